//! [`Lock`]: mutual exclusion between processes, which notices a holder that died.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::region::{Region, W32, W64};
use super::{BODY, Kind, Object, Open, deadline, object_serde, slice, time_left};
use crate::error::{Error, Result};
use crate::sys;

/// The lock word: the holder's pid (0: free) and [`WAITERS`].
const WORD: W32 = W32::at(BODY);
/// When the holder started (0: not known yet), to tell it from a later process with its pid.
const HOLDER_START: W64 = W64::at(BODY + 8);
/// The pid namespace of the lock's creator.
const NAMESPACE: W64 = W64::at(BODY + 16);

/// The holder's pid in the lock word (Linux pids are at most 2^22).
const PID: u32 = (1 << 30) - 1;
/// Someone may sleep on the word: a release must wake one.
const WAITERS: u32 = 1 << 31;

/// A lock shared between processes, like Python's `multiprocessing.Lock`, held through an
/// RAII [`LockGuard`]. Unlike Python's, it notices a holder that ended without releasing it
/// (killed, crashed, exited): the next process to acquire it gets it with
/// [`LockError::OwnerDied`], which names the dead holder and carries the guard, so that it can
/// repair what the holder may have left half-done, as with a robust POSIX mutex.
///
/// The lock belongs to a process, not a thread: threads of one process exclude each other
/// too, but a thread that acquires it again while holding it waits for itself (use a
/// timeout), as with `std::sync::Mutex`.
///
/// ```no_run
/// use cuda_mp::{HostTensor, Lock};
///
/// fn add_one((lock, counter): (Lock, HostTensor<i64>)) {
///     for _ in 0..100 {
///         let _guard = lock.acquire().unwrap();
///         let v = counter.to_vec()[0]; // read, then write: only safe under the lock
///         counter.fill(v + 1);
///     }
/// }
///
/// #[cuda_mp::main]
/// fn main() {
///     let lock = Lock::new().unwrap();
///     let counter = HostTensor::<i64>::zeros(&[1]).unwrap();
///     cuda_mp::spawn_n(4, (lock, counter.clone()), |(_, args)| add_one(args)).unwrap();
///     assert_eq!(counter.to_vec()[0], 400);
/// }
/// ```
#[derive(Clone)]
pub struct Lock {
    object: Arc<Object>,
}

impl Lock {
    /// A new, free lock in anonymous shared memory, for this process and the processes it is
    /// sent to.
    ///
    /// ```
    /// let lock = cuda_mp::Lock::new().unwrap();
    /// assert!(!lock.is_locked());
    /// ```
    pub fn new() -> Result<Lock> {
        Ok(Lock { object: Arc::new(Object::anonymous(Kind::Lock, init)?) })
    }

    /// A new, free lock named `name`, for processes that meet by name; this process owns the
    /// name, which is removed when this handle and its clones are dropped. See
    /// [`Event::create`](crate::Event::create) for names.
    ///
    /// ```
    /// let lock = cuda_mp::Lock::create("doc-lock-create").unwrap();
    /// assert_eq!(lock.name(), Some("doc-lock-create"));
    /// ```
    pub fn create(name: &str) -> Result<Lock> {
        Lock::named(name, Open::Create)
    }

    /// Opens the lock named `name` while its creator holds it; see
    /// [`Event::open`](crate::Event::open). A lock made in another pid namespace (another
    /// container) is refused: its holders' pids mean nothing here.
    ///
    /// ```
    /// let made = cuda_mp::Lock::create("doc-lock-open").unwrap();
    /// let opened = cuda_mp::Lock::open("doc-lock-open").unwrap();
    /// let _guard = made.acquire().unwrap();
    /// assert!(opened.try_acquire().unwrap_err().is_would_block());
    /// ```
    pub fn open(name: &str) -> Result<Lock> {
        Lock::named(name, Open::Existing)
    }

    /// Opens the lock named `name`, or creates it (free) if there is none.
    ///
    /// ```
    /// let a = cuda_mp::Lock::open_or_create("doc-lock-either").unwrap();
    /// let b = cuda_mp::Lock::open_or_create("doc-lock-either").unwrap();
    /// let _guard = a.acquire().unwrap();
    /// assert!(b.is_locked());
    /// ```
    pub fn open_or_create(name: &str) -> Result<Lock> {
        Lock::named(name, Open::Either)
    }

    fn named(name: &str, open: Open) -> Result<Lock> {
        Ok(Lock { object: Arc::new(Object::named(Kind::Lock, name, open, init, check)?) })
    }

    /// The name, for a lock made or opened by name.
    ///
    /// ```
    /// assert_eq!(cuda_mp::Lock::new().unwrap().name(), None);
    /// ```
    pub fn name(&self) -> Option<&str> {
        self.object.name.as_deref()
    }

    fn word(&self) -> &AtomicU32 {
        self.object.region.u32(WORD)
    }

    fn holder_start(&self) -> &AtomicU64 {
        self.object.region.u64(HOLDER_START)
    }

    /// True while some process holds the lock.
    ///
    /// ```
    /// let lock = cuda_mp::Lock::new().unwrap();
    /// let guard = lock.acquire().unwrap();
    /// assert!(lock.is_locked());
    /// drop(guard);
    /// assert!(!lock.is_locked());
    /// ```
    pub fn is_locked(&self) -> bool {
        self.holder().is_some()
    }

    /// The pid of the process that holds the lock, if one does.
    ///
    /// ```
    /// let lock = cuda_mp::Lock::new().unwrap();
    /// let _guard = lock.acquire().unwrap();
    /// assert_eq!(lock.holder(), Some(std::process::id()));
    /// ```
    pub fn holder(&self) -> Option<u32> {
        Some(self.word().load(Ordering::Relaxed) & PID).filter(|&pid| pid != 0)
    }

    /// Blocks until this process holds the lock. Fails only with [`LockError::OwnerDied`],
    /// which holds the lock all the same.
    ///
    /// ```
    /// let lock = cuda_mp::Lock::new().unwrap();
    /// {
    ///     let _guard = lock.acquire().unwrap();
    ///     // ... exclusive work ...
    /// } // released here
    /// ```
    pub fn acquire(&self) -> std::result::Result<LockGuard<'_>, LockError<'_>> {
        self.acquire_until(None, false)
    }

    /// Takes the lock if it is free, without blocking; [`LockError::WouldBlock`] when another
    /// holder (or this process, on another thread) has it.
    ///
    /// ```
    /// let lock = cuda_mp::Lock::new().unwrap();
    /// let guard = lock.try_acquire().unwrap();
    /// assert!(lock.try_acquire().unwrap_err().is_would_block());
    /// drop(guard);
    /// assert!(lock.try_acquire().is_ok());
    /// ```
    pub fn try_acquire(&self) -> std::result::Result<LockGuard<'_>, LockError<'_>> {
        self.acquire_until(None, true)
    }

    /// Like [`acquire`](Self::acquire), giving up after `timeout` with
    /// [`LockError::Timeout`].
    ///
    /// ```
    /// use std::time::Duration;
    /// let lock = cuda_mp::Lock::new().unwrap();
    /// let _guard = lock.acquire().unwrap();
    /// assert!(lock.acquire_timeout(Duration::from_millis(10)).unwrap_err().is_timeout());
    /// ```
    pub fn acquire_timeout(&self, timeout: Duration) -> std::result::Result<LockGuard<'_>, LockError<'_>> {
        self.acquire_until(deadline(timeout), false)
    }

    fn acquire_until(
        &self,
        deadline: Option<Instant>,
        once: bool,
    ) -> std::result::Result<LockGuard<'_>, LockError<'_>> {
        let word = self.word();
        let me = sys::own_pid() & PID;
        let mut slept = false;
        loop {
            let current = word.load(Ordering::Acquire);
            let holder = current & PID;
            if holder == 0 {
                // Free. After a sleep others may sleep too: keep their flag for our release.
                let flag = if slept { WAITERS } else { current & WAITERS };
                if word.compare_exchange(current, me | flag, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                    self.holder_start().store(sys::own_start(), Ordering::Release);
                    return Ok(LockGuard { lock: self, pid: me });
                }
                continue;
            }
            if let Some(dead_start) = self.holder_gone(current) {
                if holder == me {
                    // An earlier process with this pid died holding it: the word names us
                    // already, so the start time decides which of this process's threads takes
                    // it over (a swap of the word from our pid to our pid would let several).
                    if self
                        .holder_start()
                        .compare_exchange(dead_start, sys::own_start(), Ordering::AcqRel, Ordering::Relaxed)
                        .is_ok()
                    {
                        return Err(LockError::OwnerDied { pid: holder, guard: LockGuard { lock: self, pid: me } });
                    }
                    continue;
                }
                // Take it over from the dead holder; of several waiters, one succeeds. The dead
                // holder's start time goes first (a waiter that looks between the take-over
                // and the new start time must not judge the new holder by it), unless the
                // winner's is already there.
                let _ = self.holder_start().compare_exchange(dead_start, 0, Ordering::AcqRel, Ordering::Relaxed);
                // Tried again while the word still names the dead holder (another waiter set
                // its flag meanwhile): given up, the start time cleared above would make every
                // waiter judge the dead holder by its pid alone, which another process may
                // have taken since.
                let mut seen = current;
                loop {
                    match word.compare_exchange(seen, me | (seen & WAITERS), Ordering::Acquire, Ordering::Relaxed) {
                        Ok(_) => {
                            self.holder_start().store(sys::own_start(), Ordering::Release);
                            return Err(LockError::OwnerDied { pid: holder, guard: LockGuard { lock: self, pid: me } });
                        }
                        Err(now) if now & PID == holder => seen = now,
                        Err(_) => break,
                    }
                }
                continue;
            }
            if once {
                return Err(LockError::WouldBlock);
            }
            if current & WAITERS == 0
                && word.compare_exchange(current, current | WAITERS, Ordering::Relaxed, Ordering::Relaxed).is_err()
            {
                continue;
            }
            let left = time_left(deadline);
            if left == Some(Duration::ZERO) {
                return Err(LockError::Timeout);
            }
            // Woken by a release, or after a slice to look at the holder again.
            sys::futex_wait(word, current | WAITERS, Some(slice(left)));
            slept = true;
        }
    }

    /// True when the holder named in `current` (the lock word just read) has ended.
    /// The start time of the holder in `current` if it has died (0 when it had not written
    /// one), `None` while it lives.
    fn holder_gone(&self, current: u32) -> Option<u64> {
        let start = self.holder_start().load(Ordering::Acquire);
        // The start time belongs to this holder only if the word is unchanged meanwhile (it is
        // 0 while a holder is between taking the word and writing its start time).
        if self.word().load(Ordering::Acquire) != current {
            return None;
        }
        let pid = current & PID;
        let gone = if pid == sys::own_pid() & PID {
            // This process (another thread, or this one again), unless an earlier process
            // with our pid died holding it.
            start != 0 && start != sys::own_start()
        } else {
            sys::process_gone(pid, start)
        };
        gone.then_some(start)
    }

    /// Releases the lock taken by process `pid` (a guard's), if that is this process and the
    /// lock word names it. A guard that a child forked without `exec` copied is its parent's,
    /// which holds the lock still: the child's drop of it leaves the lock alone, whoever holds
    /// it then (the child itself included).
    fn release(&self, pid: u32) {
        let me = sys::own_pid() & PID;
        let word = self.word();
        let mut current = word.load(Ordering::Acquire);
        if pid != me || current & PID != me {
            return;
        }
        self.holder_start().store(0, Ordering::Release);
        // Waiters may set their flag meanwhile; nobody else changes a word that names us.
        while let Err(now) = word.compare_exchange(current, 0, Ordering::Release, Ordering::Acquire) {
            current = now;
        }
        if current & WAITERS != 0 {
            sys::futex_wake(word, 1);
        }
    }
}

fn init(region: &Region) {
    region.u64(NAMESPACE).store(sys::pid_namespace(), Ordering::Relaxed);
}

fn check(region: &Region) -> Result<()> {
    let theirs = region.u64(NAMESPACE).load(Ordering::Relaxed);
    let ours = sys::pid_namespace();
    if theirs != 0 && ours != 0 && theirs != ours {
        return Err(Error::Unsupported(
            "this lock was made in another pid namespace: the pids of its holders mean nothing here".into(),
        ));
    }
    Ok(())
}

impl fmt::Debug for Lock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lock").field("name", &self.name()).field("holder", &self.holder()).finish()
    }
}

object_serde!(Lock, check);

/// Holds a [`Lock`]; dropping it releases the lock and wakes one waiter.
///
/// ```
/// let lock = cuda_mp::Lock::new().unwrap();
/// let guard = lock.acquire().unwrap();
/// println!("{guard:?}");
/// drop(guard);
/// assert!(!lock.is_locked());
/// ```
pub struct LockGuard<'a> {
    lock: &'a Lock,
    /// The process that took the lock (a forked child's copy of the guard is not its own).
    pid: u32,
}

impl Drop for LockGuard<'_> {
    fn drop(&mut self) {
        self.lock.release(self.pid);
    }
}

impl fmt::Debug for LockGuard<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard").field("lock", self.lock).finish()
    }
}

/// Why [`Lock::acquire`], [`Lock::try_acquire`] or [`Lock::acquire_timeout`] did not simply
/// return a guard.
///
/// ```
/// use std::time::Duration;
/// let lock = cuda_mp::Lock::new().unwrap();
/// let _held = lock.acquire().unwrap();
/// let err = lock.acquire_timeout(Duration::from_millis(1)).unwrap_err();
/// assert_eq!(err.to_string(), "timed out waiting for the lock");
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum LockError<'a> {
    /// The timeout passed while another holder had the lock.
    Timeout,
    /// The lock is held (by another process, or by this one on another thread).
    WouldBlock,
    /// The process that held the lock ended without releasing it. This process holds the lock
    /// now, through `guard`; what the lock protects may be half-updated.
    OwnerDied {
        /// The dead holder's pid.
        pid: u32,
        /// The lock, now held by this process.
        guard: LockGuard<'a>,
    },
}

impl<'a> LockError<'a> {
    /// True when the timeout passed.
    ///
    /// ```
    /// let lock = cuda_mp::Lock::new().unwrap();
    /// let _held = lock.acquire().unwrap();
    /// assert!(lock.acquire_timeout(std::time::Duration::ZERO).unwrap_err().is_timeout());
    /// ```
    pub fn is_timeout(&self) -> bool {
        matches!(self, LockError::Timeout)
    }

    /// True when [`Lock::try_acquire`] found the lock held.
    ///
    /// ```
    /// let lock = cuda_mp::Lock::new().unwrap();
    /// let _held = lock.acquire().unwrap();
    /// assert!(lock.try_acquire().unwrap_err().is_would_block());
    /// ```
    pub fn is_would_block(&self) -> bool {
        matches!(self, LockError::WouldBlock)
    }

    /// True when the previous holder died holding the lock (this process holds it now).
    ///
    /// ```
    /// let lock = cuda_mp::Lock::new().unwrap();
    /// let _held = lock.acquire().unwrap();
    /// assert!(!lock.try_acquire().unwrap_err().is_owner_died()); // the holder lives
    /// ```
    pub fn is_owner_died(&self) -> bool {
        matches!(self, LockError::OwnerDied { .. })
    }

    /// The guard of [`LockError::OwnerDied`], for a caller that accepts taking over from a
    /// dead holder; other errors come back as they are.
    ///
    /// ```
    /// use cuda_mp::LockError;
    /// let lock = cuda_mp::Lock::new().unwrap();
    /// let guard = lock.acquire().or_else(LockError::recover).unwrap();
    /// # drop(guard);
    /// ```
    pub fn recover(self) -> std::result::Result<LockGuard<'a>, LockError<'a>> {
        match self {
            LockError::OwnerDied { guard, .. } => Ok(guard),
            other => Err(other),
        }
    }
}

impl fmt::Display for LockError<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockError::Timeout => f.write_str("timed out waiting for the lock"),
            LockError::WouldBlock => f.write_str("the lock is held"),
            LockError::OwnerDied { pid, .. } => write!(
                f,
                "the process that held the lock (pid {pid}) died without releasing it; this process holds it now"
            ),
        }
    }
}

impl std::error::Error for LockError<'_> {}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child forked while its parent held the lock drops its copy of the guard: the parent
    /// still holds the lock (before, the child's drop released it under the parent).
    #[test]
    fn a_forked_childs_copy_of_a_guard_leaves_the_parents_lock_held() {
        let lock = Lock::new().unwrap();
        let held = std::cell::Cell::new(Some(lock.acquire().unwrap()));
        let released_in_child = sys::fork_and_run(|| {
            drop(held.take());
            !lock.is_locked()
        })
        .unwrap();
        assert!(!released_in_child, "the child's copy of the guard released the parent's lock");
        assert_eq!(lock.holder(), Some(std::process::id()));
        drop(held.take());
        assert!(!lock.is_locked(), "the parent's own guard releases it");
    }

    /// A child that takes the lock once its parent let go keeps it when it drops its stale copy
    /// of the parent's guard.
    #[test]
    fn a_stale_copy_of_the_parents_guard_leaves_the_childs_own_hold() {
        let lock = Lock::new().unwrap();
        let held = std::sync::Mutex::new(Some(lock.acquire().unwrap()));
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                drop(held.lock().unwrap().take());
            });
            let kept = sys::fork_and_run(|| {
                let Ok(own) = lock.acquire_timeout(Duration::from_secs(10)) else { return false };
                drop(held.lock().unwrap().take());
                let kept = lock.holder() == Some(std::process::id());
                drop(own);
                kept
            })
            .unwrap();
            assert!(kept, "a stale copy of the parent's guard released the child's own hold");
        });
    }

    #[test]
    fn a_dead_holder_is_taken_over_once() {
        let lock = Lock::new().unwrap();
        // A holder that cannot exist (pids are at most 2^22) with a waiter flag.
        lock.word().store(0x3fff_fff0 | WAITERS, Ordering::Release);
        let err = lock.try_acquire().unwrap_err();
        assert!(matches!(err, LockError::OwnerDied { pid: 0x3fff_fff0, .. }), "{err:?}");
        assert_eq!(lock.holder(), Some(std::process::id()));
        assert!(lock.try_acquire().unwrap_err().is_would_block());
        drop(err);
        assert!(!lock.is_locked());
        assert!(lock.try_acquire().is_ok());
    }

    #[test]
    fn of_this_processs_threads_one_takes_over_from_a_dead_holder_with_our_pid() {
        let lock = Lock::new().unwrap();
        // An earlier process with our pid died holding it (another start time).
        lock.word().store(sys::own_pid() & PID, Ordering::Release);
        lock.holder_start().store(sys::own_start() + 1, Ordering::Release);
        let taken = std::sync::atomic::AtomicUsize::new(0);
        let barrier = std::sync::Barrier::new(4);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    barrier.wait();
                    if let Err(LockError::OwnerDied { guard, .. }) = lock.try_acquire() {
                        taken.fetch_add(1, Ordering::SeqCst);
                        // Held until every thread has looked.
                        std::thread::sleep(std::time::Duration::from_millis(200));
                        drop(guard);
                    }
                });
            }
        });
        assert_eq!(taken.load(Ordering::SeqCst), 1, "exactly one thread took it over");
        assert!(!lock.is_locked());
    }

    #[test]
    fn a_waiter_that_lost_the_take_over_leaves_the_winners_start_time() {
        let lock = Lock::new().unwrap();
        lock.word().store(0x3fff_fff0, Ordering::Release);
        lock.holder_start().store(123, Ordering::Release);
        // Two waiters see the dead holder; one takes over first.
        let current = lock.word().load(Ordering::Acquire);
        let seen_by_loser = lock.holder_gone(current);
        assert_eq!(seen_by_loser, Some(123));
        let winner = lock.try_acquire().unwrap_err();
        assert!(matches!(winner, LockError::OwnerDied { .. }));
        // The loser goes on with what it saw: the winner's start time stays.
        let _ = lock.holder_start().compare_exchange(123, 0, Ordering::AcqRel, Ordering::Relaxed);
        assert_eq!(lock.holder_start().load(Ordering::Acquire), sys::own_start());
        assert!(lock.word().compare_exchange(current, 1, Ordering::Acquire, Ordering::Relaxed).is_err());
        drop(winner);
    }

    #[test]
    fn a_live_holder_with_a_stale_start_time_reads_as_gone_only_when_consistent() {
        let lock = Lock::new().unwrap();
        let guard = lock.acquire().unwrap();
        let current = lock.word().load(Ordering::Relaxed);
        assert!(lock.holder_gone(current).is_none());
        // The start time of another process with our pid: the pid was reused.
        lock.holder_start().store(sys::own_start() + 1, Ordering::Relaxed);
        assert!(lock.holder_gone(current).is_some());
        // Unknown start time: the pid alone decides.
        lock.holder_start().store(0, Ordering::Relaxed);
        assert!(lock.holder_gone(current).is_none());
        drop(guard);
    }

    #[test]
    fn threads_of_one_process_exclude_each_other() {
        let lock = Lock::new().unwrap();
        let counter = Arc::new(AtomicU64::new(0));
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..500 {
                        let _g = lock.acquire().unwrap();
                        let v = counter.load(Ordering::Relaxed);
                        std::hint::spin_loop();
                        counter.store(v + 1, Ordering::Relaxed);
                    }
                });
            }
        });
        assert_eq!(counter.load(Ordering::Relaxed), 2000);
        assert!(!lock.is_locked());
    }
}
