//! The one local transport: Unix `SOCK_SEQPACKET` sockets carrying ordered messages of bytes
//! and any number of descriptors of any kind (`SCM_RIGHTS`). The message layout (one packet,
//! the rest of the descriptors in an overflow socket past [`PACKET_FDS`]) and why a socket's
//! own non-blocking flag is never set (`MSG_DONTWAIT` per call): `README.md` here.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType, accept_with, bind, connect, listen,
    recvmsg, sendmsg, socket_with, socketpair, sockopt,
};

/// The kernel's limit on descriptors attached to one packet (`SCM_MAX_FD`).
pub(crate) const PACKET_FDS: usize = 253;

/// Bytes of the control buffer for one packet's descriptors (on the stack: a send or receive
/// allocates none).
const CONTROL_SPACE: usize = rustix::cmsg_space!(ScmRights(PACKET_FDS));

/// Bytes of the transport's header on every message.
const HEADER: usize = 4;

/// The most descriptors one message may carry in all: more is refused before anything is sent
/// (and a received header claiming more is malformed).
pub(crate) const MESSAGE_FDS: usize = 1 << 20;

/// The send buffer asked for every socket: more messages wait in the kernel before a channel's
/// sender has to spill to its backlog. The kernel caps it at `net.core.wmem_max`.
const SEND_BUFFER: usize = 1 << 20;

/// How long a blocking wait sleeps at most before it looks again (a signal, or a peer that
/// closed while the socket still looked writable).
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// Whether a call may wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Until it can proceed.
    Forever,
    /// Until the deadline at most (then `WouldBlock`).
    Until(Instant),
    /// Not at all (`WouldBlock` at once).
    Not,
}

/// One end of a Unix `SOCK_SEQPACKET` socket.
#[derive(Debug)]
pub(crate) struct Socket(OwnedFd);

/// A message read from a socket.
#[derive(Debug)]
pub(crate) struct Message {
    /// Its bytes (the transport's header removed).
    pub(crate) bytes: Vec<u8>,
    /// Every descriptor it carried, in the order they were given to [`Socket::send`].
    pub(crate) fds: Vec<OwnedFd>,
}

/// One message received into a caller's buffer.
#[derive(Debug)]
pub(crate) struct Received {
    /// Where its bytes lie in the buffer (the transport's header left out).
    pub(crate) bytes: std::ops::Range<usize>,
    /// The descriptors that arrived, in the order they were given to [`Socket::send`].
    pub(crate) fds: Vec<OwnedFd>,
    /// Why the message is lost but for its bytes, if it is.
    pub(crate) lost: Option<Lost>,
}

/// Why a message that was read is lost but for its bytes (which the caller reads to account
/// for it: the place and cost it took).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) enum Lost {
    /// The kernel dropped some of its descriptors, this process being at its limit of file
    /// descriptors: `fds` holds the first ones only.
    DescriptorsDropped,
    /// Its descriptors do not add up (a forged message: its header claims others than came,
    /// its overflow socket is not one or cannot be read): those that came are closed.
    Malformed(String),
}

fn invalid(text: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, text.to_owned())
}

impl Socket {
    /// A connected pair.
    pub(crate) fn pair() -> io::Result<(Socket, Socket)> {
        let (a, b) = socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
        let _ = sockopt::set_socket_send_buffer_size(&a, SEND_BUFFER);
        let _ = sockopt::set_socket_send_buffer_size(&b, SEND_BUFFER);
        Ok((Socket(a), Socket(b)))
    }

    /// One end of a connection made through a listener: refused unless the process at the other
    /// end runs as this user; given the send buffer every socket of ours asks for.
    fn connected(fd: OwnedFd) -> io::Result<Socket> {
        check_peer_is_this_user(fd.as_fd())?;
        let _ = sockopt::set_socket_send_buffer_size(&fd, SEND_BUFFER);
        Ok(Socket(fd))
    }

    /// A descriptor that arrived in a message, checked to be a Unix `SOCK_SEQPACKET` socket.
    pub(crate) fn from_fd(fd: OwnedFd) -> io::Result<Socket> {
        let seqpacket = sockopt::socket_type(&fd).is_ok_and(|t| t == SocketType::SEQPACKET)
            && sockopt::socket_domain(&fd).is_ok_and(|d| d == AddressFamily::UNIX);
        if seqpacket {
            Ok(Socket(fd))
        } else {
            Err(invalid("a descriptor that should be a socket of ours is something else"))
        }
    }

    /// Sends one message: `parts` (their bytes in order, together not empty) and `fds`, which
    /// the receiver gets in the same order. `Wait::Not` fails with `WouldBlock` when the socket
    /// is full; a peer that is gone is `BrokenPipe`.
    pub(crate) fn send(&self, parts: &[&[u8]], fds: &[BorrowedFd<'_>], wait: Wait) -> io::Result<()> {
        if fds.len() > MESSAGE_FDS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a message carries at most {MESSAGE_FDS} descriptors, not {}", fds.len()),
            ));
        }
        let header = (fds.len() as u32).to_le_bytes();
        let mut slices = Vec::with_capacity(parts.len() + 1);
        slices.push(IoSlice::new(&header));
        slices.extend(parts.iter().map(|p| IoSlice::new(p)));
        if fds.len() <= PACKET_FDS {
            return send_packet(self.0.as_fd(), &slices, fds, wait);
        }
        let (head, tail) = fds.split_at(PACKET_FDS - 1);
        let rest = overflow(tail)?;
        let attached: Vec<BorrowedFd<'_>> = head.iter().copied().chain([rest.0.as_fd()]).collect();
        send_packet(self.0.as_fd(), &slices, &attached, wait)
    }

    /// Receives one message of at most `max` bytes. `Ok(None)`: the peer is gone and
    /// everything it sent was read. `Wait::Until` and `Wait::Not` fail with `WouldBlock` when
    /// nothing came. A message longer than `max`, or whose descriptors do not add up, is
    /// `InvalidData` (its descriptors closed) and the socket stays usable.
    pub(crate) fn recv(&self, max: usize, wait: Wait) -> io::Result<Option<Message>> {
        let mut buf = vec![0u8; max + HEADER];
        let Some(got) = self.recv_in(&mut buf, wait)? else { return Ok(None) };
        match got.lost {
            Some(Lost::DescriptorsDropped) => {
                Err(invalid("a message lost its descriptors: this process is at its limit of file descriptors"))
            }
            Some(Lost::Malformed(why)) => Err(invalid(&why)),
            None => Ok(Some(Message { bytes: buf[got.bytes].to_vec(), fds: got.fds })),
        }
    }

    /// Like [`recv`](Self::recv), into `buf` (kept by the caller, so that a receive allocates
    /// nothing): messages of up to `buf.len() - 4` bytes. A message whose descriptors were
    /// dropped or do not add up is returned with its bytes, so that the caller can account
    /// for it; see [`Received::lost`]. Only a message longer than the buffer, or shorter than
    /// the header, is `InvalidData`.
    pub(crate) fn recv_in(&self, buf: &mut [u8], wait: Wait) -> io::Result<Option<Received>> {
        let Some(packet) = recv_packet(self.0.as_fd(), buf, wait)? else { return Ok(None) };
        let (len, mut fds) = (packet.len, packet.fds);
        if len < HEADER {
            return Err(invalid("a message shorter than the transport's header"));
        }
        let received = |fds, lost| Ok(Some(Received { bytes: HEADER..len, fds, lost }));
        let malformed = |why: String| received(Vec::new(), Some(Lost::Malformed(why)));
        let claimed = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        // More than came only past a packet's worth (the rest in the overflow socket, attached
        // last), or where the kernel dropped some.
        let more = claimed > fds.len();
        if claimed > MESSAGE_FDS || claimed < fds.len() || (more && fds.len() != PACKET_FDS && !packet.fds_dropped) {
            return malformed("a message whose descriptors do not match its header".into());
        }
        if packet.fds_dropped {
            // The overflow socket, attached last, is among those dropped.
            return received(fds, Some(Lost::DescriptorsDropped));
        }
        if more {
            let overflow = fds.pop().map(Socket::from_fd).transpose().and_then(|rest| {
                let rest = rest.ok_or_else(|| invalid("no overflow socket"))?;
                rest.read_overflow(claimed - fds.len(), &mut fds)
            });
            return match overflow {
                Ok(true) => received(fds, None),
                Ok(false) => received(fds, Some(Lost::DescriptorsDropped)),
                Err(e) => malformed(e.to_string()),
            };
        }
        received(fds, None)
    }

    /// Sends `bytes` under a transport header that claims `claimed` descriptors, with none
    /// attached: a forged message.
    #[cfg(test)]
    pub(crate) fn send_forged(&self, claimed: u32, bytes: &[u8]) -> io::Result<()> {
        send_packet(self.0.as_fd(), &[IoSlice::new(&claimed.to_le_bytes()), IoSlice::new(bytes)], &[], Wait::Not)
    }

    /// The buffer size [`recv_in`](Self::recv_in) needs for messages of `max` bytes.
    pub(crate) const fn buffer_for(max: usize) -> usize {
        max + HEADER
    }

    /// Reads `count` descriptors from an overflow socket (written in full before its message
    /// was sent, so nothing here waits). False when the kernel dropped some of them.
    fn read_overflow(&self, count: usize, fds: &mut Vec<OwnedFd>) -> io::Result<bool> {
        let target = fds.len() + count;
        let mut byte = [0u8; 1];
        while fds.len() < target {
            // Nothing there (a forged message's socket whose writer is still open) is as
            // malformed as too few: never a "try again" that drops the message silently.
            // So is a socket that cannot be read (one never connected): its `ENOTCONN` would
            // read as the channel's end.
            let packet = match recv_packet(self.0.as_fd(), &mut byte, Wait::Not) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
                Err(e) => return Err(invalid(&format!("a message's overflow socket cannot be read: {e}"))),
                Ok(packet) => packet,
            };
            match packet {
                Some(Packet { fds_dropped: true, .. }) => return Ok(false),
                Some(Packet { len: 1, fds: got, .. }) if !got.is_empty() && fds.len() + got.len() <= target => {
                    fds.extend(got)
                }
                _ => return Err(invalid("a message's overflow descriptors are missing or too many")),
            }
        }
        Ok(true)
    }

    /// True once the other end is closed (every holder of it is gone).
    pub(crate) fn peer_closed(&self) -> bool {
        peer_gone(&self.0)
    }

    /// Bytes waiting to be read (0 when none or unknown).
    pub(crate) fn pending_bytes(&self) -> usize {
        rustix::io::ioctl_fionread(&self.0).map_or(0, |n| n as usize)
    }

    /// The first bytes of the next message (after the transport's header, at most `buf`'s
    /// length), without taking it; `None` when nothing is there to read. The end of the
    /// connection reads as an empty message.
    pub(crate) fn peek<'b>(&self, buf: &'b mut [u8]) -> Option<&'b [u8]> {
        let mut head = [0u8; HEADER + 8];
        let want = (HEADER + buf.len()).min(head.len());
        match rustix::net::recv(&self.0, &mut head[..want], RecvFlags::PEEK | RecvFlags::DONTWAIT) {
            Ok((_, n)) => {
                let body = n.saturating_sub(HEADER);
                buf[..body].copy_from_slice(&head[HEADER..HEADER + body]);
                Some(&buf[..body])
            }
            Err(_) => None,
        }
    }

    /// The send buffer the kernel gave this socket.
    pub(crate) fn send_buffer(&self) -> usize {
        sockopt::socket_send_buffer_size(&self.0).unwrap_or(212_992)
    }

    /// Bytes the kernel charges to this sending socket for what it holds unread (`SIOCOUTQ`).
    #[cfg(test)]
    pub(crate) fn queued_bytes(&self) -> u64 {
        use std::os::fd::AsRawFd;
        let mut n: libc::c_int = 0;
        // SAFETY: SIOCOUTQ writes one c_int to the pointer, which is valid for it.
        unsafe { libc::ioctl(self.0.as_raw_fd(), libc::TIOCOUTQ, &mut n as *mut libc::c_int) };
        n.max(0) as u64
    }

    /// The socket's identity (device and inode): two descriptors of one socket share it.
    pub(crate) fn identity(&self) -> Option<(u64, u64)> {
        rustix::fs::fstat(&self.0).ok().map(|st| (st.st_dev, st.st_ino))
    }
}

impl AsFd for Socket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl From<Socket> for OwnedFd {
    fn from(socket: Socket) -> OwnedFd {
        socket.0
    }
}

/// The descriptors past the first packet's, written into a fresh pair whose reading end is
/// returned (the writing end is closed, so the reader sees where they end).
fn overflow(fds: &[BorrowedFd<'_>]) -> io::Result<Socket> {
    let (tx, rx) = Socket::pair()?;
    for (i, chunk) in fds.chunks(PACKET_FDS).enumerate() {
        if i > 0 {
            super::kill_point("descriptor-batch");
        }
        send_packet(tx.0.as_fd(), &[IoSlice::new(&[0])], chunk, Wait::Not).map_err(|e| {
            if e.kind() == io::ErrorKind::WouldBlock {
                io::Error::other("too many descriptors for one message (the overflow socket is full)")
            } else {
                e
            }
        })?;
    }
    Ok(rx)
}

fn send_packet(socket: BorrowedFd<'_>, slices: &[IoSlice<'_>], fds: &[BorrowedFd<'_>], wait: Wait) -> io::Result<()> {
    let mut space = [MaybeUninit::uninit(); CONTROL_SPACE];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("the descriptors do not fit their control buffer"));
    }
    let total: usize = slices.iter().map(|s| s.len()).sum();
    loop {
        let flags = match wait {
            Wait::Forever => SendFlags::NOSIGNAL,
            Wait::Until(_) | Wait::Not => SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
        };
        match sendmsg(socket, slices, &mut control, flags) {
            Ok(sent) if sent == total => return Ok(()),
            Ok(_) => return Err(io::Error::new(io::ErrorKind::WriteZero, "the message was cut short")),
            Err(rustix::io::Errno::INTR) => continue,
            Err(rustix::io::Errno::AGAIN) if matches!(wait, Wait::Until(_)) => {
                if wait_for(socket, PollFlags::OUT, wait)?.is_none() {
                    return Err(io::ErrorKind::WouldBlock.into());
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// One packet as received.
struct Packet {
    len: usize,
    /// The descriptors that arrived, in order.
    fds: Vec<OwnedFd>,
    /// The kernel dropped the packet's later descriptors (`MSG_CTRUNC`): this process could
    /// not take more.
    fds_dropped: bool,
}

fn recv_packet(socket: BorrowedFd<'_>, buf: &mut [u8], wait: Wait) -> io::Result<Option<Packet>> {
    let mut space = [MaybeUninit::uninit(); CONTROL_SPACE];
    loop {
        if let Wait::Until(deadline) = wait
            && !wait_readable(&[socket], Wait::Until(deadline))?[0]
        {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let flags = match wait {
            Wait::Forever => RecvFlags::CMSG_CLOEXEC,
            _ => RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
        };
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = match recvmsg(socket, &mut [IoSliceMut::new(buf)], &mut control, flags) {
            Ok(got) => got,
            Err(rustix::io::Errno::INTR) => continue,
            // Another reader took what woke us: wait again.
            Err(rustix::io::Errno::AGAIN) if matches!(wait, Wait::Until(_)) => continue,
            // A peer that closed with messages of ours unread: the kernel says so once, before
            // what the peer sent us and we have not read yet. The next read finds that, then the end.
            Err(rustix::io::Errno::CONNRESET) => continue,
            Err(e) => return Err(e.into()),
        };
        let mut fds = Vec::new();
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = message {
                fds.extend(rights);
            }
        }
        if got.flags.contains(ReturnFlags::TRUNC) {
            return Err(invalid("a message longer than this socket takes"));
        }
        // Our control buffer holds a whole packet's descriptors: the kernel cuts them short
        // only when this process is out of descriptors (or on a forged packet with more).
        let fds_dropped = got.flags.contains(ReturnFlags::CTRUNC);
        if got.bytes == 0 && fds.is_empty() && !fds_dropped {
            // Every message of ours has a header: no bytes is the end once the peer is gone
            // (unless a message follows: the end reads as no bytes too), and an empty message
            // of a peer that is not ours while it lives.
            if peer_gone(&socket) && !message_follows(socket) {
                return Ok(None);
            }
            return Err(invalid("an empty message"));
        }
        return Ok(Some(Packet { len: got.bytes, fds, fds_dropped }));
    }
}

/// Whether a message with bytes or descriptors waits next on `socket` (looked at, not taken).
/// One look: behind two empty messages in a row, it is taken for the end.
fn message_follows(socket: BorrowedFd<'_>) -> bool {
    let mut byte = [0u8; 1];
    let mut space = [MaybeUninit::uninit(); CONTROL_SPACE];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let flags = RecvFlags::PEEK | RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC;
    match recvmsg(socket, &mut [IoSliceMut::new(&mut byte)], &mut control, flags) {
        // Descriptors a look copies here are closed with `control`.
        Ok(got) => {
            got.bytes > 0
                || got.flags.intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC)
                || control.drain().next().is_some()
        }
        Err(_) => false,
    }
}

/// Waits until one of `fds` is readable, hung up or in error, or `wait` ends. Returns which are
/// ready (all false when the wait ended first).
pub(crate) fn wait_readable(fds: &[BorrowedFd<'_>], wait: Wait) -> io::Result<Vec<bool>> {
    Ok(wait_readable_or_closed(fds, &[], wait)?.0)
}

/// As [`wait_readable`] for `readable`, waiting also until a socket of `closing` has its peer
/// gone (data arriving on one does not end the wait): which of each, in order.
pub(crate) fn wait_readable_or_closed(
    readable: &[BorrowedFd<'_>],
    closing: &[BorrowedFd<'_>],
    wait: Wait,
) -> io::Result<(Vec<bool>, Vec<bool>)> {
    let mut polled: Vec<PollFd<'_>> = readable
        .iter()
        .map(|fd| PollFd::from_borrowed_fd(*fd, PollFlags::IN))
        .chain(closing.iter().map(|fd| PollFd::from_borrowed_fd(*fd, PollFlags::RDHUP)))
        .collect();
    poll_until(&mut polled, wait)?;
    let mut ready: Vec<bool> = polled.iter().map(|p| !p.revents().is_empty()).collect();
    let closing = ready.split_off(readable.len());
    Ok((ready, closing))
}

/// Waits until `fd` has one of `events` (or hangs up or fails), or `wait` ends: what it has,
/// `None` when the wait ended first.
pub(crate) fn wait_for(fd: BorrowedFd<'_>, events: PollFlags, wait: Wait) -> io::Result<Option<PollFlags>> {
    let mut polled = [PollFd::from_borrowed_fd(fd, events)];
    Ok(poll_until(&mut polled, wait)?.then(|| polled[0].revents()))
}

/// Polls `polled` until one of them is ready (true) or `wait` ends (false), in slices of at
/// most [`WAIT_SLICE`].
fn poll_until(polled: &mut [PollFd<'_>], wait: Wait) -> io::Result<bool> {
    loop {
        let left = match wait {
            Wait::Forever => None,
            Wait::Until(deadline) => Some(deadline.saturating_duration_since(Instant::now())),
            Wait::Not => Some(Duration::ZERO),
        };
        let slice = left.map_or(WAIT_SLICE, |l| l.min(WAIT_SLICE));
        if poll_once(polled, Some(slice))? > 0 {
            return Ok(true);
        }
        if left.is_some_and(|l| l <= slice) {
            return Ok(false);
        }
    }
}

/// Whether a failed send on a socket of ours says that its peer is gone.
pub(crate) fn is_disconnect(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset | io::ErrorKind::NotConnected)
}

/// True once the other end of `fd` is closed: a socket's peer; a pipe's reader, seen from a
/// writing end, or every writer, seen from its reading end.
pub(crate) fn peer_gone(fd: &impl AsFd) -> bool {
    matches!(wait_for(fd.as_fd(), PollFlags::OUT, Wait::Not), Ok(Some(r)) if r.intersects(PollFlags::HUP | PollFlags::ERR))
}

/// One `poll(2)`, `timeout` at most (`None`: no limit); an interrupted poll returns 0.
pub(crate) fn poll_once(fds: &mut [PollFd<'_>], timeout: Option<Duration>) -> io::Result<usize> {
    let timeout =
        timeout.map(|t| Timespec { tv_sec: t.as_secs().min(i64::MAX as u64) as i64, tv_nsec: t.subsec_nanos() as _ });
    match poll(fds, timeout.as_ref()) {
        Ok(n) => Ok(n),
        Err(rustix::io::Errno::INTR) => Ok(0),
        Err(e) => Err(e.into()),
    }
}

/// Refuses a connected Unix socket whose other end is a process of another user (its
/// credentials as the kernel recorded them at `connect` or `listen`, `SO_PEERCRED`).
fn check_peer_is_this_user(socket: BorrowedFd<'_>) -> io::Result<()> {
    let peer = sockopt::socket_peercred(socket)?;
    let me = rustix::process::geteuid();
    if peer.uid != me {
        tracing::warn!(
            pid = peer.pid.as_raw_nonzero().get(),
            uid = peer.uid.as_raw(),
            "refused a connection from a process of another user"
        );
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

/// A socket listening for connections at a path (see [`private_dir`]).
#[derive(Debug)]
pub(crate) struct Listening(OwnedFd);

impl AsFd for Listening {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl Listening {
    /// Listens at `path` (which must not exist).
    pub(crate) fn bind(path: &Path) -> io::Result<Listening> {
        Listening::bind_to(&SocketAddrUnix::new(path)?)
    }

    /// Listens at the abstract name `name` (Linux): no file, and the name goes with the last
    /// descriptor of the socket, however the process ends. Anyone on the machine may connect,
    /// so [`accept`](Self::accept) refuses peers of other users, as always.
    pub(crate) fn bind_abstract(name: &str) -> io::Result<Listening> {
        Listening::bind_to(&SocketAddrUnix::new_abstract_name(name.as_bytes())?)
    }

    fn bind_to(addr: &SocketAddrUnix) -> io::Result<Listening> {
        // Not blocking: threads or forked processes that share the listener may all see one
        // peer waiting, and those that lose the race for it must go back to waiting as they
        // were told to, not block in `accept`. (Accepted sockets block, as every socket here.)
        let flags = SocketFlags::CLOEXEC | SocketFlags::NONBLOCK;
        let fd = socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, flags, None)?;
        bind(&fd, addr)?;
        listen(&fd, 64)?;
        Ok(Listening(fd))
    }

    /// Accepts one connection, waiting as `wait` says; refuses a peer of another user.
    pub(crate) fn accept(&self, wait: Wait) -> io::Result<Socket> {
        let fd = loop {
            match accept_with(&self.0, SocketFlags::CLOEXEC) {
                Ok(fd) => break fd,
                Err(rustix::io::Errno::INTR) => continue,
                Err(rustix::io::Errno::AGAIN) => {
                    if !wait_readable(&[self.0.as_fd()], wait)?[0] {
                        return Err(io::ErrorKind::WouldBlock.into());
                    }
                }
                Err(e) => return Err(e.into()),
            }
        };
        Socket::connected(fd)
    }
}

/// Connects to a listener at `path` (refusing a listener of another user), waiting no later
/// than `deadline` while its backlog is full.
pub(crate) fn connect_to(path: &Path, deadline: Instant) -> io::Result<Socket> {
    connect_within(&SocketAddrUnix::new(path)?, deadline)
}

/// Connects to the listener of the abstract name `name` (refusing a listener of another
/// user), waiting no later than `deadline` while its backlog is full.
pub(crate) fn connect_abstract_within(name: &str, deadline: Instant) -> io::Result<Socket> {
    connect_within(&SocketAddrUnix::new_abstract_name(name.as_bytes())?, deadline)
}

/// Connects to `addr`, waiting no later than `deadline` while the listener's backlog is full:
/// a blocking connect would wait for as long as others keep it full (a listener that does not
/// accept, or peers of another user, whom it refuses only once it accepts them).
fn connect_within(addr: &SocketAddrUnix, deadline: Instant) -> io::Result<Socket> {
    let fd =
        socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC | SocketFlags::NONBLOCK, None)?;
    loop {
        match connect(&fd, addr) {
            Ok(()) => break,
            Err(rustix::io::Errno::INTR) => continue,
            // A Unix socket's connect does not wait without blocking: the backlog is full.
            Err(rustix::io::Errno::AGAIN) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
            Err(rustix::io::Errno::AGAIN) => {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "the listener's backlog stayed full"));
            }
            Err(e) => return Err(e.into()),
        }
    }
    // Blocking again, as every socket here is (each call says whether it waits).
    rustix::io::ioctl_fionbio(&fd, false)?;
    Socket::connected(fd)
}

/// This user's directory for listener sockets, which only this user may enter: `$TMPDIR/
/// cuda-mp-UID` (made mode 0700 if missing; closed again if this user opened it up). Where
/// another user took that name first (anyone may make it in a shared directory), a directory
/// of a random name beside it, made for this process, kept for its later listeners and removed
/// at its exit: a squatter cannot stop this user's listeners, and gets nothing of them.
pub(crate) fn private_dir() -> io::Result<std::path::PathBuf> {
    let uid = rustix::process::geteuid().as_raw();
    let named = std::env::temp_dir().join(format!("cuda-mp-{uid}"));
    let refused = match own_dir(&named, uid, false) {
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => e,
        other => return other.map(|()| named),
    };
    // This process's own (a forked child makes its own: a lock held across the fork by another
    // thread of its parent is not seen there).
    let mut fallback = FALLBACK.get().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(dir) = fallback.as_ref()
        && own_dir(dir, uid, false).is_ok()
    {
        return Ok(dir.clone());
    }
    for _ in 0..8 {
        // Short: a listener's path must fit a socket address (108 bytes).
        let dir = std::env::temp_dir().join(format!("cuda-mp-{uid}-{:08x}", crate::sys::random_u128() as u32));
        match own_dir(&dir, uid, true) {
            Ok(()) => {
                // A flag, not a `Once`: a child forked while a thread of its parent ran a `Once`
                // would wait on it for ever. (A child forked after this inherits the handler.)
                static REMOVE_AT_EXIT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
                if !REMOVE_AT_EXIT.swap(true, std::sync::atomic::Ordering::AcqRel) {
                    crate::sys::at_exit(remove_fallback);
                }
                tracing::warn!("{refused}; this process's listeners live in {} instead", dir.display());
                *fallback = Some(dir.clone());
                return Ok(dir);
            }
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => continue,
            Err(e) => return Err(e),
        }
    }
    Err(refused)
}

/// The directory [`private_dir`] made for this process's listeners, if it made one.
static FALLBACK: crate::fork::ForkLocal<std::sync::Mutex<Option<std::path::PathBuf>>> =
    crate::fork::ForkLocal::new(Default::default);

/// At exit: removes this process's own directory for listeners, with what is left in it (the
/// sockets of listeners never dropped, which nobody can reach once this process is gone).
/// Left behind by a process killed, ended with `_exit` or replaced by `exec`, and where another
/// thread holds the directory's lock at the exit (it waits for no lock there).
extern "C" fn remove_fallback() {
    let dir = FALLBACK.get().try_lock().ok().and_then(|d| d.clone());
    if let Some(dir) = dir {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Makes `dir` mode 0700 if missing (`fresh`: only a directory made now will do), and checks
/// that it is a directory of user `uid` that nobody else may enter: `PermissionDenied` if not.
fn own_dir(dir: &std::path::Path, uid: u32, fresh: bool) -> io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let taken = || {
        io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("refused: {} is not a directory of this user's alone", dir.display()),
        )
    };
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && fresh => return Err(taken()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let meta = std::fs::symlink_metadata(dir)?;
    if meta.is_dir() && meta.uid() == uid && meta.permissions().mode() & 0o077 != 0 {
        // Ours, opened up by this user: closed again (only this user or root could have).
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    let meta = std::fs::symlink_metadata(dir)?;
    if !meta.is_dir() || meta.uid() != uid || meta.permissions().mode() & 0o077 != 0 {
        return Err(taken());
    }
    Ok(())
}

/// A non-blocking `eventfd`, written to interrupt a thread that polls it.
pub(crate) fn bell() -> io::Result<OwnedFd> {
    use rustix::event::{EventfdFlags, eventfd};
    Ok(eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?)
}

/// Rings `bell`: a poll that watches it returns.
pub(crate) fn ring(bell: &OwnedFd) {
    let _ = rustix::io::write(bell, &1u64.to_ne_bytes());
}

/// Quiets `bell` after it rang.
pub(crate) fn silence(bell: &OwnedFd) {
    let mut count = [0u8; 8];
    let _ = rustix::io::read(bell, &mut count);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send(s: &Socket, bytes: &[u8], fds: &[&OwnedFd]) -> io::Result<()> {
        let fds: Vec<BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
        s.send(&[bytes], &fds, Wait::Forever)
    }

    /// Sends on `a` a forged message that claims 300 descriptors: a full packet of them whose
    /// last, where the overflow socket goes, is `overflow`.
    fn send_forged_overflow(a: &Socket, overflow: BorrowedFd<'_>) {
        crate::sys::raise_descriptor_limit();
        let fillers: Vec<OwnedFd> =
            (0..PACKET_FDS - 1).map(|_| std::fs::File::open("/dev/null").unwrap().into()).collect();
        let mut fds: Vec<BorrowedFd<'_>> = fillers.iter().map(|f| f.as_fd()).collect();
        fds.push(overflow);
        send_packet(a.0.as_fd(), &[IoSlice::new(&300u32.to_le_bytes())], &fds, Wait::Not).unwrap();
    }

    #[test]
    fn a_message_whose_overflow_socket_is_empty_is_malformed_even_to_a_blocking_receive() {
        let (a, b) = Socket::pair().unwrap();
        // An overflow socket with nothing in it and its writer still open.
        let (over_tx, over_rx) = Socket::pair().unwrap();
        send_forged_overflow(&a, over_rx.0.as_fd());
        let err = b.recv(16, Wait::Forever).unwrap_err();
        drop(over_tx);
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err:?}");
    }

    #[test]
    fn a_message_whose_overflow_socket_is_not_connected_is_malformed_not_the_end() {
        let (a, b) = Socket::pair().unwrap();
        let unconnected = socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None).unwrap();
        send_forged_overflow(&a, unconnected.as_fd());
        let err = b.recv(16, Wait::Not).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err:?}");
        send(&a, b"next", &[]).unwrap();
        assert_eq!(b.recv(16, Wait::Not).unwrap().unwrap().bytes, b"next", "the socket goes on");
    }

    /// A peer that closes with our messages unread leaves its own messages readable: the
    /// kernel's one report of the reset is not the end.
    #[test]
    fn messages_of_a_peer_that_closed_with_ours_unread_are_all_read() {
        let (a, b) = Socket::pair().unwrap();
        send(&b, b"unread by a", &[]).unwrap();
        send(&a, b"m1", &[]).unwrap();
        send(&a, b"m2", &[]).unwrap();
        drop(a);
        assert_eq!(b.recv(16, Wait::Not).unwrap().unwrap().bytes, b"m1");
        assert_eq!(b.recv(16, Wait::Forever).unwrap().unwrap().bytes, b"m2");
        assert!(b.recv(16, Wait::Forever).unwrap().is_none(), "then the end");
        assert!(b.recv(16, Wait::Not).unwrap().is_none(), "and the end again");
    }

    #[test]
    fn an_accept_that_loses_the_race_for_a_peer_waits_only_as_long_as_told() {
        let name = format!("cuda-mp-test-race-{}", std::process::id());
        let listening = Listening::bind_abstract(&name).unwrap();
        for round in 0..10 {
            let _peer = connect_abstract_within(&name, Instant::now() + Duration::from_secs(5)).unwrap();
            let go = std::sync::Barrier::new(2);
            let took: Vec<(bool, Duration)> = std::thread::scope(|scope| {
                let racers: Vec<_> = (0..2)
                    .map(|_| {
                        scope.spawn(|| {
                            go.wait();
                            let start = Instant::now();
                            let got = listening.accept(Wait::Until(start + Duration::from_millis(100)));
                            (got.is_ok(), start.elapsed())
                        })
                    })
                    .collect();
                racers.into_iter().map(|r| r.join().unwrap()).collect()
            });
            assert_eq!(took.iter().filter(|(got, _)| *got).count(), 1, "round {round}: {took:?}");
            assert!(took.iter().all(|(_, t)| *t < Duration::from_secs(2)), "round {round}: {took:?}");
        }
        // Not waiting at all, with nobody there.
        assert_eq!(listening.accept(Wait::Not).unwrap_err().kind(), io::ErrorKind::WouldBlock);
    }

    #[test]
    fn a_connect_to_a_full_backlog_gives_up_at_its_deadline() {
        let name = format!("cuda-mp-test-backlog-{}", std::process::id());
        let listening = Listening::bind_abstract(&name).unwrap();
        // Nobody accepts: fill the backlog (64, and the kernel takes one more).
        let mut held = Vec::new();
        let full = loop {
            match connect_abstract_within(&name, Instant::now()) {
                Ok(socket) => held.push(socket),
                Err(e) => break e,
            }
            assert!(held.len() <= 1024, "the backlog never filled");
        };
        assert_eq!(full.kind(), io::ErrorKind::TimedOut, "{full}");
        let start = Instant::now();
        let err = connect_abstract_within(&name, Instant::now() + Duration::from_millis(50)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(start.elapsed() < Duration::from_secs(5), "waited {:?}", start.elapsed());
        // Room again: the next connect goes through, and the socket blocks as every socket here.
        drop(listening.accept(Wait::Not).unwrap());
        let socket = connect_abstract_within(&name, Instant::now() + Duration::from_secs(5)).unwrap();
        assert!(!rustix::fs::fcntl_getfl(&socket.0).unwrap().contains(rustix::fs::OFlags::NONBLOCK));
    }

    #[test]
    fn descriptors_travel_with_their_message_and_stay_alive_in_flight() {
        let (a, b) = Socket::pair().unwrap();
        let (x, y) = Socket::pair().unwrap();
        send(&a, b"fd", &[&x.0]).unwrap();
        // The sender's copy goes: the one in flight keeps the socket alive.
        drop(x);
        let got = b.recv(16, Wait::Not).unwrap().unwrap();
        assert_eq!((&got.bytes[..], got.fds.len()), (&b"fd"[..], 1));
        let x = Socket::from_fd(got.fds.into_iter().next().unwrap()).unwrap();
        send(&x, b"!", &[]).unwrap();
        assert_eq!(y.recv(16, Wait::Not).unwrap().unwrap().bytes, b"!");
        // Nothing queued: no wait.
        assert_eq!(b.recv(16, Wait::Not).unwrap_err().kind(), io::ErrorKind::WouldBlock);
        let start = Instant::now();
        let deadline = start + Duration::from_millis(30);
        assert_eq!(b.recv(16, Wait::Until(deadline)).unwrap_err().kind(), io::ErrorKind::WouldBlock);
        assert!(Instant::now() >= deadline);
        // The peer gone: the end, after what it sent.
        send(&a, b"last", &[]).unwrap();
        drop(a);
        // Closed once no process holds `a` (a child that another test forks meanwhile holds a
        // copy until it exits).
        let deadline = Instant::now() + Duration::from_secs(10);
        while !b.peer_closed() {
            assert!(Instant::now() < deadline, "the peer's end is closed, yet the socket says it is not");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(b.recv(16, Wait::Forever).unwrap().unwrap().bytes, b"last");
        assert!(b.recv(16, Wait::Forever).unwrap().is_none());
    }

    #[test]
    fn any_number_of_descriptors_arrive_in_order_in_one_message() {
        crate::sys::raise_descriptor_limit();
        let (a, b) = Socket::pair().unwrap();
        for count in [0usize, 1, PACKET_FDS - 1, PACKET_FDS, PACKET_FDS + 1, 700] {
            let files: Vec<OwnedFd> = (0..count).map(|_| bell().unwrap()).collect();
            for (i, f) in files.iter().enumerate() {
                rustix::io::write(f, &(i as u64 + 1).to_ne_bytes()).unwrap();
            }
            let borrowed: Vec<&OwnedFd> = files.iter().collect();
            send(&a, &[count as u8], &borrowed).unwrap();
            drop(files);
            let got = b.recv(16, Wait::Not).unwrap().unwrap();
            assert_eq!(got.fds.len(), count);
            for (i, f) in got.fds.iter().enumerate() {
                let mut v = [0u8; 8];
                rustix::io::read(f, &mut v).unwrap();
                assert_eq!(u64::from_ne_bytes(v), i as u64 + 1, "descriptor {i} of {count} in its place");
            }
        }
    }

    #[test]
    fn a_forged_header_or_an_oversized_message_is_refused_and_the_socket_goes_on() {
        let (a, b) = Socket::pair().unwrap();
        let (x, _y) = Socket::pair().unwrap();
        // Raw packets, without our header's promise kept.
        let raw =
            |bytes: &[u8], fds: &[BorrowedFd<'_>]| send_packet(a.0.as_fd(), &[IoSlice::new(bytes)], fds, Wait::Not);
        raw(&[9, 0, 0, 0], &[x.0.as_fd()]).unwrap();
        assert_eq!(b.recv(16, Wait::Not).unwrap_err().kind(), io::ErrorKind::InvalidData);
        raw(&[0, 0, 0, 0], &[x.0.as_fd()]).unwrap();
        assert_eq!(b.recv(16, Wait::Not).unwrap_err().kind(), io::ErrorKind::InvalidData);
        raw(&[1], &[]).unwrap();
        assert_eq!(b.recv(16, Wait::Not).unwrap_err().kind(), io::ErrorKind::InvalidData);
        send(&a, &[7; 64], &[]).unwrap();
        assert_eq!(b.recv(16, Wait::Not).unwrap_err().kind(), io::ErrorKind::InvalidData);
        send(&a, b"ok", &[]).unwrap();
        assert_eq!(b.recv(16, Wait::Not).unwrap().unwrap().bytes, b"ok");
        // A descriptor that is not a socket is not taken for one.
        assert!(Socket::from_fd(bell().unwrap()).is_err());
    }

    #[test]
    fn a_listener_accepts_a_peer_of_this_user() {
        let path = private_dir().unwrap().join(format!("test-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listening = Listening::bind(&path).unwrap();
        assert_eq!(listening.accept(Wait::Not).unwrap_err().kind(), io::ErrorKind::WouldBlock);
        let client = connect_to(&path, Instant::now() + Duration::from_secs(5)).unwrap();
        let server = listening.accept(Wait::Forever).unwrap();
        send(&client, b"hi", &[]).unwrap();
        assert_eq!(server.recv(8, Wait::Forever).unwrap().unwrap().bytes, b"hi");
        assert_ne!(client.identity(), server.identity());
        std::fs::remove_file(&path).unwrap();
    }
}

#[cfg(test)]
mod empty_messages {
    use super::*;

    /// An empty message read once the peer is gone is not taken for the end while a message
    /// follows it.
    #[test]
    fn an_empty_message_does_not_hide_the_messages_behind_it() {
        let (a, b) = Socket::pair().unwrap();
        rustix::net::send(&a.0, &[], SendFlags::empty()).unwrap();
        a.send(&[b"after"], &[], Wait::Forever).unwrap();
        drop(a);
        assert!(b.recv(16, Wait::Not).is_err(), "the empty message is reported");
        assert_eq!(b.recv(16, Wait::Not).unwrap().map(|m| m.bytes), Some(b"after".to_vec()));
        assert!(b.recv(16, Wait::Not).unwrap().is_none(), "then the end");
    }
}
