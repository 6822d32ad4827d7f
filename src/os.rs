//! What the process does around its system calls (which live in `src/sys/`): deadlines cut
//! into waits, shared memory read as atomic cells, procspawn's panics caught without printing
//! them, and the panics of a pool worker's job thread reported as they happen.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Once, OnceLock, RwLock};
use std::time::{Duration, Instant};

use crate::sys::MemoryFile;

use crate::error::PanicReport;

/// `timeout` from now; `None` (no limit) for one past what the clock holds (`Duration::MAX`).
pub(crate) fn deadline_after(timeout: Duration) -> Option<Instant> {
    Instant::now().checked_add(timeout)
}

/// `timeout` from now, or about 136 years from now for one past what the clock holds.
pub(crate) fn instant_after(timeout: Duration) -> Instant {
    let far = || Instant::now().checked_add(Duration::from_secs(u32::MAX.into())).unwrap_or_else(Instant::now);
    deadline_after(timeout).unwrap_or_else(far)
}

/// How long to wait next, at most `most`, before `deadline` (none: no limit); `None` once it
/// has passed.
pub(crate) fn wait_slice(deadline: Option<Instant>, most: Duration) -> Option<Duration> {
    match deadline.map(|d| d.saturating_duration_since(Instant::now())) {
        Some(left) if left.is_zero() => None,
        Some(left) => Some(left.min(most)),
        None => Some(most),
    }
}

/// Shared memory seen as an array of `AtomicU64` cells: other processes may write it at any
/// time, so it is only ever accessed atomically.
pub(crate) struct SharedCells {
    memory: Arc<MemoryFile>,
}

impl SharedCells {
    /// Cells over `memory` (its length rounded down to whole cells).
    pub(crate) fn new(memory: Arc<MemoryFile>) -> SharedCells {
        SharedCells { memory }
    }

    /// `len` zeroed cells in fresh shared memory.
    #[cfg(test)]
    pub(crate) fn zeroed(len: usize) -> std::io::Result<SharedCells> {
        Ok(SharedCells::new(Arc::new(MemoryFile::zeroed(len * 8)?)))
    }

    /// `len` zeroed cells in fresh shared memory that only this process writes: the processes
    /// it is sent to map it read-only ([`MemoryFile::zeroed_for_readers`]).
    pub(crate) fn zeroed_for_readers(len: usize) -> std::io::Result<SharedCells> {
        Ok(SharedCells::new(Arc::new(MemoryFile::zeroed_for_readers(len * 8)?)))
    }

    /// Cell `i` to write, if in range and the memory is writable here.
    pub(crate) fn cell(&self, i: u32) -> Option<&AtomicU64> {
        self.memory.word(i as usize * 8)
    }

    /// The value of cell `i`, if in range; also where the memory is mapped read-only (a relaxed
    /// load of a word, which read-only memory allows, then an acquire fence: an acquire load).
    pub(crate) fn load(&self, i: u32) -> Option<u64> {
        let mut word = [0u8; 8];
        let read = self.memory.copy_out(i as usize * 8, &mut word);
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        read.then(|| u64::from_ne_bytes(word))
    }

    /// The shared memory, to send to another process.
    pub(crate) fn memory(&self) -> &Arc<MemoryFile> {
        &self.memory
    }
}

thread_local! {
    /// Set while a panic of the transport is being caught on this thread.
    static QUIET: Cell<bool> = const { Cell::new(false) };
    /// Whether the last panic caught quietly on this thread was raised in procspawn's or
    /// ipc-channel's code (its location's file).
    static CAUGHT_IN_DEPENDENCY: Cell<bool> = const { Cell::new(false) };
}

/// A panic that [`catch_spawn_panic`] caught.
#[derive(Debug)]
pub(crate) struct Caught {
    /// What it said.
    pub(crate) message: String,
    /// Whether it was raised in procspawn's or ipc-channel's code, not in a `Serialize` of the
    /// caller's that they ran.
    pub(crate) in_dependency: bool,
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
                let file = info.location().map_or("", |l| l.file());
                let dependency = ["procspawn", "ipc-channel", "ipc_channel"].iter().any(|d| file.contains(d));
                CAUGHT_IN_DEPENDENCY.with(|c| c.set(dependency));
                return;
            }
            if let Some(reporter) = REPORTER.get()
                && reporter.thread == std::thread::current().id()
            {
                (reporter.report)(PanicReport {
                    message: panic_message(info.payload()),
                    location: info.location().map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column())),
                });
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

/// Runs `f`, turning a panic into `Err(message)` without printing it: procspawn panics where it
/// should return errors (a spawn that cannot start, a pool worker that cannot be set up), a
/// serializer of the user's may panic, and a thread of ours must not die of either; those are
/// errors to report, not crashes to print. Panics elsewhere, on other threads or outside `f`,
/// print as usual.
pub(crate) fn catch_quietly<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    catch_spawn_panic(f).map_err(|caught| caught.message)
}

/// [`catch_quietly`], telling whose code panicked: procspawn's (or ipc-channel's), or code
/// they ran, such as the `Serialize` of a caller's arguments.
pub(crate) fn catch_spawn_panic<R>(f: impl FnOnce() -> R) -> Result<R, Caught> {
    install_hook();
    let was_quiet = QUIET.with(|q| q.replace(true));
    CAUGHT_IN_DEPENDENCY.with(|c| c.set(false));
    let result = catch_unwind(AssertUnwindSafe(f));
    QUIET.with(|q| q.set(was_quiet));
    result.map_err(|payload| Caught {
        message: panic_message(&*payload),
        in_dependency: CAUGHT_IN_DEPENDENCY.with(Cell::get),
    })
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
    }

    /// A panic raised in this crate's code (as in a caller's `Serialize`) is not procspawn's.
    #[test]
    fn a_caught_panic_of_this_crate_is_not_a_dependencys() {
        let caught = catch_spawn_panic(|| -> () { panic!("index out of bounds") }).unwrap_err();
        assert_eq!(caught.message, "index out of bounds");
        assert!(!caught.in_dependency);
    }
}
