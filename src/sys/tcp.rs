//! The remote transport's socket calls: a stream read and written under a deadline, and
//! `send` / `recv` between a TCP socket and shared memory in place (whose bytes Rust code never
//! borrows as a slice: the kernel copies them, as a device would).

use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::time::Instant;

use rustix::event::PollFlags;
use rustix::net::{RecvFlags, SendFlags};

use super::{Mapping, Wait, wait_for};

/// Waits until `fd` is ready for `events` or `deadline` passes (then `TimedOut`; `None`: no
/// limit).
pub(crate) fn stream_wait(fd: &impl AsFd, events: PollFlags, deadline: Option<Instant>) -> io::Result<PollFlags> {
    let wait = deadline.map_or(Wait::Forever, Wait::Until);
    match wait_for(fd.as_fd(), events, wait)? {
        Some(revents) => Ok(revents),
        None => Err(io::Error::new(io::ErrorKind::TimedOut, "timed out")),
    }
}

/// True when the peer has closed its end (or the socket failed): what a sender, whose peer
/// never writes, and a receiver waiting for a transfer ask while they wait.
pub(crate) fn peer_closed(socket: &impl AsFd) -> bool {
    let hung = PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR | PollFlags::NVAL;
    matches!(wait_for(socket.as_fd(), PollFlags::RDHUP, Wait::Not), Ok(Some(r)) if r.intersects(hung))
}

/// A call that may be retried: interrupted, or not ready yet.
fn again(e: rustix::io::Errno) -> bool {
    e == rustix::io::Errno::INTR || e == rustix::io::Errno::AGAIN
}

/// Reads what is there (at least one byte) into `buf`, waiting until `deadline` (`None`: no
/// limit); 0 at the end of the stream.
pub(crate) fn read_some(socket: &impl AsFd, buf: &mut [u8], deadline: Option<Instant>) -> io::Result<usize> {
    loop {
        stream_wait(socket, PollFlags::IN, deadline)?;
        match rustix::net::recv(socket, &mut *buf, RecvFlags::DONTWAIT) {
            Ok((_, n)) => return Ok(n),
            Err(e) if again(e) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// Writes all of `bytes`, waiting until `deadline`.
pub(crate) fn write_all(socket: &impl AsFd, mut bytes: &[u8], deadline: Instant) -> io::Result<()> {
    while !bytes.is_empty() {
        stream_wait(socket, PollFlags::OUT, Some(deadline))?;
        // NOSIGNAL turns a closed peer into EPIPE instead of SIGPIPE.
        match rustix::net::send(socket, bytes, SendFlags::NOSIGNAL | SendFlags::DONTWAIT) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if again(e) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Moves `len` bytes of `mapping` from byte `offset`, inside its first `limit` (the storage's
/// size, which its mapping may exceed), over the stream, waiting until `deadline` for `events`:
/// `call(at, n)` sends or receives up to `n` bytes at `at`, as `send(2)` / `recv(2)` (without
/// waiting), and is only given a pointer to bytes inside the mapping.
fn in_place(
    socket: &impl AsFd,
    mapping: &Mapping,
    (limit, offset, len): (usize, usize, usize),
    deadline: Instant,
    events: PollFlags,
    call: impl Fn(*mut u8, usize) -> isize,
) -> io::Result<()> {
    if offset.checked_add(len).is_none_or(|end| end > limit.min(mapping.len())) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "bytes outside the shared memory"));
    }
    let mut done = 0;
    while done < len {
        stream_wait(socket, events, Some(deadline))?;
        // SAFETY: `offset + done .. offset + len` lies inside the mapping (checked above), which
        // lives while it is borrowed.
        match call(unsafe { mapping.ptr().add(offset + done) }, len - done) {
            0 if events == PollFlags::IN => {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the connection mid-message"));
            }
            n if n >= 0 => done += n as usize,
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

/// Writes `len` bytes of `mapping` from byte `offset`, inside its first `limit`, waiting until
/// `deadline`.
pub(crate) fn write_mapped(
    socket: &(impl AsFd + AsRawFd),
    mapping: &Mapping,
    limit: usize,
    offset: usize,
    len: usize,
    deadline: Instant,
) -> io::Result<()> {
    in_place(socket, mapping, (limit, offset, len), deadline, PollFlags::OUT, |at, n| {
        // SAFETY: `at .. at + n` lies inside the mapping (`in_place`); the kernel reads it, no
        // Rust reference to it is made. NOSIGNAL turns a closed peer into EPIPE, not SIGPIPE.
        unsafe { libc::send(socket.as_raw_fd(), at.cast(), n, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) }
    })
}

/// Fills `len` bytes of a writable `mapping` from byte `offset`, inside its first `limit`, from
/// the stream, waiting until `deadline`.
pub(crate) fn read_mapped(
    socket: &(impl AsFd + AsRawFd),
    mapping: &Mapping,
    limit: usize,
    offset: usize,
    len: usize,
    deadline: Instant,
) -> io::Result<()> {
    if !mapping.is_writable() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "shared memory sealed against writes"));
    }
    in_place(socket, mapping, (limit, offset, len), deadline, PollFlags::IN, |at, n| {
        // SAFETY: `at .. at + n` lies inside the mapping (`in_place`); the kernel writes it, no
        // Rust reference to it is made.
        unsafe { libc::recv(socket.as_raw_fd(), at.cast(), n, libc::MSG_DONTWAIT) }
    })
}
