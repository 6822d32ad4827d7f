//! One queue, many producers and many consumers in many processes: [`Queue`],
//! [`QueueConsumer`] and their errors. The dispatcher that owns the backlog is in
//! `queue/dispatch.rs`; README.md here explains the protocol and its guarantees.

mod dispatch;

use std::fmt;
use std::sync::{mpsc, Mutex, MutexGuard};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::channel::{channel, Receiver, Sender};
use crate::error::{Error, RecvError, RecvTimeoutError, Result, SendError, SendFailure};

use dispatch::{Ctl, Event, Failure, Join, Reply, Slot};

/// How long a consumer that gave up waiting ([`Queue::get_timeout`]) waits for the dispatcher
/// to confirm; it answers at once unless its process is stuck.
const CANCEL_WAIT: Duration = Duration::from_secs(10);

/// A queue that many processes put to and get from, like `torch.multiprocessing.Queue`: each
/// message goes to exactly one consumer.
///
/// ```no_run
/// use cuda_mp::{spawn, HostTensor, Queue, QueueConsumer};
///
/// fn worker(tasks: QueueConsumer<HostTensor<f32>>) -> usize {
///     let mut done = 0;
///     // Ends once every producer handle is dropped and the backlog is drained.
///     for t in tasks.iter() {
///         t.map_inplace(|x| x * 2.0); // the same memory as the producer's tensor
///         done += 1;
///     }
///     done
/// }
///
/// #[cuda_mp::main]
/// fn main() {
///     let queue = Queue::new().unwrap();
///     let workers: Vec<_> = (0..4).map(|_| spawn(queue.consumer(), worker)).collect();
///     for i in 0..100 {
///         queue.put(HostTensor::full(&[1024], i as f32).unwrap()).unwrap();
///     }
///     drop(queue); // the last producer handle: the workers drain, then stop
///     let done: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
///     assert_eq!(done, 100);
/// }
/// ```
///
/// # Handles
///
/// A `Queue` puts and gets; a [`QueueConsumer`] (from [`Queue::consumer`]) only gets. Both are
/// `Clone` and travel to other processes as spawn arguments or inside messages. The queue is
/// *closed* once every `Queue` handle everywhere is dropped (including by the death of the
/// process holding it): consumers then receive what is left, after which every get reports
/// `Disconnected`. A process that keeps a `Queue` of its own therefore never sees it close;
/// give workers a `QueueConsumer` when they should stop at the end.
///
/// A handle becomes a consumer on its first get (or [`stats`](Queue::stats)); each clone, and
/// each copy received by another process, is a consumer of its own. Gets on one handle from
/// several threads take turns: clone the handle for threads that should wait side by side.
///
/// # Guarantees
///
/// - **Exactly once.** Each message is returned by one get, in one consumer.
/// - **A consumer that dies loses nothing it had not received.** A message counts as
///   delivered when the consumer has decoded it and acknowledged it, which happens before
///   its get returns; if the consumer's process dies (or its handle is dropped) before that,
///   the message goes back to the front of the queue for another consumer. A message it *had*
///   received keeps its tensors only until the process dies: the kernel closes its
///   descriptors and the owners reclaim the memory, as for any channel.
/// - **Puts never wait for consumers.** The queue is unbounded: the dispatcher reads every
///   put into its backlog as it arrives.
/// - **Order.** Messages put through one handle (and its clones, in one process) are handed
///   out in the order put; a message taken back from a dead consumer goes first, ahead of
///   later ones.
///
/// # Design: a dispatcher, not a shared receiver
///
/// [`Receiver`](crate::Receiver) is not `Clone`, and a clone would not give these
/// guarantees: with several processes reading one socket, a message read by a process that
/// dies before decoding it is lost, and no one could tell. Instead the process that calls
/// [`Queue::new`] runs a dispatcher (a few threads) that owns the backlog. A consumer joins
/// once by sending it a request channel and a reply channel; each get asks for one message,
/// the dispatcher sends one, and the consumer acknowledges it. The dispatcher holds every sent
/// message until acknowledged, and the consumer's request channel closing (the kernel closes
/// it when its process dies) tells it to put an unacknowledged message back. Messages are
/// forwarded as decoded values: a tensor's memory is never copied, its lease travels on to the
/// consumer.
///
/// **The queue lives in the process that created it.** When that process exits, the backlog
/// is gone with it and the queue ends: gets report `Disconnected` and puts fail with a
/// disconnected [`SendError`], in every process. Create the queue in the process that
/// outlives the workers (the parent, as a rule).
///
/// Costs: a get is one round trip to the dispatcher plus an acknowledgement. A put from the
/// creating process hands the value to the dispatcher as it is; a put from another process is
/// one more hop, and the dispatcher's process then maps each waiting tensor of it and holds
/// its descriptors (a host tensor: its memory and its message's lease) until it is delivered.
/// The dispatcher runs three threads, plus one per consumer.
///
/// Unbounded means the backlog keeps its tensors alive: every live host tensor is a
/// descriptor in the process that made it, so a producer of fresh tensors running tens of
/// thousands ahead of its consumers reaches the descriptor limit. Its allocations then fail,
/// and a get whose message the dispatcher cannot send reports
/// [`GetError::OutOfDescriptors`] (the message stays first in the queue). Where that can
/// happen, bound how far the producer runs ahead (the queue's benchmark returns a credit per
/// 256 tensors consumed).
pub struct Queue<T> {
    inbox: Sender<T>,
    /// In the process that created the queue (and not in copies sent elsewhere): the
    /// dispatcher's own event queue, which a put enters without being encoded.
    local: Option<mpsc::Sender<Event<T>>>,
    consumer: QueueConsumer<T>,
}

/// The getting end of a [`Queue`], made by [`Queue::consumer`]: it gets like a `Queue`, but
/// does not keep the queue open, so its gets report `Disconnected` once every `Queue` handle
/// is gone and the backlog is drained.
///
/// ```
/// let queue = cuda_mp::Queue::<u32>::new().unwrap();
/// let consumer = queue.consumer();
/// queue.put(1).unwrap();
/// drop(queue); // the only producer
/// assert_eq!(consumer.get().unwrap(), 1);
/// assert!(consumer.get().unwrap_err().is_disconnected());
/// ```
pub struct QueueConsumer<T> {
    join: Sender<Join<T>>,
    /// This handle's consumer, made on first use.
    endpoint: Mutex<Option<Endpoint<T>>>,
}

/// A consumer's two channels to the dispatcher.
struct Endpoint<T> {
    requests: Sender<Ctl>,
    replies: Receiver<Reply<T>>,
}

/// Counters of a queue, from its dispatcher ([`Queue::stats`]).
///
/// ```
/// let queue = cuda_mp::Queue::<u8>::new().unwrap();
/// queue.put(1).unwrap();
/// queue.put(2).unwrap();
/// assert_eq!(queue.get().unwrap(), 1);
/// let stats = queue.stats().unwrap();
/// assert_eq!((stats.backlog, stats.delivered), (1, 1));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct QueueStats {
    /// Messages waiting for a consumer.
    pub backlog: usize,
    /// Messages sent to a consumer and not yet acknowledged.
    pub in_flight: usize,
    /// Consumers that have joined and not left.
    pub consumers: usize,
    /// Consumers waiting in a get.
    pub waiting: usize,
    /// True once every producer handle is gone.
    pub closed: bool,
    /// Messages delivered (acknowledged by their consumer).
    pub delivered: u64,
    /// Messages put back at the front because their consumer left or died before
    /// acknowledging them.
    pub requeued: u64,
    /// Messages the dispatcher could not encode again, dropped (each reported to the get that
    /// would have received it).
    pub discarded: u64,
    /// Puts the dispatcher could not decode (for example out of descriptors in its process),
    /// dropped with their resources released.
    pub undecodable: u64,
}

impl<T> Clone for Queue<T> {
    fn clone(&self) -> Self {
        Queue { inbox: self.inbox.clone(), local: self.local.clone(), consumer: self.consumer.clone() }
    }
}

impl<T> Clone for QueueConsumer<T> {
    /// Another handle on the same queue, a consumer of its own.
    fn clone(&self) -> Self {
        QueueConsumer { join: self.join.clone(), endpoint: Mutex::new(None) }
    }
}

impl<T> fmt::Debug for Queue<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Queue").field("message", &std::any::type_name::<T>()).finish_non_exhaustive()
    }
}

impl<T> fmt::Debug for QueueConsumer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueueConsumer").field("message", &std::any::type_name::<T>()).finish_non_exhaustive()
    }
}

#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
struct QueueWire<T> {
    inbox: Sender<T>,
    join: Sender<Join<T>>,
}

impl<T> Serialize for Queue<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        QueueWire { inbox: self.inbox.clone(), join: self.consumer.join.clone() }.serialize(serializer)
    }
}

impl<'de, T> Deserialize<'de> for Queue<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let QueueWire { inbox, join } = QueueWire::deserialize(deserializer)?;
        Ok(Queue { inbox, local: None, consumer: QueueConsumer { join, endpoint: Mutex::new(None) } })
    }
}

impl<T> Serialize for QueueConsumer<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        self.join.serialize(serializer)
    }
}

impl<'de, T> Deserialize<'de> for QueueConsumer<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        Ok(QueueConsumer { join: Sender::deserialize(deserializer)?, endpoint: Mutex::new(None) })
    }
}

impl<T: Serialize + DeserializeOwned + Send + 'static> Queue<T> {
    /// Creates a queue whose dispatcher runs in this process (see "Design" above: the queue
    /// ends when this process exits).
    ///
    /// ```
    /// let queue = cuda_mp::Queue::<String>::new().unwrap();
    /// queue.put("task".to_string()).unwrap();
    /// assert_eq!(queue.get().unwrap(), "task");
    /// ```
    pub fn new() -> Result<Queue<T>> {
        let ends = dispatch::start::<T>()?;
        Ok(Queue {
            inbox: ends.inbox,
            local: Some(ends.local),
            consumer: QueueConsumer { join: ends.join, endpoint: Mutex::new(None) },
        })
    }

    /// Puts a message on the queue. It never waits for a consumer (the queue is unbounded);
    /// tensors inside are shared, not copied. Fails, handing the message back, when the
    /// queue's process is gone or the message cannot be encoded.
    ///
    /// ```
    /// let queue = cuda_mp::Queue::new().unwrap();
    /// let t = cuda_mp::HostTensor::<u8>::full(&[4096], 7).unwrap();
    /// queue.put(t.clone()).unwrap();
    /// let got = queue.get().unwrap();
    /// assert!(got.shares_storage_with(&t));
    /// ```
    pub fn put(&self, value: T) -> std::result::Result<(), SendError<T>> {
        let Some(local) = &self.local else { return self.inbox.send(value) };
        match local.send(Event::Put(value)) {
            Ok(()) => Ok(()),
            // The dispatcher thread is gone (it runs while any event sender exists, this one
            // included, so it panicked): the inbox reports what became of the queue.
            Err(mpsc::SendError(Event::Put(value))) => self.inbox.send(value),
            // What comes back is what was sent.
            Err(_) => Ok(()),
        }
    }

    /// A handle that only gets and does not keep the queue open.
    ///
    /// ```
    /// let queue = cuda_mp::Queue::<u8>::new().unwrap();
    /// let consumer = queue.consumer();
    /// drop(queue);
    /// assert!(consumer.get().unwrap_err().is_disconnected());
    /// ```
    pub fn consumer(&self) -> QueueConsumer<T> {
        self.consumer.clone()
    }

    /// Blocks until a message is available; see [`QueueConsumer::get`]. While this handle
    /// exists the queue is open, so this never reports `Disconnected` unless the queue's
    /// process is gone.
    ///
    /// ```
    /// let queue = cuda_mp::Queue::new().unwrap();
    /// queue.put(5u64).unwrap();
    /// assert_eq!(queue.get().unwrap(), 5);
    /// ```
    pub fn get(&self) -> std::result::Result<T, GetError> {
        self.consumer.get()
    }

    /// Waits up to `timeout` for a message; see [`QueueConsumer::get_timeout`].
    ///
    /// ```
    /// use std::time::Duration;
    /// let queue = cuda_mp::Queue::<u8>::new().unwrap();
    /// assert!(queue.get_timeout(Duration::from_millis(10)).unwrap_err().is_timeout());
    /// ```
    pub fn get_timeout(&self, timeout: Duration) -> std::result::Result<T, GetTimeoutError> {
        self.consumer.get_timeout(timeout)
    }

    /// Takes a message if one is waiting; see [`QueueConsumer::try_get`].
    ///
    /// ```
    /// let queue = cuda_mp::Queue::<u8>::new().unwrap();
    /// assert!(queue.try_get().unwrap_err().is_empty());
    /// ```
    pub fn try_get(&self) -> std::result::Result<T, TryGetError> {
        self.consumer.try_get()
    }

    /// The queue's counters; see [`QueueConsumer::stats`].
    ///
    /// ```
    /// let queue = cuda_mp::Queue::<u8>::new().unwrap();
    /// queue.put(1).unwrap();
    /// assert!(!queue.stats().unwrap().closed);
    /// ```
    pub fn stats(&self) -> std::result::Result<QueueStats, GetError> {
        self.consumer.stats()
    }
}

/// Why one exchange with the dispatcher failed.
enum Fault {
    Disconnected,
    Malformed(String),
    Io(String),
    OutOfDescriptors(u64),
    /// The dispatcher could not send the message meant for this request (the consumer is
    /// still in step with it).
    Forward(Failure),
}

impl From<RecvError> for Fault {
    fn from(e: RecvError) -> Self {
        match e {
            RecvError::Disconnected => Fault::Disconnected,
            RecvError::Malformed(m) => Fault::Malformed(m),
            RecvError::OutOfDescriptors { limit } => Fault::OutOfDescriptors(limit),
            other => Fault::Io(other.to_string()),
        }
    }
}

impl From<RecvTimeoutError> for Fault {
    fn from(e: RecvTimeoutError) -> Self {
        match e {
            RecvTimeoutError::Disconnected => Fault::Disconnected,
            RecvTimeoutError::Malformed(m) => Fault::Malformed(m),
            RecvTimeoutError::OutOfDescriptors { limit } => Fault::OutOfDescriptors(limit),
            other => Fault::Io(other.to_string()),
        }
    }
}

fn send_fault(f: &SendFailure) -> Fault {
    match f {
        SendFailure::Disconnected => Fault::Disconnected,
        SendFailure::OutOfDescriptors { limit } => Fault::OutOfDescriptors(*limit),
        other => Fault::Io(other.to_string()),
    }
}

fn error_fault(e: Error) -> Fault {
    match e {
        Error::OutOfDescriptors { limit } => Fault::OutOfDescriptors(limit),
        other => Fault::Io(other.to_string()),
    }
}

fn out_of_turn() -> Fault {
    Fault::Io("the queue's dispatcher answered out of turn".into())
}

impl<T: Serialize + DeserializeOwned + Send + 'static> Endpoint<T> {
    fn ask(&self, ctl: Ctl) -> std::result::Result<(), Fault> {
        self.requests.send(ctl).map_err(|e| send_fault(e.failure()))
    }

    /// Acknowledges a message that arrived: from here on it is this consumer's.
    fn ack(&self, slot: Slot<T>) -> std::result::Result<T, Fault> {
        let Slot::Owned(value) = slot else { return Err(out_of_turn()) };
        match self.requests.send(Ctl::Got) {
            Ok(()) => Ok(value),
            // The dispatcher is gone: nobody can hand it out again, so it is ours.
            Err(e) if e.is_disconnected() => Ok(value),
            // The dispatcher does not know it arrived: dropped here, it goes to another
            // consumer when this one leaves (the caller drops it on this error).
            Err(e) => Err(send_fault(e.failure())),
        }
    }

    /// The answer to a `Want`: a message, or why none.
    fn wanted(&self, reply: Reply<T>) -> std::result::Result<T, Fault> {
        match reply {
            Reply::Item(slot) => self.ack(slot),
            Reply::Closed => Err(Fault::Disconnected),
            Reply::Failed(f) => Err(Fault::Forward(f)),
            _ => Err(out_of_turn()),
        }
    }
}

impl<T: Serialize + DeserializeOwned + Send + 'static> QueueConsumer<T> {
    /// Runs one exchange with this handle's consumer, joining first if needed. After a fault
    /// that may leave it out of step with the dispatcher, the consumer leaves (the dispatcher
    /// then puts back whatever it had sent it) and the next call joins afresh.
    fn exchange<R>(
        &self,
        f: impl FnOnce(&Endpoint<T>) -> std::result::Result<R, Fault>,
    ) -> std::result::Result<R, Fault> {
        let mut guard = self.lock();
        if guard.is_none() {
            *guard = Some(self.join()?);
        }
        let endpoint = guard.as_ref().ok_or(Fault::Disconnected)?;
        let result = f(endpoint);
        if matches!(result, Err(ref fault) if !matches!(fault, Fault::Forward(_))) {
            *guard = None;
        }
        result
    }

    fn lock(&self) -> MutexGuard<'_, Option<Endpoint<T>>> {
        match self.endpoint.lock() {
            Ok(g) => g,
            Err(poisoned) => {
                // A panic in the middle of an exchange: its state is unknown, start afresh.
                let mut g = poisoned.into_inner();
                *g = None;
                self.endpoint.clear_poison();
                g
            }
        }
    }

    fn join(&self) -> std::result::Result<Endpoint<T>, Fault> {
        let (requests, requests_rx) = channel::<Ctl>().map_err(error_fault)?;
        let (replies_tx, replies) = channel::<Reply<T>>().map_err(error_fault)?;
        self.join.send(Join { requests: requests_rx, replies: replies_tx }).map_err(|e| send_fault(e.failure()))?;
        Ok(Endpoint { requests, replies })
    }

    /// Blocks until a message is available and returns it. Reports `Disconnected` once the
    /// queue is closed (every [`Queue`] handle dropped) and nothing is left, or when the
    /// queue's process is gone.
    ///
    /// ```
    /// let queue = cuda_mp::Queue::new().unwrap();
    /// let consumer = queue.consumer();
    /// queue.put([1u8, 2, 3]).unwrap();
    /// assert_eq!(consumer.get().unwrap(), [1, 2, 3]);
    /// ```
    pub fn get(&self) -> std::result::Result<T, GetError> {
        self.exchange(|e| {
            e.ask(Ctl::Want)?;
            let reply = e.replies.recv()?;
            e.wanted(reply)
        })
        .map_err(GetError::from)
    }

    /// Waits up to `timeout` for a message. A message that the dispatcher sent just as the
    /// wait ran out is returned rather than put back.
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// let queue = cuda_mp::Queue::<u8>::new().unwrap();
    /// let consumer = queue.consumer();
    /// let start = Instant::now();
    /// assert!(consumer.get_timeout(Duration::from_millis(50)).unwrap_err().is_timeout());
    /// assert!(start.elapsed() >= Duration::from_millis(50));
    /// queue.put(9).unwrap();
    /// assert_eq!(consumer.get_timeout(Duration::from_secs(5)).unwrap(), 9);
    /// ```
    pub fn get_timeout(&self, timeout: Duration) -> std::result::Result<T, GetTimeoutError> {
        let got = self.exchange(|e| {
            e.ask(Ctl::Want)?;
            match e.replies.recv_timeout(timeout) {
                Ok(reply) => e.wanted(reply).map(Some),
                Err(RecvTimeoutError::Timeout) => {
                    e.ask(Ctl::Cancel)?;
                    // The `Want` may have been answered meanwhile: that answer comes first.
                    let mut answer = None;
                    loop {
                        match e.replies.recv_timeout(CANCEL_WAIT) {
                            Ok(Reply::Cancelled) => break,
                            Ok(reply) if answer.is_none() => answer = Some(e.wanted(reply)),
                            Ok(_) => return Err(out_of_turn()),
                            Err(RecvTimeoutError::Timeout) => {
                                return Err(Fault::Io("the queue's dispatcher did not answer".into()))
                            }
                            Err(other) => return Err(other.into()),
                        }
                    }
                    answer.transpose()
                }
                Err(other) => Err(other.into()),
            }
        });
        match got {
            Ok(Some(v)) => Ok(v),
            Ok(None) => Err(GetTimeoutError::Timeout),
            Err(f) => Err(f.into()),
        }
    }

    /// Takes a message if one is waiting now, without waiting for one (it asks the dispatcher,
    /// a round trip). A put made earlier in the queue's own process is seen; one from another
    /// process once it has reached the dispatcher.
    ///
    /// ```
    /// let queue = cuda_mp::Queue::new().unwrap();
    /// let consumer = queue.consumer();
    /// assert!(consumer.try_get().unwrap_err().is_empty());
    /// queue.put('x').unwrap();
    /// assert_eq!(consumer.try_get().unwrap(), 'x');
    /// drop(queue);
    /// assert!(consumer.get().unwrap_err().is_disconnected()); // waits until the close is seen
    /// assert!(consumer.try_get().unwrap_err().is_disconnected());
    /// ```
    pub fn try_get(&self) -> std::result::Result<T, TryGetError> {
        let got = self.exchange(|e| {
            e.ask(Ctl::TryWant)?;
            match e.replies.recv()? {
                Reply::Empty => Ok(None),
                reply => e.wanted(reply).map(Some),
            }
        });
        match got {
            Ok(Some(v)) => Ok(v),
            Ok(None) => Err(TryGetError::Empty),
            Err(f) => Err(f.into()),
        }
    }

    /// An iterator of gets that ends at the first error: once the queue is closed and drained,
    /// or on a failure (call [`get`](Self::get) to see which).
    ///
    /// ```
    /// let queue = cuda_mp::Queue::new().unwrap();
    /// let consumer = queue.consumer();
    /// for i in 0..3u8 {
    ///     queue.put(i).unwrap();
    /// }
    /// drop(queue);
    /// assert_eq!(consumer.iter().collect::<Vec<_>>(), vec![0, 1, 2]);
    /// ```
    pub fn iter(&self) -> impl Iterator<Item = T> + '_ {
        std::iter::from_fn(move || self.get().ok())
    }

    /// The queue's counters, asked of its dispatcher (this makes the handle a consumer, which
    /// the counters include).
    ///
    /// ```
    /// let queue = cuda_mp::Queue::<u8>::new().unwrap();
    /// let consumer = queue.consumer();
    /// queue.put(1).unwrap();
    /// let stats = consumer.stats().unwrap();
    /// assert_eq!((stats.backlog, stats.consumers), (1, 1));
    /// ```
    pub fn stats(&self) -> std::result::Result<QueueStats, GetError> {
        self.exchange(|e| {
            e.ask(Ctl::Stats)?;
            match e.replies.recv()? {
                Reply::Stats(s) => Ok(s),
                _ => Err(out_of_turn()),
            }
        })
        .map_err(GetError::from)
    }
}

/// Why a blocking get failed.
///
/// ```
/// let queue = cuda_mp::Queue::<u8>::new().unwrap();
/// let consumer = queue.consumer();
/// drop(queue);
/// let err = consumer.get().unwrap_err();
/// assert_eq!(err, cuda_mp::GetError::Disconnected);
/// assert_eq!(err.to_string(), "getting from an empty and closed queue");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GetError {
    /// The queue is closed and drained, or its process is gone.
    #[error("getting from an empty and closed queue")]
    Disconnected,
    /// A message arrived that does not decode here, or one the queue could not forward (then
    /// it is discarded). One that does not decode here is put back for another consumer.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The operating system reported an error.
    #[error("failed to get: {0}")]
    Io(String),
    /// A process is out of file descriptors (this one, or the queue's for a message it could
    /// not forward, which stays queued); the limit is given.
    #[error("out of file descriptors: this process may open at most {limit}")]
    OutOfDescriptors {
        /// The process's soft limit on open descriptors.
        limit: u64,
    },
}

/// Why a non-blocking get failed.
///
/// ```
/// let queue = cuda_mp::Queue::<u8>::new().unwrap();
/// let err = queue.try_get().unwrap_err();
/// assert_eq!(err, cuda_mp::TryGetError::Empty);
/// assert_eq!(err.to_string(), "getting from an empty queue");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TryGetError {
    /// No message is waiting.
    #[error("getting from an empty queue")]
    Empty,
    /// The queue is closed and drained, or its process is gone.
    #[error("getting from an empty and closed queue")]
    Disconnected,
    /// As [`GetError::Malformed`].
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The operating system reported an error.
    #[error("failed to get: {0}")]
    Io(String),
    /// As [`GetError::OutOfDescriptors`].
    #[error("out of file descriptors: this process may open at most {limit}")]
    OutOfDescriptors {
        /// The process's soft limit on open descriptors.
        limit: u64,
    },
}

/// Why a get with a timeout failed.
///
/// ```
/// use std::time::Duration;
/// let queue = cuda_mp::Queue::<u8>::new().unwrap();
/// let err = queue.get_timeout(Duration::from_millis(10)).unwrap_err();
/// assert_eq!(err, cuda_mp::GetTimeoutError::Timeout);
/// assert_eq!(err.to_string(), "timed out waiting on queue");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GetTimeoutError {
    /// No message came in time.
    #[error("timed out waiting on queue")]
    Timeout,
    /// The queue is closed and drained, or its process is gone.
    #[error("getting from an empty and closed queue")]
    Disconnected,
    /// As [`GetError::Malformed`].
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The operating system reported an error.
    #[error("failed to get: {0}")]
    Io(String),
    /// As [`GetError::OutOfDescriptors`].
    #[error("out of file descriptors: this process may open at most {limit}")]
    OutOfDescriptors {
        /// The process's soft limit on open descriptors.
        limit: u64,
    },
}

fn forward_text(f: Failure) -> Fault {
    match f {
        Failure::Discarded(m) => Fault::Malformed(format!("the queue could not forward a message and dropped it: {m}")),
        Failure::Io(m) => Fault::Io(format!("the queue could not forward a message (it stays queued): {m}")),
        Failure::OutOfDescriptors(limit) => Fault::OutOfDescriptors(limit),
    }
}

impl From<Fault> for GetError {
    fn from(f: Fault) -> Self {
        match f {
            Fault::Disconnected => GetError::Disconnected,
            Fault::Malformed(m) => GetError::Malformed(m),
            Fault::Io(m) => GetError::Io(m),
            Fault::OutOfDescriptors(limit) => GetError::OutOfDescriptors { limit },
            Fault::Forward(f) => forward_text(f).into(),
        }
    }
}

impl From<Fault> for TryGetError {
    fn from(f: Fault) -> Self {
        match GetError::from(f) {
            GetError::Disconnected => TryGetError::Disconnected,
            GetError::Malformed(m) => TryGetError::Malformed(m),
            GetError::Io(m) => TryGetError::Io(m),
            GetError::OutOfDescriptors { limit } => TryGetError::OutOfDescriptors { limit },
        }
    }
}

impl From<Fault> for GetTimeoutError {
    fn from(f: Fault) -> Self {
        match GetError::from(f) {
            GetError::Disconnected => GetTimeoutError::Disconnected,
            GetError::Malformed(m) => GetTimeoutError::Malformed(m),
            GetError::Io(m) => GetTimeoutError::Io(m),
            GetError::OutOfDescriptors { limit } => GetTimeoutError::OutOfDescriptors { limit },
        }
    }
}

impl GetError {
    /// True when the queue is closed and drained, or its process is gone.
    ///
    /// ```
    /// let queue = cuda_mp::Queue::<u8>::new().unwrap();
    /// let consumer = queue.consumer();
    /// drop(queue);
    /// assert!(consumer.get().unwrap_err().is_disconnected());
    /// ```
    pub fn is_disconnected(&self) -> bool {
        matches!(self, GetError::Disconnected)
    }
}

impl TryGetError {
    /// True when no message was waiting.
    ///
    /// ```
    /// let queue = cuda_mp::Queue::<u8>::new().unwrap();
    /// assert!(queue.try_get().unwrap_err().is_empty());
    /// ```
    pub fn is_empty(&self) -> bool {
        matches!(self, TryGetError::Empty)
    }

    /// True when the queue is closed and drained, or its process is gone.
    ///
    /// ```
    /// let queue = cuda_mp::Queue::<u8>::new().unwrap();
    /// let consumer = queue.consumer();
    /// drop(queue);
    /// assert!(consumer.get().unwrap_err().is_disconnected()); // waits until the close is seen
    /// assert!(consumer.try_get().unwrap_err().is_disconnected());
    /// ```
    pub fn is_disconnected(&self) -> bool {
        matches!(self, TryGetError::Disconnected)
    }
}

impl GetTimeoutError {
    /// True when no message came in time.
    ///
    /// ```
    /// use std::time::Duration;
    /// let queue = cuda_mp::Queue::<u8>::new().unwrap();
    /// assert!(queue.get_timeout(Duration::from_millis(10)).unwrap_err().is_timeout());
    /// ```
    pub fn is_timeout(&self) -> bool {
        matches!(self, GetTimeoutError::Timeout)
    }

    /// True when the queue is closed and drained, or its process is gone.
    ///
    /// ```
    /// use std::time::Duration;
    /// let queue = cuda_mp::Queue::<u8>::new().unwrap();
    /// let consumer = queue.consumer();
    /// drop(queue);
    /// assert!(consumer.get_timeout(Duration::from_secs(5)).unwrap_err().is_disconnected());
    /// ```
    pub fn is_disconnected(&self) -> bool {
        matches!(self, GetTimeoutError::Disconnected)
    }
}

impl From<GetError> for Error {
    fn from(e: GetError) -> Self {
        match e {
            GetError::Disconnected => Error::Recv(RecvError::Disconnected),
            GetError::Malformed(m) => Error::Recv(RecvError::Malformed(m)),
            GetError::Io(m) => Error::Recv(RecvError::Io(m)),
            GetError::OutOfDescriptors { limit } => Error::OutOfDescriptors { limit },
        }
    }
}

impl From<GetTimeoutError> for Error {
    fn from(e: GetTimeoutError) -> Self {
        match e {
            GetTimeoutError::Timeout => Error::Timeout(Duration::ZERO),
            GetTimeoutError::Disconnected => Error::Recv(RecvError::Disconnected),
            GetTimeoutError::Malformed(m) => Error::Recv(RecvError::Malformed(m)),
            GetTimeoutError::Io(m) => Error::Recv(RecvError::Io(m)),
            GetTimeoutError::OutOfDescriptors { limit } => Error::OutOfDescriptors { limit },
        }
    }
}
