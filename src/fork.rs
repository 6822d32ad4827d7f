//! Processes made by `fork(2)` without `exec` (a copy of the parent's memory with one thread:
//! the parent's other threads, the locks they held and its identities must not be used): the
//! *generation* a `pthread_atfork` child handler bumps, [`ForkLocal`] cells built afresh in
//! each generation (the parent's values are never used or dropped in the child), the count of
//! forks whose children may still map this process's memory ([`latest_living_fork`]), and the
//! descriptors a child closes at once: the parent's lease channels ([`on_fork_child`]) and what
//! [`NotInherited`] holds. See "Processes made by `fork`" in `docs/architecture.md`.
//!
//! The handler closes those by number, never through an `OwnedFd`'s drop: `fork` copies the
//! descriptor table before the memory while the parent's other threads run, so a descriptor made
//! in between is named in the child's memory but is not open there (the close fails and is
//! ignored), or is open there as the file that number was before, which nothing in the child's
//! memory owns any more. The same window is a limit of forking while other threads work, which
//! no handler can close: what another thread of the parent received in it (a tensor arriving on
//! a channel, say) and the child drops later closes a number that is not its own in the child,
//! and what the parent closed in it stays open in the child. Fork while the other threads are
//! quiet, or use the spawn or forkserver start method.

use std::ops::Deref;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicPtr, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// Bumped in every forked child, before `fork` returns there.
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// What the child handler runs after bumping the generation.
static CHILD_HOOK: OnceLock<fn()> = OnceLock::new();

/// Runs `hook` in every later forked child, in its handler (so it must not block on a lock the
/// parent's other threads may have held, nor allocate where that could deadlock). One hook per
/// process; a second registration is ignored.
pub(crate) fn on_fork_child(hook: fn()) {
    generation();
    let _ = CHILD_HOOK.set(hook);
}

/// How many descriptors at most are closed in forked children (beyond, the rest stay open in
/// them, as any inherited descriptor does): a home's listener and bell, its kept connections
/// (at most 256), this process's connections to other homes (at most 64), the open batch of
/// each channel's backlog, each queue consumer's request channel, this process's end of each
/// subscriber's revocation socket, and the creator's lock of each named sync object it made.
const NOT_INHERITED: usize = 4096;

/// The descriptors [`NotInherited`] holds, by number (-1: a free slot).
static NOT_INHERITED_FDS: [AtomicI32; NOT_INHERITED] = [const { AtomicI32::new(-1) }; NOT_INHERITED];

/// A descriptor (a socket, say) that a forked child closes at once: where the parent's peers
/// must see it closed when the parent is gone, not when its last forked child is. What it holds
/// stays this generation's: the child never uses or drops the parent's (as with [`ForkLocal`]).
pub(crate) struct NotInherited<T: AsFd> {
    inner: T,
    /// The slot of `NOT_INHERITED_FDS` that names the descriptor, if one was free.
    slot: Option<usize>,
}

impl<T: AsFd> NotInherited<T> {
    /// Holds `inner`, whose descriptor forked children close.
    pub(crate) fn new(inner: T) -> NotInherited<T> {
        generation(); // the child handler is registered before any descriptor is named to it
        let fd = inner.as_fd().as_raw_fd();
        let slot = NOT_INHERITED_FDS
            .iter()
            .position(|s| s.compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Relaxed).is_ok());
        if slot.is_none() {
            static SAID: AtomicBool = AtomicBool::new(false);
            if !SAID.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    limit = NOT_INHERITED,
                    "more descriptors to close in forked children than fit: the rest stay open in them"
                );
            }
        }
        NotInherited { inner, slot }
    }
}

/// A descriptor's number, for a [`NotInherited`] beside the descriptor's owner: the owner keeps
/// it open at least as long as this lives (declare it before the owner's field).
pub(crate) struct Number(RawFd);

impl Number {
    pub(crate) fn of(fd: &impl AsFd) -> Number {
        Number(fd.as_fd().as_raw_fd())
    }
}

impl AsFd for Number {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        // SAFETY: the descriptor's owner keeps it open while this lives (see the type).
        unsafe { std::os::fd::BorrowedFd::borrow_raw(self.0) }
    }
}

impl<T: AsFd> Deref for NotInherited<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.inner
    }
}

impl<T: AsFd> AsFd for NotInherited<T> {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.inner.as_fd()
    }
}

impl<T: AsFd> Drop for NotInherited<T> {
    fn drop(&mut self) {
        // Before `inner` closes the descriptor (the fields drop after this): a number let go of
        // here may be reused at once, and a child forked then must not close the new one.
        if let Some(slot) = self.slot {
            NOT_INHERITED_FDS[slot].store(-1, Ordering::Release);
        }
    }
}

impl<T: AsFd + std::fmt::Debug> std::fmt::Debug for NotInherited<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt(f)
    }
}

/// Closes, in a forked child, every descriptor a [`NotInherited`] of the parent named.
fn close_not_inherited() {
    for slot in &NOT_INHERITED_FDS {
        let fd: RawFd = slot.swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            // SAFETY: the parent's `NotInherited` that owns it is never used or dropped in the
            // child (it is the parent generation's state, or on the stack of a thread that is
            // not in the child), and the slot is emptied, so nothing here closes it again.
            unsafe { crate::sys::close_inherited(fd) };
        }
    }
}

/// Forks this process has begun (counted in the prepare handler, before each): a fork under
/// way is counted before its child's copy of memory is taken. A fork's number is this count.
static FORKS_BEGUN: AtomicU64 = AtomicU64::new(0);

/// The number of the latest fork this process has finished (set in the parent handler): a
/// fork numbered above it may yet copy memory in use now.
static FORKS_DONE: AtomicU64 = AtomicU64::new(0);

/// Set from the prepare handler to the parent or child handler: one fork's handlers at a time
/// (two threads that fork at once take turns here), and a fork under way.
static FORKING: AtomicBool = AtomicBool::new(false);

/// The pipe of the fork under way (-1: none): the parent keeps its reading end, the child its
/// writing end, which closes when the child and every process it forked without `exec` have
/// exited or exec'd.
static FORK_PIPE_READ: AtomicI32 = AtomicI32::new(-1);
static FORK_PIPE_WRITE: AtomicI32 = AtomicI32::new(-1);

/// The forks whose children may still hold this process's memory: (the fork's number, the
/// reading end of its pipe; `None` where no pipe could be made, a fork counted as living for
/// good). A forked child starts with none of its own (its parent's are the parent's, and their
/// reading ends stay open in it, unused: only writing ends keep a pipe's children counted).
type Children = Mutex<Vec<(u64, Option<OwnedFd>)>>;
static CHILDREN: ForkLocal<Children> = ForkLocal::new(|| Mutex::new(Vec::new()));

extern "C" fn before_fork() {
    while FORKING.swap(true, Ordering::AcqRel) {
        std::hint::spin_loop();
    }
    FORKS_BEGUN.fetch_add(1, Ordering::AcqRel);
    // A pipe closed at `exec`, as a lease is: the parent keeps the reading end, the child the
    // writing end, which tells the parent when the child (and all it forks without `exec`) is
    // gone or has exec'd.
    if let Ok((read, write)) = crate::sys::lease_pipe() {
        FORK_PIPE_READ.store(read.into_raw_fd(), Ordering::Release);
        FORK_PIPE_WRITE.store(write.into_raw_fd(), Ordering::Release);
    }
}

extern "C" fn forked_parent() {
    let (read, write) = (FORK_PIPE_READ.swap(-1, Ordering::AcqRel), FORK_PIPE_WRITE.swap(-1, Ordering::AcqRel));
    // SAFETY: made by `before_fork` for this fork and owned by nothing else; the child has its
    // own copies.
    let [read, write] = [read, write].map(|fd| (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) }));
    drop(write);
    let _ = std::panic::catch_unwind(|| {
        let mut children = CHILDREN.get().lock().unwrap_or_else(|p| p.into_inner());
        // Forks seen gone are forgotten here too, so that a process that forks and execs
        // often holds a pipe per living child only.
        forget_gone(&mut children);
        let number = FORKS_BEGUN.load(Ordering::Acquire);
        children.push((number, read));
        FORKS_DONE.store(number, Ordering::Release);
    });
    FORKING.store(false, Ordering::Release);
}

extern "C" fn forked_child() {
    // In the child's only thread, before `fork` returns there. The handlers run, so they are
    // registered here, whether or not the parent's thread had marked them so.
    HANDLERS.mark_done();
    GENERATION.fetch_add(1, Ordering::SeqCst);
    // The fork's pipe: its writing end stays open here (until this process and all it forks
    // without `exec` are gone), its reading end is the parent's.
    let read = FORK_PIPE_READ.swap(-1, Ordering::AcqRel);
    FORK_PIPE_WRITE.store(-1, Ordering::Release);
    if read >= 0 {
        // SAFETY: the parent's copy is owned by the parent handler; nothing here owns this one.
        unsafe { crate::sys::close_inherited(read) };
    }
    FORKING.store(false, Ordering::Release);
    close_not_inherited();
    // The parent's lease channels must not stay open in the child for as long as it lives
    // (its memory would be held that long): the lifetime registry's hook closes this child's
    // copies at once. Nothing may unwind out of this handler.
    if let Some(hook) = CHILD_HOOK.get() {
        let _ = std::panic::catch_unwind(*hook);
    }
}

/// The number of the latest fork (with the C library's `fork`, whose handlers run) this
/// process has finished: memory taken into use after this is read is in the children of the
/// forks numbered above it at most.
pub(crate) fn forks_done() -> u64 {
    generation();
    FORKS_DONE.load(Ordering::Acquire)
}

/// How many forks this process has begun, the one under way included: none numbered above
/// it has copied memory yet.
pub(crate) fn forks_begun() -> u64 {
    generation();
    FORKS_BEGUN.load(Ordering::Acquire)
}

/// The number of the latest fork whose child, or a process that child forked without `exec`,
/// may still live and has not exec'd (0: none): a fork under way counts. Forks seen gone are
/// forgotten.
pub(crate) fn latest_living_fork() -> u64 {
    let mut children = CHILDREN.get().lock().unwrap_or_else(|p| p.into_inner());
    forget_gone(&mut children);
    let recorded = children.last().map_or(0, |(number, _)| *number);
    if FORKING.load(Ordering::Acquire) { recorded.max(FORKS_BEGUN.load(Ordering::Acquire)) } else { recorded }
}

/// Runs `run` once no child of a fork numbered above `after` lives (at once where none does):
/// on a thread that looks every [`FORKS_LOOK_EVERY`] while something waits. What still waits
/// when the process exits never runs, nor in a forked child.
pub(crate) fn when_forks_gone(after: u64, run: Box<dyn FnOnce() + Send>) {
    if latest_living_fork() <= after {
        return run();
    }
    let waiting = WAITING.get();
    let mut w = waiting.lock().unwrap_or_else(|p| p.into_inner());
    w.runs.push((after, run));
    if !w.watching {
        w.watching =
            std::thread::Builder::new().name("cuda-mp-forks".into()).spawn(move || watch_forks(waiting)).is_ok();
    }
}

/// How often what waits for forked children to end looks whether they have.
const FORKS_LOOK_EVERY: std::time::Duration = std::time::Duration::from_millis(20);

/// What waits for forked children to end, and whether a thread watches them.
#[derive(Default)]
struct Waiting {
    runs: Vec<(u64, Box<dyn FnOnce() + Send>)>,
    watching: bool,
}

static WAITING: ForkLocal<Mutex<Waiting>> = ForkLocal::new(|| Mutex::new(Waiting::default()));

fn watch_forks(waiting: &Mutex<Waiting>) {
    loop {
        std::thread::sleep(FORKS_LOOK_EVERY);
        let due: Vec<Box<dyn FnOnce() + Send>> = {
            let mut w = waiting.lock().unwrap_or_else(|p| p.into_inner());
            let latest = latest_living_fork();
            w.runs.extract_if(.., |(after, _)| *after >= latest).map(|(_, run)| run).collect()
        };
        // Outside the lock: a run may wait for a fork to be recorded.
        due.into_iter().for_each(|run| run());
        let mut w = waiting.lock().unwrap_or_else(|p| p.into_inner());
        if w.runs.is_empty() {
            w.watching = false;
            return;
        }
    }
}

fn forget_gone(children: &mut Vec<(u64, Option<OwnedFd>)>) {
    children.retain(|(_, read)| read.as_ref().is_none_or(|read| !crate::sys::writers_gone(read)));
}

/// This process's generation: 0 in a process started fresh (or spawned, or exec'd), one more
/// in each forked child than in its parent.
pub(crate) fn generation() -> u64 {
    // Every caller waits until the handlers are registered, so no cell is built before a fork
    // could be told apart.
    HANDLERS.ensure(|| {
        // Should this fail (only when out of memory), forked children are not told apart:
        // they behave as before this module existed.
        // SAFETY: `forked_child` waits on no lock (the hook it runs only tries locks; the
        // descriptors it closes are read from atomics) and allocates only through the C
        // library's malloc, whose locks `fork` resets in the child (glibc); nothing unwinds
        // out of it. The parent's handlers run in the parent, with its threads.
        let _ = unsafe { crate::sys::at_fork(before_fork, forked_parent, forked_child) };
    });
    GENERATION.load(Ordering::Acquire)
}

/// Whether this process's fork handlers are registered.
static HANDLERS: Registration = Registration::new();

/// A one-time registration that a forked child never waits on for ever, as it would on a
/// `std::sync::Once` that another thread of its parent was running when it forked: that thread
/// is not in the child. The C library takes one lock for `pthread_atfork` and `fork`, so a
/// child was forked either after the handlers were registered (its child handler marks them
/// done) or before (it registers its own).
struct Registration(AtomicI64);

/// [`Registration`]'s state when done (others: 0, not begun; a process id, a thread of that
/// process registers now).
const REGISTERED: i64 = -1;

impl Registration {
    const fn new() -> Registration {
        Registration(AtomicI64::new(0))
    }

    /// Runs `register` once in this process and its forked children together, and returns
    /// when it has run.
    fn ensure(&self, register: impl FnOnce()) {
        if self.0.load(Ordering::Acquire) == REGISTERED {
            return;
        }
        let me = i64::from(crate::sys::own_pid());
        loop {
            match self.0.load(Ordering::Acquire) {
                REGISTERED => return,
                // Another thread of this process registers: a matter of microseconds.
                seen if seen == me => std::thread::yield_now(),
                // Not begun, or begun by a thread of the parent this process was forked from
                // before the registration was done: this process's own thread registers.
                seen => {
                    if self.0.compare_exchange(seen, me, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                        register();
                        self.0.store(REGISTERED, Ordering::Release);
                        return;
                    }
                }
            }
        }
    }

    /// Marks the registration done: in a forked child whose handlers ran, whatever state the
    /// parent's copy was taken in.
    fn mark_done(&self) {
        self.0.store(REGISTERED, Ordering::Release);
    }
}

/// A value of one generation of the process: built on first use, and built afresh on first use
/// in a forked child, which never touches its parent's value. `init` must be cheap and free of
/// side effects (two threads may race to build the value, and the loser's is dropped): put a
/// `OnceCell` inside for what starts threads or makes descriptors.
pub(crate) struct ForkLocal<T> {
    current: AtomicPtr<Slot<T>>,
    init: fn() -> T,
}

struct Slot<T> {
    generation: u64,
    value: T,
}

impl<T> ForkLocal<T> {
    /// A cell whose value `init` builds.
    pub(crate) const fn new(init: fn() -> T) -> ForkLocal<T> {
        ForkLocal { current: AtomicPtr::new(std::ptr::null_mut()), init }
    }

    /// This generation's value.
    pub(crate) fn get(&self) -> &T {
        let generation = generation();
        let seen = self.current.load(Ordering::Acquire);
        // SAFETY: a non-null pointer was published by the compare-exchange below from
        // `Box::into_raw`, and no published slot is freed before `self` is dropped (slots of
        // earlier generations are left behind on purpose: see the module's comment).
        if let Some(slot) = unsafe { seen.as_ref() }
            && slot.generation == generation
        {
            return &slot.value;
        }
        let fresh = Box::into_raw(Box::new(Slot { generation, value: (self.init)() }));
        match self.current.compare_exchange(seen, fresh, Ordering::AcqRel, Ordering::Acquire) {
            // SAFETY: just published; it lives as long as `self` (above).
            Ok(_) => unsafe { &(*fresh).value },
            Err(winner) => {
                // SAFETY: `fresh` was never published; it is ours alone.
                drop(unsafe { Box::from_raw(fresh) });
                // SAFETY: published by the thread that won, as above. Both raced in this
                // generation (a fork leaves one thread), so the winner's value is this
                // generation's.
                unsafe { &(*winner).value }
            }
        }
    }

    /// The value of an earlier generation this cell holds (its parent's, in a forked child
    /// that has not used the cell yet), if any.
    pub(crate) fn inherited(&self) -> Option<&T> {
        // SAFETY: as in `get`.
        let slot = unsafe { self.current.load(Ordering::Acquire).as_ref() }?;
        (slot.generation != generation()).then_some(&slot.value)
    }

    /// True when this cell holds a value of an earlier generation (this process was forked
    /// from one that used it) or none yet.
    pub(crate) fn is_stale(&self) -> bool {
        // SAFETY: as in `get`.
        unsafe { self.current.load(Ordering::Acquire).as_ref() }.is_none_or(|s| s.generation != generation())
    }
}

impl<T> Drop for ForkLocal<T> {
    fn drop(&mut self) {
        let current = *self.current.get_mut();
        // SAFETY: as in `get`; `&mut self` means no reference from `get` is alive.
        let ours = unsafe { current.as_ref() }.is_some_and(|s| s.generation == generation());
        if ours {
            // SAFETY: published from `Box::into_raw`, of this generation, owned by this cell.
            // A slot of an earlier generation (the parent's, in a child that never used the
            // cell) is left as it is, like every inherited value.
            drop(unsafe { Box::from_raw(current) });
        }
    }
}

// SAFETY: the cell hands out `&T` to any thread and may drop a `T` built on another thread:
// exactly what `Sync + Send` of `T` allow.
unsafe impl<T: Send + Sync> Sync for ForkLocal<T> {}
// SAFETY: as above; the slot is owned by the cell.
unsafe impl<T: Send> Send for ForkLocal<T> {}

impl<T> std::fmt::Debug for ForkLocal<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForkLocal").field("stale", &self.is_stale()).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_is_built_once_per_generation() {
        static BUILT: AtomicU64 = AtomicU64::new(0);
        let cell = ForkLocal::new(|| BUILT.fetch_add(1, Ordering::SeqCst));
        assert!(cell.is_stale());
        let first = *cell.get();
        assert_eq!(*cell.get(), first);
        assert!(!cell.is_stale());
        // Many threads see the one value.
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| assert_eq!(*cell.get(), first));
            }
        });
        assert_eq!(BUILT.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_child_forked_during_a_registration_registers_on_its_own() {
        static ONCE: Registration = Registration::new();
        static RUNS: AtomicU64 = AtomicU64::new(0);
        let (begun_tx, begun) = std::sync::mpsc::channel();
        let registering = std::thread::spawn(move || {
            ONCE.ensure(|| {
                RUNS.fetch_add(1, Ordering::SeqCst);
                begun_tx.send(()).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(300));
            })
        });
        begun.recv().unwrap();
        // Forked while the other thread registers: the child must not wait for that thread.
        let child = crate::sys::fork_and_run(|| {
            let (done_tx, done) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                ONCE.ensure(|| {
                    RUNS.fetch_add(1, Ordering::SeqCst);
                });
                ONCE.ensure(|| panic!("registered twice"));
                let _ = done_tx.send(RUNS.load(Ordering::SeqCst));
            });
            done.recv_timeout(std::time::Duration::from_secs(5)) == Ok(2)
        })
        .expect("fork");
        registering.join().unwrap();
        assert!(child, "the child waited for its parent's registering thread, or did not register");
        ONCE.ensure(|| panic!("registered twice"));
        assert_eq!(RUNS.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_forked_child_closes_what_not_inherited_holds_and_keeps_the_rest() {
        use std::os::unix::net::UnixStream;
        let open = |fd: RawFd| std::path::Path::new(&format!("/proc/self/fd/{fd}")).exists();
        let (ours, _peer) = UnixStream::pair().unwrap();
        let ours = NotInherited::new(ours);
        let (plain, _plain_peer) = UnixStream::pair().unwrap();
        let (fd, plain_fd) = (ours.as_raw_fd(), plain.as_raw_fd());
        let child = crate::sys::fork_and_run(|| !open(fd) && open(plain_fd)).expect("fork");
        assert!(child, "the forked child kept what NotInherited holds, or closed another descriptor");
        assert!(open(fd) && open(plain_fd), "the fork closed the parent's descriptors");
    }

    #[test]
    fn a_forked_child_gets_its_own_value_and_generation() {
        let cell = ForkLocal::new(std::process::id);
        let parent_generation = generation();
        assert_eq!(*cell.get(), std::process::id());
        let child = crate::sys::fork_and_run(|| {
            // The parent's value is not the child's.
            generation() == parent_generation + 1 && cell.is_stale() && *cell.get() == std::process::id()
        })
        .expect("fork");
        assert!(child, "the forked child saw its parent's value or generation");
        assert_eq!(generation(), parent_generation, "fork changed the parent's generation");
        assert_eq!(*cell.get(), std::process::id());
    }
}
