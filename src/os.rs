//! The operating-system calls cuda-mp makes itself (everything else goes through ipc-channel):
//! the descriptor limit, shared memory read as atomics (anonymous, or named with `shm_open` for
//! PyTorch's reference counters), exit hooks, watching a child's exit, panics of the transport
//! caught without printing them, and the panics of a pool worker's job thread reported as they
//! happen.

use std::cell::Cell;
use std::sync::atomic::AtomicU64;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Once, OnceLock, RwLock};

use crate::error::PanicReport;

/// The soft and hard limits on open file descriptors (`RLIMIT_NOFILE`).
fn descriptor_limits() -> Option<(u64, u64)> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `limit` is a valid, writable rlimit.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
    // `rlim_t` is not `u64` on every platform.
    #[allow(clippy::unnecessary_cast)]
    ok.then_some((limit.rlim_cur as u64, limit.rlim_max as u64))
}

/// Milliseconds for `poll(2)`: -1 without a limit, rounded up so that a wait never ends before
/// its deadline.
pub(crate) fn poll_millis(left: Option<std::time::Duration>) -> libc::c_int {
    match left {
        None => -1,
        Some(d) => d.as_nanos().div_ceil(1_000_000).min(libc::c_int::MAX as u128) as libc::c_int,
    }
}

/// How long to wait next, at most `most`, before `deadline` (none: no limit); `None` once it
/// has passed.
pub(crate) fn wait_slice(
    deadline: Option<std::time::Instant>,
    most: std::time::Duration,
) -> Option<std::time::Duration> {
    match deadline.map(|d| d.saturating_duration_since(std::time::Instant::now())) {
        Some(left) if left.is_zero() => None,
        Some(left) => Some(left.min(most)),
        None => Some(most),
    }
}

/// The soft limit on open descriptors of this process.
pub(crate) fn descriptor_limit() -> u64 {
    descriptor_limits().map_or(0, |(soft, _)| soft)
}

/// Lifts the soft limit on open descriptors to the hard limit, once per process: every shared
/// storage and every lease is a descriptor, as every connection is for a server.
pub(crate) fn raise_descriptor_limit() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if let Some((soft, hard)) = descriptor_limits() {
            if soft < hard {
                let limit = libc::rlimit { rlim_cur: hard as libc::rlim_t, rlim_max: hard as libc::rlim_t };
                // SAFETY: `limit` is a valid rlimit; raising the soft limit up to the hard one
                // is always allowed.
                unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
            }
        }
    });
}

/// Bytes of physical memory of this machine (0 when unknown).
pub(crate) fn physical_memory() -> u64 {
    // SAFETY: sysconf only reads system configuration.
    let (pages, page) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    if pages > 0 && page > 0 {
        (pages as u64).saturating_mul(page as u64)
    } else {
        0
    }
}

/// True when this process is at, or within one transport message (64 descriptors) of, its
/// limit on open descriptors: a message whose descriptors could not all be received was
/// probably cut short by the limit, and dropping it has freed what did arrive.
pub(crate) fn near_descriptor_limit() -> bool {
    let limit = descriptor_limit();
    let open = std::fs::read_dir("/proc/self/fd").map(|d| d.count() as u64).unwrap_or(0);
    out_of_descriptors() || open + 64 >= limit
}

/// True when this process cannot open one more descriptor (`EMFILE`/`ENFILE`): probes by
/// duplicating standard input's slot number into a fresh descriptor and closing it again.
pub(crate) fn out_of_descriptors() -> bool {
    // SAFETY: `F_DUPFD_CLOEXEC` on descriptor 0 only reads the descriptor table; a returned
    // descriptor is ours and closed at once.
    let fd = unsafe { libc::fcntl(0, libc::F_DUPFD_CLOEXEC, 0) };
    if fd >= 0 {
        // SAFETY: `fd` was just returned to us and is used nowhere else.
        unsafe { libc::close(fd) };
        return false;
    }
    let errno = std::io::Error::last_os_error().raw_os_error();
    // Without a descriptor 0 the probe says nothing: try a pipe instead.
    if errno == Some(libc::EBADF) {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` is a writable array of two descriptors.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } == 0 {
            // SAFETY: both descriptors were just returned to us.
            unsafe {
                libc::close(fds[0]);
                libc::close(fds[1]);
            }
            return false;
        }
        let errno = std::io::Error::last_os_error().raw_os_error();
        return matches!(errno, Some(libc::EMFILE) | Some(libc::ENFILE));
    }
    matches!(errno, Some(libc::EMFILE) | Some(libc::ENFILE))
}

/// Shared memory seen as an array of `AtomicU64` cells: other processes may write it at any
/// time, so it is only ever accessed atomically.
pub(crate) struct SharedCells {
    memory: std::sync::Arc<crate::sys::MemoryFile>,
}

impl SharedCells {
    /// Cells over `memory` (its length rounded down to whole cells).
    pub(crate) fn new(memory: std::sync::Arc<crate::sys::MemoryFile>) -> SharedCells {
        SharedCells { memory }
    }

    /// `len` zeroed cells in fresh shared memory.
    pub(crate) fn zeroed(len: usize) -> std::io::Result<SharedCells> {
        Ok(SharedCells::new(std::sync::Arc::new(crate::sys::MemoryFile::zeroed(len * 8)?)))
    }

    /// Cell `i`, if in range.
    pub(crate) fn cell(&self, i: u32) -> Option<&AtomicU64> {
        if (i as usize) < self.memory.len() / 8 {
            // SAFETY: in bounds of the live mapping; the mapping is page-aligned, so every cell
            // is 8-byte aligned, as AtomicU64 requires; every access to it, in any process, is
            // atomic.
            Some(unsafe { AtomicU64::from_ptr(self.memory.ptr().cast::<u64>().add(i as usize)) })
        } else {
            None
        }
    }

    /// The shared memory, to send to another process.
    pub(crate) fn memory(&self) -> &std::sync::Arc<crate::sys::MemoryFile> {
        &self.memory
    }
}

/// A named POSIX shared-memory object (`shm_open`), mapped read-write in full and accessed only
/// through atomics (other processes write it at any time). Dropping it unmaps it; the object
/// itself stays until someone unlinks it ([`shm_unlink`]).
///
/// Another process that shrinks the object while it is mapped here makes accesses past its new
/// end fault (`SIGBUS`), as with any shared mapping; the objects cuda-mp maps belong to
/// cooperating processes (PyTorch's reference counters) that never shrink them.
pub(crate) struct ShmFile {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is owned by the value and lives as long as it; its bytes are only
// accessed atomically, which concurrent writers (threads or processes) cannot make undefined.
unsafe impl Send for ShmFile {}
// SAFETY: as above.
unsafe impl Sync for ShmFile {}

/// What opening an existing shared-memory object found.
#[derive(Debug)]
pub(crate) enum ShmOpen {
    /// Mapped.
    Mapped(ShmFile),
    /// No object of that name.
    Missing,
    /// The object holds fewer bytes than asked for (it is left as it is).
    TooSmall,
}

/// Closes `fd` when dropped.
struct Fd(libc::c_int);

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: the descriptor was returned to us by `shm_open` and is closed once, here.
        unsafe { libc::close(self.0) };
    }
}

/// Size in bytes of the object behind `fd`.
fn fd_size(fd: &Fd) -> std::io::Result<u64> {
    // SAFETY: `stat` is plain integers, for which all zeroes is a valid value.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `stat` is valid and writable; `fd` is open.
    if unsafe { libc::fstat(fd.0, &mut stat) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(stat.st_size.max(0) as u64)
}

impl ShmFile {
    /// Creates the object `name` (which must not exist yet; mode 0600) with `len` zeroed bytes,
    /// and maps it. `ErrorKind::AlreadyExists` when the name is taken.
    pub(crate) fn create(name: &std::ffi::CStr, len: usize) -> std::io::Result<ShmFile> {
        // SAFETY: `name` is NUL-terminated; a non-negative result is a new descriptor we own.
        let fd = unsafe {
            libc::shm_open(name.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC, 0o600)
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = Fd(fd);
        let mapped = libc::off_t::try_from(len)
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
            .and_then(|size| {
                // SAFETY: `fd` is open, and ours.
                if unsafe { libc::ftruncate(fd.0, size) } != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                ShmFile::map(&fd, len)
            });
        if mapped.is_err() {
            // Nobody else knows the name yet: take it back.
            let _ = shm_unlink(name);
        }
        mapped
    }

    /// Opens the existing object `name` read-write and maps its first `len` bytes; creates
    /// nothing and changes nothing when it is missing or smaller.
    pub(crate) fn open(name: &std::ffi::CStr, len: usize) -> std::io::Result<ShmOpen> {
        // SAFETY: `name` is NUL-terminated; a non-negative result is a new descriptor we own.
        let fd = unsafe { libc::shm_open(name.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ENOENT) => Ok(ShmOpen::Missing),
                _ => Err(e),
            };
        }
        let fd = Fd(fd);
        let size = fd_size(&fd)?;
        if size < len as u64 {
            return Ok(ShmOpen::TooSmall);
        }
        Ok(ShmOpen::Mapped(ShmFile::map(&fd, len)?))
    }

    /// Size in bytes of the existing object `name`, or None when there is none.
    pub(crate) fn size_of(name: &std::ffi::CStr) -> std::io::Result<Option<u64>> {
        // SAFETY: `name` is NUL-terminated; a non-negative result is a new descriptor we own.
        let fd = unsafe { libc::shm_open(name.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC, 0) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ENOENT) => Ok(None),
                _ => Err(e),
            };
        }
        fd_size(&Fd(fd)).map(Some)
    }

    /// Maps the first `len` bytes (at least one) of `fd`, shared and read-write.
    fn map(fd: &Fd, len: usize) -> std::io::Result<ShmFile> {
        if len == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
        }
        // SAFETY: a fresh mapping chosen by the kernel (no address hint) of an open descriptor;
        // the descriptor may be closed afterwards, the mapping stays.
        let ptr = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.0, 0)
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let ptr =
            std::ptr::NonNull::new(ptr as *mut u8).ok_or_else(|| std::io::Error::from(std::io::ErrorKind::Other))?;
        Ok(ShmFile { ptr, len })
    }

    /// The 32-bit cell at byte `offset`, if aligned and inside the mapping.
    pub(crate) fn i32_at(&self, offset: usize) -> Option<&std::sync::atomic::AtomicI32> {
        let inside = offset.is_multiple_of(4) && offset.checked_add(4).is_some_and(|end| end <= self.len);
        // SAFETY: inside the live mapping, which is page-aligned, so the cell is 4-byte aligned
        // as `AtomicI32` requires; the reference lives no longer than the mapping (`&self`), and
        // the memory is only ever accessed atomically.
        inside.then(|| unsafe { &*(self.ptr.as_ptr().add(offset) as *const std::sync::atomic::AtomicI32) })
    }

    /// The 64-bit cell at byte `offset`, if aligned and inside the mapping.
    pub(crate) fn i64_at(&self, offset: usize) -> Option<&std::sync::atomic::AtomicI64> {
        let inside = offset.is_multiple_of(8) && offset.checked_add(8).is_some_and(|end| end <= self.len);
        // SAFETY: as for `i32_at`, with 8-byte alignment.
        inside.then(|| unsafe { &*(self.ptr.as_ptr().add(offset) as *const std::sync::atomic::AtomicI64) })
    }
}

impl Drop for ShmFile {
    fn drop(&mut self) {
        // SAFETY: `ptr` and `len` are exactly the mapping made in `map`; no reference into it
        // outlives `self`.
        unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len) };
    }
}

impl std::fmt::Debug for ShmFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmFile").field("len", &self.len).finish_non_exhaustive()
    }
}

/// Removes the shared-memory object `name` (processes that have it mapped keep their mapping).
pub(crate) fn shm_unlink(name: &std::ffi::CStr) -> std::io::Result<()> {
    // SAFETY: `name` is NUL-terminated.
    if unsafe { libc::shm_unlink(name.as_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Runs `f` when the process exits normally (`exit`, or returning from `main`), after the
/// handlers registered later. False when it could not be registered.
pub(crate) fn at_exit(f: extern "C" fn()) -> bool {
    // SAFETY: `f` is a plain function with no arguments, valid for the life of the process.
    unsafe { libc::atexit(f) == 0 }
}

/// Runs `f` in the child of every later `fork(2)`, before `fork` returns there (a
/// `pthread_atfork` child handler). False when it could not be registered.
pub(crate) fn at_fork_child(f: extern "C" fn()) -> bool {
    // SAFETY: `f` is a plain function with no arguments, valid for the life of the process, and
    // the caller makes it async-signal-safe (it runs in a child that may have inherited locks).
    unsafe { libc::pthread_atfork(None, None, Some(f)) == 0 }
}

/// Forks, runs `f` in the child and ends the child with `f`'s answer (a panic is `false`),
/// without running exit hooks: the child of a multithreaded test process, as a library that
/// forks would make one. The parent waits for the child and gets the answer.
#[cfg(test)]
pub(crate) fn fork_and_run(f: impl FnOnce() -> bool) -> std::io::Result<bool> {
    // SAFETY: the child only runs `f` and `_exit`s; the parent only waits for it.
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
    // SAFETY: `pid` is our child; `status` is writable.
    if unsafe { libc::waitpid(pid, &mut status, 0) } != pid {
        return Err(std::io::Error::last_os_error());
    }
    Ok(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0)
}

/// How a child process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Exit {
    /// It exited with this status.
    Code(i32),
    /// A signal killed it.
    Signal(i32),
}

/// Watches a child process for its end without reaping it (whoever owns it reaps it).
#[derive(Debug)]
pub(crate) struct ChildWatch {
    pid: libc::pid_t,
    /// A pidfd, readable once the child has exited (`None` where the kernel has none).
    pidfd: Option<std::os::fd::OwnedFd>,
}

impl ChildWatch {
    pub(crate) fn new(pid: u32) -> ChildWatch {
        // SAFETY: `pidfd_open(pid, 0)` has no memory arguments; a non-negative result is a new
        // descriptor that we own.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        let pidfd = (fd >= 0).then(|| {
            // SAFETY: `fd` is a fresh descriptor owned by nobody else.
            unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as libc::c_int) }
        });
        ChildWatch { pid: pid as libc::pid_t, pidfd }
    }

    /// How the child ended, if it has (waiting up to `wait` for it to end); leaves it to be
    /// reaped by its owner. `None` while it runs, or once someone else reaped it.
    pub(crate) fn exited(&self, wait: std::time::Duration) -> Option<Exit> {
        if let Some(exit) = self.peek() {
            return Some(exit);
        }
        if wait.is_zero() {
            return None;
        }
        match &self.pidfd {
            Some(fd) => {
                let mut poll =
                    libc::pollfd { fd: std::os::fd::AsRawFd::as_raw_fd(fd), events: libc::POLLIN, revents: 0 };
                let ms = wait.as_millis().min(i32::MAX as u128) as libc::c_int;
                // SAFETY: `poll` is one valid pollfd.
                unsafe { libc::poll(&mut poll, 1, ms) };
            }
            None => std::thread::sleep(wait),
        }
        self.peek()
    }

    /// Sends `signal` to the child unless it has exited (then its pid may belong to someone
    /// else once reaped; an exited child not yet reaped is left alone too).
    pub(crate) fn signal(&self, signal: i32) -> bool {
        if self.peek().is_some() {
            return false;
        }
        // SAFETY: `kill` has no memory arguments; the pid is our child's, which has not
        // exited (so not reaped: the pid is not reused).
        unsafe { libc::kill(self.pid, signal) == 0 }
    }

    /// How the child ended, also once someone else has reaped it: then the kernel keeps its
    /// exit status for the pidfd (Linux 6.15 and later; `None` on older kernels). `None` while
    /// it runs.
    pub(crate) fn exit_status(&self) -> Option<Exit> {
        self.peek().or_else(|| self.reaped_status())
    }

    fn reaped_status(&self) -> Option<Exit> {
        let fd = std::os::fd::AsRawFd::as_raw_fd(self.pidfd.as_ref()?);
        // SAFETY: `pidfd_info` is plain integers, for which all zeroes is a valid value.
        let mut info: libc::pidfd_info = unsafe { std::mem::zeroed() };
        info.mask = libc::PIDFD_INFO_EXIT as u64;
        // SAFETY: `PIDFD_GET_INFO` writes at most `size_of::<pidfd_info>()` bytes (the size the
        // request encodes) into `info`, which is valid and writable; a kernel without it fails.
        let r = unsafe { libc::ioctl(fd, libc::PIDFD_GET_INFO, &mut info) };
        if r != 0 || info.mask & libc::PIDFD_INFO_EXIT as u64 == 0 {
            return None;
        }
        let status = info.exit_code;
        if libc::WIFSIGNALED(status) {
            Some(Exit::Signal(libc::WTERMSIG(status)))
        } else if libc::WIFEXITED(status) {
            Some(Exit::Code(libc::WEXITSTATUS(status)))
        } else {
            None
        }
    }

    fn peek(&self) -> Option<Exit> {
        // SAFETY: zeroed siginfo_t is a valid output buffer for waitid.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `info` is writable; WNOWAIT leaves the child to be reaped by its owner.
        let r = unsafe {
            libc::waitid(libc::P_PID, self.pid as libc::id_t, &mut info, libc::WEXITED | libc::WNOHANG | libc::WNOWAIT)
        };
        // SAFETY: after a successful waitid the pid and status fields are initialized.
        let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
        if r != 0 || pid == 0 {
            return None;
        }
        Some(match info.si_code {
            libc::CLD_EXITED => Exit::Code(status),
            _ => Exit::Signal(status),
        })
    }
}

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

thread_local! {
    /// Set while a panic of the transport is being caught on this thread.
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

/// Where the panics of one thread of this process are reported (see [`report_panics`]).
struct Reporter {
    thread: std::thread::ThreadId,
    report: Box<dyn Fn(PanicReport) + Send + Sync>,
}

static REPORTER: OnceLock<Reporter> = OnceLock::new();

/// A panic hook.
type Hook = Box<dyn Fn(&std::panic::PanicHookInfo<'_>) + Send + Sync>;

/// The hook that this module's hook passes the panics it does not keep quiet to: the one it
/// replaced, or Rust's default hook once [`report_panics`] has been called.
static PREVIOUS: RwLock<Option<Hook>> = RwLock::new(None);

/// Installs this module's panic hook, once per process: it keeps the panics that
/// [`catch_quietly`] catches from printing, hands the panics of the thread given to
/// [`report_panics`] to its reporter, and passes everything else on to [`PREVIOUS`].
fn install_hook() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        *PREVIOUS.write().unwrap_or_else(|p| p.into_inner()) = Some(std::panic::take_hook());
        std::panic::set_hook(Box::new(|info| {
            if QUIET.with(Cell::get) {
                return;
            }
            if let Some(reporter) = REPORTER.get() {
                if reporter.thread == std::thread::current().id() {
                    (reporter.report)(PanicReport {
                        message: panic_message(info.payload()),
                        location: info.location().map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column())),
                    });
                }
            }
            if let Some(previous) = PREVIOUS.read().unwrap_or_else(|p| p.into_inner()).as_ref() {
                previous(info)
            }
        }));
    });
}

/// Hands every panic of the calling thread to `report` as it happens, before the panic unwinds
/// (and before it prints), except the panics that [`catch_quietly`] catches. One thread per
/// process: false (and nothing changes) when a reporter is already set.
///
/// The panics of this process then print with Rust's default hook rather than the hook
/// installed before cuda-mp's: in a spawned process that is procspawn's, which captures and
/// resolves a backtrace for its own report (a second or more in a debug build), a report that
/// the caller, reporting panics itself, does not read.
pub(crate) fn report_panics(report: impl Fn(PanicReport) + Send + Sync + 'static) -> bool {
    install_hook();
    if REPORTER.set(Reporter { thread: std::thread::current().id(), report: Box::new(report) }).is_err() {
        return false;
    }
    // `take_hook` puts the default hook in place of the one it returns: take ours, then the
    // default, and put ours back.
    let ours = std::panic::take_hook();
    let default = std::panic::take_hook();
    std::panic::set_hook(ours);
    *PREVIOUS.write().unwrap_or_else(|p| p.into_inner()) = Some(default);
    true
}

/// Runs `f`, turning a panic into `Err(message)` without printing it: the transport
/// (ipc-channel) asserts where it should return errors (a forged descriptor index, a failed
/// `memfd_create` or `mmap`), and those are errors of ours to report, not crashes to print.
/// Panics elsewhere, on other threads or outside `f`, print as usual.
pub(crate) fn catch_quietly<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    install_hook();
    let was_quiet = QUIET.with(|q| q.replace(true));
    let result = catch_unwind(AssertUnwindSafe(f));
    QUIET.with(|q| q.set(was_quiet));
    result.map_err(|payload| panic_message(&*payload))
}

/// The message a panic was given (`panic!` makes it a `&str` or a `String`).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caught_panic_becomes_its_message() {
        assert_eq!(catch_quietly(|| 7), Ok(7));
        assert_eq!(catch_quietly(|| -> () { panic!("boom {}", 1) }), Err("boom 1".to_string()));
        assert!(!out_of_descriptors());
        raise_descriptor_limit();
        assert!(descriptor_limit() > 0);
    }
}
