//! [`Select`]: waiting for the first of several receivers.

use std::fmt;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;

use super::flavor::Watched;
use super::inbox::{Announced, Readiness, Wait};
use super::{Receiver, ReceiverFlavor};
use crate::error::{IoFailure, SelectError, SelectTimeoutError};

/// What `Select` asks of a receiver of any message type.
trait Watch {
    /// Whether a receive would return at once, or what to wait on (`None`: cannot be watched).
    fn readiness(&self) -> Option<Readiness>;
}

impl<T: DeserializeOwned> Watch for Receiver<T> {
    fn readiness(&self) -> Option<Readiness> {
        match &self.flavor {
            ReceiverFlavor::Local(local) => local.readiness(),
            ReceiverFlavor::Remote(remote) => {
                Some(remote.readiness().map_or(Readiness::Ready, |fd| Readiness::Wait(fd, None)))
            }
        }
    }
}

/// Waits until one of several receivers, of any message types, has a message (or is
/// disconnected), like crossbeam's `Select`: add the receivers, call
/// [`select`](Self::select) or [`select_timeout`](Self::select_timeout), and receive from the
/// one whose index comes back. The receivers are borrowed, not consumed: they stay usable
/// alone, and may be selected again.
///
/// Readiness is a promise about the next receive only as long as nobody else receives from the
/// same receiver meanwhile (a receiver that another thread is receiving from is looked at once
/// that thread is done with it), and may rarely be
/// spurious (a frame that announces a sender's ring makes a receiver ready, and the receive
/// finds the ring still empty): receive with [`try_recv`](Receiver::try_recv) and select again
/// on [`TryRecvError::Empty`]. A receiver
/// whose senders are all gone is always ready (its receive reports the disconnection); remove
/// it with [`remove`](Self::remove). When several are ready, they take turns.
///
/// [`TryRecvError::Empty`]: crate::TryRecvError::Empty
///
/// ```no_run
/// use std::time::Duration;
/// use cuda_mp::{channel, spawn, Receiver, Select, Sender};
///
/// fn worker((id, tx): (u32, Sender<u32>)) {
///     std::thread::sleep(Duration::from_millis(10 * id as u64));
///     tx.send(id).unwrap();
/// }
///
/// #[cuda_mp::main]
/// fn main() {
///     let mut receivers: Vec<Receiver<u32>> = Vec::new();
///     let mut children = Vec::new();
///     for id in 0..3 {
///         let (tx, rx) = channel().unwrap();
///         children.push(spawn((id, tx), worker));
///         receivers.push(rx);
///     }
///     let mut sel = Select::new();
///     for rx in &receivers {
///         sel.add(rx);
///     }
///     let mut got = Vec::new();
///     while got.len() < 3 {
///         let i = sel.select_timeout(Duration::from_secs(10)).unwrap();
///         match receivers[i].try_recv() {
///             Ok(id) => got.push(id),
///             Err(e) if e.is_disconnected() => sel.remove(i),
///             Err(_) => {} // spurious: select again
///         }
///     }
///     for c in children {
///         c.join().unwrap();
///     }
/// }
/// ```
pub struct Select<'a> {
    entries: Vec<Option<&'a dyn Watch>>,
    /// Where the next look starts, so that ready receivers take turns.
    next: usize,
}

impl fmt::Debug for Select<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Select").field("receivers", &self.entries.iter().flatten().count()).finish()
    }
}

impl Default for Select<'_> {
    fn default() -> Self {
        Select::new()
    }
}

impl<'a> Select<'a> {
    /// A selection of no receivers.
    ///
    /// ```
    /// let sel = cuda_mp::Select::new();
    /// println!("{sel:?}");
    /// ```
    pub fn new() -> Select<'a> {
        Select { entries: Vec::new(), next: 0 }
    }

    /// Adds a receiver; returns the index that [`select`](Self::select) returns when it is
    /// ready.
    ///
    /// ```
    /// let (tx, rx) = cuda_mp::channel::<u8>().unwrap();
    /// let mut sel = cuda_mp::Select::new();
    /// let i = sel.add(&rx);
    /// tx.send(1).unwrap();
    /// assert_eq!(sel.select().unwrap(), i);
    /// ```
    pub fn add<T: DeserializeOwned>(&mut self, rx: &'a Receiver<T>) -> usize {
        self.entries.push(Some(rx));
        self.entries.len() - 1
    }

    /// Removes the receiver added as `index`; the other indices stay as they were. Removing an
    /// index twice, or one never returned by [`add`](Self::add), changes nothing.
    ///
    /// ```
    /// use std::time::Duration;
    /// let (tx, rx) = cuda_mp::channel::<u8>().unwrap();
    /// let mut sel = cuda_mp::Select::new();
    /// let i = sel.add(&rx);
    /// drop(tx);
    /// assert_eq!(sel.select().unwrap(), i); // disconnected: ready
    /// sel.remove(i);
    /// assert!(sel.select_timeout(Duration::ZERO).is_err());
    /// ```
    pub fn remove(&mut self, index: usize) {
        if let Some(entry) = self.entries.get_mut(index) {
            *entry = None;
        }
    }

    /// Blocks until one of the receivers is ready; returns its index.
    ///
    /// ```
    /// let (_tx_a, a) = cuda_mp::channel::<u8>().unwrap();
    /// let (tx_b, b) = cuda_mp::channel::<String>().unwrap();
    /// let mut sel = cuda_mp::Select::new();
    /// sel.add(&a);
    /// let ib = sel.add(&b);
    /// tx_b.send("b".into()).unwrap();
    /// assert_eq!(sel.select().unwrap(), ib);
    /// assert_eq!(b.try_recv().unwrap(), "b");
    /// ```
    pub fn select(&mut self) -> Result<usize, SelectError> {
        self.wait(None).map_err(|e| match e {
            SelectTimeoutError::NoReceivers => SelectError::NoReceivers,
            SelectTimeoutError::Io(m) => SelectError::Io(m),
            SelectTimeoutError::Timeout => SelectError::Io(IoFailure::other("a wait without limit timed out")),
        })
    }

    /// Like [`select`](Self::select), giving up after `timeout` (a zero timeout only looks).
    ///
    /// ```
    /// use std::time::Duration;
    /// let (tx, rx) = cuda_mp::channel::<u8>().unwrap();
    /// let mut sel = cuda_mp::Select::new();
    /// let i = sel.add(&rx);
    /// assert!(sel.select_timeout(Duration::from_millis(10)).unwrap_err().is_timeout());
    /// tx.send(1).unwrap();
    /// assert_eq!(sel.select_timeout(Duration::from_secs(1)), Ok(i));
    /// ```
    pub fn select_timeout(&mut self, timeout: Duration) -> Result<usize, SelectTimeoutError> {
        self.wait(Instant::now().checked_add(timeout))
    }

    fn wait(&mut self, deadline: Option<Instant>) -> Result<usize, SelectTimeoutError> {
        let n = self.entries.len();
        if self.entries.iter().all(Option::is_none) {
            return Err(SelectTimeoutError::NoReceivers);
        }
        loop {
            // Each with its receiver's sleep announced until the wait ends.
            let mut waits: Vec<(usize, Watched, Option<Announced>)> = Vec::new();
            for k in 0..n {
                let i = (self.next + k) % n;
                let Some(entry) = self.entries[i] else { continue };
                match entry.readiness() {
                    Some(Readiness::Ready) => return Ok(self.chosen(i)),
                    Some(Readiness::Wait(fd, asleep)) => waits.push((i, fd, asleep)),
                    None => {
                        return Err(SelectTimeoutError::Io(IoFailure::other(format!(
                            "receiver {i} has no descriptor this process can wait on"
                        ))));
                    }
                }
            }
            let fds: Vec<_> = waits.iter().map(|(_, fd, _)| fd.as_fd()).collect();
            let wait = deadline.map_or(Wait::Forever, Wait::Until);
            let ready =
                crate::sys::wait_readable(&fds, wait).map_err(|e| SelectTimeoutError::Io(IoFailure::from(e)))?;
            // Readable sockets and receivers let go of are looked at again (README.md, "Select and
            // async receives"); one that could not be looked at (no bell to wait on) is reported.
            let unlooked = waits.iter().zip(&ready).find(|&((_, _, asleep), &r)| r && asleep.is_none());
            if let Some(((i, _, _), _)) = unlooked {
                return Ok(self.chosen(*i));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) && !ready.contains(&true) {
                return Err(SelectTimeoutError::Timeout);
            }
        }
    }

    fn chosen(&mut self, i: usize) -> usize {
        self.next = i + 1;
        i
    }
}
