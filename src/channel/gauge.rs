//! A channel's shared counters: 64 bytes of shared memory that every process holding an end of
//! the channel maps. They say how full the channel's socket is (so that a send never waits for
//! the reader), and for a bounded channel how many messages are queued.
//!
//! | bytes | word | |
//! | --- | --- | --- |
//! | 0..4 | magic | `"CMCH"` |
//! | 4..8 | version | 2 |
//! | 8..16 | id | random; the same channel's senders in one process share their backlog by it |
//! | 16..24 | `queued` | the estimated bytes that frames on the socket cost the kernel, unread |
//! | 24..32 | `limit` | `queued` may not pass this on a direct send (3/4 of the send buffer) |
//! | 32..36 | `capacity` | 0: unbounded; else the most messages queued at once |
//! | 36..40 | `free` | free places of a bounded channel |
//! | 40..44 | `sleepers` | senders asleep on `free` |
//! | 44..48 | `room` | advanced when `queued` falls to a quarter of the limit while a feeder waits |
//! | 48..52 | `room_waiters` | feeders asleep on `room` |
//! | 52..56 | `asleep` | the receiver's waits in the kernel now (a receive's, a select's, an async receive's) |
//! | 56..60 | `written` | frames our senders wrote or are writing to the socket (wrapping) |
//! | 60..64 | `read` | frames the receiver has read from the socket (wrapping) |
//!
//! Another process can write anything here: bad contents give wrong estimates (a send that
//! spills to its backlog when it need not, or one that waits in the kernel), never undefined
//! behaviour. Every word is only ever accessed atomically.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::flavor::Refused;
use crate::error::{Error, Result, SendFailure};
use crate::sync::region::{self, Region, W32, W64};
use crate::sys;
use crate::sys::MemoryFile;

/// Bytes of the counters' shared memory.
pub(super) const BYTES: usize = region::BYTES;

const MAGIC: u32 = u32::from_be_bytes(*b"CMCH");
const VERSION: u32 = 2;

const MAGIC_AT: W32 = W32::at(0);
const VERSION_AT: W32 = W32::at(4);
const ID_AT: W64 = W64::at(8);
const QUEUED_AT: W64 = W64::at(16);
const LIMIT_AT: W64 = W64::at(24);
const CAPACITY_AT: W32 = W32::at(32);
const FREE_AT: W32 = W32::at(36);
const SLEEPERS_AT: W32 = W32::at(40);
const ROOM_AT: W32 = W32::at(44);
const ROOM_WAITERS_AT: W32 = W32::at(48);
const ASLEEP_AT: W32 = W32::at(52);
const WRITTEN_AT: W32 = W32::at(56);
const READ_AT: W32 = W32::at(60);

/// The most messages a bounded channel may hold.
pub(crate) const MAX_CAPACITY: usize = i32::MAX as usize;

/// The smallest limit accepted from another process: below it no frame would fit.
const MIN_LIMIT: u64 = 16 << 10;

/// How long a waiter sleeps before it looks again at what a futex wake alone cannot tell it (a
/// receiver that is gone, a wake lost with a process killed between its change and its wake).
pub(super) const SLICE: Duration = Duration::from_millis(100);

/// The shared counters of one channel, as this process maps them.
#[derive(Clone)]
pub(crate) struct Gauge {
    region: Arc<Region>,
    /// Read once: the words may change under us, these must not. `limit`: the most that frames
    /// on the socket may cost when a sender writes one directly.
    pub(super) limit: u64,
    capacity: u32,
}

impl Gauge {
    /// Fresh counters for a channel of `capacity` messages (0: unbounded), whose socket has a
    /// send buffer of `send_buffer` bytes.
    pub(super) fn new(capacity: u32, send_buffer: usize) -> Result<Gauge> {
        let region = Region::anonymous()?;
        let limit = (send_buffer as u64 / 4 * 3).max(MIN_LIMIT);
        region.u64(ID_AT).store(crate::sync::fresh_id(), Ordering::Relaxed);
        region.u64(LIMIT_AT).store(limit, Ordering::Relaxed);
        region.u32(CAPACITY_AT).store(capacity, Ordering::Relaxed);
        region.u32(FREE_AT).store(capacity, Ordering::Relaxed);
        region.u32(VERSION_AT).store(VERSION, Ordering::Relaxed);
        region.u32(MAGIC_AT).store(MAGIC, Ordering::Release);
        Ok(Gauge { region: Arc::new(region), limit, capacity })
    }

    /// The counters of a channel that arrived in a message; refused unless they are ours.
    pub(super) fn from_memory(shm: Arc<MemoryFile>) -> Result<Gauge> {
        let region = Region::from_memory(shm)?;
        if region.u32(MAGIC_AT).load(Ordering::Acquire) != MAGIC {
            return Err(Error::Malformed("a channel's shared counters are not ours".into()));
        }
        let version = region.u32(VERSION_AT).load(Ordering::Relaxed);
        if version != VERSION {
            return Err(Error::Malformed(format!(
                "a channel's shared counters of layout version {version}, not {VERSION}"
            )));
        }
        let limit = region.u64(LIMIT_AT).load(Ordering::Relaxed);
        let capacity = region.u32(CAPACITY_AT).load(Ordering::Relaxed);
        if limit < MIN_LIMIT || capacity as usize > MAX_CAPACITY {
            return Err(Error::Malformed(format!(
                "a channel's shared counters are out of range (limit {limit}, capacity {capacity})"
            )));
        }
        Ok(Gauge { region: Arc::new(region), limit, capacity })
    }

    /// The shared memory, to send to another process.
    pub(super) fn memory(&self) -> Result<Arc<MemoryFile>> {
        self.region.memory().cloned().ok_or_else(|| Error::Unsupported("a channel's counters without memory".into()))
    }

    /// Tells channels apart: ends of one channel agree.
    pub(super) fn id(&self) -> u64 {
        self.region.u64(ID_AT).load(Ordering::Relaxed)
    }

    /// The capacity of a bounded channel; `None` when unbounded.
    pub(super) fn capacity(&self) -> Option<u32> {
        (self.capacity > 0).then_some(self.capacity)
    }

    /// Messages queued in a bounded channel now (0 when unbounded).
    pub(super) fn queued_messages(&self) -> u32 {
        self.capacity.saturating_sub(self.region.u32(FREE_AT).load(Ordering::Relaxed))
    }

    /// Counts a frame of `cost` on the socket if that keeps it within the limit.
    pub(super) fn try_reserve(&self, cost: u64) -> bool {
        self.region
            .u64(QUEUED_AT)
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                q.checked_add(cost).filter(|&after| after <= self.limit)
            })
            .is_ok()
    }

    /// Counts a frame of `cost` on the socket, within the limit or not (a feeder's frame, whose
    /// write may wait).
    pub(super) fn reserve(&self, cost: u64) {
        self.region.u64(QUEUED_AT).fetch_add(cost, Ordering::AcqRel);
    }

    /// What the frames on the socket are counted to cost now.
    #[cfg(test)]
    pub(super) fn queued(&self) -> u64 {
        self.region.u64(QUEUED_AT).load(Ordering::SeqCst)
    }

    /// Whether the socket is nearly drained: the reader is about to run out of frames.
    pub(super) fn nearly_drained(&self) -> bool {
        self.region.u64(QUEUED_AT).load(Ordering::SeqCst) <= self.limit / 4
    }

    /// A frame of `cost` left the socket (read, or never written). When that drains the socket
    /// nearly (a quarter of the limit), wakes the feeders waiting for it: once per crossing.
    pub(super) fn release(&self, cost: u64) {
        let before = self
            .region
            .u64(QUEUED_AT)
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |q| Some(q.saturating_sub(cost)))
            .unwrap_or(0);
        let after = before.saturating_sub(cost);
        let low = self.limit / 4;
        if before > low && after <= low && self.region.u32(ROOM_WAITERS_AT).load(Ordering::SeqCst) != 0 {
            let room = self.region.u32(ROOM_AT);
            room.fetch_add(1, Ordering::SeqCst);
            sys::futex_wake_all(room);
        }
    }

    /// Sleeps until the socket is nearly drained, or `timeout` passes. (A waiter announces
    /// itself before it looks: a release that drains the socket after the look sees it, and
    /// its wake finds it asleep or makes its sleep return at once.)
    pub(super) fn wait_until_drained(&self, timeout: Duration) {
        let room = self.region.u32(ROOM_AT);
        let waiters = self.region.u32(ROOM_WAITERS_AT);
        waiters.fetch_add(1, Ordering::SeqCst);
        let seen = room.load(Ordering::SeqCst);
        if !self.nearly_drained() {
            sys::futex_wait(room, seen, Some(timeout));
        }
        waiters.fetch_sub(1, Ordering::SeqCst);
    }

    /// A frame of ours is about to be written to the socket (before the write: a spinning
    /// receiver that sees `written == read` need not ask the kernel).
    pub(super) fn writing_frame(&self) {
        self.region.u32(WRITTEN_AT).fetch_add(1, Ordering::SeqCst);
    }

    /// A frame counted with [`writing_frame`](Self::writing_frame) was not written after all.
    pub(super) fn frame_not_written(&self) {
        self.region.u32(WRITTEN_AT).fetch_sub(1, Ordering::SeqCst);
    }

    /// The receiver read a frame from the socket.
    pub(super) fn frame_read(&self) {
        self.region.u32(READ_AT).fetch_add(1, Ordering::SeqCst);
    }

    /// The frames our senders have counted as written to the socket (wrapping).
    pub(super) fn frames_written(&self) -> u32 {
        self.region.u32(WRITTEN_AT).load(Ordering::SeqCst)
    }

    /// The frames the receiver has read from the socket (wrapping).
    pub(super) fn frames_read(&self) -> u32 {
        self.region.u32(READ_AT).load(Ordering::SeqCst)
    }

    /// Whether the receiver has read `written` frames from the socket (wrapping): then every
    /// frame written before [`frames_written`](Self::frames_written) said `written` has been
    /// read, as the socket keeps their order and every frame written to it is counted before
    /// its write.
    pub(super) fn frames_read_past(&self, written: u32) -> bool {
        self.frames_read().wrapping_sub(written) as i32 >= 0
    }

    /// True when every frame our senders wrote to the socket has been read (a killed writer can
    /// keep it false: README.md, "Rings", Trust).
    pub(super) fn socket_read_up(&self) -> bool {
        self.region.u32(WRITTEN_AT).load(Ordering::SeqCst) == self.region.u32(READ_AT).load(Ordering::SeqCst)
    }

    /// True while the receiver waits in the kernel: a message written to a ring then needs a
    /// wake on the socket.
    pub(super) fn receiver_asleep(&self) -> bool {
        self.region.u32(ASLEEP_AT).load(Ordering::SeqCst) != 0
    }

    /// Announces a wait of the receiver in the kernel, until the guard drops; the caller looks at
    /// the rings once more after this and before it waits (README.md, "Rings", Sleep).
    pub(super) fn asleep(&self) -> Asleep {
        self.region.u32(ASLEEP_AT).fetch_add(1, Ordering::SeqCst);
        // Before the caller's look at the rings (a sender fences between its write and its
        // look at this word).
        std::sync::atomic::fence(Ordering::SeqCst);
        Asleep(self.region.clone())
    }

    /// Forgets waits announced by another process that held the receiving end (it moved here).
    pub(super) fn forget_sleepers(&self) {
        self.region.u32(ASLEEP_AT).store(0, Ordering::SeqCst);
    }

    /// Takes a free place of a bounded channel: at once or not at all (`deadline` `Some(None)`),
    /// waiting until `deadline` (`Some(Some(_))`), or for as long as it takes (`None`). `gone`
    /// says whether the receiver has gone; it is asked whenever no place is free. Fails with
    /// [`Refused::Full`], [`Refused::Timeout`] or a disconnection.
    pub(super) fn take_place(
        &self,
        deadline: Option<Option<Instant>>,
        gone: impl Fn() -> bool,
    ) -> std::result::Result<(), Refused> {
        let gone_or = |other| if gone() { Refused::Failed(SendFailure::Disconnected) } else { other };
        let free = self.region.u32(FREE_AT);
        let sleepers = self.region.u32(SLEEPERS_AT);
        loop {
            let mut now = free.load(Ordering::Acquire);
            while now > 0 {
                match free.compare_exchange_weak(now, now - 1, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return Ok(()),
                    Err(seen) => now = seen,
                }
            }
            let limit = match deadline {
                Some(None) => return Err(gone_or(Refused::Full)),
                Some(Some(d)) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        // A receiver that is gone says so whatever the time left, as a try does.
                        return Err(gone_or(Refused::Timeout));
                    }
                    left.min(SLICE)
                }
                None => SLICE,
            };
            if gone() {
                return Err(Refused::Failed(SendFailure::Disconnected));
            }
            // Announce, look again, sleep only on 0: a receiver that frees a place after our
            // look sees us and wakes us (the Semaphore's protocol, src/sync/README.md).
            sleepers.fetch_add(1, Ordering::SeqCst);
            if free.load(Ordering::SeqCst) == 0 {
                sys::futex_wait(free, 0, Some(limit));
            }
            sleepers.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Gives back `n` places of a bounded channel: their messages were received (or lost with
    /// a batch), or a send failed.
    pub(super) fn free_places(&self, n: u64) {
        if self.capacity == 0 || n == 0 {
            return;
        }
        let free = self.region.u32(FREE_AT);
        let capacity = self.capacity;
        let more = |f: u32| u32::try_from(n).unwrap_or(u32::MAX).min(capacity.saturating_sub(f));
        // Never beyond the capacity, whatever a forged message or a foreign process did.
        if let Ok(before) =
            free.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |f| (f < capacity).then(|| f + more(f)))
            && self.region.u32(SLEEPERS_AT).load(Ordering::SeqCst) != 0
        {
            sys::futex_wake(free, more(before));
        }
    }
}

/// A wait of the receiver in the kernel, announced in the counters while it lives.
pub(super) struct Asleep(Arc<Region>);

impl Drop for Asleep {
    fn drop(&mut self) {
        let _ = self.0.u32(ASLEEP_AT).fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_written_and_read_and_the_receivers_sleep_are_counted() {
        let g = Gauge::new(0, 1 << 20).unwrap();
        let other = Gauge::from_memory(g.memory().unwrap()).unwrap();
        assert!(g.socket_read_up());
        g.writing_frame();
        assert!(!other.socket_read_up());
        g.writing_frame();
        g.frame_not_written();
        other.frame_read();
        assert!(g.socket_read_up());
        assert!(!g.receiver_asleep());
        let a = other.asleep();
        let b = other.asleep();
        assert!(g.receiver_asleep());
        drop(a);
        assert!(g.receiver_asleep());
        drop(b);
        assert!(!g.receiver_asleep());
        let c = other.asleep();
        g.forget_sleepers();
        assert!(!g.receiver_asleep());
        drop(c); // never below zero
        assert!(!g.receiver_asleep());
    }

    #[test]
    fn reservations_stay_within_the_limit_and_a_drained_socket_wakes_the_feeder() {
        let g = Gauge::new(0, 64 << 10).unwrap();
        assert_eq!(g.limit, 48 << 10);
        assert!(g.try_reserve(40 << 10));
        assert!(!g.try_reserve(10 << 10));
        assert!(!g.nearly_drained());
        g.reserve(10 << 10); // a feeder's frame passes the limit
        g.release(50 << 10);
        assert!(g.nearly_drained());
        assert!(g.try_reserve(48 << 10));
        g.release(u64::MAX); // never below zero
        assert!(g.try_reserve(g.limit));
        g.release(g.limit);
        g.wait_until_drained(Duration::from_secs(5)); // drained now: returns at once
        // A feeder asleep is woken when a release drains the socket.
        assert!(g.try_reserve(g.limit));
        let other = g.clone();
        let start = Instant::now();
        let waiter = std::thread::spawn(move || other.wait_until_drained(Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(20));
        g.release(g.limit);
        waiter.join().unwrap();
        assert!(start.elapsed() < Duration::from_secs(4), "woken, not timed out");
    }

    #[test]
    fn places_of_a_bounded_channel_are_taken_and_given_back() {
        let g = Gauge::new(2, 1 << 20).unwrap();
        assert_eq!(g.capacity(), Some(2));
        assert!(g.take_place(Some(None), || false).is_ok());
        assert!(g.take_place(None, || false).is_ok());
        assert_eq!(g.queued_messages(), 2);
        assert!(matches!(g.take_place(Some(None), || false), Err(Refused::Full)));
        let start = Instant::now();
        assert!(matches!(g.take_place(Some(Some(start + Duration::from_millis(30))), || false), Err(Refused::Timeout)));
        assert!(start.elapsed() >= Duration::from_millis(30));
        assert!(matches!(g.take_place(None, || true), Err(Refused::Failed(SendFailure::Disconnected))));
        let other = Gauge::from_memory(g.memory().unwrap()).unwrap();
        assert_eq!(other.id(), g.id());
        let waiter = std::thread::spawn(move || other.take_place(None, || false));
        std::thread::sleep(Duration::from_millis(20));
        g.free_places(1);
        assert!(waiter.join().unwrap().is_ok());
        g.free_places(1);
        g.free_places(1);
        g.free_places(1); // one too many: ignored
        assert_eq!(g.queued_messages(), 0);
        assert_eq!(Gauge::new(0, 1 << 20).unwrap().capacity(), None);
    }

    #[test]
    fn foreign_memory_is_refused() {
        let garbage = MemoryFile::zeroed(BYTES).unwrap();
        // SAFETY: in bounds of the fresh mapping, which nothing else uses.
        unsafe { std::ptr::write_bytes(garbage.ptr(), 0xab, BYTES) };
        assert!(matches!(Gauge::from_memory(Arc::new(garbage)), Err(Error::Malformed(_))));
        let short = Arc::new(MemoryFile::zeroed(8).unwrap());
        assert!(matches!(Gauge::from_memory(short), Err(Error::Malformed(_))));
    }
}
