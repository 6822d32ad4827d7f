//! Named POSIX shared-memory objects (`shm_open`): PyTorch's reference-counter files.

use std::ffi::CStr;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicI32, AtomicI64};

use rustix::fs::{Mode, OFlags, fstat, ftruncate};
use rustix::shm;

use super::Mapping;

/// A named POSIX shared-memory object, mapped read-write in full and accessed only through
/// atomics (other processes write it at any time). Dropping it unmaps it; the object itself
/// stays until someone unlinks it ([`shm_unlink`]).
///
/// Another process that shrinks the object while it is mapped here makes accesses past its new
/// end fault (`SIGBUS`), as with any shared mapping; the objects cuda-mp maps belong to
/// cooperating processes (PyTorch's reference counters) that never shrink them, and cannot be
/// sealed (they are not memory files).
#[derive(Debug)]
pub(crate) struct ShmFile {
    mapping: Mapping,
}

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

fn size_of_fd(fd: &OwnedFd) -> io::Result<u64> {
    Ok(fstat(fd)?.st_size.max(0) as u64)
}

/// Refuses an object that another user owns or that others may open: its owner could shrink
/// it under the mapping (a SIGBUS in this process). The objects opened here are made mode 0600
/// by their creators (this crate, and PyTorch's reference-counter files). Refuses as well
/// anything but a regular file with one name: a FIFO, or a second name of another file of this
/// user's, planted under an absent object's name.
fn check_private(fd: &OwnedFd, name: &CStr) -> io::Result<()> {
    let stat = fstat(fd)?;
    let why = "a shared-memory object of this user's alone, mode 600, is expected";
    super::named::check_private(stat.st_uid, stat.st_mode, stat.st_nlink, &name.to_string_lossy(), why)
}

/// Opens the existing object `name` with `access`: `Ok(None)` when there is none. A symbolic
/// link is refused, not followed (it could lead to any file of this user's: glibc's
/// `shm_open` adds `O_NOFOLLOW` itself, rustix's does not), and the open does not wait (one
/// for reading would wait for a writer on a FIFO planted under the name).
fn open_existing(name: &CStr, access: shm::OFlags) -> io::Result<Option<OwnedFd>> {
    let never = shm::OFlags::from_bits_retain((OFlags::NOFOLLOW | OFlags::NONBLOCK).bits());
    match shm::open(name, access | never, Mode::empty()) {
        Ok(fd) => check_private(&fd, name).map(|()| Some(fd)),
        Err(rustix::io::Errno::NOENT) => Ok(None),
        Err(rustix::io::Errno::LOOP) => Err(super::named::refused_link(&name.to_string_lossy())),
        Err(e) => Err(e.into()),
    }
}

impl ShmFile {
    /// Creates the object `name` (which must not exist yet; mode 0600) with `len` zeroed bytes,
    /// and maps it. `ErrorKind::AlreadyExists` when the name is taken.
    pub(crate) fn create(name: &CStr, len: usize) -> io::Result<ShmFile> {
        let flags = shm::OFlags::CREATE | shm::OFlags::EXCL | shm::OFlags::RDWR;
        let fd = shm::open(name, flags, Mode::RUSR | Mode::WUSR)?;
        let mapped = ftruncate(&fd, len as u64).map_err(io::Error::from).and_then(|()| ShmFile::map(&fd, len));
        if mapped.is_err() {
            // Nobody else knows the name yet: take it back.
            let _ = shm_unlink(name);
        }
        mapped
    }

    /// Opens the existing object `name` read-write and maps its first `len` bytes; creates
    /// nothing and changes nothing when it is missing or smaller.
    pub(crate) fn open(name: &CStr, len: usize) -> io::Result<ShmOpen> {
        let Some(fd) = open_existing(name, shm::OFlags::RDWR)? else { return Ok(ShmOpen::Missing) };
        if size_of_fd(&fd)? < len as u64 {
            return Ok(ShmOpen::TooSmall);
        }
        Ok(ShmOpen::Mapped(ShmFile::map(&fd, len)?))
    }

    /// Size in bytes of the existing object `name`, or None when there is none.
    pub(crate) fn size_of(name: &CStr) -> io::Result<Option<u64>> {
        open_existing(name, shm::OFlags::RDONLY)?.map(|fd| size_of_fd(&fd)).transpose()
    }

    /// Maps the first `len` bytes (at least one) of `fd`, shared and read-write.
    fn map(fd: &OwnedFd, len: usize) -> io::Result<ShmFile> {
        if len == 0 {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        Ok(ShmFile { mapping: Mapping::new(fd, len, true)? })
    }

    /// The 32-bit cell at byte `offset`, if aligned and inside the mapping.
    pub(crate) fn i32_at(&self, offset: usize) -> Option<&AtomicI32> {
        self.mapping.i32_at(offset)
    }

    /// The 64-bit cell at byte `offset`, if aligned and inside the mapping.
    pub(crate) fn i64_at(&self, offset: usize) -> Option<&AtomicI64> {
        self.mapping.i64_at(offset)
    }
}

/// Removes the shared-memory object `name` (processes that have it mapped keep their mapping).
pub(crate) fn shm_unlink(name: &CStr) -> io::Result<()> {
    Ok(shm::unlink(name)?)
}

/// Removes the files that the CUDA driver keeps in `/dev/shm` for process `pid`'s interprocess
/// events (`cuda.shm.<n>.<pid in hex>.<n>`), owned by this user; returns how many. The driver
/// removes them only when the process's context is destroyed, which neither an exit nor a
/// signal does. Call it for this process (at its exit), or for a process that has ended (its
/// pid is then no one else's until the kernel's pid space wraps).
pub(crate) fn remove_cuda_event_files(pid: u32) -> usize {
    let Ok(entries) = std::fs::read_dir("/dev/shm") else { return 0 };
    let pid = format!("{pid:x}");
    let uid = rustix::process::getuid().as_raw();
    let is_number = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit());
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let parts: Vec<&str> = name.split('.').collect();
        let of_pid = matches!(parts.as_slice(), ["cuda", "shm", a, p, b] if is_number(a) && *p == pid && is_number(b));
        let ours = entry.metadata().is_ok_and(|m| std::os::unix::fs::MetadataExt::uid(&m) == uid);
        if of_pid && ours && std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_driver_files_of_that_pid_are_removed() {
        // A pid above the kernel's largest (2^22): no process has it.
        let pid = (1u32 << 22) + 77;
        let names = [
            format!("cuda.shm.0.{pid:x}.1"),
            format!("cuda.shm.3.{pid:x}.12"),
            format!("cuda.shm.0.{:x}.1", pid + 1),
            format!("cuda.shm.0.{pid:x}.1.other"),
            format!("cuda-mp-test.{pid:x}"),
        ];
        for name in &names {
            std::fs::write(format!("/dev/shm/{name}"), b"x").unwrap();
        }
        assert_eq!(remove_cuda_event_files(pid), 2);
        let left: Vec<bool> = names.iter().map(|n| std::path::Path::new(&format!("/dev/shm/{n}")).exists()).collect();
        for name in &names {
            let _ = std::fs::remove_file(format!("/dev/shm/{name}"));
        }
        assert_eq!(left, [false, false, true, true, true]);
    }

    #[test]
    fn an_object_others_may_open_is_refused() {
        let name = std::ffi::CString::new(format!("/cuda-mp-test-open-{}", std::process::id())).unwrap();
        let _ = shm_unlink(&name);
        let fd = shm::open(&name, shm::OFlags::CREATE | shm::OFlags::EXCL | shm::OFlags::RDWR, Mode::RUSR | Mode::WUSR)
            .unwrap();
        ftruncate(&fd, 4096).unwrap();
        assert!(matches!(ShmFile::open(&name, 4096).unwrap(), ShmOpen::Mapped(_)), "mode 600: mapped");
        // Mode 666 (as a file planted by another user would be): its owner could shrink it.
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o666)).unwrap();
        let refused = ShmFile::open(&name, 4096).map(|_| ()).unwrap_err();
        let sized = ShmFile::size_of(&name).unwrap_err();
        let _ = shm_unlink(&name);
        assert_eq!(refused.kind(), io::ErrorKind::PermissionDenied, "{refused}");
        assert!(refused.to_string().contains("mode 666"), "{refused}");
        assert_eq!(sized.kind(), io::ErrorKind::PermissionDenied);
    }

    /// A name planted as a symbolic link (to a file of this user's elsewhere) or as a FIFO is
    /// refused at once: neither followed nor waited on, and nothing is written.
    #[test]
    fn a_planted_link_or_fifo_is_refused_at_once() {
        let dir = std::env::temp_dir().join(format!("cuda-mp-test-planted-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let target = dir.join("victim");
        std::fs::write(&target, vec![0u8; 4096]).unwrap();
        std::fs::set_permissions(&target, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        let link = format!("cuda-mp-test-link-{}", std::process::id());
        let fifo = format!("cuda-mp-test-fifo-{}", std::process::id());
        let _ = std::fs::remove_file(format!("/dev/shm/{link}"));
        let _ = std::fs::remove_file(format!("/dev/shm/{fifo}"));
        std::os::unix::fs::symlink(&target, format!("/dev/shm/{link}")).unwrap();
        rustix::fs::mkfifoat(rustix::fs::CWD, format!("/dev/shm/{fifo}").as_str(), Mode::RUSR | Mode::WUSR).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let tries: Vec<(String, bool, bool)> = [link, fifo]
                .into_iter()
                .map(|n| {
                    let name = std::ffi::CString::new(format!("/{n}")).unwrap();
                    let denied = |e: io::Error| e.kind() == io::ErrorKind::PermissionDenied;
                    let opened = ShmFile::open(&name, 8).map(|_| ()).is_err_and(denied);
                    let sized = ShmFile::size_of(&name).is_err_and(denied);
                    let _ = std::fs::remove_file(format!("/dev/shm/{n}"));
                    (n, opened, sized)
                })
                .collect();
            let _ = tx.send(tries);
        });
        let tries = rx.recv_timeout(std::time::Duration::from_secs(10));
        let untouched = std::fs::read(&target).unwrap().iter().all(|&b| b == 0);
        let _ = std::fs::remove_dir_all(&dir);
        let tries = tries.expect("an open waited on a planted FIFO");
        for (name, opened, sized) in tries {
            assert!(opened && sized, "{name}: open refused {opened}, size_of refused {sized}");
        }
        assert!(untouched, "the link's target was written");
    }
}
