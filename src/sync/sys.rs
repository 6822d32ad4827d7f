//! The operating-system layer of the sync objects (and of the channels' shared counters), and
//! all of their `unsafe`: a small region of shared memory read and written only as atomic words,
//! futex wait and wake on those words, named regions in `/dev/shm` with their creator's lock, and
//! whether a process still lives.

use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::sys::MemoryFile;

/// Bytes of one sync object: a header and the object's words.
pub(crate) const BYTES: usize = 64;

/// Where a 32-bit word lies in a region. Made only by [`W32::at`] in constants, which checks at
/// compile time that the word is aligned and inside [`BYTES`].
#[derive(Clone, Copy)]
pub(crate) struct W32(usize);

impl W32 {
    pub(crate) const fn at(offset: usize) -> W32 {
        assert!(offset.is_multiple_of(4) && offset + 4 <= BYTES, "a 32-bit word outside the region");
        W32(offset)
    }
}

/// Where a 64-bit word lies in a region; see [`W32`].
#[derive(Clone, Copy)]
pub(crate) struct W64(usize);

impl W64 {
    pub(crate) const fn at(offset: usize) -> W64 {
        assert!(offset.is_multiple_of(8) && offset + 8 <= BYTES, "a 64-bit word outside the region");
        W64(offset)
    }
}

/// [`BYTES`] bytes of shared memory, mapped in this process, that other processes may write at
/// any time: only ever accessed through atomics.
pub(crate) struct Region {
    /// First byte of the mapping: valid for [`BYTES`] bytes and 8-byte aligned while the
    /// region lives (checked when the region is made).
    ptr: *mut u8,
    backing: Backing,
}

// SAFETY: the mapping is owned by the region and lives as long as it does; its bytes are only
// accessed atomically, which concurrent writers (threads or processes) cannot make undefined.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

enum Backing {
    /// An anonymous memory file, sent to other processes as a descriptor.
    Anonymous(Arc<MemoryFile>),
    /// A file in `/dev/shm`, mapped by this region.
    Named(Named),
}

struct Named {
    /// Open while the region lives; the creator holds a shared lock on it.
    file: File,
    path: PathBuf,
    /// Whether this region published the name (and removes it when dropped).
    creator: bool,
}

impl Region {
    /// Fresh zeroed anonymous shared memory.
    pub(crate) fn anonymous() -> Result<Region> {
        crate::sys::raise_descriptor_limit();
        let memory = MemoryFile::zeroed(BYTES).map_err(|e| {
            crate::wire::descriptor_error(Error::Io(io::Error::new(
                e.kind(),
                format!("cannot allocate shared memory for a sync object: {e}"),
            )))
        })?;
        Region::from_memory(Arc::new(memory))
    }

    /// The shared memory of a message: refused unless it holds a whole region.
    pub(crate) fn from_memory(shm: Arc<MemoryFile>) -> Result<Region> {
        if shm.len() < BYTES {
            return Err(Error::Malformed(format!(
                "a sync object needs {BYTES} bytes of shared memory, the message carries {}",
                shm.len()
            )));
        }
        Region::checked(shm.ptr(), Backing::Anonymous(shm))
    }

    fn checked(ptr: *mut u8, backing: Backing) -> Result<Region> {
        if ptr.is_null() || !(ptr as usize).is_multiple_of(8) {
            return Err(Error::Malformed("shared memory of a sync object is not 8-byte aligned".into()));
        }
        Ok(Region { ptr, backing })
    }

    /// The anonymous shared memory, to send to another process (`None` for a named region).
    pub(crate) fn memory(&self) -> Option<&Arc<MemoryFile>> {
        match &self.backing {
            Backing::Anonymous(memory) => Some(memory),
            Backing::Named(_) => None,
        }
    }

    /// The 32-bit word at `at`.
    pub(crate) fn u32(&self, at: W32) -> &AtomicU32 {
        // SAFETY: `at` lies inside the first BYTES bytes and is 4-byte aligned (checked when it
        // was made); the region's pointer is valid for BYTES bytes and 8-byte aligned while the
        // region (borrowed for the reference's lifetime) lives. The memory is only accessed
        // atomically, by this and every other process.
        unsafe { AtomicU32::from_ptr(self.ptr.add(at.0).cast()) }
    }

    /// The 64-bit word at `at`.
    pub(crate) fn u64(&self, at: W64) -> &AtomicU64 {
        // SAFETY: as in `u32`, with 8-byte alignment.
        unsafe { AtomicU64::from_ptr(self.ptr.add(at.0).cast()) }
    }

    /// Creates a region under `path`: `init` fills it before anyone can open it, then it is
    /// published under the name, which it owns from then on. `None` when the name is taken.
    pub(super) fn create_named(path: &Path, init: impl FnOnce(&Region)) -> Result<Option<Region>> {
        let dir = path.parent().unwrap_or(Path::new("/"));
        // A file without a name (O_TMPFILE): nothing is left behind if we stop before
        // publishing it, and nobody sees it half-made.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .mode(0o600)
            .custom_flags(rustix::fs::OFlags::TMPFILE.bits() as i32)
            .open(dir)
            .map_err(|e| named_error(e, dir))?;
        file.set_len(BYTES as u64)?;
        // Held for as long as this process holds the region: how others tell that the creator
        // lives. The kernel drops it when the process ends, however it ends.
        file.lock_shared()?;
        let region = map(file, path.to_owned())?;
        init(&region);
        let published = match &region.backing {
            Backing::Named(named) => publish(&named.file, path),
            Backing::Anonymous(_) => Err(io::Error::other("an anonymous region has no name")),
        };
        match published {
            Ok(()) => {
                let mut region = region;
                if let Backing::Named(named) = &mut region.backing {
                    named.creator = true;
                }
                Ok(Some(region))
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Opens the region published under `path`. `None` when there is none, or when its creator
    /// is gone: such a leftover of a process that ended without dropping its object is removed
    /// here.
    pub(super) fn open_named(path: &Path) -> Result<Option<Region>> {
        for _ in 0..100 {
            let file = match OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
                .open(path)
            {
                Ok(file) => file,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(named_error(e, path)),
            };
            // Before anything else, a leftover's removal included: another user's file, or one
            // that others may open, is not ours to map (it could be changed under us).
            check_private(&file, path)?;
            match file.try_lock() {
                Ok(()) => {
                    // Nobody holds the creator's shared lock: the creator is gone. Removers
                    // hold this exclusive lock, so the name is removed at most once.
                    if same_file(&file, path) {
                        let _ = std::fs::remove_file(path);
                    }
                    continue;
                }
                Err(TryLockError::WouldBlock) => {
                    // The creator's lock, or another process removing a leftover: a shared
                    // lock waits for the latter only.
                    file.lock_shared()?;
                    file.unlock()?;
                    if !same_file(&file, path) {
                        continue;
                    }
                }
                Err(TryLockError::Error(e)) => return Err(e.into()),
            }
            let len = file.metadata()?.len();
            if len < BYTES as u64 {
                return Err(Error::Malformed(format!(
                    "{} is not a sync object of cuda-mp: it holds {len} bytes",
                    path.display()
                )));
            }
            return map(file, path.to_owned()).map(Some);
        }
        Err(Error::Io(io::Error::other(format!("{} keeps being replaced; giving up opening it", path.display()))))
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if let Backing::Named(named) = &self.backing {
            // SAFETY: `ptr` is the start of our own mapping of BYTES bytes, made by `map`;
            // nothing refers to it any more (every reference borrowed the region).
            let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), BYTES) };
            if named.creator {
                // The creator owns the name: remove it, unless it was replaced meanwhile (a
                // process that took this object for a leftover removed it and made another).
                let _ = named.file.lock();
                if same_file(&named.file, &named.path) {
                    let _ = std::fs::remove_file(&named.path);
                }
            }
        }
    }
}

/// Maps the first [`BYTES`] bytes of `file`, which holds at least that many.
fn map(file: File, path: PathBuf) -> Result<Region> {
    use rustix::mm::{mmap, MapFlags, ProtFlags};
    // SAFETY: a fresh shared mapping of an open file, at an address the kernel picks; no memory
    // of ours is passed in.
    let ptr =
        unsafe { mmap(std::ptr::null_mut(), BYTES, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, &file, 0) }
            .map_err(io::Error::from)?;
    Region::checked(ptr.cast(), Backing::Named(Named { file, path, creator: false }))
}

/// Gives the nameless `file` the name `path`; fails with `AlreadyExists` when it is taken.
fn publish(file: &File, path: &Path) -> io::Result<()> {
    use rustix::fs::{linkat, AtFlags, CWD};
    let from = format!("/proc/self/fd/{}", file.as_raw_fd());
    Ok(linkat(CWD, from.as_str(), CWD, path, AtFlags::SYMLINK_FOLLOW)?)
}

/// True while `path` names the file open as `file`.
fn same_file(file: &File, path: &Path) -> bool {
    match (file.metadata(), std::fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Refuses a named object's file that another user owns or that others may open: only files
/// this user made with mode 0600 are mapped.
fn check_private(file: &File, path: &Path) -> Result<()> {
    let meta = file.metadata()?;
    let me = rustix::process::geteuid().as_raw();
    if meta.uid() != me || meta.mode() & 0o077 != 0 {
        return Err(Error::Io(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{}: refused, it is owned by user {} with mode {:o} (a sync object is this user's alone, mode 600)",
                path.display(),
                meta.uid(),
                meta.mode() & 0o7777
            ),
        )));
    }
    Ok(())
}

fn named_error(e: io::Error, path: &Path) -> Error {
    Error::Io(io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

/// Sleeps while `word` holds `expected`, for at most `timeout` (`None`: no limit). Returns on a
/// wake, a timeout, a signal, or at once when the word holds another value: the caller looks at
/// the word again in every case.
pub(crate) fn wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
    use rustix::thread::futex;
    let timeout = timeout.map(|d| rustix::time::Timespec {
        tv_sec: d.as_secs().min(i32::MAX as u64) as i64,
        tv_nsec: d.subsec_nanos() as _,
    });
    // Not the private variant: the word is shared between processes. A changed word, a wake,
    // a signal and a timeout all just return.
    let _ = futex::wait(word, futex::Flags::empty(), expected, timeout.as_ref());
}

/// Wakes up to `n` processes or threads sleeping in [`wait`] on `word`.
pub(crate) fn wake(word: &AtomicU32, n: u32) {
    use rustix::thread::futex;
    let _ = futex::wake(word, futex::Flags::empty(), n.min(i32::MAX as u32));
}

/// Wakes every sleeper on `word`.
pub(crate) fn wake_all(word: &AtomicU32) {
    wake(word, u32::MAX)
}

/// This process's id.
pub(super) fn own_pid() -> u32 {
    std::process::id()
}

/// When this process started (in clock ticks since boot; 0 when unknown).
pub(super) fn own_start() -> u64 {
    static START: OnceLock<u64> = OnceLock::new();
    *START.get_or_init(|| process_stat(own_pid()).map_or(0, |s| s.start))
}

/// The identity of this process's pid namespace (0 when unknown): pids of processes in other
/// namespaces mean nothing here.
pub(super) fn pid_namespace() -> u64 {
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino())
}

/// True when the process `pid`, which started at `start` (0: unknown), has ended: no such
/// process, a zombie, or the pid now belongs to a process that started at another time.
pub(super) fn process_gone(pid: u32, start: u64) -> bool {
    // No process has this id (and kill would address a group).
    let Some(raw) = i32::try_from(pid).ok().filter(|&p| p > 0) else { return true };
    let Some(target) = rustix::process::Pid::from_raw(raw) else { return true };
    // Signal 0: sends nothing, only checks that the process exists.
    if rustix::process::test_kill_process(target) == Err(rustix::io::Errno::SRCH) {
        return true;
    }
    match process_stat(pid) {
        Some(stat) => matches!(stat.state, 'Z' | 'X' | 'x') || (start != 0 && stat.start != start),
        // Exists (kill said so) but /proc does not show it to us: assume it lives.
        None => false,
    }
}

struct Stat {
    state: char,
    start: u64,
}

/// The state and start time of a process, from `/proc/PID/stat`.
fn process_stat(pid: u32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid ...": the name may hold spaces and parentheses; fields follow the
    // last ')'. The start time is field 22, the 20th after the name.
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    let start = fields.nth(18)?.parse().ok()?;
    Some(Stat { state, start })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_lives_and_a_made_up_one_does_not() {
        assert!(!process_gone(own_pid(), own_start()));
        assert!(own_start() != 0);
        assert!(process_gone(own_pid(), own_start() + 1), "a pid reused by a later process");
        assert!(process_gone(0, 0));
        assert!(process_gone(u32::MAX, 0));
        assert!(process_gone(i32::MAX as u32, 0));
    }

    #[test]
    fn a_wait_on_a_changed_word_returns_at_once_and_a_timeout_ends_a_wait() {
        let region = Region::anonymous().unwrap();
        const W: W32 = W32::at(16);
        let word = region.u32(W);
        let start = std::time::Instant::now();
        wait(word, 1, None); // holds 0, not 1
        wait(word, 0, Some(Duration::from_millis(30)));
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(25) && waited < Duration::from_secs(2), "{waited:?}");
    }

    #[test]
    fn short_memory_is_refused() {
        let shm = Arc::new(MemoryFile::zeroed(BYTES - 1).unwrap());
        assert!(matches!(Region::from_memory(shm), Err(Error::Malformed(_))));
        assert!(matches!(Region::from_memory(Arc::new(MemoryFile::zeroed(0).unwrap())), Err(Error::Malformed(_))));
    }
}
