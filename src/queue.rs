//! One queue, many producers and many consumers in many processes: [`Queue`],
//! [`QueueConsumer`] and their errors. The dispatcher that owns the backlog is in
//! `queue/dispatch.rs`; README.md here explains the protocol and its guarantees.

mod dispatch;

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::channel::{Receiver, Sender, channel};
use crate::error::{
    Error, IoFailure, RecvError, RecvTimeoutError, Result, SendError, SendFailure, TryRecvError, same_failure,
};
use crate::fork::ForkLocal;

use dispatch::{Ctl, Failure, Hub, Join, Reply, Slot};

/// A decoder of one frame of the queue's protocol (for fuzzing): what became of it.
#[cfg(all(feature = "cuda", any(test, feature = "testing")))]
type FrameDecoder = fn(&[u8], Vec<std::os::fd::OwnedFd>) -> String;

/// The queue's frames as the dispatcher and the consumers read them: a request, an answer
/// (of the fuzzers' message type), a consumer joining.
#[cfg(all(feature = "cuda", any(test, feature = "testing")))]
pub(crate) const FRAME_DECODERS: [FrameDecoder; 3] = {
    use crate::testing::fuzz::Message;
    fn said<T>(decoded: std::result::Result<Option<T>, String>, what: &str) -> String {
        match decoded {
            Ok(Some(_)) => format!("a {what}"),
            Ok(None) => "a frame that is not a message".into(),
            Err(e) => e,
        }
    }
    [
        |bytes, fds| said(crate::channel::decode_frame::<Ctl>(bytes, fds), "request"),
        |bytes, fds| said(crate::channel::decode_frame::<Reply<Message>>(bytes, fds), "reply"),
        |bytes, fds| said(crate::channel::decode_frame::<Join<Message>>(bytes, fds), "join"),
    ]
};

/// How long an unbounded `stats`, and a delivered message's acknowledgement, wait for the
/// dispatcher; it answers (reads) at once unless its process is stuck.
const CANCEL_WAIT: Duration = Duration::from_secs(10);

/// The least a `stats_timeout` waits for the dispatcher's answer, once it has the handle.
const STATS_FLOOR: Duration = Duration::from_millis(100);

/// How long a `get_timeout` past its limit, or a `try_get`, waits for the dispatcher's answer
/// (a round trip to one that keeps up takes far less, and one reading a flood of puts may lag
/// for a while: leaving it then would only make the consumer join again); then the consumer
/// leaves, giving back what it asked for, and the call reports a time-out (empty).
const ANSWER_PAST_LIMIT: Duration = Duration::from_secs(1);

/// How many messages a consumer keeps asked for ahead of its gets unless told otherwise
/// ([`QueueConsumer::with_prefetch`]). With two, the next message is usually waiting in the
/// consumer's channel even when the dispatcher is once slow to answer: one consumer of small
/// messages got 1.6-1.7x as many per second as when asking for one at a time, and 1.2x as
/// many as with one ahead; four added under a tenth more, and each is one more message a busy
/// consumer holds back from idle ones.
pub const QUEUE_PREFETCH: usize = 2;

/// The most messages a consumer may keep asked for ahead of its gets.
const MAX_PREFETCH: usize = 64;

/// A queue that many processes put to and get from, like `torch.multiprocessing.Queue`: each
/// message goes to exactly one consumer.
///
/// **Give workers [`queue.consumer()`](Queue::consumer), not `queue.clone()`**, when they
/// should stop once the producers are done: every `Queue` handle keeps the queue open, so a
/// worker holding one never sees it close and its `for t in queue.iter()` never ends.
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
/// A turn's wait counts in a `get_timeout`'s limit, and a `try_get` takes nothing while
/// another thread's get holds the handle; a `stats` waits for its turn (`stats_timeout` within
/// its limit).
///
/// # Guarantees
///
/// - **Exactly once.** Each message is returned by one get, in one consumer.
/// - **A consumer that dies loses nothing it had not received.** A message counts as
///   delivered when the consumer has decoded it and acknowledged it, which happens before
///   its get returns; if the consumer's process dies (or its handle is dropped) before that,
///   the message goes back to the front of the queue for another consumer. So do the
///   messages it had been sent ahead of its gets ([`QueueConsumer::with_prefetch`]). A
///   message it *had* received keeps its tensors only until the process dies: the kernel
///   closes its descriptors and the owners reclaim the memory, as for any channel.
/// - **Puts never wait for consumers.** The queue is unbounded: the dispatcher reads every
///   put into its backlog as it arrives. A put from another process whose dispatcher is behind
///   (stopped, busy) is kept in that process's backlog until it can be handed on, as a
///   channel's send is; a producer killed before that loses those puts, as a killed
///   `multiprocessing.Queue` producer loses what its feeder thread had not written. Returning
///   from `main` waits for them; [`flush_sends`](crate::flush_sends) waits for them within a
///   limit.
/// - **Order.** Messages put through one handle (and its clones, in one process) are handed
///   out in the order put, and one consumer's gets return them in the order handed to it;
///   messages taken back from a dead consumer go first, in their order, ahead of later ones.
///
/// # Design: a dispatcher, not a shared receiver
///
/// The process that calls [`Queue::new`] runs a dispatcher that owns the backlog and holds
/// each message until a get acknowledges it (a shared [`Receiver`](crate::Receiver) could
/// lose one unseen); tensors are forwarded, never copied. The protocol and why it is exactly
/// once: `src/queue/README.md` in the repository.
///
/// **The queue lives in the process that created it.** When that process exits, the backlog
/// is gone with it and the queue ends: gets report `Disconnected` and puts fail with a
/// disconnected [`SendError`], in every process. Create the queue in the process that
/// outlives the workers (the parent, as a rule).
///
/// Costs: a get whose message was prefetched takes it from its own channel and sends one
/// acknowledgement that also asks for the next; one that finds nothing there waits for the
/// dispatcher. A put from the creating process hands the value to the dispatcher as it is; a
/// put from another process is one more hop, and the dispatcher's process then maps each
/// waiting tensor of it and holds its descriptors (a host tensor: its memory and its
/// message's lease) until it is delivered. The queue's process runs two threads, plus one per
/// consumer, which read and handle each event on the spot; a put in that process may do the
/// send to a consumer that waits for its message.
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
    /// dispatcher itself, which a put enters without being encoded.
    local: Option<Arc<Hub<T>>>,
    /// The process generation (`crate::fork`) `local` belongs to: a forked child's copy of the
    /// queue puts through the inbox, since the dispatcher and its readers are its parent's.
    generation: u64,
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
    /// Messages kept asked for ahead of the gets.
    prefetch: usize,
    /// This handle's consumer, made on first use.
    /// (A forked child's copy joins afresh: its parent's endpoint is the parent's.)
    endpoint: ForkLocal<EndpointSlot<T>>,
}

/// A handle's consumer, made on first use, and how many threads wait for it while another
/// thread's exchange holds it.
struct EndpointSlot<T> {
    endpoint: Mutex<Option<Endpoint<T>>>,
    waiting: AtomicUsize,
}

impl<T> EndpointSlot<T> {
    fn new() -> Self {
        EndpointSlot { endpoint: Mutex::new(None), waiting: AtomicUsize::new(0) }
    }
}

/// A consumer's two channels to the dispatcher, and where it stands with it.
struct Endpoint<T> {
    requests: Sender<Ctl>,
    replies: Receiver<Reply<T>>,
    /// Messages wanted whose answers are not read yet: they are on their way, or will be sent
    /// when there is a message.
    asked: usize,
    /// Answers to wants read while waiting for the answer to another request, to be returned
    /// by the next gets in this order. Their messages are still in flight (not acknowledged).
    early: VecDeque<Reply<T>>,
    /// Whether any answer came on this endpoint's reply channel.
    answered: bool,
}

/// Counters of a queue, from its dispatcher ([`Queue::stats`]).
///
/// ```
/// let queue = cuda_mp::Queue::<u8>::new().unwrap();
/// for i in 1..=4 {
///     queue.put(i).unwrap();
/// }
/// assert_eq!(queue.get().unwrap(), 1);
/// let stats = queue.stats().unwrap();
/// // 2 and 3 are in flight to this handle, asked for ahead of its next gets.
/// assert_eq!(cuda_mp::QUEUE_PREFETCH, 2);
/// assert_eq!((stats.backlog, stats.in_flight, stats.delivered), (1, 2, 1));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct QueueStats {
    /// Messages waiting for a consumer.
    pub backlog: usize,
    /// Messages sent to a consumer and not yet acknowledged: in its get, or prefetched for
    /// its next gets.
    pub in_flight: usize,
    /// Consumers that have joined and not left.
    pub consumers: usize,
    /// Consumers that asked for a message and have none in flight: waiting in a get (or just
    /// about to).
    pub waiting: usize,
    /// True once every producer handle is gone.
    pub closed: bool,
    /// Messages delivered (acknowledged by their consumer).
    pub delivered: u64,
    /// Messages put back at the front because their consumer left or died before
    /// acknowledging them (prefetched ones included).
    pub requeued: u64,
    /// Messages dropped: the dispatcher could not encode one again, or a consumer could not
    /// decode one it was sent (each reported to the get that would have received it).
    pub discarded: u64,
    /// Puts the dispatcher could not decode (for example out of descriptors in its process),
    /// dropped with their resources released.
    pub undecodable: u64,
}

impl<T> Clone for Queue<T> {
    fn clone(&self) -> Self {
        Queue {
            inbox: self.inbox.clone(),
            local: self.local.clone(),
            generation: self.generation,
            consumer: self.consumer.clone(),
        }
    }
}

impl<T> Clone for QueueConsumer<T> {
    /// Another handle on the same queue, a consumer of its own with the same prefetch.
    fn clone(&self) -> Self {
        QueueConsumer { join: self.join.clone(), prefetch: self.prefetch, endpoint: ForkLocal::new(EndpointSlot::new) }
    }
}

impl<T> QueueConsumer<T> {
    fn new(join: Sender<Join<T>>, prefetch: usize) -> Self {
        QueueConsumer { join, prefetch: prefetch.min(MAX_PREFETCH), endpoint: ForkLocal::new(EndpointSlot::new) }
    }

    /// This handle with its gets keeping `n` messages asked for ahead of them (at most 64;
    /// [`QUEUE_PREFETCH`] unless set); it never has more than `n` (or one) in flight, once the
    /// messages it had asked for before the setting changed are taken. The handle's copies
    /// (clones, and copies sent to other processes) keep the setting, as do a [`Queue`]'s.
    ///
    /// A get takes a prefetched message from its own channel without waiting for the
    /// dispatcher, which makes one consumer of small messages much faster. The cost: between
    /// its gets, and while it does anything else, a consumer holds up to `n` messages that
    /// another, idle consumer could have had. The dispatcher serves a consumer that holds none
    /// before it sends any consumer one more, so that happens only when every waiting consumer
    /// has one; but a message prefetched by a consumer that is busy for a long time waits that
    /// long. A message prefetched and not returned is not delivered: it goes back to the front
    /// of the queue when the handle is dropped or its process dies. Use 0 (ask for a message
    /// only in a get) for long tasks shared among several consumers, and where a consumer may
    /// wait for something that another consumer's message must produce: a message it holds
    /// would wait with it.
    ///
    /// ```
    /// let queue = cuda_mp::Queue::new().unwrap();
    /// let consumer = queue.consumer().with_prefetch(0);
    /// assert_eq!(consumer.prefetch(), 0);
    /// queue.put(1u8).unwrap();
    /// queue.put(2).unwrap();
    /// assert_eq!(consumer.get().unwrap(), 1);
    /// // Nothing was asked for ahead: the second waits in the queue for any consumer.
    /// assert_eq!(consumer.stats().unwrap().backlog, 1);
    /// ```
    pub fn with_prefetch(self, n: usize) -> Self {
        let QueueConsumer { join, endpoint, .. } = self;
        QueueConsumer { join, prefetch: n.min(MAX_PREFETCH), endpoint }
    }

    /// How many messages this handle's gets keep asked for ahead of them.
    ///
    /// ```
    /// let queue = cuda_mp::Queue::<u8>::new().unwrap();
    /// assert_eq!(queue.consumer().prefetch(), cuda_mp::QUEUE_PREFETCH);
    /// ```
    pub fn prefetch(&self) -> usize {
        self.prefetch
    }
}

impl<T> fmt::Debug for Queue<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Queue").field("message", &std::any::type_name::<T>()).finish_non_exhaustive()
    }
}

impl<T> fmt::Debug for QueueConsumer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueueConsumer")
            .field("message", &std::any::type_name::<T>())
            .field("prefetch", &self.prefetch)
            .finish_non_exhaustive()
    }
}

#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
struct QueueWire<T> {
    inbox: Sender<T>,
    join: Sender<Join<T>>,
    prefetch: u32,
}

impl<T> Serialize for Queue<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        // At most MAX_PREFETCH: fits.
        let prefetch = self.consumer.prefetch as u32;
        QueueWire { inbox: self.inbox.clone(), join: self.consumer.join.clone(), prefetch }.serialize(serializer)
    }
}

impl<'de, T> Deserialize<'de> for Queue<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let QueueWire { inbox, join, prefetch } = QueueWire::deserialize(deserializer)?;
        Ok(Queue {
            inbox,
            local: None,
            generation: crate::fork::generation(),
            consumer: QueueConsumer::new(join, prefetch as usize),
        })
    }
}

#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
struct ConsumerWire<T> {
    join: Sender<Join<T>>,
    prefetch: u32,
}

impl<T> Serialize for QueueConsumer<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        // At most MAX_PREFETCH: fits.
        ConsumerWire { join: self.join.clone(), prefetch: self.prefetch as u32 }.serialize(serializer)
    }
}

impl<'de, T> Deserialize<'de> for QueueConsumer<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let ConsumerWire { join, prefetch } = ConsumerWire::deserialize(deserializer)?;
        Ok(QueueConsumer::new(join, prefetch as usize))
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
            generation: crate::fork::generation(),
            consumer: QueueConsumer::new(ends.join, QUEUE_PREFETCH),
        })
    }

    /// This handle with its gets keeping `n` messages asked for ahead of them (see
    /// [`QueueConsumer::with_prefetch`]); `0`: a message goes to this handle only in a get, as
    /// with `multiprocessing.Queue`.
    ///
    /// ```
    /// let queue = cuda_mp::Queue::new().unwrap().with_prefetch(0);
    /// queue.put(1u8).unwrap();
    /// queue.put(2).unwrap();
    /// assert_eq!(queue.get().unwrap(), 1);
    /// assert_eq!(queue.stats().unwrap().backlog, 1, "the second waits for any consumer");
    /// ```
    pub fn with_prefetch(self, n: usize) -> Self {
        Queue { consumer: self.consumer.with_prefetch(n), ..self }
    }

    /// Puts a message on the queue. It never waits for a consumer (the queue is unbounded);
    /// tensors inside are shared, not copied. From another process it fails, handing the
    /// message back, when the queue's process is gone or the message cannot be encoded. In the
    /// queue's own process (the handle that made it, its clones, and forked children's are
    /// other processes) the message is not encoded here but when it is handed to a consumer,
    /// as `multiprocessing.Queue` pickles in its feeder thread: one that cannot be encoded
    /// then is dropped, counted in [`QueueStats::discarded`], and the consumer it was for gets
    /// [`GetError::Malformed`] saying why. As a channel's send, it may
    /// encode the message on the calling thread (in the queue's process, when a consumer waits
    /// for it), so its `Serialize` must not take a lock that the calling thread holds; it
    /// never encodes another thread's message, nor waits for one's.
    ///
    /// ```
    /// let queue = cuda_mp::Queue::new().unwrap();
    /// let t = cuda_mp::HostTensor::<u8>::full(&[4096], 7).unwrap();
    /// queue.put(t.clone()).unwrap();
    /// let got = queue.get().unwrap();
    /// assert!(got.shares_storage_with(&t));
    /// ```
    pub fn put(&self, value: T) -> std::result::Result<(), SendError<T>> {
        let local = self.local.as_ref().filter(|_| self.generation == crate::fork::generation());
        let Some(local) = local else { return self.inbox.send(value) };
        local.put(value);
        Ok(())
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

    /// An iterator of gets that ends at the first error; see [`QueueConsumer::iter`]. This
    /// handle keeps the queue open, so the iterator does not end when the producers are done
    /// (only when the queue's process is gone or a get fails): to drain a queue and stop,
    /// iterate a [`QueueConsumer`].
    ///
    /// ```
    /// let queue = cuda_mp::Queue::new().unwrap();
    /// for i in 0..3u8 {
    ///     queue.put(i).unwrap();
    /// }
    /// assert_eq!(queue.iter().take(3).collect::<Vec<_>>(), vec![0, 1, 2]);
    /// ```
    pub fn iter(&self) -> impl Iterator<Item = T> + '_ {
        self.consumer.iter()
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

    /// The queue's counters, waiting at most `timeout`; see [`QueueConsumer::stats_timeout`].
    ///
    /// ```
    /// let queue = cuda_mp::Queue::<u8>::new().unwrap();
    /// assert!(!queue.stats_timeout(std::time::Duration::from_secs(5)).unwrap().closed);
    /// ```
    pub fn stats_timeout(&self, timeout: Duration) -> std::result::Result<QueueStats, GetTimeoutError> {
        self.consumer.stats_timeout(timeout)
    }

    /// Puts every message that arrives on `source` until its senders are gone: a channel from
    /// another host ([`Sender::connect_remote`](crate::Sender::connect_remote) to a
    /// [`RemoteListener`](crate::RemoteListener)), or any other receiver. A thread of this
    /// process receives and puts; it holds a handle of the queue, so the queue stays open
    /// while `source` has a sender. Messages keep their order; each is put as received (a
    /// tensor from another host is this host's copy, shared from here on).
    ///
    /// A message that does not decode (or that this process has no descriptor left for) is
    /// dropped and counted, as the queue's own inbox does. The feed ends when `source`
    /// disconnects, when the queue is gone (the message in hand is then lost with it), or at
    /// a failure of the transport under `source`. Dropping the [`Feed`] leaves its thread
    /// running; [`Feed::join_timeout`] waits for its end within a limit.
    ///
    /// ```
    /// let queue = cuda_mp::Queue::new().unwrap();
    /// let (tx, rx) = cuda_mp::channel::<u32>().unwrap();
    /// let feed = queue.feed(rx).unwrap();
    /// tx.send(7).unwrap();
    /// drop(tx);
    /// assert_eq!(feed.join().unwrap().fed, 1);
    /// assert_eq!(queue.get().unwrap(), 7);
    /// ```
    pub fn feed(&self, source: Receiver<T>) -> Result<Feed> {
        let queue = self.clone();
        let (running, ended) = std::sync::mpsc::channel::<std::convert::Infallible>();
        let thread = std::thread::Builder::new().name("cuda-mp-queue-feed".into()).spawn(move || {
            // Dropped when the thread ends, however it ends: what `join_timeout` waits for
            // (after the source and the queue handle, locals declared after it).
            let _running = running;
            let (source, queue) = (source, queue);
            let mut end = FeedEnd { fed: 0, undecodable: 0 };
            loop {
                // A `Deserialize` that panics is a message that does not decode, as elsewhere.
                match panic_as_malformed(|| source.recv(), RecvError::Malformed) {
                    Ok(value) => {
                        queue.put(value).map_err(|e| (end, e.into()))?;
                        end.fed += 1;
                    }
                    Err(RecvError::Disconnected) => return Ok(end),
                    Err(RecvError::Malformed(_) | RecvError::OutOfDescriptors { .. }) => end.undecodable += 1,
                    Err(e @ RecvError::Io(_)) => return Err((end, Error::Recv(e))),
                }
            }
        })?;
        Ok(Feed { thread: Some(thread), ended: std::sync::Mutex::new(ended) })
    }
}

/// A thread putting what a receiver gets on a [`Queue`] ([`Queue::feed`]).
pub struct Feed {
    /// `None` once joined.
    thread: Option<std::thread::JoinHandle<std::result::Result<FeedEnd, (FeedEnd, Error)>>>,
    /// Disconnected when the thread ends (in a lock only so that a `Feed` is `Sync`: every
    /// use has `&mut self`).
    ended: std::sync::Mutex<std::sync::mpsc::Receiver<std::convert::Infallible>>,
}

/// What a [`Feed`] did, once its source disconnected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct FeedEnd {
    /// Messages put on the queue.
    pub fed: u64,
    /// Messages that arrived and did not decode, dropped.
    pub undecodable: u64,
}

impl Feed {
    /// Waits until the source disconnects and says what the feed did; an error if it ended
    /// earlier (the queue gone, or the transport failed).
    pub fn join(mut self) -> Result<FeedEnd> {
        self.end()
    }

    /// As [`join`](Self::join), for `timeout` at most: [`Error::Timeout`] while the feed
    /// runs (it runs on, and can be joined again). Once it has said how the feed ended, a
    /// later call is an error.
    ///
    /// ```
    /// # use std::time::Duration;
    /// let queue = cuda_mp::Queue::<u32>::new().unwrap();
    /// let (tx, rx) = cuda_mp::channel::<u32>().unwrap();
    /// let mut feed = queue.feed(rx).unwrap();
    /// assert!(feed.join_timeout(Duration::from_millis(10)).unwrap_err().is_timeout());
    /// drop(tx);
    /// assert_eq!(feed.join_timeout(Duration::from_secs(60)).unwrap().fed, 0);
    /// ```
    pub fn join_timeout(&mut self, timeout: Duration) -> Result<FeedEnd> {
        let ended = self.ended.get_mut().unwrap_or_else(|p| p.into_inner());
        match ended.recv_timeout(timeout) {
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) if self.thread.is_some() => Err(Error::Timeout(timeout)),
            _ => self.end(),
        }
    }

    fn end(&mut self) -> Result<FeedEnd> {
        match self.thread.take().map(|thread| thread.join()) {
            Some(Ok(Ok(end))) => Ok(end),
            Some(Ok(Err((_, error)))) => Err(error),
            Some(Err(_)) => Err(Error::Io(std::io::Error::other("the queue's feed thread panicked"))),
            None => Err(Error::Unsupported("this feed was joined already".into())),
        }
    }

    /// True once the feed has ended.
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|thread| thread.is_finished())
    }
}

impl fmt::Debug for Feed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Feed").field("finished", &self.is_finished()).finish()
    }
}

/// Why one exchange with the dispatcher failed.
enum Fault {
    Disconnected,
    Malformed(String),
    Io(IoFailure),
    OutOfDescriptors {
        limit: u64,
    },
    /// The dispatcher could not send the message meant for this request (the consumer is
    /// still in step with it).
    Forward(Failure),
    /// The message meant for this request arrived and does not decode here: the dispatcher is
    /// told to drop it (the consumer is still in step with it).
    Rejected(String),
    /// The dispatcher did not answer in time (its process stopped or stuck): the consumer is
    /// out of step and leaves (the messages in flight to it go back to the backlog).
    Unanswered,
}

impl Fault {
    /// Whether the consumer is still in step with the dispatcher after this fault: when the
    /// dispatcher could not forward a message meant for it (and did not cut it off), or knows
    /// that the consumer dropped one that does not decode.
    fn leaves_in_step(&self) -> bool {
        matches!(self, Fault::Forward(f) if !matches!(f, Failure::Unreadable(_))) || matches!(self, Fault::Rejected(_))
    }
}

impl From<RecvError> for Fault {
    fn from(e: RecvError) -> Self {
        same_failure!(e, RecvError => Fault)
    }
}

impl From<TryRecvError> for Fault {
    fn from(e: TryRecvError) -> Self {
        same_failure!(e, TryRecvError => Fault, other => Fault::Io(IoFailure::other(other.to_string())))
    }
}

impl From<RecvTimeoutError> for Fault {
    fn from(e: RecvTimeoutError) -> Self {
        same_failure!(e, RecvTimeoutError => Fault, other => Fault::Io(IoFailure::other(other.to_string())))
    }
}

fn send_fault(f: &SendFailure) -> Fault {
    match f {
        SendFailure::Disconnected => Fault::Disconnected,
        SendFailure::OutOfDescriptors { limit } => Fault::OutOfDescriptors { limit: *limit },
        SendFailure::Io(e) => Fault::Io(e.clone()),
        other => Fault::Io(IoFailure::other(other.to_string())),
    }
}

fn error_fault(e: Error) -> Fault {
    match e {
        Error::OutOfDescriptors { limit } => Fault::OutOfDescriptors { limit },
        Error::Io(e) => Fault::Io(e.into()),
        other => Fault::Io(IoFailure::other(other.to_string())),
    }
}

/// Runs a receive, a panic of the message's `Deserialize` made the receive's `malformed` error:
/// the message is then refused as one that does not decode here (and dropped once every
/// consumer in turn refused it), where a panic would leave it first in line for every get.
fn panic_as_malformed<R, E>(
    receive: impl FnOnce() -> std::result::Result<R, E>,
    malformed: fn(String) -> E,
) -> std::result::Result<R, E> {
    crate::os::catch_quietly(receive)
        .unwrap_or_else(|panic| Err(malformed(format!("the message's decoding panicked: {panic}"))))
}

fn out_of_turn() -> Fault {
    Fault::Io(IoFailure::other("the queue's dispatcher answered out of turn"))
}

impl<T: Serialize + DeserializeOwned + Send + 'static> Endpoint<T> {
    fn ask(&self, ctl: Ctl) -> std::result::Result<(), Fault> {
        self.requests.send(ctl).map_err(|e| send_fault(e.failure()))
    }

    /// One answer from the channel, waiting up to `timeout` (`None`: for ever); `None` when
    /// the time ran out.
    fn read(&mut self, timeout: Option<Duration>) -> std::result::Result<Option<Reply<T>>, Fault> {
        let received = panic_as_malformed(
            || match timeout {
                None => self.replies.recv().map(Some).map_err(Fault::from),
                Some(t) => match self.replies.recv_timeout(t) {
                    Ok(reply) => Ok(Some(reply)),
                    Err(RecvTimeoutError::Timeout) => Ok(None),
                    Err(e) => Err(e.into()),
                },
            },
            Fault::Malformed,
        );
        let reply = received?;
        self.answered |= reply.is_some();
        Ok(reply)
    }

    /// Counts an answer to a want read from the channel: an `Item` answers one message asked
    /// for, `Closed` all that are left, `Failed` the ones the dispatcher withdrew (a `Got` of
    /// this consumer that crossed it asks for its own again, which the dispatcher read after).
    fn counted(&mut self, reply: Reply<T>) -> std::result::Result<Reply<T>, Fault> {
        match reply {
            Reply::Item(_) if self.asked > 0 => self.asked -= 1,
            Reply::Closed | Reply::Failed(Failure::Unreadable(_), _) if self.asked > 0 => self.asked = 0,
            Reply::Failed(_, withdrawn) if self.asked > 0 => {
                self.asked = self.asked.saturating_sub(withdrawn as usize);
            }
            _ => return Err(out_of_turn()),
        }
        Ok(reply)
    }

    /// The next answer to a want, in order: one read earlier, or one from the channel within
    /// `timeout` (`None`: for ever), asking for `ahead` messages (at least this one) first if
    /// nothing is asked for. `None` when the time ran out.
    fn next(&mut self, ahead: usize, timeout: Option<Duration>) -> std::result::Result<Option<Reply<T>>, Fault> {
        if let Some(reply) = self.early.pop_front() {
            return Ok(Some(reply));
        }
        if self.asked == 0 {
            // So that a consumer never has more than `ahead` (or one) in flight. At most
            // MAX_PREFETCH.
            let n = ahead.max(1);
            self.ask(Ctl::Want(n as u32))?;
            self.asked = n;
        }
        match self.read(timeout) {
            Ok(Some(reply)) => self.counted(reply).map(Some),
            Ok(None) => Ok(None),
            Err(Fault::Malformed(why)) if self.asked > 0 => {
                // Nothing read ahead is waiting (`early` is empty): its turn is now.
                self.asked -= 1;
                Ok(Some(Reply::Undecodable(why)))
            }
            Err(fault) => Err(fault),
        }
    }

    /// Reads answers until `mine` takes one, the answer to a request other than a want.
    /// While messages are asked for, an `Item`, `Closed` or `Failed` answers them (the
    /// dispatcher answers a `TryWant` only after them, see `Ctl::TryWant`): those are kept, in
    /// order, for the next gets.
    fn until(
        &mut self,
        timeout: Option<Duration>,
        mine: impl Fn(&Reply<T>) -> bool,
    ) -> std::result::Result<Reply<T>, Fault> {
        // One limit for all the answers read on the way.
        let deadline = timeout.map(crate::os::instant_after);
        loop {
            let reply = match self.read(deadline.map(|d| d.saturating_duration_since(Instant::now()))) {
                Ok(Some(reply)) => reply,
                Ok(None) => return Err(Fault::Unanswered),
                Err(Fault::Malformed(why)) if self.asked > 0 => {
                    // An `Item` asked for before, in its place for the gets: its `Reject` goes
                    // when its get comes, after the `Got`s of those before it (the dispatcher
                    // takes both for the oldest in flight).
                    self.asked -= 1;
                    self.early.push_back(Reply::Undecodable(why));
                    continue;
                }
                Err(Fault::Malformed(why)) if mine(&Reply::Undecodable(String::new())) => {
                    // Nothing asked for ahead: the `Item` answering a `TryWant`.
                    return Ok(Reply::Undecodable(why));
                }
                Err(fault) => return Err(fault),
            };
            // Cut off: nothing more comes (the channel closes next), whatever was asked for.
            if let Reply::Failed(f @ Failure::Unreadable(_), _) = reply {
                return Err(Fault::Forward(f));
            }
            if self.asked > 0 && matches!(reply, Reply::Item(_) | Reply::Closed | Reply::Failed(..)) {
                let reply = self.counted(reply)?;
                self.early.push_back(reply);
            } else if mine(&reply) {
                return Ok(reply);
            } else {
                return Err(out_of_turn());
            }
        }
    }

    /// Returns the message an answer to a want carries, or why there is none. A message is
    /// acknowledged first: from then on it is this consumer's. The acknowledgement also asks
    /// for as many more as keep `ahead` asked for ahead of the gets.
    fn deliver(&mut self, reply: Reply<T>, ahead: usize) -> std::result::Result<T, Fault> {
        match reply {
            Reply::Item(Slot::Owned(value)) => {
                crate::sys::kill_point("queue-delivered");
                match self.acknowledge(Ctl::Got, ahead) {
                    Ok(()) => {
                        // The acknowledgement must outlive this process: one still spilled here
                        // (the dispatcher behind in its reading) dies with it, and the message
                        // the get returned would go to another consumer too.
                        self.requests.handed_on(crate::os::instant_after(CANCEL_WAIT));
                        Ok(value)
                    }
                    // The dispatcher is gone: nobody can hand it out again, so it is ours.
                    Err(None) => Ok(value),
                    // The dispatcher does not know it arrived: dropped here, it goes to another
                    // consumer when this one leaves (the caller drops it on this error).
                    Err(Some(fault)) => Err(fault),
                }
            }
            Reply::Closed => Err(Fault::Disconnected),
            Reply::Failed(f, _) => Err(Fault::Forward(f)),
            // A message that does not decode here, in its turn: the dispatcher hands it to
            // another consumer (or drops it), where leaving would put it back first for every
            // consumer in turn, for ever.
            Reply::Undecodable(why) => match self.acknowledge(Ctl::Reject, ahead) {
                Ok(()) | Err(None) => Err(Fault::Rejected(why)),
                Err(Some(fault)) => Err(fault),
            },
            _ => Err(out_of_turn()),
        }
    }

    /// Acknowledges the oldest message in flight (`Got` or `Reject`), asking for as many more as
    /// keep `ahead` asked for ahead of the gets (at most MAX_PREFETCH). `Err(None)` when the
    /// dispatcher is gone.
    fn acknowledge(&mut self, ctl: fn(u32) -> Ctl, ahead: usize) -> std::result::Result<(), Option<Fault>> {
        let more = ahead.saturating_sub(self.asked + self.early.len());
        match self.requests.send(ctl(more as u32)) {
            Ok(()) => {
                self.asked += more;
                Ok(())
            }
            Err(e) if e.is_disconnected() => Err(None),
            Err(e) => Err(Some(send_fault(e.failure()))),
        }
    }
}

impl<T: Serialize + DeserializeOwned + Send + 'static> QueueConsumer<T> {
    /// Runs one exchange with this handle's consumer, joining first if needed. After a fault
    /// that may leave it out of step with the dispatcher, the consumer leaves (the dispatcher
    /// then puts back whatever it had sent it) and the next call joins afresh.
    fn exchange<R>(
        &self,
        f: impl FnOnce(&mut Endpoint<T>) -> std::result::Result<R, Fault>,
    ) -> std::result::Result<R, Fault> {
        self.exchange_until(None, f).map(|r| r.expect("waited for the handle without limit"))
    }

    /// Like [`exchange`](Self::exchange), waiting for the handle (held by a get of another
    /// thread) until `deadline` at most: `Ok(None)` when it was still held then.
    fn exchange_until<R>(
        &self,
        deadline: Option<Instant>,
        f: impl FnOnce(&mut Endpoint<T>) -> std::result::Result<R, Fault>,
    ) -> std::result::Result<Option<R>, Fault> {
        let Some(mut guard) = self.lock_until(deadline) else { return Ok(None) };
        if guard.is_none() {
            *guard = Some(self.join()?);
        }
        let endpoint = guard.as_mut().ok_or(Fault::Disconnected)?;
        let mut result = f(endpoint);
        if matches!(result, Err(Fault::Disconnected)) && !endpoint.answered && self.join_still_open() {
            // Closed before any answer while joins are still taken: the join was not taken in
            // (out of descriptors), not a closed queue (README.md here, "States of a message").
            result = Err(Fault::Io(IoFailure::other(
                "the queue's process could not take this consumer in (it may be out of file descriptors); try again",
            )));
        }
        if matches!(result, Err(ref fault) if !fault.leaves_in_step()) {
            *guard = None;
        }
        result.map(Some)
    }

    /// The handle's endpoint, waiting for another thread's exchange until `deadline` at most
    /// (looking every millisecond; `None` when it is still held then). Threads that wait for
    /// it already go first: a get that waits in slices (the Python package's, which looks for
    /// Ctrl-C between them) would otherwise take it back between two slices before a waiter
    /// that looks every millisecond saw it free, and a `stats` of another thread would time out
    /// against a healthy queue.
    fn lock_until(&self, deadline: Option<Instant>) -> Option<MutexGuard<'_, Option<Endpoint<T>>>> {
        let EndpointSlot { endpoint, waiting } = self.endpoint.get();
        if waiting.load(Ordering::Acquire) > 0 {
            let pause = Duration::from_millis(3);
            std::thread::sleep(deadline.map_or(pause, |d| d.saturating_duration_since(Instant::now()).min(pause)));
        }
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
        waiting.fetch_add(1, Ordering::AcqRel);
        let _waiting = Waiting(waiting);
        let locked = match deadline {
            None => endpoint.lock(),
            Some(deadline) => loop {
                match endpoint.try_lock() {
                    Ok(g) => break Ok(g),
                    Err(std::sync::TryLockError::Poisoned(p)) => break Err(p),
                    Err(std::sync::TryLockError::WouldBlock) if Instant::now() >= deadline => return None,
                    Err(std::sync::TryLockError::WouldBlock) => std::thread::sleep(Duration::from_millis(1)),
                }
            },
        };
        Some(locked.unwrap_or_else(|poisoned| {
            // A panic in the middle of an exchange: its state is unknown, start afresh.
            let mut g = poisoned.into_inner();
            *g = None;
            endpoint.clear_poison();
            g
        }))
    }

    /// Whether the queue's dispatcher still takes joins on this process's join channel, after
    /// this consumer's channels closed before any answer: a local channel only (a remote one
    /// cannot tell), looked at for a moment, since a dying process's descriptors close one
    /// after another and the join channel may be the last.
    fn join_still_open(&self) -> bool {
        if !self.join.is_local() {
            return false;
        }
        let deadline = Instant::now() + Duration::from_millis(100);
        loop {
            if self.join.receiver_gone() {
                return false;
            }
            if Instant::now() >= deadline {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn join(&self) -> std::result::Result<Endpoint<T>, Fault> {
        let (requests, requests_rx) = channel::<Ctl>().map_err(error_fault)?;
        // The dispatcher sees this consumer leave when the request channel closes: a child
        // forked without `exec` (which joins afresh if it gets) must not keep it open.
        requests.not_inherited();
        let (replies_tx, replies) = channel::<Reply<T>>().map_err(error_fault)?;
        self.join.send(Join { requests: requests_rx, replies: replies_tx }).map_err(|e| send_fault(e.failure()))?;
        Ok(Endpoint { requests, replies, asked: 0, early: VecDeque::new(), answered: false })
    }

    /// Blocks until a message is available and returns it. Reports `Disconnected` once the
    /// queue is closed (every [`Queue`] handle dropped) and nothing is left, or when the
    /// queue's process is gone. It returns a message asked for ahead if one is there, and asks
    /// for the next ([`with_prefetch`](Self::with_prefetch)).
    ///
    /// ```
    /// let queue = cuda_mp::Queue::new().unwrap();
    /// let consumer = queue.consumer();
    /// queue.put([1u8, 2, 3]).unwrap();
    /// assert_eq!(consumer.get().unwrap(), [1, 2, 3]);
    /// ```
    pub fn get(&self) -> std::result::Result<T, GetError> {
        let ahead = self.prefetch;
        self.exchange(|e| match e.next(ahead, None)? {
            Some(reply) => e.deliver(reply, ahead),
            None => Err(Fault::Io(IoFailure::other("a receive without limit returned nothing"))),
        })
        .map_err(GetError::from)
    }

    /// Waits up to `timeout` for a message. A message that the dispatcher sent just as the
    /// wait ran out is returned rather than put back; one prefetched is returned at once. Past
    /// the limit it waits at most a second more for the dispatcher to take back what it asked
    /// for (a dispatcher that does not answer, its process stopped or lagging more than that
    /// behind, is left: what it sends this handle later goes back to its backlog, and the
    /// handle joins again at its next call).
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
        let ahead = self.prefetch;
        let deadline = crate::os::instant_after(timeout);
        let got = self.exchange_until(Some(deadline), |e| {
            if let Some(reply) = e.next(ahead, Some(deadline.saturating_duration_since(Instant::now())))? {
                return e.deliver(reply, ahead).map(Some);
            }
            // Withdraw what is asked for, so that a consumer that stopped waiting is sent
            // nothing more. Messages sent meanwhile come first: the first is returned, the
            // others kept for the next gets.
            e.ask(Ctl::Cancel)?;
            // Past the caller's limit already: a dispatcher that keeps up answers at once; one
            // that does not (its process stopped) is left (`Unanswered`: a time-out).
            e.until(Some(ANSWER_PAST_LIMIT), |reply| matches!(reply, Reply::Cancelled))?;
            e.asked = 0;
            match e.early.pop_front() {
                Some(reply) => e.deliver(reply, 0).map(Some),
                None => Ok(None),
            }
        });
        match got {
            Ok(Some(Some(v))) => Ok(v),
            Ok(_) => Err(GetTimeoutError::Timeout),
            Err(f) => Err(f.into()),
        }
    }

    /// Takes a message if one is waiting now, without waiting for one: one prefetched for this
    /// handle, else one the dispatcher has (a round trip). A put made earlier in the queue's
    /// own process is seen; one from another process once it has reached the dispatcher. A
    /// dispatcher that does not answer within a second (its process stopped) is left, and the
    /// result is `Empty`.
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
        let ahead = self.prefetch;
        // A get of another thread on this handle holds it: nothing is taken now.
        let got = self.exchange_until(Some(Instant::now()), |e| {
            if let Some(reply) = e.early.pop_front() {
                return e.deliver(reply, ahead).map(Some);
            }
            if e.asked > 0 {
                // A `Deserialize` that panics is a message that does not decode here, as in `read`.
                match panic_as_malformed(|| e.replies.try_recv(), TryRecvError::Malformed) {
                    Ok(reply) => {
                        e.answered = true;
                        let reply = e.counted(reply)?;
                        return e.deliver(reply, ahead).map(Some);
                    }
                    Err(TryRecvError::Empty) => {}
                    Err(TryRecvError::Malformed(why)) => {
                        e.answered = true;
                        e.asked -= 1;
                        return e.deliver(Reply::Undecodable(why), ahead).map(Some);
                    }
                    Err(other) => return Err(other.into()),
                }
            }
            e.ask(Ctl::TryWant)?;
            let wanted = |reply: &Reply<T>| {
                matches!(
                    reply,
                    Reply::Item(_) | Reply::Empty | Reply::Closed | Reply::Failed(..) | Reply::Undecodable(_)
                )
            };
            // Bounded: a dispatcher that does not answer (its process stopped, say) is left,
            // and nothing was taken (`Unanswered`: empty).
            match e.until(Some(ANSWER_PAST_LIMIT), wanted)? {
                Reply::Empty => {}
                reply => e.early.push_back(reply),
            }
            match e.early.pop_front() {
                Some(reply) => e.deliver(reply, ahead).map(Some),
                None => Ok(None),
            }
        });
        match got {
            Ok(Some(Some(v))) => Ok(v),
            Ok(_) => Err(TryGetError::Empty),
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
        self.exchange(|e| Self::ask_stats(e, CANCEL_WAIT)).map_err(GetError::from)
    }

    /// Like [`stats`](Self::stats), waiting at most `timeout` for the handle (a `get` of
    /// another thread holds it while it waits for a message) and for the dispatcher's answer
    /// (at least 100 ms for the answer, whatever `timeout`: a round trip to a dispatcher that
    /// keeps up takes far less).
    ///
    /// ```
    /// use std::time::Duration;
    /// let queue = cuda_mp::Queue::<u8>::new().unwrap();
    /// let consumer = queue.consumer();
    /// let stats = consumer.stats_timeout(Duration::from_secs(5)).unwrap();
    /// assert_eq!(stats.consumers, 1);
    /// ```
    pub fn stats_timeout(&self, timeout: Duration) -> std::result::Result<QueueStats, GetTimeoutError> {
        let deadline = crate::os::instant_after(timeout);
        let asked = self.exchange_until(Some(deadline), |e| {
            // Never less than a round trip takes a dispatcher that keeps up: a short limit
            // must not turn a healthy queue's answer into a time-out (which starts the
            // endpoint afresh, giving back what it had asked for ahead).
            Self::ask_stats(e, deadline.saturating_duration_since(Instant::now()).max(STATS_FLOOR))
        });
        match asked {
            Ok(Some(stats)) => Ok(stats),
            // The handle was held until the deadline, or no answer came in time (the endpoint
            // starts afresh at the next call: a late answer would come out of turn).
            Ok(None) => Err(GetTimeoutError::Timeout),
            Err(f) => Err(f.into()),
        }
    }

    /// Asks the dispatcher for its counters and waits `wait` at most for the answer.
    fn ask_stats(e: &mut Endpoint<T>, wait: Duration) -> std::result::Result<QueueStats, Fault> {
        e.ask(Ctl::Stats)?;
        match e.until(Some(wait), |reply| matches!(reply, Reply::Stats(_)))? {
            Reply::Stats(s) => Ok(s),
            _ => Err(out_of_turn()),
        }
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
    Io(#[source] IoFailure),
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
    Io(#[source] IoFailure),
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
    Io(#[source] IoFailure),
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
        Failure::Io(m) => {
            Fault::Io(IoFailure::other(format!("the queue could not forward a message (it stays queued): {m}")))
        }
        Failure::OutOfDescriptors(limit) => Fault::OutOfDescriptors { limit },
        Failure::Unreadable(m) => {
            Fault::Malformed(format!("the queue could not read a request of this consumer, which joins again: {m}"))
        }
    }
}

impl From<Fault> for GetError {
    fn from(f: Fault) -> Self {
        same_failure!(f, Fault => GetError,
            Fault::Rejected(m) => GetError::Malformed(format!(
                "{m} (the queue hands the message to other consumers; it is dropped once three could not decode it, or no producer is left and none there can)"
            )),
            Fault::Forward(f) => forward_text(f).into(),
            Fault::Unanswered => GetError::Io(IoFailure::other("the queue's dispatcher did not answer"))
        )
    }
}

impl From<Fault> for TryGetError {
    fn from(f: Fault) -> Self {
        match f {
            // Nothing taken within the bounded wait.
            Fault::Unanswered => TryGetError::Empty,
            f => same_failure!(GetError::from(f), GetError => TryGetError),
        }
    }
}

impl From<Fault> for GetTimeoutError {
    fn from(f: Fault) -> Self {
        match f {
            Fault::Unanswered => GetTimeoutError::Timeout,
            f => same_failure!(GetError::from(f), GetError => GetTimeoutError),
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

// As the receive errors they stand for: out of descriptors is `Error::OutOfDescriptors`.
impl From<GetError> for Error {
    fn from(e: GetError) -> Self {
        Error::from(same_failure!(e, GetError => RecvTimeoutError))
    }
}

impl From<GetTimeoutError> for Error {
    fn from(e: GetTimeoutError) -> Self {
        Error::from(
            same_failure!(e, GetTimeoutError => RecvTimeoutError, GetTimeoutError::Timeout => RecvTimeoutError::Timeout),
        )
    }
}

/// Looks with `look` until what it sees is `done` or `wait` has passed; gives the last look
/// (for the tests of the queue and its dispatcher, whose threads settle in their own time).
#[cfg(test)]
fn look_until<T>(wait: Duration, mut look: impl FnMut() -> T, done: impl Fn(&T) -> bool) -> T {
    let deadline = std::time::Instant::now() + wait;
    let mut seen = look();
    while !done(&seen) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
        seen = look();
    }
    seen
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A consumer with messages asked for ahead (the usual state) is cut off, its request
    /// unreadable: its next exchange (`stats` here) reports that, not an open queue as closed,
    /// and the one after joins afresh.
    #[test]
    fn a_cut_off_consumer_says_why_and_joins_again() {
        let queue = Queue::<u32>::new().unwrap();
        let consumer = queue.consumer();
        queue.put(1).unwrap();
        assert_eq!(consumer.get().unwrap(), 1);
        let hub = queue.local.clone().unwrap();
        hub.handle(Some(dispatch::Event::Unreadable(1, "a forged request".into())));
        match consumer.stats() {
            Err(GetError::Malformed(why)) => assert!(why.contains("a forged request"), "{why}"),
            other => panic!("a cut-off consumer's stats returned {other:?}"),
        }
        queue.put(2).unwrap();
        assert_eq!(consumer.get().unwrap(), 2);
        // The first goes once the hub has read its channel's close, which may come after.
        let consumers = look_until(Duration::from_secs(5), || consumer.stats().unwrap().consumers, |&n| n == 1);
        assert_eq!(consumers, 1, "the consumer joined again, and the first is gone");
    }

    /// A value whose `Deserialize` panics for 13.
    #[derive(Debug, PartialEq)]
    struct Touchy(u32);

    impl Serialize for Touchy {
        fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
            self.0.serialize(s)
        }
    }

    impl<'de> Deserialize<'de> for Touchy {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
            let v = u32::deserialize(d)?;
            assert!(v != 13, "refuses 13");
            Ok(Touchy(v))
        }
    }

    /// A prefetched message whose `Deserialize` panics, taken by `try_get`, is a message that
    /// does not decode here (as for `get`), not a panic in the caller; the next goes on.
    #[test]
    fn a_try_get_of_a_message_whose_deserialize_panics_reports_it() {
        let queue = Queue::<Touchy>::new().unwrap();
        let consumer = queue.consumer().with_prefetch(2);
        queue.put(Touchy(1)).unwrap();
        queue.put(Touchy(13)).unwrap();
        queue.put(Touchy(3)).unwrap();
        assert_eq!(consumer.get().unwrap(), Touchy(1));
        let deadline = Instant::now() + Duration::from_secs(5);
        let got = loop {
            let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| consumer.try_get()))
                .expect("the panic of a message's Deserialize reached try_get's caller");
            if got != Err(TryGetError::Empty) || Instant::now() > deadline {
                break got;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        assert!(matches!(got, Err(TryGetError::Malformed(ref why)) if why.contains("refuses 13")), "{got:?}");
        assert_eq!(consumer.get_timeout(Duration::from_secs(5)), Ok(Touchy(3)));
    }

    /// A message whose `Deserialize` panics in a feed is counted as undecodable, and the feed
    /// goes on with the next.
    #[test]
    fn a_feed_counts_a_message_whose_deserialize_panics_and_goes_on() {
        let queue = Queue::<Touchy>::new().unwrap();
        let (tx, rx) = crate::channel::<Touchy>().unwrap();
        let feed = queue.feed(rx).unwrap();
        tx.send(Touchy(13)).unwrap();
        tx.send(Touchy(2)).unwrap();
        drop(tx);
        assert_eq!(feed.join().unwrap(), FeedEnd { fed: 1, undecodable: 1 });
        assert_eq!(queue.get_timeout(Duration::from_secs(5)), Ok(Touchy(2)));
    }

    /// A thread that waits on a handle in slices (as the Python package's get does, looking for
    /// Ctrl-C between them) lets another thread's `stats` in: it used to take the handle back
    /// between its slices before the other thread, looking every millisecond, saw it free.
    #[test]
    fn a_get_that_waits_in_slices_lets_stats_of_another_thread_in() {
        let queue = Queue::<u32>::new().unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                while !stop.load(Ordering::SeqCst) {
                    if let Ok(v) = queue.get_timeout(Duration::from_millis(20)) {
                        assert_eq!(v, 0, "only the last put is a message");
                    }
                }
            });
            std::thread::sleep(Duration::from_millis(50));
            let stats: Vec<_> = (0..5).map(|_| queue.stats_timeout(Duration::from_secs(1))).collect();
            stop.store(true, Ordering::SeqCst);
            queue.put(0).unwrap();
            assert!(stats.iter().all(Result::is_ok), "stats of a healthy queue, while another thread gets: {stats:?}");
        });
    }

    /// A queue handle sent to another process keeps its prefetch setting, as a consumer does.
    #[test]
    fn a_queue_sent_keeps_its_prefetch() {
        let queue = Queue::<u32>::new().unwrap().with_prefetch(0);
        let (tx, rx) = crate::channel::<(Queue<u32>, QueueConsumer<u32>)>().unwrap();
        tx.send((queue.clone().with_prefetch(5), queue.consumer())).unwrap();
        let (copy, consumer) = rx.recv().unwrap();
        assert_eq!((copy.consumer().prefetch(), consumer.prefetch()), (5, 0));
    }

    /// A put whose `Deserialize` panics in the queue's process is lost and counted as one that
    /// did not decode; the puts after it go on, and the queue still ends when its handles go.
    #[test]
    fn a_put_whose_deserialize_panics_loses_only_that_put() {
        let queue = Queue::<Touchy>::new().unwrap();
        let consumer = queue.consumer();
        // A handle that came through a channel puts through the queue's inbox.
        let (tx, rx) = crate::channel::<Queue<Touchy>>().unwrap();
        tx.send(queue.clone()).unwrap();
        let remote = rx.recv().unwrap();
        remote.put(Touchy(13)).unwrap();
        remote.put(Touchy(2)).unwrap();
        assert_eq!(consumer.get_timeout(Duration::from_secs(5)), Ok(Touchy(2)));
        let undecodable = look_until(Duration::from_secs(5), || queue.stats().unwrap().undecodable, |&n| n == 1);
        assert_eq!(undecodable, 1);
        drop((queue, remote, tx, rx));
        assert_eq!(consumer.get_timeout(Duration::from_secs(5)), Err(GetTimeoutError::Disconnected));
    }

    /// A get without limit on one thread holds the handle: a bounded get on another thread
    /// still ends in time, and a try returns at once.
    #[test]
    fn bounded_gets_end_in_time_while_another_thread_waits_on_the_handle() {
        let queue = Arc::new(Queue::<u32>::new().unwrap());
        let blocked = {
            let queue = queue.clone();
            std::thread::spawn(move || queue.get())
        };
        std::thread::sleep(Duration::from_millis(100));
        let start = Instant::now();
        assert_eq!(queue.get_timeout(Duration::from_millis(50)), Err(GetTimeoutError::Timeout));
        assert_eq!(queue.try_get(), Err(TryGetError::Empty));
        assert!(start.elapsed() < Duration::from_secs(2), "waited {:?} for the other thread's get", start.elapsed());
        queue.put(1).unwrap();
        assert_eq!(blocked.join().unwrap(), Ok(1));
    }
}
