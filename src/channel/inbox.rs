//! The receiving side of a channel: the socket, the spill batch being read, and the loop that
//! reads frames, follows redirects and settles the shared counters.

use std::io;
use std::marker::PhantomData;
use std::sync::Arc;

use serde::de::DeserializeOwned;

use super::frame::{self, Incoming, SMALL_COST};
use super::gauge::Gauge;
use crate::error::{IoFailure, RecvError};
use crate::lifetime::ConnectionLeases;
use crate::sys::Socket;
pub(super) use crate::sys::Wait;
use crate::sys::{descriptor_limit, near_descriptor_limit};

/// What a receiver reads from: its socket, and the spill batch a redirect pointed it to (read
/// to its end first).
pub(super) struct Inbox<T> {
    pub(super) main: Arc<Socket>,
    pub(super) spill: Option<Arc<Socket>>,
    /// What frames read from the socket cost, not yet given back to the shared counters: given
    /// back an eighth of the limit at a time, so that the receiver does not touch memory the
    /// senders write on every frame. The counters then show at most that much more than is
    /// on the socket; when the socket is empty they show less than a quarter of the limit,
    /// which is all a waiting feeder asks (`Gauge::nearly_drained`).
    unsettled: u64,
    /// Where frames are read into (made once: a receive allocates nothing for its frame).
    buf: Vec<u8>,
    /// The connection leases this channel's senders introduced (`src/lifetime/connection.rs`).
    pub(super) leases: Arc<ConnectionLeases>,
    _message: PhantomData<fn() -> T>,
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
    /// Wait for this socket to become readable.
    Wait(Arc<Socket>),
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

/// Reads one frame.
fn read<T: DeserializeOwned>(
    socket: &Socket,
    buf: &mut [u8],
    leases: &Arc<ConnectionLeases>,
    wait: Wait,
) -> Result<Incoming<T>, Missing> {
    let failed = |e: RecvError| Missing::Failed(checked(e));
    match socket.recv_in(buf, wait) {
        Ok(Some((range, fds))) => {
            frame::read(&buf[range], fds, Some(leases)).map_err(|e| failed(RecvError::Malformed(e)))
        }
        Ok(None) => Err(Missing::Failed(RecvError::Disconnected)),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Err(Missing::Empty),
        Err(e) if e.kind() == io::ErrorKind::InvalidData => Err(failed(RecvError::Malformed(e.to_string()))),
        Err(e) if matches!(e.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::NotConnected) => {
            Err(Missing::Failed(RecvError::Disconnected))
        }
        Err(e) => Err(failed(RecvError::Io(IoFailure::from(e)))),
    }
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
    pub(super) fn new(main: Arc<Socket>, leases: Arc<ConnectionLeases>) -> Inbox<T> {
        Inbox { main, spill: None, unsettled: 0, buf: vec![0; frame::BUFFER], leases, _message: PhantomData }
    }

    /// Receives the next message: from the spill batch while there is one, else from the
    /// socket, following redirects.
    pub(super) fn receive(&mut self, gauge: &Gauge, wait: Wait) -> Result<T, Missing> {
        loop {
            let from_spill = self.spill.is_some();
            let socket = match &self.spill {
                Some(spill) => spill,
                None => &self.main,
            };
            match read(socket, &mut self.buf, &self.leases, wait) {
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
                    self.spill = Some(Arc::new(batch));
                }
                Err(Missing::Failed(RecvError::Disconnected)) if from_spill => self.spill = None,
                Err(missing) => return Err(missing),
            }
        }
    }

    /// Whether a receive would return at once, or which descriptor to wait on. A spill batch
    /// read to its end is left here (which loses nothing).
    pub(super) fn readiness(&mut self) -> Option<Readiness> {
        if let Some(spill) = &self.spill {
            if spill.pending_bytes() > 0 {
                return Some(Readiness::Ready);
            }
            if !spill.peer_closed() {
                return Some(Readiness::Wait(spill.clone()));
            }
            // Read to its end and closed.
            self.spill = None;
        }
        Some(Readiness::Wait(self.main.clone()))
    }
}
