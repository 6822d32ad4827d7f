//! Receives for async code: [`RecvFuture`] and [`RecvStream`], for any executor, without a
//! blocking thread per receive: a poll that finds nothing hands the socket to this process's
//! poller thread, `cuda-mp-poller`, woken through an `eventfd` when a task starts or stops
//! waiting; an idle receiver costs nothing (README.md, "Select and async receives").

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::task::{Context, Poll, Waker};

use serde::de::DeserializeOwned;

use super::flavor::Watched;
use super::inbox::{Announced, Missing, Readiness, Wait};
use super::{Receiver, ReceiverFlavor};
use crate::error::{IoFailure, RecvError, RecvTimeoutError};
use crate::fork::ForkLocal;

/// Sockets that tasks wait on, by registration.
struct Poller {
    waiting: Mutex<Waiting>,
    bell: OwnedFd,
    /// Whether its thread started.
    started: OnceLock<bool>,
}

#[derive(Default)]
struct Waiting {
    next: u64,
    by_id: HashMap<u64, (Watched, Waker)>,
}

/// The poller of this process (a forked child starts its own: its parent's thread is not there).
fn poller() -> Option<&'static Poller> {
    static POLLER: ForkLocal<OnceLock<Option<Poller>>> = ForkLocal::new(OnceLock::new);
    POLLER
        .get()
        .get_or_init(|| {
            let bell = crate::sys::bell().ok()?;
            let poller = Poller { waiting: Mutex::new(Waiting::default()), bell, started: OnceLock::new() };
            Some(poller)
        })
        .as_ref()
        .filter(|p| p.started())
}

impl Poller {
    fn lock(&self) -> MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts the thread on first use; false when it cannot be started.
    fn started(&'static self) -> bool {
        *self
            .started
            .get_or_init(|| std::thread::Builder::new().name("cuda-mp-poller".into()).spawn(|| self.run()).is_ok())
    }

    /// Waits on every registered socket and the bell; wakes the tasks whose socket is ready
    /// (each registration serves one wait).
    fn run(&self) {
        loop {
            let (ids, fds): (Vec<u64>, Vec<Watched>) =
                self.lock().by_id.iter().map(|(&id, (fd, _))| (id, fd.clone())).unzip();
            let mut raw: Vec<_> = fds.iter().map(|fd| fd.as_fd()).collect();
            raw.push(self.bell.as_fd());
            let ready = crate::sys::wait_readable(&raw, Wait::Forever);
            drop(raw);
            let Ok(ready) = ready else {
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            };
            // Our copies of the sockets are released before anything else happens.
            drop(fds);
            if ready[ids.len()] {
                crate::sys::silence(&self.bell);
            }
            let wakers: Vec<Waker> = {
                let mut waiting = self.lock();
                ids.iter()
                    .zip(&ready)
                    .filter(|&(_, &r)| r)
                    .filter_map(|(id, _)| waiting.by_id.remove(id))
                    .map(|(_, w)| w)
                    .collect()
            };
            for waker in wakers {
                waker.wake();
            }
        }
    }

    /// Wakes `waker` once `fd` is readable: a new registration, or `id`'s renewed.
    fn register(&self, id: &mut Option<u64>, fd: Watched, waker: &Waker) {
        {
            let mut waiting = self.lock();
            let key = match *id {
                Some(key) => key,
                None => {
                    waiting.next += 1;
                    waiting.next
                }
            };
            *id = Some(key);
            match waiting.by_id.get_mut(&key) {
                // The same wait polled again: keep the socket, take the newest waker.
                Some((old_fd, old)) if Arc::ptr_eq(old_fd, &fd) => {
                    if !old.will_wake(waker) {
                        *old = waker.clone();
                    }
                    return;
                }
                _ => {
                    waiting.by_id.insert(key, (fd, waker.clone()));
                }
            }
        }
        crate::sys::ring(&self.bell);
    }

    fn deregister(&self, id: &mut Option<u64>) {
        if let Some(key) = id.take()
            && self.lock().by_id.remove(&key).is_some()
        {
            // The poller lets go of its copy of the socket.
            crate::sys::ring(&self.bell);
        }
    }
}

/// One poll of a receive: a message, a failure, or pending with the task registered.
fn poll_recv<T: DeserializeOwned>(
    rx: &Receiver<T>,
    registration: &mut Option<u64>,
    asleep: &mut Option<Announced>,
    cx: &mut Context<'_>,
) -> Poll<Result<T, RecvError>> {
    // A wait announced for the last poll ends: this one looks again.
    *asleep = None;
    let Some(poller) = poller() else {
        return Poll::Ready(Err(RecvError::Io(IoFailure::other(
            "cannot start the thread that waits for async receives",
        ))));
    };
    let next = match &rx.flavor {
        ReceiverFlavor::Remote(remote) => match remote.recv(Some(std::time::Instant::now())) {
            Err(RecvTimeoutError::Timeout) => remote.readiness().map_or(Next::Again, Next::WaitOn),
            got => Next::Got(got.map_err(|e| {
                e.failure().unwrap_or_else(|| RecvError::Io(IoFailure::other("a receive that only looks timed out")))
            })),
        },
        ReceiverFlavor::Local(local) => match local.inbox.try_lock() {
            Some(mut inbox) => match inbox.receive(&local.gauge, Wait::Not) {
                Ok(v) => Next::Got(Ok(v)),
                Err(Missing::Failed(e)) => Next::Got(Err(e)),
                Err(Missing::Empty) => match inbox.readiness(&local.gauge) {
                    Some(readiness) => Next::after(readiness, asleep),
                    None => Next::Got(Err(RecvError::Io(IoFailure::other(
                        "this channel has no descriptor this process can wait on",
                    )))),
                },
            },
            // Another thread is receiving: wait until it is done, then look.
            None => Next::after(local.wait_for_holder(), asleep),
        },
    };
    match next {
        Next::WaitOn(fd) => {
            poller.register(registration, fd, cx.waker());
            Poll::Pending
        }
        Next::Again => {
            cx.waker().wake_by_ref();
            Poll::Pending
        }
        Next::Got(got) => {
            poller.deregister(registration);
            Poll::Ready(got)
        }
    }
}

/// What one poll of a receive found.
enum Next<T> {
    /// A message or a failure: the receive is over.
    Got(Result<T, RecvError>),
    /// Nothing yet: wake the task when this becomes readable.
    WaitOn(Watched),
    /// Nothing yet, but more may be read at once: poll again.
    Again,
}

impl<T> Next<T> {
    /// What to do for a local receiver's `readiness`, keeping the wait it announced.
    fn after(readiness: Readiness, asleep: &mut Option<Announced>) -> Next<T> {
        match readiness {
            Readiness::Wait(fd, announced) => {
                *asleep = announced;
                Next::WaitOn(fd)
            }
            // A spill batch with messages left.
            Readiness::Ready => Next::Again,
        }
    }
}

impl<T: DeserializeOwned> Receiver<T> {
    /// Receives a message without blocking the thread: the future is ready with the next
    /// message, or the error [`recv`](Self::recv) would return. Usable from any executor (a
    /// tokio task, multi-thread or current-thread); dropping the future cancels the receive
    /// and loses nothing.
    ///
    /// ```no_run
    /// use cuda_mp::{channel, spawn, Sender};
    ///
    /// fn worker(tx: Sender<String>) {
    ///     tx.send("hello from a worker".into()).unwrap();
    /// }
    ///
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let (tx, rx) = channel().unwrap();
    ///     let child = spawn(tx, worker);
    ///     let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    ///     let got = runtime.block_on(async { rx.recv_async().await }).unwrap();
    ///     assert_eq!(got, "hello from a worker");
    ///     child.join().unwrap();
    /// }
    /// ```
    pub fn recv_async(&self) -> RecvFuture<'_, T> {
        RecvFuture { rx: self, registration: None, asleep: None }
    }

    /// The messages as a [`futures_core::Stream`] of receive results, borrowing the receiver;
    /// it ends when every sender is gone (and after an [`RecvError::Io`], which it yields). A
    /// malformed message is yielded as `Err(RecvError::Malformed)` and the stream goes on.
    ///
    /// ```no_run
    /// # fn main() {
    /// use std::future::poll_fn;
    /// use std::pin::Pin;
    /// use futures_core::Stream;
    ///
    /// let (tx, rx) = cuda_mp::channel::<u32>().unwrap();
    /// tx.send(1).unwrap();
    /// drop(tx);
    /// let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    /// runtime.block_on(async {
    ///     let mut stream = rx.stream();
    ///     while let Some(item) = poll_fn(|cx| Pin::new(&mut stream).poll_next(cx)).await {
    ///         assert_eq!(item.unwrap(), 1);
    ///     }
    /// });
    /// # }
    /// ```
    pub fn stream(&self) -> RecvStream<'_, T> {
        RecvStream { rx: Holder::Borrowed(self), registration: None, asleep: None, done: false }
    }

    /// Like [`stream`](Self::stream), owning the receiver (to move it into a task).
    ///
    /// ```no_run
    /// # fn main() {
    /// let (tx, rx) = cuda_mp::channel::<u32>().unwrap();
    /// let stream: cuda_mp::RecvStream<'static, u32> = rx.into_stream();
    /// # drop((tx, stream));
    /// # }
    /// ```
    pub fn into_stream(self) -> RecvStream<'static, T> {
        RecvStream { rx: Holder::Owned(Box::new(self)), registration: None, asleep: None, done: false }
    }
}

/// The future of [`Receiver::recv_async`].
///
/// ```no_run
/// # fn main() {
/// let (tx, rx) = cuda_mp::channel::<u8>().unwrap();
/// tx.send(3).unwrap();
/// let future: cuda_mp::RecvFuture<'_, u8> = rx.recv_async();
/// let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
/// assert_eq!(runtime.block_on(future).unwrap(), 3);
/// # }
/// ```
#[must_use = "a future does nothing unless polled"]
pub struct RecvFuture<'a, T> {
    rx: &'a Receiver<T>,
    registration: Option<u64>,
    /// The receiver's sleep announced, or the wait for another thread's receive to end,
    /// while the task waits.
    asleep: Option<Announced>,
}

impl<T> fmt::Debug for RecvFuture<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecvFuture").field("rx", self.rx).field("waiting", &self.registration.is_some()).finish()
    }
}

impl<T: DeserializeOwned> Future for RecvFuture<'_, T> {
    type Output = Result<T, RecvError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        poll_recv(this.rx, &mut this.registration, &mut this.asleep, cx)
    }
}

impl<T> Drop for RecvFuture<'_, T> {
    fn drop(&mut self) {
        if let Some(poller) = self.registration.and(poller()) {
            poller.deregister(&mut self.registration);
        }
    }
}

enum Holder<'a, T> {
    Borrowed(&'a Receiver<T>),
    Owned(Box<Receiver<T>>),
}

impl<T> Holder<'_, T> {
    fn get(&self) -> &Receiver<T> {
        match self {
            Holder::Borrowed(rx) => rx,
            Holder::Owned(rx) => rx,
        }
    }
}

/// The stream of [`Receiver::stream`] and [`Receiver::into_stream`]: receive results until the
/// channel disconnects.
///
/// ```no_run
/// # fn main() {
/// let (_tx, rx) = cuda_mp::channel::<u8>().unwrap();
/// let stream: cuda_mp::RecvStream<'_, u8> = rx.stream();
/// println!("{stream:?}");
/// # }
/// ```
#[must_use = "a stream does nothing unless polled"]
pub struct RecvStream<'a, T> {
    rx: Holder<'a, T>,
    registration: Option<u64>,
    asleep: Option<Announced>,
    done: bool,
}

impl<T> fmt::Debug for RecvStream<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecvStream").field("rx", self.rx.get()).field("done", &self.done).finish()
    }
}

// Nothing in the stream is pinned: moving it between polls is fine whatever the message type.
impl<T> Unpin for RecvStream<'_, T> {}

impl<T: DeserializeOwned> futures_core::Stream for RecvStream<'_, T> {
    type Item = Result<T, RecvError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        match poll_recv(this.rx.get(), &mut this.registration, &mut this.asleep, cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(RecvError::Disconnected)) => {
                this.done = true;
                Poll::Ready(None)
            }
            Poll::Ready(Err(e @ RecvError::Io(_))) => {
                this.done = true;
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(item) => Poll::Ready(Some(item)),
        }
    }
}

impl<T: DeserializeOwned> futures_core::FusedStream for RecvStream<'_, T> {
    fn is_terminated(&self) -> bool {
        self.done
    }
}

impl<T> Drop for RecvStream<'_, T> {
    fn drop(&mut self) {
        if let Some(poller) = self.registration.and(poller()) {
            poller.deregister(&mut self.registration);
        }
    }
}
