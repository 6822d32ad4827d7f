//! The receiving side of a channel: the socket, the spill batch being read, and the loop that
//! reads frames, follows redirects and settles the shared counters.

use std::io;
use std::marker::PhantomData;
use std::ops::Range;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;

use super::frame::{self, Incoming, SMALL_COST};
use super::gauge::{Asleep, Gauge};
use super::ring::RingReader;
use crate::error::{IoFailure, RecvError};
use crate::lifetime::ConnectionLeases;
use crate::sys::Socket;
pub(super) use crate::sys::Wait;
use crate::sys::{descriptor_limit, near_descriptor_limit};
use crate::wire;

/// What a receiver reads from: its socket, the spill batch a redirect pointed it to (read
/// to its end first), and its senders' rings.
pub(super) struct Inbox<T> {
    pub(super) main: Arc<Socket>,
    pub(super) spill: Option<Arc<Socket>>,
    /// The rings this channel's sending processes introduced (`ring.rs`).
    pub(super) rings: Vec<RingReader>,
    /// The ring to look at first (they take turns).
    next_ring: usize,
    /// What frames read from the socket cost, not yet given back to the shared counters: given
    /// back an eighth of the limit at a time, so that the receiver does not touch memory the
    /// senders write on every frame. The counters then show at most that much more than is
    /// on the socket; when the socket is empty they show less than a quarter of the limit,
    /// which is all a waiting feeder asks (`Gauge::nearly_drained`).
    unsettled: u64,
    /// Where frames are read into (made once: a receive allocates nothing for its frame).
    buf: Vec<u8>,
    /// Where a ring's entry is copied to before it is decoded.
    entry: Vec<u8>,
    /// A frame read from the socket while a ring held messages that may have come before it:
    /// delivered once the rings are empty (no sender writes to a ring meanwhile, as the frame
    /// is counted read only when it is delivered). Its bytes stay in `buf`.
    stash: Option<Raw>,
    /// The connection leases this channel's senders introduced (`src/lifetime/connection.rs`).
    pub(super) leases: Arc<ConnectionLeases>,
    _message: PhantomData<fn() -> T>,
}

/// What one look found.
enum Look<T> {
    Got(Result<T, Missing>),
    /// A frame that was not a message: there may be more.
    Again,
    Nothing,
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
    /// Wait for this socket to become readable, with the receiver's sleep announced while the
    /// guard lives (so that a message written to a ring meanwhile wakes the socket).
    Wait(Arc<Socket>, Option<Asleep>),
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

/// A frame as it arrived: where its bytes lie in the receive buffer, and its descriptors.
type Raw = (Range<usize>, Vec<OwnedFd>);

/// Receives one frame's bytes and descriptors.
fn receive_raw(socket: &Socket, buf: &mut [u8], wait: Wait) -> Result<Raw, Missing> {
    let failed = |e: RecvError| Missing::Failed(checked(e));
    match socket.recv_in(buf, wait) {
        Ok(Some(raw)) => Ok(raw),
        Ok(None) => Err(Missing::Failed(RecvError::Disconnected)),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Err(Missing::Empty),
        Err(e) if e.kind() == io::ErrorKind::InvalidData => Err(failed(RecvError::Malformed(e.to_string()))),
        Err(e) if matches!(e.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::NotConnected) => {
            Err(Missing::Failed(RecvError::Disconnected))
        }
        Err(e) => Err(failed(RecvError::Io(IoFailure::from(e)))),
    }
}

/// Reads a frame that arrived: its leases adopted, its message decoded.
fn parse<T: DeserializeOwned>(
    buf: &[u8],
    (range, fds): Raw,
    leases: &Arc<ConnectionLeases>,
) -> Result<Incoming<T>, Missing> {
    frame::read(&buf[range], fds, Some(leases)).map_err(|e| Missing::Failed(checked(RecvError::Malformed(e))))
}

/// How long a receive that may wait looks for a message without waiting first: 50 us where at
/// least 2 processors run (a spinning receiver then leaves the sender one), none on one;
/// `CUDA_MP_SPIN_US` (microseconds, 0 for none) sets it.
fn spin() -> Duration {
    static SPIN: OnceLock<Duration> = OnceLock::new();
    *SPIN.get_or_init(|| {
        let set = std::env::var("CUDA_MP_SPIN_US").ok().and_then(|v| v.trim().parse::<u64>().ok());
        let processors = std::thread::available_parallelism().map_or(1, |n| n.get());
        Duration::from_micros(set.unwrap_or(if processors >= 2 { 50 } else { 0 }))
    })
}

/// While spinning, a receiver asks the kernel about its socket only every so many looks (the
/// shared counters say when a frame of ours is unread): often enough to see a foreign frame
/// or the last sender's close soon.
const KERNEL_LOOK_EVERY: u32 = 64;

/// Messages this process received from rings (for the tests).
pub(super) static RING_MESSAGES: AtomicU64 = AtomicU64::new(0);

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

    /// The stashed frame's bytes and descriptors, to send with the receiving end (the
    /// descriptors stay here until the message that carries them has been sent).
    pub(super) fn stashed(&self) -> Option<(Vec<u8>, Vec<std::os::fd::BorrowedFd<'_>>)> {
        let (range, fds) = self.stash.as_ref()?;
        Some((self.buf[range.clone()].to_vec(), fds.iter().map(|fd| fd.as_fd()).collect()))
    }

    /// A stashed frame that came with the receiving end.
    pub(super) fn restash(&mut self, bytes: &[u8], fds: Vec<OwnedFd>) {
        let len = bytes.len().min(self.buf.len());
        self.buf[..len].copy_from_slice(&bytes[..len]);
        self.stash = Some((0..len, fds));
    }

    /// True when a ring holds a message.
    fn rings_hold_any(&self) -> bool {
        self.rings.iter().any(RingReader::has_entries)
    }
}

impl<T: DeserializeOwned> Inbox<T> {
    pub(super) fn new(main: Arc<Socket>, leases: Arc<ConnectionLeases>) -> Inbox<T> {
        Inbox {
            main,
            spill: None,
            rings: Vec::new(),
            next_ring: 0,
            unsettled: 0,
            buf: vec![0; frame::BUFFER],
            entry: Vec::new(),
            stash: None,
            leases,
            _message: PhantomData,
        }
    }

    /// Receives the next message: from the spill batch while there is one, else from the
    /// rings and the socket, in order, following redirects. A receive that may wait looks
    /// without waiting first for up to [`spin`], then announces its sleep and waits for the
    /// socket.
    pub(super) fn receive(&mut self, gauge: &Gauge, wait: Wait) -> Result<T, Missing> {
        let spin_until = match (wait, spin()) {
            (_, spin) if spin.is_zero() => None,
            (Wait::Not, _) => None,
            (Wait::Forever, spin) => Some(Instant::now() + spin),
            (Wait::Until(deadline), spin) => Some(deadline.min(Instant::now() + spin)),
        };
        let mut looks = 0u32;
        loop {
            if self.spill.is_some() {
                match self.next_of_spill(gauge, wait) {
                    Some(got) => return got,
                    None => continue,
                }
            }
            let kernel = looks.is_multiple_of(KERNEL_LOOK_EVERY);
            looks = looks.wrapping_add(1);
            if let Some(got) = self.look(gauge, kernel) {
                return got;
            }
            if self.spill.is_some() {
                continue;
            }
            if spin_until.is_some_and(|end| Instant::now() < end) {
                std::hint::spin_loop();
                continue;
            }
            if matches!(wait, Wait::Not) {
                if !kernel {
                    // A try looks at the kernel once at least.
                    looks = 0;
                    continue;
                }
                return Err(Missing::Empty);
            }
            // Announced before the last look: a ring written after it wakes the socket.
            let asleep = gauge.asleep();
            if let Some(got) = self.look(gauge, true) {
                return got;
            }
            if self.spill.is_some() {
                continue;
            }
            let ready = crate::sys::wait_readable(&[self.main.as_fd()], wait)
                .map_err(|e| Missing::Failed(RecvError::Io(IoFailure::from(e))))?;
            drop(asleep);
            if !ready[0] {
                return Err(Missing::Empty);
            }
            looks = 0;
        }
    }

    /// One frame of the spill batch being read: `None` when the batch ended (the receiver goes
    /// back to its socket).
    fn next_of_spill(&mut self, gauge: &Gauge, wait: Wait) -> Option<Result<T, Missing>> {
        let spill = self.spill.as_ref()?;
        match receive_raw(spill, &mut self.buf, wait).and_then(|raw| parse(&self.buf, raw, &self.leases)) {
            Ok(Incoming::Message { value, .. }) => {
                gauge.free_place();
                Some(value.map_err(|m| Missing::Failed(checked(RecvError::Malformed(m)))))
            }
            Ok(Incoming::Redirect(_) | Incoming::Ring(_) | Incoming::Wake) => Some(Err(Missing::Failed(
                RecvError::Malformed("a spilled batch holds a frame that only a channel's socket may".into()),
            ))),
            Err(Missing::Failed(RecvError::Disconnected)) => {
                self.spill = None;
                None
            }
            Err(missing) => Some(Err(missing)),
        }
    }

    /// One look that does not wait, at the rings and the socket. `kernel` asks the kernel
    /// about the socket even when the counters say no frame of ours is unread (a foreign frame,
    /// the last sender's close). `None`: nothing now, or a frame that was not a message (a
    /// redirect, a ring, a wake).
    ///
    /// Why the order holds: a sender writes to its ring only when every frame on the socket has
    /// been read (`Outbox::try_ring`), so a frame read when the rings are empty came before
    /// anything its sender puts in its ring later; and a frame read while a ring holds
    /// messages (which may have come before it: written before it, read after) waits in the
    /// stash, not yet counted read, until the rings are empty; no sender writes to a ring
    /// meanwhile.
    fn look(&mut self, gauge: &Gauge, kernel: bool) -> Option<Result<T, Missing>> {
        loop {
            match self.look_once(gauge, kernel) {
                Look::Got(got) => return Some(got),
                Look::Nothing => return None,
                // A frame that was not a message: look again at once (in a batch, it may be).
                Look::Again if self.spill.is_some() => return None,
                Look::Again => {}
            }
        }
    }

    fn look_once(&mut self, gauge: &Gauge, kernel: bool) -> Look<T> {
        if let Some(got) = self.next_of_rings(gauge) {
            return Look::Got(got);
        }
        let raw = match self.stash.take() {
            Some(raw) => raw,
            None => {
                if !kernel && gauge.socket_read_up() {
                    return Look::Nothing;
                }
                match receive_raw(&self.main, &mut self.buf, Wait::Not) {
                    Ok(raw) if self.rings_hold_any() => {
                        self.stash = Some(raw);
                        return self.next_of_rings(gauge).map_or(Look::Again, Look::Got);
                    }
                    Ok(raw) => raw,
                    Err(Missing::Empty) => return Look::Nothing,
                    // The last sender is gone: what its rings still hold comes first.
                    Err(Missing::Failed(RecvError::Disconnected)) => {
                        return Look::Got(
                            self.next_of_rings(gauge).unwrap_or(Err(Missing::Failed(RecvError::Disconnected))),
                        )
                    }
                    Err(missing) => return Look::Got(Err(missing)),
                }
            }
        };
        gauge.frame_read();
        match parse(&self.buf, raw, &self.leases) {
            Ok(Incoming::Message { cost, value }) => {
                self.settle(gauge, cost);
                gauge.free_place();
                Look::Got(value.map_err(|m| Missing::Failed(checked(RecvError::Malformed(m)))))
            }
            Ok(Incoming::Redirect(batch)) => {
                self.settle(gauge, SMALL_COST);
                self.spill = Some(Arc::new(batch));
                Look::Again
            }
            Ok(Incoming::Ring(ring)) => {
                self.settle(gauge, SMALL_COST);
                // Rings whose writers are gone, read to their end, go first.
                self.rings.retain(|r| !r.writer_gone() || r.has_entries());
                self.rings.push(ring);
                Look::Again
            }
            Ok(Incoming::Wake) => {
                self.settle(gauge, SMALL_COST);
                Look::Again
            }
            Err(missing) => Look::Got(Err(missing)),
        }
    }

    /// The next message of a ring, the rings taking turns. A ring that does not add up is
    /// dropped (its writer's later messages are lost) and reported as a malformed message.
    fn next_of_rings(&mut self, gauge: &Gauge) -> Option<Result<T, Missing>> {
        let n = self.rings.len();
        for k in 0..n {
            let i = (self.next_ring + k) % n;
            match self.rings[i].pop(&mut self.entry) {
                Ok(false) => continue,
                Ok(true) => {
                    RING_MESSAGES.fetch_add(1, Ordering::Relaxed);
                    self.next_ring = i + 1;
                    gauge.free_place();
                    let value = wire::decode_on(&self.entry, Vec::new(), Some(&*self.leases));
                    return Some(value.map_err(|m| Missing::Failed(checked(RecvError::Malformed(m)))));
                }
                Err(why) => {
                    self.rings.remove(i);
                    return Some(Err(Missing::Failed(RecvError::Malformed(why))));
                }
            }
        }
        None
    }

    /// Whether a receive would return at once, or which descriptor to wait on. A spill batch
    /// read to its end is left here (which loses nothing).
    pub(super) fn readiness(&mut self, gauge: &Gauge) -> Option<Readiness> {
        if let Some(spill) = &self.spill {
            if spill.pending_bytes() > 0 {
                return Some(Readiness::Ready);
            }
            if !spill.peer_closed() {
                return Some(Readiness::Wait(spill.clone(), None));
            }
            // Read to its end and closed.
            self.spill = None;
        }
        if self.stash.is_some() || self.rings_hold_any() {
            return Some(Readiness::Ready);
        }
        let asleep = gauge.asleep();
        if self.rings_hold_any() {
            return Some(Readiness::Ready);
        }
        Some(Readiness::Wait(self.main.clone(), Some(asleep)))
    }
}
