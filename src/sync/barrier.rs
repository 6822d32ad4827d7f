//! [`Barrier`]: a meeting point for a fixed number of processes, reusable generation after
//! generation.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::region::{Region, W32, W64};
use super::{BODY, Kind, Object, Open, deadline, invalid, slice, time_left};
use crate::error::{Error, Result};
use crate::sys;

/// The number of parties, fixed at creation.
const PARTIES: W32 = W32::at(BODY);
/// The barrier's word: [`COUNT`], [`BROKEN`], [`RESET`] and the generation.
const STATE: W32 = W32::at(BODY + 4);
/// Which of the last 64 generations began with a reset (bit `generation % 64`), set or cleared
/// by whoever starts a generation before it starts it: a waiter whose generation moved on by
/// any number of rounds (more users than parties) tells its release from a reset there.
const STARTED_BY_RESET: W64 = W64::at(BODY + 8);

/// Parties arrived in this generation (bits 0 to 15).
const COUNT: u32 = 0xffff;
/// The generation is broken: its waiters, and all arrivals until a reset, fail.
const BROKEN: u32 = 1 << 16;
/// This generation began with a reset, not with the release of the one before.
const RESET: u32 = 1 << 17;
/// The generation counter, bits 18 to 31.
const GENERATION_SHIFT: u32 = 18;

/// The most parties a barrier may have.
const MAX_PARTIES: usize = COUNT as usize;

/// A barrier shared between processes, like Python's `multiprocessing.Barrier`: each of
/// `parties` processes (or threads) calls [`wait`](Self::wait), and all of them return once the
/// last has arrived; then the barrier is ready for the next round.
///
/// A wait that times out breaks the barrier, as in Python: the parties waiting, and every wait
/// after, fail with [`BarrierError::Broken`] until [`reset`](Self::reset).
///
/// More users than parties (say three threads at a barrier of two) take part in rounds as
/// they come: a waiter released from a round is released even when later rounds opened before
/// it looked (up to 64 of them).
///
/// ```no_run
/// use cuda_mp::Barrier;
///
/// fn worker((rank, barrier): (usize, Barrier)) -> bool {
///     // ... load this rank's part ...
///     let arrived = barrier.wait().unwrap(); // every rank has loaded
///     arrived.is_leader() // true in exactly one rank
/// }
///
/// #[cuda_mp::main]
/// fn main() {
///     let barrier = Barrier::new(4).unwrap();
///     let leaders = cuda_mp::spawn_n(4, barrier, worker).unwrap();
///     assert_eq!(leaders.iter().filter(|&&l| l).count(), 1);
/// }
/// ```
#[derive(Clone)]
pub struct Barrier {
    object: Arc<Object>,
    /// Read once: the memory is writable by others.
    parties: u32,
}

impl Barrier {
    /// A new barrier for `parties` parties (1 to 65535), in anonymous shared memory.
    ///
    /// ```
    /// let barrier = cuda_mp::Barrier::new(1).unwrap();
    /// assert!(barrier.wait().unwrap().is_leader()); // one party: it is always the last
    /// assert!(cuda_mp::Barrier::new(0).is_err());
    /// ```
    pub fn new(parties: usize) -> Result<Barrier> {
        let parties = check_parties(parties)?;
        let object = Object::anonymous(Kind::Barrier, |r| r.u32(PARTIES).store(parties, Ordering::Relaxed))?;
        Ok(Barrier { object: Arc::new(object), parties })
    }

    /// A new barrier for `parties` parties named `name`; this process owns the name. See
    /// [`Event::create`](crate::Event::create).
    ///
    /// ```
    /// let barrier = cuda_mp::Barrier::create("doc-barrier-create", 2).unwrap();
    /// assert_eq!(barrier.parties(), 2);
    /// ```
    pub fn create(name: &str, parties: usize) -> Result<Barrier> {
        Barrier::named(name, Open::Create, Some(parties))
    }

    /// Opens the barrier named `name` while its creator holds it; see
    /// [`Event::open`](crate::Event::open).
    ///
    /// ```
    /// let made = cuda_mp::Barrier::create("doc-barrier-open", 3).unwrap();
    /// assert_eq!(cuda_mp::Barrier::open("doc-barrier-open").unwrap().parties(), 3);
    /// ```
    pub fn open(name: &str) -> Result<Barrier> {
        Barrier::named(name, Open::Existing, None)
    }

    /// Opens the barrier named `name`, or creates it for `parties` parties if there is none.
    /// An existing barrier for another number of parties is an error.
    ///
    /// ```
    /// let a = cuda_mp::Barrier::open_or_create("doc-barrier-either", 2).unwrap();
    /// let b = cuda_mp::Barrier::open_or_create("doc-barrier-either", 2).unwrap();
    /// assert!(cuda_mp::Barrier::open_or_create("doc-barrier-either", 3).is_err());
    /// let t = std::thread::spawn(move || b.wait().unwrap());
    /// a.wait().unwrap();
    /// t.join().unwrap();
    /// ```
    pub fn open_or_create(name: &str, parties: usize) -> Result<Barrier> {
        Barrier::named(name, Open::Either, Some(parties))
    }

    fn named(name: &str, open: Open, parties: Option<usize>) -> Result<Barrier> {
        let expected = parties.map(check_parties).transpose()?;
        let init = |r: &Region| r.u32(PARTIES).store(expected.unwrap_or(1), Ordering::Relaxed);
        let agree = |r: &Region| {
            let found = check(r)?;
            match expected {
                Some(expected) if expected != found => {
                    Err(invalid(format!("the barrier named {name:?} has {found} parties, not {expected}")))
                }
                _ => Ok(()),
            }
        };
        let object = Object::named(Kind::Barrier, name, open, init, agree)?;
        // Checked again as it is kept: another process may have written the word since.
        let parties = check(&object.region)?;
        Ok(Barrier { object: Arc::new(object), parties })
    }

    /// The name, for a barrier made or opened by name.
    ///
    /// ```
    /// assert_eq!(cuda_mp::Barrier::new(2).unwrap().name(), None);
    /// ```
    pub fn name(&self) -> Option<&str> {
        self.object.name.as_deref()
    }

    fn state(&self) -> &AtomicU32 {
        self.object.region.u32(STATE)
    }

    /// Notes, before the generation of `state` begins, whether a reset begins it.
    fn mark_start(&self, state: u32, by_reset: bool) {
        let bit = 1u64 << ((state >> GENERATION_SHIFT) % 64);
        let ring = self.object.region.u64(STARTED_BY_RESET);
        if by_reset {
            ring.fetch_or(bit, Ordering::SeqCst);
        } else {
            ring.fetch_and(!bit, Ordering::SeqCst);
        }
    }

    /// After losing the race to begin the generation of `intended` (a release against a reset):
    /// the mark this side made before it may have landed after the winner's, so it is set to
    /// what the word says began that generation.
    fn mark_as_begun(&self, now: u32, intended: u32) {
        if now >> GENERATION_SHIFT == intended >> GENERATION_SHIFT {
            self.mark_start(now, now & RESET != 0);
        }
    }

    /// Whether the generation of `state` began with a reset.
    fn started_by_reset(&self, state: u32) -> bool {
        let bit = 1u64 << ((state >> GENERATION_SHIFT) % 64);
        self.object.region.u64(STARTED_BY_RESET).load(Ordering::SeqCst) & bit != 0
    }

    /// The number of parties that must arrive for the barrier to open.
    ///
    /// ```
    /// assert_eq!(cuda_mp::Barrier::new(4).unwrap().parties(), 4);
    /// ```
    pub fn parties(&self) -> usize {
        self.parties as usize
    }

    /// The number of parties waiting now (0 while the barrier is broken).
    ///
    /// ```
    /// assert_eq!(cuda_mp::Barrier::new(4).unwrap().n_waiting(), 0);
    /// ```
    pub fn n_waiting(&self) -> usize {
        let state = self.state().load(Ordering::Relaxed);
        if state & BROKEN != 0 { 0 } else { (state & COUNT) as usize }
    }

    /// True while the barrier is broken (by a timeout or [`abort`](Self::abort)).
    ///
    /// ```
    /// let barrier = cuda_mp::Barrier::new(2).unwrap();
    /// barrier.abort();
    /// assert!(barrier.is_broken());
    /// ```
    pub fn is_broken(&self) -> bool {
        self.state().load(Ordering::Relaxed) & BROKEN != 0
    }

    /// Waits until all parties have arrived; returns this party's arrival index and whether it
    /// arrived last (the leader, which alone may do once-per-round work). Fails with
    /// [`BarrierError::Broken`] when the barrier is or becomes broken.
    ///
    /// ```
    /// let barrier = cuda_mp::Barrier::new(2).unwrap();
    /// let other = barrier.clone();
    /// let t = std::thread::spawn(move || other.wait().unwrap());
    /// let mine = barrier.wait().unwrap();
    /// let theirs = t.join().unwrap();
    /// assert_eq!(mine.index() + theirs.index(), 1); // 0 and 1
    /// assert!(mine.is_leader() != theirs.is_leader());
    /// ```
    pub fn wait(&self) -> std::result::Result<BarrierWaitResult, BarrierError> {
        self.wait_until(None)
    }

    /// Like [`wait`](Self::wait), giving up after `timeout` with [`BarrierError::Timeout`];
    /// the barrier is then broken for the other parties.
    ///
    /// ```
    /// use std::time::Duration;
    /// let barrier = cuda_mp::Barrier::new(2).unwrap();
    /// assert!(barrier.wait_timeout(Duration::from_millis(10)).unwrap_err().is_timeout());
    /// assert!(barrier.wait().unwrap_err().is_broken());
    /// ```
    pub fn wait_timeout(&self, timeout: Duration) -> std::result::Result<BarrierWaitResult, BarrierError> {
        self.wait_until(deadline(timeout))
    }

    fn wait_until(&self, deadline: Option<Instant>) -> std::result::Result<BarrierWaitResult, BarrierError> {
        let state = self.state();
        let mut current = state.load(Ordering::Acquire);
        // Arrive: count ourselves in, or open the barrier as the last party.
        let (index, generation) = loop {
            if current & BROKEN != 0 {
                return Err(BarrierError::Broken);
            }
            let count = current & COUNT;
            if count + 1 >= self.parties {
                let next = next_generation(current);
                self.mark_start(next, false);
                match state.compare_exchange_weak(current, next, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => {
                        // Again, after a reset that lost the race for this generation marked it.
                        self.mark_start(next, false);
                        sys::futex_wake_all(state);
                        let index = count.min(self.parties - 1) as usize;
                        return Ok(BarrierWaitResult { index, leader: true });
                    }
                    Err(now) => {
                        self.mark_as_begun(now, next);
                        current = now;
                    }
                }
                continue;
            }
            match state.compare_exchange_weak(current, current + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break (count as usize, current >> GENERATION_SHIFT),
                Err(now) => current = now,
            }
        };
        loop {
            let now = state.load(Ordering::Acquire);
            let now_generation = now >> GENERATION_SHIFT;
            if now_generation != generation {
                // Opened by the last party, unless a reset ended our generation: the next one
                // then began with a reset. (Past 64 rounds, which no waiter sleeps through
                // unless more users than parties keep the barrier busy, it reads as opened.)
                // One round on, the word itself says how the round began.
                let next = next_generation(generation << GENERATION_SHIFT);
                let moved = now_generation.wrapping_sub(generation) & GENERATION_MASK;
                let released = match moved {
                    1 => now & RESET == 0,
                    2..64 => !self.started_by_reset(next),
                    _ => true,
                };
                return if released {
                    Ok(BarrierWaitResult { index, leader: false })
                } else {
                    Err(BarrierError::Broken)
                };
            }
            if now & BROKEN != 0 {
                return Err(BarrierError::Broken);
            }
            let left = time_left(deadline);
            if left == Some(Duration::ZERO) {
                // Break the barrier for the others, unless it opened meanwhile.
                if state.compare_exchange(now, now | BROKEN, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                    sys::futex_wake_all(state);
                    return Err(BarrierError::Timeout);
                }
                continue;
            }
            // A slice at a time: a last party killed between its change and its wake wakes
            // nobody.
            sys::futex_wait(state, now, Some(slice(left)));
        }
    }

    /// Breaks the barrier: the parties waiting, and every wait until [`reset`](Self::reset),
    /// fail with [`BarrierError::Broken`] (Python's `abort`).
    ///
    /// ```
    /// let barrier = cuda_mp::Barrier::new(2).unwrap();
    /// barrier.abort();
    /// assert!(barrier.wait().unwrap_err().is_broken());
    /// ```
    pub fn abort(&self) {
        let state = self.state();
        let previous = state.fetch_or(BROKEN, Ordering::AcqRel);
        if previous & BROKEN == 0 {
            sys::futex_wake_all(state);
        }
    }

    /// Returns the barrier to its first state, empty and not broken; parties waiting now fail
    /// with [`BarrierError::Broken`] (a party still waking from a round that opened before is
    /// released). A new barrier is often simpler.
    ///
    /// ```
    /// let barrier = cuda_mp::Barrier::new(1).unwrap();
    /// barrier.abort();
    /// barrier.reset();
    /// assert!(barrier.wait().is_ok());
    /// ```
    pub fn reset(&self) {
        let state = self.state();
        let mut current = state.load(Ordering::Relaxed);
        loop {
            let next = next_generation(current);
            self.mark_start(next, true);
            match state.compare_exchange_weak(current, next | RESET, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => {
                    // Again, after a release that lost the race for this generation marked it.
                    self.mark_start(next, true);
                    break;
                }
                Err(now) => {
                    self.mark_as_begun(now, next);
                    current = now;
                }
            }
        }
        sys::futex_wake_all(state);
    }
}

/// The generation bits of a state, shifted down.
const GENERATION_MASK: u32 = u32::MAX >> GENERATION_SHIFT;

/// The state of the generation after `state`'s: nobody arrived, not broken.
fn next_generation(state: u32) -> u32 {
    ((state >> GENERATION_SHIFT).wrapping_add(1) << GENERATION_SHIFT) & !(COUNT | BROKEN | RESET)
}

fn check_parties(parties: usize) -> Result<u32> {
    if parties == 0 || parties > MAX_PARTIES {
        return Err(invalid(format!("a barrier has 1 to {MAX_PARTIES} parties, not {parties}")));
    }
    Ok(parties as u32)
}

/// The number of parties of a barrier made elsewhere.
fn check(region: &Region) -> Result<u32> {
    let parties = region.u32(PARTIES).load(Ordering::Relaxed);
    if parties == 0 || parties as usize > MAX_PARTIES {
        return Err(Error::Malformed(format!("a barrier of {parties} parties")));
    }
    Ok(parties)
}

impl fmt::Debug for Barrier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Barrier")
            .field("name", &self.name())
            .field("parties", &self.parties)
            .field("waiting", &self.n_waiting())
            .field("broken", &self.is_broken())
            .finish()
    }
}

impl Serialize for Barrier {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        self.object.encode(serializer)
    }
}

impl<'de> Deserialize<'de> for Barrier {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let object = Object::decode(deserializer, Kind::Barrier, |r| check(r).map(|_| ()))?;
        let parties = object.region.u32(PARTIES).load(Ordering::Relaxed);
        Ok(Barrier { object: Arc::new(object), parties: parties.clamp(1, MAX_PARTIES as u32) })
    }
}

/// What [`Barrier::wait`] returns to each party.
///
/// ```
/// let barrier = cuda_mp::Barrier::new(1).unwrap();
/// let result = barrier.wait().unwrap();
/// assert_eq!((result.index(), result.is_leader()), (0, true));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BarrierWaitResult {
    index: usize,
    leader: bool,
}

impl BarrierWaitResult {
    /// The party's arrival index in its round: 0 for the first to arrive, `parties - 1` for
    /// the last (Python's return value of `Barrier.wait`).
    ///
    /// ```
    /// assert_eq!(cuda_mp::Barrier::new(1).unwrap().wait().unwrap().index(), 0);
    /// ```
    pub fn index(&self) -> usize {
        self.index
    }

    /// True for the last party to arrive, exactly one per round (like
    /// `std::sync::BarrierWaitResult::is_leader`).
    ///
    /// ```
    /// assert!(cuda_mp::Barrier::new(1).unwrap().wait().unwrap().is_leader());
    /// ```
    pub fn is_leader(&self) -> bool {
        self.leader
    }
}

/// Why a [`Barrier::wait`] failed.
///
/// ```
/// let barrier = cuda_mp::Barrier::new(2).unwrap();
/// barrier.abort();
/// assert_eq!(barrier.wait().unwrap_err().to_string(), "the barrier is broken");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BarrierError {
    /// The barrier is broken: a party timed out, or [`Barrier::abort`] or
    /// [`Barrier::reset`] was called, during this round or before it (Python's
    /// `BrokenBarrierError`).
    #[error("the barrier is broken")]
    Broken,
    /// This wait timed out, and broke the barrier for the other parties.
    #[error("timed out waiting at the barrier; the barrier is now broken")]
    Timeout,
}

impl BarrierError {
    /// True when this wait timed out.
    ///
    /// ```
    /// let barrier = cuda_mp::Barrier::new(2).unwrap();
    /// assert!(barrier.wait_timeout(std::time::Duration::ZERO).unwrap_err().is_timeout());
    /// ```
    pub fn is_timeout(&self) -> bool {
        matches!(self, BarrierError::Timeout)
    }

    /// True when the barrier was broken by another party, or before this wait.
    ///
    /// ```
    /// let barrier = cuda_mp::Barrier::new(2).unwrap();
    /// barrier.abort();
    /// assert!(barrier.wait().unwrap_err().is_broken());
    /// ```
    pub fn is_broken(&self) -> bool {
        matches!(self, BarrierError::Broken)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_follow_each_other_and_a_timeout_breaks_until_reset() {
        let barrier = Barrier::new(3).unwrap();
        for _round in 0..50 {
            let results: Vec<BarrierWaitResult> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..3).map(|_| s.spawn(|| barrier.wait().unwrap())).collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let mut indices: Vec<usize> = results.iter().map(|r| r.index()).collect();
            indices.sort();
            assert_eq!(indices, vec![0, 1, 2]);
            assert_eq!(results.iter().filter(|r| r.is_leader()).count(), 1);
        }
        // One waits, then times out: the other waiter fails too.
        std::thread::scope(|s| {
            let other = s.spawn(|| barrier.wait());
            while barrier.n_waiting() == 0 {
                std::thread::yield_now();
            }
            assert_eq!(barrier.wait_timeout(Duration::from_millis(20)), Err(BarrierError::Timeout));
            assert_eq!(other.join().unwrap(), Err(BarrierError::Broken));
        });
        assert!(barrier.is_broken());
        assert_eq!(barrier.wait(), Err(BarrierError::Broken));
        barrier.reset();
        assert!(!barrier.is_broken());
        // A waiter interrupted by a reset fails; the barrier works afterwards.
        std::thread::scope(|s| {
            let other = s.spawn(|| barrier.wait());
            while barrier.n_waiting() == 0 {
                std::thread::yield_now();
            }
            barrier.reset();
            assert_eq!(other.join().unwrap(), Err(BarrierError::Broken));
        });
        std::thread::scope(|s| {
            let a = s.spawn(|| barrier.wait());
            let b = s.spawn(|| barrier.wait());
            barrier.wait().unwrap();
            a.join().unwrap().unwrap();
            b.join().unwrap().unwrap();
        });
    }

    #[test]
    fn the_generation_wraps() {
        let top = !(COUNT | BROKEN | RESET);
        assert_eq!(next_generation(top | 5 | BROKEN), 0);
        assert_eq!(next_generation(0) >> GENERATION_SHIFT, 1);
    }
}
