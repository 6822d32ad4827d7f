//! Passing file descriptors between processes through a descriptor broker of the process that
//! offers them.
//!
//! GPU memory exported with CUDA VMM (`cuMemExportToShareableHandle`, POSIX descriptor handle
//! type) is shared by handing its descriptor to the consumer. ipc-channel cannot carry such a
//! descriptor (it maps every non-socket descriptor it receives as shared memory), and
//! `pidfd_getfd` needs ptrace rights that containers deny. So a process that exports offers the
//! descriptor here: [`offer`] starts, on first use, this process's **broker**, a thread named
//! `cuda-mp-fd-broker` listening on a Unix `SOCK_SEQPACKET` socket in the Linux abstract
//! namespace (`@cuda-mp-<pid>-<16 random hex digits>`), and returns a [`Ticket`]: the broker's
//! name, the caller's key (its storage index) and a 16-byte random secret. The ticket travels
//! inside a message; a process that received it calls [`fetch`], which connects to the broker
//! and gets its own copy of the descriptor with `SCM_RIGHTS`. [`withdraw`] ends the offer.
//!
//! # Wire protocol (version 1)
//!
//! One connection per fetch, one record each way, then the broker closes the connection.
//!
//! | record | bytes | meaning |
//! |---|---|---|
//! | request | 0..4 | magic `CMFD` |
//! | | 4 | protocol version, 1 |
//! | | 5..13 | key, u64 little-endian |
//! | | 13..29 | secret |
//! | reply | 0 | status (below); with status 0 exactly one descriptor rides along in an `SCM_RIGHTS` control message, with any other status none |
//!
//! | status | meaning | [`fetch`] fails with |
//! |---|---|---|
//! | 0 | here is the descriptor | |
//! | 1 | nothing is offered under this key | `Malformed` (withdrawn, or a forged ticket) |
//! | 2 | the secret does not match | `Malformed` (a forged ticket) |
//! | 3 | the broker speaks another protocol version | `Malformed` |
//! | 4 | the request is not 29 bytes of this layout | `Malformed` |
//! | 5 | the client runs as another user | `Io` (permission denied) |
//! | 6 | the broker's process is out of descriptors | `Io` |
//!
//! Other failures of [`fetch`]: nothing listens on the name (the offering process has exited:
//! `OwnerExited`, "the process that offered it has exited"); the broker closed the
//! connection without a reply (`Io`, unexpected end of file); the reply carries no descriptor or
//! more than one (`Malformed`; every descriptor received is closed); no reply within the
//! timeout (`Timeout`; the whole fetch, connect included, is bounded by it); this process has no
//! descriptor free for the socket or for the received descriptor (the kernel truncates the
//! control message, `MSG_CTRUNC`: `OutOfDescriptors`).
//!
//! # Security
//!
//! Abstract sockets have no file permissions: any process in the same network namespace may
//! connect. The secret (from `getrandom(2)`, compared in constant time, fresh for every offer)
//! is what makes a ticket a capability: only a process that received the message holding it can
//! fetch the descriptor. In addition the broker checks the client's credentials (`SO_PEERCRED`)
//! and serves only processes of its own effective uid, or root (which could read the memory
//! anyway); others get status 5. The broker name is random, so another process cannot bind it
//! first, and [`fetch`] only connects to names of this form. Every descriptor made here has
//! close-on-exec set (`SOCK_CLOEXEC`, `accept4`, `MSG_CMSG_CLOEXEC`).
//!
//! # The broker
//!
//! One thread multiplexes the listener and the connections with `poll(2)`; all sockets are
//! non-blocking, so a slow or malicious client never blocks another: a connection that has not
//! sent its request within 2 s is closed, at most 256 connections wait at once (the oldest is
//! dropped to make room), and a reply is one byte on a fresh socket, sent without waiting. The
//! table of offers is behind a mutex taken only to look up an offer (no socket I/O under it);
//! the broker sends from its own reference to the descriptor, so a concurrent [`withdraw`] does
//! not close it under the send. The broker lives as long as the process; a process forked
//! without exec closes its copy of the listener at once (`pthread_atfork`), so tickets of a
//! parent that exits do not hang in a child's backlog, and starts a broker of its own.
//!
//! Abstract sockets belong to a network namespace: processes in different network namespaces
//! cannot reach each other's brokers (cuda-mp's spawned workers share their parent's).

// Until the VMM storage kind uses it.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::mem::{size_of, MaybeUninit};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Once};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The version byte of requests; a broker answers another version with status 3.
pub(crate) const PROTOCOL_VERSION: u8 = 1;
/// The first bytes of every request.
const MAGIC: [u8; 4] = *b"CMFD";
/// Magic, version, key, secret.
const REQUEST_LEN: usize = 4 + 1 + 8 + 16;
/// Every broker name starts with this; [`fetch`] refuses other names.
const NAME_PREFIX: &str = "cuda-mp-";
/// The thread's name.
const THREAD_NAME: &str = "cuda-mp-fd-broker";
/// How long the broker waits for a connection's request.
const REQUEST_DEADLINE: Duration = Duration::from_secs(2);
/// Connections waiting for their request at most.
const MAX_PENDING: usize = 256;
/// The listener's backlog.
const BACKLOG: libc::c_int = 128;
/// Descriptors a reply is received with room for: a reply with more is refused (and all are
/// closed), and a truncated control message below this many means we ran out of descriptors.
const MAX_REPLY_FDS: usize = 8;

/// Reply status bytes.
mod status {
    pub(super) const OK: u8 = 0;
    pub(super) const NO_OFFER: u8 = 1;
    pub(super) const BAD_SECRET: u8 = 2;
    pub(super) const BAD_VERSION: u8 = 3;
    pub(super) const BAD_REQUEST: u8 = 4;
    pub(super) const DENIED: u8 = 5;
    pub(super) const BROKER_OUT_OF_DESCRIPTORS: u8 = 6;
}

/// Where and how to fetch one offered descriptor: travels inside messages.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Ticket {
    /// The abstract socket name of the owner's broker (without the leading NUL).
    pub(crate) broker: String,
    /// The key the owner offered the descriptor under (its storage index).
    pub(crate) key: u64,
    /// The secret that proves the fetcher received the ticket.
    pub(crate) secret: [u8; 16],
}

impl fmt::Debug for Ticket {
    // The secret is a capability: it stays out of logs and error messages.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ticket").field("broker", &self.broker).field("key", &self.key).field("secret", &"..").finish()
    }
}

/// One offered descriptor.
struct Offer {
    secret: [u8; 16],
    fd: Arc<OwnedFd>,
}

/// This process's broker.
struct Broker {
    /// The process that started it: a child forked without exec has the table but not the
    /// thread, and starts its own.
    pid: u32,
    name: String,
}

/// The broker and the offers.
struct Registry {
    broker: Option<Broker>,
    offers: BTreeMap<u64, Offer>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry { broker: None, offers: BTreeMap::new() });

/// The broker's listening descriptor (-1 when none), closed in children forked without exec.
static LISTENER: AtomicI32 = AtomicI32::new(-1);

fn registry() -> MutexGuard<'static, Registry> {
    // Nothing under the lock can leave the table inconsistent: a poisoned lock is still good.
    REGISTRY.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Offers `fd` under `key` (the caller's storage index) until withdrawn: starts this process's
/// broker on first use, keeps a reference to the descriptor, and returns the ticket. Offering
/// the same descriptor (the same `Arc`) again while the offer stands returns the same ticket;
/// offering another descriptor under a key replaces the offer with a fresh secret, so tickets
/// for the old descriptor stop working.
pub(crate) fn offer(key: u64, fd: Arc<OwnedFd>) -> Result<Ticket> {
    let mut registry = registry();
    let pid = std::process::id();
    let name = match &registry.broker {
        Some(broker) if broker.pid == pid => broker.name.clone(),
        _ => {
            // First use, or a child forked from an offering process: the offers were the
            // parent's (dropping the table's references closes only this process's copies).
            registry.offers.clear();
            registry.broker = None;
            let broker = start_broker(pid)?;
            let name = broker.name.clone();
            registry.broker = Some(broker);
            name
        }
    };
    let (secret, replaced) = match registry.offers.get(&key) {
        Some(offer) if Arc::ptr_eq(&offer.fd, &fd) => (offer.secret, None),
        _ => {
            let secret = random_bytes::<16>()?;
            (secret, registry.offers.insert(key, Offer { secret, fd }))
        }
    };
    drop(registry);
    // A replaced descriptor (if this was its last reference) closes outside the lock.
    drop(replaced);
    Ok(Ticket { broker: name, key, secret })
}

/// Withdraws the offer under `key`: the broker drops its reference, later fetches fail (a
/// fetch already being answered still gets the descriptor). Withdrawing a key that is not
/// offered does nothing.
pub(crate) fn withdraw(key: u64) {
    let removed = registry().offers.remove(&key);
    // The descriptor (if this was its last reference) closes outside the lock.
    drop(removed);
}

/// How many descriptors this process offers now.
pub(crate) fn offered() -> usize {
    registry().offers.len()
}

/// Fetches the descriptor a ticket names from its broker: connects, sends key and secret, and
/// receives the descriptor (close-on-exec) with `SCM_RIGHTS`. Never waits longer than
/// `timeout` in all; the errors are listed in the module documentation.
pub(crate) fn fetch(ticket: &Ticket, timeout: Duration) -> Result<OwnedFd> {
    let pid = broker_pid(&ticket.broker)?;
    let what = format!("cannot fetch descriptor {} from process {pid}", ticket.key);
    let deadline = Instant::now().checked_add(timeout);
    let request = encode_request(PROTOCOL_VERSION, ticket.key, &ticket.secret);
    let reply = exchange(&ticket.broker, &request, deadline).map_err(|failure| match failure {
        Failure::Exited => Error::OwnerExited(format!(
            "{what}: the process that offered it has exited (nothing listens on @{})",
            ticket.broker
        )),
        Failure::Timeout => Error::Timeout(timeout),
        Failure::OutOfDescriptors => out_of_descriptors(),
        Failure::Closed => Error::Io(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("{what}: its broker closed the connection without replying (the process may be exiting)"),
        )),
        Failure::Io(call, e) => Error::Io(io::Error::new(e.kind(), format!("{what}: {call}: {e}"))),
    })?;
    let Reply { status, mut fds, data_len, data_truncated, control_truncated } = reply;
    if control_truncated {
        // `fds` (dropped here) holds what did arrive. Below our room, the kernel could not
        // install a descriptor: this process is at its limit.
        return Err(if fds.len() < MAX_REPLY_FDS {
            out_of_descriptors()
        } else {
            Error::Malformed(format!("{what}: the reply carries more than {MAX_REPLY_FDS} descriptors"))
        });
    }
    if data_len != 1 || data_truncated {
        return Err(Error::Malformed(format!("{what}: the broker's reply is not one status byte")));
    }
    let key = ticket.key;
    match status {
        status::OK if fds.len() == 1 => Ok(fds.remove(0)),
        status::OK => {
            Err(Error::Malformed(format!("{what}: the reply carries {} descriptors instead of one", fds.len())))
        }
        status::NO_OFFER => Err(Error::Malformed(format!(
            "{what}: it offers nothing under key {key} (the offer was withdrawn, or the ticket is forged)"
        ))),
        status::BAD_SECRET => {
            Err(Error::Malformed(format!("{what}: the secret for key {key} is wrong (a forged ticket)")))
        }
        status::BAD_VERSION => Err(Error::Malformed(format!(
            "{what}: its broker does not speak descriptor protocol version {PROTOCOL_VERSION}"
        ))),
        status::BAD_REQUEST => Err(Error::Malformed(format!("{what}: its broker could not parse the request"))),
        status::DENIED => Err(Error::Io(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("{what}: refused, this process runs as another user"),
        ))),
        status::BROKER_OUT_OF_DESCRIPTORS => {
            Err(Error::Io(io::Error::other(format!("{what}: the process that offered it is out of file descriptors"))))
        }
        other => Err(Error::Malformed(format!("{what}: unknown reply status {other}"))),
    }
}

fn out_of_descriptors() -> Error {
    Error::OutOfDescriptors { limit: crate::os::descriptor_limit() }
}

/// The pid in a broker name `cuda-mp-<pid>-<hex>`; any other name is a forged ticket.
fn broker_pid(name: &str) -> Result<u32> {
    let parsed = name.strip_prefix(NAME_PREFIX).and_then(|rest| rest.split_once('-')).and_then(|(pid, hex)| {
        let hex_ok = !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit());
        let pid_ok = !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit());
        (hex_ok && pid_ok && name.len() < SUN_PATH_LEN).then(|| pid.parse::<u32>().ok()).flatten()
    });
    parsed.ok_or_else(|| {
        let shown: String = name.chars().take(64).collect();
        Error::Malformed(format!("the ticket names no cuda-mp descriptor broker: {shown:?}"))
    })
}

// ---------------------------------------------------------------------------------------------
// The wire.

fn encode_request(version: u8, key: u64, secret: &[u8; 16]) -> [u8; REQUEST_LEN] {
    let mut request = [0u8; REQUEST_LEN];
    request[..4].copy_from_slice(&MAGIC);
    request[4] = version;
    request[5..13].copy_from_slice(&key.to_le_bytes());
    request[13..].copy_from_slice(secret);
    request
}

/// What the broker answers a request with.
fn answer(request: &[u8]) -> (u8, Option<Arc<OwnedFd>>) {
    if request.len() < 5 || request[..4] != MAGIC {
        return (status::BAD_REQUEST, None);
    }
    if request[4] != PROTOCOL_VERSION {
        return (status::BAD_VERSION, None);
    }
    if request.len() != REQUEST_LEN {
        return (status::BAD_REQUEST, None);
    }
    let mut key = [0u8; 8];
    key.copy_from_slice(&request[5..13]);
    let key = u64::from_le_bytes(key);
    let mut secret = [0u8; 16];
    secret.copy_from_slice(&request[13..]);
    let registry = registry();
    match registry.offers.get(&key) {
        None => (status::NO_OFFER, None),
        Some(offer) if secrets_equal(&offer.secret, &secret) => (status::OK, Some(offer.fd.clone())),
        Some(_) => (status::BAD_SECRET, None),
    }
}

/// Compares in time independent of where the secrets differ.
fn secrets_equal(a: &[u8; 16], b: &[u8; 16]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut bytes = [0u8; N];
    let mut filled = 0;
    while filled < N {
        let rest = &mut bytes[filled..];
        // SAFETY: `rest` is a writable buffer of `rest.len()` bytes.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::ENOSYS) => {
                    use std::io::Read;
                    std::fs::File::open("/dev/urandom")?.read_exact(rest)?;
                    return Ok(bytes);
                }
                _ => return Err(Error::Io(io::Error::new(e.kind(), format!("getrandom: {e}")))),
            }
        }
        filled += n as usize;
    }
    Ok(bytes)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

// ---------------------------------------------------------------------------------------------
// Sockets.

/// Bytes in `sockaddr_un::sun_path`.
const SUN_PATH_LEN: usize = 108;

/// The abstract address `@name` and its length.
fn abstract_address(name: &str) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: `sockaddr_un` is plain data for which all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if name.is_empty() || name.len() + 1 > addr.sun_path.len() || name.bytes().any(|b| b == 0) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a valid abstract socket name"));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    // sun_path[0] stays 0: the abstract namespace.
    for (slot, byte) in addr.sun_path[1..].iter_mut().zip(name.bytes()) {
        *slot = byte as libc::c_char;
    }
    let len = size_of::<libc::sa_family_t>() + 1 + name.len();
    Ok((addr, len as libc::socklen_t))
}

/// A non-blocking, close-on-exec `SOCK_SEQPACKET` Unix socket.
fn seqpacket_socket() -> io::Result<OwnedFd> {
    let flags = libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK;
    // SAFETY: plain system call without pointers.
    let fd = unsafe { libc::socket(libc::AF_UNIX, flags, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned to us and is owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A listening socket bound to `@name`.
fn bind_listener(name: &str) -> io::Result<OwnedFd> {
    let socket = seqpacket_socket()?;
    let (addr, len) = abstract_address(name)?;
    // SAFETY: `addr` is a valid `sockaddr_un` of which `len` bytes are meaningful.
    if unsafe { libc::bind(socket.as_raw_fd(), (&addr as *const libc::sockaddr_un).cast(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: plain system call on a socket we own.
    if unsafe { libc::listen(socket.as_raw_fd(), BACKLOG) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(socket)
}

fn errno(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

/// Room for a control message of [`MAX_REPLY_FDS`] descriptors, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct ControlBuffer([u8; 128]);

/// Bytes of control message for `count` descriptors.
fn rights_space(count: usize) -> usize {
    // SAFETY: CMSG_SPACE only computes a size.
    unsafe { libc::CMSG_SPACE((count * size_of::<libc::c_int>()) as libc::c_uint) as usize }
}

/// Sends one record of `data` with `fds` in one `SCM_RIGHTS` control message (none when
/// empty), without blocking and without `SIGPIPE`.
fn send_record(socket: RawFd, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let mut control = ControlBuffer([0; 128]);
    if fds.len() > MAX_REPLY_FDS || rights_space(fds.len()) > control.0.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "too many descriptors for one record"));
    }
    let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() };
    // SAFETY: `msghdr` is plain data for which all zeroes is a valid value (no name, no control).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        let payload = std::mem::size_of_val(fds);
        msg.msg_control = control.0.as_mut_ptr().cast();
        msg.msg_controllen = rights_space(fds.len()) as _;
        // SAFETY: `msg_control` points to `msg_controllen` zeroed, aligned bytes, enough for one
        // header and `payload` bytes (checked above), so CMSG_FIRSTHDR is not null and the header
        // and data writes stay inside `control`.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(payload as libc::c_uint) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr().cast::<u8>(), libc::CMSG_DATA(cmsg), payload);
        }
    }
    loop {
        // SAFETY: `msg` points to `iov` (which the kernel only reads, `data` outlives the call)
        // and to `control`, both alive for the call.
        let n = unsafe { libc::sendmsg(socket, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        if n >= 0 {
            return if n as usize == data.len() {
                Ok(())
            } else {
                Err(io::Error::new(io::ErrorKind::WriteZero, "short send of a record"))
            };
        }
        let e = io::Error::last_os_error();
        if errno(&e) != libc::EINTR {
            return Err(e);
        }
    }
}

/// One received record.
struct Reply {
    status: u8,
    /// Every descriptor the record carried (closed when dropped).
    fds: Vec<OwnedFd>,
    data_len: usize,
    data_truncated: bool,
    control_truncated: bool,
}

/// Receives one record without blocking; its descriptors are close-on-exec.
fn receive_record(socket: RawFd) -> io::Result<Reply> {
    let mut data = [0u8; 16];
    let mut control = ControlBuffer([0; 128]);
    let mut iov = libc::iovec { iov_base: data.as_mut_ptr().cast(), iov_len: data.len() };
    // SAFETY: `msghdr` is plain data for which all zeroes is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    msg.msg_controllen = rights_space(MAX_REPLY_FDS) as _;
    let n = loop {
        // SAFETY: `msg` points to `iov` (over `data`) and `control`, both writable and alive for
        // the call, with their true lengths.
        let n = unsafe { libc::recvmsg(socket, &mut msg, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if errno(&e) != libc::EINTR {
            return Err(e);
        }
    };
    // Take ownership of every descriptor first, so that every path below closes them.
    let mut fds = Vec::new();
    // SAFETY: after recvmsg, `msg_control`/`msg_controllen` describe the control messages the
    // kernel wrote into `control`; CMSG_FIRSTHDR/CMSG_NXTHDR stay inside that range.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !cmsg.is_null() {
        // SAFETY: `cmsg` is a non-null header inside `control` (see above).
        let (level, kind, len) = unsafe { ((*cmsg).cmsg_level, (*cmsg).cmsg_type, (*cmsg).cmsg_len as usize) };
        if level == libc::SOL_SOCKET && kind == libc::SCM_RIGHTS {
            // SAFETY: CMSG_LEN only computes a size.
            let header = unsafe { libc::CMSG_LEN(0) } as usize;
            let count = len.saturating_sub(header) / size_of::<libc::c_int>();
            // SAFETY: the kernel wrote `count` descriptors after this header, inside `control`.
            let first = unsafe { libc::CMSG_DATA(cmsg) }.cast::<libc::c_int>();
            for i in 0..count {
                // SAFETY: `i < count` (above); the data may be unaligned, hence read_unaligned.
                let fd = unsafe { first.add(i).read_unaligned() };
                if fd >= 0 {
                    // SAFETY: the kernel just installed `fd` in this process for us alone.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
        // SAFETY: `cmsg` is a valid header of `msg` (see above).
        cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
    }
    Ok(Reply {
        status: data[0],
        fds,
        data_len: n,
        data_truncated: msg.msg_flags & libc::MSG_TRUNC != 0,
        control_truncated: msg.msg_flags & libc::MSG_CTRUNC != 0,
    })
}

/// Waits until `socket` has one of `events`, or the deadline passes.
fn wait_for(socket: RawFd, events: libc::c_short, deadline: Option<Instant>) -> Result<(), Failure> {
    loop {
        let millis = match deadline {
            None => -1,
            Some(deadline) => {
                let now = Instant::now();
                if now >= deadline {
                    return Err(Failure::Timeout);
                }
                crate::os::poll_millis(Some(deadline - now))
            }
        };
        let mut poll_fd = libc::pollfd { fd: socket, events, revents: 0 };
        // SAFETY: `poll_fd` is one valid, writable pollfd.
        let n = unsafe { libc::poll(&mut poll_fd, 1, millis) };
        if n > 0 {
            return Ok(());
        }
        if n < 0 {
            let e = io::Error::last_os_error();
            if errno(&e) != libc::EINTR {
                return Err(Failure::Io("poll", e));
            }
        }
    }
}

/// Why an exchange with a broker failed.
enum Failure {
    /// Nothing listens on the name.
    Exited,
    Timeout,
    OutOfDescriptors,
    /// The broker closed the connection without replying.
    Closed,
    Io(&'static str, io::Error),
}

impl Failure {
    fn from_io(call: &'static str, e: io::Error) -> Failure {
        match errno(&e) {
            libc::EMFILE | libc::ENFILE => Failure::OutOfDescriptors,
            libc::EPIPE | libc::ECONNRESET => Failure::Closed,
            _ => Failure::Io(call, e),
        }
    }
}

/// Connects to `@name`, sends `request` and receives the reply, all by `deadline`.
fn exchange(name: &str, request: &[u8], deadline: Option<Instant>) -> Result<Reply, Failure> {
    let (addr, len) = abstract_address(name).map_err(|e| Failure::Io("connect", e))?;
    let socket = seqpacket_socket().map_err(|e| Failure::from_io("socket", e))?;
    let fd = socket.as_raw_fd();
    loop {
        // SAFETY: `addr` is a valid `sockaddr_un` of which `len` bytes are meaningful.
        if unsafe { libc::connect(fd, (&addr as *const libc::sockaddr_un).cast(), len) } == 0 {
            break;
        }
        let e = io::Error::last_os_error();
        match errno(&e) {
            libc::EINTR => {}
            libc::EISCONN => break,
            libc::ECONNREFUSED | libc::ENOENT => return Err(Failure::Exited),
            // The broker's backlog is full: try again until the deadline.
            libc::EAGAIN => {
                let pause = Duration::from_millis(2);
                match deadline {
                    Some(deadline) if Instant::now() + pause >= deadline => return Err(Failure::Timeout),
                    _ => std::thread::sleep(pause),
                }
            }
            libc::EINPROGRESS | libc::EALREADY => {
                wait_for(fd, libc::POLLOUT, deadline)?;
                break;
            }
            _ => return Err(Failure::from_io("connect", e)),
        }
    }
    loop {
        wait_for(fd, libc::POLLOUT, deadline)?;
        match send_record(fd, request, &[]) {
            Ok(()) => break,
            Err(e) if errno(&e) == libc::EAGAIN => {}
            Err(e) => return Err(Failure::from_io("send", e)),
        }
    }
    loop {
        wait_for(fd, libc::POLLIN, deadline)?;
        match receive_record(fd) {
            Ok(reply) if reply.data_len == 0 && reply.fds.is_empty() && !reply.control_truncated => {
                return Err(Failure::Closed)
            }
            Ok(reply) => return Ok(reply),
            Err(e) if errno(&e) == libc::EAGAIN => {}
            Err(e) => return Err(Failure::from_io("recvmsg", e)),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The broker.

/// Binds a new broker and starts its thread.
fn start_broker(pid: u32) -> Result<Broker> {
    let name = format!("{NAME_PREFIX}{pid}-{}", hex(&random_bytes::<8>()?));
    let listener = bind_listener(&name).map_err(|e| match errno(&e) {
        libc::EMFILE | libc::ENFILE => out_of_descriptors(),
        _ => Error::Io(io::Error::new(e.kind(), format!("cannot start the descriptor broker @{name}: {e}"))),
    })?;
    install_fork_handler();
    // The listener lives as long as the process (or until the thread fails): the thread uses it
    // by number, and a forked child closes its copy by number.
    let raw = listener.as_raw_fd();
    std::mem::forget(listener);
    LISTENER.store(raw, Ordering::SeqCst);
    let thread_name = name.clone();
    let spawned = std::thread::Builder::new().name(THREAD_NAME.into()).spawn(move || {
        if serve(raw) {
            close_listener(raw);
        } else {
            // The number is no longer the listener: only forget it.
            let _ = LISTENER.compare_exchange(raw, -1, Ordering::SeqCst, Ordering::SeqCst);
        }
        // The next offer starts a new broker.
        let mut registry = registry();
        if registry.broker.as_ref().is_some_and(|broker| broker.name == thread_name) {
            registry.broker = None;
        }
    });
    if let Err(e) = spawned {
        close_listener(raw);
        return Err(Error::Io(io::Error::new(e.kind(), format!("cannot start the descriptor broker thread: {e}"))));
    }
    Ok(Broker { pid, name })
}

/// Closes the listener `raw` unless someone already did.
fn close_listener(raw: RawFd) {
    if LISTENER.compare_exchange(raw, -1, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
        // SAFETY: `raw` is the listener, which nothing else closes (the exchange above makes
        // this the only close).
        unsafe { libc::close(raw) };
    }
}

/// In a child forked without exec, the parent's broker thread does not exist: its copy of the
/// listener would keep the name bound, and fetches from a parent that has exited would wait
/// out their timeout in its backlog instead of failing at once.
fn install_fork_handler() {
    extern "C" fn in_child() {
        // Only async-signal-safe work here: an atomic swap and close(2).
        let fd = LISTENER.swap(-1, Ordering::SeqCst);
        if fd >= 0 {
            // SAFETY: `fd` is this (child) process's copy of the listener, used by nothing here.
            unsafe { libc::close(fd) };
        }
    }
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: `in_child` is a valid `extern "C" fn()` for the lifetime of the process.
        unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
    });
}

/// A connection waiting for its request.
struct Pending {
    conn: OwnedFd,
    deadline: Instant,
}

/// The broker's loop: never returns unless the listener breaks; then true when the descriptor
/// is still open (to be closed), false when it is no longer ours (`POLLNVAL`).
fn serve(listener: RawFd) -> bool {
    let mut pending: Vec<Pending> = Vec::new();
    let mut spare = open_spare();
    let mut poll_fds: Vec<libc::pollfd> = Vec::new();
    loop {
        let now = Instant::now();
        pending.retain(|p| p.deadline > now);
        let millis = pending.iter().map(|p| crate::os::poll_millis(Some(p.deadline - now))).min().unwrap_or(-1);
        poll_fds.clear();
        poll_fds.push(libc::pollfd { fd: listener, events: libc::POLLIN, revents: 0 });
        poll_fds.extend(pending.iter().map(|p| libc::pollfd {
            fd: p.conn.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }));
        // SAFETY: `poll_fds` is a valid, writable array of `len` pollfds.
        let n = unsafe { libc::poll(poll_fds.as_mut_ptr(), poll_fds.len() as libc::nfds_t, millis) };
        if n < 0 {
            if errno(&io::Error::last_os_error()) != libc::EINTR {
                std::thread::sleep(Duration::from_millis(10));
            }
            continue;
        }
        // Descending, so that swap_remove only moves entries already looked at.
        for i in (1..poll_fds.len()).rev() {
            if poll_fds[i].revents != 0 && answer_connection(&pending[i - 1].conn) {
                pending.swap_remove(i - 1);
            }
        }
        let events = poll_fds[0].revents;
        if events & libc::POLLNVAL != 0 {
            return false;
        }
        if events & libc::POLLERR != 0
            || (events & libc::POLLIN != 0 && !accept_all(listener, &mut pending, &mut spare))
        {
            return true;
        }
    }
}

/// A descriptor held in reserve: when accept fails for want of descriptors, closing it frees
/// a slot to accept a waiting client and tell it so, instead of leaving it to time out.
fn open_spare() -> Option<OwnedFd> {
    std::fs::File::open("/dev/null").ok().map(OwnedFd::from)
}

/// Accepts one connection (`accept4` with `flags`).
fn accept(listener: RawFd, flags: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: accept4 without an address buffer.
    let fd = unsafe { libc::accept4(listener, std::ptr::null_mut(), std::ptr::null_mut(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by accept4 and is owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Accepts every waiting connection. False when the listener is broken.
fn accept_all(listener: RawFd, pending: &mut Vec<Pending>, spare: &mut Option<OwnedFd>) -> bool {
    loop {
        let conn = match accept(listener, libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK) {
            Ok(conn) => conn,
            Err(e) => {
                return match errno(&e) {
                    libc::EAGAIN => true,
                    libc::EINTR | libc::ECONNABORTED | libc::EPROTO => continue,
                    libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM => {
                        refuse_one(listener, spare);
                        true
                    }
                    _ => false,
                };
            }
        };
        if !peer_allowed(&conn) {
            let _ = send_record(conn.as_raw_fd(), &[status::DENIED], &[]);
            continue;
        }
        // Most clients send the request with the connect: answer at once.
        if answer_connection(&conn) {
            continue;
        }
        if pending.len() >= MAX_PENDING {
            // The oldest is the likeliest to be idle on purpose.
            pending.remove(0);
        }
        pending.push(Pending { conn, deadline: Instant::now() + REQUEST_DEADLINE });
    }
}

/// Out of descriptors: uses the spare slot to accept one client and tell it, so that a full
/// backlog drains instead of every client waiting out its timeout.
fn refuse_one(listener: RawFd, spare: &mut Option<OwnedFd>) {
    if spare.take().is_none() {
        // Nothing in reserve: do not spin on a listener that stays readable.
        std::thread::sleep(Duration::from_millis(10));
        *spare = open_spare();
        return;
    }
    if let Ok(conn) = accept(listener, libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK) {
        let _ = send_record(conn.as_raw_fd(), &[status::BROKER_OUT_OF_DESCRIPTORS], &[]);
    }
    *spare = open_spare();
}

/// Serves the client only if it runs as our effective uid, or as root.
fn peer_allowed(conn: &OwnedFd) -> bool {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a writable `ucred` and `len` its size.
    let rc = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 || len as usize != size_of::<libc::ucred>() {
        return false;
    }
    // SAFETY: geteuid cannot fail.
    let own = unsafe { libc::geteuid() };
    cred.uid == own || cred.uid == 0
}

/// Reads a connection's request and replies. True when the connection is done with (answered,
/// closed by the client, or broken); false when its request has not arrived yet.
fn answer_connection(conn: &OwnedFd) -> bool {
    let mut request = [MaybeUninit::<u8>::uninit(); 64];
    // SAFETY: `request` is a writable buffer of its length; no descriptors can arrive (no
    // control buffer: the kernel closes any a client attaches).
    let n = unsafe { libc::recv(conn.as_raw_fd(), request.as_mut_ptr().cast(), request.len(), libc::MSG_DONTWAIT) };
    if n < 0 {
        let e = errno(&io::Error::last_os_error());
        return !(e == libc::EAGAIN || e == libc::EINTR);
    }
    if n == 0 {
        return true;
    }
    // SAFETY: recv initialized the first `n` bytes.
    let request = unsafe { std::slice::from_raw_parts(request.as_ptr().cast::<u8>(), n as usize) };
    let (status, fd) = answer(request);
    // The registry's lock is released: `fd` is our own reference, alive across the send.
    let raw = fd.as_ref().map(|fd| fd.as_raw_fd());
    // A client that went away meanwhile loses its reply; nothing else to do.
    let _ = send_record(conn.as_raw_fd(), &[status], raw.as_slice());
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::io::Write;
    use std::os::unix::fs::FileExt;
    use std::process::Command;
    use std::sync::atomic::AtomicU64;

    /// Keys of this test process: tests run in parallel and share the registry.
    fn fresh_key() -> u64 {
        static NEXT: AtomicU64 = AtomicU64::new(1 << 40);
        NEXT.fetch_add(1, Ordering::Relaxed)
    }

    fn memfd(contents: &[u8]) -> Arc<OwnedFd> {
        // SAFETY: a NUL-terminated name and valid flags.
        let fd = unsafe { libc::memfd_create(c"fdpass-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
        // SAFETY: `fd` was just returned to us.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut file = File::from(fd);
        file.write_all(contents).unwrap();
        Arc::new(OwnedFd::from(file))
    }

    fn read_all(fd: &OwnedFd) -> Vec<u8> {
        let file = File::from(fd.try_clone().unwrap());
        let len = file.metadata().unwrap().len() as usize;
        let mut bytes = vec![0u8; len];
        file.read_exact_at(&mut bytes, 0).unwrap();
        bytes
    }

    fn inode(fd: &OwnedFd) -> (u64, u64) {
        use std::os::unix::fs::MetadataExt;
        let meta = File::from(fd.try_clone().unwrap()).metadata().unwrap();
        (meta.dev(), meta.ino())
    }

    fn is_cloexec(fd: RawFd) -> bool {
        // SAFETY: F_GETFD only reads the descriptor's flags.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        flags >= 0 && flags & libc::FD_CLOEXEC != 0
    }

    fn unused_name() -> String {
        format!("{NAME_PREFIX}{}-{}", std::process::id(), hex(&random_bytes::<8>().unwrap()))
    }

    const LONG: Duration = Duration::from_secs(10);

    #[test]
    fn fetch_in_the_same_process_reads_the_memfd() {
        let key = fresh_key();
        let fd = memfd(b"hello from the owner");
        let ticket = offer(key, fd.clone()).unwrap();
        assert!(ticket.broker.starts_with(&format!("cuda-mp-{}-", std::process::id())));
        assert_eq!(ticket.key, key);
        let fetched = fetch(&ticket, LONG).unwrap();
        assert_ne!(fetched.as_raw_fd(), fd.as_raw_fd());
        assert_eq!(inode(&fetched), inode(&fd), "the same file");
        assert!(is_cloexec(fetched.as_raw_fd()));
        assert_eq!(read_all(&fetched), b"hello from the owner");
        // The same offer again: the same ticket; fetch works repeatedly.
        assert_eq!(offer(key, fd.clone()).unwrap(), ticket);
        assert_eq!(read_all(&fetch(&ticket, LONG).unwrap()), b"hello from the owner");
        assert!(!format!("{ticket:?}").contains(&format!("{:?}", ticket.secret)), "the secret stays out of Debug");
        withdraw(key);
    }

    #[test]
    fn a_new_offer_has_a_new_secret() {
        let key = fresh_key();
        let fd = memfd(b"x");
        let first = offer(key, fd.clone()).unwrap();
        withdraw(key);
        let second = offer(key, fd.clone()).unwrap();
        assert_ne!(first.secret, second.secret);
        assert!(fetch(&first, LONG).unwrap_err().to_string().contains("forged"));
        // Another descriptor under the same key replaces the offer.
        let other = memfd(b"y");
        let third = offer(key, other).unwrap();
        assert_ne!(third.secret, second.secret);
        assert!(fetch(&second, LONG).is_err());
        assert_eq!(read_all(&fetch(&third, LONG).unwrap()), b"y");
        withdraw(key);
    }

    #[test]
    fn a_wrong_secret_is_malformed() {
        let key = fresh_key();
        let mut ticket = offer(key, memfd(b"secret stuff")).unwrap();
        ticket.secret[7] ^= 1;
        let err = fetch(&ticket, LONG).unwrap_err();
        assert!(matches!(err, Error::Malformed(_)), "{err}");
        let text = err.to_string();
        assert!(text.contains("malformed") && text.contains("forged"), "{text}");
        withdraw(key);
    }

    #[test]
    fn an_unknown_key_fails() {
        let key = fresh_key();
        let mut ticket = offer(key, memfd(b"a")).unwrap();
        ticket.key = fresh_key();
        let err = fetch(&ticket, LONG).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, Error::Malformed(_)) && text.contains("offers nothing under key"), "{text}");
        withdraw(key);
    }

    #[test]
    fn a_withdrawn_offer_fails_but_fetched_copies_stay() {
        let key = fresh_key();
        let ticket = offer(key, memfd(b"kept")).unwrap();
        let fetched = fetch(&ticket, LONG).unwrap();
        withdraw(key);
        withdraw(key); // twice: nothing happens
        let text = fetch(&ticket, LONG).unwrap_err().to_string();
        assert!(text.contains("withdrawn"), "{text}");
        assert_eq!(read_all(&fetched), b"kept", "the fetched copy outlives the offer");
    }

    #[test]
    fn a_missing_broker_means_the_owner_exited() {
        let ticket = Ticket { broker: unused_name(), key: 1, secret: [0; 16] };
        let start = Instant::now();
        let err = fetch(&ticket, LONG).unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(1), "fails at once");
        assert!(matches!(err, Error::OwnerExited(_)), "{err}");
        let text = err.to_string();
        assert!(text.contains("the process that offered it has exited"), "{text}");
        // Even with no time to wait.
        let text = fetch(&ticket, Duration::ZERO).unwrap_err().to_string();
        assert!(text.contains("has exited"), "{text}");
    }

    #[test]
    fn foreign_broker_names_are_refused() {
        let very_long = "a".repeat(300);
        for name in ["", "systemd-journal", "cuda-mp-", "cuda-mp-12-", "cuda-mp-x-ab", "cuda-mp-1-zz", &very_long] {
            let ticket = Ticket { broker: name.to_string(), key: 1, secret: [0; 16] };
            let err = fetch(&ticket, LONG).unwrap_err();
            assert!(matches!(err, Error::Malformed(_)), "{name:?}: {err}");
        }
        let long = format!("cuda-mp-1-{}", "a".repeat(120));
        assert!(matches!(fetch(&Ticket { broker: long, key: 1, secret: [0; 16] }, LONG), Err(Error::Malformed(_))));
    }

    #[test]
    fn the_timeout_is_respected() {
        // A "broker" that never accepts: the connection waits in its backlog.
        let name = unused_name();
        let _listener = bind_listener(&name).unwrap();
        let ticket = Ticket { broker: name, key: 1, secret: [0; 16] };
        let start = Instant::now();
        let err = fetch(&ticket, Duration::from_millis(300)).unwrap_err();
        let elapsed = start.elapsed();
        assert!(matches!(err, Error::Timeout(t) if t == Duration::from_millis(300)), "{err}");
        assert!(elapsed >= Duration::from_millis(300) && elapsed < Duration::from_secs(2), "{elapsed:?}");
    }

    /// Connects to `@name` without sending anything.
    fn idle_connection(name: &str) -> OwnedFd {
        let socket = seqpacket_socket().unwrap();
        let (addr, len) = abstract_address(name).unwrap();
        // SAFETY: a valid address of `len` meaningful bytes.
        let rc = unsafe { libc::connect(socket.as_raw_fd(), (&addr as *const libc::sockaddr_un).cast(), len) };
        assert_eq!(rc, 0, "{}", io::Error::last_os_error());
        socket
    }

    #[test]
    fn slow_clients_do_not_block_others() {
        let key = fresh_key();
        let ticket = offer(key, memfd(b"quick")).unwrap();
        let idle: Vec<OwnedFd> = (0..20).map(|_| idle_connection(&ticket.broker)).collect();
        let partial = idle_connection(&ticket.broker);
        send_record(partial.as_raw_fd(), &MAGIC, &[]).unwrap(); // a short request
        let start = Instant::now();
        for _ in 0..10 {
            assert_eq!(read_all(&fetch(&ticket, Duration::from_secs(1)).unwrap()), b"quick");
        }
        assert!(start.elapsed() < Duration::from_secs(1), "{:?}", start.elapsed());
        // The short request got its answer; the idle ones are closed after the deadline.
        wait_for(partial.as_raw_fd(), libc::POLLIN, Some(Instant::now() + LONG)).ok().unwrap();
        assert_eq!(receive_record(partial.as_raw_fd()).unwrap().status, status::BAD_REQUEST);
        let reply = match exchange_on(&idle[0], None) {
            Ok(reply) => reply,
            Err(_) => panic!("no end of file"),
        };
        assert_eq!(reply.data_len, 0, "closed by the broker after its deadline");
        withdraw(key);
    }

    /// Waits for one record on an existing connection.
    fn exchange_on(conn: &OwnedFd, request: Option<&[u8]>) -> Result<Reply, Failure> {
        if let Some(request) = request {
            send_record(conn.as_raw_fd(), request, &[]).map_err(|e| Failure::Io("send", e))?;
        }
        wait_for(conn.as_raw_fd(), libc::POLLIN, Some(Instant::now() + LONG))?;
        receive_record(conn.as_raw_fd()).map_err(|e| Failure::Io("recv", e))
    }

    #[test]
    fn bad_versions_and_requests_are_answered() {
        let key = fresh_key();
        let ticket = offer(key, memfd(b"v")).unwrap();
        let deadline = || Some(Instant::now() + LONG);
        let status_of = |request: &[u8]| match exchange(&ticket.broker, request, deadline()) {
            Ok(reply) => {
                assert!(reply.fds.is_empty() || reply.status == status::OK);
                reply.status
            }
            Err(_) => panic!("exchange failed"),
        };
        assert_eq!(status_of(&encode_request(PROTOCOL_VERSION, key, &ticket.secret)), status::OK);
        assert_eq!(status_of(&encode_request(2, key, &ticket.secret)), status::BAD_VERSION);
        assert_eq!(status_of(b"GET / HTTP/1.1\r\n\r\n"), status::BAD_REQUEST);
        assert_eq!(status_of(&encode_request(PROTOCOL_VERSION, key, &ticket.secret)[..20]), status::BAD_REQUEST);
        let mut long = encode_request(PROTOCOL_VERSION, key, &ticket.secret).to_vec();
        long.push(0);
        assert_eq!(status_of(&long), status::BAD_REQUEST);
        // A request carrying descriptors: they are dropped by the kernel, the request answered.
        let conn = idle_connection(&ticket.broker);
        let pipe = Pipe::new();
        let request = encode_request(PROTOCOL_VERSION, key, &ticket.secret);
        send_record(conn.as_raw_fd(), &request, &[pipe.write.as_raw_fd()]).unwrap();
        let reply = exchange_on(&conn, None).ok().unwrap();
        assert_eq!((reply.status, reply.fds.len()), (status::OK, 1));
        withdraw(key);
    }

    struct Pipe {
        read: OwnedFd,
        write: OwnedFd,
    }

    impl Pipe {
        fn new() -> Pipe {
            let mut fds = [0; 2];
            // SAFETY: `fds` is a writable array of two descriptors.
            assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) }, 0);
            // SAFETY: both were just returned to us.
            unsafe { Pipe { read: OwnedFd::from_raw_fd(fds[0]), write: OwnedFd::from_raw_fd(fds[1]) } }
        }
    }

    /// True when every write end of the pipe of `read` is closed (end of file, not "empty").
    /// Waits a while: a process that other tests fork holds copies of our descriptors until it
    /// execs (close-on-exec), so a write end can outlive its close here for a moment.
    fn writers_gone(read: &OwnedFd) -> bool {
        let deadline = Instant::now() + LONG;
        loop {
            let mut byte = 0u8;
            // SAFETY: reads at most one byte into `byte`.
            if unsafe { libc::read(read.as_raw_fd(), (&mut byte as *mut u8).cast(), 1) } == 0 {
                return true;
            }
            if wait_for(read.as_raw_fd(), libc::POLLIN, Some(deadline)).is_err() {
                return false;
            }
        }
    }

    /// A fake broker answering one connection with `status` and `fds`.
    fn fake_broker(status: u8, fds: Vec<RawFd>, data: Option<Vec<u8>>) -> (String, std::thread::JoinHandle<()>) {
        let name = unused_name();
        let listener = bind_listener(&name).unwrap();
        let thread = std::thread::spawn(move || {
            wait_for(listener.as_raw_fd(), libc::POLLIN, Some(Instant::now() + LONG)).ok().unwrap();
            let conn = accept(listener.as_raw_fd(), 0).unwrap();
            wait_for(conn.as_raw_fd(), libc::POLLIN, Some(Instant::now() + LONG)).ok().unwrap();
            let request = receive_record(conn.as_raw_fd()).unwrap();
            assert_eq!(request.data_len, 16, "the first 16 bytes of the request");
            let data = data.unwrap_or_else(|| vec![status]);
            send_record(conn.as_raw_fd(), &data, &fds).unwrap();
        });
        (name, thread)
    }

    #[test]
    fn replies_without_exactly_one_descriptor_fail_and_leak_nothing() {
        let cases: [(u8, usize, Option<Vec<u8>>, &str); 5] = [
            (status::OK, 0, None, "carries 0 descriptors instead of one"),
            (status::OK, 2, None, "carries 2 descriptors instead of one"),
            (status::NO_OFFER, 1, None, "offers nothing"),
            (status::OK, 1, Some(vec![0, 0]), "not one status byte"),
            (status::OK, MAX_REPLY_FDS, None, "instead of one"),
        ];
        for (status, count, data, expected) in cases {
            let pipe = Pipe::new();
            let fds = vec![pipe.write.as_raw_fd(); count];
            let (name, thread) = fake_broker(status, fds, data);
            let ticket = Ticket { broker: name, key: 3, secret: [1; 16] };
            let text = fetch(&ticket, LONG).unwrap_err().to_string();
            assert!(text.contains(expected), "{text}");
            thread.join().unwrap();
            let Pipe { read, write } = pipe;
            drop(write);
            assert!(writers_gone(&read), "a received descriptor leaked: {expected}");
        }
    }

    #[test]
    fn a_broker_that_closes_without_reply_is_reported() {
        let name = unused_name();
        let listener = bind_listener(&name).unwrap();
        let thread = std::thread::spawn(move || {
            wait_for(listener.as_raw_fd(), libc::POLLIN, Some(Instant::now() + LONG)).ok().unwrap();
            // Closed at once.
            drop(accept(listener.as_raw_fd(), 0).unwrap());
        });
        let text = fetch(&Ticket { broker: name, key: 3, secret: [1; 16] }, LONG).unwrap_err().to_string();
        assert!(text.contains("without replying"), "{text}");
        thread.join().unwrap();
    }

    #[test]
    fn concurrent_offers_and_fetches() {
        let threads: Vec<_> = (0..8)
            .map(|t| {
                std::thread::spawn(move || {
                    for round in 0..20u32 {
                        let key = fresh_key();
                        let contents = format!("thread {t} round {round}");
                        let ticket = offer(key, memfd(contents.as_bytes())).unwrap();
                        assert_eq!(read_all(&fetch(&ticket, LONG).unwrap()), contents.as_bytes());
                        withdraw(key);
                        assert!(fetch(&ticket, LONG).is_err());
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
    }

    #[test]
    fn the_broker_thread_is_named() {
        let key = fresh_key();
        offer(key, memfd(b"n")).unwrap();
        let names: Vec<String> = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
            .map(|name| name.trim().to_string())
            .collect();
        // comm holds at most 15 bytes.
        assert!(names.iter().any(|name| THREAD_NAME.starts_with(name.as_str()) && name.len() >= 15), "{names:?}");
        withdraw(key);
    }

    // -----------------------------------------------------------------------------------------
    // Across processes: the test binary runs itself, filtered to `cross_process_helper`.

    const HELPER_MODE: &str = "CUDA_MP_FDPASS_HELPER";
    const HELPER_TICKET: &str = "CUDA_MP_FDPASS_TICKET";

    fn ticket_to_text(ticket: &Ticket) -> String {
        format!("{} {} {}", ticket.broker, ticket.key, hex(&ticket.secret))
    }

    fn ticket_from_text(text: &str) -> Ticket {
        let parts: Vec<&str> = text.trim().split(' ').collect();
        let mut secret = [0u8; 16];
        for (i, byte) in secret.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&parts[2][2 * i..2 * i + 2], 16).unwrap();
        }
        Ticket { broker: parts[0].to_string(), key: parts[1].parse().unwrap(), secret }
    }

    /// Runs this test binary's helper in a child process; returns its stdout.
    fn run_helper(mode: &str, ticket: Option<&Ticket>) -> String {
        let module = module_path!();
        let test = format!("{}::cross_process_helper", module.split_once("::").map_or(module, |(_, rest)| rest));
        let mut command = Command::new(std::env::current_exe().unwrap());
        command.args(["--exact", &test, "--nocapture", "--test-threads=1"]).env(HELPER_MODE, mode);
        if let Some(ticket) = ticket {
            command.env(HELPER_TICKET, ticket_to_text(ticket));
        }
        let output = command.output().unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success() && stdout.contains("1 passed"),
            "helper {mode} failed: {}\nstdout:\n{stdout}\nstderr:\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        stdout
    }

    /// The value printed after `tag:` on a line of `stdout`.
    fn printed<'a>(stdout: &'a str, tag: &str) -> &'a str {
        // libtest may print "test <name> ... " on the same line first.
        let prefix = format!("{tag}:");
        let line = stdout.lines().find_map(|line| line.split_once(prefix.as_str()).map(|(_, rest)| rest));
        line.unwrap_or_else(|| panic!("no {tag} in:\n{stdout}"))
    }

    /// Does nothing unless run by `run_helper`.
    #[test]
    fn cross_process_helper() {
        let Ok(mode) = std::env::var(HELPER_MODE) else { return };
        let ticket = std::env::var(HELPER_TICKET).ok().map(|text| ticket_from_text(&text));
        match mode.as_str() {
            "read" => {
                let fd = fetch(ticket.as_ref().unwrap(), LONG).unwrap();
                assert!(is_cloexec(fd.as_raw_fd()));
                let contents = read_all(&fd);
                println!("FDPASS-READ:{}", String::from_utf8_lossy(&contents));
                // Write back through the same file: the parent sees it.
                File::from(fd).write_all_at(b" and back", contents.len() as u64).unwrap();
            }
            "fail" => {
                let err = fetch(ticket.as_ref().unwrap(), LONG).unwrap_err();
                println!("FDPASS-ERROR:{err}");
            }
            "offer-and-exit" => {
                let ticket = offer(7, memfd(b"from a child that exits")).unwrap();
                let fetched = fetch(&ticket, LONG).unwrap();
                assert_eq!(read_all(&fetched), b"from a child that exits");
                println!("FDPASS-TICKET:{}", ticket_to_text(&ticket));
            }
            "exhaust" => exhaust(ticket.as_ref().unwrap()),
            other => panic!("unknown helper mode {other}"),
        }
    }

    /// Fills this process's descriptor table and fetches: with no slot free (the socket cannot
    /// be made) and with exactly one (the socket takes it; the received descriptor cannot be
    /// installed and the kernel truncates the control message).
    fn exhaust(ticket: &Ticket) {
        let highest = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u64>().ok())
            .max()
            .unwrap();
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: `limit` is a writable rlimit.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0);
        limit.rlim_cur = (highest + 32) as libc::rlim_t;
        // SAFETY: lowering the soft limit below the hard one is always allowed.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) }, 0);
        let base = OwnedFd::from(File::open("/dev/null").unwrap());
        let mut fillers = Vec::new();
        loop {
            // SAFETY: duplicates a descriptor we own into a fresh one.
            let fd = unsafe { libc::fcntl(base.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
            if fd < 0 {
                break;
            }
            // SAFETY: just returned to us.
            fillers.push(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        let none_free = fetch(ticket, LONG).unwrap_err();
        fillers.pop();
        let one_free = fetch(ticket, LONG).unwrap_err();
        drop(fillers);
        let fine = fetch(ticket, LONG).unwrap();
        assert_eq!(read_all(&fine).len(), 5);
        println!("FDPASS-NONE-FREE:{none_free}");
        println!("FDPASS-ONE-FREE:{one_free}");
        assert!(matches!(none_free, Error::OutOfDescriptors { .. }));
        assert!(matches!(one_free, Error::OutOfDescriptors { .. }));
    }

    #[test]
    fn a_child_process_fetches_and_reads_then_fails_after_withdraw() {
        let key = fresh_key();
        let fd = memfd(b"written by the parent");
        assert!(is_cloexec(fd.as_raw_fd()), "the child cannot simply inherit it");
        let ticket = offer(key, fd.clone()).unwrap();
        let stdout = run_helper("read", Some(&ticket));
        assert_eq!(printed(&stdout, "FDPASS-READ"), "written by the parent");
        assert_eq!(read_all(&fd), b"written by the parent and back", "the child wrote to the same file");
        withdraw(key);
        let stdout = run_helper("fail", Some(&ticket));
        let error = printed(&stdout, "FDPASS-ERROR");
        assert!(error.contains("malformed") && error.contains("withdrawn"), "{error}");
        // A forged secret from another process.
        let key = fresh_key();
        let mut forged = offer(key, fd.clone()).unwrap();
        forged.secret[0] ^= 0xff;
        let stdout = run_helper("fail", Some(&forged));
        assert!(printed(&stdout, "FDPASS-ERROR").contains("forged"), "{stdout}");
        withdraw(key);
    }

    #[test]
    fn a_ticket_of_an_exited_process_says_so() {
        let stdout = run_helper("offer-and-exit", None);
        let ticket = ticket_from_text(printed(&stdout, "FDPASS-TICKET"));
        let start = Instant::now();
        let text = fetch(&ticket, LONG).unwrap_err().to_string();
        assert!(text.contains("the process that offered it has exited"), "{text}");
        assert!(start.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn a_process_out_of_descriptors_is_told_so() {
        let key = fresh_key();
        let ticket = offer(key, memfd(b"12345")).unwrap();
        let stdout = run_helper("exhaust", Some(&ticket));
        for tag in ["FDPASS-NONE-FREE", "FDPASS-ONE-FREE"] {
            assert!(printed(&stdout, tag).contains("out of file descriptors"), "{stdout}");
        }
        withdraw(key);
    }
}
