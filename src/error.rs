//! Error types: one crate error plus one error type per channel operation.

use std::fmt;
use std::time::Duration;

use crate::dtype::DType;

/// The crate's error type for everything that is not a channel operation.
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
    /// A CUDA driver call failed.
    #[error("cuda driver call {call} failed: {message}")]
    Driver {
        /// The driver entry point that failed.
        call: &'static str,
        /// The driver's name and description of the error.
        message: String,
    },
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
    /// `spawn` was called before `cuda_mp::init()`.
    #[error("process spawning is not initialized: call cuda_mp::init() first in main or use #[cuda_mp::main]")]
    NotInitialized,
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a send failed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SendFailure {
    /// Every receiver is gone.
    Disconnected,
    /// The value could not be serialized (for example a GPU tensor could not be exported).
    Serialize(String),
    /// The operating system refused the message.
    Io(String),
}

/// A failed send; the value comes back with [`SendError::into_inner`].
pub struct SendError<T> {
    value: T,
    failure: SendFailure,
}

impl<T> SendError<T> {
    pub(crate) fn new(value: T, failure: SendFailure) -> Self {
        SendError { value, failure }
    }

    /// Takes back the value that could not be sent.
    pub fn into_inner(self) -> T {
        self.value
    }

    /// Why the send failed.
    pub fn failure(&self) -> &SendFailure {
        &self.failure
    }

    /// True when the send failed because every receiver is gone.
    pub fn is_disconnected(&self) -> bool {
        self.failure == SendFailure::Disconnected
    }
}

impl<T> fmt::Debug for SendError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SendError").field("failure", &self.failure).finish_non_exhaustive()
    }
}

impl<T> fmt::Display for SendError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.failure {
            SendFailure::Disconnected => f.write_str("sending on a disconnected channel"),
            SendFailure::Serialize(m) => write!(f, "failed to serialize the message: {m}"),
            SendFailure::Io(m) => write!(f, "failed to send the message: {m}"),
        }
    }
}

impl<T> std::error::Error for SendError<T> {}

/// A failed blocking receive.
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
    Io(String),
}

/// A failed non-blocking receive.
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
    Io(String),
}

/// A failed receive with a timeout.
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
    Io(String),
}

impl From<RecvError> for TryRecvError {
    fn from(e: RecvError) -> Self {
        match e {
            RecvError::Disconnected => TryRecvError::Disconnected,
            RecvError::Malformed(m) => TryRecvError::Malformed(m),
            RecvError::Io(m) => TryRecvError::Io(m),
        }
    }
}

impl From<RecvError> for RecvTimeoutError {
    fn from(e: RecvError) -> Self {
        match e {
            RecvError::Disconnected => RecvTimeoutError::Disconnected,
            RecvError::Malformed(m) => RecvTimeoutError::Malformed(m),
            RecvError::Io(m) => RecvTimeoutError::Io(m),
        }
    }
}

/// Where a panic in a child process happened and what it said.
#[derive(Debug, Clone, PartialEq, Eq)]
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
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JoinError {
    /// The child's function panicked.
    #[error("child process panicked: {0}")]
    Panicked(PanicReport),
    /// The child did not finish within the timeout; it is still running.
    #[error("timed out waiting for the child process")]
    Timeout,
    /// The child died without returning (killed, crashed or exited early).
    #[error("child process terminated without a result: {0}")]
    Terminated(String),
    /// The child could not be started or its result not decoded.
    #[error("child process failed: {0}")]
    Failed(String),
    /// `spawn` was called before `cuda_mp::init()`.
    #[error("process spawning is not initialized: call cuda_mp::init() first in main or use #[cuda_mp::main]")]
    NotInitialized,
}

impl JoinError {
    /// The child's panic, when it panicked.
    pub fn panic(&self) -> Option<&PanicReport> {
        match self {
            JoinError::Panicked(p) => Some(p),
            _ => None,
        }
    }
}
