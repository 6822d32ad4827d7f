//! Typed channels between processes: `channel`, `bounded`, `pipe`, connections by name, select
//! over several receivers, and receives for async code. How a send avoids waiting for the
//! reader, and the frames on the wire: `src/channel/README.md`.

mod asynch;
mod flavor;
mod frame;
mod gauge;
mod inbox;
mod outbox;
mod ring;
mod select;

pub use asynch::{RecvFuture, RecvStream};
pub use flavor::Route;
#[cfg(feature = "remote")]
pub(crate) use flavor::Watched;
pub(crate) use flavor::{RecvFlavor, Refused, SendFlavor};
pub use select::Select;

use std::fmt;
use std::io;
use std::marker::PhantomData;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use self::frame::FrameOut;
use self::gauge::{Gauge, MAX_CAPACITY};
use self::inbox::{Inbox, InboxLock, Readiness, Wait};
use self::outbox::Outbox;
use self::ring::RingReader;
use crate::error::{
    Error, IoFailure, RecvError, RecvTimeoutError, Result, SendError, SendFailure, SendTimeoutError, TryRecvError,
    TrySendError,
};
use crate::lifetime::{ConnectionKey, ConnectionLeases, Lease};
use crate::protocol::{Hello, Refusal};
use crate::sys::{Listening, MemoryFile, Socket};
use crate::wire::{self, Carried};

/// Creates an unbounded channel between processes. Either end can be sent to another process
/// (as a spawn argument or inside a message); the sender can be cloned and sent to many
/// processes.
///
/// A send never waits for the reader: when the reader falls behind, messages wait in a backlog
/// of the sending process (memory grows instead; before that, a send whose shared-memory ring
/// is full looks for room for at most 50 us, once until the reader catches up, as a receive
/// spins before it sleeps; `try_send` does not look, `send_timeout` not past its limit), and each process's messages arrive in the
/// order it sent them. Tensors in the backlog keep their memory alive until received. A process
/// that exits with a backlog first waits until it is handed on (or the receiver is gone), like
/// torch's queues; see [`bounded`] for a channel whose sends wait for room instead.
///
/// The receiver reports [`RecvError::Disconnected`] once every sender is gone and everything
/// sent was received, including senders held by processes that died; a process that keeps a
/// sender of its own therefore never sees the channel disconnect.
///
/// ```
/// let (tx, rx) = cuda_mp::channel::<u32>().unwrap();
/// for i in 0..100_000 {
///     tx.send(i).unwrap(); // nobody receives yet: no send waits
/// }
/// drop(tx);
/// assert_eq!(rx.iter().count(), 100_000);
/// ```
pub fn channel<T: Serialize + DeserializeOwned>() -> Result<(Sender<T>, Receiver<T>)> {
    make(0)
}

/// Creates a channel that holds at most `capacity` messages: [`Sender::send`] waits while it
/// is full, [`Sender::try_send`] fails with [`TrySendError::Full`], and
/// [`Sender::send_timeout`] gives up after its timeout. A message counts from its send until it
/// is received. `capacity` is 1 to `i32::MAX`.
///
/// The count lives in shared memory that every end of the channel maps; a process killed
/// between taking a place and sending its message leaves that place taken.
///
/// ```
/// use std::time::Duration;
/// let (tx, rx) = cuda_mp::bounded::<u8>(2).unwrap();
/// tx.send(1).unwrap();
/// tx.send(2).unwrap();
/// assert!(tx.try_send(3).unwrap_err().is_full());
/// assert!(tx.send_timeout(3, Duration::from_millis(10)).unwrap_err().is_timeout());
/// assert_eq!(rx.recv().unwrap(), 1);
/// tx.try_send(3).unwrap(); // room again
/// assert!(cuda_mp::bounded::<u8>(0).is_err());
/// ```
pub fn bounded<T: Serialize + DeserializeOwned>(capacity: usize) -> Result<(Sender<T>, Receiver<T>)> {
    if capacity == 0 || capacity > MAX_CAPACITY {
        return Err(Error::Io(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("a bounded channel holds 1 to {MAX_CAPACITY} messages, not {capacity}"),
        )));
    }
    make(capacity as u32)
}

/// Waits until every message this process sent, on any channel, has been handed to the socket
/// its receiver reads (or its receiver is gone), for at most `timeout`. A send never waits for
/// the reader, so a process whose reader is behind holds a backlog: returning from `main` (or
/// from a spawned worker) waits for it by itself, but a process that ends with `_exit` does not
/// (a child of Python's `multiprocessing` with the `fork` start method; the Python package
/// calls this for it), nor one that is killed. It then waits, within the same limit, until
/// the releases of what this process received and dropped have been sent to their owners.
/// [`Error::Timeout`] when the backlog is not handed on in time (the reader does not read),
/// or a release is not sent (its owner does not read: stopped); [`flush_backlogs`] waits for
/// the messages alone.
///
/// ```
/// let (tx, rx) = cuda_mp::channel::<u32>().unwrap();
/// for i in 0..10_000 {
///     tx.send(i).unwrap();
/// }
/// let reader = std::thread::spawn(move || rx.iter().count());
/// cuda_mp::flush_sends(std::time::Duration::from_secs(30)).unwrap();
/// drop(tx);
/// assert_eq!(reader.join().unwrap(), 10_000);
/// ```
pub fn flush_sends(timeout: Duration) -> Result<()> {
    if outbox::flush_all(Some(timeout)) { Ok(()) } else { Err(Error::Timeout(timeout)) }
}

/// As [`flush_sends`], for the messages alone: waits until every message this process sent
/// has been handed to the socket its receiver reads (or its receiver is gone), for at most
/// `timeout`, and not for releases. What a process's exit waits for without limit (it waits
/// for its releases a minute at most).
///
/// ```
/// let (tx, rx) = cuda_mp::channel::<u32>().unwrap();
/// tx.send(7).unwrap();
/// cuda_mp::flush_backlogs(std::time::Duration::from_secs(30)).unwrap();
/// assert_eq!(rx.recv().unwrap(), 7);
/// ```
pub fn flush_backlogs(timeout: Duration) -> Result<()> {
    if outbox::flush_backlogs(Some(crate::os::instant_after(timeout))) { Ok(()) } else { Err(Error::Timeout(timeout)) }
}

/// Messages this process received through a sender's ring.
#[cfg(any(test, feature = "testing"))]
pub(crate) fn ring_messages_received() -> u64 {
    inbox::RING_MESSAGES.load(std::sync::atomic::Ordering::Relaxed)
}

fn make<T: Serialize + DeserializeOwned>(capacity: u32) -> Result<(Sender<T>, Receiver<T>)> {
    let (tx, rx) = Socket::pair().map_err(wire::io_error)?;
    let gauge = Gauge::new(capacity, tx.send_buffer())?;
    let outbox = Outbox::attach(Arc::new(tx), gauge.clone());
    Ok((Sender::local(outbox), Receiver::from_parts(Arc::new(rx), None, gauge, Default::default(), |_| {})))
}

/// The sending end of a channel. Clone it for several producers, in this process or others.
///
/// | form | when the channel is full (bounded) | when the receiver is gone |
/// | --- | --- | --- |
/// | [`send`](Self::send) | waits | [`SendError`], value back |
/// | [`try_send`](Self::try_send) | [`TrySendError::Full`], value back | [`TrySendError::Disconnected`] |
/// | [`send_timeout`](Self::send_timeout) | waits, then [`SendTimeoutError::Timeout`] | [`SendTimeoutError::Disconnected`] |
///
/// An unbounded channel is never full: its sends return without waiting for the reader.
///
/// ```
/// let (tx, rx) = cuda_mp::channel::<String>().unwrap();
/// let tx2 = tx.clone();
/// tx2.send("from a clone".into()).unwrap();
/// assert_eq!(rx.recv().unwrap(), "from a clone");
/// ```
pub struct Sender<T> {
    flavor: SenderFlavor<T>,
}

enum SenderFlavor<T> {
    /// A channel of this host.
    Local(Arc<Outbox>, PhantomData<fn(T)>),
    /// A connection to another host (`src/net`).
    Remote(Arc<dyn SendFlavor<T>>),
}

impl<T> Sender<T> {
    /// Waits until what this sender's process spilled on the channel (messages a full socket
    /// could not take, kept in this process) was handed on, or the receiver is gone, until
    /// `deadline` at most: then the messages outlive this process. False when the deadline
    /// passed first.
    pub(crate) fn handed_on(&self, deadline: Instant) -> bool {
        match &self.flavor {
            SenderFlavor::Local(outbox, _) => outbox.drain(Some(deadline)),
            SenderFlavor::Remote(_) => true,
        }
    }

    fn local(outbox: Arc<Outbox>) -> Sender<T> {
        Sender { flavor: SenderFlavor::Local(outbox, PhantomData) }
    }

    /// A sender over another transport.
    pub(crate) fn remote(flavor: Arc<dyn SendFlavor<T>>) -> Sender<T> {
        Sender { flavor: SenderFlavor::Remote(flavor) }
    }

    /// Which way its messages travel: [`Route::SameHost`] for a channel of this host (made by
    /// [`channel`], say, or [`connect_remote`](Self::connect_remote) to a listener on this
    /// host), [`Route::Network`] for a connection to another host.
    ///
    /// ```
    /// assert_eq!(cuda_mp::channel::<u8>().unwrap().0.route(), cuda_mp::Route::SameHost);
    /// ```
    pub fn route(&self) -> Route {
        match &self.flavor {
            SenderFlavor::Local(..) => Route::SameHost,
            SenderFlavor::Remote(remote) => remote.route(),
        }
    }

    /// Whether the channel is one of this host's.
    pub(crate) fn is_local(&self) -> bool {
        matches!(self.flavor, SenderFlavor::Local(..))
    }

    /// True once the channel's receiving end is known to be closed (for a local channel: its
    /// socket's peer); false for a remote sender.
    pub(crate) fn receiver_gone(&self) -> bool {
        match &self.flavor {
            SenderFlavor::Local(outbox, _) => outbox.receiver_gone(),
            SenderFlavor::Remote(_) => false,
        }
    }

    /// A child forked without `exec` closes this process's sending end of the channel at once
    /// (see `Outbox::not_inherited`); nothing for a remote sender.
    pub(crate) fn not_inherited(&self) {
        if let SenderFlavor::Local(outbox, _) = &self.flavor {
            outbox.not_inherited();
        }
    }

    #[cfg(test)]
    fn outbox(&self) -> &Outbox {
        match &self.flavor {
            SenderFlavor::Local(outbox, _) => outbox,
            SenderFlavor::Remote(_) => panic!("a remote sender has no outbox"),
        }
    }
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        match &self.flavor {
            SenderFlavor::Local(outbox, _) => Sender::local(outbox.add_handle()),
            SenderFlavor::Remote(remote) => Sender::remote(remote.clone()),
        }
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        if let SenderFlavor::Local(outbox, _) = &self.flavor {
            outbox.drop_handle();
        }
    }
}

impl<T> fmt::Debug for Sender<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Sender");
        d.field("message", &std::any::type_name::<T>()).field("route", &self.route());
        if let SenderFlavor::Local(outbox, _) = &self.flavor {
            d.field("outbox", outbox);
        }
        d.finish_non_exhaustive()
    }
}

impl<T: Serialize> Sender<T> {
    /// Sends a message. Tensors inside it are shared, not copied: the receiver maps the same
    /// memory. Any number of tensors may travel in one message. The message is encoded before
    /// this returns (a tensor that cannot be exported fails here). On an unbounded channel this
    /// never waits for the reader; on a [`bounded`] one it waits while the channel is full. On
    /// failure the message comes back inside the error.
    ///
    /// ```
    /// let (tx, rx) = cuda_mp::channel::<String>().unwrap();
    /// tx.send("hello".to_string()).unwrap();
    /// assert_eq!(rx.recv().unwrap(), "hello");
    /// ```
    pub fn send(&self, value: T) -> std::result::Result<(), SendError<T>> {
        self.submit(value, None).map_err(|(value, refused)| match refused {
            Refused::Failed(failure) => SendError::new(value, failure),
            // A wait without limit is neither full nor timed out.
            Refused::Full | Refused::Timeout => {
                SendError::new(value, SendFailure::Io(IoFailure::other("the channel stayed full")))
            }
        })
    }

    /// Sends a message if the channel has room now, without waiting for it.
    ///
    /// ```
    /// let (tx, rx) = cuda_mp::bounded::<u8>(1).unwrap();
    /// tx.try_send(1).unwrap();
    /// let err = tx.try_send(2).unwrap_err();
    /// assert!(err.is_full());
    /// assert_eq!(rx.recv().unwrap(), 1);
    /// tx.try_send(err.into_inner()).unwrap();
    /// ```
    pub fn try_send(&self, value: T) -> std::result::Result<(), TrySendError<T>> {
        self.submit(value, Some(None)).map_err(|(value, refused)| match refused {
            Refused::Full | Refused::Timeout => TrySendError::Full(value),
            Refused::Failed(SendFailure::Disconnected) => TrySendError::Disconnected(value),
            Refused::Failed(failure) => TrySendError::Failed(value, failure),
        })
    }

    /// Sends a message, waiting at most `timeout` for room in a bounded channel.
    ///
    /// ```
    /// use std::time::Duration;
    /// let (tx, _rx) = cuda_mp::bounded::<u8>(1).unwrap();
    /// tx.send_timeout(1, Duration::from_secs(1)).unwrap();
    /// assert!(tx.send_timeout(2, Duration::from_millis(10)).unwrap_err().is_timeout());
    /// ```
    pub fn send_timeout(&self, value: T, timeout: Duration) -> std::result::Result<(), SendTimeoutError<T>> {
        let deadline = Instant::now().checked_add(timeout);
        // A timeout too long to represent is a wait without limit.
        let wait = deadline.map(Some);
        self.submit(value, wait).map_err(|(value, refused)| match refused {
            Refused::Full | Refused::Timeout => SendTimeoutError::Timeout(value),
            Refused::Failed(SendFailure::Disconnected) => SendTimeoutError::Disconnected(value),
            Refused::Failed(failure) => SendTimeoutError::Failed(value, failure),
        })
    }

    /// Takes a place in a bounded channel (`wait`: `None` without limit, `Some(None)` not at
    /// all, `Some(Some(deadline))` until then), then encodes and writes the message.
    fn submit(&self, value: T, wait: Option<Option<Instant>>) -> std::result::Result<(), (T, Refused)> {
        let outbox = match &self.flavor {
            SenderFlavor::Local(outbox, _) => outbox,
            SenderFlavor::Remote(remote) => return remote.send(&value, wait).map_err(|refused| (value, refused)),
        };
        if outbox.disconnected() {
            return Err((value, Refused::Failed(SendFailure::Disconnected)));
        }
        let gauge = &outbox.gauge;
        if gauge.capacity().is_some()
            && let Err(refused) = gauge.take_place(wait, || outbox.receiver_gone())
        {
            return Err((value, refused));
        }
        // How long a full ring may be waited for: a receive's spin, bounded by the caller's
        // own limit (none for `try_send`); past it the message takes the socket.
        let patience = match wait {
            None => inbox::spin(),
            Some(None) => Duration::ZERO,
            Some(Some(deadline)) => inbox::spin().min(deadline.saturating_duration_since(Instant::now())),
        };
        Self::write(outbox, &value, patience).map_err(|failure| {
            gauge.free_places(1); // on a bounded channel
            (value, Refused::Failed(failure))
        })
    }

    /// Encodes `value` (collecting its descriptors) and writes its frame, waiting at most
    /// `patience` for room in a full ring.
    fn write(outbox: &Arc<Outbox>, value: &T, patience: Duration) -> std::result::Result<(), SendFailure> {
        let encoded = wire::encode_on(value, outbox.connection()).map_err(SendFailure::Serialize)?;
        if encoded.fds.is_empty() && encoded.introduce.is_empty() && outbox.try_ring(&encoded.bytes, patience)? {
            encoded.sent();
            return Ok(());
        }
        let frame =
            FrameOut::message(&encoded.bytes, outbox.gauge.limit, &encoded.introduce).map_err(outbox::failure)?;
        outbox.write(frame, &encoded.fds)?;
        crate::sys::kill_point("sent");
        // Not sent (an error above): `encoded` takes its claims back as it drops.
        encoded.sent();
        Ok(())
    }

    /// The most messages the channel holds; `None` for an unbounded channel.
    ///
    /// ```
    /// assert_eq!(cuda_mp::bounded::<u8>(4).unwrap().0.capacity(), Some(4));
    /// assert_eq!(cuda_mp::channel::<u8>().unwrap().0.capacity(), None);
    /// ```
    pub fn capacity(&self) -> Option<usize> {
        match &self.flavor {
            SenderFlavor::Local(outbox, _) => outbox.gauge.capacity().map(|c| c as usize),
            SenderFlavor::Remote(_) => None,
        }
    }

    /// Connects to a [`Listener`] by the name it published. The connection is an unbounded
    /// channel. A listener whose backlog stays full (it does not accept) fails the connect
    /// after 10 s with [`Error::Timeout`]; [`connect_file`](Self::connect_file) takes a timeout.
    ///
    /// ```
    /// let listener = cuda_mp::Listener::<u8>::bind().unwrap();
    /// let tx = cuda_mp::Sender::<u8>::connect(listener.name()).unwrap();
    /// let rx = listener.accept().unwrap();
    /// tx.send(1).unwrap();
    /// assert_eq!(rx.recv().unwrap(), 1);
    /// ```
    pub fn connect(name: &str) -> Result<Sender<T>> {
        Self::connect_until(name, CONNECT_WAIT)
    }

    fn connect_until(name: &str, timeout: Duration) -> Result<Sender<T>> {
        if name.is_empty() || name.len() >= 108 || name.contains('\0') {
            return Err(Error::Io(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{name:?} is not a listener name"),
            )));
        }
        // A listener of another user (a socket planted under the name) is refused here.
        let socket = match crate::sys::connect_to(Path::new(name), crate::os::instant_after(timeout)) {
            Ok(socket) => socket,
            Err(e) if e.kind() == io::ErrorKind::TimedOut => return Err(Error::Timeout(timeout)),
            Err(e) => return Err(wire::io_error(e)),
        };
        let gauge = Gauge::new(0, socket.send_buffer())?;
        let memory = gauge.memory()?;
        socket
            .send(&[&Hello::of::<T>(()).encode()], &[memory.as_fd()], crate::sys::Wait::Forever)
            .map_err(wire::io_error)?;
        tracing::debug!(listener = name, "connected to a listener");
        Ok(Sender::local(Outbox::attach(Arc::new(socket), gauge)))
    }

    /// Connects to a [`Listener`] whose name was written to `path` with
    /// [`Listener::publish_to`], waiting up to `timeout` for the file to appear (or to name a
    /// listener that is there: a file left by one that is gone is read again) and for room in
    /// the listener's backlog. A file that is not a regular file of this user's (a FIFO, a
    /// symbolic link, another user's file planted under the name), or that its group or every
    /// user may write, fails at once (`PermissionDenied`); a listener of another user's is refused as
    /// by [`connect`](Self::connect).
    ///
    /// ```
    /// use std::time::Duration;
    /// let listener = cuda_mp::Listener::<u8>::bind().unwrap();
    /// let path = format!("{}.name", listener.name());
    /// listener.publish_to(&path).unwrap();
    /// let tx = cuda_mp::Sender::<u8>::connect_file(&path, Duration::from_secs(5)).unwrap();
    /// let rx = listener.accept().unwrap();
    /// tx.send(2).unwrap();
    /// assert_eq!(rx.recv().unwrap(), 2);
    /// std::fs::remove_file(&path).unwrap();
    /// ```
    pub fn connect_file(path: impl AsRef<Path>, timeout: Duration) -> Result<Sender<T>> {
        let deadline = crate::os::instant_after(timeout);
        loop {
            // A listener's name is a path of at most 107 bytes.
            let waited = match crate::sys::read_published(path.as_ref(), 4096) {
                Ok(Some(name)) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match Sender::connect_until(name.trim(), left) {
                        Err(Error::Timeout(_)) => return Err(Error::Timeout(timeout)),
                        // A name left by a listener that is gone (a server being restarted):
                        // its next listener writes the file again.
                        Err(Error::Io(e))
                            if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused) =>
                        {
                            Error::Io(e)
                        }
                        other => return other,
                    }
                }
                Ok(None) => Error::Timeout(timeout),
                Err(e) => return Err(e.into()),
            };
            if Instant::now() >= deadline {
                return Err(waited);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A sender as it travels: the socket and the shared counters.
#[derive(Serialize, Deserialize)]
struct SenderWire {
    main: Carried,
    gauge: Carried,
}

/// The channel's shared counters, placed in the message being encoded.
fn carry_gauge<E: serde::ser::Error>(gauge: &Gauge) -> std::result::Result<Carried, E> {
    wire::carry(gauge.memory().map_err(wire::encode_error)?, None).map_err(wire::encode_error)
}

/// The channel's shared counters, taken out of the message being decoded.
fn take_gauge<E: serde::de::Error>(carried: Carried) -> std::result::Result<Gauge, E> {
    let fd = wire::take(carried).map_err(wire::decode_error)?;
    let memory = MemoryFile::open(fd, gauge::BYTES)
        .map_err(|e| wire::decode_error(Error::Malformed(format!("a channel's counters: {e}"))))?;
    Gauge::from_memory(Arc::new(memory)).map_err(wire::decode_error)
}

/// A socket of a channel, placed in the message being encoded.
fn carry_socket<E: serde::ser::Error>(socket: &Arc<Socket>) -> std::result::Result<Carried, E> {
    wire::carry(socket.clone(), None).map_err(wire::encode_error)
}

fn take_socket<E: serde::de::Error>(carried: Carried) -> std::result::Result<Arc<Socket>, E> {
    wire::take_socket(carried).map_err(wire::decode_error)
}

/// Why a remote end cannot be sent: its connection (and NCCL communicator) belong to this
/// process.
fn stays_here<E: serde::ser::Error>(end: &str) -> E {
    wire::encode_error(Error::Unsupported(format!(
        "a remote channel's {end} stays in the process that made it; send its messages on, or connect \
         from the other process"
    )))
}

impl<T> Serialize for Sender<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let SenderFlavor::Local(outbox, _) = &self.flavor else { return Err(stays_here("sender")) };
        SenderWire { main: carry_socket(&outbox.main)?, gauge: carry_gauge(&outbox.gauge)? }.serialize(serializer)
    }
}

impl<'de, T> Deserialize<'de> for Sender<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let wire = SenderWire::deserialize(deserializer)?;
        Ok(Sender::local(Outbox::attach(take_socket(wire.main)?, take_gauge(wire.gauge)?)))
    }
}

/// The receiving end of a channel. It can be moved to another process, not cloned; threads of
/// one process may share it (one of them receives each message).
///
/// | form | waits | returns |
/// | --- | --- | --- |
/// | [`recv`](Self::recv) | until a message or disconnection | `Result<T, RecvError>` |
/// | [`try_recv`](Self::try_recv) | no | `Result<T, TryRecvError>` |
/// | [`recv_timeout`](Self::recv_timeout) | at most the timeout | `Result<T, RecvTimeoutError>` |
/// | [`recv_async`](Self::recv_async) | as a future | `Result<T, RecvError>` |
/// | [`iter`](Self::iter), `for x in &rx` | yields `T` until disconnection or the first failure | |
/// | [`iter_results`](Self::iter_results) | yields every message and failure until disconnection | |
/// | [`try_iter`](Self::try_iter) | yields what waits now | |
/// | [`stream`](Self::stream) | a `futures_core::Stream` of `Result<T, RecvError>` | |
///
/// [`Select`] waits for the first of several receivers.
///
/// ```
/// let (tx, rx) = cuda_mp::channel::<i64>().unwrap();
/// tx.send(-1).unwrap();
/// assert_eq!(rx.recv().unwrap(), -1);
/// ```
pub struct Receiver<T> {
    flavor: ReceiverFlavor<T>,
}

// The local end is the common one, inline; the remote one is a box.
#[allow(clippy::large_enum_variant)]
enum ReceiverFlavor<T> {
    /// A channel of this host.
    Local(LocalReceiver<T>),
    /// A connection from another host (`src/net`).
    #[cfg_attr(not(feature = "remote"), allow(dead_code))]
    Remote(Box<dyn RecvFlavor<T>>),
}

/// The receiving end of a channel of this host.
struct LocalReceiver<T> {
    /// Shared with the end's segment table, which looks whether everything was read when an
    /// owner of its segments exits (`Inbox::everything_read`).
    inbox: Arc<InboxLock>,
    /// Set where forked children must not keep the channel's socket open
    /// ([`Receiver::not_inherited`]); before `main`, which keeps the number open while it lives.
    not_inherited: std::sync::OnceLock<crate::fork::NotInherited<crate::fork::Number>>,
    /// The channel's socket, to wait on without holding the inbox.
    main: Arc<Socket>,
    gauge: Gauge,
    _message: PhantomData<fn() -> T>,
}

impl<T> fmt::Debug for Receiver<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Receiver")
            .field("message", &std::any::type_name::<T>())
            .field("route", &self.route())
            .field("capacity", &self.capacity())
            .finish_non_exhaustive()
    }
}

impl<T> Receiver<T> {
    /// A receiver over another transport.
    #[cfg_attr(not(feature = "remote"), allow(dead_code))]
    pub(crate) fn remote(flavor: Box<dyn RecvFlavor<T>>) -> Receiver<T> {
        Receiver { flavor: ReceiverFlavor::Remote(flavor) }
    }

    /// Which way its messages travel (see [`Sender::route`]).
    ///
    /// ```
    /// assert_eq!(cuda_mp::channel::<u8>().unwrap().1.route(), cuda_mp::Route::SameHost);
    /// ```
    pub fn route(&self) -> Route {
        match &self.flavor {
            ReceiverFlavor::Local(_) => Route::SameHost,
            ReceiverFlavor::Remote(remote) => remote.route(),
        }
    }

    /// The most messages the channel holds; `None` for an unbounded channel (and a remote
    /// one, which the connection bounds).
    ///
    /// ```
    /// assert_eq!(cuda_mp::bounded::<u8>(3).unwrap().1.capacity(), Some(3));
    /// ```
    pub fn capacity(&self) -> Option<usize> {
        match &self.flavor {
            ReceiverFlavor::Local(local) => local.gauge.capacity().map(|c| c as usize),
            ReceiverFlavor::Remote(_) => None,
        }
    }

    /// Sets how long a receive on this end that would wait first looks for a message without
    /// sleeping; `None` for the process's (50 us where two or more processors run, none on
    /// one, or what `CUDA_MP_SPIN_US` says). A message that comes within that time is read by
    /// a thread that is awake: neither the process's wake-up nor a processor's return from an
    /// idle state is on its path (on H100 hosts, a 7B model's re-publish took 227-413 us
    /// with the default and 83-171 us with 10 ms, both ends spinning: docs/performance.md).
    /// Each receive that waits may keep a processor busy for that long (it lets other threads
    /// run between looks): for a receiver whose next message comes within milliseconds and
    /// that can spare a processor, such as a rollout engine waiting for the next weights.
    /// Receives that have begun keep the spin they began with. It belongs to this end in this
    /// process: an end sent on starts with the receiving process's. A remote receiver waits
    /// on its connection and does not spin.
    ///
    /// ```
    /// use std::time::Duration;
    /// let (tx, rx) = cuda_mp::channel::<u8>().unwrap();
    /// rx.set_spin(Some(Duration::from_millis(2)));
    /// assert_eq!(rx.spin(), Duration::from_millis(2));
    /// tx.send(1).unwrap();
    /// assert_eq!(rx.recv().unwrap(), 1);
    /// ```
    pub fn set_spin(&self, spin: Option<Duration>) {
        if let ReceiverFlavor::Local(local) = &self.flavor {
            local.inbox.set_spin(spin);
        }
    }

    /// How long a receive on this end that would wait spins first ([`set_spin`]); zero for a
    /// remote receiver.
    ///
    /// [`set_spin`]: Self::set_spin
    pub fn spin(&self) -> Duration {
        match &self.flavor {
            ReceiverFlavor::Local(local) => local.inbox.spin(),
            ReceiverFlavor::Remote(_) => Duration::ZERO,
        }
    }

    #[cfg(test)]
    fn lock(&self) -> inbox::InboxGuard<'_> {
        match &self.flavor {
            ReceiverFlavor::Local(local) => local.inbox.lock(),
            ReceiverFlavor::Remote(_) => panic!("a remote receiver has no inbox"),
        }
    }
}

impl<T: DeserializeOwned> LocalReceiver<T> {
    /// For a wait that found another thread receiving: the bell that thread rings when it lets
    /// go of the inbox (or, where no bell can be made, the socket, looked at when readable).
    fn wait_for_holder(&self) -> Readiness {
        match self.inbox.wait_for_holder() {
            Some((bell, wait)) => Readiness::Wait(bell, Some(wait)),
            None => Readiness::Wait(self.main.clone(), None),
        }
    }

    fn recv_until(&self, deadline: Instant) -> std::result::Result<T, RecvTimeoutError> {
        loop {
            if let Some(mut inbox) = self.inbox.try_lock() {
                return inbox.receive(&self.gauge, Wait::Until(deadline)).map_err(|m| m.or(RecvTimeoutError::Timeout));
            }
            // Another thread is receiving: look again shortly.
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(RecvTimeoutError::Timeout);
            }
            std::thread::sleep(left.min(Duration::from_millis(1)));
        }
    }

    fn readiness(&self) -> Option<Readiness> {
        match self.inbox.try_lock() {
            Some(mut inbox) => inbox.readiness(&self.gauge),
            // Another thread is receiving: wait until it is done, then look.
            None => Some(self.wait_for_holder()),
        }
    }
}

impl<T: DeserializeOwned> Receiver<T> {
    fn from_parts(
        main: Arc<Socket>,
        spill: Option<Arc<Socket>>,
        gauge: Gauge,
        leases: Arc<ConnectionLeases>,
        set_up: impl FnOnce(&mut Inbox),
    ) -> Receiver<T> {
        let segments = leases.segments().clone();
        let mut inbox = Inbox::new(main.clone(), leases);
        inbox.spill = spill;
        set_up(&mut inbox);
        inbox.came_with_end(&gauge);
        let inbox = Arc::new(InboxLock::new(inbox));
        let weak = Arc::downgrade(&inbox);
        // Never waits: a receiving thread holds the inbox, and will look itself.
        segments.watch_reads(Box::new(move || {
            let inbox = weak.upgrade()?;
            let mut inbox = inbox.try_lock()?;
            Some(inbox.everything_read())
        }));
        let not_inherited = std::sync::OnceLock::new();
        Receiver {
            flavor: ReceiverFlavor::Local(LocalReceiver { inbox, not_inherited, main, gauge, _message: PhantomData }),
        }
    }

    /// A child forked without `exec` closes this process's receiving end of the channel at
    /// once, so that its senders see it gone when this process is, not when its last forked
    /// child is (a queue's inbox, read by a thread that the child does not have); nothing for
    /// a remote receiver. The child must not use or drop its copy of this receiver.
    pub(crate) fn not_inherited(&self) {
        if let ReceiverFlavor::Local(local) = &self.flavor {
            local.not_inherited.get_or_init(|| crate::fork::NotInherited::new(crate::fork::Number::of(&*local.main)));
        }
    }

    /// Blocks until a message arrives or every sender is gone.
    ///
    /// ```
    /// let (tx, rx) = cuda_mp::channel::<u8>().unwrap();
    /// drop(tx);
    /// assert!(rx.recv().unwrap_err().is_disconnected());
    /// ```
    pub fn recv(&self) -> std::result::Result<T, RecvError> {
        match &self.flavor {
            ReceiverFlavor::Local(local) => local
                .inbox
                .lock()
                .receive(&local.gauge, Wait::Forever)
                .map_err(|m| m.or(RecvError::Io(IoFailure::other("a receive without limit returned nothing")))),
            ReceiverFlavor::Remote(remote) => remote.recv(None).map_err(|e| {
                e.failure().unwrap_or_else(|| RecvError::Io(IoFailure::other("a receive without limit timed out")))
            }),
        }
    }

    /// Returns a waiting message, if any, without blocking.
    ///
    /// ```
    /// let (_tx, rx) = cuda_mp::channel::<u8>().unwrap();
    /// assert!(rx.try_recv().unwrap_err().is_empty());
    /// ```
    pub fn try_recv(&self) -> std::result::Result<T, TryRecvError> {
        match &self.flavor {
            // Another thread receiving: whatever waits is its.
            ReceiverFlavor::Local(local) => local.inbox.try_lock().map_or(Err(TryRecvError::Empty), |mut inbox| {
                inbox.receive(&local.gauge, Wait::Not).map_err(|m| m.or(TryRecvError::Empty))
            }),
            ReceiverFlavor::Remote(remote) => remote
                .recv(Some(Instant::now()))
                .map_err(|e| e.failure().map_or(TryRecvError::Empty, TryRecvError::from)),
        }
    }

    /// Blocks until a message arrives, every sender is gone, or `timeout` passes.
    ///
    /// ```
    /// use std::time::Duration;
    /// let (_tx, rx) = cuda_mp::channel::<u8>().unwrap();
    /// assert!(rx.recv_timeout(Duration::from_millis(10)).unwrap_err().is_timeout());
    /// ```
    pub fn recv_timeout(&self, timeout: Duration) -> std::result::Result<T, RecvTimeoutError> {
        let Some(deadline) = Instant::now().checked_add(timeout) else {
            return self.recv().map_err(RecvTimeoutError::from);
        };
        match &self.flavor {
            ReceiverFlavor::Local(local) => local.recv_until(deadline),
            ReceiverFlavor::Remote(remote) => remote.recv(Some(deadline)),
        }
    }

    /// An iterator that receives until the channel disconnects. It also ends at the first
    /// failed receive (a malformed message, an i/o error), without saying so: use
    /// [`iter_results`](Self::iter_results) to see failures and go on past them.
    ///
    /// ```
    /// let (tx, rx) = cuda_mp::channel::<u8>().unwrap();
    /// for i in 0..3 {
    ///     tx.send(i).unwrap();
    /// }
    /// drop(tx);
    /// assert_eq!(rx.iter().collect::<Vec<_>>(), vec![0, 1, 2]);
    /// ```
    pub fn iter(&self) -> Iter<'_, T> {
        Iter { rx: self }
    }

    /// An iterator over every receive's result, until the channel disconnects: a message that
    /// does not decode yields `Err(RecvError::Malformed)` and the iterator goes on with the next
    /// one. It ends after [`RecvError::Disconnected`] (not yielded) and after an
    /// [`RecvError::Io`] (yielded: the channel is then unusable).
    ///
    /// ```
    /// let (tx, rx) = cuda_mp::channel::<u8>().unwrap();
    /// tx.send(1).unwrap();
    /// drop(tx);
    /// let all: Vec<Result<u8, cuda_mp::RecvError>> = rx.iter_results().collect();
    /// assert_eq!(all, vec![Ok(1)]);
    /// ```
    pub fn iter_results(&self) -> IterResults<'_, T> {
        IterResults { rx: self, done: false }
    }

    /// An iterator over the messages waiting now; it never blocks, and ends when none waits
    /// (or a receive fails).
    ///
    /// ```
    /// let (tx, rx) = cuda_mp::channel::<u8>().unwrap();
    /// tx.send(1).unwrap();
    /// tx.send(2).unwrap();
    /// assert_eq!(rx.try_iter().collect::<Vec<_>>(), vec![1, 2]);
    /// assert_eq!(rx.try_iter().count(), 0);
    /// ```
    pub fn try_iter(&self) -> TryIter<'_, T> {
        TryIter { rx: self }
    }
}

/// Iterator of [`Receiver::iter`] (and of `for x in &rx`): messages until the channel
/// disconnects or a receive fails.
///
/// ```
/// let (tx, rx) = cuda_mp::channel::<u8>().unwrap();
/// tx.send(5).unwrap();
/// drop(tx);
/// let mut it: cuda_mp::Iter<'_, u8> = rx.iter();
/// assert_eq!(it.next(), Some(5));
/// assert_eq!(it.next(), None);
/// ```
pub struct Iter<'a, T> {
    rx: &'a Receiver<T>,
}

impl<T: DeserializeOwned> Iterator for Iter<'_, T> {
    type Item = T;

    fn next(&mut self) -> Option<T> {
        self.rx.recv().ok()
    }
}

impl<T> fmt::Debug for Iter<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Iter").field("rx", self.rx).finish()
    }
}

/// Iterator of [`Receiver::try_iter`]: the messages waiting now.
///
/// ```
/// let (tx, rx) = cuda_mp::channel::<u8>().unwrap();
/// tx.send(5).unwrap();
/// let mut it: cuda_mp::TryIter<'_, u8> = rx.try_iter();
/// assert_eq!(it.next(), Some(5));
/// assert_eq!(it.next(), None);
/// ```
pub struct TryIter<'a, T> {
    rx: &'a Receiver<T>,
}

impl<T: DeserializeOwned> Iterator for TryIter<'_, T> {
    type Item = T;

    fn next(&mut self) -> Option<T> {
        self.rx.try_recv().ok()
    }
}

impl<T> fmt::Debug for TryIter<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TryIter").field("rx", self.rx).finish()
    }
}

/// Iterator of [`Receiver::iter_results`]: every receive's result until disconnection.
///
/// ```
/// let (tx, rx) = cuda_mp::channel::<u8>().unwrap();
/// drop(tx);
/// let mut it: cuda_mp::IterResults<'_, u8> = rx.iter_results();
/// assert!(it.next().is_none());
/// ```
pub struct IterResults<'a, T> {
    rx: &'a Receiver<T>,
    done: bool,
}

impl<T: DeserializeOwned> Iterator for IterResults<'_, T> {
    type Item = std::result::Result<T, RecvError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        match self.rx.recv() {
            Err(RecvError::Disconnected) => {
                self.done = true;
                None
            }
            Err(e @ RecvError::Io(_)) => {
                self.done = true;
                Some(Err(e))
            }
            other => Some(other),
        }
    }
}

impl<T> fmt::Debug for IterResults<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IterResults").field("rx", self.rx).field("done", &self.done).finish()
    }
}

/// Iterator of a receiver taken by value (`for x in rx`): messages until the channel
/// disconnects or a receive fails.
///
/// ```
/// let (tx, rx) = cuda_mp::channel::<u8>().unwrap();
/// tx.send(1).unwrap();
/// drop(tx);
/// let it: cuda_mp::IntoIter<u8> = rx.into_iter();
/// assert_eq!(it.collect::<Vec<_>>(), vec![1]);
/// ```
pub struct IntoIter<T> {
    rx: Receiver<T>,
}

impl<T: DeserializeOwned> Iterator for IntoIter<T> {
    type Item = T;

    fn next(&mut self) -> Option<T> {
        self.rx.recv().ok()
    }
}

impl<T> fmt::Debug for IntoIter<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IntoIter").field("rx", &self.rx).finish()
    }
}

/// `for x in &rx`: like [`Receiver::iter`].
///
/// ```
/// let (tx, rx) = cuda_mp::channel::<u8>().unwrap();
/// tx.send(1).unwrap();
/// tx.send(2).unwrap();
/// drop(tx);
/// let mut sum = 0;
/// for x in &rx {
///     sum += x;
/// }
/// assert_eq!(sum, 3);
/// ```
impl<'a, T: DeserializeOwned> IntoIterator for &'a Receiver<T> {
    type Item = T;
    type IntoIter = Iter<'a, T>;

    fn into_iter(self) -> Iter<'a, T> {
        self.iter()
    }
}

/// `for x in rx`: like [`Receiver::iter`], owning the receiver.
///
/// ```
/// let (tx, rx) = cuda_mp::channel::<u8>().unwrap();
/// tx.send(7).unwrap();
/// drop(tx);
/// for x in rx {
///     assert_eq!(x, 7);
/// }
/// ```
impl<T: DeserializeOwned> IntoIterator for Receiver<T> {
    type Item = T;
    type IntoIter = IntoIter<T>;

    fn into_iter(self) -> IntoIter<T> {
        IntoIter { rx: self }
    }
}

/// A receiver as it travels: the socket, the spill batch being read, the shared counters, and
/// the connection leases its senders introduced (messages still on the socket name them).
#[derive(Serialize, Deserialize)]
struct ReceiverWire {
    main: Carried,
    spill: Option<Carried>,
    gauge: Carried,
    leases: Vec<(ConnectionKey, Lease)>,
    /// The senders' rings: memory and pipe end of each.
    rings: Vec<(Carried, Carried)>,
    /// A frame read before its turn (`inbox.rs`): its bytes, descriptors, whether it came
    /// from the socket and why it is lost, if it is.
    stash: Option<(Vec<u8>, Vec<Carried>, bool, Option<crate::sys::Lost>)>,
    /// Whether messages were lost whose places in their senders' order are unknown.
    gaps: bool,
    /// The caching allocators' segments the senders introduced (messages still on the socket
    /// name them), each with the sending process that did.
    segments: Vec<(u128, CarriedSegment)>,
}

/// A segment a receiving end keeps, as it travels.
#[derive(Serialize, Deserialize)]
enum CarriedSegment {
    Host(crate::storage::CarriedSegment<crate::host::HostSegment>),
    #[cfg(feature = "cuda")]
    Gpu(crate::storage::CarriedSegment<crate::GpuStorage>),
}

/// Adopts a segment that a message on a channel introduces (`wire::decode_on`): its kind's
/// tag and record.
pub(super) fn adopt_segment(tag: u8, record: &[u8]) -> Result<()> {
    match crate::storage::SegmentTag::from_tag(tag) {
        Some(crate::storage::SegmentTag::Host) => {
            crate::storage::CarriedSegment::<crate::host::HostSegment>::introduced(record)
        }
        #[cfg(feature = "cuda")]
        Some(crate::storage::SegmentTag::Gpu) => {
            crate::storage::CarriedSegment::<crate::GpuStorage>::introduced(record)
        }
        _ => Err(Error::Malformed(format!(
            "a message introduces a segment of kind {tag}, which this build does not know"
        ))),
    }
}

impl CarriedSegment {
    fn carry(segment: &crate::lifetime::AnyStorage) -> Result<CarriedSegment> {
        if let Some(host) = crate::storage::CarriedSegment::carry(segment) {
            return host.map(CarriedSegment::Host);
        }
        #[cfg(feature = "cuda")]
        if let Some(gpu) = crate::storage::CarriedSegment::carry(segment) {
            return gpu.map(CarriedSegment::Gpu);
        }
        Err(Error::Unsupported("a receiver keeps a segment of an unknown kind".into()))
    }

    fn adopt(self, via: u128) -> Option<crate::lifetime::TravelledSegment> {
        match self {
            CarriedSegment::Host(host) => host.adopt(via),
            #[cfg(feature = "cuda")]
            CarriedSegment::Gpu(gpu) => gpu.adopt(via),
        }
    }
}

impl<T> Serialize for Receiver<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let ReceiverFlavor::Local(local) = &self.flavor else { return Err(stays_here("receiver")) };
        let mut inbox = local.inbox.lock();
        inbox.settle_all(&local.gauge);
        let spill = inbox.spill.as_ref().map(carry_socket).transpose()?;
        let leases = inbox.leases.all();
        let rings = inbox
            .rings
            .iter()
            .map(|ring| {
                let (memory, alive) = ring.descriptors();
                Ok((wire::carry(memory, None)?, wire::carry(alive, None)?))
            })
            .collect::<Result<Vec<_>>>()
            .map_err(wire::encode_error)?;
        let stash = inbox
            .stashed()
            .map(|(bytes, fds, main, dropped)| {
                let carry = |fd: std::os::fd::BorrowedFd<'_>| {
                    wire::carry(Arc::new(fd.try_clone_to_owned().map_err(wire::io_error)?), None)
                };
                Ok((bytes, fds.into_iter().map(carry).collect::<Result<Vec<_>>>()?, main, dropped))
            })
            .transpose()
            .map_err(wire::encode_error)?;
        let segments = inbox
            .leases
            .segments()
            .all()
            .into_iter()
            .map(|((via, _), segment)| Ok((via, CarriedSegment::carry(&segment)?)))
            .collect::<Result<Vec<_>>>()
            .map_err(wire::encode_error)?;
        ReceiverWire {
            main: carry_socket(&local.main)?,
            spill,
            gauge: carry_gauge(&local.gauge)?,
            leases,
            rings,
            stash,
            gaps: inbox.gaps,
            segments,
        }
        .serialize(serializer)
    }
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for Receiver<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let wire = ReceiverWire::deserialize(deserializer)?;
        let main = take_socket(wire.main)?;
        let spill = wire.spill.map(take_socket).transpose()?;
        let gauge = take_gauge(wire.gauge)?;
        let rings = wire
            .rings
            .into_iter()
            .map(|(memory, alive)| {
                let (memory, alive) = (wire::take(memory)?, wire::take(alive)?);
                RingReader::adopt(memory, alive).map_err(Error::Malformed)
            })
            .collect::<Result<Vec<_>>>()
            .map_err(wire::decode_error)?;
        // Waits announced where the end was before are over: this process waits now.
        gauge.forget_sleepers();
        let stash = wire
            .stash
            .map(|(bytes, fds, main, dropped)| {
                Ok((bytes, fds.into_iter().map(wire::take).collect::<Result<Vec<_>>>()?, main, dropped))
            })
            .transpose()
            .map_err(wire::decode_error)?;
        // Each mapped here; one that cannot be fails only the blocks that name it.
        let segments = wire.segments.into_iter().filter_map(|(via, segment)| segment.adopt(via)).collect();
        let leases = ConnectionLeases::from_leases(wire.leases, segments);
        Ok(Receiver::from_parts(main, spill, gauge, leases, |inbox| {
            inbox.rings = rings;
            inbox.gaps = wire.gaps;
            if wire.gaps {
                // Which rings a lost batch may have held messages of did not travel: all.
                inbox.rings.iter_mut().for_each(RingReader::batch_lost);
            }
            if let Some((bytes, fds, main, dropped)) = stash {
                inbox.restash(&bytes, fds, main, dropped);
            }
        }))
    }
}

/// Decodes one frame's bytes and descriptors as a receiver does (for fuzzing): the message as
/// `T` (`None` for a frame of another kind, read and dropped), or why it does not decode.
#[cfg(all(feature = "cuda", any(test, feature = "testing")))]
pub(crate) fn decode_frame<T: DeserializeOwned>(
    bytes: &[u8],
    fds: Vec<OwnedFd>,
) -> std::result::Result<Option<T>, String> {
    let leases: Arc<ConnectionLeases> = Default::default();
    match frame::read::<T>(bytes, fds, Some(&leases))? {
        frame::Incoming::Message { value, .. } => value.map(Some),
        _ => Ok(None),
    }
}

#[cfg(all(feature = "cuda", any(test, feature = "testing")))]
impl<T> Receiver<T> {
    /// The next frame on this receiver's socket as it arrived, not decoded (`None` when none
    /// came within `timeout`, or for a remote receiver).
    pub(crate) fn read_raw_frame(&self, timeout: Duration) -> io::Result<Option<crate::sys::Message>> {
        let ReceiverFlavor::Local(local) = &self.flavor else { return Ok(None) };
        match local.main.recv(frame::BUFFER, Wait::Until(crate::os::instant_after(timeout))) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            other => other,
        }
    }
}

/// One end of a two-way connection made by [`pipe`]: it sends `S` and receives `R`.
///
/// ```
/// let (a, b) = cuda_mp::pipe::<u8, String>().unwrap();
/// a.send(3).unwrap();
/// b.send(format!("got {}", b.recv().unwrap())).unwrap();
/// assert_eq!(a.recv().unwrap(), "got 3");
/// ```
#[derive(Serialize, Deserialize)]
#[serde(bound(serialize = "", deserialize = "R: DeserializeOwned"))]
pub struct Duplex<S, R> {
    tx: Sender<S>,
    rx: Receiver<R>,
}

impl<S, R> fmt::Debug for Duplex<S, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Duplex")
            .field("sends", &std::any::type_name::<S>())
            .field("receives", &std::any::type_name::<R>())
            .finish()
    }
}

/// Creates a two-way connection, like `multiprocessing.Pipe()`: the first end sends `A` and
/// receives `B`, the second sends `B` and receives `A`. Both directions are unbounded
/// channels.
///
/// ```
/// let (here, there) = cuda_mp::pipe::<u8, u8>().unwrap();
/// there.send(9).unwrap();
/// assert_eq!(here.recv().unwrap(), 9);
/// ```
pub fn pipe<A, B>() -> Result<(Duplex<A, B>, Duplex<B, A>)>
where
    A: Serialize + DeserializeOwned,
    B: Serialize + DeserializeOwned,
{
    let (tx_a, rx_a) = channel::<A>()?;
    let (tx_b, rx_b) = channel::<B>()?;
    Ok((Duplex { tx: tx_a, rx: rx_b }, Duplex { tx: tx_b, rx: rx_a }))
}

impl<S: Serialize + DeserializeOwned, R: Serialize + DeserializeOwned> Duplex<S, R> {
    /// Sends to the other end.
    ///
    /// ```
    /// let (a, b) = cuda_mp::pipe::<u8, u8>().unwrap();
    /// a.send(1).unwrap();
    /// assert_eq!(b.recv().unwrap(), 1);
    /// ```
    pub fn send(&self, value: S) -> std::result::Result<(), SendError<S>> {
        self.tx.send(value)
    }

    /// Receives from the other end, blocking.
    ///
    /// ```
    /// let (a, b) = cuda_mp::pipe::<u8, u8>().unwrap();
    /// b.send(2).unwrap();
    /// assert_eq!(a.recv().unwrap(), 2);
    /// ```
    pub fn recv(&self) -> std::result::Result<R, RecvError> {
        self.rx.recv()
    }

    /// Receives from the other end without blocking.
    ///
    /// ```
    /// let (a, _b) = cuda_mp::pipe::<u8, u8>().unwrap();
    /// assert!(a.try_recv().unwrap_err().is_empty());
    /// ```
    pub fn try_recv(&self) -> std::result::Result<R, TryRecvError> {
        self.rx.try_recv()
    }

    /// Receives from the other end, giving up after `timeout`.
    ///
    /// ```
    /// use std::time::Duration;
    /// let (a, _b) = cuda_mp::pipe::<u8, u8>().unwrap();
    /// assert!(a.recv_timeout(Duration::from_millis(10)).unwrap_err().is_timeout());
    /// ```
    pub fn recv_timeout(&self, timeout: Duration) -> std::result::Result<R, RecvTimeoutError> {
        self.rx.recv_timeout(timeout)
    }

    /// Splits into the sending and receiving halves.
    ///
    /// ```
    /// let (a, b) = cuda_mp::pipe::<u8, u8>().unwrap();
    /// let (tx, _rx) = a.split();
    /// tx.send(4).unwrap();
    /// assert_eq!(b.recv().unwrap(), 4);
    /// ```
    pub fn split(self) -> (Sender<S>, Receiver<R>) {
        (self.tx, self.rx)
    }
}

/// The most bytes a named connection's hello may have (a message type's name is in it).
const HELLO_BYTES: usize = 64 << 10;

/// How long an accepted peer has to say hello.
const HELLO_WAIT: Duration = Duration::from_secs(10);
/// How long a connect by name waits for room in the listener's backlog.
const CONNECT_WAIT: Duration = Duration::from_secs(10);
/// How long an accept waits for a peer's hello at least, past the caller's own deadline (a
/// cuda-mp sender says hello as it connects; a loaded host may take a while).
const HELLO_GRACE: Duration = Duration::from_secs(1);

/// Waits for one unrelated process to connect by name (see [`Sender::connect`]).
///
/// ```
/// let listener = cuda_mp::Listener::<String>::bind().unwrap();
/// assert!(!listener.name().is_empty());
/// ```
pub struct Listener<T> {
    listening: Listening,
    name: String,
    path: PathBuf,
    _message: PhantomData<fn() -> T>,
}

impl<T> fmt::Debug for Listener<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Listener").field("name", &self.name).finish_non_exhaustive()
    }
}

impl<T> Drop for Listener<T> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl<T: Serialize + DeserializeOwned> Listener<T> {
    /// Creates a listener with a fresh name: a socket in a directory that only this user may
    /// enter.
    ///
    /// ```
    /// let listener = cuda_mp::Listener::<u8>::bind().unwrap();
    /// println!("connect to {}", listener.name());
    /// ```
    pub fn bind() -> Result<Listener<T>> {
        let dir = crate::sys::private_dir().map_err(wire::io_error)?;
        let path = dir.join(format!("listener-{:032x}", crate::sys::random_u128()));
        let listening = Listening::bind(&path).map_err(wire::io_error)?;
        let name =
            path.to_str().ok_or_else(|| Error::Io(io::Error::other("the listener's path is not text")))?.to_owned();
        Ok(Listener { listening, name, path, _message: PhantomData })
    }

    /// The name a peer passes to [`Sender::connect`].
    ///
    /// ```
    /// let listener = cuda_mp::Listener::<u8>::bind().unwrap();
    /// let _tx = cuda_mp::Sender::<u8>::connect(listener.name()).unwrap();
    /// ```
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Writes the name to `path` (atomically: a reader never sees half of it), as a file of
    /// this user's alone, mode 600. Pick a path others cannot take first: in a directory of
    /// this user's alone.
    ///
    /// ```
    /// let listener = cuda_mp::Listener::<u8>::bind().unwrap();
    /// // Beside the listener's socket, in a directory of this user's alone.
    /// let path = format!("{}.name", listener.name());
    /// listener.publish_to(&path).unwrap();
    /// assert_eq!(std::fs::read_to_string(&path).unwrap(), listener.name());
    /// std::fs::remove_file(&path).unwrap();
    /// ```
    pub fn publish_to(&self, path: impl AsRef<Path>) -> Result<()> {
        Ok(crate::sys::publish(path.as_ref(), &self.name)?)
    }

    /// Blocks until a peer connects; returns the receiving end of the connection.
    ///
    /// ```
    /// let listener = cuda_mp::Listener::<u8>::bind().unwrap();
    /// let tx = cuda_mp::Sender::<u8>::connect(listener.name()).unwrap();
    /// let rx = listener.accept().unwrap();
    /// tx.send(5).unwrap();
    /// assert_eq!(rx.recv().unwrap(), 5);
    /// ```
    pub fn accept(self) -> Result<Receiver<T>> {
        self.accept_until(Wait::Forever, Duration::MAX)
    }

    /// Like [`accept`](Self::accept), giving up after `timeout`.
    ///
    /// ```
    /// use std::time::Duration;
    /// let listener = cuda_mp::Listener::<u8>::bind().unwrap();
    /// let err = listener.accept_timeout(Duration::from_millis(50)).unwrap_err();
    /// assert!(err.is_timeout());
    /// ```
    pub fn accept_timeout(self, timeout: Duration) -> Result<Receiver<T>> {
        self.accept_until(Instant::now().checked_add(timeout).map_or(Wait::Forever, Wait::Until), timeout)
    }

    /// Like [`accept_timeout`](Self::accept_timeout), keeping the listener: `Ok(None)` when no
    /// peer came in time, and the listener waits again at the next call (a caller that waits in
    /// slices, to look at something else between them).
    ///
    /// ```
    /// use std::time::Duration;
    /// let listener = cuda_mp::Listener::<u8>::bind().unwrap();
    /// assert!(listener.try_accept_for(Duration::from_millis(20)).unwrap().is_none());
    /// let tx = cuda_mp::Sender::<u8>::connect(listener.name()).unwrap();
    /// let rx = listener.try_accept_for(Duration::from_secs(10)).unwrap().expect("a peer came");
    /// tx.send(3).unwrap();
    /// assert_eq!(rx.recv().unwrap(), 3);
    /// ```
    pub fn try_accept_for(&self, timeout: Duration) -> Result<Option<Receiver<T>>> {
        let wait = Instant::now().checked_add(timeout).map_or(Wait::Forever, Wait::Until);
        match self.accept_until(wait, timeout) {
            Err(Error::Timeout(_)) => Ok(None),
            other => other.map(Some),
        }
    }

    fn accept_until(&self, wait: Wait, timeout: Duration) -> Result<Receiver<T>> {
        // A peer of another user is refused here, before anything of it is read.
        let socket = match self.listening.accept(wait) {
            Ok(socket) => socket,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Err(Error::Timeout(timeout)),
            Err(e) => return Err(wire::io_error(e)),
        };
        // The hello is waited for within the caller's time (a moment past it at least), and at
        // most `HELLO_WAIT`: a peer that connects and says nothing holds no caller past its
        // timeout (a slice of `try_accept_for` then finds no peer).
        let now = Instant::now();
        let by = match wait {
            Wait::Until(deadline) => deadline.max(now + HELLO_GRACE).min(now + HELLO_WAIT),
            _ => now + HELLO_WAIT,
        };
        let (gauge, sends) = match accept_hello::<T>(&socket, by) {
            Err(Error::Timeout(_)) if matches!(wait, Wait::Until(_)) && by < now + HELLO_WAIT => {
                return Err(Error::Timeout(timeout));
            }
            Err(Error::Timeout(_)) => {
                return Err(Error::Malformed(format!("the peer said no hello within {HELLO_WAIT:?}")));
            }
            other => other?,
        };
        tracing::debug!(listener = self.name(), "accepted a sender");
        Ok(Receiver::from_parts(Arc::new(socket), None, gauge, Default::default(), |inbox| inbox.sender_sends = sends))
    }
}

/// The connection's shared counters, once the peer said hello, and what the peer sends when
/// that is not `T` (see [`Listener::accept`]); `Error::Timeout` when no hello came by `by`.
fn accept_hello<T>(socket: &Socket, by: Instant) -> Result<(Gauge, Option<String>)> {
    let hello = match socket.recv(HELLO_BYTES, Wait::Until(by)) {
        Ok(Some(hello)) => hello,
        Ok(None) => return Err(Error::Malformed("the peer closed the connection before its hello".into())),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Err(Error::Timeout(Duration::ZERO)),
        Err(e) if e.kind() == io::ErrorKind::InvalidData => return Err(Refusal::Foreign.error()),
        Err(e) => return Err(wire::io_error(e)),
    };
    let said = Hello::<()>::decode(&hello.bytes).map_err(|r| r.error())?;
    let [fd] = <[OwnedFd; 1]>::try_from(hello.fds).map_err(|_| Refusal::Foreign.error())?;
    let memory = MemoryFile::open(fd, gauge::BYTES).map_err(|_| Refusal::Foreign.error())?;
    let other = (!said.sends::<T>()).then_some(said.message);
    Ok((Gauge::from_memory(Arc::new(memory))?, other))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A sender of a channel that arrives here while this process's last one is being dropped
    /// on another thread (its ring still holding messages) takes the ring back: its messages
    /// come after those, not before.
    #[test]
    fn a_sender_that_arrives_while_the_last_one_goes_keeps_the_order() {
        let (tx, rx) = channel::<u64>().unwrap();
        for i in 0..20 {
            tx.send(i).unwrap();
            assert_eq!(rx.recv().unwrap(), i);
        }
        // Three to the ring, unread.
        for i in 20..23 {
            tx.send(i).unwrap();
        }
        let (carrier_tx, carrier_rx) = channel::<Sender<u64>>().unwrap();
        carrier_tx.send(tx.clone()).unwrap();
        outbox::DROP_PAUSE_MS.store(200, std::sync::atomic::Ordering::SeqCst);
        let dropping = std::thread::spawn(move || drop(tx));
        std::thread::sleep(Duration::from_millis(50));
        // Arrives while the last handle's drop waits before it parks the ring.
        let heir = carrier_rx.recv().unwrap();
        outbox::DROP_PAUSE_MS.store(0, std::sync::atomic::Ordering::SeqCst);
        heir.send(23).unwrap();
        dropping.join().unwrap();
        let got: Vec<u64> = (0..4).map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap()).collect();
        assert_eq!(got, [20, 21, 22, 23]);
    }

    /// Frames without a place in an order (a process that never made a ring on the channel:
    /// its messages carry descriptors, or are too large for a ring) give back what their
    /// sender counted: with everything read, the count of what is on the socket is back at 0
    /// (it drifted up by 32 bytes a frame, until every send spilled).
    #[test]
    fn frames_read_give_back_what_their_sender_counted() {
        let (tx, rx) = channel::<Sender<u8>>().unwrap();
        let (inner, _inner_rx) = channel::<u8>().unwrap();
        for _ in 0..100 {
            tx.send(inner.clone()).unwrap();
            drop(rx.recv().unwrap());
        }
        let (large_tx, large_rx) = channel::<Vec<u8>>().unwrap();
        for _ in 0..100 {
            large_tx.send(vec![3u8; 100_000]).unwrap();
            assert_eq!(large_rx.recv().unwrap().len(), 100_000);
        }
        for (rx, gauge) in [(rx.lock(), &tx.outbox().gauge), (large_rx.lock(), &large_tx.outbox().gauge)] {
            let mut rx = rx;
            rx.settle_all(gauge);
            assert_eq!(gauge.queued(), 0, "100 frames, all read and settled");
        }
    }

    /// A wake frame whose message was already taken does not make a receiver ready, and a
    /// frame that only looks like one is reported, not dropped.
    #[test]
    fn a_stale_wake_is_not_readiness_and_a_forged_one_is_reported() {
        let (tx, rx) = channel::<u32>().unwrap();
        tx.send(1).unwrap();
        assert_eq!(rx.recv().unwrap(), 1);
        tx.outbox().write_raw(&[4], &[]);
        let mut select = Select::new();
        select.add(&rx);
        assert!(select.select_timeout(Duration::from_millis(50)).unwrap_err().is_timeout(), "a stale wake");
        assert_eq!(rx.try_recv(), Err(TryRecvError::Empty));
        // The same bytes with a descriptor attached: not a wake frame.
        let fd = crate::sys::bell().unwrap();
        tx.outbox().write_raw(&[4], &[fd.as_fd()]);
        assert_eq!(select.select_timeout(Duration::from_secs(5)), Ok(0));
        assert!(matches!(rx.try_recv(), Err(TryRecvError::Malformed(_))));
        tx.send(2).unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(2), "the channel goes on");
    }

    /// A message frame that fails before its message is decoded (here its place in its
    /// sender's order is cut short; a lease that cannot be reopened fails the same way) gives
    /// the place its sender took on a bounded channel back: it used to stay taken, and a full
    /// channel's sends then waited for a message that would never be read.
    #[test]
    fn a_message_frame_that_cannot_be_read_gives_its_place_back() {
        let (tx, rx) = bounded::<u32>(1).unwrap();
        let gauge = &tx.outbox().gauge;
        assert!(gauge.take_place(Some(None), || false).is_ok(), "the one place is free");
        tx.outbox().write_raw(&[crate::protocol::kind::MESSAGE | 0x40, 1, 2, 3], &[]);
        assert!(matches!(rx.recv_timeout(Duration::from_secs(5)), Err(RecvTimeoutError::Malformed(_))));
        tx.send_timeout(7, Duration::from_secs(1)).expect("the place is back");
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(7));
    }

    /// A message frame whose descriptors do not add up (its transport header claims one that
    /// did not come: only a forger writes that) is reported as malformed and gives back the
    /// place it took, as one whose message does not decode does.
    #[test]
    fn a_message_frame_whose_descriptors_do_not_add_up_gives_its_place_back() {
        let (tx, rx) = bounded::<u32>(1).unwrap();
        let gauge = &tx.outbox().gauge;
        assert!(gauge.take_place(Some(None), || false).is_ok(), "the one place is free");
        let frame = [&[crate::protocol::kind::MESSAGE][..], &postcard::to_allocvec(&7u32).unwrap(), &[0]].concat();
        tx.outbox().write_forged(1, &frame);
        match rx.recv_timeout(Duration::from_secs(5)) {
            Err(RecvTimeoutError::Malformed(why)) => assert!(why.contains("do not match its header"), "{why}"),
            other => panic!("a forged frame read as {other:?}"),
        }
        tx.send_timeout(8, Duration::from_secs(1)).expect("the place is back");
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(8));
    }

    /// A redirect that the kernel refuses for a passing reason (no buffers; descriptors in
    /// flight past a user's limit) is written again: the backlog arrives whole and in order,
    /// where the channel used to be disconnected and the backlog dropped.
    #[test]
    fn a_redirect_refused_for_a_passing_reason_is_written_again() {
        let (tx, rx) = channel::<Vec<u8>>().unwrap();
        tx.outbox().refuse_redirects(Some(3));
        // Too large for a ring, and together far more than the socket holds: they spill.
        let sent = 300u32;
        for i in 0..sent {
            tx.send(vec![(i % 251) as u8; 8_000]).unwrap();
        }
        for i in 0..sent {
            let got = rx.recv_timeout(Duration::from_secs(10)).unwrap();
            assert_eq!((got.len(), got[0]), (8_000, (i % 251) as u8), "message {i}");
        }
        assert_eq!(tx.outbox().refuse_redirects(None), 0, "every refusal was met");
        tx.send(vec![1]).unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(vec![1]), "the channel goes on");
    }

    /// A receiving end keeps at most `MAX_RINGS` rings; the writer of one it refuses writes
    /// nothing to it, and no writer writes before its ring is adopted.
    #[test]
    fn a_receiver_keeps_a_bounded_number_of_rings() {
        let (tx, rx) = channel::<u32>().unwrap();
        let mut writers = Vec::new();
        for _ in 0..ring::MAX_RINGS + 3 {
            let (mut writer, introduction) = ring::RingWriter::new().unwrap();
            assert!(!writer.push(&7u32.to_le_bytes()), "nothing written before the ring is adopted");
            tx.outbox().write_frame(&FrameOut::Ring(&introduction));
            writers.push(writer);
        }
        assert_eq!(rx.try_recv(), Err(TryRecvError::Empty));
        assert_eq!(rx.lock().rings.len(), ring::MAX_RINGS);
        let writing = writers.iter_mut().map(|w| w.push(&[1])).filter(|&wrote| wrote).count();
        assert_eq!(writing, ring::MAX_RINGS, "the writers of refused rings take the socket");
    }

    /// A receiver that never finds its channel empty (every receive finds a message waiting on
    /// the socket) still lets go of what senders gone left: their connection leases and their
    /// rings, and it passes over a gap in a gone sender's order (its lost backlog), once it has
    /// read past everything they wrote. Only an idle receiver did, before. While a ring holds
    /// an entry written before the senders were found gone (its writer's pipe still open, as
    /// in a process that forked), their leases are kept: that entry may name them.
    #[test]
    fn a_receiver_that_is_never_idle_lets_go_of_senders_gone() {
        use crate::lifetime::{ConnectionKey, Introduction, Lease};
        let (tx, rx) = channel::<Vec<u8>>().unwrap();
        let message = |v: Vec<u8>| [postcard::to_allocvec(&v).unwrap(), vec![0]].concat();
        // Past a ring entry's size: these take the socket.
        let big = || vec![1u8; 9 << 10];
        tx.send(big()).unwrap();
        // A sender whose ring holds a message numbered after one it lost.
        let (writer, ring_intro) = ring::RingWriter::new().unwrap();
        tx.outbox().write_frame(&FrameOut::Ring(&ring_intro));
        // Senders gone, each having introduced its connection lease.
        for key in 0..40 {
            let (owner_end, lease) = crate::sys::lease_pipe().unwrap();
            drop(owner_end);
            let intro = [Introduction {
                name: ConnectionKey { owner: 7, key },
                lease: Lease::accept(Arc::new(lease)).unwrap(),
            }];
            let bytes = message(vec![2]);
            tx.outbox().write_frame(&FrameOut::message(&bytes, 1 << 20, &intro).unwrap());
        }
        let mut writer = Some(writer);
        let gap_passed = std::cell::Cell::new(false);
        let receive = || {
            tx.send(big()).unwrap();
            if rx.recv_timeout(Duration::from_secs(5)).expect("a message") == [9] {
                gap_passed.set(true);
            }
            let inbox = rx.lock();
            (inbox.leases.all().len(), inbox.rings.len())
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while receive() != (40, 1) {
            assert!(Instant::now() < deadline, "the leases and the ring were not all adopted");
        }
        let w = writer.as_mut().expect("not dropped yet");
        w.sent();
        assert!(w.push(&message(vec![9])), "the ring was adopted");
        for _ in 0..4 * inbox::BUSY_SWEEP_EVERY {
            assert_eq!(receive(), (40, 1), "let go while a ring's entry written before was unread");
        }
        assert!(!gap_passed.get(), "its writer lives: the message before it may still come");
        // Its writer goes: its gap is passed over, and then everything is let go.
        drop(writer.take());
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if receive() == (0, 0) && gap_passed.get() {
                return;
            }
        }
        panic!("after 20 s of receives: gap passed {}, leases and rings kept {:?}", gap_passed.get(), receive());
    }

    /// An empty message written to the channel's socket by a peer that is not cuda-mp's (it
    /// holds a sender's socket) is malformed, not the channel's end: the receives after it go
    /// on (it read as `Disconnected`, before).
    #[test]
    fn an_empty_message_is_not_the_channels_end() {
        use std::os::fd::AsRawFd;
        let (tx, rx) = channel::<u32>().unwrap();
        tx.send(1).unwrap();
        // SAFETY: a send of no bytes on a socket this test holds.
        let sent = unsafe { libc::send(tx.outbox().main.as_fd().as_raw_fd(), std::ptr::null(), 0, 0) };
        assert_eq!(sent, 0);
        tx.send(2).unwrap();
        assert_eq!(rx.recv(), Ok(1));
        assert!(matches!(rx.recv(), Err(RecvError::Malformed(m)) if m.contains("empty")));
        assert_eq!(rx.recv(), Ok(2));
    }
}

#[cfg(test)]
mod forged_counters {
    use std::os::fd::AsFd;

    use super::*;
    use crate::HostTensor;

    /// A channel whose counters carry another channel's id does not share that channel's
    /// connection lease in the sending process (introduced on one, it would be named
    /// unintroduced on the other).
    #[test]
    fn a_forged_channel_id_does_not_share_a_connection_lease() {
        let (tx_a, rx_a) = channel::<HostTensor<u8>>().unwrap();
        let (tx_b, rx_b) = channel::<HostTensor<u8>>().unwrap();
        let a_id = tx_a.outbox().gauge.id();
        tx_b.outbox().gauge.memory().unwrap().word(8).unwrap().store(a_id, std::sync::atomic::Ordering::SeqCst);
        let (bytes, held) = wire::encode_scope(|| postcard::to_allocvec(&tx_b));
        let fds = held.iter().map(|h| h.as_fd().try_clone_to_owned().unwrap()).collect();
        let forged_b: Sender<HostTensor<u8>> = wire::decode(&bytes.unwrap(), fds).unwrap();
        drop(tx_b);
        let t = HostTensor::<u8>::from_vec(&[4], vec![1, 2, 3, 4]).unwrap();
        forged_b.send(t.clone()).unwrap();
        tx_a.send(t.clone()).unwrap();
        let got_b = rx_b.recv_timeout(std::time::Duration::from_secs(5)).map(|t| t.to_vec());
        let got_a = rx_a.recv_timeout(std::time::Duration::from_secs(5)).map(|t| t.to_vec());
        assert_eq!(got_b, Ok(vec![1, 2, 3, 4]));
        assert_eq!(got_a, Ok(vec![1, 2, 3, 4]));
    }
}
