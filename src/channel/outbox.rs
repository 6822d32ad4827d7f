//! The sending side of a channel in one process: the socket, the shared counters, and the
//! backlog of spilled frames with the feeder thread that hands it on. See
//! `src/channel/README.md` for why a send never waits for the reader and what that costs.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::frame::{FrameOut, Order, SMALL_COST};
use super::gauge::Gauge;
use super::ring::{self, RingWriter};
use crate::error::{IoFailure, SendFailure};
use crate::fork::{ForkLocal, NotInherited, Number};
use crate::lifetime::Connection;
use crate::os::{catch_quietly, wait_slice};
use crate::sys::{Socket, Wait};
use crate::sys::{descriptor_limit, out_of_descriptors};
use crate::wire::Held;

/// How long an idle feeder waits for more work before its thread ends.
const FEEDER_IDLE: Duration = Duration::from_secs(2);

/// How long a feeder sleeps at most while it waits for the socket to drain.
const ROOM_WAIT: Duration = Duration::from_millis(10);

/// How long the open batch waits for room on the socket at most before it is handed on anyway:
/// the latency a spilled message may gain, and what keeps messages moving when the counters
/// are wrong (a frame counted but never read, by a process killed between the two).
const HANDOVER_DELAY: Duration = Duration::from_millis(20);

/// Set once the process is exiting: feeders then hand on everything at once.
static EXITING: AtomicBool = AtomicBool::new(false);

/// Messages a process sends directly on a channel before it makes a ring for it: a process
/// that sends one message (a reply on a sender that came with its request) makes none.
const BEFORE_RING: u32 = 3;

/// Threads waiting in [`flush_all`]: feeders hand on everything at once meanwhile.
static FLUSHING: AtomicUsize = AtomicUsize::new(0);

/// The senders of one channel in this process, shared by all their handles.
pub(super) struct Outbox {
    /// Set where forked children must not keep the channel open ([`Outbox::not_inherited`]);
    /// before `main`, so that it lets go of the number before the socket closes.
    not_inherited: OnceLock<NotInherited<Number>>,
    /// The channel's socket (its sending end).
    pub(super) main: Arc<Socket>,
    pub(super) gauge: Gauge,
    /// The backlog of this process: a forked child's copy of a sender starts with none (its
    /// parent's is the parent's to hand on, by the parent's feeder).
    pending: ForkLocal<Pending>,
    /// Live `Sender` handles of this process (the feeder holds the outbox without being one).
    handles: AtomicUsize,
    /// Set with `Backlog::disconnected`, read without the lock.
    gone: AtomicBool,
    /// This process's side of the channel's connection, looked up once (a forked child looks
    /// up its own).
    connection: ForkLocal<OnceLock<Arc<Connection>>>,
}

#[derive(Default)]
struct Pending {
    backlog: Mutex<Backlog>,
    changed: Condvar,
}

/// Frames waiting for the feeder, in order.
#[derive(Default)]
struct Backlog {
    /// Full batches (their writing end closed), oldest first.
    closed: VecDeque<Batch>,
    /// The batch being filled.
    open: Option<Batch>,
    /// The feeder is writing a redirect to the socket now.
    handing_on: bool,
    /// A feeder thread runs.
    feeder: bool,
    /// The feeder sleeps until told of new work.
    feeder_idle: bool,
    /// The receiver is gone: sends fail, and what was spilled is dropped.
    disconnected: bool,
    /// Messages spilled and not yet handed on (for `Debug`).
    messages: usize,
    /// This process's ring on the channel, once made (`ring.rs`).
    ring: Option<RingWriter>,
    /// Messages that could have taken a ring before there was one.
    ring_candidates: u32,
    /// For a test: how many redirect writes to refuse as the kernel does when it is short of
    /// buffers.
    #[cfg(test)]
    refuse_redirects: u32,
    /// A redirect refused for a passing reason was reported (once per backlog).
    told_refused: bool,
}

/// A private channel holding spilled frames: written here, read by the receiver after the
/// redirect that hands it on.
struct Batch {
    /// `None` once the batch is full: nothing more is written to it. A forked child closes
    /// its copy (the child's sends have a backlog of their own, and must not write here).
    tx: Option<NotInherited<Socket>>,
    rx: Socket,
    /// What its frames cost its socket, and what they may cost without a write waiting.
    cost: u64,
    limit: u64,
    messages: usize,
    opened: Instant,
}

impl Backlog {
    fn is_empty(&self) -> bool {
        self.closed.is_empty() && self.open.is_none() && !self.handing_on
    }
}

/// How long the feeder waits before it writes again a redirect that the kernel refused for a
/// passing reason.
const REDIRECT_RETRY: Duration = Duration::from_millis(10);

/// For a test: how long an outbox's drop waits before it parks its ring (ms).
#[cfg(test)]
pub(super) static DROP_PAUSE_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl Drop for Outbox {
    fn drop(&mut self) {
        #[cfg(test)]
        std::thread::sleep(Duration::from_millis(DROP_PAUSE_MS.load(Ordering::SeqCst)));
        // Only this generation's ring (a forked child's copy of its parent's outbox has none).
        if !self.pending.is_stale() {
            let ring = self.lock().ring.take();
            if let Some(ring) = ring.filter(|ring| ring.used() > 0 && !ring.reader_gone())
                && let Some(identity) = self.main.identity()
            {
                parked_rings().insert((self.gauge.id(), identity), ring);
            }
        }
        // Last, after the ring is parked: an `attach` of this channel that found this outbox
        // going waits until its entry is gone, and then takes the ring back.
        let me: *const Outbox = self;
        let mut registry = registry();
        if registry.get(&self.gauge.id()).is_some_and(|w| std::ptr::eq(w.as_ptr(), me)) {
            registry.remove(&self.gauge.id());
        }
    }
}

impl fmt::Debug for Outbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let backlog = self.lock();
        f.debug_struct("Outbox")
            .field("capacity", &self.gauge.capacity())
            .field("queued", &self.gauge.capacity().map(|_| self.gauge.queued_messages()))
            .field("spilled", &backlog.messages)
            .field("disconnected", &backlog.disconnected)
            .finish_non_exhaustive()
    }
}

/// Every outbox of this process, by the id of its channel: the handles of one channel in one
/// process share one backlog, so that one thread's messages stay in order whichever handle it
/// uses. An outbox takes its entry out as the last step of its drop.
fn registry() -> MutexGuard<'static, HashMap<u64, Weak<Outbox>>> {
    static REGISTRY: ForkLocal<Mutex<HashMap<u64, Weak<Outbox>>>> = ForkLocal::new(Default::default);
    REGISTRY.get().lock().unwrap_or_else(|p| p.into_inner())
}

/// A channel as this process tells it apart: the id in its counters and its socket. The id
/// alone would do for channels of ours, but any holder of a channel's counters can write it.
type ChannelKey = (u64, Option<(u64, u64)>);

/// This process's side of the connection of channel `key` (a forked child has its own). Kept
/// after the channel's senders here are gone, so that a later one (a sender that comes with
/// every request) goes on with the same lease; the table drops connections that hold no open
/// lease as it grows.
fn connection_of(key: ChannelKey) -> Arc<Connection> {
    type Table = (HashMap<ChannelKey, Arc<Connection>>, usize);
    static CONNECTIONS: ForkLocal<Mutex<Table>> = ForkLocal::new(Default::default);
    let mut table = CONNECTIONS.get().lock().unwrap_or_else(|p| p.into_inner());
    let (connections, swept) = &mut *table;
    if let Some(c) = connections.get(&key) {
        return c.clone();
    }
    if connections.len() >= 64.max(2 * *swept) {
        connections.retain(|_, c| Arc::strong_count(c) > 1 || crate::lifetime::connection_open(c));
        *swept = connections.len();
    }
    connections.entry(key).or_default().clone()
}

/// Rings of this process whose outbox went while the receiver had not read all of them, by
/// channel id and socket, for the channel's next sender here (README.md, "Rings", Order).
type ParkedRings = HashMap<(u64, (u64, u64)), RingWriter>;

fn parked_rings() -> MutexGuard<'static, ParkedRings> {
    static PARKED: ForkLocal<Mutex<ParkedRings>> = ForkLocal::new(Default::default);
    let mut parked = PARKED.get().lock().unwrap_or_else(|p| p.into_inner());
    parked.retain(|_, ring| ring.used() > 0 && !ring.reader_gone());
    parked
}

/// Whether a write failed for a reason that passes: kernel buffers or memory short, this
/// user's descriptors in flight past its limit, this process out of descriptors.
fn passing(why: &SendFailure) -> bool {
    use rustix::io::Errno;
    let passing = [Errno::NOBUFS, Errno::NOMEM, Errno::TOOMANYREFS, Errno::AGAIN].map(|e| e.raw_os_error());
    match why {
        SendFailure::OutOfDescriptors { .. } => true,
        SendFailure::Io(e) => e.raw_os_error().is_some_and(|code| passing.contains(&code)),
        _ => false,
    }
}

/// A failed system call of a send, as the send's failure.
pub(super) fn failure(e: io::Error) -> SendFailure {
    if out_of_descriptors() || e.raw_os_error() == Some(rustix::io::Errno::MFILE.raw_os_error()) {
        let limit = descriptor_limit();
        tracing::warn!(limit, "a send failed: this process is out of file descriptors");
        return SendFailure::OutOfDescriptors { limit };
    }
    if crate::sys::is_disconnect(&e) { SendFailure::Disconnected } else { SendFailure::Io(IoFailure::from(e)) }
}

impl Outbox {
    /// The outbox of this process for the channel `main` writes to, whose counters are
    /// `gauge`: the existing one when this process already holds a sender of the channel.
    pub(super) fn attach(main: Arc<Socket>, gauge: Gauge) -> Arc<Outbox> {
        // Another outbox of the channel (another socket) is let go after the registry: its
        // drop, if it is the last handle, takes the registry's lock.
        let mut replaced = None;
        let mut registry = loop {
            let registry = registry();
            match registry.get(&gauge.id()) {
                // The channel's outbox here is being dropped (its last handle went on another
                // thread): wait for its drop to park its ring, which this one takes back, so
                // that this process's messages keep their order.
                Some(going) if going.strong_count() == 0 => {
                    drop(registry);
                    std::thread::yield_now();
                }
                _ => break registry,
            }
        };
        if let Some(existing) = registry.get(&gauge.id()).and_then(Weak::upgrade) {
            let identity = existing.main.identity();
            if identity.is_some() && identity == main.identity() {
                existing.handles.fetch_add(1, Ordering::SeqCst);
                return existing;
            }
            replaced = Some(existing);
        }
        let parked = main.identity().and_then(|identity| parked_rings().remove(&(gauge.id(), identity)));
        let outbox = Arc::new(Outbox {
            not_inherited: OnceLock::new(),
            main,
            gauge,
            pending: ForkLocal::new(Pending::default),
            handles: AtomicUsize::new(1),
            gone: AtomicBool::new(false),
            connection: ForkLocal::new(OnceLock::new),
        });
        if parked.is_some() {
            outbox.lock().ring = parked;
        }
        registry.insert(outbox.gauge.id(), Arc::downgrade(&outbox));
        drop(registry);
        drop(replaced);
        outbox
    }

    /// From now on a child forked without `exec` closes this process's sending end of the
    /// channel at once, rather than keeping it open as long as it lives: for a channel whose
    /// end a receiver watches for this process's departure, and that children never use.
    pub(super) fn not_inherited(&self) {
        self.not_inherited.get_or_init(|| NotInherited::new(Number::of(&*self.main)));
    }

    /// Another handle of this outbox.
    pub(super) fn add_handle(self: &Arc<Self>) -> Arc<Outbox> {
        self.handles.fetch_add(1, Ordering::SeqCst);
        self.clone()
    }

    /// A handle is dropped: when it was the last, the feeder hands on the rest at once.
    pub(super) fn drop_handle(&self) {
        if self.handles.fetch_sub(1, Ordering::SeqCst) == 1 {
            let _backlog = self.lock();
            self.changed().notify_all();
        }
    }

    /// Writes raw bytes and descriptors to the channel's socket, counted as a frame of ours.
    #[cfg(test)]
    pub(super) fn write_raw(&self, bytes: &[u8], fds: &[std::os::fd::BorrowedFd<'_>]) {
        self.gauge.writing_frame();
        self.main.send(&[bytes], fds, Wait::Forever).expect("a raw frame written");
    }

    /// Writes `bytes` to the channel's socket under a transport header that claims `claimed`
    /// descriptors, with none attached (what only a forger writes), counted as a frame of ours.
    #[cfg(test)]
    pub(super) fn write_forged(&self, claimed: u32, bytes: &[u8]) {
        self.gauge.writing_frame();
        self.main.send_forged(claimed, bytes).expect("a forged frame written");
    }

    /// Writes a frame to the channel's socket as this process's feeder would.
    #[cfg(test)]
    pub(super) fn write_frame(&self, frame: &FrameOut<'_>) {
        assert!(self.gauge.try_reserve(frame.cost()));
        self.write_main(frame, &[], Wait::Forever, None).expect("a frame written");
    }

    /// This process's side of the channel's connection lease: one per channel and process,
    /// whichever of its senders (now or later: a sender that arrives with every request) sends.
    pub(super) fn connection(&self) -> &Arc<Connection> {
        self.connection.get().get_or_init(|| connection_of((self.gauge.id(), self.main.identity())))
    }

    fn lock(&self) -> MutexGuard<'_, Backlog> {
        self.pending.get().backlog.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn changed(&self) -> &Condvar {
        &self.pending.get().changed
    }

    /// True once a send found the receiver gone.
    pub(super) fn disconnected(&self) -> bool {
        self.gone.load(Ordering::Acquire)
    }

    /// The receiver is gone: what was spilled is dropped, and every later send fails.
    fn disconnect(&self, backlog: &mut Backlog) {
        (backlog.disconnected, backlog.open, backlog.messages) = (true, None, 0);
        backlog.closed.clear();
        self.gone.store(true, Ordering::Release);
        self.changed().notify_all();
    }

    /// True once the receiver is known to be gone.
    pub(super) fn receiver_gone(&self) -> bool {
        self.disconnected() || self.main.peer_closed()
    }

    /// Writes the frame of one message, encoded on this thread: to the socket when nothing of
    /// ours waits before it and the socket surely has room, else to the backlog. Never waits
    /// for the reader.
    pub(super) fn write(self: &Arc<Self>, frame: FrameOut<'_>, fds: &[Held]) -> Result<(), SendFailure> {
        let cost = frame.cost();
        let mut backlog = self.lock();
        if backlog.disconnected {
            return Err(SendFailure::Disconnected);
        }
        // On a bounded channel this process numbers its messages from its first one (its ring
        // made at once, not after a few small messages): were it to die with messages in its
        // backlog, the receiver gives their places back by the numbers it never got.
        if backlog.ring.is_none() && backlog.is_empty() && self.gauge.capacity().is_some() {
            backlog.ring = self.open_ring();
        }
        // Once this process has a ring on the channel, its frames carry their place among its
        // messages, so that the receiver puts them in order with the ring's.
        let order = backlog.ring.as_ref().map(RingWriter::order);
        if backlog.is_empty() && self.gauge.try_reserve(cost) {
            if let Err(failure) = self.write_main(&frame, fds, Wait::Forever, order) {
                self.gauge.release(cost);
                if failure == SendFailure::Disconnected {
                    self.disconnect(&mut backlog);
                }
                return Err(failure);
            }
        } else {
            self.spill(&mut backlog, frame, fds, cost, order)?;
        }
        if let Some(ring) = backlog.ring.as_mut() {
            ring.sent();
        }
        Ok(())
    }

    /// Writes a frame to the channel's socket, counted in the shared counters' `written`
    /// before the write (and taken back if it fails): a hint for the receiver's spin, and how
    /// a receiver that is never idle knows it has read past a point (README.md, "Rings").
    fn write_main(
        &self,
        frame: &FrameOut<'_>,
        fds: &[Held],
        wait: Wait,
        order: Option<Order>,
    ) -> Result<(), SendFailure> {
        self.gauge.writing_frame();
        let written = frame.write_in_order(&self.main, fds, wait, order).map_err(failure);
        if written.is_err() {
            self.gauge.frame_not_written();
        }
        written
    }

    /// For a test: the feeder's next `n` redirects are refused as the kernel refuses one when
    /// it is short of buffers; `None` reads how many are left to refuse.
    #[cfg(test)]
    pub(super) fn refuse_redirects(&self, n: Option<u32>) -> u32 {
        let mut backlog = self.lock();
        if let Some(n) = n {
            backlog.refuse_redirects = n;
        }
        backlog.refuse_redirects
    }

    /// Writes the bytes of a message that carries no descriptor to this process's ring of the
    /// channel where it may (README.md, "Rings"); `Ok(false)` when the message must take the
    /// socket instead. A full ring is waited for at most `patience`.
    pub(super) fn try_ring(&self, bytes: &[u8], patience: Duration) -> Result<bool, SendFailure> {
        if bytes.len() > ring::MAX_MESSAGE {
            return Ok(false);
        }
        let mut backlog = self.lock();
        if backlog.disconnected {
            return Err(SendFailure::Disconnected);
        }
        if !backlog.is_empty() || self.gauge.receiver_asleep() {
            return Ok(false);
        }
        let Some(ring) = backlog.ring.as_mut() else {
            backlog.ring_candidates += 1;
            if backlog.ring_candidates > BEFORE_RING {
                backlog.ring = self.open_ring();
            }
            return Ok(false);
        };
        if ring.look_due(Instant::now()) && self.main.peer_closed() {
            self.disconnect(&mut backlog);
            return Err(SendFailure::Disconnected);
        }
        if !ring.push_patiently(bytes, patience) {
            return Ok(false);
        }
        if self.gauge.receiver_asleep() {
            // It went to sleep after our look: wake it through the socket.
            self.wake();
        }
        Ok(true)
    }

    /// Makes this process's ring and introduces it on the socket (its first message comes
    /// after that frame is read). `None` when either fails: the ring is then tried again later.
    fn open_ring(&self) -> Option<RingWriter> {
        // Room for the introduction first: a ring made for nothing costs a memory file and a pipe.
        if !self.gauge.try_reserve(SMALL_COST) {
            return None;
        }
        let introduced = RingWriter::new().ok().and_then(|(writer, introduction)| {
            let frame = FrameOut::Ring(&introduction);
            debug_assert_eq!(frame.cost(), SMALL_COST);
            self.write_main(&frame, &[], Wait::Not, None).ok().map(|()| writer)
        });
        if introduced.is_none() {
            self.gauge.release(SMALL_COST);
        }
        introduced
    }

    /// A wake frame on the socket, unless the socket is full (its frames wake the receiver).
    fn wake(&self) {
        if !self.gauge.try_reserve(SMALL_COST) {
            return;
        }
        if self.write_main(&FrameOut::Wake, &[], Wait::Not, None).is_err() {
            self.gauge.release(SMALL_COST);
        }
    }

    /// Writes a frame to the open batch (a fresh one when there is none or it is full).
    fn spill(
        self: &Arc<Self>,
        backlog: &mut Backlog,
        frame: FrameOut<'_>,
        fds: &[Held],
        cost: u64,
        order: Option<Order>,
    ) -> Result<(), SendFailure> {
        if backlog.open.as_ref().is_some_and(|b| b.cost + cost > b.limit)
            && let Some(mut full) = backlog.open.take()
        {
            full.tx = None;
            backlog.closed.push_back(full);
        }
        if backlog.open.is_none() {
            // A new batch is where a receiver that is gone would be noticed last: look now.
            if self.main.peer_closed() {
                self.disconnect(backlog);
                return Err(SendFailure::Disconnected);
            }
            let (tx, rx) = Socket::pair().map_err(|e| match failure(e) {
                SendFailure::Io(e) => {
                    SendFailure::Io(IoFailure::context(e.io_error(), "cannot make a batch for the backlog"))
                }
                other => other,
            })?;
            // Within the limit of the channel's socket at least, whose frames all fit.
            let limit = (tx.send_buffer() as u64 / 4 * 3).max(self.gauge.limit);
            backlog.open = Some(Batch {
                tx: Some(NotInherited::new(tx)),
                rx,
                cost: 0,
                limit,
                messages: 0,
                opened: Instant::now(),
            });
        }
        if !backlog.feeder {
            self.start_feeder()?;
            backlog.feeder = true;
        }
        let batch =
            backlog.open.as_mut().ok_or_else(|| SendFailure::Io(IoFailure::other("the backlog lost its batch")))?;
        let tx = batch.tx.as_ref().ok_or_else(|| SendFailure::Io(IoFailure::other("the backlog's batch is closed")))?;
        // Nobody reads the batch before its redirect, and its frames stay within the socket's
        // limit: this write does not wait.
        frame.write_in_order(tx, fds, Wait::Forever, order).map_err(failure)?;
        batch.cost += cost;
        batch.messages += 1;
        backlog.messages += 1;
        if backlog.feeder_idle {
            // Otherwise the feeder is busy, or waits for room and looks again when there is.
            self.changed().notify_all();
        }
        Ok(())
    }

    fn start_feeder(self: &Arc<Self>) -> Result<(), SendFailure> {
        install_exit_hook();
        // A sender that a forked child inherited is not in the child's registry yet: the exit
        // hook must find it there.
        registry()
            .entry(self.gauge.id())
            .and_modify(|w| {
                if w.strong_count() == 0 {
                    *w = Arc::downgrade(self);
                }
            })
            .or_insert_with(|| Arc::downgrade(self));
        let outbox = self.clone();
        std::thread::Builder::new()
            .name("cuda-mp-feeder".into())
            .spawn(move || {
                let result = catch_quietly(|| outbox.feed());
                if result.is_err() {
                    // Nothing more will be handed on: fail the sends that would wait for it.
                    let mut backlog = outbox.lock();
                    outbox.disconnect(&mut backlog);
                    backlog.feeder = false;
                }
            })
            .map(drop)
            .map_err(|e| {
                SendFailure::Io(IoFailure::other(format!("cannot start the thread that feeds the channel: {e}")))
            })
    }

    /// The feeder: hands the backlog's batches on to the receiver, oldest first, by redirect
    /// frames; when (at the latest [`HANDOVER_DELAY`]): README.md, "Why a send used to wait".
    fn feed(self: &Arc<Self>) {
        let mut backlog = self.lock();
        loop {
            if backlog.disconnected {
                break;
            }
            let urgent = self.handles.load(Ordering::SeqCst) == 0
                || EXITING.load(Ordering::SeqCst)
                || FLUSHING.load(Ordering::SeqCst) > 0;
            let due = |b: &Batch| urgent || b.opened.elapsed() >= HANDOVER_DELAY || self.gauge.nearly_drained();
            let next = match backlog.closed.pop_front() {
                Some(batch) => Some(batch),
                None if backlog.open.as_ref().is_some_and(due) => backlog.open.take(),
                None => None,
            };
            match next {
                Some(mut batch) => {
                    backlog.handing_on = true;
                    #[cfg(test)]
                    let refused =
                        backlog.refuse_redirects.checked_sub(1).map(|n| backlog.refuse_redirects = n).is_some();
                    #[cfg(not(test))]
                    let refused = false;
                    drop(backlog);
                    let messages = batch.messages;
                    // Closing the writing end first: the receiver reads the batch to its end.
                    drop(batch.tx.take());
                    self.gauge.reserve(SMALL_COST);
                    let written = if refused {
                        Err(failure(io::Error::from_raw_os_error(rustix::io::Errno::NOBUFS.raw_os_error())))
                    } else {
                        self.write_main(&FrameOut::Redirect(&batch.rx, messages as u64), &[], Wait::Forever, None)
                    };
                    backlog = self.lock();
                    backlog.handing_on = false;
                    match written {
                        Ok(()) => backlog.messages = backlog.messages.saturating_sub(messages),
                        Err(why) if passing(&why) && !self.main.peer_closed() => {
                            // Descriptors in flight past the user's limit, kernel memory: the
                            // batch is handed on again, in its turn, after a pause.
                            self.gauge.release(SMALL_COST);
                            if !std::mem::replace(&mut backlog.told_refused, true) {
                                tracing::warn!(%why, "a spilled batch could not be handed on yet: trying again");
                            }
                            backlog.closed.push_front(batch);
                            drop(backlog);
                            std::thread::sleep(REDIRECT_RETRY);
                            backlog = self.lock();
                        }
                        Err(_) => {
                            self.gauge.release(SMALL_COST);
                            self.disconnect(&mut backlog);
                        }
                    }
                    self.changed().notify_all();
                }
                None if backlog.open.is_some() => {
                    if self.main.peer_closed() {
                        // The receiver is gone: no room will come.
                        self.disconnect(&mut backlog);
                        continue;
                    }
                    drop(backlog);
                    self.gauge.wait_until_drained(ROOM_WAIT);
                    backlog = self.lock();
                }
                None => {
                    self.changed().notify_all();
                    if urgent {
                        break;
                    }
                    backlog.feeder_idle = true;
                    let (b, waited) =
                        self.changed().wait_timeout(backlog, FEEDER_IDLE).unwrap_or_else(|p| p.into_inner());
                    backlog = b;
                    backlog.feeder_idle = false;
                    if waited.timed_out() && backlog.is_empty() {
                        break;
                    }
                }
            }
        }
        backlog.feeder = false;
        self.changed().notify_all();
    }

    /// Waits until everything spilled here was handed on, or the receiver is gone.
    /// False when `deadline` passed first.
    pub(super) fn drain(&self, deadline: Option<Instant>) -> bool {
        let mut backlog = self.lock();
        while !(backlog.is_empty() || backlog.disconnected) {
            if !backlog.feeder {
                // No thread to hand it on (it could not start): nothing to wait for.
                break;
            }
            let Some(wait) = wait_slice(deadline, ROOM_WAIT) else { return false };
            backlog = self.changed().wait_timeout(backlog, wait).unwrap_or_else(|p| p.into_inner()).0;
        }
        true
    }
}

/// Lets the backlogs of this process drain when it exits, as torch's queues join their feeder
/// threads: a process that returns from `main` (or a spawned worker that returns) first waits
/// until every message it sent has been handed on, or its receiver is gone.
fn install_exit_hook() {
    // Once per generation: a forked child that sends registers its own, for `before_exit`.
    static INSTALLED: ForkLocal<OnceLock<bool>> = ForkLocal::new(OnceLock::new);
    INSTALLED.get().get_or_init(|| crate::process::at_exit(drain_at_exit));
}

extern "C" fn drain_at_exit() {
    let _ = catch_quietly(|| {
        EXITING.store(true, Ordering::SeqCst);
        // Backlogs for as long as they take; releases for a minute at most: an owner that
        // does not read them (stopped) would hold the exit for ever, and the kernel closes
        // this process's leases when it exits, as at a kill.
        flush_backlogs(None);
        crate::lifetime::wait_for_releases_at_exit()
    });
}

/// Waits until every backlog of this process was handed on (or its receiver is gone), until
/// `timeout` at most; false when it passed first. Feeders hand on at once meanwhile.
pub(super) fn flush_all(timeout: Option<Duration>) -> bool {
    let deadline = timeout.map(crate::os::instant_after);
    // Releases of claims this process dropped are messages too.
    flush_backlogs(deadline) && crate::lifetime::wait_for_releases(deadline)
}

/// Waits until every backlog of this process was handed on (or its receiver is gone), until
/// `deadline` at most; false when it passed first.
pub(super) fn flush_backlogs(deadline: Option<std::time::Instant>) -> bool {
    FLUSHING.fetch_add(1, Ordering::SeqCst);
    let outboxes: Vec<Arc<Outbox>> = registry().values().filter_map(Weak::upgrade).collect();
    for outbox in &outboxes {
        let _backlog = outbox.lock();
        outbox.changed().notify_all();
    }
    let done = outboxes.iter().all(|outbox| outbox.drain(deadline));
    FLUSHING.fetch_sub(1, Ordering::SeqCst);
    done
}
