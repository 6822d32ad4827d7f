//! All `unsafe` of the remote transport: `poll`, and `send` / `recv` between a TCP socket and
//! memory given by address (shared host memory, which Rust code here never borrows as a slice:
//! the kernel copies it, as a device would).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::time::Instant;

use rustix::event::PollFlags;

use crate::host::HostStorage;
use crate::sys::Wait;

/// Waits until `fd` is ready for `events` or `deadline` passes (then `TimedOut`; `None`: no
/// limit).
pub(super) fn wait(fd: RawFd, events: PollFlags, deadline: Option<Instant>) -> io::Result<PollFlags> {
    // SAFETY: `fd` is the caller's open socket, borrowed for this call only.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    let wait = deadline.map_or(Wait::Forever, Wait::Until);
    match crate::sys::wait_for(fd, events, wait)? {
        Some(revents) => Ok(revents),
        None => Err(io::Error::new(io::ErrorKind::TimedOut, "timed out")),
    }
}

/// True when the peer has closed its end (or the socket failed): what a sender, whose peer
/// never writes, and a receiver waiting for a transfer ask while they wait.
pub(super) fn peer_closed(socket: &impl AsFd) -> bool {
    let hung = PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR | PollFlags::NVAL;
    matches!(crate::sys::wait_for(socket.as_fd(), PollFlags::RDHUP, Wait::Not), Ok(Some(r)) if r.intersects(hung))
}

/// Reads what is there (at least one byte) into `buf`, waiting until `deadline` (`None`: no
/// limit); 0 at the end of the stream.
pub(super) fn read_some(socket: &impl AsRawFd, buf: &mut [u8], deadline: Option<Instant>) -> io::Result<usize> {
    let fd = socket.as_raw_fd();
    loop {
        wait(fd, PollFlags::IN, deadline)?;
        // SAFETY: `buf` is writable for its length.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if !matches!(e.kind(), io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock) {
            return Err(e);
        }
    }
}

fn send_from(fd: RawFd, mut ptr: *const u8, mut len: usize, deadline: Instant) -> io::Result<()> {
    while len > 0 {
        wait(fd, PollFlags::OUT, Some(deadline))?;
        // SAFETY: the caller guarantees `len` readable bytes at `ptr`; MSG_NOSIGNAL turns a
        // closed peer into EPIPE instead of SIGPIPE.
        let n = unsafe { libc::send(fd, ptr.cast(), len, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if matches!(e.kind(), io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock) {
                continue;
            }
            return Err(e);
        }
        // SAFETY: `n <= len` bytes were sent, so the pointer stays inside the caller's range.
        ptr = unsafe { ptr.add(n as usize) };
        len -= n as usize;
    }
    Ok(())
}

/// Writes all of `bytes`, waiting until `deadline`.
pub(super) fn write_all(socket: &impl AsRawFd, bytes: &[u8], deadline: Instant) -> io::Result<()> {
    send_from(socket.as_raw_fd(), bytes.as_ptr(), bytes.len(), deadline)
}

fn check_range(storage: &HostStorage, offset: usize, len: usize) -> io::Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= storage.byte_len() => Ok(()),
        _ => Err(io::Error::new(io::ErrorKind::InvalidInput, "bytes outside the host storage")),
    }
}

/// Writes `len` bytes from byte `offset` of a host storage.
pub(super) fn write_host(
    socket: &impl AsRawFd,
    storage: &HostStorage,
    offset: usize,
    len: usize,
    deadline: Instant,
) -> io::Result<()> {
    check_range(storage, offset, len)?;
    // SAFETY: the range lies inside the mapping (checked above), which lives while `storage`
    // is borrowed; the kernel reads it, no Rust reference to it is made.
    let ptr = unsafe { storage.base_ptr().add(offset) };
    send_from(socket.as_raw_fd(), ptr, len, deadline)
}

/// Fills the first `len` bytes of a host storage from the stream.
pub(super) fn read_host(socket: &impl AsRawFd, storage: &HostStorage, len: usize, deadline: Instant) -> io::Result<()> {
    check_range(storage, 0, len)?;
    let fd = socket.as_raw_fd();
    let mut done = 0;
    while done < len {
        wait(fd, PollFlags::IN, Some(deadline))?;
        // SAFETY: `done..len` lies inside the mapping (checked above), which lives while
        // `storage` is borrowed; the kernel writes it, no Rust reference to it is made.
        let n = unsafe { libc::recv(fd, storage.base_ptr().add(done).cast(), len - done, libc::MSG_DONTWAIT) };
        match n {
            0 => {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the connection mid-message"))
            }
            n if n > 0 => done += n as usize,
            _ => {
                let e = io::Error::last_os_error();
                if !matches!(e.kind(), io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock) {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}
