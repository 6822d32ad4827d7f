//! Messages with descriptors (`SCM_RIGHTS`) on Unix sockets, never waiting.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};

use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// The kernel's limit on descriptors in one message (`SCM_MAX_FD`).
pub(crate) const MAX_FDS: usize = 253;

/// Sends `bytes` (not empty) with `fds` (at most [`MAX_FDS`]) as one message on `socket`,
/// without waiting: a full socket is `WouldBlock`.
pub(crate) fn send_with_fds(socket: BorrowedFd<'_>, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if bytes.is_empty() || fds.len() > MAX_FDS {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "a message of no bytes, or of too many descriptors"));
    }
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("the descriptors do not fit their control buffer"));
    }
    let sent = sendmsg(socket, &[IoSlice::new(bytes)], &mut control, SendFlags::DONTWAIT | SendFlags::NOSIGNAL)?;
    if sent != bytes.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, "the message was cut short"));
    }
    Ok(())
}

/// Receives one message from `socket` into `buf`, with at most `max_fds` descriptors, without
/// waiting: nothing queued is `WouldBlock`. A message cut short (bytes or descriptors beyond
/// what fits) is an error, and the descriptors that did arrive are closed.
pub(crate) fn recv_with_fds(
    socket: BorrowedFd<'_>,
    buf: &mut [u8],
    max_fds: usize,
) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(max_fds.clamp(1, MAX_FDS)))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got =
        recvmsg(socket, &mut [IoSliceMut::new(buf)], &mut control, RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC)?;
    let mut fds = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = message {
            fds.extend(rights);
        }
    }
    if got.flags.intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC) || fds.len() > max_fds {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a message longer, or with more descriptors, than expected",
        ));
    }
    Ok((got.bytes, fds))
}

/// Refuses a connected Unix socket whose other end is a process of another user (its
/// credentials as the kernel recorded them at `connect` or `listen`, `SO_PEERCRED`).
pub(crate) fn check_peer_is_this_user(socket: BorrowedFd<'_>) -> io::Result<()> {
    let peer = rustix::net::sockopt::socket_peercred(socket)?;
    let me = rustix::process::geteuid();
    if peer.uid != me {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "refused: the process at the other end of the connection (pid {}) runs as user {}, not as this user ({})",
                peer.pid.as_raw_nonzero(),
                peer.uid.as_raw(),
                me.as_raw()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};

    use super::*;

    fn pair() -> (OwnedFd, OwnedFd) {
        socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None).unwrap()
    }

    #[test]
    fn descriptors_travel_with_their_message_and_stay_alive_in_flight() {
        let (a, b) = pair();
        let (x, y) = pair();
        send_with_fds(a.as_fd(), b"fd", &[x.as_fd()]).unwrap();
        // The sender's copy goes: the one in flight keeps the socket alive.
        drop(x);
        let mut buf = [0u8; 8];
        let (n, mut fds) = recv_with_fds(b.as_fd(), &mut buf, 1).unwrap();
        assert_eq!((&buf[..n], fds.len()), (&b"fd"[..], 1));
        let x = fds.pop().unwrap();
        send_with_fds(x.as_fd(), b"!", &[]).unwrap();
        assert_eq!(recv_with_fds(y.as_fd(), &mut buf, 0).unwrap().0, 1);
        // Nothing queued: no wait.
        assert_eq!(recv_with_fds(b.as_fd(), &mut buf, 1).unwrap_err().kind(), io::ErrorKind::WouldBlock);
    }

    #[test]
    fn a_peer_of_this_user_is_accepted() {
        let (a, _b) = pair();
        check_peer_is_this_user(a.as_fd()).unwrap();
    }

    #[test]
    fn a_message_with_more_descriptors_than_asked_for_is_refused_and_closes_them() {
        let (a, b) = pair();
        let (x, y) = pair();
        send_with_fds(a.as_fd(), b"two", &[x.as_fd(), y.as_fd()]).unwrap();
        let mut buf = [0u8; 8];
        assert!(recv_with_fds(b.as_fd(), &mut buf, 1).is_err());
        assert!(send_with_fds(a.as_fd(), b"", &[]).is_err(), "empty messages are refused");
    }
}
