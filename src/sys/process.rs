//! This process and others: whether a process still lives (its id, start time and pid
//! namespace), the C library's exit and fork hooks, and signal names.

use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};

/// This process's id.
pub(crate) fn own_pid() -> u32 {
    std::process::id()
}

/// When this process started (in clock ticks since boot; 0 when unknown), as
/// [`per_process`] keeps it. Read from `/proc/self`: `/proc/<own pid>` names another process
/// where this one is in a pid namespace other than the one `/proc` was mounted for.
pub(crate) fn own_start() -> u64 {
    per_process(&START, &START_FOR_PID, || stat_of(std::path::Path::new("/proc/self/stat")).map_or(0, |s| s.start))
}

/// The identity of this process's pid namespace (0 when unknown): pids of processes in other
/// namespaces mean nothing here. Kept as [`per_process`] does (a child forked after
/// `unshare(CLONE_NEWPID)` is in another namespace).
pub(crate) fn pid_namespace() -> u64 {
    per_process(&NAMESPACE, &NAMESPACE_FOR_PID, || std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino()))
}

static START: AtomicU64 = AtomicU64::new(0);
static START_FOR_PID: AtomicU32 = AtomicU32::new(0);
static NAMESPACE: AtomicU64 = AtomicU64::new(0);
static NAMESPACE_FOR_PID: AtomicU32 = AtomicU32::new(0);

/// A value of this process that `read` gives (0: unknown), cached in `value` with the process id
/// it was read for in `for_pid`: a child forked without `exec` reads its own, as its pid
/// differs; one whose pid is its parent's (both pid 1, the child in a pid namespace the parent
/// made with `unshare`) has the cache emptied by a fork handler, and nothing is cached before
/// that handler is registered. Not cached while unknown (`/proc` unreadable, out of
/// descriptors): a later call reads again. (Atomics, not a lock: a fork while another thread
/// held a lock would leave it held in the child.)
fn per_process(value: &AtomicU64, for_pid: &AtomicU32, read: impl FnOnce() -> u64) -> u64 {
    let pid = own_pid();
    if for_pid.load(Ordering::Acquire) == pid {
        return value.load(Ordering::Relaxed);
    }
    let read = read();
    if read != 0 && forgotten_in_children() {
        value.store(read, Ordering::Relaxed);
        for_pid.store(pid, Ordering::Release);
    }
    read
}

/// Whether the fork handler that empties [`per_process`]'s caches in a child is registered,
/// registering it on the first call. False while another thread registers it (the value is
/// then read again next time, not cached), and for ever in a child forked meanwhile (whose
/// values are then always read). A state word, not a `Once`: a child forked while another
/// thread ran a `Once` would wait on it for ever.
fn forgotten_in_children() -> bool {
    const NONE: u8 = 0;
    const REGISTERING: u8 = 1;
    const REGISTERED: u8 = 2;
    static STATE: AtomicU8 = AtomicU8::new(NONE);
    extern "C" fn nothing() {}
    extern "C" fn forget() {
        START_FOR_PID.store(0, Ordering::Release);
        NAMESPACE_FOR_PID.store(0, Ordering::Release);
    }
    match STATE.compare_exchange(NONE, REGISTERING, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {
            // SAFETY: `forget` only stores to atomics (async-signal-safe); the others do
            // nothing. Should registering fail (out of memory), nothing is cached.
            let registered = unsafe { at_fork(nothing, nothing, forget) };
            STATE.store(if registered { REGISTERED } else { REGISTERING }, Ordering::Release);
            registered
        }
        Err(state) => state == REGISTERED,
    }
}

/// True when the process `pid`, which started at `start` (0: unknown), has ended: no such
/// process, a zombie, or the pid now belongs to a process that started at another time.
pub(crate) fn process_gone(pid: u32, start: u64) -> bool {
    // No process has this id (and kill would address a group).
    let Some(raw) = i32::try_from(pid).ok().filter(|&p| p > 0) else { return true };
    let Some(target) = rustix::process::Pid::from_raw(raw) else { return true };
    // Signal 0: sends nothing, only checks that the process exists.
    if rustix::process::test_kill_process(target) == Err(rustix::io::Errno::SRCH) {
        return true;
    }
    match process_stat(pid) {
        // A process whose main thread ended while others run shows its main thread's state,
        // `Z`, and lives on: it is gone only once its last thread is.
        Some(stat) => {
            (matches!(stat.state, 'Z' | 'X' | 'x') && stat.threads <= 1) || (start != 0 && stat.start != start)
        }
        // Exists (kill said so) but /proc does not show it to us: assume it lives.
        None => false,
    }
}

struct Stat {
    state: char,
    /// The main thread's flags (`PF_*` of `linux/sched.h`).
    flags: u64,
    threads: u64,
    start: u64,
}

/// `PF_EXITING` of `linux/sched.h`: the thread is in `do_exit`.
const PF_EXITING: u64 = 0x4;

/// A pidfd of process `pid` (which started at `start`) while it is ending and its exit is not
/// complete: its main thread is exiting, or has ended while another thread of it exits. The
/// pidfd reads as readable once the exit is complete: every thread has ended, after the
/// release of every file it held (a CUDA driver's included, which stops the GPU work the
/// process queued). `None` once it has exited, while it lives on, or where the kernel cannot
/// tell (no pidfds, or `/proc` hides it).
pub(crate) fn ending(pid: u32, start: u64) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::AsFd;
    let target = rustix::process::Pid::from_raw(i32::try_from(pid).ok()?)?;
    let pidfd = rustix::process::pidfd_open(target, rustix::process::PidfdFlags::empty()).ok()?;
    // Read after the pidfd is open: a process that started at another time is not the one
    // named, and the one named has exited.
    let stat = process_stat(pid).filter(|s| start == 0 || s.start == start)?;
    let exiting = if matches!(stat.state, 'Z' | 'X' | 'x') {
        // A main thread that ended while the process lives on shows as a zombie too: the
        // process ends only where another thread of it is exiting.
        any_thread_exiting(pid)
    } else {
        stat.flags & PF_EXITING != 0
    };
    if !exiting {
        return None;
    }
    let done = super::socket::wait_for(pidfd.as_fd(), rustix::event::PollFlags::IN, super::Wait::Not);
    matches!(done, Ok(None)).then_some(pidfd)
}

/// Whether a thread of process `pid` is in `do_exit`.
fn any_thread_exiting(pid: u32) -> bool {
    let Ok(threads) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
    threads
        .flatten()
        .any(|thread| stat_of(&thread.path().join("stat")).is_some_and(|s| s.flags & PF_EXITING != 0 && s.state != 'Z'))
}

/// The state and start time of a process, from `/proc/PID/stat`.
fn process_stat(pid: u32) -> Option<Stat> {
    stat_of(std::path::Path::new(&format!("/proc/{pid}/stat")))
}

/// The fields of a `stat` file of `/proc` (a process's, or one of its threads').
fn stat_of(path: &std::path::Path) -> Option<Stat> {
    let text = std::fs::read_to_string(path).ok()?;
    // "pid (comm) state ppid ...": the name may hold spaces and parentheses; fields follow the
    // last ')'. The state is field 3, the flags field 9, the number of threads field 20, the start
    // time field 22.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_ascii_whitespace().take(20).collect();
    let state = fields.first()?.chars().next()?;
    let flags = fields.get(6)?.parse().ok()?;
    let threads = fields.get(17)?.parse().ok()?;
    let start = fields.get(19)?.parse().ok()?;
    Some(Stat { state, flags, threads, start })
}

/// Runs `f` when the process exits normally (`exit`, or returning from `main`), after the
/// handlers registered later. False when it could not be registered.
pub(crate) fn at_exit(f: extern "C" fn()) -> bool {
    // SAFETY: `f` is a plain function with no arguments, valid for the life of the process.
    unsafe { libc::atexit(f) == 0 }
}

/// Runs `prepare` in the parent before every later `fork(2)`, `parent` in the parent after it,
/// and `child` in the child before `fork` returns there (`pthread_atfork`). False when they
/// could not be registered.
///
/// # Safety
/// `child` must be async-signal-safe: it runs in a child that may have inherited locks held by
/// threads that do not exist there. `prepare` and `parent` run in the forking thread of the
/// parent, whose other threads run on.
pub(crate) unsafe fn at_fork(prepare: extern "C" fn(), parent: extern "C" fn(), child: extern "C" fn()) -> bool {
    // SAFETY: plain functions with no arguments, valid for the life of the process; the caller
    // vouches that `child` is async-signal-safe.
    unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) == 0 }
}

/// Closes descriptor number `fd` of this process, in a forked child's handler (`close` is
/// async-signal-safe); an error (a number not open) is ignored.
///
/// # Safety
/// No object of this process may use or close `fd` after this: the object that owns it was
/// inherited from the parent and is never used or dropped in the child.
pub(crate) unsafe fn close_inherited(fd: std::os::fd::RawFd) {
    // SAFETY: the caller vouches that nothing owns the number any more in this process.
    unsafe { libc::close(fd) };
}

/// Closes, in a forked child's handler, a descriptor that the child's copy of its parent's
/// memory owns, if this is its last owner there (another owner, on the stack of a thread the
/// child does not have, is never dropped: the descriptor then stays open in the child).
///
/// Not by dropping it: `fork` copies the descriptor table before the memory, while the parent's
/// other threads run, so an object made between the two copies names a number that is not open
/// in the child (or is open there as the file that number was before). `OwnedFd`'s drop aborts
/// on a number not open (with debug assertions); this ignores it.
pub(crate) fn close_inherited_shared<T: Into<std::os::fd::OwnedFd>>(fd: std::sync::Arc<T>) {
    use std::os::fd::IntoRawFd;
    if let Ok(fd) = std::sync::Arc::try_unwrap(fd) {
        // SAFETY: the descriptor was this owner's alone, and it is consumed here.
        unsafe { close_inherited(fd.into().into_raw_fd()) };
    }
}

/// Forks, runs `f` in the child and ends the child with `f`'s answer (a panic is `false`),
/// without running exit hooks: the child of a multithreaded test process, as a library that
/// forks would make one. The parent waits for the child and gets the answer.
#[cfg(test)]
pub(crate) fn fork_and_run(f: impl FnOnce() -> bool) -> std::io::Result<bool> {
    use std::panic::{AssertUnwindSafe, catch_unwind};
    // SAFETY: the child only runs `f` and `_exit`s; the parent only waits for it. (`f` may
    // allocate: the tests that use this hold no allocator lock across the fork in practice; a
    // child that deadlocked would hang its test, not corrupt memory.)
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if pid == 0 {
        let ok = catch_unwind(AssertUnwindSafe(f)).unwrap_or(false);
        // SAFETY: ends the child at once, as a forked child must (no exit hooks of the parent).
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let mut status = 0;
    loop {
        // SAFETY: `pid` is our child; `status` is writable.
        if unsafe { libc::waitpid(pid, &mut status, 0) } == pid {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0)
}

/// The number of `SIGKILL`.
pub(crate) const SIGKILL: i32 = libc::SIGKILL;

/// The name of signal `signal`, such as `SIGKILL`.
pub(crate) fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGSYS => "SIGSYS",
        _ => "unknown signal",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_living_process_a_made_up_one_and_one_that_exited_are_not_ending() {
        assert!(ending(own_pid(), own_start()).is_none(), "this process lives on");
        assert!(ending(own_pid(), own_start() + 1).is_none(), "another start time: another process");
        assert!(ending(u32::MAX, 0).is_none());
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // A zombie once it has exited (not reaped yet): its exit is complete.
        while process_stat(pid).is_some_and(|s| s.state != 'Z') {
            std::thread::yield_now();
        }
        assert!(ending(pid, 0).is_none(), "a zombie has exited");
        child.wait().unwrap();
    }

    #[test]
    fn this_process_lives_and_a_made_up_one_does_not() {
        assert!(!process_gone(own_pid(), own_start()));
        assert!(own_start() != 0);
        assert!(process_gone(own_pid(), own_start() + 1), "a pid reused by a later process");
        assert!(process_gone(0, 0));
        assert!(process_gone(u32::MAX, 0));
        assert!(process_gone(i32::MAX as u32, 0));
        assert_eq!(signal_name(SIGKILL), "SIGKILL");
    }

    /// A process whose main thread ended (`pthread_exit`) while another thread runs lives:
    /// its `/proc` state is its main thread's, `Z`, and a lock it holds must not be taken
    /// over. Once its last thread ends and it is a zombie, it is gone.
    #[test]
    fn a_process_whose_main_thread_ended_lives_while_another_thread_runs() {
        extern "C" fn linger(_: *mut libc::c_void) -> *mut libc::c_void {
            // SAFETY: `sleep` and `_exit` are async-signal-safe, as a forked child of a threaded
            // process needs; `_exit` ends the whole process.
            unsafe {
                libc::sleep(2);
                libc::_exit(0)
            }
        }
        // SAFETY: the child makes one thread with `pthread_create` and ends its own thread with
        // the `exit` system call (`pthread_exit` would unwind Rust frames, which aborts); neither
        // allocates. The parent only looks at it and waits for it.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let mut thread: libc::pthread_t = 0;
            // SAFETY: `linger` takes no argument and ends the process itself.
            unsafe {
                if libc::pthread_create(&mut thread, std::ptr::null(), linger, std::ptr::null_mut()) != 0 {
                    libc::_exit(3);
                }
                libc::syscall(libc::SYS_exit, 0);
            }
            unreachable!("the thread ended");
        }
        let child = pid as u32;
        let start = process_stat(child).map_or(0, |s| s.start);
        std::thread::sleep(std::time::Duration::from_millis(500));
        let stat = process_stat(child).expect("the child's stat");
        assert_eq!((stat.state, stat.threads), ('Z', 2), "the main thread ended, the other runs");
        assert!(!process_gone(child, start), "a process with a running thread lives");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !process_gone(child, start) {
            assert!(std::time::Instant::now() < deadline, "the child ended with its last thread");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let mut status = 0;
        // SAFETY: `pid` is our child; `status` is writable.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "status {status}");
    }
}
