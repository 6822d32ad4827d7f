//! Named shared memory: a small file published under a path (in `/dev/shm`) whose creator holds
//! a shared lock on it for as long as it lives, so that others can tell a live object from the
//! leftover of a process that ended without removing it.

use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::Mapping;
use crate::fork::NotInherited;

/// A named file of shared memory, mapped read-write.
#[derive(Debug)]
pub(crate) struct NamedMemory {
    /// The creator's shared lock (see [`CreatorLock`]); `None` in those that opened the name.
    alive: Option<CreatorLock>,
    /// Open while this value lives.
    file: File,
    path: PathBuf,
    /// The process that published the name (and removes it when it drops this): not a child
    /// forked from it, whose copy of this value is not the name's.
    creator: Option<u32>,
    mapping: Mapping,
}

/// The creator's shared lock on the file, held on a descriptor of its own (another open file
/// description: a lock belongs to that, not to a process) that children forked from the
/// creator close at once: a child that outlives a creator killed without dropping its object
/// does not keep the name looking alive for its whole life.
#[derive(Debug)]
struct CreatorLock {
    file: Option<NotInherited<File>>,
    /// The process that took it: in a child forked from it the descriptor is closed already,
    /// and its number may name another file by now.
    pid: u32,
}

impl CreatorLock {
    fn take(file: &File) -> io::Result<CreatorLock> {
        let own = OpenOptions::new().read(true).open(format!("/proc/self/fd/{}", file.as_raw_fd()))?;
        own.lock_shared()?;
        Ok(CreatorLock { file: Some(NotInherited::new(own)), pid: super::own_pid() })
    }
}

impl Drop for CreatorLock {
    fn drop(&mut self) {
        if super::own_pid() != self.pid {
            std::mem::forget(self.file.take());
        }
    }
}

impl NamedMemory {
    /// The mapping.
    pub(crate) fn mapping(&self) -> &Mapping {
        &self.mapping
    }

    /// A fresh file of `len` zeroed bytes for `path`, not published yet: nobody can open it
    /// until [`publish`](Self::publish) gives it the name.
    pub(crate) fn unpublished(path: &Path, len: usize) -> io::Result<NamedMemory> {
        let dir = path.parent().unwrap_or(Path::new("/"));
        // A file without a name (O_TMPFILE): nothing is left behind if we stop before
        // publishing it, and nobody sees it half-made.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .mode(0o600)
            .custom_flags(rustix::fs::OFlags::TMPFILE.bits() as i32)
            .open(dir)
            .map_err(|e| with_path(e, dir))?;
        file.set_len(len as u64)?;
        // Held for as long as this process holds the memory: how others tell that the creator
        // lives. The kernel drops it when the process ends, however it ends.
        let alive = Some(CreatorLock::take(&file)?);
        let mapping = Mapping::new(&file, len, true)?;
        Ok(NamedMemory { alive, file, path: path.to_owned(), creator: None, mapping })
    }

    /// Gives the file its name, which it owns from then on; false when the name is taken.
    pub(crate) fn publish(&mut self) -> io::Result<bool> {
        use rustix::fs::{AtFlags, CWD, linkat};
        let from = format!("/proc/self/fd/{}", self.file.as_raw_fd());
        match linkat(CWD, from.as_str(), CWD, &self.path, AtFlags::SYMLINK_FOLLOW) {
            Ok(()) => {
                self.creator = Some(super::own_pid());
                Ok(true)
            }
            Err(rustix::io::Errno::EXIST) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Opens the file published under `path`, of at least `min_len` bytes (else
    /// `InvalidData`). `None` when there is none, or when its creator is gone: such a leftover
    /// of a process that ended without dropping its object is removed here. Another user's
    /// file, or one that others may open, is refused (`PermissionDenied`).
    pub(crate) fn open(path: &Path, min_len: usize) -> io::Result<Option<NamedMemory>> {
        for _ in 0..100 {
            let file = match OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
                .open(path)
            {
                Ok(file) => file,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(with_path(e, path)),
            };
            // Before anything else, a leftover's removal included: another user's file, or one
            // that others may open, is not ours to map (it could be changed under us).
            let meta = file.metadata()?;
            let why = "a named object is this user's alone, mode 600";
            check_private(meta.uid(), meta.mode(), meta.nlink(), &path.display(), why)?;
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
                Err(TryLockError::Error(e)) => return Err(e),
            }
            let len = file.metadata()?.len();
            if len < min_len as u64 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{} holds {len} bytes, fewer than {min_len}", path.display()),
                ));
            }
            let mapping = Mapping::new(&file, min_len, true)?;
            return Ok(Some(NamedMemory { alive: None, file, path: path.to_owned(), creator: None, mapping }));
        }
        Err(io::Error::other(format!("{} keeps being replaced; giving up opening it", path.display())))
    }
}

impl Drop for NamedMemory {
    fn drop(&mut self) {
        if self.creator == Some(super::own_pid()) {
            // The creator owns the name: remove it, unless it was replaced meanwhile (a process
            // that took this object for a leftover removed it and made another). Its shared
            // lock goes first (the exclusive one, on another open file, would wait for it).
            drop(self.alive.take());
            let _ = self.file.lock();
            if same_file(&self.file, &self.path) {
                let _ = std::fs::remove_file(&self.path);
            }
            // The lock belongs to the open file, which a child forked since shares: left held,
            // it would hold up, for that child's whole life, an open that found the file just
            // before its name went (a shared lock then finds it gone).
            let _ = self.file.unlock();
        }
    }
}

/// Reads the small text file at `path` (a name a peer published), of at most `max_len` bytes;
/// `Ok(None)` when there is none. Refused (`PermissionDenied`): a symbolic link, anything but
/// a regular file (a FIFO planted there would hold the read for ever), a file of another
/// user's, and one that its group or every user may write (a member of the group could point
/// it at another listener of this user's; [`publish`] writes mode 0600). The open does not wait.
pub(crate) fn read_published(path: &Path, max_len: u64) -> io::Result<Option<String>> {
    let flags = rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK;
    let file = match OpenOptions::new().read(true).custom_flags(flags.bits() as i32).open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::LOOP.raw_os_error()) => {
            return Err(refused_link(&path.display()));
        }
        Err(e) => return Err(with_path(e, path)),
    };
    let meta = file.metadata()?;
    let own = meta.uid() == rustix::process::geteuid().as_raw() && meta.mode() & 0o022 == 0;
    if !meta.file_type().is_file() || !own || meta.len() > max_len {
        let text = format!(
            "{}: refused, a regular file of this user's that neither its group nor others may write, of at \
             most {max_len} bytes, is expected (owner {}, mode {:o}, {} bytes)",
            path.display(),
            meta.uid(),
            meta.mode() & 0o7777,
            meta.len()
        );
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, text));
    }
    let mut text = String::new();
    io::Read::read_to_string(&mut io::Read::take(file, max_len), &mut text).map_err(|e| with_path(e, path))?;
    Ok(Some(text))
}

/// Writes `text` to `path` atomically (a reader never sees half of it), as a file of this
/// user's alone: a file of this call's own beside it (another process or thread may publish to
/// the same path, or to one differing only in its extension), renamed over it.
pub(crate) fn publish(path: &Path, text: &str) -> io::Result<()> {
    let file = path.file_name().map_or_else(|| "name".into(), |n| n.to_string_lossy().into_owned());
    let tmp = path.with_file_name(format!(".{file}.{}.{:x}.partial", std::process::id(), super::random_u128()));
    let written = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| io::Write::write_all(&mut f, text.as_bytes()))
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// True while `path` names the file open as `file`.
fn same_file(file: &File, path: &Path) -> bool {
    match (file.metadata(), std::fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// The refusal of a name that is a symbolic link (opened with `O_NOFOLLOW`).
pub(super) fn refused_link(name: &dyn std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, format!("{name}: refused, it is a symbolic link"))
}

/// Refuses an object `name` (a file, a shared-memory object) that another user owns, that
/// others may open, that is not a regular file, or that has another name too (`uid`, `mode`
/// and `links` as its metadata says; `why` ends the error): only objects this user made with
/// mode 0600 are mapped, as another's could be changed or shrunk under us, and a hard link of
/// one of ours under another name would pass for the object of that name. (No links: the name
/// was removed since it was opened, which its opener sees next.)
pub(super) fn check_private(
    uid: u32,
    mode: u32,
    links: u64,
    name: &dyn std::fmt::Display,
    why: &str,
) -> io::Result<()> {
    if uid != rustix::process::geteuid().as_raw() || mode & 0o077 != 0 {
        let mode = mode & 0o7777;
        let text = format!("{name}: refused, it is owned by user {uid} with mode {mode:o} ({why})");
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, text));
    }
    if rustix::fs::FileType::from_raw_mode(mode) != rustix::fs::FileType::RegularFile || links > 1 {
        let text = format!("{name}: refused, it is not a regular file with one name ({why})");
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, text));
    }
    Ok(())
}

fn with_path(e: io::Error, path: &Path) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A creator killed without dropping its object, whose child forked without `exec` lives
    /// on, leaves a leftover that the next open removes: the child's copy of the creator's
    /// lock used to keep the name looking alive for the child's whole life (and a new
    /// creator's `create` failed, its `open` attaching to the dead creator's object).
    #[test]
    fn a_child_forked_from_a_killed_creator_does_not_keep_its_name_alive() {
        let path = PathBuf::from(format!("/dev/shm/cuda-mp-test-named-fork-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let creator_path = path.clone();
        let made = crate::sys::fork_and_run(move || {
            let Ok(mut memory) = NamedMemory::unpublished(&creator_path, 64) else { return false };
            if !memory.publish().is_ok_and(|published| published) {
                return false;
            }
            std::mem::forget(memory);
            // The grandchild says when it runs (its fork handlers have run by then): the creator
            // ends only after that.
            let mut ready = [0i32; 2];
            // SAFETY: `ready` has room for the two descriptors.
            if unsafe { libc::pipe(ready.as_mut_ptr()) } != 0 {
                return false;
            }
            // SAFETY: the grandchild only writes a byte, sleeps and `_exit`s (async-signal-safe);
            // the creator reads the byte.
            match unsafe { libc::fork() } {
                0 => unsafe {
                    libc::write(ready[1], [1u8].as_ptr().cast(), 1);
                    libc::sleep(5);
                    libc::_exit(0)
                },
                pid if pid > 0 => {
                    let mut byte = 0u8;
                    // SAFETY: reads one byte into `byte`.
                    unsafe { libc::read(ready[0], (&mut byte as *mut u8).cast(), 1) == 1 }
                }
                _ => false,
            }
        });
        assert_eq!(made.ok(), Some(true), "the creator published and forked");
        assert!(path.exists(), "the name outlives its creator");
        assert!(NamedMemory::open(&path, 64).unwrap().is_none(), "the creator is gone: the name was a leftover");
        assert!(!path.exists(), "and is removed");
        // A live creator's name opens, and a child forked from it does not change that.
        let mut memory = NamedMemory::unpublished(&path, 64).unwrap();
        assert!(memory.publish().unwrap());
        assert!(crate::sys::fork_and_run(|| true).unwrap());
        assert!(NamedMemory::open(&path, 64).unwrap().is_some(), "its creator lives");
        drop(memory);
        assert!(!path.exists(), "the creator's drop removes the name");
    }
}
