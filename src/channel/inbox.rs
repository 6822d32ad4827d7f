//! The receiving side of a channel: the socket, the spill batch being read, and the loop that
//! reads frames, follows redirects and settles the shared counters.

use std::io;
use std::ops::{Deref, DerefMut};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, TryLockError};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;

use super::flavor::Watched;
use super::frame::{self, Incoming, Order};
use super::gauge::{Asleep, Gauge};
use super::ring::{self, RingReader};
use crate::error::{IoFailure, RecvError};
use crate::lifetime::ConnectionLeases;
pub(super) use crate::sys::Wait;
use crate::sys::{Lost, Received, Socket};
use crate::sys::{descriptor_limit, near_descriptor_limit};
use crate::wire;

/// What a receiver reads from: its socket, the spill batch a redirect pointed it to (read
/// to its end first), and its senders' rings.
pub(super) struct Inbox {
    pub(super) main: Arc<Socket>,
    pub(super) spill: Option<Arc<Socket>>,
    /// The rings this channel's sending processes introduced (`ring.rs`).
    pub(super) rings: Vec<RingReader>,
    /// The ring to look at first (they take turns).
    next_ring: usize,
    /// Messages taken from rings since the socket was last read: past [`RING_STREAK`], the
    /// socket's turn comes first (README.md, "Rings", Order).
    ring_streak: u32,
    /// What frames read from the socket cost, not yet given back to the shared counters (an
    /// eighth of the limit at a time: README.md, "Why a send used to wait"); below the quarter
    /// that a waiting feeder asks of an empty socket (`Gauge::nearly_drained`).
    unsettled: u64,
    /// Where frames are read into (made once: a receive allocates nothing for its frame).
    buf: Vec<u8>,
    /// Where a ring's entry is copied to before it is decoded.
    entry: Vec<u8>,
    /// A failure met while taking wake frames off the socket (`take_wakes`), for the next
    /// receive to report.
    failure: Option<RecvError>,
    /// A frame that came before its turn (its sender's ring holds messages numbered before
    /// it): delivered after them. Its bytes stay in `buf`.
    stash: Option<Stashed>,
    /// The connection leases this channel's senders introduced (`src/lifetime/connection.rs`).
    pub(super) leases: Arc<ConnectionLeases>,
    /// Leases of senders found gone, to forget once everything was read (`read_everything`).
    leases_gone: Vec<crate::lifetime::ConnectionKey>,
    /// How many owners the segment table had been told gone when the current receive began
    /// (`KnownSegments::forget_gone`).
    told_gone: u64,
    /// What a receiver that never finds its channel empty found gone, waiting for the socket
    /// and the rings to be read past it (`sweep_busy`).
    busy_sweep: Option<BusySweep>,
    /// Messages delivered since `busy_sweep` was last looked at.
    delivered: u32,
    /// The shared counters' `read` once the redirect of the batch being read (`spill`) was
    /// read: a batch handed on after a sweep looked holds no frame written before it.
    spill_read_at: u32,
    /// A spill batch was lost with its messages (this process was out of descriptors): a
    /// ring whose next message is missing and nothing else to read steps over it.
    pub(super) gaps: bool,
    /// What the sender of a named connection said it sends, when that is not `T`: named in
    /// the error of a message that does not decode.
    pub(super) sender_sends: Option<String>,
    /// How long a receive of this end spins before it sleeps, in nanoseconds ([`PROCESS_SPIN`]:
    /// the process's, [`spin`]); set through the [`InboxLock`] without taking the inbox, which
    /// a receiving thread may hold while it sleeps.
    spin: Arc<AtomicU64>,
}

/// [`Inbox::spin`]'s value for the process's spin ([`spin`]).
const PROCESS_SPIN: u64 = u64::MAX;

/// The spin an [`Inbox::spin`] cell says.
fn spin_of(cell: &AtomicU64) -> Duration {
    match cell.load(Ordering::Relaxed) {
        PROCESS_SPIN => spin(),
        nanos => Duration::from_nanos(nanos),
    }
}

/// What a sweep of a receiver that is never idle found gone, and where the socket and the
/// rings stood then (README.md, "Rings", Order).
struct BusySweep {
    /// The frames our senders had counted as written to the socket after it looked: once the
    /// receiver has read as many, every frame written before it has been read.
    written: u32,
    /// The socket (and the batches its frames handed on) has been read past `written`.
    socket_read: bool,
    /// Connection leases whose owners were gone.
    leases: Vec<crate::lifetime::ConnectionKey>,
    /// How many owners the segment table had been told gone.
    told_gone: u64,
    /// The rings whose writers were gone.
    rings_gone: Vec<u64>,
    /// Every ring's id and how far its writer had written: a gone sender's entries were all
    /// written by then, whether or not its ring's pipe was seen closed.
    tails: Vec<(u64, u64)>,
}

/// A frame read before its turn.
struct Stashed {
    raw: Received,
    /// Read from the channel's socket (not a batch): its cost is settled when delivered.
    main: bool,
    /// Its place in its sender's order (`None`: delivered next, whatever the rings hold).
    order: Option<Order>,
    /// The shared counters' `read` once it was read (for a batch's frame, once the batch's
    /// redirect was): a frame read after a busy sweep looked is none it waits for.
    read_at: u32,
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

impl Missing {
    /// As a receive's error, `empty` when nothing arrived.
    pub(super) fn or<E: From<RecvError>>(self, empty: E) -> E {
        if let Missing::Failed(e) = self { e.into() } else { empty }
    }
}

/// Where a receiver waits for its next frame.
pub(super) enum Readiness {
    /// A receive would not wait.
    Ready,
    /// Wait for this descriptor to become readable. Without a guard, readable means a receive
    /// would not wait; with one, only that it is time to look again.
    Wait(Watched, Option<Announced>),
}

/// What a wait without the inbox keeps while it lasts.
pub(super) enum Announced {
    /// The receiver's sleep, announced (so that a message written to a ring meanwhile wakes
    /// the socket, which is what the wait watches).
    Asleep(#[allow(dead_code)] Asleep),
    /// A wait for the thread that holds the inbox to let it go (the wait watches the bell it
    /// rings then).
    Holder(#[allow(dead_code)] HolderWait),
}

/// The inbox of a receiving end, held by the thread that receives; a waiter that finds it held
/// is rung when the holder lets go (README.md, "Select and async receives").
pub(super) struct InboxLock {
    inbox: Mutex<Inbox>,
    /// Bells of the threads waiting for the holder to let go, rung and forgotten when it does.
    bells: Mutex<Vec<Arc<OwnedFd>>>,
    /// How many there are, read without the lock by every holder that lets go.
    waiting: AtomicUsize,
    /// The inbox's spin ([`Inbox::spin`]), to set while another thread receives.
    spin: Arc<AtomicU64>,
}

impl InboxLock {
    pub(super) fn new(inbox: Inbox) -> InboxLock {
        let spin = inbox.spin.clone();
        InboxLock { inbox: Mutex::new(inbox), bells: Mutex::new(Vec::new()), waiting: AtomicUsize::new(0), spin }
    }

    /// Sets how long the inbox's receives spin before they sleep (`None`: the process's,
    /// [`spin`]), for the receives that begin after this.
    pub(super) fn set_spin(&self, spin: Option<Duration>) {
        let nanos = spin
            .map_or(PROCESS_SPIN, |s| u64::try_from(s.as_nanos()).unwrap_or(PROCESS_SPIN - 1).min(PROCESS_SPIN - 1));
        self.spin.store(nanos, Ordering::Relaxed);
    }

    /// How long the inbox's receives spin before they sleep.
    pub(super) fn spin(&self) -> Duration {
        spin_of(&self.spin)
    }

    pub(super) fn lock(&self) -> InboxGuard<'_> {
        InboxGuard { guard: Some(self.inbox.lock().unwrap_or_else(|p| p.into_inner())), lock: self }
    }

    /// The inbox, unless another thread holds it.
    pub(super) fn try_lock(&self) -> Option<InboxGuard<'_>> {
        let guard = match self.inbox.try_lock() {
            Ok(inbox) => inbox,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        Some(InboxGuard { guard: Some(guard), lock: self })
    }

    /// For a thread that found the inbox held: a bell the holder rings when it lets go (at
    /// once if it let go meanwhile), and the registration that keeps it, to watch instead of
    /// the socket. `None` where no bell can be made (no descriptor left).
    pub(super) fn wait_for_holder(self: &Arc<Self>) -> Option<(Watched, Announced)> {
        let bell = Arc::new(crate::sys::bell().ok()?);
        self.bells.lock().unwrap_or_else(|p| p.into_inner()).push(bell.clone());
        self.waiting.fetch_add(1, Ordering::SeqCst);
        // Against a holder that let go before the count went up (it fences between letting go
        // and reading the count): the inbox is free now, so look at once. Taken as a holder
        // (whose letting go rings every bell, this one's too), so that a thread that found it
        // held just now is not left waiting.
        std::sync::atomic::fence(Ordering::SeqCst);
        drop(self.try_lock());
        let wait = HolderWait { lock: self.clone(), bell: bell.clone() };
        Some((bell as Watched, Announced::Holder(wait)))
    }

    fn holder_let_go(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        let bells = std::mem::take(&mut *self.bells.lock().unwrap_or_else(|p| p.into_inner()));
        for bell in bells {
            crate::sys::ring(&bell);
        }
    }
}

/// The inbox held; letting it go rings the threads waiting for it.
pub(super) struct InboxGuard<'a> {
    guard: Option<MutexGuard<'a, Inbox>>,
    lock: &'a InboxLock,
}

impl Deref for InboxGuard<'_> {
    type Target = Inbox;
    fn deref(&self) -> &Inbox {
        self.guard.as_ref().expect("held until dropped")
    }
}

impl DerefMut for InboxGuard<'_> {
    fn deref_mut(&mut self) -> &mut Inbox {
        self.guard.as_mut().expect("held until dropped")
    }
}

impl Drop for InboxGuard<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        self.lock.holder_let_go();
    }
}

/// A thread's wait for the holder of an inbox to let go, registered while it lives.
pub(super) struct HolderWait {
    lock: Arc<InboxLock>,
    bell: Arc<OwnedFd>,
}

impl Drop for HolderWait {
    fn drop(&mut self) {
        self.lock.bells.lock().unwrap_or_else(|p| p.into_inner()).retain(|b| !Arc::ptr_eq(b, &self.bell));
        self.lock.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A malformed message, named as descriptor exhaustion when that is why it failed (the kernel
/// drops descriptors a full process cannot take).
fn checked(e: RecvError) -> RecvError {
    match e {
        RecvError::Malformed(_) | RecvError::Io(_) if near_descriptor_limit() => {
            let limit = descriptor_limit();
            tracing::warn!(limit, "a message was cut short: this process is at its limit of file descriptors");
            RecvError::OutOfDescriptors { limit }
        }
        other => other,
    }
}

/// Whether the messages before `ring`'s first entry (numbered past its next) will never come:
/// its writer is gone, or a batch was lost (`gaps`), and nothing is left to read that could
/// hold them.
fn gap_is_lost(ring: &RingReader, gaps: bool, spill: &Option<Arc<Socket>>, main: &Socket) -> bool {
    (ring.writer_gone() || gaps) && spill.is_none() && main.pending_bytes() == 0
}

/// Drops the rings of writers gone that `read_out` says were read to their end, giving back
/// the places of the messages their writers numbered and never sent.
fn drop_rings(rings: &mut Vec<RingReader>, gauge: &Gauge, read_out: impl Fn(&RingReader) -> bool) {
    rings.retain(|r| {
        let gone = read_out(r);
        if gone {
            gauge.free_places(r.never_delivered());
        }
        !gone
    });
}

/// Receives one frame's bytes and descriptors.
fn receive_raw(socket: &Socket, buf: &mut [u8], wait: Wait) -> Result<Received, Missing> {
    let failed = |e: RecvError| Missing::Failed(checked(e));
    match socket.recv_in(buf, wait) {
        Ok(Some(raw)) => {
            crate::sys::kill_point("received");
            Ok(raw)
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

/// How long a receive that may wait looks without waiting first, and a sender at a full ring
/// for room: 50 us, none on one processor; `CUDA_MP_SPIN_US` (microseconds, 0 for none) sets
/// it (README.md, "Why a send used to wait").
pub(super) fn spin() -> Duration {
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

/// Looks a spinning receiver makes before it lets other threads run between looks: a
/// receiver that spins without yielding holds a processor that its sender, or another thread
/// of the pipeline, may need (a queue's dispatcher runs several threads that each wait).
const YIELD_AFTER: u32 = 256;

/// Messages from rings in a row before the socket's turn.
const RING_STREAK: u32 = 16;

/// How often (in messages delivered) a receiver looks for senders gone without waiting for
/// its channel to be empty (`Inbox::sweep_busy`).
pub(super) const BUSY_SWEEP_EVERY: u32 = 256;

/// Messages this process received from rings (for the tests).
pub(super) static RING_MESSAGES: AtomicU64 = AtomicU64::new(0);

impl Inbox {
    /// Counts a frame read from the socket, giving the costs back in eighths of the limit.
    fn settle(&mut self, gauge: &Gauge, cost: u64) {
        self.unsettled += cost;
        if self.unsettled >= gauge.limit / 8 {
            self.settle_all(gauge);
        }
    }

    /// Gives back every cost not yet given back (before the receiver leaves this process).
    pub(super) fn settle_all(&mut self, gauge: &Gauge) {
        gauge.release(std::mem::take(&mut self.unsettled));
    }

    /// The stashed frame's bytes and descriptors, whether it came from the socket and why it
    /// is lost if it is, to send with the receiving end (the descriptors stay here until the
    /// message has been sent).
    pub(super) fn stashed(&self) -> Option<(Vec<u8>, Vec<std::os::fd::BorrowedFd<'_>>, bool, Option<Lost>)> {
        let Stashed { raw, main, .. } = self.stash.as_ref()?;
        let fds = raw.fds.iter().map(|fd| fd.as_fd()).collect();
        Some((self.buf[raw.bytes.clone()].to_vec(), fds, *main, raw.lost.clone()))
    }

    /// A stashed frame that came with the receiving end.
    pub(super) fn restash(&mut self, bytes: &[u8], fds: Vec<OwnedFd>, main: bool, lost: Option<Lost>) {
        let len = bytes.len().min(self.buf.len());
        self.buf[..len].copy_from_slice(&bytes[..len]);
        if len > 0 {
            let order = frame::order_of(&self.buf[..len]);
            // Read before any sweep here looks (`came_with_end`).
            let read_at = 0;
            self.stash = Some(Stashed { raw: Received { bytes: 0..len, fds, lost }, main, order, read_at });
        }
    }

    pub(super) fn new(main: Arc<Socket>, leases: Arc<ConnectionLeases>) -> Inbox {
        Inbox {
            main,
            spill: None,
            rings: Vec::new(),
            next_ring: 0,
            ring_streak: 0,
            unsettled: 0,
            buf: vec![0; frame::BUFFER],
            entry: Vec::new(),
            failure: None,
            stash: None,
            leases,
            leases_gone: Vec::new(),
            told_gone: 0,
            busy_sweep: None,
            delivered: 0,
            spill_read_at: 0,
            gaps: false,
            sender_sends: None,
            spin: Arc::new(AtomicU64::new(PROCESS_SPIN)),
        }
    }

    /// Receives the next message, in its sender's order across its ring, the socket and
    /// spill batches, following redirects. A receive that may wait looks without waiting
    /// first for up to [`spin`], then announces its sleep and waits for its socket.
    pub(super) fn receive<T: DeserializeOwned>(&mut self, gauge: &Gauge, wait: Wait) -> Result<T, Missing> {
        let spin_until = match (wait, spin_of(&self.spin)) {
            (_, spin) if spin.is_zero() => None,
            (Wait::Not, _) => None,
            (Wait::Forever, spin) => Some(crate::os::instant_after(spin)),
            (Wait::Until(deadline), spin) => Some(deadline.min(crate::os::instant_after(spin))),
        };
        let mut looks = 0u32;
        self.told_gone = self.leases.segments().told_gone();
        loop {
            let kernel = looks.is_multiple_of(KERNEL_LOOK_EVERY);
            looks = looks.wrapping_add(1);
            if kernel {
                // Owners marked gone before this look: all they sent is here by now.
                self.told_gone = self.leases.segments().told_gone();
            }
            if let Some(got) = self.look(gauge, kernel) {
                return got;
            }
            if spin_until.is_some_and(|end| Instant::now() < end) {
                if looks > YIELD_AFTER {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            if matches!(wait, Wait::Not) {
                if !kernel {
                    // A try looks at the kernel once at least.
                    looks = 0;
                    continue;
                }
                self.read_everything(gauge);
                return Err(Missing::Empty);
            }
            // Announced before the last look: a ring written after it wakes the socket.
            let asleep = gauge.asleep();
            self.told_gone = self.leases.segments().told_gone();
            if let Some(got) = self.look(gauge, true) {
                return got;
            }
            self.read_everything(gauge);
            // A look reads a spill batch to its end: only the socket is left to wait on.
            let ready = crate::sys::wait_readable(&[self.main.as_fd()], wait)
                .map_err(|e| Missing::Failed(RecvError::Io(IoFailure::from(e))))?;
            drop(asleep);
            if !ready[0] {
                return Err(Missing::Empty);
            }
            looks = 0;
        }
    }

    /// A look that asked the kernel found nothing (or the end of the channel): when nothing waits
    /// in the stash, a ring or a batch either, every message of a sender that is gone has been
    /// read: the segments it introduced can go, and so can the rings of writers gone. Such a
    /// writer's messages that never came (its backlog, lost with it) give their places on a
    /// bounded channel back, unless a batch was lost for want of descriptors while its ring
    /// was read (`RingReader::never_delivered`).
    fn read_everything(&mut self, gauge: &Gauge) {
        // Leases of senders gone before the looks below: once nothing waits, every message
        // that names them was read.
        if self.leases_gone.is_empty() {
            self.leases_gone = self.leases.gone_if_due();
        }
        if !self.leases_gone.is_empty() && self.everything_read() {
            self.leases.forget(&std::mem::take(&mut self.leases_gone));
        }
        if self.nothing_waits_here() {
            self.leases.segments().forget_gone(self.told_gone);
            let main = &self.main;
            // Writer gone first, then its entries, then the socket: a frame or an entry written
            // as it went is not lost (the look that called this may predate it).
            drop_rings(&mut self.rings, gauge, |r| r.writer_gone() && !r.has_entries() && main.pending_bytes() == 0);
        }
    }

    /// What `read_everything` does for a receiver that may never find its channel empty (a
    /// saturated channel fed by workers that come and go), every [`BUSY_SWEEP_EVERY`]
    /// messages (README.md, "Rings", Order): it notes which senders are gone, how far every
    /// ring was written, and then how many frames had been written to the socket. Once that
    /// many were read (with no batch handed on before left to read, and no frame stashed),
    /// every frame those senders wrote has been delivered: what their rings lack was lost, and
    /// their rings go once empty. Once every ring has been read past where it was written,
    /// no message names their leases and segments any more.
    fn sweep_busy(&mut self, gauge: &Gauge) {
        let Some(sweep) = &mut self.busy_sweep else {
            self.start_busy_sweep(gauge, Vec::new());
            return;
        };
        if !sweep.socket_read {
            let batch_after = |read_at: u32| read_at.wrapping_sub(sweep.written) as i32 > 0;
            sweep.socket_read = gauge.frames_read_past(sweep.written)
                && (self.spill.is_none() || batch_after(self.spill_read_at))
                && self.stash.as_ref().is_none_or(|stashed| batch_after(stashed.read_at));
            if !sweep.socket_read {
                return;
            }
        }
        // Nothing more comes from the writers gone then: nothing numbered before a ring's first
        // entry, and nothing at all once it is empty.
        for ring in self.rings.iter_mut().filter(|r| sweep.rings_gone.contains(&r.id)) {
            if let Ok(Some(first)) = ring.first()
                && first > ring.next()
            {
                ring.set_next(first);
            }
        }
        drop_rings(&mut self.rings, gauge, |r| sweep.rings_gone.contains(&r.id) && !r.has_entries());
        let rings = &self.rings;
        let read_past = |&(id, tail): &(u64, u64)| rings.iter().find(|r| r.id == id).is_none_or(|r| r.read_past(tail));
        let sweep = self.busy_sweep.take().expect("looked at above");
        if !sweep.tails.iter().all(read_past) {
            // A ring waits for a message before its first entry (its writer lived when the
            // sweep looked): looked at again from here, with what this sweep found gone.
            self.start_busy_sweep(gauge, sweep.leases);
            return;
        }
        if !sweep.leases.is_empty() {
            self.leases.forget(&sweep.leases);
        }
        self.leases.segments().forget_gone(sweep.told_gone);
    }

    /// The batch and stashed frame this end came with (from another process) were read before
    /// any sweep here looks: as old as anything a sweep waits for.
    pub(super) fn came_with_end(&mut self, gauge: &Gauge) {
        let now = gauge.frames_read();
        self.spill_read_at = now;
        if let Some(stashed) = &mut self.stash {
            stashed.read_at = now;
        }
    }

    /// Notes what is gone now (and `leases` found gone before), how far every ring was
    /// written, and then the frames written to the socket.
    fn start_busy_sweep(&mut self, gauge: &Gauge, mut leases: Vec<crate::lifetime::ConnectionKey>) {
        leases.extend(self.leases.gone_if_due());
        // Those the idle path found and has not forgotten yet: forgetting twice is harmless.
        leases.extend(self.leases_gone.iter().copied());
        leases.sort_unstable_by_key(|k| (k.owner, k.key));
        leases.dedup();
        let told_gone = self.leases.segments().told_gone();
        let rings_gone = self.rings.iter().filter(|r| r.writer_gone()).map(|r| r.id).collect();
        let tails = self.rings.iter().map(|r| (r.id, r.tail())).collect();
        // Counted after the looks above: the frames of senders found gone were all counted.
        let written = gauge.frames_written();
        self.busy_sweep = Some(BusySweep { written, socket_read: false, leases, told_gone, rings_gone, tails });
    }

    /// Whether nothing waits to be read: in the stash, a ring, a batch or the socket.
    pub(super) fn everything_read(&mut self) -> bool {
        self.nothing_waits_here() && self.main.pending_bytes() == 0
    }

    /// Whether nothing waits in the stash, a ring or a batch.
    fn nothing_waits_here(&self) -> bool {
        self.stash.is_none() && self.spill.is_none() && !self.rings.iter().any(|r| r.has_entries())
    }

    /// Looks without waiting until it finds a message (or a failure) or nothing more.
    /// `kernel` asks the kernel about the socket even when the counters say no frame of ours
    /// is unread (a foreign frame, the last sender's close).
    fn look<T: DeserializeOwned>(&mut self, gauge: &Gauge, kernel: bool) -> Option<Result<T, Missing>> {
        loop {
            match self.look_once(gauge, kernel) {
                Look::Got(got) => {
                    self.delivered += 1;
                    if self.delivered >= BUSY_SWEEP_EVERY {
                        self.delivered = 0;
                        self.sweep_busy(gauge);
                    }
                    return Some(got);
                }
                Look::Again => {}
                Look::Nothing => return None,
            }
        }
    }

    /// One step, in each sending process's order (README.md, "Rings", Order).
    fn look_once<T: DeserializeOwned>(&mut self, gauge: &Gauge, kernel: bool) -> Look<T> {
        if let Some(failure) = self.failure.take() {
            return Look::Got(Err(Missing::Failed(failure)));
        }
        if let Some(stashed) = self.stash.take() {
            return self.release(gauge, stashed);
        }
        // Reading the socket first is safe at any time: each frame waits for its turn.
        let socket_turn = self.ring_streak >= RING_STREAK && self.spill.is_none() && !gauge.socket_read_up();
        if !socket_turn && let Some(got) = self.next_of_rings(gauge) {
            self.ring_streak += 1;
            return Look::Got(got);
        }
        self.ring_streak = 0;
        let (raw, main) = match self.spill.clone() {
            // A batch is complete when it is handed on: a read finds a frame or its end. One
            // found empty with its writing end still open (kept by a forger) ends there too:
            // waiting for that end would stall the channel behind it.
            Some(spill) => match receive_raw(&spill, &mut self.buf, Wait::Not) {
                Ok(raw) => (raw, false),
                Err(Missing::Failed(RecvError::Disconnected) | Missing::Empty) => {
                    self.spill = None;
                    return Look::Again;
                }
                Err(missing) => return Look::Got(Err(missing)),
            },
            None => {
                if !kernel && gauge.socket_read_up() {
                    return Look::Nothing;
                }
                match receive_raw(&self.main, &mut self.buf, Wait::Not) {
                    Ok(raw) => {
                        gauge.frame_read();
                        (raw, true)
                    }
                    // Not there yet: the rings again.
                    Err(Missing::Empty) if socket_turn => return Look::Again,
                    Err(Missing::Empty) => return Look::Nothing,
                    Err(Missing::Failed(RecvError::Disconnected)) => return Look::Got(self.at_end(gauge)),
                    Err(missing) => return Look::Got(Err(missing)),
                }
            }
        };
        if let Some(order) = frame::order_of(&self.buf[raw.bytes.clone()])
            && let Some(ring) = self.rings.iter_mut().find(|r| r.id == order.ring)
        {
            if order.number > ring.next() {
                let read_at = if main { gauge.frames_read() } else { self.spill_read_at };
                self.stash = Some(Stashed { raw, main, order: Some(order), read_at });
                return Look::Again;
            }
            if order.number == ring.next() {
                // Numbers come from the sender: wrapping, as the ring's own do.
                ring.set_next(order.number.wrapping_add(1));
            }
        }
        self.deliver(gauge, raw, main)
    }

    /// The stashed frame, once its sender's ring has delivered what comes before it.
    fn release<T: DeserializeOwned>(&mut self, gauge: &Gauge, stashed: Stashed) -> Look<T> {
        let Some(order) = stashed.order else { return self.deliver(gauge, stashed.raw, stashed.main) };
        let number = order.number;
        let Some(i) = self.rings.iter().position(|r| r.id == order.ring) else {
            return self.deliver(gauge, stashed.raw, stashed.main);
        };
        if self.rings[i].next() < number {
            match self.rings[i].first() {
                Ok(Some(before)) if before < number => {
                    self.stash = Some(stashed);
                    return Look::Got(self.pop_ring(gauge, i));
                }
                // Not in the ring: lost with its sender (killed with a backlog).
                Ok(_) => self.rings[i].set_next(number),
                Err(why) => {
                    self.rings.remove(i);
                    self.stash = Some(stashed);
                    return Look::Got(Err(Missing::Failed(RecvError::Malformed(why))));
                }
            }
        }
        if self.rings[i].next() == number {
            self.rings[i].set_next(number.wrapping_add(1));
        }
        self.deliver(gauge, stashed.raw, stashed.main)
    }

    /// A frame in its turn: its message, or what a frame of another kind does.
    fn deliver<T: DeserializeOwned>(&mut self, gauge: &Gauge, mut raw: Received, main: bool) -> Look<T> {
        if let Some(lost) = raw.lost.take() {
            return self.deliver_cut_short(gauge, raw, main, lost);
        }
        // Settled before the decode, which runs the user's `Deserialize` and may unwind.
        if main && let Some(cost) = frame::read_cost(&self.buf[raw.bytes.clone()]) {
            self.settle(gauge, cost);
        }
        // A message frame that fails before its message decodes (a lease that cannot be
        // reopened, a forged prefix) still takes its place in the channel with it.
        let message = frame::holds_a_message(&self.buf[raw.bytes.clone()]);
        // Its leases adopted, its message decoded.
        let incoming = frame::read(&self.buf[raw.bytes], raw.fds, Some(&self.leases))
            .map_err(|e| Missing::Failed(checked(RecvError::Malformed(e))));
        match incoming {
            Ok(Incoming::Message { value, .. }) => {
                gauge.free_places(1);
                Look::Got(value.map_err(|m| self.undecodable::<T>(m)))
            }
            Ok(Incoming::Redirect(_) | Incoming::Ring(_)) if !main => Look::Got(Err(Missing::Failed(
                RecvError::Malformed("a spilled batch holds a frame that only a channel's socket may".into()),
            ))),
            Ok(Incoming::Redirect(batch)) => {
                self.spill = Some(Arc::new(batch));
                self.spill_read_at = gauge.frames_read();
                Look::Again
            }
            Ok(Incoming::Ring(ring)) => {
                // Rings whose writers are gone, read to their end, go first (those whose lost
                // messages' places are still to give back stay until nothing is left to read).
                self.rings.retain(|r| !r.writer_gone() || r.has_entries() || r.never_delivered() > 0);
                if self.rings.len() < ring::MAX_RINGS {
                    ring.accept();
                    self.rings.push(ring);
                } else {
                    // Its writer has written nothing to it, and now never will.
                    ring.refuse();
                }
                Look::Again
            }
            Ok(Incoming::Wake) => Look::Again,
            Err(missing) => {
                if message {
                    gauge.free_places(1);
                }
                Look::Got(Err(missing))
            }
        }
    }

    /// A frame in its turn whose descriptors the kernel dropped, or whose descriptors do not
    /// add up: its message (or a spill batch's) is lost, reported, and what it took given back
    /// as if read (README.md, "Rings", Out of descriptors); `look_once` moved the ring past it,
    /// `gaps` steps over a batch's.
    fn deliver_cut_short<T>(&mut self, gauge: &Gauge, raw: Received, main: bool, lost: Lost) -> Look<T> {
        let error = match lost {
            Lost::DescriptorsDropped => {
                let limit = descriptor_limit();
                tracing::warn!(limit, "a message was lost: this process is at its limit of file descriptors");
                RecvError::OutOfDescriptors { limit }
            }
            Lost::Malformed(why) => checked(RecvError::Malformed(why)),
        };
        let Some(cut) = frame::cut_short(&self.buf[raw.bytes], raw.fds, &self.leases) else {
            return Look::Got(Err(Missing::Failed(error)));
        };
        if cut.batch && !main {
            // As `deliver` refuses it when its descriptors come.
            return Look::Got(Err(Missing::Failed(RecvError::Malformed("a redirect inside a batch".into()))));
        }
        if main {
            self.settle(gauge, cut.cost);
        }
        if cut.batch {
            self.gaps = true;
            self.rings.iter_mut().for_each(RingReader::batch_lost);
        }
        gauge.free_places(cut.messages);
        Look::Got(Err(Missing::Failed(error)))
    }

    /// The next message of a ring that is next in its sender's order, the rings taking turns.
    /// A ring that does not add up is dropped (its writer's later messages are lost) and
    /// reported as a malformed message.
    fn next_of_rings<T: DeserializeOwned>(&mut self, gauge: &Gauge) -> Option<Result<T, Missing>> {
        let n = self.rings.len();
        for k in 0..n {
            let i = (self.next_ring + k) % n;
            let ring = &mut self.rings[i];
            match ring.first() {
                Ok(None) => continue,
                Ok(Some(number)) if number == ring.next() => {}
                Ok(Some(number)) if number < ring.next() => {
                    self.rings.remove(i);
                    return Some(Err(Missing::Failed(RecvError::Malformed(
                        "a channel's ring whose writer numbers a message twice".into(),
                    ))));
                }
                // Messages before it are on their way, unless its writer is gone (or a batch
                // was lost) and nothing is left to read: then they were lost.
                Ok(Some(number)) => {
                    if !gap_is_lost(ring, self.gaps, &self.spill, &self.main) {
                        continue;
                    }
                    ring.set_next(number);
                }
                Err(why) => {
                    self.rings.remove(i);
                    return Some(Err(Missing::Failed(RecvError::Malformed(why))));
                }
            }
            self.next_ring = i + 1;
            return Some(self.pop_ring(gauge, i));
        }
        None
    }

    /// A message that did not decode, with the types of both ends when they differ.
    fn undecodable<T: DeserializeOwned>(&self, why: String) -> Missing {
        let why = match &self.sender_sends {
            Some(sends) => {
                format!("{why} (the sender sends {sends}, this receiver takes {})", std::any::type_name::<T>())
            }
            None => why,
        };
        Missing::Failed(checked(RecvError::Malformed(why)))
    }

    /// Takes the wake frames at the head of the socket; true when another frame (or the end)
    /// is there to read (why: README.md, "Select and async receives").
    fn take_wakes(&mut self, gauge: &Gauge) -> bool {
        let mut head = [0u8; 2];
        loop {
            match self.main.peek(&mut head) {
                None => return false,
                Some(bytes) if !frame::is_wake(bytes) => return true,
                Some(_) => {}
            }
            let raw = match receive_raw(&self.main, &mut self.buf, Wait::Not) {
                Ok(raw) => raw,
                Err(Missing::Empty) => return false,
                // The end stays readable: the receive finds it, and reads the rings out first.
                Err(Missing::Failed(RecvError::Disconnected)) => return true,
                Err(Missing::Failed(e)) => {
                    // The frame is gone: the next receive reports why.
                    self.failure = Some(e);
                    return true;
                }
            };
            gauge.frame_read();
            if !frame::is_wake(&self.buf[raw.bytes.clone()]) {
                // Not the frame peeked at (another process reads this socket too): it is the
                // next to deliver.
                let order = frame::order_of(&self.buf[raw.bytes.clone()]);
                self.stash = Some(Stashed { order, raw, main: true, read_at: gauge.frames_read() });
                return true;
            }
            if let Look::Got(Err(Missing::Failed(e))) = self.deliver::<()>(gauge, raw, true) {
                // A wake frame that is not one (descriptors attached, say).
                self.failure = Some(e);
                return true;
            }
        }
    }

    /// Takes ring `i`'s first message.
    fn pop_ring<T: DeserializeOwned>(&mut self, gauge: &Gauge, i: usize) -> Result<T, Missing> {
        match self.rings[i].pop(&mut self.entry) {
            Ok(Some(_)) => {
                RING_MESSAGES.fetch_add(1, Ordering::Relaxed);
                gauge.free_places(1);
                wire::decode_on(&self.entry, Vec::new(), Some(&*self.leases), super::adopt_segment)
                    .map_err(|m| self.undecodable::<T>(m))
            }
            Ok(None) => Err(Missing::Empty),
            Err(why) => {
                self.rings.remove(i);
                Err(Missing::Failed(RecvError::Malformed(why)))
            }
        }
    }

    /// Every sender is gone: what the rings still hold comes first, whatever was lost before
    /// it, then the end.
    fn at_end<T: DeserializeOwned>(&mut self, gauge: &Gauge) -> Result<T, Missing> {
        for i in 0..self.rings.len() {
            if let Ok(Some(number)) = self.rings[i].first() {
                self.rings[i].set_next(number);
                return self.pop_ring(gauge, i);
            }
        }
        self.read_everything(gauge);
        Err(Missing::Failed(RecvError::Disconnected))
    }

    /// True when a receive would deliver a ring's first message: it is next in its sender's
    /// order, or the messages before it were lost (`next_of_rings`' condition).
    fn rings_ready(&mut self) -> bool {
        let (gaps, spill, main) = (self.gaps, &self.spill, &self.main);
        self.rings.iter_mut().any(|r| match r.first() {
            Ok(Some(n)) => n == r.next() || (n > r.next() && gap_is_lost(r, gaps, spill, main)),
            Ok(None) => false,
            // A receive reports it at once.
            Err(_) => true,
        })
    }

    /// Whether a receive would return at once, or which descriptor to wait on. A spill batch
    /// read to its end is left here (which loses nothing).
    pub(super) fn readiness(&mut self, gauge: &Gauge) -> Option<Readiness> {
        if let Some(spill) = &self.spill {
            if spill.pending_bytes() > 0 {
                return Some(Readiness::Ready);
            }
            // Read to its end (complete when handed on, closed or not).
            self.spill = None;
        }
        if self.stash.is_some() || self.failure.is_some() || self.rings_ready() {
            return Some(Readiness::Ready);
        }
        // The socket: ready when a frame other than a wake is there (or its end).
        if self.spill.is_none() && self.take_wakes(gauge) {
            return Some(Readiness::Ready);
        }
        let asleep = gauge.asleep();
        if self.rings_ready() {
            return Some(Readiness::Ready);
        }
        Some(Readiness::Wait(self.main.clone(), Some(Announced::Asleep(asleep))))
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;
    use std::sync::{Arc, Barrier};

    use super::*;

    /// A writer that writes its last entry and goes while the receiver looks whether
    /// everything was read: the ring must not be dropped with that entry in it.
    #[test]
    fn a_ring_is_not_dropped_with_an_entry_its_writer_wrote_as_it_went() {
        let mut lost = 0;
        let mut hits = 0;
        let gauge = Gauge::new(0, 1 << 20).unwrap();
        for _ in 0..5_000 {
            let (main, _peer) = Socket::pair().unwrap();
            let mut inbox = Inbox::new(Arc::new(main), Arc::new(ConnectionLeases::default()));
            let (mut writer, intro) = ring::RingWriter::new().unwrap();
            let reader = RingReader::adopt(intro.memory.as_fd().try_clone_to_owned().unwrap(), intro.alive).unwrap();
            reader.accept();
            inbox.rings.push(reader);
            let keep = intro.memory.clone(); // so that the writer's drop only closes its pipe end
            let go = Arc::new(Barrier::new(2));
            let w = {
                let go = go.clone();
                std::thread::spawn(move || {
                    go.wait();
                    assert!(writer.push(b"last"));
                    drop(writer);
                })
            };
            go.wait();
            while !w.is_finished() {
                inbox.read_everything(&gauge);
            }
            w.join().unwrap();
            inbox.read_everything(&gauge);
            if inbox.rings.is_empty() {
                lost += 1;
            } else {
                hits += 1;
            }
            drop(keep);
        }
        assert_eq!(lost, 0, "rings dropped with an unread entry ({hits} kept)");
    }

    /// A writer numbers five messages on a bounded channel of capacity 8 (taking a place each)
    /// and dies: the receiver got the first two (from the ring), the other three (its backlog)
    /// never come. Once nothing is left to read, their places come back, and only theirs; not
    /// while the writer lives or the socket holds a frame, and not where a batch was lost for
    /// want of descriptors while the ring was read (its places came back then).
    #[test]
    fn a_dead_writers_messages_that_never_came_give_their_places_back() {
        for gaps in [false, true] {
            let gauge = Gauge::new(8, 1 << 20).unwrap();
            let (main, peer) = Socket::pair().unwrap();
            let mut inbox = Inbox::new(Arc::new(main), Arc::new(ConnectionLeases::default()));
            let (mut writer, intro) = ring::RingWriter::new().unwrap();
            let mut reader =
                RingReader::adopt(intro.memory.as_fd().try_clone_to_owned().unwrap(), intro.alive).unwrap();
            reader.accept();
            if gaps {
                reader.batch_lost();
            }
            inbox.rings.push(reader);
            for _ in 0..5 {
                assert!(gauge.take_place(Some(None), || false).is_ok());
            }
            assert!(writer.push(b"one") && writer.push(b"two"));
            for _ in 0..3 {
                writer.sent(); // spilled to a backlog the receiver never sees
            }
            for _ in 0..2 {
                // Taken from the ring (bytes that are not a message: malformed, but taken).
                let _ = inbox.next_of_rings::<u32>(&gauge).expect("a ring entry");
            }
            assert_eq!(gauge.queued_messages(), 5 - 2, "the two received gave their places back");
            inbox.read_everything(&gauge);
            assert_eq!(gauge.queued_messages(), 3, "the writer lives: its messages may still come");
            drop(writer);
            // A process forked by another test meanwhile may hold the pipe's end a while.
            let deadline = Instant::now() + Duration::from_secs(10);
            while !inbox.rings[0].writer_gone() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            // A frame the writer wrote as it went, unread: it may be one of the three.
            peer.send(&[b"a frame"], &[], Wait::Not).unwrap();
            inbox.read_everything(&gauge);
            assert_eq!((inbox.rings.len(), gauge.queued_messages()), (1, 3), "not while the socket holds a frame");
            let _ = inbox.main.recv(64, Wait::Not).unwrap();
            inbox.read_everything(&gauge);
            assert!(inbox.rings.is_empty(), "the gone writer's empty ring is dropped");
            assert_eq!(
                gauge.queued_messages(),
                if gaps { 3 } else { 0 },
                "the three lost messages' places (gaps: {gaps})"
            );
        }
    }
}

#[cfg(test)]
mod forged_frames {
    use std::os::fd::AsFd;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::*;

    fn message_frame(v: u8) -> Vec<u8> {
        let mut f = vec![0u8];
        f.extend(postcard::to_allocvec(&v).unwrap());
        f.push(0);
        f
    }

    /// A redirect whose batch's writing end the forger keeps open does not stall the frames
    /// behind it (a batch is complete when it is handed on).
    #[test]
    fn a_redirect_to_a_batch_kept_open_does_not_stall_the_channel() {
        let (main, peer) = Socket::pair().unwrap();
        let mut inbox = Inbox::new(Arc::new(main), Arc::new(ConnectionLeases::default()));
        let gauge = Gauge::new(0, 1 << 20).unwrap();
        let (batch_tx, batch_rx) = Socket::pair().unwrap();
        let mut redirect = vec![2u8];
        redirect.extend(1u64.to_le_bytes());
        peer.send(&[&redirect], &[batch_rx.as_fd()], Wait::Forever).unwrap();
        drop(batch_rx);
        peer.send(&[&message_frame(7)], &[], Wait::Forever).unwrap();
        let got = inbox.receive::<u8>(&gauge, Wait::Until(Instant::now() + Duration::from_secs(5)));
        assert!(matches!(got, Ok(7)), "the message behind the redirect");
        drop(batch_tx);
    }

    /// One pipe's writing end introduced again and again under fresh names is kept once: else
    /// each frame would take the receiver descriptors without bound.
    #[test]
    fn a_lease_introduced_under_many_names_is_kept_once() {
        let (main, peer) = Socket::pair().unwrap();
        let mut inbox = Inbox::new(Arc::new(main), Arc::new(ConnectionLeases::default()));
        let gauge = Gauge::new(0, 1 << 20).unwrap();
        let (_read, write) = crate::sys::lease_pipe().unwrap();
        let mut key = 1u64;
        for _ in 0..20 {
            let mut f = vec![0x80u8, 16];
            for _ in 0..16 {
                f.extend(7u128.to_le_bytes());
                f.extend(key.to_le_bytes());
                key += 1;
            }
            f.push(0xff); // garbage message
            let fds: Vec<std::os::fd::BorrowedFd<'_>> = (0..16).map(|_| write.as_fd()).collect();
            peer.send(&[&f], &fds, Wait::Forever).unwrap();
            let _ = inbox.receive::<u8>(&gauge, Wait::Not);
        }
        assert_eq!(inbox.leases.all().len(), 1);
    }
}
