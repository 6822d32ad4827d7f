//! [`Event`]: a flag that processes set, clear and wait for.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::region::W32;
use super::{BODY, Kind, Object, Open, deadline, object_serde, slice, time_left};
use crate::error::Result;
use crate::sys;

/// The event's one word: [`SET`], [`WAITERS`], and a generation above them.
const STATE: W32 = W32::at(BODY);
/// The flag.
const SET: u32 = 1;
/// Someone may sleep on the word: [`Event::set`] must wake.
const WAITERS: u32 = 2;
/// One step of the generation, which counts the times the flag was set (bits 2 to 31).
const GENERATION: u32 = 4;

/// A flag shared between processes, like Python's `multiprocessing.Event`: [`set`](Self::set)
/// wakes every process waiting in [`wait`](Self::wait), [`clear`](Self::clear) resets it.
///
/// Pass it to spawned processes in their arguments or over a channel (a clone refers to the
/// same flag), or meet by name with [`open_or_create`](Self::open_or_create).
///
/// ```no_run
/// use cuda_mp::Event;
///
/// fn worker(ready: Event) -> bool {
///     ready.wait_timeout(std::time::Duration::from_secs(10))
/// }
///
/// #[cuda_mp::main]
/// fn main() {
///     let ready = Event::new().unwrap();
///     let child = cuda_mp::spawn(ready.clone(), worker);
///     ready.set();
///     assert!(child.join().unwrap());
/// }
/// ```
#[derive(Clone)]
pub struct Event {
    object: Arc<Object>,
}

impl Event {
    /// A new, clear event in anonymous shared memory, for this process and the processes it
    /// is sent to.
    ///
    /// ```
    /// let event = cuda_mp::Event::new().unwrap();
    /// assert!(!event.is_set());
    /// ```
    pub fn new() -> Result<Event> {
        Ok(Event { object: Arc::new(Object::anonymous(Kind::Event, |_| {})?) })
    }

    /// A new, clear event named `name` (1 to 200 of `A-Z a-z 0-9 . _ -`), for processes that
    /// meet by name. This process owns the name: it is removed when this handle and its clones
    /// are dropped (see [`open`](Self::open)). Fails with [`std::io::ErrorKind::AlreadyExists`]
    /// when a live event has the name.
    ///
    /// ```
    /// let event = cuda_mp::Event::create("doc-event-create").unwrap();
    /// assert!(cuda_mp::Event::create("doc-event-create").is_err()); // taken
    /// assert_eq!(event.name(), Some("doc-event-create"));
    /// ```
    pub fn create(name: &str) -> Result<Event> {
        Event::named(name, Open::Create)
    }

    /// Opens the event named `name`, made by another process (or this one) with
    /// [`create`](Self::create) or [`open_or_create`](Self::open_or_create). The name exists
    /// while its creator holds the event: once the creator drops it, or ends, the name is
    /// gone ([`std::io::ErrorKind::NotFound`]), though processes that opened it keep using it.
    ///
    /// ```
    /// let made = cuda_mp::Event::create("doc-event-open").unwrap();
    /// let opened = cuda_mp::Event::open("doc-event-open").unwrap();
    /// made.set();
    /// assert!(opened.is_set());
    /// drop(made);
    /// assert!(cuda_mp::Event::open("doc-event-open").is_err()); // the creator dropped it
    /// assert!(opened.is_set()); // still usable
    /// ```
    pub fn open(name: &str) -> Result<Event> {
        Event::named(name, Open::Existing)
    }

    /// Opens the event named `name`, or creates it (clear) if there is none; the process that
    /// creates it owns the name, as with [`create`](Self::create).
    ///
    /// ```
    /// let a = cuda_mp::Event::open_or_create("doc-event-either").unwrap();
    /// let b = cuda_mp::Event::open_or_create("doc-event-either").unwrap();
    /// a.set();
    /// assert!(b.is_set());
    /// ```
    pub fn open_or_create(name: &str) -> Result<Event> {
        Event::named(name, Open::Either)
    }

    fn named(name: &str, open: Open) -> Result<Event> {
        Ok(Event { object: Arc::new(Object::named(Kind::Event, name, open, |_| {}, |_| Ok(()))?) })
    }

    /// The name, for an event made or opened by name.
    ///
    /// ```
    /// assert_eq!(cuda_mp::Event::new().unwrap().name(), None);
    /// ```
    pub fn name(&self) -> Option<&str> {
        self.object.name.as_deref()
    }

    fn state(&self) -> &std::sync::atomic::AtomicU32 {
        self.object.region.u32(STATE)
    }

    /// True while the flag is set.
    ///
    /// ```
    /// let event = cuda_mp::Event::new().unwrap();
    /// event.set();
    /// assert!(event.is_set());
    /// ```
    pub fn is_set(&self) -> bool {
        self.state().load(Ordering::Acquire) & SET != 0
    }

    /// Sets the flag and wakes every process and thread waiting for it. Waiters that are
    /// asleep when it is set return `true` even if it is cleared again before they run.
    ///
    /// ```
    /// let event = cuda_mp::Event::new().unwrap();
    /// let waiter = event.clone();
    /// let t = std::thread::spawn(move || waiter.wait());
    /// event.set();
    /// t.join().unwrap();
    /// ```
    pub fn set(&self) {
        let state = self.state();
        let mut current = state.load(Ordering::Relaxed);
        loop {
            if current & SET != 0 {
                return;
            }
            // Set, a new generation, nobody asleep any more (all are woken below).
            let next = (current & !WAITERS).wrapping_add(GENERATION) | SET;
            match state.compare_exchange_weak(current, next, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => {
                    if current & WAITERS != 0 {
                        sys::futex_wake_all(state);
                    }
                    return;
                }
                Err(now) => current = now,
            }
        }
    }

    /// Clears the flag: waits from now on block until it is set again.
    ///
    /// ```
    /// let event = cuda_mp::Event::new().unwrap();
    /// event.set();
    /// event.clear();
    /// assert!(!event.is_set());
    /// ```
    pub fn clear(&self) {
        self.state().fetch_and(!SET, Ordering::Release);
    }

    /// Blocks until the flag is set (returns at once if it is).
    ///
    /// ```
    /// let event = cuda_mp::Event::new().unwrap();
    /// event.set();
    /// event.wait();
    /// ```
    pub fn wait(&self) {
        self.wait_until(None);
    }

    /// Blocks until the flag is set or `timeout` has passed; true when it was set, like
    /// Python's `Event.wait(timeout)`.
    ///
    /// ```
    /// use std::time::Duration;
    /// let event = cuda_mp::Event::new().unwrap();
    /// assert!(!event.wait_timeout(Duration::from_millis(10)));
    /// event.set();
    /// assert!(event.wait_timeout(Duration::from_millis(10)));
    /// ```
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        self.wait_until(deadline(timeout))
    }

    /// Waits until the flag is set or was set meanwhile (true), or the deadline passed.
    fn wait_until(&self, deadline: Option<Instant>) -> bool {
        let state = self.state();
        let mut current = state.load(Ordering::Acquire);
        let generation = current & !(SET | WAITERS);
        loop {
            if current & SET != 0 || current & !(SET | WAITERS) != generation {
                return true;
            }
            if current & WAITERS == 0 {
                if let Err(now) =
                    state.compare_exchange_weak(current, current | WAITERS, Ordering::Acquire, Ordering::Acquire)
                {
                    current = now;
                    continue;
                }
                current |= WAITERS;
            }
            let left = time_left(deadline);
            if left == Some(Duration::ZERO) {
                return false;
            }
            // A slice at a time: a setter killed between its change and its wake wakes nobody.
            sys::futex_wait(state, current, Some(slice(left)));
            current = state.load(Ordering::Acquire);
        }
    }
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event").field("name", &self.name()).field("set", &self.is_set()).finish()
    }
}

object_serde!(Event, |_| Ok(()));
