//! Typed channels between hosts: a [`RemoteListener`] on a TCP address,
//! [`Sender::connect_remote`] to it. On one host the pair is an ordinary cuda-mp channel
//! (tensors shared, not copied); across hosts messages travel on the TCP connection and GPU
//! bytes by NCCL, behind the same [`Sender`] and [`Receiver`] (a flavor of them, as
//! crossbeam-channel has). See `README.md` here.

mod auth;

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

use auth::{NONCE, PROOF, Role, Secret};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::channel::{Listener, Receiver, RecvFlavor, Refused, Route, SendFlavor, Sender, Watched};
use crate::error::{Error, IoFailure, RecvError, RecvTimeoutError, Result, SendFailure};
use crate::gpu::{Communicator, Device, GpuStorage, UniqueId};
use crate::os::catch_quietly;
use crate::profile::{self, Phase};
use crate::protocol::{self, kind};
use crate::storage::remote::{self as codec, Budget, Incoming, Outgoing};
use crate::sys::tcp;
use crate::wire;

/// The version of the protocol, local and remote; both ends must speak the same.
///
/// ```
/// assert_eq!(cuda_mp::REMOTE_PROTOCOL_VERSION, 13);
/// ```
pub const REMOTE_PROTOCOL_VERSION: u32 = protocol::VERSION;

/// The largest handshake message either end reads.
const HANDSHAKE_BYTES: usize = 64 << 10;

/// Handshakes a listener runs at once, each on a thread of its own; past them a connection
/// waits in the kernel's backlog, unless room is made for it ([`make_room`]).
const MAX_PENDING_HANDSHAKES: usize = 64;
/// Handshakes at once from one source (an IPv4 address, an IPv6 /64): a peer that opens
/// connections and says nothing (it cannot prove the secret) holds no more of them, and
/// others' go on; half the total, so that the ranks of one host (or of hosts behind one
/// address) connect at once.
const MAX_HANDSHAKES_PER_SOURCE: usize = MAX_PENDING_HANDSHAKES / 2;
/// How long a peer has to prove the secret before its handshake may be ended to make room for
/// a connection from a source that runs fewer (a real connector proves it within a round
/// trip or two).
const PROVE_GRACE: Duration = Duration::from_secs(1);

/// The environment variable a remote channel's secret is read from when its options set none.
///
/// ```
/// assert_eq!(cuda_mp::REMOTE_SECRET_ENV, "CUDA_MP_REMOTE_SECRET");
/// ```
pub const REMOTE_SECRET_ENV: &str = "CUDA_MP_REMOTE_SECRET";

/// A frame's header after its length: kind (1), transfers (4), host bytes (8).
const HEADER: usize = 13;
/// What a frame's bytes start with before its payload: the length (4), then the header. A
/// payload is encoded after this many reserved bytes, which [`frame`] fills in.
const HEAD: usize = 4 + HEADER;

/// What a receiver writes back once a message's GPU bytes have arrived: a sender's `send`
/// returns only then, so a sender that exits right after cannot take bytes still on their way
/// (NCCL's send completes when its buffer may be reused, not when the peer has the bytes).
const ACK: u8 = 0x06;

/// Settings of a remote channel's end.
///
/// ```
/// use std::time::Duration;
/// let options = cuda_mp::RemoteOptions::default().device(1).transfer_timeout(Duration::from_secs(5));
/// assert_eq!(options.get_device(), Some(1));
/// ```
#[derive(Debug, Clone)]
pub struct RemoteOptions {
    device: Option<usize>,
    connect_timeout: Duration,
    handshake_timeout: Duration,
    transfer_timeout: Duration,
    max_frame_bytes: usize,
    max_host_bytes: u64,
    max_gpu_bytes: u64,
    max_tensors: u32,
    max_bundle_tensors: u32,
    network_only: bool,
    reuse_memory: bool,
    secret: Option<Secret>,
    allow_unauthenticated: bool,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        RemoteOptions {
            device: Some(0),
            connect_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
            transfer_timeout: Duration::from_secs(120),
            max_frame_bytes: 256 << 20,
            max_host_bytes: 64 << 30,
            max_gpu_bytes: 64 << 30,
            max_tensors: 16 << 10,
            max_bundle_tensors: 1 << 18,
            network_only: false,
            reuse_memory: true,
            secret: std::env::var_os(REMOTE_SECRET_ENV)
                .filter(|v| !v.is_empty())
                .map(|v| Secret::new(std::os::unix::ffi::OsStrExt::as_bytes(v.as_os_str()))),
            allow_unauthenticated: false,
        }
    }
}

impl RemoteOptions {
    /// The GPU (ordinal) on which a receiver allocates the GPU tensors it receives over the
    /// network; 0 by default. A sender's GPU is that of its tensors.
    pub fn device(mut self, ordinal: usize) -> Self {
        self.device = Some(ordinal);
        self
    }

    /// No receiving GPU: a message with GPU tensors, even empty ones, is refused by its sender
    /// (a host-only receiver that should never touch CUDA); its value comes back and the
    /// connection stays open.
    ///
    /// ```
    /// assert_eq!(cuda_mp::RemoteOptions::default().without_device().get_device(), None);
    /// ```
    pub fn without_device(mut self) -> Self {
        self.device = None;
        self
    }

    /// The receiving GPU, if any.
    ///
    /// ```
    /// assert_eq!(cuda_mp::RemoteOptions::default().get_device(), Some(0));
    /// ```
    pub fn get_device(&self) -> Option<usize> {
        self.device
    }

    /// How long [`Sender::connect_remote_with`] tries to reach the listener, retrying while
    /// nobody listens yet (10 s by default).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long either end waits for the other's part of the handshake (10 s by default).
    pub fn handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// How long a message's bytes may take once its frame has started to move, including the
    /// NCCL set-up at the first GPU tensor (120 s by default). Past it the transfer fails, the
    /// NCCL communicator is aborted and the connection is closed.
    pub fn transfer_timeout(mut self, timeout: Duration) -> Self {
        self.transfer_timeout = timeout;
        self
    }

    /// The largest frame (a message's serialized form, tensor bytes excluded) either end
    /// writes or reads: 256 MiB by default. A peer that announces more is refused.
    pub fn max_frame_bytes(mut self, bytes: usize) -> Self {
        self.max_frame_bytes = bytes.min(u32::MAX as usize - HEADER);
        self
    }

    /// The most host-tensor bytes one received message may make this end allocate (64 GiB by
    /// default).
    pub fn max_host_bytes(mut self, bytes: u64) -> Self {
        self.max_host_bytes = bytes;
        self
    }

    /// The most GPU-tensor bytes one received message may make this end allocate (64 GiB by
    /// default): checked tensor by tensor before each allocation. With 0 this end takes no GPU
    /// tensor, as [`without_device`](Self::without_device).
    ///
    /// ```
    /// let options = cuda_mp::RemoteOptions::default().max_gpu_bytes(1 << 30);
    /// # drop(options);
    /// ```
    pub fn max_gpu_bytes(mut self, bytes: u64) -> Self {
        self.max_gpu_bytes = bytes;
        self
    }

    /// The secret both ends must prove before anything else of the handshake is read (at least
    /// 16 bytes; 32 random bytes are a good one). Without this, the secret is read from the
    /// environment variable [`REMOTE_SECRET_ENV`] when it is set. Each end proves it with an
    /// HMAC-SHA256 of fresh nonces: a peer without it is refused before its hello is parsed,
    /// and a sender with a secret sends nothing to a listener that cannot prove it. The secret
    /// authenticates the peers when they connect; it neither encrypts nor authenticates the
    /// bytes that follow (see `src/net/README.md`, "Threat model").
    ///
    /// ```
    /// let options = cuda_mp::RemoteOptions::default().secret(b"0123456789abcdef0123456789abcdef");
    /// assert!(options.has_secret());
    /// ```
    pub fn secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.secret = Some(Secret::new(secret.as_ref()));
        self
    }

    /// Whether a secret is set (here or by [`REMOTE_SECRET_ENV`]).
    pub fn has_secret(&self) -> bool {
        self.secret.is_some()
    }

    /// Lets a listener without a secret bind addresses other than loopback, and a sender
    /// without one connect to them (off by default): any host that reaches the port may then
    /// connect, and whoever answers on it gets what a sender sends. For a network where every
    /// host is trusted.
    ///
    /// ```
    /// let options = cuda_mp::RemoteOptions::default().allow_unauthenticated(true);
    /// # drop(options);
    /// ```
    pub fn allow_unauthenticated(mut self, yes: bool) -> Self {
        self.allow_unauthenticated = yes;
        self
    }

    /// The most tensors one received message may hold (16,384 by default): each host tensor
    /// received is a shared-memory descriptor of this process.
    pub fn max_tensors(mut self, tensors: u32) -> Self {
        self.max_tensors = tensors;
        self
    }

    /// The most tensors a received [`Bundle`](crate::Bundle) may hold (262,144 by default):
    /// its table is read on the CPU, some 200 bytes of host memory a tensor, before anything
    /// else of it. Checked where the bundle arrives.
    ///
    /// ```
    /// let options = cuda_mp::RemoteOptions::default().max_bundle_tensors(1 << 20);
    /// # drop(options);
    /// ```
    pub fn max_bundle_tensors(mut self, tensors: u32) -> Self {
        self.max_bundle_tensors = tensors;
        self
    }

    /// Takes the network route even when both ends are on one host: how two processes of one
    /// machine stand in for two hosts (tests, benchmarks). Either end may ask.
    pub fn network_only(mut self, yes: bool) -> Self {
        self.network_only = yes;
        self
    }

    /// Whether a receiver receives GPU tensors into the memory of the previous message's,
    /// once nothing holds that any more (on by default), as a caching allocator would: a
    /// steady stream of same-sized messages (weights at every step) then costs no allocation
    /// and no free on the receiving GPU. The receiver keeps a handle on the last GPU message's
    /// storages until the next message with GPU tensors is decoded (or the receiver is dropped),
    /// so a dropped message's memory goes back to the driver only then, and a reused storage
    /// keeps its `storage_id`; `false` frees it when its last tensor is dropped.
    ///
    /// Memory is reused only when no tensor of this process holds it and it was never sent on
    /// to another process; a message shaped otherwise lets every kept storage go before it
    /// allocates. cuda-mp's own work on a received tensor is ordered before the next transfer
    /// (the device's stream; a copy to another GPU returns once done); work of another library
    /// that reads it on its own stream must be finished before the last handle is dropped, as
    /// with any caching allocator. See "Reusing GPU memory" in `src/net/README.md`.
    ///
    /// ```
    /// let options = cuda_mp::RemoteOptions::default().reuse_memory(false);
    /// assert!(!options.get_reuse_memory());
    /// ```
    pub fn reuse_memory(mut self, yes: bool) -> Self {
        self.reuse_memory = yes;
        self
    }

    /// Whether a receiver reuses dropped messages' GPU memory.
    pub fn get_reuse_memory(&self) -> bool {
        self.reuse_memory
    }
}

/// What makes two ends "one host": the same kernel boot and the same IPC and mount namespaces
/// (CUDA IPC and our Unix sockets need both).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct HostIdentity {
    boot_id: String,
    namespaces: Vec<String>,
}

fn host_identity() -> HostIdentity {
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default().trim().to_string();
    let namespaces = ["ipc", "mnt"]
        .iter()
        .map(|ns| {
            std::fs::read_link(format!("/proc/self/ns/{ns}")).map(|p| p.display().to_string()).unwrap_or_default()
        })
        .collect();
    HostIdentity { boot_id, namespaces }
}

impl HostIdentity {
    fn is_known(&self) -> bool {
        !self.boot_id.is_empty() && self.namespaces.iter().all(|n| !n.is_empty())
    }
}

/// What a remote hello adds to the shared one (`src/protocol.rs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Remote {
    host: HostIdentity,
    network_only: bool,
}

type Hello = protocol::Hello<Remote>;

#[derive(Serialize, Deserialize)]
enum Welcome {
    Refused(String),
    /// Connect to this local listener instead.
    SameHost(String),
    /// Messages go on this connection, within the receiver's limits.
    Network(Limits),
}

/// What a receiver takes in one message: the sender checks before it writes, so a message
/// over them fails with its value back and the connection stays open.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Limits {
    frame_bytes: u64,
    host_bytes: u64,
    gpu_bytes: u64,
    tensors: u32,
}

impl Limits {
    /// A receiver's limits; one without a GPU takes no GPU tensor (it would refuse one, even
    /// an empty one, and close the connection).
    fn of(options: &RemoteOptions) -> Limits {
        Limits {
            frame_bytes: options.max_frame_bytes as u64,
            host_bytes: options.max_host_bytes,
            gpu_bytes: if options.device.is_some() { options.max_gpu_bytes } else { 0 },
            tensors: options.max_tensors,
        }
    }

    /// Whether a message of `frame` bytes and `tensors` tensors, `host` bytes of them host
    /// tensors' and `gpu` GPU tensors' (`None`: it has none), is within these limits. A
    /// receiver that takes no GPU bytes takes no GPU tensor.
    fn check(&self, frame: u64, tensors: u64, host: u64, gpu: Option<u64>) -> std::result::Result<(), SendFailure> {
        let over = |what: &str, have: u64, limit: u64| {
            Err(SendFailure::Serialize(format!(
                "the message has {have} {what}; the receiver takes at most {limit} (its RemoteOptions)"
            )))
        };
        if frame > self.frame_bytes {
            return over("bytes of frame", frame, self.frame_bytes);
        }
        if tensors > u64::from(self.tensors) {
            return over("tensors", tensors, u64::from(self.tensors));
        }
        if host > self.host_bytes {
            return over("bytes of host tensors", host, self.host_bytes);
        }
        match gpu {
            Some(_) if self.gpu_bytes == 0 => Err(SendFailure::Serialize(
                "the message has GPU tensors; the receiver takes none (it has no GPU, or its max_gpu_bytes is 0)"
                    .into(),
            )),
            Some(gpu) if gpu > self.gpu_bytes => over("bytes of GPU tensors", gpu, self.gpu_bytes),
            _ => Ok(()),
        }
    }
}

/// The connector's first message: the magic and version (read first, as in every version),
/// and its nonce.
#[derive(Serialize, Deserialize)]
struct Greeting {
    magic: [u8; 8],
    version: u32,
    nonce: [u8; NONCE],
}

impl Greeting {
    fn new(nonce: [u8; NONCE]) -> Greeting {
        Greeting { magic: protocol::MAGIC, version: protocol::VERSION, nonce }
    }

    /// A greeting that arrived: the magic and version checked before the nonce is read.
    fn decode(bytes: &[u8]) -> std::result::Result<[u8; NONCE], protocol::Refusal> {
        let rest = protocol::check_version(bytes)?;
        postcard::from_bytes::<[u8; NONCE]>(rest).map_err(|_| protocol::Refusal::Foreign)
    }
}

/// The listener's answer to a greeting: a refusal, or its nonce and, if it holds a secret, its
/// proof of it.
#[derive(Serialize, Deserialize)]
enum Challenge {
    Refused(String),
    Prove { nonce: [u8; NONCE], proof: Option<[u8; PROOF]> },
}

/// The connector's proof of the secret, if it holds one.
#[derive(Serialize, Deserialize)]
struct Response {
    proof: Option<[u8; PROOF]>,
}

#[derive(Serialize, Deserialize)]
enum Joined {
    Yes,
    No(String),
}

fn malformed(what: &str, e: impl fmt::Display) -> Error {
    Error::Malformed(format!("{what}: {e}"))
}

fn io_error(e: io::Error, waiting_for: &str, timeout: Duration) -> Error {
    if e.kind() == io::ErrorKind::TimedOut {
        Error::Timeout(timeout)
    } else if e.kind() == io::ErrorKind::UnexpectedEof {
        Error::Malformed(format!("the peer closed the connection during {waiting_for}"))
    } else {
        Error::Io(e)
    }
}

fn write_handshake<M: Serialize>(stream: &TcpStream, message: &M, timeout: Duration) -> Result<()> {
    write_handshake_bytes(stream, postcard::to_allocvec(message).map_err(|e| malformed("handshake", e))?, timeout)
}

/// A handshake message's bytes, length-prefixed.
fn write_handshake_bytes(stream: &TcpStream, body: Vec<u8>, timeout: Duration) -> Result<()> {
    write_handshake_frame(stream, &body, timeout).map_err(|e| io_error(e, "the handshake", timeout))
}

/// Writes `body` length-prefixed, as every handshake message is.
fn write_handshake_frame(stream: &TcpStream, body: &[u8], timeout: Duration) -> io::Result<()> {
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(body);
    tcp::write_all(stream, &frame, crate::os::instant_after(timeout))
}

/// Reads the next length-prefixed handshake message; `Ok(None)` when the peer closed first.
fn read_handshake_frame(stream: &TcpStream, timeout: Duration) -> io::Result<Option<Vec<u8>>> {
    FrameReader::new(HANDSHAKE_BYTES, None).read(stream, Some(crate::os::instant_after(timeout)))
}

/// Sends a connector's greeting and reads the listener's challenge; `None` when the listener
/// closed the connection unanswered (it runs its most handshakes at once, and makes room for
/// later ones).
fn greet(stream: &TcpStream, ours: [u8; NONCE], timeout: Duration) -> Result<Option<Challenge>> {
    let closed = |e: &io::Error| {
        use io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
        matches!(e.kind(), ConnectionReset | BrokenPipe | ConnectionAborted | UnexpectedEof)
    };
    let body = postcard::to_allocvec(&Greeting::new(ours)).map_err(|e| malformed("handshake", e))?;
    match write_handshake_frame(stream, &body, timeout) {
        Ok(()) => {}
        Err(e) if closed(&e) => return Ok(None),
        Err(e) => return Err(io_error(e, "the handshake", timeout)),
    }
    match read_handshake_frame(stream, timeout) {
        Ok(Some(body)) => postcard::from_bytes(&body).map(Some).map_err(|e| malformed("undecodable handshake", e)),
        Ok(None) => Ok(None),
        Err(e) if closed(&e) => Ok(None),
        Err(e) => Err(io_error(e, "the handshake", timeout)),
    }
}

fn read_handshake<M: DeserializeOwned>(stream: &TcpStream, timeout: Duration) -> Result<M> {
    postcard::from_bytes(&read_handshake_bytes(stream, timeout)?).map_err(|e| malformed("undecodable handshake", e))
}

/// The next handshake message's bytes.
fn read_handshake_bytes(stream: &TcpStream, timeout: Duration) -> Result<Vec<u8>> {
    match read_handshake_frame(stream, timeout) {
        Ok(Some(body)) => Ok(body),
        Ok(None) => Err(Error::Malformed("the peer closed the connection during the handshake".into())),
        Err(e) => Err(io_error(e, "the handshake", timeout)),
    }
}

/// Reads length-prefixed frames; a read that times out keeps what it read for the next one.
#[derive(Debug)]
struct FrameReader {
    max: usize,
    prefix: [u8; 4],
    prefix_filled: usize,
    body: Vec<u8>,
    body_len: Option<usize>,
    /// How long a frame that has begun may stall (no byte coming) before the peer is taken
    /// for stopped, whatever the caller's own limit: `None` for none.
    stall: Option<Duration>,
    /// When the frame being read last got bytes: a stall is counted from there, across reads
    /// (a receiver that polls with short limits would otherwise never see one).
    progress: Option<Instant>,
}

impl FrameReader {
    fn new(max: usize, stall: Option<Duration>) -> FrameReader {
        FrameReader { max, prefix: [0; 4], prefix_filled: 0, body: Vec::new(), body_len: None, stall, progress: None }
    }

    /// Reads some bytes into `into`: until the caller's `deadline`, and once a frame has begun
    /// no longer than its stall allows, then an error that is not a timeout (the connection
    /// goes).
    fn read_some(&self, socket: &TcpStream, into: &mut [u8], deadline: Option<Instant>) -> io::Result<usize> {
        let begun = self.prefix_filled > 0 || self.body_len.is_some();
        let Some(stall) = self.stall.filter(|_| begun) else { return tcp::read_some(socket, into, deadline) };
        let stalled_at =
            self.progress.and_then(|p| p.checked_add(stall)).unwrap_or_else(|| crate::os::instant_after(stall));
        match tcp::read_some(socket, into, Some(deadline.map_or(stalled_at, |d| d.min(stalled_at)))) {
            Err(e) if e.kind() == io::ErrorKind::TimedOut && deadline.is_none_or(|d| stalled_at < d) => {
                Err(io::Error::other(format!("the peer stopped inside a frame for {stall:?}")))
            }
            other => other,
        }
    }

    /// The next frame's body; `None` when the stream ended between frames. `TimedOut` keeps
    /// the partial frame; `UnexpectedEof` is a stream that ended inside one; `InvalidData` a
    /// frame over the limit.
    fn read(&mut self, socket: &TcpStream, deadline: Option<Instant>) -> io::Result<Option<Vec<u8>>> {
        while self.body_len.is_none() {
            let filled = self.prefix_filled;
            let mut prefix = self.prefix;
            let n = self.read_some(socket, &mut prefix[filled..], deadline)?;
            self.prefix = prefix;
            self.progress = Some(Instant::now());
            if n == 0 {
                if self.prefix_filled == 0 {
                    return Ok(None);
                }
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the stream ended inside a frame's length"));
            }
            self.prefix_filled += n;
            if self.prefix_filled == 4 {
                let len = u32::from_le_bytes(self.prefix) as usize;
                if len > self.max {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("the peer announced a frame of {len} bytes; the limit is {}", self.max),
                    ));
                }
                self.body_len = Some(len);
                self.body = Vec::with_capacity(len.min(1 << 20));
            }
        }
        let len = self.body_len.expect("set above");
        while self.body.len() < len {
            let start = self.body.len();
            let want = (len - start).min(1 << 20);
            self.body.resize(start + want, 0);
            let mut body = std::mem::take(&mut self.body);
            let n = self.read_some(socket, &mut body[start..], deadline);
            self.body = body;
            let n = match n {
                Ok(n) => n,
                Err(e) => {
                    self.body.truncate(start);
                    return Err(e);
                }
            };
            self.body.truncate(start + n);
            self.progress = Some(Instant::now());
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("the stream ended inside a frame of {len} bytes"),
                ));
            }
        }
        self.prefix_filled = 0;
        self.body_len = None;
        self.progress = None;
        Ok(Some(std::mem::take(&mut self.body)))
    }
}

/// A frame: its length, its header, then its payload (encoded after [`HEAD`] reserved bytes).
fn frame(mut payload: Vec<u8>, kind: u8, transfers: u32, host_bytes: u64) -> Vec<u8> {
    let len = (payload.len() - 4) as u32;
    payload[..4].copy_from_slice(&len.to_le_bytes());
    payload[4] = kind;
    payload[5..9].copy_from_slice(&transfers.to_le_bytes());
    payload[9..HEAD].copy_from_slice(&host_bytes.to_le_bytes());
    payload
}

/// A frame's body (after its length) split into its header and payload.
fn parse_frame(body: &[u8]) -> Result<(&[u8], u8, u32, u64)> {
    if body.len() < HEADER {
        return Err(Error::Malformed(format!("a frame of {} bytes is shorter than its header", body.len())));
    }
    let (header, payload) = body.split_at(HEADER);
    let kind = header[0];
    let transfers = u32::from_le_bytes(header[1..5].try_into().expect("4 bytes"));
    let host_bytes = u64::from_le_bytes(header[5..13].try_into().expect("8 bytes"));
    Ok((payload, kind, transfers, host_bytes))
}

/// Checks the end's secret; without one, refuses an address other than loopback unless
/// [`RemoteOptions::allow_unauthenticated`] (`only` and `reach` say what the end does with
/// the addresses, in the error).
fn secret_or_loopback(options: &RemoteOptions, addrs: &[SocketAddr], only: &str, reach: &str) -> Result<()> {
    if let Some(secret) = &options.secret {
        return secret.check();
    }
    match addrs.iter().find(|a| !a.ip().is_loopback()) {
        Some(open) if !options.allow_unauthenticated => Err(Error::Unsupported(format!(
            "a remote {only} loopback addresses, not {open}: set RemoteOptions::secret (or \
             {REMOTE_SECRET_ENV}) on both ends, or RemoteOptions::allow_unauthenticated(true) where \
             every host that can {reach} the port is trusted"
        ))),
        _ => Ok(()),
    }
}

fn resolve(addr: impl ToSocketAddrs) -> Result<Vec<SocketAddr>> {
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs()?.collect();
    if addrs.is_empty() {
        return Err(Error::Io(io::Error::new(io::ErrorKind::InvalidInput, "the address resolves to nothing")));
    }
    Ok(addrs)
}

/// Listens on a TCP address for senders of `T` ([`Sender::connect_remote`]): each accepted
/// connection is one [`Receiver`].
///
/// ```
/// let listener = cuda_mp::RemoteListener::<String>::bind("127.0.0.1:0").unwrap();
/// let addr = listener.local_addr().unwrap();
/// // The handshake needs both ends: accept on one thread, connect on another.
/// let accepting = std::thread::spawn(move || listener.accept().unwrap());
/// let tx = cuda_mp::Sender::<String>::connect_remote(addr).unwrap();
/// let rx = accepting.join().unwrap();
/// tx.send("hello".into()).unwrap();
/// assert_eq!(rx.recv().unwrap(), "hello");
/// ```
pub struct RemoteListener<T> {
    listener: TcpListener,
    options: RemoteOptions,
    /// Handshakes that ended, for `accept` to hand out in order.
    done: Mutex<mpsc::Receiver<Result<Receiver<T>>>>,
    done_tx: mpsc::Sender<Result<Receiver<T>>>,
    /// Handshakes running.
    pending: Arc<AtomicUsize>,
    /// Handshakes running, by the source they come from.
    by_source: Arc<Mutex<BySource>>,
}

/// Running handshakes by source (`source_of`), each with what making room for another needs.
type BySource = HashMap<IpAddr, Vec<Running>>;

/// A running handshake, as its listener keeps it.
struct Running {
    id: u64,
    started: Instant,
    /// Set once the peer has proven the secret (or, without one, answered the challenge).
    proven: Arc<AtomicBool>,
    /// A copy of its connection, to shut down when it is ended to make room (`None` once it
    /// was).
    stream: Option<TcpStream>,
}

impl Running {
    /// Whether it may be ended to make room: it has had its grace and proven nothing.
    fn evictable(&self, now: Instant) -> bool {
        self.stream.is_some() && !self.proven.load(Ordering::Acquire) && now >= self.started + PROVE_GRACE
    }
}

/// The source a connection is counted under: its IPv4 address, or its IPv6 /64 (a host is
/// given a whole /64, so counting its addresses one by one would count nothing).
fn source_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from(u128::from(v6) & !((1u128 << 64) - 1))),
        },
        v4 => v4,
    }
}

impl<T> fmt::Debug for RemoteListener<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteListener").field("addr", &self.listener.local_addr().ok()).finish_non_exhaustive()
    }
}

impl<T: Serialize + DeserializeOwned + 'static> RemoteListener<T> {
    /// Listens on `addr` (port 0 picks a free port) with the default options.
    pub fn bind(addr: impl ToSocketAddrs) -> Result<RemoteListener<T>> {
        Self::bind_with(addr, RemoteOptions::default())
    }

    /// Listens on `addr` with `options` (the receiving GPU, timeouts, limits, the secret).
    ///
    /// Without a secret (neither [`RemoteOptions::secret`] nor [`REMOTE_SECRET_ENV`]) only a
    /// loopback address may be bound, unless [`RemoteOptions::allow_unauthenticated`] says
    /// otherwise: any host that reaches the port could connect.
    ///
    /// ```
    /// let err = cuda_mp::RemoteListener::<u8>::bind_with("0.0.0.0:0", cuda_mp::RemoteOptions::default());
    /// # if std::env::var_os(cuda_mp::REMOTE_SECRET_ENV).is_none() {
    /// assert!(err.unwrap_err().to_string().contains("without a secret"));
    /// # }
    /// ```
    pub fn bind_with(addr: impl ToSocketAddrs, options: RemoteOptions) -> Result<RemoteListener<T>> {
        let addrs = resolve(addr)?;
        secret_or_loopback(&options, &addrs, "listener without a secret binds only", "reach")?;
        let listener = TcpListener::bind(&addrs[..])?;
        listener.set_nonblocking(true)?;
        let (done_tx, done) = mpsc::channel();
        Ok(RemoteListener {
            listener,
            options,
            done: Mutex::new(done),
            done_tx,
            pending: Arc::new(AtomicUsize::new(0)),
            by_source: Arc::default(),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.listener.local_addr()?)
    }

    /// Waits for a sender and completes the handshake with it.
    ///
    /// Each connection's handshake runs on a thread of its own (at most 64 at once), so a peer
    /// that is slow or says nothing holds up no other; `accept` returns the first handshake
    /// that ends. A peer that does not prove the secret, is not a cuda-mp sender of `T` or of
    /// this protocol version gets a refusal and this returns [`Error::Unsupported`] or
    /// [`Error::Malformed`]; the listener goes on listening.
    pub fn accept(&self) -> Result<Receiver<T>> {
        self.accept_until(None)
    }

    /// Like [`accept`](Self::accept), giving up after `timeout` ([`Error::Timeout`]).
    ///
    /// ```
    /// use std::time::Duration;
    /// let listener = cuda_mp::RemoteListener::<u8>::bind("127.0.0.1:0").unwrap();
    /// assert!(listener.accept_timeout(Duration::from_millis(20)).unwrap_err().is_timeout());
    /// ```
    pub fn accept_timeout(&self, timeout: Duration) -> Result<Receiver<T>> {
        self.accept_until(Some((crate::os::instant_after(timeout), timeout)))
    }

    fn accept_until(&self, deadline: Option<(Instant, Duration)>) -> Result<Receiver<T>> {
        // While handshakes run, the listener is watched in slices so that one that ends is seen.
        const SLICE: Duration = Duration::from_millis(2);
        // Another thread accepting holds this for its wait: a limited accept waits for it no
        // longer than its limit.
        let done = match lock_within(&self.done, deadline.map(|d| Some(d.0))) {
            Some(done) => done,
            None => return Err(Error::Timeout(deadline.map_or(Duration::ZERO, |d| d.1))),
        };
        loop {
            // Read before the results: a handshake counts itself out only after it sent its result.
            let running = self.pending.load(Ordering::Acquire);
            if let Ok(result) = done.try_recv() {
                return result;
            }
            // A handshake started in this pass may end (or fail to start) before the count
            // below is read: it is watched for all the same.
            let mut started = false;
            loop {
                // At the most handshakes at once, later connections wait in the kernel's
                // backlog (accepted as running ones end) rather than being closed unanswered,
                // unless a handshake may be ended to make room.
                if self.pending.load(Ordering::Acquire) >= MAX_PENDING_HANDSHAKES && !self.may_make_room() {
                    break;
                }
                match self.listener.accept() {
                    Ok((stream, _)) => {
                        self.start_handshake(stream);
                        started = true;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(Error::Io(e)),
                }
            }
            let now = Instant::now();
            if let Some((at, timeout)) = deadline
                && now >= at
            {
                return Err(Error::Timeout(timeout));
            }
            let wait_until = match (running > 0 || started, deadline) {
                (true, Some((at, _))) => Some(at.min(now + SLICE)),
                (true, None) => Some(now + SLICE),
                (false, d) => d.map(|d| d.0),
            };
            if self.pending.load(Ordering::Acquire) >= MAX_PENDING_HANDSHAKES && !self.may_make_room() {
                // The backlog is not taken now: the listener would read as ready at once.
                if let Some(until) = wait_until {
                    std::thread::sleep(until.saturating_duration_since(Instant::now()));
                }
                continue;
            }
            match tcp::stream_wait(&self.listener, rustix::event::PollFlags::IN, wait_until) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::TimedOut => {}
                Err(e) => return Err(Error::Io(e)),
            }
        }
    }

    /// Whether a running handshake may be ended to make room for a new connection.
    fn may_make_room(&self) -> bool {
        let now = Instant::now();
        lock(&self.by_source).values().flatten().any(|r| r.evictable(now))
    }

    /// Runs the handshake of a new connection on a thread of its own. At the most handshakes
    /// at once, it makes room by ending the oldest handshake that may be ended (no proof
    /// within [`PROVE_GRACE`]) of the source that runs the most, when that is more than the
    /// new connection's source runs; else the new connection is closed unanswered. So
    /// connections that never prove the secret, from however few sources, keep no sender
    /// that proves it in time out: each new one from a flooding source ends another of its
    /// own kind, or is closed.
    fn start_handshake(&self, stream: TcpStream) {
        let source = stream.peer_addr().map(|a| source_of(a.ip())).ok();
        let proven = Arc::new(AtomicBool::new(false));
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        if let Some(source) = source {
            let mut by_source = lock(&self.by_source);
            let running = by_source.get(&source).map_or(0, Vec::len);
            if running >= MAX_HANDSHAKES_PER_SOURCE {
                // At its source's cap: the source's oldest handshake that had its grace and
                // proved nothing makes room (a sender behind the same address as a flood, or
                // on the same host, gets in), else the connection is closed unanswered (one
                // source's idle connections keep no other sender out).
                if !end_oldest_unproven(by_source.get_mut(&source).into_iter().flatten()) {
                    return;
                }
            } else if self.pending.load(Ordering::Acquire) >= MAX_PENDING_HANDSHAKES
                && !make_room(&mut by_source, running)
            {
                return;
            }
            let copy = stream.try_clone().ok();
            let started = Instant::now();
            by_source.entry(source).or_default().push(Running { id, started, proven: proven.clone(), stream: copy });
        }
        self.pending.fetch_add(1, Ordering::AcqRel);
        let (options, done) = (self.options.clone(), self.done_tx.clone());
        // Counted out however the thread ends (after its result is sent), or if it never runs.
        let counted = CountedOut(self.pending.clone(), source.map(|source| (self.by_source.clone(), source, id)));
        let failed = done.clone();
        let started = std::thread::Builder::new().name("cuda-mp-handshake".into()).spawn(move || {
            let _counted = counted;
            let peer = stream.peer_addr().ok();
            // A handshake that panicked still gives `accept` an answer, so that it never waits
            // for a result that no thread will send.
            let result = crate::os::catch_quietly(|| handshake::<T>(stream, &options, &proven))
                .unwrap_or_else(|why| {
                    Err(Error::Io(io::Error::other(format!("the handshake with a remote peer panicked: {why}"))))
                })
                // Each step waits what is left of the limit: the limit is what ran out.
                .map_err(|e| if e.is_timeout() { Error::Timeout(options.handshake_timeout) } else { e });
            match &result {
                Ok(_) => tracing::debug!(peer = ?peer, "accepted a remote sender"),
                Err(e) => tracing::warn!(peer = ?peer, error = %e, "refused a remote peer"),
            }
            // The listener's copy of the connection goes before the receiver is handed out:
            // the receiver then holds the connection's only descriptor.
            _counted.forget_copy();
            let _ = done.send(result);
        });
        if let Err(e) = started {
            // The closure was dropped unrun, and the count with it.
            let _ = failed.send(Err(Error::Io(e)));
        }
    }
}

/// Ends the oldest handshake that may be ended of the source that runs the most, if it runs
/// more than `running` (what the new connection's source runs); false when none may be.
fn make_room(by_source: &mut BySource, running: usize) -> bool {
    let now = Instant::now();
    by_source
        .values_mut()
        .filter(|hs| hs.len() > running && hs.iter().any(|r| r.evictable(now)))
        .max_by_key(|hs| hs.len())
        .is_some_and(|hs| end_oldest_unproven(hs.iter_mut()))
}

/// Ends the oldest of `running` that may be ended (no proof within its grace); false when none
/// may be.
fn end_oldest_unproven<'a>(running: impl IntoIterator<Item = &'a mut Running>) -> bool {
    let now = Instant::now();
    let Some(victim) = running.into_iter().filter(|r| r.evictable(now)).min_by_key(|r| r.started) else {
        return false;
    };
    // Its thread's next read fails, and it counts itself out.
    if let Some(stream) = victim.stream.take() {
        let _ = stream.shutdown(std::net::Shutdown::Both);
    }
    tracing::debug!("ended a handshake that proved nothing, to make room for another");
    true
}

/// Takes one running handshake off a listener's counts (all, and its source's) when dropped.
struct CountedOut(Arc<AtomicUsize>, Option<(Arc<Mutex<BySource>>, IpAddr, u64)>);

impl CountedOut {
    /// Closes the listener's copy of the connection (kept to end the handshake to make room).
    fn forget_copy(&self) {
        if let Some((by_source, source, id)) = &self.1
            && let Some(running) = lock(by_source).get_mut(source)
        {
            running.iter_mut().filter(|r| r.id == *id).for_each(|r| r.stream = None);
        }
    }
}

impl Drop for CountedOut {
    fn drop(&mut self) {
        if let Some((by_source, source, id)) = &self.1 {
            let mut by_source = lock(by_source);
            if let Some(running) = by_source.get_mut(source) {
                running.retain(|r| r.id != *id);
                if running.is_empty() {
                    by_source.remove(source);
                }
            }
        }
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The listener's side of one connection's handshake.
fn handshake<T: Serialize + DeserializeOwned>(
    stream: TcpStream,
    options: &RemoteOptions,
    proven: &AtomicBool,
) -> Result<Receiver<T>> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    let timeout = options.handshake_timeout;
    // One limit for all a peer says before it has proven the secret (the greeting and the
    // response): a silent peer holds a handshake for no longer than that.
    let proven_by = crate::os::instant_after(timeout);
    let left = || proven_by.saturating_duration_since(Instant::now());
    // The secret first: nothing else of a peer is read before it has proven it.
    let theirs = match Greeting::decode(&read_handshake_bytes(&stream, left())?) {
        Ok(nonce) => nonce,
        Err(refusal) => {
            let _ = write_handshake(&stream, &Challenge::Refused(refusal.reason()), timeout);
            return Err(refusal.error());
        }
    };
    let ours = auth::nonce()?;
    let secret = options.secret.as_ref();
    let proof = secret.map(|s| s.prove(Role::Listener, &theirs, &ours));
    write_handshake(&stream, &Challenge::Prove { nonce: ours, proof }, left())?;
    let response = read_handshake::<Response>(&stream, left())?;
    let refuse = |told: String, error: Error| {
        let _ = write_handshake(&stream, &Welcome::Refused(told), timeout);
        Err(error)
    };
    if let Some(secret) = secret
        && !response.proof.is_some_and(|p| secret.verify(Role::Connector, &ours, &theirs, &p))
    {
        return refuse(
            "authentication failed".into(),
            Error::Unsupported("refused a peer that did not prove the shared secret".into()),
        );
    }
    // Without a secret nothing a peer says proves anything: it keeps its first limit for the
    // whole handshake, and may be ended to make room until it is done.
    if secret.is_some() {
        proven.store(true, Ordering::Release);
    }
    let limit = || if secret.is_some() { timeout } else { left() };
    let hello = match Hello::decode(&read_handshake_bytes(&stream, limit())?) {
        Ok(hello) => hello,
        Err(refusal) => return refuse(refusal.reason(), refusal.error()),
    };
    let here = std::any::type_name::<T>();
    if !hello.sends::<T>() {
        let why = format!("the listener receives {here}, the sender sends {}", hello.message);
        // Type names are for a peer that proved the secret.
        let told = if secret.is_some() { why.clone() } else { "the listener receives another message type".into() };
        return refuse(told, Error::Unsupported(why));
    }
    let identity = host_identity();
    let same_host =
        !hello.extra.network_only && !options.network_only && identity.is_known() && hello.extra.host == identity;
    if same_host {
        let local = Listener::<T>::bind()?;
        write_handshake(&stream, &Welcome::SameHost(local.name().to_string()), timeout)?;
        // `No`: the sender could not reach the local listener (another mount namespace, say):
        // the network route serves instead.
        if let Joined::Yes = read_handshake::<Joined>(&stream, limit())? {
            return local.accept_timeout(limit());
        }
    }
    write_handshake(&stream, &Welcome::Network(Limits::of(options)), timeout)?;
    let stream = Arc::new(stream);
    let net = NetReceiver {
        reader: FrameReader::new(options.max_frame_bytes.saturating_add(HEADER), Some(options.transfer_timeout)),
        stream: stream.clone(),
        comm: None,
        spare: VecDeque::new(),
        options: options.clone(),
        broken: false,
    };
    Ok(Receiver::remote(Box::new(NetReceiverEnd { net: Mutex::new(net), stream })))
}

/// How a [`Sender`] of a connection to another host sends: when `send` returns, and how clones
/// share the connection: README.md here ("Frames and transfers": Completion, Acknowledgement).
struct NetSenderEnd {
    net: Mutex<NetSender>,
}

struct NetSender {
    stream: TcpStream,
    comm: Option<Communicator>,
    options: RemoteOptions,
    /// The receiver's limits.
    peer: Limits,
    broken: bool,
}

fn lock<S>(m: &Mutex<S>) -> MutexGuard<'_, S> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `m` locked, waiting as a send may (`None`: without limit, `Some(None)`: not at all, else
/// until the deadline); `None` when it could not be had in time.
fn lock_within<S>(m: &Mutex<S>, wait: Option<Option<Instant>>) -> Option<MutexGuard<'_, S>> {
    loop {
        match m.try_lock() {
            Ok(guard) => return Some(guard),
            Err(std::sync::TryLockError::Poisoned(p)) => return Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => match wait {
                None => return Some(lock(m)),
                Some(Some(d)) if Instant::now() < d => std::thread::sleep(Duration::from_micros(200)),
                Some(_) => return None,
            },
        }
    }
}

impl<T: Serialize> SendFlavor<T> for NetSenderEnd {
    fn send(&self, value: &T, wait: Option<Option<Instant>>) -> std::result::Result<(), Refused> {
        let no_room = || if matches!(wait, Some(None)) { Refused::Full } else { Refused::Timeout };
        // Another thread's send holds the connection; then the kernel's buffer must take bytes.
        let mut net = lock_within(&self.net, wait).ok_or_else(no_room)?;
        if let Some(deadline) = wait
            && !net.broken
        {
            let writable = tcp::stream_wait(
                &net.stream,
                rustix::event::PollFlags::OUT,
                Some(deadline.unwrap_or_else(Instant::now)),
            );
            if matches!(&writable, Err(e) if e.kind() == io::ErrorKind::TimedOut) {
                return Err(no_room());
            }
        }
        net.send(value).map_err(Refused::Failed)
    }

    fn route(&self) -> Route {
        Route::Network
    }
}

fn net_sender<T: Serialize + 'static>(stream: TcpStream, options: RemoteOptions, peer: Limits) -> Sender<T> {
    let net = NetSender { stream, comm: None, options, peer, broken: false };
    Sender::remote(Arc::new(NetSenderEnd { net: Mutex::new(net) }))
}

impl<T: Serialize + DeserializeOwned + 'static> Sender<T> {
    /// Connects to a [`RemoteListener`] of `T` at `addr` with the default options. Returns
    /// once the listener has accepted: the handshake needs both ends.
    ///
    /// On one host the channel is an ordinary one ([`Route::SameHost`]); to another host its
    /// messages travel on the connection ([`Route::Network`]): `send` returns once the message
    /// has left (host bytes written to the connection; GPU bytes received and acknowledged by
    /// the receiver), so the tensors may be overwritten or dropped at once, and a GPU send
    /// waits for the receiver's `recv`. Clones share the connection: their sends take turns,
    /// each message whole. Over the network, [`try_send`](Self::try_send) and
    /// [`send_timeout`](Self::send_timeout) wait (not at all, or until the timeout) for another
    /// thread's send and for room in the connection's buffer, then send the whole message; a
    /// failure after the message started to move (the peer died, a transfer timeout) closes
    /// the connection, and later sends fail as disconnected. A remote sender or receiver
    /// cannot itself be sent to another process.
    pub fn connect_remote(addr: impl ToSocketAddrs) -> Result<Sender<T>> {
        Self::connect_remote_with(addr, RemoteOptions::default())
    }

    /// Connects with `options`.
    ///
    /// Errors: [`Error::Timeout`] when the listener cannot be reached or does not answer in
    /// time; [`Error::Unsupported`] when it refuses (the secret, another protocol version,
    /// another message type), when this end holds a secret that the listener does not prove,
    /// or when it holds none and `addr` is not a loopback address (unless
    /// [`RemoteOptions::allow_unauthenticated`]).
    pub fn connect_remote_with(addr: impl ToSocketAddrs, options: RemoteOptions) -> Result<Sender<T>> {
        let addrs = resolve(addr)?;
        // Without a secret, whoever answers on the port would get every message.
        secret_or_loopback(&options, &addrs, "sender without a secret connects only to", "take")?;
        // Retried until the connect timeout: the listener may not be up yet (a peer process
        // still starting), as torch.distributed's rendezvous retries, or may close a connection
        // unanswered while it runs its most handshakes at once.
        let deadline = crate::os::instant_after(options.connect_timeout);
        let timeout = options.handshake_timeout;
        let pause =
            || std::thread::sleep(Duration::from_millis(50).min(deadline.saturating_duration_since(Instant::now())));
        let (stream, ours, challenge) = 'greeted: loop {
            let stream = 'connected: {
                let mut last = None;
                for (i, addr) in addrs.iter().enumerate() {
                    // The time left shared by the addresses not tried yet: one that drops
                    // connection attempts (an address of the name behind a firewall) does
                    // not take it all from those after it.
                    let untried = (addrs.len() - i) as u32;
                    let left = deadline.saturating_duration_since(Instant::now()) / untried;
                    match TcpStream::connect_timeout(addr, left.max(Duration::from_millis(1))) {
                        Ok(s) => break 'connected s,
                        Err(e) => last = Some(e),
                    }
                }
                let Some(e) = last else { return Err(Error::Timeout(options.connect_timeout)) };
                let retry = matches!(e.kind(), io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionReset);
                if retry && Instant::now() >= deadline {
                    tracing::warn!(error = %e, "no remote listener answered within the connect timeout");
                    return Err(Error::Timeout(options.connect_timeout));
                }
                if !retry {
                    return Err(io_error(e, "connecting", options.connect_timeout));
                }
                pause();
                continue 'greeted;
            };
            tracing::debug!(listener = ?stream.peer_addr().ok(), "connected to a remote listener");
            stream.set_nodelay(true)?;
            // The secret first, both ways: this end proves it only to a listener that proved it.
            let ours = auth::nonce()?;
            match greet(&stream, ours, timeout)? {
                Some(challenge) => break (stream, ours, challenge),
                None if Instant::now() < deadline => pause(),
                None => {
                    tracing::warn!(
                        timeout = ?options.connect_timeout,
                        "the remote listener closed every connection unanswered: it runs its most handshakes at once"
                    );
                    return Err(Error::Timeout(options.connect_timeout));
                }
            }
        };
        let (theirs, proof) = match challenge {
            Challenge::Refused(why) => return Err(Error::Unsupported(format!("the listener refused: {why}"))),
            Challenge::Prove { nonce, proof } => (nonce, proof),
        };
        if let Some(secret) = &options.secret
            && !proof.is_some_and(|p| secret.verify(Role::Listener, &ours, &theirs, &p))
        {
            return Err(Error::Unsupported(
                "the listener did not prove the shared secret: nothing is sent to it".into(),
            ));
        }
        let proof = options.secret.as_ref().map(|s| s.prove(Role::Connector, &theirs, &ours));
        write_handshake(&stream, &Response { proof }, timeout)?;
        let hello = Hello::of::<T>(Remote { host: host_identity(), network_only: options.network_only });
        write_handshake_bytes(&stream, hello.encode(), timeout)?;
        match read_handshake::<Welcome>(&stream, timeout)? {
            Welcome::Refused(why) => Err(Error::Unsupported(format!("the listener refused: {why}"))),
            // Asked for the network: a same-host answer may come from anyone who took the port.
            Welcome::SameHost(_) if options.network_only => Err(Error::Unsupported(
                "the listener offered a same-host channel to a sender that asked for the network only".into(),
            )),
            Welcome::SameHost(name) => match Sender::<T>::connect(&name) {
                Ok(tx) => {
                    write_handshake(&stream, &Joined::Yes, timeout)?;
                    Ok(tx)
                }
                Err(e) => {
                    write_handshake(&stream, &Joined::No(e.to_string()), timeout)?;
                    match read_handshake::<Welcome>(&stream, timeout)? {
                        Welcome::Network(limits) => Ok(net_sender(stream, options, limits)),
                        _ => Err(Error::Malformed("the listener answered out of turn".into())),
                    }
                }
            },
            Welcome::Network(limits) => Ok(net_sender(stream, options, limits)),
        }
    }
}

impl NetSender {
    fn send<T: Serialize>(&mut self, value: &T) -> std::result::Result<(), SendFailure> {
        if self.broken {
            return Err(SendFailure::Disconnected);
        }
        // HEAD bytes kept for the frame's length and header.
        let (encoded, outgoing) = codec::encode(|| catch_quietly(|| postcard::to_extend(value, vec![0u8; HEAD])));
        let bytes = match encoded {
            Ok(Ok(bytes)) => bytes,
            Ok(Err(e)) => {
                return Err(SendFailure::Serialize(
                    wire::take_failure().unwrap_or_else(|| format!("the message's Serialize failed ({e})")),
                ));
            }
            Err(panic) => return Err(SendFailure::Serialize(format!("serialization panicked: {panic}"))),
        };
        if bytes.len() - HEAD > self.options.max_frame_bytes {
            return Err(SendFailure::Serialize(format!(
                "the message takes {} bytes; the frame limit is {} (RemoteOptions::max_frame_bytes)",
                bytes.len() - HEAD,
                self.options.max_frame_bytes
            )));
        }
        // One connection moves GPU bytes of one device: its communicator's.
        let mut device: Option<std::sync::Arc<Device>> = self.comm.as_ref().map(|c| c.device().clone());
        for out in &outgoing {
            if let Outgoing::Gpu { storage, .. } = out {
                match &device {
                    Some(d) if d.ordinal() != storage.device().ordinal() => {
                        return Err(SendFailure::Serialize(format!(
                            "this connection moves GPU tensors of gpu {}; the message has one on gpu {}",
                            d.ordinal(),
                            storage.device().ordinal()
                        )));
                    }
                    Some(_) => {}
                    None => device = Some(storage.device().clone()),
                }
            }
        }
        let host_bytes: u64 =
            outgoing.iter().filter(|o| !matches!(o, Outgoing::Gpu { .. })).map(|o| o.len() as u64).sum();
        let gpu = outgoing
            .iter()
            .any(|o| matches!(o, Outgoing::Gpu { .. }))
            .then(|| outgoing.iter().filter(|o| matches!(o, Outgoing::Gpu { .. })).map(|o| o.len() as u64).sum());
        self.peer.check((bytes.len() - HEAD) as u64, outgoing.len() as u64, host_bytes, gpu)?;
        let message = frame(bytes, kind::MESSAGE, outgoing.len() as u32, host_bytes);
        // The communicator's identity, made before anything is written: without NCCL the send
        // fails and the connection stays open for messages without GPU tensors.
        let needs_comm = outgoing.iter().any(|o| matches!(o, Outgoing::Gpu { len, .. } if *len > 0));
        // Every range checked before anything is written: a failure after the frame has left
        // would close the connection with the message maybe delivered.
        let mut gpu = Vec::new();
        for out in &outgoing {
            match out {
                Outgoing::Host { storage, offset, len } => {
                    if offset.checked_add(*len).is_none_or(|end| end > storage.byte_len()) {
                        return Err(SendFailure::Serialize("a host tensor's bytes lie outside its storage".into()));
                    }
                }
                Outgoing::Gpu { storage, offset, len } => gpu.push(
                    storage
                        .range()
                        .and_then(|r| r.sub(*offset, *len))
                        .map_err(|e| SendFailure::Serialize(e.to_string()))?,
                ),
                Outgoing::Packed(_) => {}
            }
        }
        let setup = match (needs_comm, &self.comm, device) {
            (true, None, Some(device)) => {
                Some((UniqueId::new().map_err(|e| SendFailure::Io(IoFailure::other(e.to_string())))?, device))
            }
            _ => None,
        };
        let result = self.transmit(message, &outgoing, &gpu, setup);
        if result.is_err() {
            self.close();
        }
        result
    }

    fn transmit(
        &mut self,
        message: Vec<u8>,
        outgoing: &[Outgoing],
        gpu: &[crate::gpu::DeviceRange],
        setup: Option<(UniqueId, std::sync::Arc<Device>)>,
    ) -> std::result::Result<(), SendFailure> {
        let timeout = self.options.transfer_timeout;
        let deadline = crate::os::instant_after(timeout);
        let failed = |e: io::Error| match e.kind() {
            io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset => SendFailure::Disconnected,
            io::ErrorKind::TimedOut => {
                SendFailure::Io(IoFailure::other(format!("timed out after {timeout:?} writing to the peer")))
            }
            _ => SendFailure::Io(IoFailure::from(e)),
        };
        let needs_comm = gpu.iter().any(|r| !r.is_empty());
        if let Some((id, device)) = setup {
            let mut payload = vec![0u8; HEAD];
            payload.extend_from_slice(&id.0);
            tcp::write_all(&self.stream, &frame(payload, kind::NCCL_SETUP, 0, 0), deadline).map_err(failed)?;
            let stream = &self.stream;
            let comm = Communicator::join(&device, &id, 0, deadline, &mut || !tcp::peer_closed(stream))
                .map_err(send_failure)?;
            self.comm = Some(comm);
        }
        profile::timed(Phase::RemoteWrite, || {
            tcp::write_all(&self.stream, &message, deadline)?;
            for out in outgoing {
                match out {
                    Outgoing::Host { storage, offset, len } => {
                        let (mapping, base) = storage.mapping();
                        let limit = base + storage.byte_len();
                        tcp::write_mapped(&self.stream, mapping, limit, base + *offset, *len, deadline)?
                    }
                    Outgoing::Packed(bytes) => tcp::write_all(&self.stream, bytes, deadline)?,
                    Outgoing::Gpu { .. } => {}
                }
            }
            Ok(())
        })
        .map_err(failed)?;
        if needs_comm {
            let stream = &self.stream;
            let comm = self.comm.as_mut().expect("set up above");
            profile::timed(Phase::RemoteNccl, || comm.transfer(true, gpu, deadline, &mut || !tcp::peer_closed(stream)))
                .map_err(send_failure)?;
            let mut ack = [0u8; 1];
            match profile::timed(Phase::RemoteAck, || tcp::read_some(&self.stream, &mut ack, Some(deadline))) {
                Ok(1) if ack[0] == ACK => {}
                Ok(0) => return Err(SendFailure::Disconnected),
                Ok(_) => {
                    return Err(SendFailure::Io(IoFailure::other(format!(
                        "the receiver answered {:#x}, not an acknowledgement",
                        ack[0]
                    ))));
                }
                Err(e) => return Err(failed(e)),
            }
        }
        Ok(())
    }

    fn close(&mut self) {
        self.broken = true;
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        // Dropping aborts it: a broken peer cannot take part in a clean shutdown.
        self.comm = None;
    }
}

fn send_failure(e: Error) -> SendFailure {
    match e {
        Error::Recv(RecvError::Disconnected) => SendFailure::Disconnected,
        e => SendFailure::Io(IoFailure::other(e.to_string())),
    }
}

/// How a [`Receiver`] of a connection from another host receives. What closes the connection,
/// and the partial frame a timeout keeps: README.md here, "States and failure".
struct NetReceiverEnd {
    net: Mutex<NetReceiver>,
    /// The connection, to wait on without holding the receiver.
    stream: Arc<TcpStream>,
}

struct NetReceiver {
    stream: Arc<TcpStream>,
    reader: FrameReader,
    /// Dropped before `spare` (fields drop in order): aborted before memory is freed.
    comm: Option<Communicator>,
    /// The last message's GPU storages, to receive into again once nothing else holds them.
    spare: VecDeque<Arc<GpuStorage>>,
    options: RemoteOptions,
    broken: bool,
}

impl<T: DeserializeOwned> RecvFlavor<T> for NetReceiverEnd {
    fn recv(&self, deadline: Option<Instant>) -> std::result::Result<T, RecvTimeoutError> {
        // Another thread receiving holds the connection: wait for it only until the deadline.
        let mut net = lock_within(&self.net, deadline.map(Some)).ok_or(RecvTimeoutError::Timeout)?;
        if net.broken {
            return Err(RecvTimeoutError::Disconnected);
        }
        let result = net.recv::<T>(deadline);
        if matches!(result, Err(ref e) if !matches!(e, RecvTimeoutError::Timeout)) {
            net.close();
        }
        result
    }

    fn readiness(&self) -> Option<Watched> {
        match self.net.try_lock() {
            // Closed: a receive says so at once.
            Ok(net) if net.broken => None,
            _ => Some(self.stream.clone()),
        }
    }

    fn route(&self) -> Route {
        Route::Network
    }
}

impl NetReceiver {
    fn recv<T: DeserializeOwned>(&mut self, deadline: Option<Instant>) -> std::result::Result<T, RecvTimeoutError> {
        loop {
            let body = match self.reader.read(&self.stream, deadline) {
                Ok(Some(body)) => body,
                Ok(None) => return Err(RecvTimeoutError::Disconnected),
                Err(e) => {
                    return Err(match e.kind() {
                        io::ErrorKind::TimedOut => RecvTimeoutError::Timeout,
                        io::ErrorKind::UnexpectedEof | io::ErrorKind::InvalidData => {
                            RecvTimeoutError::Malformed(e.to_string())
                        }
                        io::ErrorKind::ConnectionReset => RecvTimeoutError::Disconnected,
                        _ => RecvTimeoutError::Io(IoFailure::from(e)),
                    });
                }
            };
            let (payload, kind, transfers, host_bytes) = parse_frame(&body).map_err(recv_error)?;
            match kind {
                kind::NCCL_SETUP => self.join(payload).map_err(recv_error)?,
                kind::MESSAGE => return self.message(payload, transfers, host_bytes),
                other => return Err(RecvTimeoutError::Malformed(format!("unknown frame kind {other}"))),
            }
        }
    }

    /// Joins the communicator the sender made (as rank 1), on this end's GPU.
    fn join(&mut self, payload: &[u8]) -> Result<()> {
        let id: [u8; 128] = payload
            .try_into()
            .map_err(|_| Error::Malformed(format!("an NCCL set-up of {} bytes, not 128", payload.len())))?;
        if self.comm.is_some() {
            return Err(Error::Malformed("a second NCCL set-up on one connection".into()));
        }
        let ordinal = self
            .options
            .device
            .ok_or_else(|| Error::Unsupported("GPU tensors are coming, and this end has no GPU set".into()))?;
        let device = Device::get(ordinal)?;
        let deadline = crate::os::instant_after(self.options.transfer_timeout);
        let stream = &self.stream;
        self.comm = Some(Communicator::join(&device, &UniqueId(id), 1, deadline, &mut || !tcp::peer_closed(stream))?);
        Ok(())
    }

    fn message<T: DeserializeOwned>(
        &mut self,
        payload: &[u8],
        transfers: u32,
        host_bytes: u64,
    ) -> std::result::Result<T, RecvTimeoutError> {
        let spare = if self.options.reuse_memory { std::mem::take(&mut self.spare) } else { VecDeque::new() };
        let decoded = decode_message::<T>(payload, transfers, host_bytes, &self.options, self.comm.is_some(), spare);
        let (value, incoming, unused) = decoded?;
        // A message without GPU tensors leaves the spares for the next one.
        self.spare = unused;
        let timeout = self.options.transfer_timeout;
        let deadline = crate::os::instant_after(timeout);
        for arrival in &incoming {
            if let Incoming::Host(storage, len) = arrival {
                let (mapping, base) = storage.mapping();
                tcp::read_mapped(&self.stream, mapping, base + storage.byte_len(), base, *len, deadline).map_err(
                    |e| match e.kind() {
                        io::ErrorKind::TimedOut => RecvTimeoutError::Io(IoFailure::other(format!(
                            "a host tensor did not arrive within {timeout:?}"
                        ))),
                        io::ErrorKind::UnexpectedEof => RecvTimeoutError::Malformed(e.to_string()),
                        _ => RecvTimeoutError::Io(IoFailure::from(e)),
                    },
                )?;
            }
        }
        let ranges = incoming
            .iter()
            .filter_map(|i| match i {
                Incoming::Gpu(storage, len) => Some(storage.range().and_then(|r| r.sub(0, *len))),
                Incoming::Host(..) => None,
            })
            .collect::<Result<Vec<_>>>()
            .map_err(recv_error)?;
        if ranges.iter().any(|r| !r.is_empty()) {
            let stream = &self.stream;
            let comm = self
                .comm
                .as_mut()
                .ok_or_else(|| RecvTimeoutError::Malformed("GPU tensors arrived before the NCCL set-up".into()))?;
            if let Err(e) = profile::timed(Phase::RemoteNccl, || {
                comm.transfer(false, &ranges, deadline, &mut || !tcp::peer_closed(stream))
            }) {
                // Abort before the fresh memory is freed: freeing waits for the stream, where
                // the receive may still be waiting for a peer that is gone.
                self.close();
                return Err(recv_error(e));
            }
            // The bytes are here: the message is the receiver's even if the acknowledgement
            // cannot be written (the sender then reports a failure and the connection closes).
            if tcp::write_all(&self.stream, &[ACK], deadline).is_err() {
                self.close();
            } else if self.options.reuse_memory {
                self.spare = incoming
                    .iter()
                    .filter_map(|i| match i {
                        Incoming::Gpu(storage, len) if *len > 0 => Some(storage.clone()),
                        _ => None,
                    })
                    .collect();
            }
        }
        Ok(value)
    }

    fn close(&mut self) {
        self.broken = true;
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        self.comm = None;
        self.spare.clear();
    }
}

/// What a receiver makes of a message frame's payload before any of its tensors' bytes are
/// read: the limits checked, the message decoded (its tensors given memory here, GPU memory
/// from `spare` where it fits), and the frame's counts checked against it. Returns the value,
/// the tensors whose bytes come next, and the spares not used.
fn decode_message<T: DeserializeOwned>(
    payload: &[u8],
    transfers: u32,
    host_bytes: u64,
    options: &RemoteOptions,
    gpu_ready: bool,
    spare: VecDeque<Arc<GpuStorage>>,
) -> std::result::Result<(T, Vec<Incoming>, VecDeque<Arc<GpuStorage>>), RecvTimeoutError> {
    if host_bytes > options.max_host_bytes {
        return Err(RecvTimeoutError::Malformed(format!(
            "a message with {host_bytes} bytes of host tensors; the limit is {} (RemoteOptions::max_host_bytes)",
            options.max_host_bytes
        )));
    }
    if transfers > options.max_tensors {
        return Err(RecvTimeoutError::Malformed(format!(
            "a message with {transfers} tensors; the limit is {} (RemoteOptions::max_tensors)",
            options.max_tensors
        )));
    }
    let budget = Budget {
        device: options.device,
        gpu_ready,
        host_bytes,
        gpu_bytes: options.max_gpu_bytes,
        transfers,
        bundle_tensors: options.max_bundle_tensors,
        spare,
    };
    let (decoded, incoming, unused) =
        codec::decode(budget, || catch_quietly(|| postcard::take_from_bytes::<T>(payload)));
    let value = match decoded {
        Ok(Ok((value, []))) => value,
        Ok(Ok((_, rest))) => {
            return Err(RecvTimeoutError::Malformed(format!("{} bytes after the message's end", rest.len())));
        }
        Ok(Err(e)) => {
            return Err(RecvTimeoutError::Malformed(
                wire::take_failure().unwrap_or_else(|| format!("undecodable message ({e})")),
            ));
        }
        Err(panic) => return Err(RecvTimeoutError::Malformed(format!("decoding panicked: {panic}"))),
    };
    if incoming.len() != transfers as usize {
        return Err(RecvTimeoutError::Malformed(format!(
            "the frame announces {transfers} tensors, the message holds {}",
            incoming.len()
        )));
    }
    let announced: u64 = incoming.iter().map(|i| if let Incoming::Host(_, len) = i { *len as u64 } else { 0 }).sum();
    if announced != host_bytes {
        return Err(RecvTimeoutError::Malformed(format!(
            "the frame announces {host_bytes} host bytes, the message's tensors hold {announced}"
        )));
    }
    Ok((value, incoming, unused))
}

/// The decoders of what a peer sends, for fuzzing (`cuda_mp::testing::fuzz`).
#[cfg(any(test, feature = "testing"))]
pub(crate) mod fuzzing {
    use super::*;

    /// Decodes `bytes` as every handshake message either end reads; how many decoded.
    pub(crate) fn handshake(bytes: &[u8]) -> usize {
        [
            Greeting::decode(bytes).is_ok(),
            postcard::from_bytes::<Challenge>(bytes).is_ok(),
            postcard::from_bytes::<Response>(bytes).is_ok(),
            Hello::decode(bytes).is_ok(),
            postcard::from_bytes::<Welcome>(bytes).is_ok(),
            postcard::from_bytes::<Joined>(bytes).is_ok(),
        ]
        .into_iter()
        .filter(|&ok| ok)
        .count()
    }

    /// The body (after its length) of the frame a sender writes for `value`, without the host
    /// tensors' bytes that follow it.
    pub(crate) fn frame_of<T: Serialize>(value: &T) -> std::result::Result<Vec<u8>, String> {
        let (encoded, outgoing) = codec::encode(|| postcard::to_extend(value, vec![0u8; HEAD]));
        let bytes = encoded.map_err(|e| e.to_string())?;
        let host_bytes = outgoing.iter().map(|o| o.len() as u64).sum();
        let mut framed = super::frame(bytes, kind::MESSAGE, outgoing.len() as u32, host_bytes);
        Ok(framed.split_off(4))
    }

    /// A frame's body (after its length) as a receiver without a GPU reads it once the
    /// handshake is done: its header, then its message as `T` up to the tensors' bytes.
    pub(crate) fn read_frame<T: DeserializeOwned>(body: &[u8]) -> std::result::Result<T, String> {
        let options = RemoteOptions::default().max_host_bytes(1 << 20).max_tensors(64).max_gpu_bytes(1 << 20);
        let (payload, kind, transfers, host_bytes) = parse_frame(body).map_err(|e| e.to_string())?;
        match kind {
            kind::MESSAGE => decode_message::<T>(payload, transfers, host_bytes, &options, false, VecDeque::new())
                .map(|(value, _, _)| value)
                .map_err(|e| e.to_string()),
            other => Err(format!("frame kind {other}")),
        }
    }
}

fn recv_error(e: Error) -> RecvTimeoutError {
    match e {
        Error::Malformed(m) => RecvTimeoutError::Malformed(m),
        Error::Recv(RecvError::Disconnected) => RecvTimeoutError::Disconnected,
        e => RecvTimeoutError::Io(IoFailure::other(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostTensor;

    type Msg = (String, HostTensor<u8>);

    /// A hello's bytes, of `version` (the fields after it are this version's).
    fn hello<T>(version: u32) -> Vec<u8> {
        let ours = Hello::of::<T>(Remote { host: host_identity(), network_only: true }).encode();
        let mut bytes = postcard::to_allocvec(&(crate::protocol::MAGIC, version)).unwrap();
        let (_, rest) = postcard::take_from_bytes::<([u8; 8], u32)>(&ours).unwrap();
        bytes.extend_from_slice(rest);
        bytes
    }

    /// A receiver whose peer is a raw socket that did the handshake by hand.
    fn forged_peer(options: RemoteOptions) -> (TcpStream, Receiver<Msg>) {
        forged_peer_of::<Msg>(options)
    }

    const T5: Duration = Duration::from_secs(5);
    const T60: Duration = Duration::from_secs(60);

    /// Does a connector's part of the handshake by hand, up to the hello: proves `secret` if
    /// given; the listener's challenge.
    fn prove_by_hand(s: &TcpStream, secret: Option<&[u8]>) -> Challenge {
        let ours = auth::nonce().unwrap();
        write_handshake(s, &Greeting::new(ours), T5).unwrap();
        let challenge = read_handshake::<Challenge>(s, T5).unwrap();
        let Challenge::Prove { nonce, .. } = &challenge else { return challenge };
        let proof = secret.map(|k| Secret::new(k).prove(Role::Connector, nonce, &ours));
        write_handshake(s, &Response { proof }, T5).unwrap();
        challenge
    }

    /// The same, for messages of type `T`.
    fn forged_peer_of<T: Serialize + DeserializeOwned + 'static>(options: RemoteOptions) -> (TcpStream, Receiver<T>) {
        let (peer, _, rx) = handshake_by_hand(options);
        (peer, rx)
    }

    /// A connection that made its handshake by hand to a listener of `T` with `options`, the
    /// limits the listener told it, and the listener's receiver.
    fn handshake_by_hand<T: Serialize + DeserializeOwned + 'static>(
        options: RemoteOptions,
    ) -> (TcpStream, Limits, Receiver<T>) {
        let listener = RemoteListener::<T>::bind_with("127.0.0.1:0", options.network_only(true)).unwrap();
        let addr = listener.local_addr().unwrap();
        let hello = hello::<T>(REMOTE_PROTOCOL_VERSION);
        let peer = std::thread::spawn(move || {
            let s = TcpStream::connect(addr).unwrap();
            prove_by_hand(&s, None);
            write_handshake_bytes(&s, hello, T5).unwrap();
            let Welcome::Network(limits) = read_handshake::<Welcome>(&s, T5).unwrap() else {
                panic!("not a network welcome")
            };
            (s, limits)
        });
        let rx = listener.accept_timeout(T60).unwrap();
        let (peer, limits) = peer.join().unwrap();
        (peer, limits, rx)
    }

    /// How many descriptors of this process refer to the TCP socket whose local port is
    /// `local` and whose peer's is `remote` (0 once the socket is gone from the kernel's table,
    /// or lingers there in TIME_WAIT with no owner).
    fn descriptors_of_connection((local, remote): (u16, u16)) -> usize {
        let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
        let (local, remote) = (format!(":{local:04X}"), format!(":{remote:04X}"));
        let inode = table.lines().skip(1).find_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            (f.len() > 9 && f[1].ends_with(&local) && f[2].ends_with(&remote)).then(|| f[9].to_string())
        });
        let Some(inode) = inode.filter(|i| i != "0") else { return 0 };
        let link = format!("socket:[{inode}]");
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|target| target.to_str() == Some(link.as_str()))
            .count()
    }

    fn payload(value: &Msg) -> Vec<u8> {
        codec::encode(|| postcard::to_extend(value, vec![0u8; HEAD])).0.unwrap()
    }

    /// What the receiver says after the peer wrote `bytes` and closed its side, then next.
    fn after(bytes: Vec<u8>, options: RemoteOptions) -> (String, String) {
        let (mut peer, rx) = forged_peer(options);
        std::io::Write::write_all(&mut peer, &bytes).unwrap();
        peer.shutdown(std::net::Shutdown::Write).unwrap();
        let first = rx.recv_timeout(Duration::from_secs(10)).unwrap_err().to_string();
        let second = rx.recv_timeout(Duration::from_secs(10)).unwrap_err().to_string();
        (first, second)
    }

    fn small() -> Msg {
        ("x".into(), HostTensor::<u8>::from_vec(&[4], vec![1, 2, 3, 4]).unwrap())
    }

    #[test]
    fn a_well_formed_forged_message_is_received() {
        let (mut peer, rx) = forged_peer(RemoteOptions::default());
        let mut bytes = frame(payload(&small()), kind::MESSAGE, 1, 4);
        bytes.extend_from_slice(&[9, 8, 7, 6]);
        std::io::Write::write_all(&mut peer, &bytes).unwrap();
        let (name, t) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!((name.as_str(), t.to_vec()), ("x", vec![9, 8, 7, 6]));
    }

    #[test]
    fn forged_frames_are_malformed_and_close_the_connection() {
        let options = || RemoteOptions::default().max_frame_bytes(1 << 10).max_host_bytes(1 << 20);
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            ("over the frame limit", vec![0xff, 0xff, 0, 0], "limit"),
            ("shorter than its header", vec![3, 0, 0, 0, 1, 2, 3], "header"),
            ("unknown kind", frame(vec![0; HEAD], 9, 0, 0), "unknown frame kind"),
            ("undecodable payload", frame([&[0; HEAD][..], &[0xff; 3]].concat(), kind::MESSAGE, 0, 0), "undecodable"),
            ("transfers miscounted", frame(payload(&small()), kind::MESSAGE, 3, 4), "announces 3 tensors"),
            ("host bytes miscounted", frame(payload(&small()), kind::MESSAGE, 1, 9), "announces 9 host bytes"),
            ("host bytes over the limit", frame(payload(&small()), kind::MESSAGE, 1, 1 << 40), "limit"),
            ("a set-up of the wrong size", frame(vec![0; HEAD + 5], kind::NCCL_SETUP, 0, 0), "not 128"),
            ("a frame cut short", vec![100, 0, 0, 0, 1, 2], "ended inside a frame"),
            ("host bytes cut short", frame(payload(&small()), kind::MESSAGE, 1, 4), "mid-message"),
        ];
        for (what, bytes, expect) in cases {
            let (first, second) = after(bytes, options());
            assert!(first.contains(expect), "{what}: {first}");
            assert!(second.contains("disconnected"), "{what}, then: {second}");
        }
    }

    #[test]
    fn tensor_counts_are_checked_against_the_frame_and_the_limit() {
        let empties = |n: usize| {
            let v: Vec<RemoteTensorForTest> =
                (0..n).map(|_| RemoteTensorForTest { dtype: crate::DType::U8.tag(), shape: vec![0] }).collect();
            postcard::to_extend(&v, vec![0u8; HEAD]).unwrap()
        };
        let receiver = forged_peer_of::<Vec<HostTensor<u8>>>;
        // More tensors than the frame announces: refused at the first one too many.
        let (mut peer, rx) = receiver(RemoteOptions::default());
        std::io::Write::write_all(&mut peer, &frame(empties(50_000), kind::MESSAGE, 10, 0)).unwrap();
        let err = rx.recv_timeout(Duration::from_secs(10)).unwrap_err().to_string();
        assert!(err.contains("more tensors than its frame announces"), "{err}");
        // More than the limit: refused before decoding.
        let (mut peer, rx) = receiver(RemoteOptions::default().max_tensors(100));
        std::io::Write::write_all(&mut peer, &frame(empties(101), kind::MESSAGE, 101, 0)).unwrap();
        let err = rx.recv_timeout(Duration::from_secs(10)).unwrap_err().to_string();
        assert!(err.contains("the limit is 100"), "{err}");
        // Empty tensors, announced honestly, share one allocation: no descriptor each.
        let (mut peer, rx) = receiver(RemoteOptions::default());
        std::io::Write::write_all(&mut peer, &frame(empties(5_000), kind::MESSAGE, 5_000, 0)).unwrap();
        let got = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(got.len(), 5_000);
        assert!(got.windows(2).all(|w| w[0].storage_id() == w[1].storage_id()));
    }

    #[test]
    fn trailing_bytes_and_gpu_tensors_before_the_set_up_are_malformed() {
        let (mut peer, rx) = forged_peer(RemoteOptions::default());
        let mut payload = payload(&small());
        payload.extend_from_slice(&[1, 2, 3]);
        std::io::Write::write_all(&mut peer, &frame(payload, kind::MESSAGE, 1, 4)).unwrap();
        let err = rx.recv_timeout(Duration::from_secs(10)).unwrap_err().to_string();
        assert!(err.contains("3 bytes after the message's end"), "{err}");

        let (mut peer, rx) = forged_peer_of::<crate::GpuTensor<f32>>(RemoteOptions::default());
        let tensor = RemoteTensorForTest { dtype: crate::DType::F32.tag(), shape: vec![1 << 20] };
        let bytes = frame(postcard::to_extend(&tensor, vec![0u8; HEAD]).unwrap(), kind::MESSAGE, 1, 0);
        std::io::Write::write_all(&mut peer, &bytes).unwrap();
        let err = rx.recv_timeout(Duration::from_secs(10)).unwrap_err().to_string();
        assert!(err.contains("before the NCCL set-up"), "{err}");
    }

    #[test]
    fn a_receiver_without_a_gpu_refuses_the_nccl_set_up() {
        let (first, second) =
            after(frame(vec![0; HEAD + 128], kind::NCCL_SETUP, 0, 0), RemoteOptions::default().without_device());
        assert!(first.contains("no GPU set"), "{first}");
        assert!(second.contains("disconnected"), "{second}");
    }

    #[test]
    fn a_huge_tensor_shape_is_refused_before_any_allocation() {
        let (mut peer, rx) = forged_peer(RemoteOptions::default().max_host_bytes(1 << 20));
        // A shape of 2^40 bytes, announced honestly: over the message's budget.
        let shape_only = ("x".to_string(), RemoteTensorForTest { dtype: crate::DType::U8.tag(), shape: vec![1 << 40] });
        let bytes = frame(postcard::to_extend(&shape_only, vec![0u8; HEAD]).unwrap(), kind::MESSAGE, 1, 1 << 20);
        std::io::Write::write_all(&mut peer, &bytes).unwrap();
        let err = rx.recv_timeout(Duration::from_secs(10)).unwrap_err().to_string();
        assert!(err.contains("more than the message may still claim"), "{err}");
    }

    /// A bundle that lists more allocations than its frame announces tensors is refused as the
    /// list is read (a byte a size: before, 32 Mi of them took 512 MiB before any limit); one
    /// allocation holding more tensors than `max_tensors` (which counts transfers) is not.
    #[cfg(feature = "cuda")]
    #[test]
    fn a_bundles_allocations_are_bounded_by_its_frames_tensors() {
        let err = bundle_refusal(RemoteOptions::default().max_tensors(4), vec![0u64; 1 << 20], &[0]);
        assert!(err.contains("more allocations than the message's 1 tensors"), "{err}");
        // Five tensors in one allocation: the table is taken, and the decode goes on to the
        // allocation (refused here only because no NCCL set-up came first).
        let (table, lens) = crate::gpu::table_of_tensors(5);
        let chunks: Vec<u64> = lens.iter().map(|&l| l as u64).collect();
        let err = bundle_refusal(RemoteOptions::default().max_tensors(4), chunks.clone(), &table);
        assert!(err.contains("before the NCCL set-up"), "{err}");
        // Past `max_bundle_tensors`, the table is refused as it is read.
        let err = bundle_refusal(RemoteOptions::default().max_bundle_tensors(4), chunks, &table);
        assert!(err.contains("more than 4 tensors (RemoteOptions::max_bundle_tensors)"), "{err}");
    }

    /// What a receiver of bundles with `options` says of a frame of one tensor whose bundle
    /// lists allocations of `chunks` bytes and the table `table`.
    #[cfg(feature = "cuda")]
    fn bundle_refusal(options: RemoteOptions, chunks: Vec<u64>, table: &[u8]) -> String {
        let (mut peer, rx) = forged_peer_of::<crate::Bundle>(options);
        let body = postcard::to_extend(&(chunks, serde_bytes::Bytes::new(table)), vec![0u8; HEAD]).unwrap();
        std::io::Write::write_all(&mut peer, &frame(body, kind::MESSAGE, 1, 0)).unwrap();
        rx.recv_timeout(T60).unwrap_err().to_string()
    }

    /// Without a secret, a peer that answered the challenge and then stalls (before its hello,
    /// or after a same-host hello, before it joins) proves nothing: 64 of them, from two other
    /// sources, keep no sender out (before, they were never ended, and filled every handshake
    /// slot for as long as they stalled).
    #[test]
    fn peers_that_stall_keep_no_sender_out_without_a_secret() {
        stalled_peers_keep_no_sender_out(None);
        let same_host = Hello::of::<u8>(Remote { host: host_identity(), network_only: false }).encode();
        stalled_peers_keep_no_sender_out(Some(same_host));
    }

    /// 32 peers each from 127.0.0.2 and 127.0.0.3 answer the challenge, write `hello` if given,
    /// and stall; after their grace a sender without a secret connects.
    fn stalled_peers_keep_no_sender_out(hello: Option<Vec<u8>>) {
        use rustix::net::{AddressFamily, SocketType, bind, connect, socket};
        let options = RemoteOptions::default().network_only(hello.is_none());
        let listener = RemoteListener::<u8>::bind_with("127.0.0.1:0", options.clone()).unwrap();
        let addr = listener.local_addr().unwrap();
        let accepting = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline {
                // The stalled peers' ended handshakes come back as refusals.
                if let Ok(rx) = listener.accept_timeout(Duration::from_millis(500)) {
                    return Some(rx);
                }
            }
            None
        });
        let stalled: Vec<TcpStream> = [[127u8, 0, 0, 2], [127, 0, 0, 3]]
            .iter()
            .flat_map(|&from| {
                let hello = hello.clone();
                (0..32).map(move |_| {
                    let fd = socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
                    bind(&fd, &std::net::SocketAddr::from((from, 0))).unwrap();
                    connect(&fd, &addr).unwrap();
                    let s = TcpStream::from(fd);
                    prove_by_hand(&s, None);
                    if let Some(hello) = &hello {
                        write_handshake_bytes(&s, hello.clone(), T5).unwrap();
                    }
                    s
                })
            })
            .collect();
        // Past their grace.
        std::thread::sleep(Duration::from_millis(1200));
        let tx = Sender::<u8>::connect_remote_with(addr, options.handshake_timeout(T5));
        let tx = tx.unwrap_or_else(|e| panic!("a sender was kept out: {e}"));
        tx.send(7).unwrap();
        let rx = accepting.join().unwrap().expect("accepted");
        assert_eq!(rx.recv_timeout(T5), Ok(7));
        drop(stalled);
    }

    /// The wire form of a remote tensor, written by hand.
    #[derive(Serialize)]
    struct RemoteTensorForTest {
        dtype: u8,
        shape: Vec<usize>,
    }

    #[test]
    fn another_protocol_version_is_refused_on_both_ends() {
        let listener = RemoteListener::<u8>::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let peer = std::thread::spawn(move || {
            let s = TcpStream::connect(addr).unwrap();
            let greeting = (crate::protocol::MAGIC, REMOTE_PROTOCOL_VERSION + 1, [0u8; NONCE]);
            write_handshake(&s, &greeting, T5).unwrap();
            match read_handshake::<Challenge>(&s, T5).unwrap() {
                Challenge::Refused(why) => why,
                _ => panic!("not refused"),
            }
        });
        let err = listener.accept_timeout(T60).unwrap_err().to_string();
        let v = REMOTE_PROTOCOL_VERSION;
        assert!(err.contains(&format!("protocol version {v} here, {} at the peer", v + 1)), "{err}");
        assert!(peer.join().unwrap().contains("protocol version"));
    }

    /// A peer that connects and closes at once ends its handshake at once: `accept` answers
    /// with its error then, not when the next peer comes or its time-out passes (the answer can
    /// arrive before `accept` has looked at the count of running handshakes).
    #[test]
    fn accept_answers_at_once_for_a_peer_that_connects_and_closes() {
        let listener = RemoteListener::<u8>::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        for _ in 0..20 {
            drop(TcpStream::connect(addr).unwrap());
            let start = Instant::now();
            assert!(listener.accept_timeout(T60).is_err());
            assert!(start.elapsed() < Duration::from_secs(5), "answered after {:?}", start.elapsed());
        }
    }

    const SECRET: &[u8] = b"a secret of thirty-two bytes ok!";

    /// What a listener of `u8` holding `listener` (a secret, or none) says to a peer that
    /// proves `secret` (or none) and then sends the hello of a sender of `String`, and what its
    /// `accept` returns.
    fn refusal(listener: Option<&[u8]>, secret: Option<&'static [u8]>) -> (String, String) {
        let options = RemoteOptions { secret: listener.map(Secret::new), ..RemoteOptions::default() };
        let listener = RemoteListener::<u8>::bind_with("127.0.0.1:0", options.network_only(true)).unwrap();
        let addr = listener.local_addr().unwrap();
        let peer = std::thread::spawn(move || {
            let s = TcpStream::connect(addr).unwrap();
            prove_by_hand(&s, secret);
            // The hello of another message type: told apart only after the secret.
            write_handshake_bytes(&s, hello::<String>(REMOTE_PROTOCOL_VERSION), T5).unwrap();
            match read_handshake::<Welcome>(&s, T5).unwrap() {
                Welcome::Refused(why) => why,
                _ => "welcomed".into(),
            }
        });
        let accepted = listener.accept_timeout(T60).map(|_| ()).unwrap_err().to_string();
        (peer.join().unwrap(), accepted)
    }

    /// What a listener holding `SECRET` says to a peer that proves `secret` (or none).
    fn with_secret(secret: Option<&'static [u8]>) -> (String, String) {
        refusal(Some(SECRET), secret)
    }

    #[test]
    fn a_peer_without_the_secret_is_refused_before_its_hello_is_read() {
        for secret in [None, Some(&b"another secret, thirty-two bytes"[..])] {
            let (told, error) = with_secret(secret);
            assert_eq!(told, "authentication failed", "told no more");
            assert!(error.contains("did not prove the shared secret"), "{error}");
        }
        // With the secret, the hello is read: another message type, named to a proven peer.
        let (told, error) = with_secret(Some(SECRET));
        assert!(told.contains("the sender sends alloc::string::String"), "{told}");
        assert!(error.contains("the listener receives u8"), "{error}");
    }

    #[test]
    fn an_unauthenticated_peer_is_not_told_the_message_type() {
        let (told, error) = refusal(None, None);
        assert_eq!(told, "the listener receives another message type");
        assert!(error.contains("the listener receives u8"), "{error}");
    }

    #[test]
    fn a_sender_with_a_secret_refuses_a_listener_that_cannot_prove_it() {
        // A listener that knows no secret: it answers with a nonce and no proof.
        let rogue = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = rogue.local_addr().unwrap();
        let answer = std::thread::spawn(move || {
            let (s, _) = rogue.accept().unwrap();
            let _ = read_handshake_bytes(&s, T5).unwrap();
            write_handshake(&s, &Challenge::Prove { nonce: [7; NONCE], proof: Some([0; PROOF]) }, T5).unwrap();
            // The sender closes without a proof of its own.
            read_handshake_bytes(&s, T5).is_err()
        });
        let options = RemoteOptions::default().secret(SECRET);
        let err = Sender::<u8>::connect_remote_with(addr, options).unwrap_err().to_string();
        assert!(err.contains("did not prove the shared secret"), "{err}");
        assert!(answer.join().unwrap(), "the sender sent nothing more");
    }

    #[test]
    fn a_network_only_sender_refuses_a_same_host_answer() {
        // Whoever took the port answers "same host": a network-only sender does not follow it.
        let rogue = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = rogue.local_addr().unwrap();
        std::thread::spawn(move || {
            let (s, _) = rogue.accept().unwrap();
            let _ = read_handshake_bytes(&s, T5).unwrap();
            write_handshake(&s, &Challenge::Prove { nonce: [7; NONCE], proof: None }, T5).unwrap();
            let _ = read_handshake_bytes(&s, T5).unwrap();
            let _ = read_handshake_bytes(&s, T5).unwrap();
            write_handshake(&s, &Welcome::SameHost("a-socket-of-someone-else".into()), T5).unwrap();
            std::thread::sleep(Duration::from_secs(1));
        });
        let options = RemoteOptions::default().network_only(true);
        let err = Sender::<u8>::connect_remote_with(addr, options).unwrap_err().to_string();
        assert!(err.contains("asked for the network only"), "{err}");
    }

    #[test]
    fn a_listener_without_a_secret_binds_only_loopback_unless_told() {
        let open = RemoteOptions { secret: None, ..RemoteOptions::default() };
        let err = RemoteListener::<u8>::bind_with("0.0.0.0:0", open.clone()).unwrap_err().to_string();
        assert!(err.contains("without a secret binds only loopback"), "{err}");
        assert!(RemoteListener::<u8>::bind_with("0.0.0.0:0", open.clone().allow_unauthenticated(true)).is_ok());
        assert!(RemoteListener::<u8>::bind_with("0.0.0.0:0", open.clone().secret(SECRET)).is_ok());
        let short = RemoteListener::<u8>::bind_with("127.0.0.1:0", open.secret(b"short")).unwrap_err().to_string();
        assert!(short.contains("at least 16 bytes"), "{short}");
    }

    #[test]
    fn an_idle_peer_does_not_hold_up_a_real_sender() {
        let options = RemoteOptions::default().secret(SECRET).handshake_timeout(Duration::from_secs(30));
        let listener = RemoteListener::<u8>::bind_with("127.0.0.1:0", options.clone()).unwrap();
        let addr = listener.local_addr().unwrap();
        // Connected first, then silent; and a few more that send half a greeting.
        let idle: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(addr).unwrap()).collect();
        for s in &idle[1..] {
            std::io::Write::write_all(&mut &*s, &[40, 0, 0, 0, b'c']).unwrap();
        }
        std::thread::sleep(Duration::from_millis(50));
        let start = Instant::now();
        let sender = std::thread::spawn(move || {
            let tx = Sender::<u8>::connect_remote_with(addr, options.network_only(true)).unwrap();
            tx.send(7).unwrap();
            tx
        });
        let rx = listener.accept_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), 7);
        assert!(start.elapsed() < Duration::from_secs(1), "took {:?}", start.elapsed());
        drop((sender.join().unwrap(), idle));
    }

    #[test]
    fn a_message_over_the_gpu_byte_limit_is_refused_before_any_allocation() {
        let (mut peer, rx) = forged_peer_of::<crate::GpuTensor<f32>>(RemoteOptions::default().max_gpu_bytes(1 << 20));
        let tensor = RemoteTensorForTest { dtype: crate::DType::F32.tag(), shape: vec![1 << 20] }; // 4 MiB
        let bytes = frame(postcard::to_extend(&tensor, vec![0u8; HEAD]).unwrap(), kind::MESSAGE, 1, 0);
        std::io::Write::write_all(&mut peer, &bytes).unwrap();
        let err = rx.recv_timeout(Duration::from_secs(10)).unwrap_err().to_string();
        assert!(err.contains("max_gpu_bytes"), "{err}");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 48, ..Default::default() })]

        /// Whatever bytes follow a valid handshake, the receiver answers with values or errors:
        /// never a panic, never a hang past the transfer timeout, and once it is dropped no
        /// descriptor of the connection is left.
        #[test]
        fn random_bytes_after_the_handshake_give_errors_only(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512),
            header in proptest::prelude::any::<bool>(),
        ) {
            let options = RemoteOptions::default()
                .max_frame_bytes(1 << 12)
                .max_host_bytes(1 << 16)
                .transfer_timeout(Duration::from_millis(200));
            let (mut peer, rx) = forged_peer(options);
            let ports = (peer.peer_addr().unwrap().port(), peer.local_addr().unwrap().port());
            proptest::prop_assert_eq!(descriptors_of_connection(ports), 1, "the receiver holds its connection");
            // Half the cases give a plausible frame header, so that the payload's decoder runs.
            let bytes = if header { frame([&[0; HEAD][..], &bytes].concat(), kind::MESSAGE, 1, 4) } else { bytes };
            std::io::Write::write_all(&mut peer, &bytes).unwrap();
            peer.shutdown(std::net::Shutdown::Write).unwrap();
            for _ in 0..3 {
                if rx.recv_timeout(Duration::from_secs(5)).is_err() {
                    break;
                }
            }
            drop(rx);
            proptest::prop_assert_eq!(descriptors_of_connection(ports), 0, "no descriptor of the connection is left");
        }
    }

    /// A peer that stops inside a frame (its length said 100 bytes, 10 came) ends a receive
    /// without a limit after the transfer timeout, as an error; it waited for ever.
    #[test]
    fn a_peer_that_stops_inside_a_frame_ends_a_receive_after_the_transfer_timeout() {
        let (mut peer, rx) = forged_peer(RemoteOptions::default().transfer_timeout(Duration::from_millis(300)));
        std::io::Write::write_all(&mut peer, &[100, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]).unwrap();
        let (tx, done) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(rx.recv().map(|_| ()).map_err(|e| e.to_string()));
        });
        let answered = done.recv_timeout(T5).expect("the receive ended");
        assert!(answered.unwrap_err().contains("stopped inside a frame"));
        drop(peer);
    }

    /// A receiver without a GPU tells its senders it takes no GPU tensor, and a sender then
    /// refuses one, even an empty one, before it writes: the receiver would refuse it and close
    /// the connection, and an empty one was written without an answer awaited (its send said
    /// `Ok` for a message that was lost).
    #[test]
    fn a_receiver_without_a_gpu_takes_no_gpu_tensor_and_its_senders_know() {
        let limits = Limits::of(&RemoteOptions::default().without_device());
        assert_eq!(limits.gpu_bytes, 0);
        assert_eq!(Limits::of(&RemoteOptions::default()).gpu_bytes, 64 << 30);
        let refused = |gpu| match limits.check(100, 1, 0, gpu) {
            Err(SendFailure::Serialize(why)) => why,
            other => panic!("{other:?}"),
        };
        assert!(refused(Some(0)).contains("takes none"), "an empty GPU tensor");
        assert!(refused(Some(4)).contains("takes none"));
        assert!(limits.check(100, 1, 4, None).is_ok(), "host tensors go");
        let with_gpu = Limits::of(&RemoteOptions::default().max_gpu_bytes(8));
        assert!(with_gpu.check(100, 2, 0, Some(8)).is_ok());
        assert!(
            matches!(with_gpu.check(100, 2, 0, Some(9)), Err(SendFailure::Serialize(why)) if why.contains("at most 8"))
        );
        // What the handshake gives a sender, read from a real one.
        let (_peer, told, _rx) = handshake_by_hand::<u8>(RemoteOptions::default().without_device());
        assert_eq!(told.gpu_bytes, 0);
    }

    /// A frame that stalls is reported once it stalled for the transfer timeout, counted from
    /// its last byte, also to a receiver that polls with shorter limits (each poll restarted
    /// the count, and the stall was never seen).
    #[test]
    fn a_stalled_frame_is_reported_to_a_receiver_that_polls() {
        let (mut peer, rx) = forged_peer(RemoteOptions::default().transfer_timeout(Duration::from_millis(200)));
        std::io::Write::write_all(&mut peer, &[100, 0, 0, 0, 0, 0]).unwrap();
        let start = Instant::now();
        let stalled = loop {
            assert!(start.elapsed() < Duration::from_secs(5), "the stall was never reported");
            match rx.recv_timeout(Duration::from_millis(50)) {
                Err(RecvTimeoutError::Timeout) => continue,
                Err(e) => break e.to_string(),
                Ok(_) => panic!("a message from half a frame"),
            }
        };
        assert!(stalled.contains("stopped inside a frame"), "{stalled}");
        assert!(start.elapsed() < Duration::from_secs(1), "{:?}", start.elapsed());
        assert!(matches!(rx.recv_timeout(Duration::from_millis(50)), Err(RecvTimeoutError::Disconnected)));
    }

    /// A connect that finds nobody listening until its limit is a timeout, as documented
    /// (it was the last refusal's `Io` error).
    #[test]
    fn a_connect_with_nobody_listening_times_out() {
        let free = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let options = RemoteOptions::default().connect_timeout(Duration::from_millis(300));
        let start = Instant::now();
        let err = Sender::<u8>::connect_remote_with(free, options).unwrap_err();
        assert!(err.is_timeout(), "{err:?}");
        assert!(start.elapsed() >= Duration::from_millis(300) && start.elapsed() < Duration::from_secs(5));
    }

    /// Sixteen senders of one host that connect at the same moment all get a channel (a cap
    /// of 8 handshakes per address reset half of them).
    #[test]
    fn sixteen_senders_of_one_host_connecting_at_once_all_get_a_channel() {
        let listener =
            RemoteListener::<u8>::bind_with("127.0.0.1:0", RemoteOptions::default().network_only(true)).unwrap();
        let addr = listener.local_addr().unwrap();
        let senders: Vec<_> = (0..16)
            .map(|_| {
                std::thread::spawn(move || {
                    Sender::<u8>::connect_remote_with(addr, RemoteOptions::default().network_only(true)).map(|_| ())
                })
            })
            .collect();
        // Their connections complete in the kernel's backlog meanwhile.
        std::thread::sleep(Duration::from_millis(300));
        let accepter = std::thread::spawn(move || {
            let mut got = 0;
            while listener.accept_timeout(Duration::from_secs(3)).is_ok() {
                got += 1;
            }
            got
        });
        let failed: Vec<String> =
            senders.into_iter().filter_map(|s| s.join().unwrap().err()).map(|e| e.to_string()).collect();
        let accepted = accepter.join().unwrap();
        assert!(failed.is_empty(), "{} of 16 senders failed ({accepted} accepted): {:?}", failed.len(), failed.first());
    }

    /// A limited accept waits no longer than its limit while another thread accepts.
    #[test]
    fn a_limited_accept_beside_another_threads_accept_keeps_its_limit() {
        let listener = Arc::new(RemoteListener::<u8>::bind("127.0.0.1:0").unwrap());
        let first = listener.clone();
        std::thread::spawn(move || {
            let _ = first.accept_timeout(Duration::from_secs(30));
        });
        std::thread::sleep(Duration::from_millis(100));
        let start = Instant::now();
        assert!(listener.accept_timeout(Duration::from_millis(100)).unwrap_err().is_timeout());
        assert!(start.elapsed() < Duration::from_secs(5), "waited {:?}", start.elapsed());
    }

    /// A sync object (named or not) sent to another host fails at the sender with the value
    /// back, and the connection goes on; a named one went out, and the receiver closed the
    /// connection when the name meant nothing on its host.
    #[test]
    fn a_sync_object_sent_to_another_host_is_refused_at_the_sender() {
        let listener = RemoteListener::<(u32, Option<crate::Lock>)>::bind_with(
            "127.0.0.1:0",
            RemoteOptions::default().network_only(true),
        )
        .unwrap();
        let addr = listener.local_addr().unwrap();
        let tx = std::thread::spawn(move || {
            Sender::<(u32, Option<crate::Lock>)>::connect_remote_with(addr, RemoteOptions::default().network_only(true))
                .unwrap()
        });
        let rx = listener.accept_timeout(T60).unwrap();
        let tx = tx.join().unwrap();
        let name = format!("net-lock-{}", std::process::id());
        let lock = crate::Lock::create(&name).unwrap();
        let refused = tx.send((1, Some(lock.clone()))).unwrap_err();
        assert!(refused.to_string().contains("another host"), "{refused}");
        assert!(tx.send((1, Some(crate::Lock::new().unwrap()))).is_err(), "an anonymous one too");
        tx.send((2, None)).unwrap();
        assert_eq!(rx.recv_timeout(T5).unwrap().0, 2, "the connection goes on");
    }

    #[test]
    fn a_shape_of_too_many_dimensions_is_refused_while_it_is_decoded() {
        let (mut peer, rx) = forged_peer_of::<HostTensor<u8>>(RemoteOptions::default());
        // A shape that announces 2^40 dimensions in a handful of bytes.
        let mut payload = postcard::to_extend(&crate::DType::U8.tag(), vec![0u8; HEAD]).unwrap();
        payload = postcard::to_extend(&(1u64 << 40), payload).unwrap();
        payload.extend([1; 64]);
        std::io::Write::write_all(&mut peer, &frame(payload, kind::MESSAGE, 1, 0)).unwrap();
        let err = rx.recv_timeout(Duration::from_secs(10)).unwrap_err().to_string();
        assert!(err.contains("more than 8 dimensions"), "{err}");
    }

    #[test]
    fn a_sender_that_dies_mid_message_does_not_hang_the_receiver() {
        let (mut peer, rx) = forged_peer(RemoteOptions::default().transfer_timeout(Duration::from_secs(30)));
        let value = ("x".to_string(), HostTensor::<u8>::zeros(&[1 << 20]).unwrap());
        let mut bytes = frame(payload(&value), kind::MESSAGE, 1, 1 << 20);
        bytes.extend_from_slice(&[0; 1000]);
        std::io::Write::write_all(&mut peer, &bytes).unwrap();
        let start = Instant::now();
        let killer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(peer);
        });
        let err = rx.recv().unwrap_err().to_string();
        killer.join().unwrap();
        assert!(err.contains("mid-message"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn a_transfer_that_stalls_times_out() {
        let (mut peer, rx) = forged_peer(RemoteOptions::default().transfer_timeout(Duration::from_millis(200)));
        let bytes = frame(payload(&small()), kind::MESSAGE, 1, 4);
        std::io::Write::write_all(&mut peer, &bytes).unwrap();
        let err = rx.recv().unwrap_err().to_string();
        assert!(err.contains("did not arrive within"), "{err}");
        drop(peer);
    }
}
