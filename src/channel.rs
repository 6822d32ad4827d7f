//! Typed channels between processes: `channel`, `pipe`, and connections by name.

use std::fmt;
use std::io;
use std::marker::PhantomData;
use std::path::Path;
use std::time::{Duration, Instant};

use ipc_channel::ipc::{self, IpcOneShotServer, IpcReceiver, IpcSender, OpaqueIpcReceiver, OpaqueIpcSender};
use ipc_channel::{IpcError, TryRecvError as IpcTryRecvError};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, RecvError, RecvTimeoutError, Result, SendError, SendFailure, TryRecvError};
use crate::os::{catch_quietly, descriptor_limit, near_descriptor_limit, out_of_descriptors};
use crate::wire;

/// Creates a channel between processes. Either end can be sent to another process (as a spawn
/// argument or inside a message); the sender can be cloned and sent to many processes.
///
/// The receiver reports [`RecvError::Disconnected`] once every sender is dropped, including
/// senders held by processes that died; a process that keeps a sender of its own therefore
/// never sees the channel disconnect.
///
/// ```
/// let (tx, rx) = cuda_mp::channel::<u32>().unwrap();
/// tx.send(7).unwrap();
/// assert_eq!(rx.recv().unwrap(), 7);
/// ```
pub fn channel<T: Serialize + DeserializeOwned>() -> Result<(Sender<T>, Receiver<T>)> {
    let (tx, rx) = ipc::channel::<T>()?;
    Ok((Sender::from_ipc(tx), Receiver { inner: rx }))
}

/// The sending end of a channel. Clone it for several producers, in this process or others.
///
/// ```
/// let (tx, rx) = cuda_mp::channel::<String>().unwrap();
/// let tx2 = tx.clone();
/// tx2.send("from a clone".into()).unwrap();
/// assert_eq!(rx.recv().unwrap(), "from a clone");
/// ```
pub struct Sender<T> {
    inner: OpaqueIpcSender,
    _message: PhantomData<fn(T)>,
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        Sender { inner: self.inner.clone(), _message: PhantomData }
    }
}

impl<T> fmt::Debug for Sender<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sender").field("message", &std::any::type_name::<T>()).finish_non_exhaustive()
    }
}

/// Serializes a borrowed message, so that a failed send can hand the value back.
struct Outgoing<'a, T>(&'a T);

impl<T: Serialize> Serialize for Outgoing<'_, T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

impl<'de, T> Deserialize<'de> for Outgoing<'_, T> {
    fn deserialize<D: Deserializer<'de>>(_: D) -> std::result::Result<Self, D::Error> {
        Err(serde::de::Error::custom("outgoing messages are never decoded"))
    }
}

fn is_disconnect(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset | io::ErrorKind::NotConnected)
}

/// Sends one message with the side channel of its descriptors, then the descriptors that did
/// not fit in it.
pub(crate) fn send_message<M: Serialize>(tx: &IpcSender<M>, message: M) -> std::result::Result<(), SendFailure> {
    let (sent, overflow) = wire::encode_scope(|| catch_quietly(move || tx.send(message)));
    if !matches!(sent, Ok(Ok(()))) {
        wire::discard_leftovers();
    }
    match sent {
        Ok(Ok(())) => overflow.send().map_err(|e| match e {
            Error::OutOfDescriptors { limit } => SendFailure::OutOfDescriptors { limit },
            Error::Io(e) if is_disconnect(&e) => SendFailure::Disconnected,
            other => SendFailure::Io(other.to_string()),
        }),
        Ok(Err(e)) => Err(send_failure(e)),
        // The transport asserts instead of failing when a message holds more than 64 of its
        // own descriptors (channels in the message beside our tensors').
        Err(panic) if panic.contains("MAX_FDS_IN_CMSG") => Err(SendFailure::Io(format!(
            "the message holds more than 64 channels and shared-memory regions of its own ({panic})"
        ))),
        Err(panic) => Err(SendFailure::Io(format!("the transport failed: {panic}"))),
    }
}

fn send_failure(e: IpcError) -> SendFailure {
    if out_of_descriptors() {
        return SendFailure::OutOfDescriptors { limit: descriptor_limit() };
    }
    match e {
        IpcError::Disconnected => SendFailure::Disconnected,
        IpcError::Io(e) if is_disconnect(&e) => SendFailure::Disconnected,
        IpcError::Io(e) => SendFailure::Io(e.to_string()),
        IpcError::SerializationError(e) => {
            SendFailure::Serialize(wire::take_failure().unwrap_or_else(|| format!("{e:?}")))
        }
    }
}

impl<T: Serialize> Sender<T> {
    fn from_ipc(tx: IpcSender<T>) -> Self {
        Sender { inner: tx.to_opaque(), _message: PhantomData }
    }

    /// Sends a message. Tensors inside it are shared, not copied: the receiver maps the same
    /// memory. Any number of tensors may travel in one message. On failure the message comes
    /// back inside the error.
    ///
    /// ```
    /// let (tx, rx) = cuda_mp::channel::<String>().unwrap();
    /// tx.send("hello".to_string()).unwrap();
    /// assert_eq!(rx.recv().unwrap(), "hello");
    /// ```
    pub fn send(&self, value: T) -> std::result::Result<(), SendError<T>> {
        let tx: IpcSender<Outgoing<'_, T>> = self.inner.clone().to();
        match send_message(&tx, Outgoing(&value)) {
            Ok(()) => Ok(()),
            Err(failure) => Err(SendError::new(value, failure)),
        }
    }

    /// Connects to a [`Listener`] by the name it published.
    ///
    /// ```
    /// let listener = cuda_mp::Listener::<u8>::bind().unwrap();
    /// let tx = cuda_mp::Sender::<u8>::connect(listener.name()).unwrap();
    /// let rx = listener.accept().unwrap();
    /// tx.send(1).unwrap();
    /// assert_eq!(rx.recv().unwrap(), 1);
    /// ```
    pub fn connect(name: &str) -> Result<Sender<T>> {
        if name.is_empty() || name.len() >= 108 || name.contains('\0') {
            return Err(Error::Io(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{name:?} is not a listener name"),
            )));
        }
        let hello: IpcSender<Hello> = IpcSender::connect(name.to_owned())?;
        hello.send(Hello::CURRENT).map_err(|e| Error::Io(io::Error::other(e.to_string())))?;
        Ok(Sender { inner: hello.to_opaque(), _message: PhantomData })
    }

    /// Connects to a [`Listener`] whose name was written to `path` with
    /// [`Listener::publish_to`], waiting up to `timeout` for the file to appear.
    ///
    /// ```
    /// use std::time::Duration;
    /// let listener = cuda_mp::Listener::<u8>::bind().unwrap();
    /// let path = std::env::temp_dir().join(format!("cuda-mp-doc-{}.name", std::process::id()));
    /// listener.publish_to(&path).unwrap();
    /// let tx = cuda_mp::Sender::<u8>::connect_file(&path, Duration::from_secs(5)).unwrap();
    /// let rx = listener.accept().unwrap();
    /// tx.send(2).unwrap();
    /// assert_eq!(rx.recv().unwrap(), 2);
    /// ```
    pub fn connect_file(path: impl AsRef<Path>, timeout: Duration) -> Result<Sender<T>> {
        let deadline = Instant::now() + timeout;
        loop {
            match std::fs::read_to_string(path.as_ref()) {
                Ok(name) => return Sender::connect(name.trim()),
                Err(e) if e.kind() == io::ErrorKind::NotFound && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(Error::Timeout(timeout)),
                Err(e) => return Err(e.into()),
            }
        }
    }
}

impl<T> Serialize for Sender<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        self.inner.serialize(serializer)
    }
}

impl<'de, T> Deserialize<'de> for Sender<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        Ok(Sender { inner: OpaqueIpcSender::deserialize(deserializer)?, _message: PhantomData })
    }
}

/// The receiving end of a channel. It can be moved to another process, not cloned.
///
/// ```
/// let (tx, rx) = cuda_mp::channel::<i64>().unwrap();
/// tx.send(-1).unwrap();
/// assert_eq!(rx.recv().unwrap(), -1);
/// ```
pub struct Receiver<T> {
    inner: IpcReceiver<T>,
}

impl<T> fmt::Debug for Receiver<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Receiver").field("message", &std::any::type_name::<T>()).finish_non_exhaustive()
    }
}

fn recv_error(e: IpcError) -> RecvError {
    match e {
        IpcError::Disconnected => RecvError::Disconnected,
        IpcError::Io(e) if is_disconnect(&e) => RecvError::Disconnected,
        IpcError::Io(e) => RecvError::Io(e.to_string()),
        IpcError::SerializationError(e) => {
            RecvError::Malformed(wire::take_failure().unwrap_or_else(|| format!("undecodable message ({e:?})")))
        }
    }
}

/// Runs a receive with a fresh decoding context, turning a panic inside the transport's
/// decoder (it indexes the descriptors that came with a message by numbers the message itself
/// carries) into an error, and naming descriptor exhaustion when that is why it failed (the
/// kernel drops descriptors a full process cannot take).
fn guarded<R>(f: impl FnOnce() -> std::result::Result<R, RecvError>) -> std::result::Result<R, RecvError> {
    wire::decode_begin();
    let result = catch_quietly(f)
        .unwrap_or_else(|_| Err(RecvError::Malformed("message refers to descriptors it does not carry".into())));
    wire::decode_end();
    match result {
        Err(RecvError::Malformed(_) | RecvError::Io(_)) if near_descriptor_limit() => {
            Err(RecvError::OutOfDescriptors { limit: descriptor_limit() })
        }
        other => other,
    }
}

impl<T: Serialize + DeserializeOwned> Receiver<T> {
    /// Blocks until a message arrives or every sender is gone.
    ///
    /// ```
    /// let (tx, rx) = cuda_mp::channel::<u8>().unwrap();
    /// drop(tx);
    /// assert!(rx.recv().unwrap_err().is_disconnected());
    /// ```
    pub fn recv(&self) -> std::result::Result<T, RecvError> {
        guarded(|| self.inner.recv().map_err(recv_error))
    }

    /// Returns a waiting message, if any, without blocking.
    ///
    /// ```
    /// let (_tx, rx) = cuda_mp::channel::<u8>().unwrap();
    /// assert!(rx.try_recv().unwrap_err().is_empty());
    /// ```
    pub fn try_recv(&self) -> std::result::Result<T, TryRecvError> {
        let mut empty = false;
        let r = guarded(|| match self.inner.try_recv() {
            Ok(v) => Ok(v),
            Err(IpcTryRecvError::Empty) => {
                empty = true;
                Err(RecvError::Disconnected)
            }
            Err(IpcTryRecvError::IpcError(e)) => Err(recv_error(e)),
        });
        match r {
            Ok(v) => Ok(v),
            Err(_) if empty => Err(TryRecvError::Empty),
            Err(e) => Err(e.into()),
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
        let mut timed_out = false;
        let r = guarded(|| match self.inner.try_recv_timeout(timeout) {
            Ok(v) => Ok(v),
            Err(IpcTryRecvError::Empty) => {
                timed_out = true;
                Err(RecvError::Disconnected)
            }
            Err(IpcTryRecvError::IpcError(e)) => Err(recv_error(e)),
        });
        match r {
            Ok(v) => Ok(v),
            Err(_) if timed_out => Err(RecvTimeoutError::Timeout),
            Err(e) => Err(e.into()),
        }
    }

    /// An iterator that receives until the channel disconnects or a receive fails.
    ///
    /// ```
    /// let (tx, rx) = cuda_mp::channel::<u8>().unwrap();
    /// for i in 0..3 {
    ///     tx.send(i).unwrap();
    /// }
    /// drop(tx);
    /// assert_eq!(rx.iter().collect::<Vec<_>>(), vec![0, 1, 2]);
    /// ```
    pub fn iter(&self) -> impl Iterator<Item = T> + '_ {
        std::iter::from_fn(move || self.recv().ok())
    }
}

impl<T> Serialize for Receiver<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        self.inner.serialize(serializer)
    }
}

impl<'de, T: Serialize + DeserializeOwned> Deserialize<'de> for Receiver<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        Ok(Receiver { inner: OpaqueIpcReceiver::deserialize(deserializer)?.to() })
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
#[serde(bound(serialize = "", deserialize = "R: Serialize + DeserializeOwned"))]
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
/// receives `B`, the second sends `B` and receives `A`.
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

/// The first message on a named connection: tells a listener that a cuda-mp sender connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Hello {
    magic: [u8; 8],
    version: u32,
}

impl Hello {
    const CURRENT: Hello = Hello { magic: *b"cuda-mp\0", version: 1 };
    const CANCEL: Hello = Hello { magic: *b"cancel!\0", version: 1 };
}

/// Waits for one unrelated process to connect by name (see [`Sender::connect`]).
///
/// ```
/// let listener = cuda_mp::Listener::<String>::bind().unwrap();
/// assert!(!listener.name().is_empty());
/// ```
pub struct Listener<T> {
    server: IpcOneShotServer<Hello>,
    name: String,
    _message: PhantomData<fn() -> T>,
}

impl<T> fmt::Debug for Listener<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Listener").field("name", &self.name).finish_non_exhaustive()
    }
}

impl<T: Serialize + DeserializeOwned> Listener<T> {
    /// Creates a listener with a fresh name.
    ///
    /// ```
    /// let listener = cuda_mp::Listener::<u8>::bind().unwrap();
    /// println!("connect to {}", listener.name());
    /// ```
    pub fn bind() -> Result<Listener<T>> {
        let (server, name) = IpcOneShotServer::new()?;
        Ok(Listener { server, name, _message: PhantomData })
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

    /// Writes the name to `path` (atomically: a reader never sees half of it).
    ///
    /// ```
    /// let listener = cuda_mp::Listener::<u8>::bind().unwrap();
    /// let path = std::env::temp_dir().join(format!("cuda-mp-doc-pub-{}.name", std::process::id()));
    /// listener.publish_to(&path).unwrap();
    /// assert_eq!(std::fs::read_to_string(&path).unwrap(), listener.name());
    /// ```
    pub fn publish_to(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let tmp = path.with_extension("partial");
        std::fs::write(&tmp, &self.name)?;
        std::fs::rename(&tmp, path)?;
        Ok(())
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
        Ok(Receiver { inner: accept_hello(self.server)?.to() })
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
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let server = self.server;
        std::thread::spawn(move || {
            let _ = done_tx.send(accept_hello(server));
        });
        match done_rx.recv_timeout(timeout) {
            Ok(result) => Ok(Receiver { inner: result?.to() }),
            Err(_) => {
                // Unblock the accepting thread with a connection of our own.
                if let Ok(tx) = IpcSender::<Hello>::connect(self.name.clone()) {
                    let _ = tx.send(Hello::CANCEL);
                }
                Err(Error::Timeout(timeout))
            }
        }
    }
}

fn accept_hello(server: IpcOneShotServer<Hello>) -> Result<OpaqueIpcReceiver> {
    let (rx, hello) = catch_quietly(|| server.accept())
        .map_err(|_| Error::Malformed("connection handshake refers to descriptors it does not carry".into()))?
        .map_err(|e| match e {
            IpcError::SerializationError(_) => {
                Error::Malformed("the peer is not a cuda-mp sender of this version".into())
            }
            other => Error::Malformed(format!("connection handshake failed: {other}")),
        })?;
    if hello != Hello::CURRENT {
        return Err(Error::Malformed("the peer is not a cuda-mp sender of this version".into()));
    }
    Ok(rx.to_opaque())
}
