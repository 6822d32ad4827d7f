//! Error types: one crate error plus one error type per channel operation.

use std::fmt;
use std::time::Duration;

use crate::dtype::DType;

/// The crate's error type for everything that is not a channel operation.
///
/// ```
/// let err = cuda_mp::HostTensor::<f32>::from_vec(&[2, 2], vec![1.0]).unwrap_err();
/// assert!(matches!(err, cuda_mp::Error::Layout(_)));
/// assert_eq!(err.to_string(), "invalid layout: shape [2, 2] holds 4 elements, not 1");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor of one element type was asked for as another.
    #[error("dtype mismatch: expected {expected}, found {found}")]
    DTypeMismatch {
        /// The element type the caller asked for.
        expected: DType,
        /// The element type the tensor holds.
        found: DType,
    },
    /// A shape, stride, offset or view argument that does not fit the tensor or its storage.
    #[error("invalid layout: {0}")]
    Layout(String),
    /// A message that cannot be decoded into the expected type.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// No CUDA driver, no GPU, or no GPU with the requested ordinal.
    #[error("cuda is not available: {0}")]
    CudaUnavailable(String),
    /// A CUDA driver call failed; [`Error::is_out_of_memory`] tells out-of-memory apart.
    #[cfg(feature = "cuda")]
    #[error("cuda driver call {call} failed: {message}")]
    Driver {
        /// The driver entry point that failed.
        call: &'static str,
        /// The driver's result code.
        code: cudarc::driver::sys::CUresult,
        /// The driver's name and description of the error.
        message: String,
    },
    /// A tensor name that a bundle does not hold.
    #[error("bundle has no tensor named {name:?}")]
    NoSuchTensor {
        /// The name asked for.
        name: String,
    },
    /// This process has as many file descriptors open as its limit allows (every shared
    /// storage and lease is one); raise `ulimit -n` or hold fewer tensors.
    #[error("out of file descriptors: this process may open at most {limit}")]
    OutOfDescriptors {
        /// The process's soft limit on open descriptors (`RLIMIT_NOFILE`).
        limit: u64,
    },
    /// Another process's memory could not be mapped because the process that allocated it has
    /// exited: legacy CUDA IPC memory cannot be mapped after that (VMM memory can: its
    /// descriptor travels in the message).
    #[error("the process that allocated this memory has exited before this process mapped it ({0})")]
    OwnerExited(String),
    /// A send failed.
    #[error("{0}")]
    Send(SendFailure),
    /// A receive failed.
    #[error(transparent)]
    Recv(#[from] RecvError),
    /// Waiting for a child process failed.
    #[error(transparent)]
    Join(#[from] JoinError),
    /// A message names a GPU that this process cannot see.
    #[error("gpu {uuid} is not visible to this process (check CUDA_VISIBLE_DEVICES)")]
    DeviceNotVisible {
        /// The UUID of the GPU the message names.
        uuid: String,
    },
    /// A GPU cannot reach memory on another GPU (`cuDeviceCanAccessPeer` says no).
    #[error("gpu {device} cannot access memory on gpu {owner}: the two gpus have no peer access")]
    NoPeerAccess {
        /// The GPU that would run the work: ordinal and UUID.
        device: String,
        /// The GPU holding the memory: ordinal and UUID.
        owner: String,
    },
    /// The operation is not supported for this element type or tensor.
    #[error("unsupported operation: {0}")]
    Unsupported(String),
    /// An operating system error.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    /// A blocking operation gave up after its timeout.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// A new segment of a caching allocator would take its reserved memory past the limit set
    /// with [`Device::set_cache_limit`](crate::Device::set_cache_limit) or
    /// [`set_host_cache_limit`](crate::set_host_cache_limit), even after every unused segment
    /// was released.
    #[error(
        "allocation of {requested} bytes refused: the caching allocator holds {reserved} bytes and its limit is {limit}"
    )]
    CacheLimit {
        /// Bytes of the segment that was needed.
        requested: usize,
        /// Bytes the allocator's segments held.
        reserved: usize,
        /// The limit.
        limit: usize,
    },
    /// A value could not be encoded (a tensor whose memory could not be exported, say).
    #[error("cannot encode: {0}")]
    Encode(String),
    /// `spawn` was called before `cuda_mp::init()`.
    #[error("process spawning is not initialized: call cuda_mp::init() first in main or use #[cuda_mp::main]")]
    NotInitialized,
}

impl Error {
    /// True when the CUDA driver ran out of device memory, the host out of memory for shared
    /// memory, or a caching allocator's limit refused more.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let err = cuda_mp::GpuTensor::<u8>::zeros(&dev, &[1 << 50]).unwrap_err(); // a petabyte
    /// assert!(err.is_out_of_memory());
    /// ```
    pub fn is_out_of_memory(&self) -> bool {
        #[cfg(feature = "cuda")]
        if matches!(self, Error::Driver { code: cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY, .. }) {
            return true;
        }
        matches!(self, Error::CacheLimit { .. })
            || matches!(self, Error::Io(e) if e.kind() == std::io::ErrorKind::OutOfMemory)
    }

    /// True when a blocking operation gave up after its timeout.
    ///
    /// ```
    /// use std::time::Duration;
    /// let err = cuda_mp::wait_for_lifetime(Duration::from_millis(10), |_| false).unwrap_err();
    /// assert!(err.is_timeout());
    /// ```
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout(_))
    }
}

impl<T> From<SendError<T>> for Error {
    fn from(e: SendError<T>) -> Self {
        Error::Send(e.failure)
    }
}

impl From<RecvTimeoutError> for Error {
    fn from(e: RecvTimeoutError) -> Self {
        match e.failure() {
            None => Error::Timeout(Duration::ZERO),
            Some(RecvError::OutOfDescriptors { limit }) => Error::OutOfDescriptors { limit },
            Some(e) => Error::Recv(e),
        }
    }
}

/// The result type of this crate.
///
/// ```
/// fn elements(shape: &[usize]) -> cuda_mp::Result<usize> {
///     Ok(cuda_mp::HostTensor::<f32>::zeros(shape)?.numel())
/// }
/// assert_eq!(elements(&[2, 3]).unwrap(), 6);
/// ```
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An operating-system error inside one of the channel, queue and select errors (their
/// `source()`): the [`std::io::Error`] itself is its own `source()` (and
/// [`io_error`](Self::io_error)), and clones of the error share it.
///
/// ```
/// use std::error::Error;
/// let (tx, rx) = cuda_mp::channel::<u8>().unwrap();
/// let err = cuda_mp::RecvError::Io(std::io::Error::other("gone").into());
/// let failure = err.source().unwrap().downcast_ref::<cuda_mp::IoFailure>().unwrap();
/// assert_eq!(failure.kind(), std::io::ErrorKind::Other);
/// assert_eq!(failure.io_error().to_string(), "gone");
/// let io = failure.source().unwrap().downcast_ref::<std::io::Error>().unwrap();
/// assert_eq!(io.to_string(), "gone");
/// # drop((tx, rx));
/// ```
#[derive(Clone)]
pub struct IoFailure(std::sync::Arc<std::io::Error>);

impl IoFailure {
    /// An error of kind `Other` that says `text` (what went wrong where no system call failed).
    pub(crate) fn other(text: impl Into<String>) -> IoFailure {
        IoFailure::from(std::io::Error::other(text.into()))
    }

    /// The same kind of error as `e`, saying `text` first.
    pub(crate) fn context(e: &std::io::Error, text: &str) -> IoFailure {
        IoFailure::from(std::io::Error::new(e.kind(), format!("{text}: {e}")))
    }

    /// The operating system's error number, where the error is one.
    pub(crate) fn raw_os_error(&self) -> Option<i32> {
        self.0.raw_os_error()
    }

    /// The kind of the operating-system error.
    ///
    /// ```
    /// let f: cuda_mp::IoFailure = std::io::Error::from(std::io::ErrorKind::BrokenPipe).into();
    /// assert_eq!(f.kind(), std::io::ErrorKind::BrokenPipe);
    /// ```
    pub fn kind(&self) -> std::io::ErrorKind {
        self.0.kind()
    }

    /// The operating-system error.
    ///
    /// ```
    /// let f: cuda_mp::IoFailure = std::io::Error::other("x").into();
    /// assert_eq!(f.io_error().to_string(), "x");
    /// ```
    pub fn io_error(&self) -> &std::io::Error {
        &self.0
    }
}

impl From<std::io::Error> for IoFailure {
    fn from(e: std::io::Error) -> IoFailure {
        IoFailure(std::sync::Arc::new(e))
    }
}

impl fmt::Debug for IoFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for IoFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

/// Equal when of the same kind and saying the same.
impl PartialEq for IoFailure {
    fn eq(&self, other: &IoFailure) -> bool {
        self.kind() == other.kind() && self.0.to_string() == other.0.to_string()
    }
}

impl Eq for IoFailure {}

impl std::error::Error for IoFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

/// Why a send failed.
///
/// ```
/// let (tx, rx) = cuda_mp::channel::<u32>().unwrap();
/// drop(rx);
/// let err = tx.send(7).unwrap_err();
/// assert_eq!(err.failure(), &cuda_mp::SendFailure::Disconnected);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SendFailure {
    /// Every receiver is gone.
    Disconnected,
    /// The value could not be serialized (for example a GPU tensor could not be exported).
    Serialize(String),
    /// The operating system refused the message.
    Io(IoFailure),
    /// This process is out of file descriptors (the limit is given).
    OutOfDescriptors {
        /// The process's soft limit on open descriptors.
        limit: u64,
    },
}

impl fmt::Display for SendFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SendFailure::Disconnected => f.write_str("sending on a disconnected channel"),
            SendFailure::Serialize(m) => write!(f, "failed to serialize the message: {m}"),
            SendFailure::Io(m) => write!(f, "failed to send the message: {m}"),
            SendFailure::OutOfDescriptors { limit } => {
                write!(f, "out of file descriptors: this process may open at most {limit}")
            }
        }
    }
}

/// A failed send; the value comes back with [`SendError::into_inner`].
///
/// ```
/// let (tx, rx) = cuda_mp::channel::<String>().unwrap();
/// drop(rx);
/// let err = tx.send("lost".to_string()).unwrap_err();
/// assert!(err.is_disconnected());
/// assert_eq!(err.into_inner(), "lost");
/// ```
pub struct SendError<T> {
    value: T,
    failure: SendFailure,
}

impl<T> SendError<T> {
    pub(crate) fn new(value: T, failure: SendFailure) -> Self {
        SendError { value, failure }
    }

    /// Takes back the value that could not be sent.
    ///
    /// ```
    /// let (tx, rx) = cuda_mp::channel::<cuda_mp::HostTensor<f32>>().unwrap();
    /// drop(rx);
    /// let t = cuda_mp::HostTensor::<f32>::full(&[2], 3.0).unwrap();
    /// let back = tx.send(t).unwrap_err().into_inner();
    /// assert_eq!(back.to_vec(), vec![3.0, 3.0]);
    /// ```
    pub fn into_inner(self) -> T {
        self.value
    }

    /// Why the send failed.
    ///
    /// ```
    /// let (tx, rx) = cuda_mp::channel::<u32>().unwrap();
    /// drop(rx);
    /// let err = tx.send(7).unwrap_err();
    /// assert_eq!(err.failure().to_string(), "sending on a disconnected channel");
    /// ```
    pub fn failure(&self) -> &SendFailure {
        &self.failure
    }

    /// True when the send failed because every receiver is gone.
    ///
    /// ```
    /// let (tx, rx) = cuda_mp::channel::<u32>().unwrap();
    /// drop(rx);
    /// assert!(tx.send(7).unwrap_err().is_disconnected());
    /// ```
    pub fn is_disconnected(&self) -> bool {
        self.failure == SendFailure::Disconnected
    }

    /// True when the send failed because this process is out of file descriptors.
    ///
    /// ```
    /// let (tx, rx) = cuda_mp::channel::<u32>().unwrap();
    /// drop(rx);
    /// let err = tx.send(7).unwrap_err();
    /// assert!(!err.is_out_of_descriptors()); // disconnected instead
    /// ```
    pub fn is_out_of_descriptors(&self) -> bool {
        matches!(self.failure, SendFailure::OutOfDescriptors { .. })
    }
}

impl<T> fmt::Debug for SendError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SendError").field("failure", &self.failure).finish_non_exhaustive()
    }
}

impl<T> fmt::Display for SendError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.failure.fmt(f)
    }
}

impl<T> std::error::Error for SendError<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.failure {
            SendFailure::Io(e) => Some(e),
            _ => None,
        }
    }
}

/// The methods and impls that [`TrySendError`] and [`SendTimeoutError`] share: `$first` is the
/// variant of a send that found no room, which converts to [`Error::Timeout`] (a try is a wait
/// of no time).
macro_rules! send_error {
    ($name:ident, $first:ident, $text:literal, $(#[$into:meta])* into_inner, $(#[$why:meta])* failure) => {
        impl<T> $name<T> {
            $(#[$into])*
            pub fn into_inner(self) -> T {
                match self {
                    $name::$first(v) | $name::Disconnected(v) | $name::Failed(v, _) => v,
                }
            }

            $(#[$why])*
            pub fn failure(&self) -> Option<&SendFailure> {
                match self {
                    $name::Failed(_, f) => Some(f),
                    _ => None,
                }
            }
        }

        impl<T> fmt::Debug for $name<T> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self {
                    $name::$first(_) => f.write_str(concat!(stringify!($first), "(..)")),
                    $name::Disconnected(_) => f.write_str("Disconnected(..)"),
                    $name::Failed(_, failure) => f.debug_tuple("Failed").field(&"..").field(failure).finish(),
                }
            }
        }

        impl<T> fmt::Display for $name<T> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self {
                    $name::$first(_) => f.write_str($text),
                    $name::Disconnected(_) => SendFailure::Disconnected.fmt(f),
                    $name::Failed(_, failure) => failure.fmt(f),
                }
            }
        }

        impl<T> std::error::Error for $name<T> {}

        impl<T> From<$name<T>> for Error {
            fn from(e: $name<T>) -> Self {
                match e {
                    $name::$first(_) => Error::Timeout(Duration::ZERO),
                    $name::Disconnected(_) => Error::Send(SendFailure::Disconnected),
                    $name::Failed(_, failure) => Error::Send(failure),
                }
            }
        }
    };
}

/// A failed [`try_send`](crate::Sender::try_send); the value comes back with
/// [`into_inner`](Self::into_inner).
///
/// ```
/// let (tx, _rx) = cuda_mp::bounded::<u32>(1).unwrap();
/// tx.try_send(1).unwrap();
/// let err = tx.try_send(2).unwrap_err();
/// assert!(err.is_full());
/// assert_eq!(err.to_string(), "sending on a full channel");
/// assert_eq!(err.into_inner(), 2);
/// ```
#[non_exhaustive]
pub enum TrySendError<T> {
    /// A bounded channel holds as many messages as it may.
    Full(T),
    /// Every receiver is gone.
    Disconnected(T),
    /// The message could not be sent for another reason (it could not be serialized, the
    /// operating system refused it, no descriptor was left).
    Failed(T, SendFailure),
}

send_error! {
    TrySendError, Full, "sending on a full channel",
    /// Takes back the value that was not sent.
    ///
    /// ```
    /// let (tx, rx) = cuda_mp::channel::<String>().unwrap();
    /// drop(rx);
    /// assert_eq!(tx.try_send("back".into()).unwrap_err().into_inner(), "back");
    /// ```
    into_inner,
    /// Why the send failed, for [`TrySendError::Failed`].
    ///
    /// ```
    /// let (tx, _rx) = cuda_mp::bounded::<u8>(1).unwrap();
    /// tx.send(0).unwrap();
    /// assert!(tx.try_send(1).unwrap_err().failure().is_none()); // full, not failed
    /// ```
    failure
}

impl<T> TrySendError<T> {
    /// True when the channel was full.
    ///
    /// ```
    /// let (tx, _rx) = cuda_mp::bounded::<u8>(1).unwrap();
    /// tx.send(0).unwrap();
    /// assert!(tx.try_send(1).unwrap_err().is_full());
    /// ```
    pub fn is_full(&self) -> bool {
        matches!(self, TrySendError::Full(_))
    }

    /// True when every receiver is gone.
    ///
    /// ```
    /// let (tx, rx) = cuda_mp::channel::<u8>().unwrap();
    /// drop(rx);
    /// assert!(tx.try_send(1).unwrap_err().is_disconnected());
    /// ```
    pub fn is_disconnected(&self) -> bool {
        matches!(self, TrySendError::Disconnected(_))
    }
}

/// A failed [`send_timeout`](crate::Sender::send_timeout); the value comes back with
/// [`into_inner`](Self::into_inner).
///
/// ```
/// use std::time::Duration;
/// let (tx, _rx) = cuda_mp::bounded::<u32>(1).unwrap();
/// tx.send(1).unwrap();
/// let err = tx.send_timeout(2, Duration::from_millis(10)).unwrap_err();
/// assert!(err.is_timeout());
/// assert_eq!(err.to_string(), "timed out waiting for room in the channel");
/// assert_eq!(err.into_inner(), 2);
/// ```
#[non_exhaustive]
pub enum SendTimeoutError<T> {
    /// A bounded channel stayed full for the whole timeout.
    Timeout(T),
    /// Every receiver is gone.
    Disconnected(T),
    /// The message could not be sent for another reason (see [`SendFailure`]).
    Failed(T, SendFailure),
}

send_error! {
    SendTimeoutError, Timeout, "timed out waiting for room in the channel",
    /// Takes back the value that was not sent.
    ///
    /// ```
    /// use std::time::Duration;
    /// let (tx, rx) = cuda_mp::channel::<String>().unwrap();
    /// drop(rx);
    /// let err = tx.send_timeout("back".into(), Duration::from_secs(1)).unwrap_err();
    /// assert_eq!(err.into_inner(), "back");
    /// ```
    into_inner,
    /// Why the send failed, for [`SendTimeoutError::Failed`].
    ///
    /// ```
    /// use std::time::Duration;
    /// let (tx, _rx) = cuda_mp::bounded::<u8>(1).unwrap();
    /// tx.send(0).unwrap();
    /// assert!(tx.send_timeout(1, Duration::ZERO).unwrap_err().failure().is_none());
    /// ```
    failure
}

impl<T> SendTimeoutError<T> {
    /// True when the channel stayed full for the whole timeout.
    ///
    /// ```
    /// use std::time::Duration;
    /// let (tx, _rx) = cuda_mp::bounded::<u8>(1).unwrap();
    /// tx.send(0).unwrap();
    /// assert!(tx.send_timeout(1, Duration::from_millis(5)).unwrap_err().is_timeout());
    /// ```
    pub fn is_timeout(&self) -> bool {
        matches!(self, SendTimeoutError::Timeout(_))
    }

    /// True when every receiver is gone.
    ///
    /// ```
    /// use std::time::Duration;
    /// let (tx, rx) = cuda_mp::channel::<u8>().unwrap();
    /// drop(rx);
    /// assert!(tx.send_timeout(1, Duration::from_secs(1)).unwrap_err().is_disconnected());
    /// ```
    pub fn is_disconnected(&self) -> bool {
        matches!(self, SendTimeoutError::Disconnected(_))
    }
}

/// A failed [`Select::select`](crate::Select::select).
///
/// ```
/// let mut sel = cuda_mp::Select::new();
/// assert_eq!(sel.select(), Err(cuda_mp::SelectError::NoReceivers));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SelectError {
    /// No receiver was added: nothing could ever be ready.
    #[error("selecting over no receivers")]
    NoReceivers,
    /// The operating system reported an error.
    #[error("failed to wait for the receivers: {0}")]
    Io(#[source] IoFailure),
}

/// A failed [`Select::select_timeout`](crate::Select::select_timeout).
///
/// ```
/// use std::time::Duration;
/// let (_tx, rx) = cuda_mp::channel::<u8>().unwrap();
/// let mut sel = cuda_mp::Select::new();
/// sel.add(&rx);
/// let err = sel.select_timeout(Duration::from_millis(10)).unwrap_err();
/// assert!(err.is_timeout());
/// assert_eq!(err.to_string(), "timed out waiting for a receiver to be ready");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SelectTimeoutError {
    /// No receiver became ready in time.
    #[error("timed out waiting for a receiver to be ready")]
    Timeout,
    /// No receiver was added: nothing could ever be ready.
    #[error("selecting over no receivers")]
    NoReceivers,
    /// The operating system reported an error.
    #[error("failed to wait for the receivers: {0}")]
    Io(#[source] IoFailure),
}

impl SelectTimeoutError {
    /// True when no receiver became ready in time.
    ///
    /// ```
    /// use std::time::Duration;
    /// let (_tx, rx) = cuda_mp::channel::<u8>().unwrap();
    /// let mut sel = cuda_mp::Select::new();
    /// sel.add(&rx);
    /// assert!(sel.select_timeout(Duration::ZERO).unwrap_err().is_timeout());
    /// ```
    pub fn is_timeout(&self) -> bool {
        matches!(self, SelectTimeoutError::Timeout)
    }
}

/// A failed blocking receive.
///
/// ```
/// let (tx, rx) = cuda_mp::channel::<u32>().unwrap();
/// drop(tx);
/// assert_eq!(rx.recv().unwrap_err(), cuda_mp::RecvError::Disconnected);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecvError {
    /// Every sender is gone (including by the death of the process that held it).
    #[error("receiving on a disconnected channel")]
    Disconnected,
    /// A message arrived that does not decode into the channel's type; it has been discarded
    /// and every resource it carried released.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The operating system reported an error.
    #[error("failed to receive: {0}")]
    Io(#[source] IoFailure),
    /// This process is out of file descriptors (the limit is given): the message is lost (or,
    /// where it was a batch of a sender's backlog, the batch's messages), its resources are
    /// released, and the channel goes on with the next message.
    #[error("out of file descriptors: this process may open at most {limit}")]
    OutOfDescriptors {
        /// The process's soft limit on open descriptors.
        limit: u64,
    },
}

/// A failed non-blocking receive.
///
/// ```
/// let (tx, rx) = cuda_mp::channel::<u32>().unwrap();
/// assert_eq!(rx.try_recv().unwrap_err(), cuda_mp::TryRecvError::Empty);
/// tx.send(1).unwrap();
/// assert_eq!(rx.try_recv().unwrap(), 1);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TryRecvError {
    /// No message is waiting.
    #[error("receiving on an empty channel")]
    Empty,
    /// Every sender is gone.
    #[error("receiving on an empty and disconnected channel")]
    Disconnected,
    /// A message arrived that does not decode; it has been discarded.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The operating system reported an error.
    #[error("failed to receive: {0}")]
    Io(#[source] IoFailure),
    /// This process is out of file descriptors (the limit is given): the message is lost (or,
    /// where it was a batch of a sender's backlog, the batch's messages), its resources are
    /// released, and the channel goes on with the next message.
    #[error("out of file descriptors: this process may open at most {limit}")]
    OutOfDescriptors {
        /// The process's soft limit on open descriptors.
        limit: u64,
    },
}

/// A failed receive with a timeout.
///
/// ```
/// use std::time::Duration;
/// let (_tx, rx) = cuda_mp::channel::<u32>().unwrap();
/// let err = rx.recv_timeout(Duration::from_millis(10)).unwrap_err();
/// assert_eq!(err, cuda_mp::RecvTimeoutError::Timeout);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecvTimeoutError {
    /// No message arrived in time.
    #[error("timed out waiting on channel")]
    Timeout,
    /// Every sender is gone.
    #[error("channel is empty and disconnected")]
    Disconnected,
    /// A message arrived that does not decode; it has been discarded.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The operating system reported an error.
    #[error("failed to receive: {0}")]
    Io(#[source] IoFailure),
    /// This process is out of file descriptors (the limit is given): the message is lost (or,
    /// where it was a batch of a sender's backlog, the batch's messages), its resources are
    /// released, and the channel goes on with the next message.
    #[error("out of file descriptors: this process may open at most {limit}")]
    OutOfDescriptors {
        /// The process's soft limit on open descriptors.
        limit: u64,
    },
}

impl RecvError {
    /// True when every sender is gone.
    ///
    /// ```
    /// let (tx, rx) = cuda_mp::channel::<u32>().unwrap();
    /// drop(tx);
    /// assert!(rx.recv().unwrap_err().is_disconnected());
    /// ```
    pub fn is_disconnected(&self) -> bool {
        matches!(self, RecvError::Disconnected)
    }
}

impl TryRecvError {
    /// True when no message was waiting.
    ///
    /// ```
    /// let (_tx, rx) = cuda_mp::channel::<u32>().unwrap();
    /// assert!(rx.try_recv().unwrap_err().is_empty());
    /// ```
    pub fn is_empty(&self) -> bool {
        matches!(self, TryRecvError::Empty)
    }

    /// True when every sender is gone.
    ///
    /// ```
    /// let (tx, rx) = cuda_mp::channel::<u32>().unwrap();
    /// drop(tx);
    /// assert!(rx.try_recv().unwrap_err().is_disconnected());
    /// ```
    pub fn is_disconnected(&self) -> bool {
        matches!(self, TryRecvError::Disconnected)
    }
}

impl RecvTimeoutError {
    /// True when no message arrived in time.
    ///
    /// ```
    /// use std::time::Duration;
    /// let (_tx, rx) = cuda_mp::channel::<u32>().unwrap();
    /// assert!(rx.recv_timeout(Duration::from_millis(10)).unwrap_err().is_timeout());
    /// ```
    pub fn is_timeout(&self) -> bool {
        matches!(self, RecvTimeoutError::Timeout)
    }

    /// True when every sender is gone.
    ///
    /// ```
    /// use std::time::Duration;
    /// let (tx, rx) = cuda_mp::channel::<u32>().unwrap();
    /// drop(tx);
    /// assert!(rx.recv_timeout(Duration::from_secs(1)).unwrap_err().is_disconnected());
    /// ```
    pub fn is_disconnected(&self) -> bool {
        matches!(self, RecvTimeoutError::Disconnected)
    }
}

impl RecvTimeoutError {
    /// The failure this is, other than running out of time (`None` for [`Timeout`]): how a
    /// receive that waits by deadline reports to `recv` and `try_recv`.
    ///
    /// [`Timeout`]: RecvTimeoutError::Timeout
    pub(crate) fn failure(self) -> Option<RecvError> {
        match self {
            RecvTimeoutError::Timeout => None,
            RecvTimeoutError::Disconnected => Some(RecvError::Disconnected),
            RecvTimeoutError::Malformed(m) => Some(RecvError::Malformed(m)),
            RecvTimeoutError::Io(m) => Some(RecvError::Io(m)),
            RecvTimeoutError::OutOfDescriptors { limit } => Some(RecvError::OutOfDescriptors { limit }),
        }
    }
}

/// `$e`, of an error type with the four failures of a receive (`Disconnected`, `Malformed`,
/// `Io`, `OutOfDescriptors { limit }`), as the same failure of `$to`; `$other` arms map the
/// rest of `$from`.
macro_rules! same_failure {
    ($e:expr, $from:ident => $to:ident $(, $other:pat => $value:expr)*) => {
        match $e {
            $from::Disconnected => $to::Disconnected,
            $from::Malformed(m) => $to::Malformed(m),
            $from::Io(m) => $to::Io(m),
            $from::OutOfDescriptors { limit } => $to::OutOfDescriptors { limit },
            $($other => $value,)*
        }
    };
}
pub(crate) use same_failure;

impl From<RecvError> for TryRecvError {
    fn from(e: RecvError) -> Self {
        same_failure!(e, RecvError => TryRecvError)
    }
}

impl From<RecvError> for RecvTimeoutError {
    fn from(e: RecvError) -> Self {
        same_failure!(e, RecvError => RecvTimeoutError)
    }
}

/// Where a panic in a child process happened and what it said.
///
/// ```
/// // What `JoinHandle::join` says about a child that panicked.
/// fn panic_message(err: &cuda_mp::JoinError) -> Option<&str> {
///     err.panic().map(|report| report.message.as_str())
/// }
/// assert_eq!(panic_message(&cuda_mp::JoinError::Timeout), None);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PanicReport {
    /// The panic message.
    pub message: String,
    /// `file:line:column` of the panic, when known.
    pub location: Option<String>,
}

impl fmt::Display for PanicReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.location {
            Some(loc) => write!(f, "{} at {loc}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

/// A failed join of a child process.
///
/// ```
/// let err = cuda_mp::JoinError::Signaled { signal: 9, name: "SIGKILL" };
/// assert_eq!(err.to_string(), "child process was killed by signal 9 (SIGKILL)");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JoinError {
    /// The child's function panicked.
    #[error("child process panicked: {0}")]
    Panicked(PanicReport),
    /// The child did not finish within the timeout; it is still running.
    #[error("timed out waiting for the child process")]
    Timeout,
    /// The child was killed by a signal (by [`JoinHandle::kill`](crate::JoinHandle::kill),
    /// another process, or a crash) before returning.
    #[error("child process was killed by signal {signal} ({name})")]
    Signaled {
        /// The signal number.
        signal: i32,
        /// The signal's name, such as `SIGKILL`.
        name: &'static str,
    },
    /// The child exited before returning a result.
    #[error("child process exited with status {code} without a result")]
    Exited {
        /// Its exit status.
        code: i32,
    },
    /// One process of [`spawn_n`](crate::spawn_n) failed (the first to fail); the others were
    /// terminated.
    #[error("rank {rank} failed: {error}")]
    Rank {
        /// The failed process's rank.
        rank: usize,
        /// How it failed.
        error: Box<JoinError>,
    },
    /// One job of a [`Pool::map`](crate::Pool::map) failed (the first to fail); the jobs of
    /// the call that had not started were cancelled.
    #[error("job {index} failed: {error}")]
    Job {
        /// The failed job's place among the call's items.
        index: usize,
        /// How it failed.
        error: Box<JoinError>,
    },
    /// A pool worker's initializer failed, so the worker could not take jobs.
    #[error("the pool worker's initializer failed: {0}")]
    Initializer(Box<JoinError>),
    /// A pool was asked for with settings it cannot have (no workers, or a limit of no jobs
    /// per worker).
    #[error("invalid pool settings: {0}")]
    InvalidPool(String),
    /// The pool was terminated (or dropped) before the job finished.
    #[error("the pool was terminated before the job finished")]
    PoolClosed,
    /// The pooled job was cancelled (by [`JoinHandle::kill`](crate::JoinHandle::kill), or
    /// because another job of the same map failed) before it started.
    #[error("the job was cancelled before it started")]
    Cancelled,
    /// The child died without returning, and how is unknown (a pool worker, on a kernel that
    /// does not keep the exit status of a reaped process).
    #[error("child process terminated without a result: {0}")]
    Terminated(String),
    /// The child could not be started: this process had as many file descriptors open as its
    /// limit allows (a spawn takes several: the child's pipes and its connection back).
    #[error("child process not started: out of file descriptors: this process may open at most {limit}")]
    OutOfDescriptors {
        /// The process's soft limit on open descriptors (`RLIMIT_NOFILE`).
        limit: u64,
    },
    /// The child could not be started or its result not decoded.
    #[error("child process failed: {0}")]
    Failed(String),
    /// `spawn` was called before `cuda_mp::init()`.
    #[error("process spawning is not initialized: call cuda_mp::init() first in main or use #[cuda_mp::main]")]
    NotInitialized,
}

impl JoinError {
    /// The child's panic, when it panicked.
    ///
    /// ```
    /// let err = cuda_mp::JoinError::Exited { code: 3 };
    /// assert!(err.panic().is_none()); // it exited, it did not panic
    /// ```
    pub fn panic(&self) -> Option<&PanicReport> {
        match self {
            JoinError::Panicked(p) => Some(p),
            _ => None,
        }
    }
}
