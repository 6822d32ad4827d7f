//! Launching worker processes, spawn-style: the child is a fresh run of this executable that
//! calls one function with deserialized arguments.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{JoinError, PanicReport};
use crate::fork::ForkLocal;
use crate::os::{Caught, catch_spawn_panic};
use crate::pool::AsyncResult;
use crate::sys::signal_name;
use crate::sys::{ChildWatch, Exit};
use crate::wire;

static INITIALIZED: AtomicBool = AtomicBool::new(false);

/// Prepares this process for spawning workers. Call it first in `main` (or annotate `main` with
/// `#[cuda_mp::main]`): in a worker this runs the worker's function and exits, so nothing
/// before it must have side effects.
///
/// ```no_run
/// // First thing in main: in a worker this runs the worker's function and exits.
/// cuda_mp::init();
/// let child = cuda_mp::spawn(2u32, |x| x * 10);
/// assert_eq!(child.join().unwrap(), 20);
/// ```
///
/// A worker may start workers of its own:
///
/// ```
/// fn outer(x: u32) -> u32 {
///     cuda_mp::spawn(x, |y| y + 1).join().unwrap() * 10
/// }
///
/// #[cuda_mp::main]
/// fn main() {
///     assert_eq!(cuda_mp::spawn(1u32, outer).join().unwrap(), 20);
/// }
/// ```
///
/// `#[cuda_mp::main]` goes with an async runtime's attribute in either order; `init()` then
/// runs before the runtime starts, so a worker runs its function without one:
///
/// ```
/// #[cuda_mp::main]
/// #[tokio::main(flavor = "current_thread")]
/// async fn main() {
///     let child = cuda_mp::spawn((), |()| tokio::runtime::Handle::try_current().is_err());
///     assert!(child.join().unwrap());
/// }
/// ```
///
/// ```
/// #[tokio::main(flavor = "current_thread")]
/// #[cuda_mp::main]
/// async fn main() -> Result<(), cuda_mp::JoinError> {
///     let child = cuda_mp::spawn((), |()| tokio::runtime::Handle::try_current().is_err());
///     assert!(child.join()?);
///     Ok(())
/// }
/// ```
pub fn init() {
    // Both before procspawn's init, which in a worker runs the worker's function and exits:
    // every shared storage and lease is a descriptor, so the soft limit is lifted in every
    // process, and a worker may spawn workers of its own.
    crate::sys::raise_descriptor_limit();
    // Read while descriptors are to spare: a lease's holder names itself with them.
    crate::sys::own_start();
    crate::sys::pid_namespace();
    crate::handover::note_parent();
    INITIALIZED.store(true, Ordering::SeqCst);
    procspawn::init();
}

/// Does now what cuda-mp does when this process exits normally, for a process about to leave
/// without a normal exit: one that ends with `_exit`, as every worker of Python's
/// `multiprocessing` does after its function returns (the Python package calls this there).
/// It hands on what the process sent (as [`flush_backlogs`](crate::flush_backlogs)), waits (a
/// minute at most in all, with the exit after it) for the releases of what it received to be
/// sent, those that wait behind its GPU work among them (an owner that does not read,
/// stopped, takes none; it gets them when the exit closes the leases), gives back its
/// references on PyTorch's shares, and finishes its interprocess events: waits for the work
/// they order, then removes the file the CUDA driver keeps for them in `/dev/shm`, which no
/// `_exit` removes. Call it last: afterwards each send of a GPU tensor waits for this
/// process's queued work itself (receivers can no longer open the event that would order
/// theirs), and sharing memory with PyTorch's own protocol fails. Calling it again, or exiting
/// normally afterwards, does nothing more but send what was sent or dropped since (a call from
/// inside an exit hook returns at once).
///
/// ```
/// let (tx, rx) = cuda_mp::channel::<u32>().unwrap();
/// tx.send(7).unwrap();
/// cuda_mp::before_exit(); // then `_exit`: the message is on its way already
/// assert_eq!(rx.recv().unwrap(), 7);
/// ```
pub fn before_exit() {
    // Per generation: a forked child's own hooks run even if its parent was running its own.
    static RUNNING: ForkLocal<AtomicBool> = ForkLocal::new(|| AtomicBool::new(false));
    struct Running(&'static AtomicBool);
    impl Drop for Running {
        fn drop(&mut self) {
            self.0.store(false, Ordering::SeqCst);
        }
    }
    if RUNNING.get().swap(true, Ordering::SeqCst) {
        return;
    }
    let _running = Running(RUNNING.get());
    run_hooks(EXIT_HOOKS.get());
}

/// The hooks [`at_exit`] registered in this generation of the process. A forked child starts
/// with none: its parent's act on the parent's state (as the counts on PyTorch's shares that
/// the parent holds), and the parent's list may have been locked by a thread the child does
/// not have.
static EXIT_HOOKS: ForkLocal<Mutex<Vec<extern "C" fn()>>> = ForkLocal::new(Default::default);

/// Runs `f` when the process exits normally (`exit`, or returning from `main`), after the
/// handlers registered later, and in [`before_exit`] (of this generation of the process). `f`
/// must find nothing left to do when it runs a second time. False when it could not be
/// registered.
pub(crate) fn at_exit(f: extern "C" fn()) -> bool {
    let registered = crate::sys::at_exit(f);
    if registered {
        EXIT_HOOKS.get().lock().unwrap_or_else(PoisonError::into_inner).push(f);
    }
    registered
}

/// Runs the hooks of `hooks`, last first (outside the lock: a hook may register another),
/// then those registered while they ran (as the C library runs a hook registered during its
/// exit), until none is new.
fn run_hooks(hooks: &Mutex<Vec<extern "C" fn()>>) {
    let mut ran = 0;
    loop {
        let due: Vec<extern "C" fn()> = {
            let list = hooks.lock().unwrap_or_else(PoisonError::into_inner);
            let due = list.get(ran..).unwrap_or_default().iter().rev().copied().collect();
            ran = list.len();
            due
        };
        if due.is_empty() {
            return;
        }
        due.into_iter().for_each(|hook| hook());
    }
}

#[cfg(feature = "testing")]
#[doc(hidden)]
pub fn __mark_initialized_for_tests() {
    crate::handover::note_parent();
    INITIALIZED.store(true, Ordering::SeqCst);
}

/// Makes [`spawn`] work inside `cargo test`: put `cuda_mp::enable_test_support!();` once at the
/// top level of a test crate, and enable the `testing` feature for tests (a dev-dependency on
/// `cuda-mp` with `features = ["testing"]`). Workers then run the test binary itself.
#[cfg(feature = "testing")]
#[macro_export]
macro_rules! enable_test_support {
    () => {
        $crate::__private::procspawn::enable_test_support!();
        #[$crate::__private::procspawn::testsupport::ctor]
        unsafe fn __cuda_mp_test_support_init() {
            $crate::__private::mark_initialized_for_tests();
        }
    };
}

pub(crate) fn not_initialized() -> bool {
    !INITIALIZED.load(Ordering::SeqCst)
}

/// Runs `f(args)` in a new process. `f` must be a plain function (or a closure that captures
/// nothing); `args` and the result cross the process boundary by serialization, so they may
/// hold channels and tensors.
///
/// ```no_run
/// fn square(x: u64) -> u64 {
///     x * x
/// }
///
/// #[cuda_mp::main]
/// fn main() {
///     assert_eq!(cuda_mp::spawn(7, square).join().unwrap(), 49);
/// }
/// ```
///
/// A process that could not be started reports why at [`JoinHandle::join`];
/// [`Builder::spawn`] reports it at once instead.
///
/// # Panics
///
/// If this process did not call [`init`] (or `main` lacks `#[cuda_mp::main]`), with
/// [`JoinError::NotInitialized`]'s message: a program that forgot it fails at its first spawn,
/// not later in a wait for workers that never started.
#[track_caller]
pub fn spawn<A, R>(args: A, f: fn(A) -> R) -> JoinHandle<R>
where
    A: Serialize + DeserializeOwned,
    R: Serialize + DeserializeOwned,
{
    match Builder::new().spawn(args, f) {
        Ok(handle) => handle,
        Err(JoinError::NotInitialized) => panic!("{}", JoinError::NotInitialized),
        Err(error) => JoinHandle::new(Inner::Failed(Some(error)), None, None),
    }
}

/// Options for a spawned process: environment variables (for example `CUDA_VISIBLE_DEVICES`).
///
/// ```no_run
/// #[cuda_mp::main]
/// fn main() {
///     let child = cuda_mp::Builder::new()
///         .env("CUDA_VISIBLE_DEVICES", "1")
///         .spawn((), |()| std::env::var("CUDA_VISIBLE_DEVICES").unwrap())
///         .unwrap();
///     assert_eq!(child.join().unwrap(), "1");
/// }
/// ```
#[derive(Debug, Default)]
pub struct Builder {
    env: Vec<(String, Option<String>)>,
    start_timeout: Option<Duration>,
}

impl Builder {
    /// Options with nothing changed from this process.
    ///
    /// ```
    /// let builder = cuda_mp::Builder::new();
    /// println!("{builder:?}");
    /// ```
    pub fn new() -> Builder {
        Builder::default()
    }

    /// Sets an environment variable in the child.
    ///
    /// ```
    /// let _builder = cuda_mp::Builder::new().env("RUST_LOG", "debug");
    /// ```
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Builder {
        self.env.push((key.into(), Some(value.into())));
        self
    }

    /// Removes an environment variable in the child.
    ///
    /// ```
    /// let _builder = cuda_mp::Builder::new().env_remove("CUDA_VISIBLE_DEVICES");
    /// ```
    pub fn env_remove(mut self, key: impl Into<String>) -> Builder {
        self.env.push((key.into(), None));
        self
    }

    /// Fails the spawn with [`JoinError::Timeout`], and kills the child, when the child has
    /// not started within `timeout`: started means it ran up to [`init`] (the first thing
    /// `#[cuda_mp::main]` does) and reported back, before `f` runs, so `f` itself may take as
    /// long as it likes. Without it, a child stuck before that (in a static constructor of a
    /// library it loads, say) holds the spawn for as long as it is stuck. A limit too long for
    /// the clock to hold is no limit.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// #[cuda_mp::main]
    /// fn main() -> Result<(), cuda_mp::JoinError> {
    ///     let child = cuda_mp::Builder::new().start_timeout(Duration::from_secs(30)).spawn((), |()| 7)?;
    ///     assert_eq!(child.join()?, 7);
    ///     Ok(())
    /// }
    /// ```
    pub fn start_timeout(mut self, timeout: Duration) -> Builder {
        self.start_timeout = Some(timeout);
        self
    }

    /// Runs `f(args)` in a new process with these options; see [`spawn`]. Fails at once,
    /// where [`spawn`] would hand back a handle whose join fails, when the process cannot be
    /// started, and with [`JoinError::NotInitialized`] when this process did not call
    /// [`init`]. A child that ends before it starts (a library it loads kills it, say) fails
    /// the spawn with how it ended, one that does not start within
    /// [`start_timeout`](Self::start_timeout) fails it with [`JoinError::Timeout`]; a failed
    /// spawn leaves no child behind.
    ///
    /// ```no_run
    /// #[cuda_mp::main]
    /// fn main() -> Result<(), cuda_mp::JoinError> {
    ///     let child = cuda_mp::Builder::new().env("MODE", "fast").spawn((), |()| std::env::var("MODE").unwrap())?;
    ///     assert_eq!(child.join()?, "fast");
    ///     Ok(())
    /// }
    /// ```
    pub fn spawn<A, R>(self, args: A, f: fn(A) -> R) -> Result<JoinHandle<R>, JoinError>
    where
        A: Serialize + DeserializeOwned,
        R: Serialize + DeserializeOwned,
    {
        if not_initialized() {
            return Err(JoinError::NotInitialized);
        }
        let mut builder = procspawn::Builder::new();
        for (key, value) in self.env {
            match value {
                Some(v) => builder.env(key, v),
                None => builder.env_remove(key),
            };
        }
        if let Some(timeout) = self.start_timeout {
            builder.start_timeout(timeout);
        }
        // The arguments are encoded like a channel message: tensors inside may be exported, and
        // their descriptors wait at this process's home for the child to fetch.
        let (handle, arguments) = wire::encode_spawn_scope(|| catch_spawn_panic(|| builder.spawn(args, f)));
        let withdraw = || {
            if let Some(ticket) = &arguments {
                crate::handover::withdraw(ticket);
            }
        };
        match handle {
            // A process that could not be started (its executable, procspawn's IPC server, the
            // arguments, a child that ended before it connected back) is a handle without a
            // process, whose join says why.
            Ok(handle) if handle.pid().is_none() => {
                withdraw();
                Err(not_started(match handle.join() {
                    Err(e) => join_error(e),
                    Ok(_) => JoinError::Failed("the process was not started".into()),
                }))
            }
            Ok(handle) => {
                let watch = handle.pid().map(ChildWatch::new);
                Ok(JoinHandle::new(Inner::Running(handle), watch, arguments))
            }
            // procspawn panics where it runs out of descriptors (an index out of bounds, say);
            // the arguments' `Serialize` may panic too.
            Err(panic) => {
                withdraw();
                Err(not_started_by_panic(None, panic))
            }
        }
    }
}

/// Waits for or kills a spawned process. Dropping it kills the process (SIGKILL); its shared
/// references are then reclaimed by their owners. (A call queued with [`Pool::spawn`] has no
/// process of its own: dropping its handle lets it run on.)
///
/// [`Pool::spawn`]: crate::Pool::spawn
///
/// ```no_run
/// #[cuda_mp::main]
/// fn main() {
///     let mut child = cuda_mp::spawn((), |()| std::thread::sleep(std::time::Duration::from_secs(60)));
///     child.kill().unwrap();
///     assert!(matches!(child.join(), Err(cuda_mp::JoinError::Signaled { name: "SIGKILL", .. })));
/// }
/// ```
pub struct JoinHandle<R> {
    inner: Inner<R>,
    /// Watches the child's end, so that a join can say how it died.
    watch: Option<ChildWatch>,
    /// How the child ended, as seen by [`kill`](Self::kill) (which reaps it, after which the
    /// watch may no longer tell).
    ended: Option<Exit>,
    /// When a join last looked for the result of the running child.
    last_look: Instant,
    /// The child's result (or panic), taken by a join before the child exited: returned once
    /// it has.
    outcome: Option<Result<R, procspawn::SpawnError>>,
    /// Where the descriptors of the child's arguments wait until it fetches them: withdrawn
    /// once the child is known to have ended (a child killed before it fetched them would
    /// otherwise keep what they claim until they expire).
    arguments: Option<crate::handover::SpawnTicket>,
}

impl<R> Drop for JoinHandle<R> {
    fn drop(&mut self) {
        // Killed here rather than by procspawn's handle as it drops (which kills by pid even a
        // child that someone else reaped, whose pid may be another's): then what the child
        // left behind goes too.
        if matches!(self.inner, Inner::Running(_)) {
            let _ = self.kill();
        }
        self.forget_arguments();
    }
}

enum Inner<R> {
    Running(procspawn::JoinHandle<R>),
    /// A call queued on a [`Pool`](crate::Pool).
    Pooled(AsyncResult<R>),
    Failed(Option<JoinError>),
}

impl<R> fmt::Debug for JoinHandle<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JoinHandle").field("pid", &self.pid()).finish()
    }
}

/// The error of a spawn that started no process (or of a job not handed to its worker):
/// `error`, or that this process is out of descriptors where procspawn failed for want of one
/// (its own words say nothing of the limit: an index out of bounds, "Bad file descriptor").
/// Only a failure of that kind is told so, and only where this process is at its limit, or
/// close to it (the descriptors procspawn opened before it failed are closed again by now):
/// a timeout stays a timeout.
pub(crate) fn not_started(error: JoinError) -> JoinError {
    told(error, false)
}

/// [`not_started`] for a panic caught while starting a process or handing a job over, told as
/// `context: message`. Only a panic in procspawn's (or ipc-channel's) code may be for want of
/// a descriptor; one in code they ran, such as the `Serialize` of the caller's arguments, is
/// the caller's own failure, whatever it says and however few descriptors are left.
pub(crate) fn not_started_by_panic(context: Option<&str>, caught: Caught) -> JoinError {
    let text = match context {
        Some(context) => format!("{context}: {}", caught.message),
        None => caught.message,
    };
    if caught.in_dependency { told(JoinError::Failed(text), true) } else { JoinError::Failed(text) }
}

/// `error`, told as out of descriptors where it is one (`panicked`: procspawn's own panic,
/// whose index out of bounds is how it fails for want of one).
fn told(error: JoinError, panicked: bool) -> JoinError {
    let descriptors = |said: &str| {
        ["(os error 24)", "(os error 23)", "(os error 9)"].iter().any(|s| said.contains(s))
            || (panicked && said.contains("index out of bounds"))
    };
    match error {
        JoinError::Failed(said)
            if crate::sys::out_of_descriptors() || (descriptors(&said) && crate::sys::near_descriptor_limit()) =>
        {
            JoinError::OutOfDescriptors { limit: crate::sys::descriptor_limit() }
        }
        other => other,
    }
}

pub(crate) fn join_error(e: procspawn::SpawnError) -> JoinError {
    if let Some(info) = e.panic_info() {
        return JoinError::Panicked(PanicReport {
            message: info.message().to_owned(),
            location: info.location().map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column())),
        });
    }
    // procspawn's message names the kind of failure; its source says what failed.
    let said = match std::error::Error::source(&e) {
        Some(source) => format!("{e}: {source}"),
        None => e.to_string(),
    };
    if e.is_timeout() {
        JoinError::Timeout
    } else if e.is_remote_close() || e.is_cancellation() {
        JoinError::Terminated(said)
    } else {
        JoinError::Failed(said)
    }
}

/// The error `e` of a join, for a child that ended as `exit` says: how it ended, where it ended
/// without a result.
fn ended_error(e: procspawn::SpawnError, exit: Option<Exit>) -> JoinError {
    match (join_error(e), exit) {
        (JoinError::Timeout | JoinError::Terminated(_), Some(exit)) => exit_error(exit),
        (error, _) => error,
    }
}

/// The error for a child that ended this way without a result.
pub(crate) fn exit_error(exit: Exit) -> JoinError {
    match exit {
        Exit::Signal(signal) => JoinError::Signaled { signal, name: signal_name(signal) },
        Exit::Code(code) => JoinError::Exited { code },
    }
}

/// Longest pause between two looks at a joined child (it wakes early when the child exits).
const JOIN_POLL: Duration = Duration::from_millis(20);

/// How often a join looks for the result of a child that is still running.
const RESULT_LOOK: Duration = Duration::from_millis(200);

impl<R> JoinHandle<R> {
    /// Once the child has ended: a process killed by a signal leaves the CUDA driver's file of
    /// its interprocess events in /dev/shm (one that exits removes it itself), which goes now.
    /// Ended means unreaped, or reaped a moment ago: its pid is given out again only after the
    /// kernel's pid space wraps. Called by every join that did not time out, by `kill` (so by
    /// `terminate` and `spawn_n`'s ends of the other ranks) and by the drop.
    fn remove_what_it_left(&self) {
        #[cfg(feature = "cuda")]
        if let Some(pid) = self.watch.as_ref().and_then(ChildWatch::pid)
            && crate::sys::process_gone(pid, 0)
        {
            crate::sys::remove_cuda_event_files(pid);
        }
    }

    /// Kills the child (SIGKILL). Its shared-memory and GPU references are reclaimed by their
    /// owners when the kernel closes its descriptors. A pooled call is cancelled if it has not
    /// started (its join then reports [`JoinError::Cancelled`]), or its worker is killed (the
    /// pool starts another).
    ///
    /// ```no_run
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let mut child = cuda_mp::spawn((), |()| std::thread::sleep(std::time::Duration::from_secs(60)));
    ///     child.kill().unwrap();
    /// }
    /// ```
    pub fn kill(&mut self) -> Result<(), JoinError> {
        match &mut self.inner {
            Inner::Running(h) => {
                // The kill reaps the child: how it ended is taken before (it may have exited
                // by itself) and after (the kernel keeps the status for the pidfd, where it
                // is new enough; else the SIGKILL sent, if it was).
                let before = self.watch.as_ref().and_then(|w| w.exited(Duration::ZERO));
                // A child reaped by someone else is not signalled: its pid may be another's.
                let gone = self.watch.as_ref().is_some_and(ChildWatch::gone);
                let killed = if gone {
                    h.reap();
                    Ok(())
                } else {
                    h.kill().map_err(join_error)
                };
                let after = || self.watch.as_ref().and_then(ChildWatch::exit_status);
                let sent = (killed.is_ok() && !gone).then_some(Exit::Signal(crate::sys::SIGKILL));
                self.ended = self.ended.or(before).or_else(after).or(sent);
                self.forget_arguments();
                self.remove_what_it_left();
                killed
            }
            Inner::Pooled(result) => {
                result.cancel();
                Ok(())
            }
            Inner::Failed(Some(e)) => Err(JoinError::Failed(e.to_string())),
            Inner::Failed(None) => Ok(()),
        }
    }

    fn new(inner: Inner<R>, watch: Option<ChildWatch>, arguments: Option<crate::handover::SpawnTicket>) -> Self {
        JoinHandle { inner, watch, ended: None, last_look: Instant::now(), outcome: None, arguments }
    }

    /// The child has ended (or is being killed): what its arguments claim and it did not fetch
    /// is released now.
    fn forget_arguments(&mut self) {
        if let Some(ticket) = self.arguments.take() {
            crate::handover::withdraw(&ticket);
        }
    }

    pub(crate) fn pooled(result: AsyncResult<R>) -> Self {
        JoinHandle::new(Inner::Pooled(result), None, None)
    }

    /// True while the child process runs (false once it has exited, was killed or never
    /// started, and for a pooled call, which has no process of its own).
    ///
    /// ```no_run
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let child = cuda_mp::spawn((), |()| std::thread::sleep(std::time::Duration::from_secs(1)));
    ///     assert!(child.is_alive());
    /// }
    /// ```
    pub fn is_alive(&self) -> bool {
        // `gone` covers every end the watch can see (exited, or reaped by anyone).
        matches!(self.inner, Inner::Running(_))
            && self.ended.is_none()
            && self.watch.as_ref().is_some_and(|w| !w.gone())
    }

    /// How the child ended, if it has: as the watch sees it, or as [`kill`](Self::kill) saw
    /// it before and after reaping it.
    fn end(&self) -> Option<Exit> {
        self.ended.or_else(|| self.watch.as_ref()?.exit_status())
    }

    /// The child's exit status once it has exited normally (`None` while it runs, or when a
    /// signal ended it). After a join it is kept where the kernel keeps a reaped child's
    /// status (Linux 6.15 and later); before, it is `None` once joined.
    ///
    /// ```no_run
    /// fn leave(code: i32) {
    ///     std::process::exit(code)
    /// }
    ///
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let child = cuda_mp::spawn(4, leave);
    ///     std::thread::sleep(std::time::Duration::from_millis(500));
    ///     assert_eq!(child.exit_code(), Some(4));
    /// }
    /// ```
    pub fn exit_code(&self) -> Option<i32> {
        if let Exit::Code(code) = self.end()? { Some(code) } else { None }
    }

    /// The child's process id, once it runs.
    ///
    /// ```no_run
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let child = cuda_mp::spawn((), |()| std::process::id());
    ///     let pid = child.pid();
    ///     assert_eq!(child.join().ok(), pid);
    /// }
    /// ```
    pub fn pid(&self) -> Option<u32> {
        match &self.inner {
            Inner::Running(h) => h.pid(),
            Inner::Pooled(result) => result.pid(),
            Inner::Failed(_) => None,
        }
    }
}

impl<R: Serialize + DeserializeOwned> JoinHandle<R> {
    /// Lets the child run on after this handle is gone: dropping a `JoinHandle` otherwise kills
    /// the child (SIGKILL). A thread of this process waits for the child's result and drops
    /// it, so that a child whose result carries descriptors (a channel end, a host tensor),
    /// which waits at its exit until they are fetched, can exit, and its exit is collected.
    ///
    /// ```no_run
    /// #[cuda_mp::main]
    /// fn main() {
    ///     cuda_mp::spawn((), |()| std::thread::sleep(std::time::Duration::from_secs(5))).detach();
    /// }
    /// ```
    pub fn detach(mut self)
    where
        R: Send + 'static,
    {
        // The child runs on, and fetches its arguments itself.
        self.arguments = None;
        let Inner::Running(handle) = std::mem::replace(&mut self.inner, Inner::Failed(None)) else { return };
        // procspawn's handle kills the child when dropped, which its `join` does only once the
        // child has exited: never drop it otherwise.
        let slot = Arc::new(Mutex::new(Some(handle)));
        let taken = slot.clone();
        let collect = move || {
            let handle = taken.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(handle) = handle {
                let _ = handle.join();
            }
        };
        if std::thread::Builder::new().name("cuda-mp-detached".into()).spawn(collect).is_err() {
            // No thread: the child runs on, uncollected until this process exits.
            if let Some(handle) = slot.lock().unwrap_or_else(|p| p.into_inner()).take() {
                std::mem::forget(handle);
            }
        }
    }

    /// Waits for the child's result. A panic in the child comes back as
    /// [`JoinError::Panicked`] with its message and location; a child killed by a signal or
    /// exiting early as [`JoinError::Signaled`] or [`JoinError::Exited`].
    ///
    /// ```no_run
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let err = cuda_mp::spawn((), |()| -> u8 { panic!("no") }).join().unwrap_err();
    ///     assert_eq!(err.panic().unwrap().message, "no");
    /// }
    /// ```
    pub fn join(mut self) -> Result<R, JoinError> {
        self.join_until(None)
    }

    /// Like [`join`](Self::join), giving up after `timeout` with [`JoinError::Timeout`]; the
    /// child keeps running and the handle stays usable. A child waits at its exit until what
    /// it sent on channels is handed on (see "Closing" in `src/channel/README.md`): a loop of
    /// this and reads of those channels ends, and a result that arrived before the child
    /// exited is kept for the next call.
    ///
    /// ```no_run
    /// use std::time::Duration;
    ///
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let mut child = cuda_mp::spawn((), |()| std::thread::sleep(Duration::from_secs(60)));
    ///     assert!(matches!(child.join_timeout(Duration::from_millis(10)), Err(cuda_mp::JoinError::Timeout)));
    ///     child.kill().unwrap();
    /// }
    /// ```
    pub fn join_timeout(&mut self, timeout: Duration) -> Result<R, JoinError> {
        self.join_until(crate::os::deadline_after(timeout))
    }

    fn join_until(&mut self, deadline: Option<Instant>) -> Result<R, JoinError> {
        let joined = self.join_now(deadline);
        if !matches!(joined, Err(JoinError::Timeout)) {
            self.remove_what_it_left();
        }
        joined
    }

    fn join_now(&mut self, deadline: Option<Instant>) -> Result<R, JoinError> {
        let handle = match &mut self.inner {
            Inner::Running(h) => h,
            Inner::Pooled(result) => return result.wait(deadline),
            Inner::Failed(e) => return Err(e.take().unwrap_or(JoinError::Failed("already joined".into()))),
        };
        let Some(watch) = &self.watch else {
            // A process whose id was never known: nothing to watch, only its result to wait for.
            let wait =
                deadline.map_or(Duration::from_secs(u32::MAX as u64), |d| d.saturating_duration_since(Instant::now()));
            return handle.join_timeout(wait).map_err(join_error);
        };
        // The child's result is looked at once it has exited (the pidfd wakes us then; its
        // result, if it sent one, is still queued), or now and then while it runs, for a result
        // too large to be queued before the child exits. A result (or panic) taken while the
        // child runs is kept until the child has exited, which may wait on this process (for
        // what it sent on channels to be read): within the deadline, so that the caller can
        // read and join again.
        loop {
            let exit = watch.exited(Duration::ZERO).or(self.ended);
            // Seen unreaped, or reaped by someone else (`SIGCHLD` ignored): then only the pidfd
            // tells, and the child must not be signalled (its pid may be another's).
            let ended = exit.is_some() || watch.gone();
            if self.outcome.is_none() && (ended || self.last_look.elapsed() >= RESULT_LOOK) {
                self.last_look = Instant::now();
                match handle.result_timeout(Duration::ZERO) {
                    Err(e) if e.is_timeout() && !ended => {}
                    Err(e) if !e.is_panic() => {
                        // Ended without a result (a timeout once it ended), or the transport
                        // failed: a child still running is killed.
                        if ended {
                            handle.reap();
                        } else {
                            let _ = handle.kill();
                        }
                        let error = match ended_error(e, exit.or_else(|| watch.exit_status())) {
                            // Reaped by someone else, on a kernel that keeps no status for us.
                            JoinError::Timeout => JoinError::Terminated("the process ended without a result".into()),
                            error => error,
                        };
                        self.inner = Inner::Failed(None);
                        self.forget_arguments();
                        return Err(error);
                    }
                    outcome => self.outcome = Some(outcome),
                }
            }
            if ended && let Some(outcome) = self.outcome.take() {
                handle.reap();
                self.inner = Inner::Failed(None);
                return outcome.map_err(|e| ended_error(e, exit.or_else(|| watch.exit_status())));
            }
            let now = Instant::now();
            let wait = match deadline {
                Some(d) if now >= d => return Err(JoinError::Timeout),
                Some(d) => JOIN_POLL.min(d - now),
                None => JOIN_POLL,
            };
            watch.exited(wait);
        }
    }

    /// Asks the child to stop (SIGTERM), and kills it (SIGKILL) if it is still running after
    /// `grace`. A join afterwards reports the signal that ended it.
    ///
    /// ```no_run
    /// use std::time::Duration;
    ///
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let mut child = cuda_mp::spawn((), |()| std::thread::sleep(Duration::from_secs(60)));
    ///     child.terminate(Duration::from_secs(2)).unwrap();
    ///     assert!(matches!(child.join(), Err(cuda_mp::JoinError::Signaled { name: "SIGTERM", .. })));
    /// }
    /// ```
    pub fn terminate(&mut self, grace: Duration) -> Result<(), JoinError> {
        let asked = self.ask_to_stop();
        self.stop_by(asked.then(|| crate::os::instant_after(grace)))
    }

    /// Sends SIGTERM unless the child has ended; whether it was sent.
    fn ask_to_stop(&self) -> bool {
        self.end().is_none() && self.watch.as_ref().is_some_and(|w| w.signal(rustix::process::Signal::TERM))
    }

    /// Waits until `deadline` (none: not at all) for the child to end, then kills it if it
    /// has not.
    fn stop_by(&mut self, deadline: Option<Instant>) -> Result<(), JoinError> {
        let Some(watch) = &self.watch else { return self.kill() };
        if let Some(deadline) = deadline {
            while self.ended.is_none() && !watch.gone() && Instant::now() < deadline {
                watch.exited(JOIN_POLL.min(deadline.saturating_duration_since(Instant::now())));
            }
        }
        if self.end().is_some() {
            self.remove_what_it_left();
            Ok(())
        } else {
            self.kill()
        }
    }
}

/// Runs `f((rank, args))` in `n` new processes, ranks `0..n`, and waits for all of them, like
/// `torch.multiprocessing.spawn`: the results in rank order, or the first failure with its
/// rank ([`JoinError::Rank`]), the other processes then terminated (SIGTERM, then SIGKILL
/// after 5 s).
///
/// ```no_run
/// fn work((rank, scale): (usize, u64)) -> u64 {
///     rank as u64 * scale
/// }
///
/// #[cuda_mp::main]
/// fn main() {
///     assert_eq!(cuda_mp::spawn_n(4, 10, work).unwrap(), vec![0, 10, 20, 30]);
/// }
/// ```
pub fn spawn_n<A, R>(n: usize, args: A, f: fn((usize, A)) -> R) -> Result<Vec<R>, JoinError>
where
    A: Serialize + DeserializeOwned + Clone,
    R: Serialize + DeserializeOwned,
{
    spawn_n_until(n, args, f, None)
}

/// Like [`spawn_n`], giving up after `timeout` (a rank stuck in a collective, say): the ranks
/// still running are then terminated as after a failure (SIGTERM, then SIGKILL after 5 s), and
/// the result is [`JoinError::Timeout`]. The ranks' starts count in the limit.
///
/// ```no_run
/// use std::time::Duration;
///
/// fn work((rank, ()): (usize, ())) {
///     if rank == 1 {
///         std::thread::sleep(Duration::from_secs(60));
///     }
/// }
///
/// #[cuda_mp::main]
/// fn main() {
///     let err = cuda_mp::spawn_n_timeout(2, (), work, Duration::from_secs(1)).unwrap_err();
///     assert!(matches!(err, cuda_mp::JoinError::Timeout));
/// }
/// ```
pub fn spawn_n_timeout<A, R>(n: usize, args: A, f: fn((usize, A)) -> R, timeout: Duration) -> Result<Vec<R>, JoinError>
where
    A: Serialize + DeserializeOwned + Clone,
    R: Serialize + DeserializeOwned,
{
    spawn_n_until(n, args, f, crate::os::deadline_after(timeout))
}

fn spawn_n_until<A, R>(
    n: usize,
    args: A,
    f: fn((usize, A)) -> R,
    deadline: Option<Instant>,
) -> Result<Vec<R>, JoinError>
where
    A: Serialize + DeserializeOwned + Clone,
    R: Serialize + DeserializeOwned,
{
    let mut handles: Vec<Option<JoinHandle<R>>> = Vec::with_capacity(n);
    for rank in 0..n {
        let mut builder = Builder::new();
        if let Some(deadline) = deadline {
            builder = builder.start_timeout(deadline.saturating_duration_since(Instant::now()));
        }
        match builder.spawn((rank, args.clone()), f) {
            Err(JoinError::Timeout) => {
                terminate_all(&mut handles);
                return Err(JoinError::Timeout);
            }
            Ok(handle) => handles.push(Some(handle)),
            Err(JoinError::NotInitialized) => return Err(JoinError::NotInitialized),
            Err(error) => {
                terminate_all(&mut handles);
                return Err(JoinError::Rank { rank, error: Box::new(error) });
            }
        }
    }
    let mut results: Vec<Option<R>> = (0..n).map(|_| None).collect();
    let mut left = n;
    while left > 0 {
        for rank in 0..n {
            let Some(handle) = handles[rank].as_mut() else { continue };
            match handle.join_timeout(Duration::ZERO) {
                Ok(r) => {
                    results[rank] = Some(r);
                    handles[rank] = None;
                    left -= 1;
                }
                Err(JoinError::Timeout) => {}
                Err(error) => {
                    terminate_all(&mut handles);
                    return Err(JoinError::Rank { rank, error: Box::new(error) });
                }
            }
        }
        if left > 0 {
            let wait = match deadline {
                Some(d) if Instant::now() >= d => {
                    terminate_all(&mut handles);
                    return Err(JoinError::Timeout);
                }
                Some(d) => JOIN_POLL.min(d.saturating_duration_since(Instant::now())),
                None => JOIN_POLL,
            };
            // Wakes early when the first still-running child exits.
            if let Some(watch) = handles.iter().flatten().find_map(|h| h.watch.as_ref()) {
                watch.exited(wait);
            }
        }
    }
    Ok(results.into_iter().flatten().collect())
}

/// Ends the ranks still running once one failed (or could not start), as torch's spawn does.
fn terminate_all<R: Serialize + DeserializeOwned>(handles: &mut [Option<JoinHandle<R>>]) {
    // All are asked first and given one grace together, not one after another.
    let deadline = crate::os::instant_after(Duration::from_secs(5));
    let asked: Vec<bool> = handles.iter().map(|h| h.as_ref().is_some_and(JoinHandle::ask_to_stop)).collect();
    for (other, asked) in handles.iter_mut().zip(asked) {
        if let Some(other) = other {
            let _ = other.stop_by(asked.then_some(deadline));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    static ORDER: AtomicUsize = AtomicUsize::new(0);
    static FIRST: AtomicUsize = AtomicUsize::new(0);
    static SECOND: AtomicUsize = AtomicUsize::new(0);

    extern "C" fn first_hook() {
        FIRST.store(ORDER.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
    }

    extern "C" fn second_hook() {
        SECOND.store(ORDER.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
    }

    /// Hooks run early, last registered first.
    #[test]
    fn exit_hooks_run_last_first() {
        let hooks = Mutex::new(vec![first_hook as extern "C" fn(), second_hook]);
        run_hooks(&hooks);
        assert_eq!((SECOND.load(Ordering::SeqCst), FIRST.load(Ordering::SeqCst)), (1, 2));
    }

    static LATE_LIST: Mutex<Vec<extern "C" fn()>> = Mutex::new(Vec::new());
    static LATE: AtomicUsize = AtomicUsize::new(0);

    extern "C" fn registers_another() {
        LATE_LIST.lock().unwrap().push(late_hook);
    }

    extern "C" fn late_hook() {
        LATE.fetch_add(1, Ordering::SeqCst);
    }

    /// A hook registered while the hooks run (a release's first post starting the courier,
    /// whose hook waits for it) runs in the same `before_exit`.
    #[test]
    fn a_hook_registered_while_hooks_run_runs_too() {
        LATE_LIST.lock().unwrap().push(registers_another);
        run_hooks(&LATE_LIST);
        assert_eq!(LATE.load(Ordering::SeqCst), 1);
    }

    static NESTED: AtomicUsize = AtomicUsize::new(0);

    extern "C" fn calls_before_exit() {
        NESTED.fetch_add(1, Ordering::SeqCst);
        before_exit();
    }

    /// A hook that calls `before_exit` (a library's cleanup that calls it too) returns: the
    /// nested call runs nothing.
    #[test]
    fn before_exit_inside_an_exit_hook_returns_at_once() {
        let child = crate::sys::fork_and_run(|| {
            // SAFETY: `alarm` only schedules a signal, which ends this child if it loops.
            unsafe { libc::alarm(10) };
            at_exit(calls_before_exit) && {
                before_exit();
                NESTED.load(Ordering::SeqCst) == 1
            }
        });
        assert!(child.expect("fork"), "the hook ran more than once, or the nested call did not return");
    }

    static PARENTS: AtomicUsize = AtomicUsize::new(0);
    static CHILDS: AtomicUsize = AtomicUsize::new(0);

    extern "C" fn parents_hook() {
        PARENTS.fetch_add(1, Ordering::SeqCst);
    }

    extern "C" fn childs_hook() {
        CHILDS.fetch_add(1, Ordering::SeqCst);
    }

    /// A forked child runs only the hooks it registered itself, and registers them even when
    /// a thread of its parent held the list's lock at the fork (it waited for ever, before).
    #[test]
    fn a_forked_child_runs_its_own_exit_hooks_only_and_never_waits_on_its_parents_lock() {
        assert!(at_exit(parents_hook));
        let (held_tx, held) = std::sync::mpsc::channel();
        let (release, release_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let _list = EXIT_HOOKS.get().lock().unwrap();
            held_tx.send(()).unwrap();
            let _ = release_rx.recv();
        });
        held.recv().unwrap();
        let child = crate::sys::fork_and_run(|| {
            // SAFETY: `alarm` only schedules a signal, which ends this child if it hangs.
            unsafe { libc::alarm(10) };
            let registered = at_exit(childs_hook);
            before_exit();
            registered && CHILDS.load(Ordering::SeqCst) == 1 && PARENTS.load(Ordering::SeqCst) == 0
        });
        release.send(()).unwrap();
        holder.join().unwrap();
        assert!(child.expect("fork"), "the child ran its parent's hook, missed its own, or hung");
        // The parent's list has its hook (running them here would end this process's other
        // tests' state), and not the child's.
        assert!(EXIT_HOOKS.get().lock().unwrap().contains(&(parents_hook as extern "C" fn())));
        assert!(!EXIT_HOOKS.get().lock().unwrap().contains(&(childs_hook as extern "C" fn())));
    }
}
