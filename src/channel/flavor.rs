//! Channel ends over another transport (a TCP connection to another host) behind the same
//! [`Sender`](super::Sender) and [`Receiver`](super::Receiver), as crossbeam-channel's flavors
//! are: `Select`, async receives, iterators and timeouts work on every end alike. The network
//! code implements these traits; this module knows nothing of it.

use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::error::{RecvTimeoutError, SendFailure};

/// How a channel's messages travel.
///
/// ```
/// let listener = cuda_mp::RemoteListener::<u32>::bind("127.0.0.1:0").unwrap();
/// let addr = listener.local_addr().unwrap();
/// let rx = std::thread::spawn(move || listener.accept().unwrap());
/// let tx = cuda_mp::Sender::<u32>::connect_remote(addr).unwrap();
/// assert_eq!(tx.route(), cuda_mp::Route::SameHost); // both ends on this machine
/// assert_eq!(rx.join().unwrap().route(), cuda_mp::Route::SameHost);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Route {
    /// Both ends are on one host: an ordinary cuda-mp channel. Tensors are shared (CUDA IPC,
    /// shared memory), never copied.
    SameHost,
    /// The ends are on different hosts (or asked for the network): messages travel on a TCP
    /// connection, GPU tensors' bytes by NCCL, host tensors' bytes on the TCP connection. A
    /// tensor arrives as a new tensor: copied, not shared.
    Network,
}

/// A descriptor that a receiver's next message makes readable.
pub(crate) type Watched = Arc<dyn AsFd + Send + Sync>;

/// Why a send did not happen.
pub(crate) enum Refused {
    /// No room now (a send that does not wait).
    Full,
    /// No room before the deadline.
    Timeout,
    Failed(SendFailure),
}

/// The sending side of a flavor.
pub(crate) trait SendFlavor<T>: Send + Sync {
    /// Sends `value`. `wait` is how long it may wait for the connection before anything is
    /// written (`None`: without limit, `Some(None)`: not at all, `Some(Some(deadline))`: until
    /// then); once written, the message is sent whole or the connection fails.
    fn send(&self, value: &T, wait: Option<Option<Instant>>) -> Result<(), Refused>;

    /// Which way its messages travel.
    fn route(&self) -> Route;
}

/// The receiving side of a flavor.
pub(crate) trait RecvFlavor<T>: Send + Sync {
    /// The next message: waits until `deadline` (`None`: without limit; one already past only
    /// looks). A message partly arrived at the deadline stays for the next call.
    fn recv(&self, deadline: Option<Instant>) -> Result<T, RecvTimeoutError>;

    /// The descriptor to wait on before a receive (readable when bytes or the connection's end
    /// arrive: a receive may still find only part of a message); `None` when a receive would
    /// return at once.
    fn readiness(&self) -> Option<Watched>;

    /// Which way its messages travel.
    fn route(&self) -> Route;
}
