//! The receiving side of a channel: the socket, the spill batch being read, and the loop that
//! reads frames, follows redirects and settles the shared counters.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ipc_channel::ipc::{IpcReceiver, OpaqueIpcReceiver};
use ipc_channel::{IpcError, TryRecvError as IpcTryRecvError};
use serde::de::DeserializeOwned;

use super::frame::{Incoming, SMALL_COST};
use super::gauge::Gauge;
use super::sys;
use crate::error::RecvError;
use crate::os::{catch_quietly, descriptor_limit, near_descriptor_limit};
use crate::wire;

/// One socket frames are read from, with our copy of its descriptor (to wait on it without
/// holding the receiver, and to ask how much it holds), made when first needed.
pub(super) struct Source<T> {
    pub(super) rx: IpcReceiver<Incoming<T>>,
    fd: Option<Arc<OwnedFd>>,
}

impl<T: DeserializeOwned> Source<T> {
    /// A source whose descriptor is copied now.
    pub(super) fn watched(rx: IpcReceiver<Incoming<T>>) -> Source<T> {
        let mut source = Source { rx, fd: None };
        source.fd();
        source
    }

    /// A source whose descriptor is copied only if something waits on it (a spill batch is
    /// usually read without waiting).
    pub(super) fn unwatched(rx: OpaqueIpcReceiver) -> Source<T> {
        Source { rx: rx.to(), fd: None }
    }

    /// Our copy of the socket's descriptor (`None`: it cannot be found).
    pub(super) fn fd(&mut self) -> Option<Arc<OwnedFd>> {
        if self.fd.is_none() {
            self.fd = sys::socket_copy(&format!("{:?}", self.rx)).map(Arc::new);
        }
        self.fd.clone()
    }
}

/// What a receiver reads from: its socket, and the spill batch a redirect pointed it to (read
/// to its end first).
pub(super) struct Inbox<T> {
    pub(super) main: Source<T>,
    pub(super) spill: Option<Source<T>>,
    /// What frames read from the socket cost, not yet given back to the shared counters: given
    /// back an eighth of the limit at a time, so that the receiver does not touch memory the
    /// senders write on every frame. The counters then show at most that much more than is
    /// on the socket; when the socket is empty they show less than a quarter of the limit,
    /// which is all a waiting feeder asks (`Gauge::nearly_drained`).
    unsettled: u64,
}

/// How long a receive may wait.
#[derive(Clone, Copy)]
pub(super) enum Wait {
    Forever,
    Until(Instant),
    Not,
}

/// Why a receive returned no message.
pub(super) enum Missing {
    /// Nothing arrived within the wait.
    Empty,
    /// The receive failed.
    Failed(RecvError),
}

/// Where a receiver waits for its next frame.
pub(super) enum Readiness {
    /// A receive would not wait.
    Ready,
    /// Wait for this descriptor to become readable.
    Wait(Arc<OwnedFd>),
}

fn recv_error(e: IpcError) -> RecvError {
    match e {
        IpcError::Disconnected => RecvError::Disconnected,
        IpcError::Io(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::NotConnected
            ) =>
        {
            RecvError::Disconnected
        }
        IpcError::Io(e) => RecvError::Io(e.to_string()),
        IpcError::SerializationError(e) => {
            RecvError::Malformed(wire::take_failure().unwrap_or_else(|| format!("undecodable message ({e:?})")))
        }
    }
}

/// A malformed message, named as descriptor exhaustion when that is why it failed (the kernel
/// drops descriptors a full process cannot take).
fn checked(e: RecvError) -> RecvError {
    match e {
        RecvError::Malformed(_) | RecvError::Io(_) if near_descriptor_limit() => {
            RecvError::OutOfDescriptors { limit: descriptor_limit() }
        }
        other => other,
    }
}

/// Reads one frame with a fresh decoding context, turning a panic inside the transport's
/// decoder into an error.
fn read<T: DeserializeOwned>(rx: &IpcReceiver<Incoming<T>>, wait: Wait) -> Result<Incoming<T>, Missing> {
    wire::decode_begin();
    let result = catch_quietly(|| match wait {
        Wait::Forever => rx.recv().map_err(|e| Missing::Failed(recv_error(e))),
        Wait::Until(deadline) => {
            // The transport waits whole milliseconds, rounded down: round up, so that a
            // receive never gives up before its deadline.
            let left = deadline.saturating_duration_since(Instant::now());
            let left = Duration::from_millis(left.as_nanos().div_ceil(1_000_000).min(u64::MAX as u128) as u64);
            rx.try_recv_timeout(left).map_err(|e| match e {
                IpcTryRecvError::Empty => Missing::Empty,
                IpcTryRecvError::IpcError(e) => Missing::Failed(recv_error(e)),
            })
        }
        Wait::Not => rx.try_recv_timeout(Duration::ZERO).map_err(|e| match e {
            IpcTryRecvError::Empty => Missing::Empty,
            IpcTryRecvError::IpcError(e) => Missing::Failed(recv_error(e)),
        }),
    })
    .unwrap_or_else(|_| {
        Err(Missing::Failed(RecvError::Malformed("message refers to descriptors it does not carry".into())))
    });
    wire::decode_end();
    result.map_err(|m| match m {
        Missing::Failed(e) => Missing::Failed(checked(e)),
        empty => empty,
    })
}

impl<T> Inbox<T> {
    /// Counts a frame read from the socket, giving the costs back in eighths of the limit.
    fn settle(&mut self, gauge: &Gauge, cost: u64) {
        self.unsettled += cost;
        if self.unsettled >= gauge.limit() / 8 {
            self.settle_all(gauge);
        }
    }

    /// Gives back every cost not yet given back (before the receiver leaves this process).
    pub(super) fn settle_all(&mut self, gauge: &Gauge) {
        gauge.release(std::mem::take(&mut self.unsettled));
    }
}

impl<T: DeserializeOwned> Inbox<T> {
    pub(super) fn new(main: IpcReceiver<Incoming<T>>) -> Inbox<T> {
        Inbox { main: Source::watched(main), spill: None, unsettled: 0 }
    }

    /// Receives the next message: from the spill batch while there is one, else from the
    /// socket, following redirects.
    pub(super) fn receive(&mut self, gauge: &Gauge, wait: Wait) -> Result<T, Missing> {
        loop {
            let from_spill = self.spill.is_some();
            let rx = match &self.spill {
                Some(spill) => &spill.rx,
                None => &self.main.rx,
            };
            match read(rx, wait) {
                Ok(Incoming::Message { cost, value }) => {
                    if !from_spill {
                        self.settle(gauge, cost);
                    }
                    gauge.free_place();
                    return value.map_err(|m| Missing::Failed(checked(RecvError::Malformed(m))));
                }
                Ok(Incoming::Redirect(batch)) => {
                    if from_spill {
                        return Err(Missing::Failed(RecvError::Malformed(
                            "a spilled batch refers to another batch".into(),
                        )));
                    }
                    self.settle(gauge, SMALL_COST);
                    self.spill = Some(Source::unwatched(batch));
                }
                Err(Missing::Failed(RecvError::Disconnected)) if from_spill => self.spill = None,
                Err(missing) => return Err(missing),
            }
        }
    }

    /// Whether a receive would return at once, or which descriptor to wait on. A spill batch
    /// read to its end is left here (which loses nothing).
    pub(super) fn readiness(&mut self) -> Option<Readiness> {
        if let Some(spill) = &mut self.spill {
            let fd = spill.fd()?;
            if sys::pending_bytes(&fd) > 0 {
                return Some(Readiness::Ready);
            }
            if !sys::peer_closed(&fd) {
                return Some(Readiness::Wait(fd));
            }
            // Read to its end and closed.
            self.spill = None;
        }
        self.main.fd().map(Readiness::Wait)
    }
}
