//! The system calls of the channels, and all of their `unsafe`: our own copy of a channel's
//! socket descriptor (to wait for it, to ask whether its peer is gone, how much it holds),
//! `poll(2)`, the default send buffer of a socket, an `eventfd` to interrupt a poll, and the
//! exit hook that lets backlogs drain.
//!
//! ipc-channel does not hand out the descriptor of its channels. Its `Debug` output names it
//! (`OsIpcSender { fd: SharedFileDescriptor(N) }`, `OsIpcReceiver { fd: Cell { value: N } }` in
//! ipc-channel 0.22); [`socket_copy`] reads the number there, checks that it is a Unix
//! `SOCK_SEQPACKET` socket, and duplicates it at once, while the channel that owns it is
//! borrowed. A test below fails if that output ever changes.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;
use std::time::Instant;

/// The number after `fd: SharedFileDescriptor(` or `fd: Cell { value: ` in a channel's `Debug`
/// output.
fn descriptor_number(debug: &str) -> Option<RawFd> {
    let rest = ["fd: SharedFileDescriptor(", "fd: Cell { value: "]
        .iter()
        .find_map(|prefix| debug.find(prefix).map(|at| &debug[at + prefix.len()..]))?;
    let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
    rest[..digits].parse().ok()
}

/// True when a channel's `Debug` output names a descriptor (not the -1 of one taken already).
pub(super) fn names_a_descriptor(debug: &str) -> bool {
    descriptor_number(debug).is_some_and(|fd| fd >= 0)
}

/// True when `fd` is an open Unix socket of type `SOCK_SEQPACKET` (what ipc-channel makes).
fn is_seqpacket(fd: RawFd) -> bool {
    let mut kind: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `kind` and `len` are valid, writable and sized as SO_TYPE requires; a descriptor
    // that is not a socket (or not open) makes the call fail without touching them.
    let r = unsafe {
        libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_TYPE, (&mut kind as *mut libc::c_int).cast(), &mut len)
    };
    if r != 0 || kind != libc::SOCK_SEQPACKET {
        return false;
    }
    let mut domain: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: as above, for SO_DOMAIN.
    let r = unsafe {
        libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_DOMAIN, (&mut domain as *mut libc::c_int).cast(), &mut len)
    };
    r == 0 && domain == libc::AF_UNIX
}

/// A copy of the socket descriptor of the channel whose `Debug` output is `debug`; call it while
/// the channel is borrowed, so that the number still names its socket. `None` when the output
/// names no descriptor, or one that is not such a socket.
pub(crate) fn socket_copy(debug: &str) -> Option<OwnedFd> {
    let fd = descriptor_number(debug)?;
    if fd < 0 || !is_seqpacket(fd) {
        return None;
    }
    // SAFETY: F_DUPFD_CLOEXEC makes a new descriptor for the same socket, which we own; `fd`
    // stays with the channel that owns it.
    let copy = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if copy < 0 {
        return None;
    }
    // SAFETY: `copy` was just returned to us and nothing else owns it.
    Some(unsafe { OwnedFd::from_raw_fd(copy) })
}

/// The identity of the socket behind `fd` (device and inode): copies of one socket agree.
pub(super) fn socket_identity(fd: &OwnedFd) -> Option<(u64, u64)> {
    let mut st = MaybeUninit::<libc::stat>::uninit();
    // SAFETY: `st` is valid for writing a `stat`; `fd` is open while borrowed.
    if unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: fstat succeeded, so it filled `st`.
    let st = unsafe { st.assume_init() };
    Some((st.st_dev, st.st_ino))
}

/// True when the peer of the socket `fd` has closed its end (`POLLHUP` or `POLLERR`).
pub(super) fn peer_closed(fd: &OwnedFd) -> bool {
    let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
    // SAFETY: one valid pollfd, a zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLHUP | libc::POLLERR) != 0
}

/// Bytes waiting to be read on the socket `fd` (0 when none, or when it cannot be told).
pub(super) fn pending_bytes(fd: &OwnedFd) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int to the pointer, which is valid for it.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::FIONREAD, &mut n as *mut libc::c_int) };
    if r == 0 {
        n.max(0) as usize
    } else {
        0
    }
}

/// Waits until one of `fds` is readable, hung up or in error, or `deadline` passes (`None`: no
/// limit). Returns which are ready (all false on a timeout).
pub(super) fn wait_readable(fds: &[RawFd], deadline: Option<Instant>) -> io::Result<Vec<bool>> {
    let mut polled: Vec<libc::pollfd> =
        fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN | libc::POLLRDHUP, revents: 0 }).collect();
    loop {
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        // SAFETY: `polled` is a valid array of `polled.len()` pollfds for the call's duration.
        let n = unsafe { libc::poll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, crate::os::poll_millis(left)) };
        if n >= 0 {
            return Ok(polled.iter().map(|p| p.revents != 0).collect());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// The send buffer of a fresh Unix `SOCK_SEQPACKET` socket here (`SO_SNDBUF`), which is what
/// every channel's socket gets; 212,992 bytes (Linux's usual default) when it cannot be told.
pub(super) fn default_send_buffer() -> usize {
    static SIZE: OnceLock<usize> = OnceLock::new();
    *SIZE.get_or_init(|| {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` has room for the two descriptors socketpair writes.
        if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr()) }
            != 0
        {
            return 212_992;
        }
        // SAFETY: both descriptors were just returned to us; the OwnedFds close them.
        let (a, _b) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let mut size: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: `size` and `len` are valid and writable, sized as SO_SNDBUF requires.
        let r = unsafe {
            libc::getsockopt(
                a.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                (&mut size as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        if r == 0 && size > 0 {
            size as usize
        } else {
            212_992
        }
    })
}

/// The send buffer asked for every socket of ours: more frames wait in the kernel before a
/// sender has to spill, and a backlog needs fewer batches. The kernel caps the request at
/// `net.core.wmem_max` (often the default buffer itself, then nothing changes).
const SEND_BUFFER: usize = 1 << 20;

/// Asks for a send buffer of [`SEND_BUFFER`] bytes on the socket of the channel whose `Debug`
/// output is `debug` (call it while the channel is borrowed); returns the buffer it has then,
/// or the default when the socket cannot be found.
pub(super) fn send_buffer(debug: &str) -> usize {
    let Some(fd) = descriptor_number(debug).filter(|&fd| fd >= 0 && is_seqpacket(fd)) else {
        return default_send_buffer();
    };
    let want = SEND_BUFFER as libc::c_int;
    // SAFETY: `want` is a valid c_int for the call's duration; `fd` is the borrowed channel's
    // socket (checked above).
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&want as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    let mut size: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `size` and `len` are valid and writable, sized as SO_SNDBUF requires.
    let r = unsafe {
        libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_SNDBUF, (&mut size as *mut libc::c_int).cast(), &mut len)
    };
    if r == 0 && size > 0 {
        size as usize
    } else {
        default_send_buffer()
    }
}

/// A non-blocking `eventfd`: written to interrupt a thread that polls it.
pub(super) fn bell() -> io::Result<OwnedFd> {
    // SAFETY: no memory arguments; a non-negative result is a new descriptor that we own.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just returned to us, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Rings `bell`: a poll that watches it returns.
pub(super) fn ring(bell: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writes the 8 bytes of `one`, which outlives the call.
    unsafe { libc::write(bell.as_raw_fd(), (&one as *const u64).cast(), 8) };
}

/// Quiets `bell` after it rang.
pub(super) fn silence(bell: &OwnedFd) {
    let mut count: u64 = 0;
    // SAFETY: reads at most 8 bytes into `count`, which is valid for them.
    unsafe { libc::read(bell.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
}

/// Runs `hook` when this process exits through `exit` (returning from `main` included), before
/// it ends. The hook must not unwind.
pub(super) fn at_exit(hook: extern "C" fn()) -> bool {
    // SAFETY: registers a function pointer with the C library; `hook` is a plain `extern "C"`
    // function that lives as long as the program.
    unsafe { libc::atexit(hook) == 0 }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Bytes the kernel charges to the sending socket `fd` for what it holds unread
    /// (`SIOCOUTQ`).
    pub(in crate::channel) fn queued_bytes(fd: RawFd) -> usize {
        let mut n: libc::c_int = 0;
        // SAFETY: SIOCOUTQ writes one c_int to the pointer, which is valid for it.
        unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut n as *mut libc::c_int) };
        n.max(0) as usize
    }

    #[test]
    fn the_descriptor_of_an_ipc_channel_is_found_and_copied() {
        let (tx, rx) = ipc_channel::ipc::channel::<u8>().unwrap();
        let tx = tx.to_opaque();
        let sender = socket_copy(&format!("{tx:?}")).expect("the sender's descriptor");
        let receiver = socket_copy(&format!("{rx:?}")).expect("the receiver's descriptor");
        assert_ne!(socket_identity(&sender), socket_identity(&receiver));
        // The copy of the receiving end sees what the sender writes.
        assert_eq!(wait_readable(&[receiver.as_raw_fd()], Some(Instant::now())).unwrap(), vec![false]);
        tx.clone().to::<u8>().send(7).unwrap();
        assert_eq!(wait_readable(&[receiver.as_raw_fd()], None).unwrap(), vec![true]);
        assert!(pending_bytes(&receiver) > 0);
        assert!(!peer_closed(&sender));
        drop(rx);
        drop(receiver);
        assert!(peer_closed(&sender), "the sender sees the receiving end close");
        assert!(socket_copy("OpaqueIpcSender { os_sender: OsIpcSender { fd: SharedFileDescriptor(-1) } }").is_none());
        assert!(socket_copy("no descriptor here").is_none());
        assert!(default_send_buffer() > 0);
    }
}
