//! Pipes as leases: the reading end stays with the storage's owner, the writing end travels to
//! every holder (how they are used, and why a pipe: src/lifetime/README.md, "Leases and claims").

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use rustix::event::{PollFd, PollFlags};
use rustix::fs::{Mode, OFlags, fcntl_getfl, fcntl_setfl};
use rustix::pipe::{PIPE_BUF, PipeFlags, pipe_with};

/// The most bytes one record may hold: up to this a write is atomic, so records of many
/// writers never interleave.
pub(crate) const RECORD_MAX: usize = PIPE_BUF;

/// Makes a write to a pipe whose reading end is gone (a lease whose owner died) fail with
/// `EPIPE` instead of raising `SIGPIPE`, whose default action kills the process. Rust's own
/// `main` and Python ignore the signal already; a C or C++ host, a fuzzer's `main`, or a
/// program built to die on broken pipes may not. Only the default action is replaced: a
/// handler the program installed is kept.
fn ignore_broken_pipes() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: `sigaction` with no new action only reads the current one into `old`, a
        // valid, writable struct; `signal` with `SIG_IGN` installs no function of ours.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGPIPE, std::ptr::null(), &mut old) == 0 && old.sa_sigaction == libc::SIG_DFL {
                libc::signal(libc::SIGPIPE, libc::SIG_IGN);
            }
        }
    });
}

/// A new pipe: its reading end and its writing end, both non-blocking. Only the owner reads;
/// every holder's writing end is non-blocking (copies share the flag; a holder given a blocking
/// one opens its own, [`accept_pipe_writer`]), so a writer that must not wait for an owner
/// that does not read (the courier) tries, and one that must (the `Retain` of a
/// forwarder that passes the lease itself on, or of a forked child's relay) waits for room
/// itself ([`write_record`]).
pub(crate) fn lease_pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let (read, write) = pipe_with(PipeFlags::CLOEXEC | PipeFlags::NONBLOCK)?;
    Ok((read, write))
}

/// The flags of `fd` if it is the writing end of a pipe: what a lease that arrives must be
/// (anything else would take a holder's records, or none, and never tell an owner of them).
fn pipe_writer_flags(fd: BorrowedFd<'_>) -> Option<OFlags> {
    let fifo = rustix::fs::fstat(fd)
        .is_ok_and(|st| rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Fifo);
    let flags = fcntl_getfl(fd).ok()?;
    (fifo && flags.contains(OFlags::WRONLY) && !flags.contains(OFlags::RDWR)).then_some(flags)
}

/// Whether `fd` is the writing end of a pipe.
#[cfg(all(feature = "cuda", any(test, feature = "testing")))]
pub(crate) fn is_pipe_writer(fd: BorrowedFd<'_>) -> bool {
    pipe_writer_flags(fd).is_some()
}

/// `fd` if it is the writing end of a pipe and non-blocking. A blocking one (from a peer that
/// cleared the flag) is opened again, through `/proc`, as a non-blocking open file of this
/// process's own: the flag belongs to the open file, which every process holding a copy shares,
/// so setting it on the one received would change a file that is not ours (a peer's stdout, if
/// that was what it sent). (An anonymous pipe opens so whether or not it has a reader left.)
/// Where that open fails (no `/proc`, or a named FIFO with no reader) the flag is set on the
/// file received; a peer can clear it again later: [`try_write_record`] looks for room first,
/// so that only a write racing another writer for the last room could then wait.
pub(crate) fn accept_pipe_writer(fd: Arc<OwnedFd>) -> Option<Arc<OwnedFd>> {
    let received = pipe_writer_flags(fd.as_fd())?;
    if received.contains(OFlags::NONBLOCK) {
        return Some(fd);
    }
    let path = format!("/proc/thread-self/fd/{}", fd.as_raw_fd());
    let flags = OFlags::WRONLY | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY;
    if let Ok(own) = rustix::fs::open(path, flags, Mode::empty())
        && pipe_writer_flags(own.as_fd()).is_some()
        && same_file(own.as_fd(), fd.as_fd())
    {
        return Some(Arc::new(own));
    }
    fcntl_setfl(fd.as_fd(), received | OFlags::NONBLOCK).ok().map(|()| fd)
}

/// A file's identity (device and inode): both ends of one pipe, and every copy of a descriptor
/// (received or duplicated), share it.
pub(crate) fn identity(fd: BorrowedFd<'_>) -> Option<(u64, u64)> {
    rustix::fs::fstat(fd).ok().map(|st| (st.st_dev, st.st_ino))
}

/// Whether `a` and `b` are one file (both identities known, and equal).
pub(crate) fn same_file(a: BorrowedFd<'_>, b: BorrowedFd<'_>) -> bool {
    let a = identity(a);
    a.is_some() && a == identity(b)
}

/// Whether `a` and `b` are one open file (`kcmp(KCMP_FILE)`: copies made by `dup` or passed
/// in messages are; two opens of one file are not). `None` where the kernel will not say (a
/// container's seccomp profile may refuse `kcmp`).
#[cfg(any(test, feature = "cuda"))]
pub(crate) fn same_open_file(a: BorrowedFd<'_>, b: BorrowedFd<'_>) -> Option<bool> {
    /// `KCMP_FILE` of `linux/kcmp.h`.
    const KCMP_FILE: libc::c_long = 0;
    let pid = libc::c_long::from(rustix::process::getpid().as_raw_nonzero().get());
    // SAFETY: kcmp only compares kernel objects of this process named by number: both
    // descriptors are borrowed, so open for the call; no memory is passed.
    let r = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            pid,
            pid,
            KCMP_FILE,
            libc::c_long::from(a.as_raw_fd()),
            libc::c_long::from(b.as_raw_fd()),
        )
    };
    (r >= 0).then_some(r == 0)
}

/// Writes one record (at most [`RECORD_MAX`] bytes) to a pipe's writing end, whole, waiting
/// while the pipe is full.
pub(crate) fn write_record(pipe: BorrowedFd<'_>, record: &[u8]) -> io::Result<()> {
    loop {
        match try_write_record(pipe, record) {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            // No kernel memory for now: tried again (a `Retain` that went missing would let its
            // owner free what a holder maps), after a pause, since the pipe may have room.
            Err(e) if e.kind() == io::ErrorKind::OutOfMemory => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(e),
        }
        let mut fds = [PollFd::from_borrowed_fd(pipe, PollFlags::OUT)];
        let _ = crate::sys::socket::poll_once(&mut fds, Some(Duration::from_millis(100)));
    }
}

/// Writes one record (at most [`RECORD_MAX`] bytes) to a pipe's (non-blocking) writing end,
/// whole: `Ok(false)`, and nothing written, while the pipe has no room for it.
pub(crate) fn try_write_record(pipe: BorrowedFd<'_>, record: &[u8]) -> io::Result<bool> {
    ignore_broken_pipes();
    if record.is_empty() || record.len() > RECORD_MAX {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "a record of no bytes, or too many"));
    }
    // A pipe with room for a page takes a record whole; one without would make a write on a
    // writing end that a peer made blocking again wait.
    let mut fds = [PollFd::from_borrowed_fd(pipe, PollFlags::OUT)];
    if crate::sys::socket::poll_once(&mut fds, Some(Duration::ZERO))? == 0 {
        return Ok(false);
    }
    loop {
        match rustix::io::write(pipe, record) {
            Ok(n) if n == record.len() => return Ok(true),
            Ok(_) => return Err(io::Error::new(io::ErrorKind::WriteZero, "a record was cut short")),
            Err(rustix::io::Errno::INTR) => {}
            // Up to `PIPE_BUF` bytes go in whole or not at all.
            Err(rustix::io::Errno::AGAIN) => return Ok(false),
            Err(e) => return Err(e.into()),
        }
    }
}

/// Reads what waits on a pipe's (non-blocking) reading end into `buf`: `Some(n)` bytes (0:
/// nothing now), `None` at its end (every writing end closed, everything read).
pub(crate) fn read_available(pipe: &OwnedFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    loop {
        match rustix::io::read(pipe, &mut *buf) {
            Ok(0) => return Ok(None),
            Ok(n) => return Ok(Some(n)),
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) => return Ok(Some(0)),
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::reader_gone;

    /// A copy of a descriptor is the same open file; a second open of the same file is not.
    #[test]
    fn copies_of_a_descriptor_are_one_open_file() {
        let (read, write) = lease_pipe().unwrap();
        let copy = write.try_clone().unwrap();
        let other = rustix::fs::open("/dev/null", OFlags::RDONLY, rustix::fs::Mode::empty()).unwrap();
        let again = rustix::fs::open("/dev/null", OFlags::RDONLY, rustix::fs::Mode::empty()).unwrap();
        match same_open_file(write.as_fd(), copy.as_fd()) {
            Some(same) => {
                assert!(same);
                assert_eq!(same_open_file(write.as_fd(), read.as_fd()), Some(false));
                assert_eq!(same_open_file(other.as_fd(), again.as_fd()), Some(false), "one inode, two opens");
            }
            // The kernel will not compare (seccomp): it says so for every pair alike.
            None => assert_eq!(same_open_file(other.as_fd(), again.as_fd()), None),
        }
        assert_eq!(identity(other.as_fd()), identity(again.as_fd()));
    }

    /// A blocking writing end that arrives is taken as a non-blocking open file of this
    /// process's own, and the file received keeps its flags; a non-blocking one is taken as it
    /// is, a reading end not at all.
    #[test]
    fn a_blocking_writing_end_is_opened_again_not_changed() {
        let (read, write) = pipe_with(PipeFlags::CLOEXEC).unwrap();
        let write = Arc::new(write);
        let accepted = accept_pipe_writer(write.clone()).expect("a pipe's writing end");
        assert!(!Arc::ptr_eq(&accepted, &write));
        assert!(fcntl_getfl(accepted.as_fd()).unwrap().contains(OFlags::NONBLOCK));
        assert!(!fcntl_getfl(write.as_fd()).unwrap().contains(OFlags::NONBLOCK), "the file received changed");
        write_record(accepted.as_fd(), b"rec").unwrap();
        let mut buf = [0u8; 8];
        assert_eq!(rustix::io::read(&read, &mut buf).unwrap(), 3, "the same pipe");
        let (_read, own) = lease_pipe().unwrap();
        let own = Arc::new(own);
        assert!(Arc::ptr_eq(&accept_pipe_writer(own.clone()).unwrap(), &own));
        assert!(accept_pipe_writer(Arc::new(read)).is_none());
    }

    /// With no reader left (the owner is gone) a blocking writing end is opened again all the
    /// same, and writes to it fail at once.
    #[test]
    fn a_blocking_writing_end_with_no_reader_is_taken_and_fails_at_once() {
        let (read, write) = pipe_with(PipeFlags::CLOEXEC).unwrap();
        drop(read);
        let write = Arc::new(write);
        let accepted = accept_pipe_writer(write.clone()).unwrap();
        assert!(!fcntl_getfl(write.as_fd()).unwrap().contains(OFlags::NONBLOCK), "the file received changed");
        assert!(try_write_record(accepted.as_fd(), b"rec").is_err());
    }

    #[test]
    fn records_arrive_whole_and_the_last_writer_closing_ends_the_pipe() {
        let (read, write) = lease_pipe().unwrap();
        let copy = write.try_clone().unwrap();
        write_record(write.as_fd(), b"one").unwrap();
        write_record(copy.as_fd(), b"two").unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(read_available(&read, &mut buf).unwrap(), Some(6));
        assert_eq!(&buf[..6], b"onetwo");
        assert_eq!(read_available(&read, &mut buf).unwrap(), Some(0), "nothing now: no wait");
        drop(write);
        assert_eq!(read_available(&read, &mut buf).unwrap(), Some(0), "a copy is left");
        assert!(!reader_gone(&copy));
        drop(copy);
        assert_eq!(read_available(&read, &mut buf).unwrap(), None);
        let (read, write) = lease_pipe().unwrap();
        drop(read);
        assert!(reader_gone(&write));
        assert!(write_record(write.as_fd(), b"x").is_err());
        assert!(write_record(write.as_fd(), &[0; RECORD_MAX + 1]).is_err());
    }
}
