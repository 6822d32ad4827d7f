//! [`Semaphore`]: a counter of permits shared between processes.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::region::{Region, W32};
use super::{BODY, Kind, Object, Open, deadline, invalid, object_serde, slice, time_left};
use crate::error::Result;
use crate::sys;

/// The number of free permits.
const COUNT: W32 = W32::at(BODY);
/// How many may be asleep on [`COUNT`]: a release wakes one when this is not 0.
const SLEEPERS: W32 = W32::at(BODY + 4);

/// The most permits a semaphore holds.
const MAX: u32 = i32::MAX as u32;

/// A counting semaphore shared between processes, like Python's `multiprocessing.Semaphore`:
/// [`acquire`](Self::acquire) takes one of its permits, waiting while there is none, and the
/// [`SemaphoreGuard`] it returns gives the permit back when dropped. Permits belong to nobody:
/// a process that dies holding one does not give it back (use a [`Lock`](crate::Lock) where
/// that matters).
///
/// ```no_run
/// use cuda_mp::Semaphore;
///
/// fn worker((rank, slots): (usize, Semaphore)) -> usize {
///     let _slot = slots.acquire(); // at most 2 workers in here at once
///     rank
/// }
///
/// #[cuda_mp::main]
/// fn main() {
///     let slots = Semaphore::new(2).unwrap();
///     cuda_mp::spawn_n(4, slots, worker).unwrap();
/// }
/// ```
#[derive(Clone)]
pub struct Semaphore {
    object: Arc<Object>,
}

impl Semaphore {
    /// A new semaphore with `permits` free permits (at most `i32::MAX`), in anonymous shared
    /// memory.
    ///
    /// ```
    /// let s = cuda_mp::Semaphore::new(3).unwrap();
    /// assert_eq!(s.value(), 3);
    /// assert!(cuda_mp::Semaphore::new(u32::MAX).is_err());
    /// ```
    pub fn new(permits: u32) -> Result<Semaphore> {
        check_permits(permits)?;
        let object = Object::anonymous(Kind::Semaphore, |r| r.u32(COUNT).store(permits, Ordering::Relaxed))?;
        Ok(Semaphore { object: Arc::new(object) })
    }

    /// A new semaphore named `name` with `permits` free permits; this process owns the name.
    /// See [`Event::create`](crate::Event::create).
    ///
    /// ```
    /// let s = cuda_mp::Semaphore::create("doc-semaphore-create", 2).unwrap();
    /// assert_eq!(s.value(), 2);
    /// ```
    pub fn create(name: &str, permits: u32) -> Result<Semaphore> {
        Semaphore::named(name, Open::Create, permits)
    }

    /// Opens the semaphore named `name` while its creator holds it; see
    /// [`Event::open`](crate::Event::open).
    ///
    /// ```
    /// let made = cuda_mp::Semaphore::create("doc-semaphore-open", 1).unwrap();
    /// let opened = cuda_mp::Semaphore::open("doc-semaphore-open").unwrap();
    /// let _permit = made.acquire();
    /// assert!(opened.try_acquire().is_none());
    /// ```
    pub fn open(name: &str) -> Result<Semaphore> {
        Semaphore::named(name, Open::Existing, 0)
    }

    /// Opens the semaphore named `name`, or creates it with `permits` free permits if there is
    /// none (an existing one keeps its count).
    ///
    /// ```
    /// let a = cuda_mp::Semaphore::open_or_create("doc-semaphore-either", 1).unwrap();
    /// let b = cuda_mp::Semaphore::open_or_create("doc-semaphore-either", 5).unwrap();
    /// assert_eq!(b.value(), 1);
    /// ```
    pub fn open_or_create(name: &str, permits: u32) -> Result<Semaphore> {
        Semaphore::named(name, Open::Either, permits)
    }

    fn named(name: &str, open: Open, permits: u32) -> Result<Semaphore> {
        check_permits(permits)?;
        let init = |r: &Region| r.u32(COUNT).store(permits, Ordering::Relaxed);
        Ok(Semaphore { object: Arc::new(Object::named(Kind::Semaphore, name, open, init, |_| Ok(()))?) })
    }

    /// The name, for a semaphore made or opened by name.
    ///
    /// ```
    /// assert_eq!(cuda_mp::Semaphore::new(1).unwrap().name(), None);
    /// ```
    pub fn name(&self) -> Option<&str> {
        self.object.name.as_deref()
    }

    fn count(&self) -> &AtomicU32 {
        self.object.region.u32(COUNT)
    }

    fn sleepers(&self) -> &AtomicU32 {
        self.object.region.u32(SLEEPERS)
    }

    /// The number of free permits now.
    ///
    /// ```
    /// let s = cuda_mp::Semaphore::new(2).unwrap();
    /// let _permit = s.acquire();
    /// assert_eq!(s.value(), 1);
    /// ```
    pub fn value(&self) -> u32 {
        self.count().load(Ordering::Relaxed)
    }

    /// Takes a permit, waiting until one is free.
    ///
    /// ```
    /// let s = cuda_mp::Semaphore::new(1).unwrap();
    /// let permit = s.acquire();
    /// assert_eq!(s.value(), 0);
    /// drop(permit);
    /// assert_eq!(s.value(), 1);
    /// ```
    pub fn acquire(&self) -> SemaphoreGuard<'_> {
        loop {
            if let Some(guard) = self.acquire_until(None, false) {
                return guard;
            }
        }
    }

    /// Takes a permit if one is free, without blocking.
    ///
    /// ```
    /// let s = cuda_mp::Semaphore::new(1).unwrap();
    /// let _permit = s.try_acquire().unwrap();
    /// assert!(s.try_acquire().is_none());
    /// ```
    pub fn try_acquire(&self) -> Option<SemaphoreGuard<'_>> {
        self.acquire_until(None, true)
    }

    /// Takes a permit, waiting at most `timeout` for one; `None` when none came free.
    ///
    /// ```
    /// use std::time::Duration;
    /// let s = cuda_mp::Semaphore::new(0).unwrap();
    /// assert!(s.acquire_timeout(Duration::from_millis(10)).is_none());
    /// s.release().unwrap();
    /// assert!(s.acquire_timeout(Duration::from_millis(10)).is_some());
    /// ```
    pub fn acquire_timeout(&self, timeout: Duration) -> Option<SemaphoreGuard<'_>> {
        match deadline(timeout) {
            Some(d) => self.acquire_until(Some(d), false),
            None => Some(self.acquire()),
        }
    }

    fn acquire_until(&self, deadline: Option<Instant>, once: bool) -> Option<SemaphoreGuard<'_>> {
        let count = self.count();
        loop {
            let current = count.load(Ordering::Relaxed);
            if current > 0 {
                if count.compare_exchange_weak(current, current - 1, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                    return Some(SemaphoreGuard { semaphore: self });
                }
                continue;
            }
            let left = time_left(deadline);
            if once || left == Some(Duration::ZERO) {
                return None;
            }
            // Announce the sleep, then look again: a release either sees the announcement or
            // made the count non-zero before the look (both sides are SeqCst).
            self.sleepers().fetch_add(1, Ordering::SeqCst);
            if count.load(Ordering::SeqCst) == 0 {
                sys::futex_wait(count, 0, Some(slice(left)));
            }
            self.sleepers().fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Adds a permit (for one taken with [`SemaphoreGuard::forget`], or a new one) and wakes a
    /// waiter. Fails when the semaphore already holds `i32::MAX` permits.
    ///
    /// ```
    /// let s = cuda_mp::Semaphore::new(0).unwrap();
    /// s.release().unwrap();
    /// assert_eq!(s.value(), 1);
    /// ```
    pub fn release(&self) -> Result<()> {
        let count = self.count();
        let mut current = count.load(Ordering::Relaxed);
        loop {
            if current >= MAX {
                return Err(invalid(format!("a semaphore holds at most {MAX} permits")));
            }
            match count.compare_exchange_weak(current, current + 1, Ordering::SeqCst, Ordering::Relaxed) {
                Ok(_) => break,
                Err(now) => current = now,
            }
        }
        if self.sleepers().load(Ordering::SeqCst) != 0 {
            sys::futex_wake(count, 1);
        }
        Ok(())
    }
}

fn check_permits(permits: u32) -> Result<()> {
    if permits > MAX {
        return Err(invalid(format!("a semaphore holds at most {MAX} permits, not {permits}")));
    }
    Ok(())
}

impl fmt::Debug for Semaphore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Semaphore").field("name", &self.name()).field("value", &self.value()).finish()
    }
}

object_serde!(Semaphore, |_| Ok(()));

/// A permit of a [`Semaphore`]; dropping it gives the permit back.
///
/// ```
/// let s = cuda_mp::Semaphore::new(1).unwrap();
/// let permit = s.acquire();
/// println!("{permit:?}");
/// ```
pub struct SemaphoreGuard<'a> {
    semaphore: &'a Semaphore,
}

impl SemaphoreGuard<'_> {
    /// Keeps the permit taken: it comes back only with [`Semaphore::release`], from any
    /// process (as with Python's separate `acquire` and `release`).
    ///
    /// ```
    /// let s = cuda_mp::Semaphore::new(1).unwrap();
    /// s.acquire().forget();
    /// assert_eq!(s.value(), 0);
    /// s.release().unwrap();
    /// assert_eq!(s.value(), 1);
    /// ```
    pub fn forget(self) {
        std::mem::forget(self);
    }
}

impl Drop for SemaphoreGuard<'_> {
    fn drop(&mut self) {
        // Cannot overflow unless others released permits they never took.
        let _ = self.semaphore.release();
    }
}

impl fmt::Debug for SemaphoreGuard<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SemaphoreGuard").field("semaphore", self.semaphore).finish()
    }
}
