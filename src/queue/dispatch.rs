//! The dispatcher of a [`Queue`](super::Queue): the state in the creating process that owns
//! the backlog, the threads that feed it, and the messages between it and the consumers. See
//! README.md here for the protocol and why no message is lost or delivered twice.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError, TryLockError, Weak};
use std::thread;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::channel::{Receiver, Sender, channel};
use crate::error::{RecvError, Result, SendFailure};

use super::QueueStats;

/// A consumer's request, on the consumer's own channel to the dispatcher; what answers each:
/// README.md here, "Protocol".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) enum Ctl {
    /// This many more messages, each whenever there is one (answered `Item` each, or `Closed`
    /// or `Failed` for all that are left).
    Want(u32),
    /// One message if one is waiting now (answered `Item`, `Empty`, `Closed` or `Failed`).
    /// While the consumer wants messages the backlog is empty (it would have been served), so
    /// this is then answered `Empty`, after the `Item`s already sent.
    TryWant,
    /// Withdraws every message wanted (answered `Cancelled`, after the `Item`s already sent).
    Cancel,
    /// The oldest `Item` in flight to this consumer is delivered (no sequence number needed:
    /// README.md, "Which message `Got` acknowledges"); then this many more are wanted. No answer.
    Got(u32),
    /// The queue's counters (answered `Stats`).
    Stats,
    /// The oldest `Item` in flight to this consumer does not decode there: requeued for the
    /// others, or dropped (`MAX_REJECTS`, `MAX_REFUSED`; README.md, "Protocol"); then as `Got`.
    Reject(u32),
}

/// A queued message's name in the record of refusals: its address, while it is queued.
fn key<T>(item: &Item<T>) -> usize {
    Arc::as_ptr(item) as usize
}

/// How many consumers may fail to decode a message before it is dropped: a broken message would
/// otherwise go round for ever (README.md, "Protocol"). Where fewer consumers are there, one
/// that all of them refused waits for another to join, and is dropped once no producer is left
/// (`drop_refused_by_all`).
const MAX_REJECTS: usize = 3;
/// How many messages that some consumer could not decode are held back for the others at
/// most (a consumer looks past those it refused for its next one).
const MAX_REFUSED: usize = 256;

/// The dispatcher's answer to one request.
#[derive(Serialize, Deserialize)]
#[serde(bound(serialize = "T: Serialize", deserialize = "T: DeserializeOwned"))]
pub(super) enum Reply<T> {
    /// A message; the consumer acknowledges it with `Got` when its get returns it.
    Item(Slot<T>),
    /// Nothing waiting (for `TryWant`).
    Empty,
    /// Every producer is gone and nothing is left or in flight.
    Closed,
    /// Every message wanted is withdrawn.
    Cancelled,
    /// The counters.
    Stats(QueueStats),
    /// The dispatcher could not send the message it had for this consumer, and withdrew what
    /// the consumer wanted: how many wants this answers (the failed message's, and every one
    /// left). A `Got` that crossed it asks for its own messages again, so the consumer counts
    /// off only these.
    Failed(Failure, u32),
    /// Never sent: what a consumer keeps, in its place among the answers read, of an `Item`
    /// that arrived and did not decode (and that it told the dispatcher to drop, `Reject`).
    #[serde(skip)]
    Undecodable(String),
}

/// Why the dispatcher could not forward a message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) enum Failure {
    /// The message cannot be encoded again; it is discarded.
    Discarded(String),
    /// The operating system refused the send; the message stays in the backlog, where it was.
    Io(String),
    /// The dispatcher's process is out of descriptors; the message stays in the backlog, where
    /// it was.
    OutOfDescriptors(u64),
    /// A request of this consumer could not be read (it did not decode, or the frame that
    /// carried it could not be taken in): the dispatcher is no longer sure what it wants, and
    /// sends it nothing more. It leaves (what it holds unreturned goes back to the backlog
    /// then) and joins again.
    Unreadable(String),
}

/// A message as the dispatcher keeps it (shared with the send that forwards it, so that it can
/// be sent again if the consumer dies first) or as a consumer receives it.
pub(super) enum Slot<T> {
    Shared(Arc<Mutex<T>>),
    Owned(T),
}

impl<T: Serialize> Serialize for Slot<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Slot::Shared(m) => m.lock().unwrap_or_else(PoisonError::into_inner).serialize(serializer),
            Slot::Owned(v) => v.serialize(serializer),
        }
    }
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for Slot<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        T::deserialize(deserializer).map(Slot::Owned)
    }
}

/// A consumer joining: the receiving end of its request channel and the sending end of its
/// reply channel, of which each side holds the only other end (README.md, "Parts").
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub(super) struct Join<T> {
    pub(super) requests: Receiver<Ctl>,
    pub(super) replies: Sender<Reply<T>>,
}

/// What the reader threads, and puts made in this process, tell the dispatcher.
pub(super) enum Event<T> {
    Put(T),
    /// A put arrived that does not decode here (it is discarded; its resources released).
    Undecodable,
    /// Every producer handle is gone.
    InboxClosed,
    Joined(u64, Sender<Reply<T>>),
    Request(u64, Ctl),
    /// The consumer's request channel closed: it left, or its process died.
    Left(u64),
    /// A request of the consumer could not be read (why is given); its channel is still open.
    Unreadable(u64, String),
}

type Item<T> = Arc<Mutex<T>>;

struct Consumer<T> {
    /// `None` once a send to it failed (see `cut_off`): it is sent nothing more.
    replies: Option<Sender<Reply<T>>>,
    /// Sent, not yet acknowledged, oldest first (the order of the reply channel).
    in_flight: VecDeque<Item<T>>,
    /// Messages wanted and not yet answered; the consumer is in the waiting line while this is
    /// not zero. Answers are sent under the hub's lock alone, in order, so a `Cancel` finds
    /// each wanted message either still wanted or already sent.
    wants: u32,
}

struct Dispatcher<T> {
    backlog: VecDeque<Item<T>>,
    consumers: HashMap<u64, Consumer<T>>,
    /// Consumers that want messages, in the order they asked; one served that wants more goes
    /// to the back (see `serve`).
    waiting: VecDeque<u64>,
    inbox_closed: bool,
    delivered: u64,
    requeued: u64,
    discarded: u64,
    undecodable: u64,
    /// Messages done with (delivered, or discarded), to be dropped once the lock is let go:
    /// a value's `Drop` is the user's code, which may be slow or put on this very queue.
    done: Vec<Item<T>>,
    /// The consumers that could not decode a message (by its address), while it is queued.
    rejects: HashMap<usize, Vec<u64>>,
}

/// The dispatcher, shared by every thread that has an event for it: each handles its event on
/// its own thread under the lock, sends included, so answers to one consumer leave in the order
/// decided. A put never waits for the lock nor encodes another's value (it leaves its value in
/// `pending` for the **server** thread): README.md, "Threads", says why.
pub(super) struct Hub<T> {
    state: Mutex<Dispatcher<T>>,
    /// Puts of this process's threads that found the lock taken, in the order they came.
    pending: Mutex<Vec<T>>,
    /// Wakes the server (see above).
    server: Arc<Server>,
}

/// The server's wake-up, shared with its thread (which holds the hub only while it works).
struct Server {
    /// Whether there is work (`wanted`), and whether the hub is gone (`gone`: the thread ends).
    state: Mutex<(bool, bool)>,
    wake: Condvar,
    /// Whether its thread was started (false: it could not be).
    started: OnceLock<bool>,
}

impl<T: Serialize + DeserializeOwned + Send + 'static> Hub<T> {
    fn new() -> Hub<T> {
        let server =
            Arc::new(Server { state: Mutex::new((false, false)), wake: Condvar::new(), started: OnceLock::new() });
        Hub { state: Mutex::new(Dispatcher::new()), pending: Mutex::new(Vec::new()), server }
    }

    /// Handles one event of a reader (or the server's turn, with none: sends what is due),
    /// waiting for the lock; the puts pending are taken in first. What was done with is
    /// dropped after the lock.
    pub(super) fn handle(&self, event: Option<Event<T>>) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        // Taken out first: the lock of `pending` is not held while the puts are sent (a
        // temporary in a `for` head would be), or a put would wait for their `Serialize`.
        let pending = std::mem::take(&mut *self.pending());
        for value in pending {
            state.handle(Event::Put(value));
        }
        match event {
            Some(event) => state.handle(event),
            // The server's turn: a put may have taken values into the backlog without sending
            // any (see `put`), and no event may come to send them.
            None => state.serve(),
        }
        let done = std::mem::take(&mut state.done);
        drop(state);
        // A value's `Drop` is the user's code: one that panics must not end a reader (its
        // consumer's requests would go unread) or the server.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(done)));
    }

    /// A put of this process's (see the type's comment).
    pub(super) fn put(self: &Arc<Self>, value: T) {
        let state = match self.state.try_lock() {
            Ok(state) => Some(state),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        };
        let Some(mut state) = state else {
            self.pending().push(value);
            self.nudge();
            return;
        };
        let earlier = std::mem::take(&mut *self.pending());
        let first_in_line = earlier.is_empty() && state.backlog.is_empty();
        let nudge = if first_in_line {
            // Sent at once if a consumer waits: this value alone can be.
            state.handle(Event::Put(value));
            false
        } else {
            state.backlog.extend(earlier.into_iter().chain([value]).map(|v| Arc::new(Mutex::new(v))));
            !state.waiting.is_empty()
        };
        let done = std::mem::take(&mut state.done);
        drop(state);
        if nudge {
            self.nudge();
        }
        // After the nudge: a value's `Drop` that panics unwinds to this put's caller only.
        drop(done);
    }

    fn pending(&self) -> MutexGuard<'_, Vec<T>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wakes the server, starting its thread the first time. Should it not start, this thread
    /// does its turn, waiting for the lock.
    fn nudge(self: &Arc<Self>) {
        self.server.state.lock().unwrap_or_else(PoisonError::into_inner).0 = true;
        self.server.wake.notify_one();
        let started = *self.server.started.get_or_init(|| {
            let (hub, server) = (Arc::downgrade(self), self.server.clone());
            thread::Builder::new()
                .name("cuda-mp-queue-server".into())
                .spawn(move || serve_pending(&hub, &server))
                .is_ok()
        });
        if !started {
            self.handle(None);
        }
    }
}

impl<T> Drop for Hub<T> {
    fn drop(&mut self) {
        self.server.state.lock().unwrap_or_else(PoisonError::into_inner).1 = true;
        self.server.wake.notify_one();
    }
}

/// The server's thread: a turn at the dispatcher whenever woken, until the hub is gone.
fn serve_pending<T: Serialize + DeserializeOwned + Send + 'static>(hub: &Weak<Hub<T>>, server: &Server) {
    loop {
        {
            let mut state = server.state.lock().unwrap_or_else(PoisonError::into_inner);
            while !state.0 && !state.1 {
                state = server.wake.wait(state).unwrap_or_else(PoisonError::into_inner);
            }
            if state.1 {
                return;
            }
            state.0 = false;
        }
        let Some(hub) = hub.upgrade() else { return };
        hub.handle(None);
    }
}

/// The ends of a queue whose dispatcher runs in this process.
pub(super) struct Ends<T> {
    /// Producers anywhere: the inbox.
    pub(super) inbox: Sender<T>,
    /// Producers in this process: the dispatcher itself, which takes the value as it is (no
    /// encoding, no descriptors, no lease).
    pub(super) local: Arc<Hub<T>>,
    /// Consumers anywhere.
    pub(super) join: Sender<Join<T>>,
}

/// Starts a queue's dispatcher in this process: the hub, a reader of the inbox and a reader
/// of joins. The hub lives as long as a reader or a handle of this process holds it; what is
/// left in the backlog is dropped with it.
pub(super) fn start<T>() -> Result<Ends<T>>
where
    T: Serialize + DeserializeOwned + Send + 'static,
{
    let (inbox_tx, inbox_rx) = channel::<T>()?;
    let (join_tx, join_rx) = channel::<Join<T>>()?;
    // Read by threads of this process alone: a child forked from it has none of them, and its
    // copies must not keep puts and joins from failing once this process is gone.
    inbox_rx.not_inherited();
    join_rx.not_inherited();
    let hub = Arc::new(Hub::new());
    let puts = hub.clone();
    thread::Builder::new().name("cuda-mp-queue-puts".into()).spawn(move || read_puts(inbox_rx, &puts))?;
    let joins = hub.clone();
    thread::Builder::new().name("cuda-mp-queue-joins".into()).spawn(move || read_joins(join_rx, joins))?;
    Ok(Ends { inbox: inbox_tx, local: hub, join: join_tx })
}

/// Waits after a receive that failed in the transport (not a message): 1 ms after the first,
/// twice as long after each next one in a row, at most 100 ms, so that a failure that lasts
/// costs no processor; says so once.
fn pause_after_failure(failures: &mut u32, what: &str, error: &crate::IoFailure) {
    if *failures == 0 {
        tracing::warn!(%error, "{what}: a receive failed; trying again");
    }
    let wait = std::time::Duration::from_millis(1u64 << (*failures).min(7)).min(std::time::Duration::from_millis(100));
    *failures = failures.saturating_add(1);
    thread::sleep(wait);
}

/// Hands every put to the dispatcher as it arrives. The backlog is unbounded, and a send to a
/// consumer never waits for it to read, so a producer never waits for a consumer.
fn read_puts<T: Serialize + DeserializeOwned + Send + 'static>(inbox: Receiver<T>, hub: &Hub<T>) {
    let mut failures = 0;
    loop {
        // The value's `Deserialize` is the user's code: a panic in it loses that put (counted
        // as one that did not decode), not this thread and every put after it.
        let event = match crate::os::catch_quietly(|| inbox.recv()) {
            Err(panic) => {
                tracing::warn!(panic, "a put's value panicked as it was decoded: it is lost");
                Event::Undecodable
            }
            Ok(Ok(v)) => Event::Put(v),
            Ok(Err(RecvError::Disconnected)) => {
                hub.handle(Some(Event::InboxClosed));
                return;
            }
            Ok(Err(RecvError::Io(e))) => {
                // Not a message: the transport failed. Do not spin on a persistent failure.
                pause_after_failure(&mut failures, "a queue's puts", &e);
                continue;
            }
            Ok(Err(_)) => Event::Undecodable,
        };
        failures = 0;
        hub.handle(Some(event));
    }
}

/// Registers joining consumers and starts a reader of each one's requests.
fn read_joins<T: Serialize + DeserializeOwned + Send + 'static>(joins: Receiver<Join<T>>, hub: Arc<Hub<T>>) {
    let mut next = 0u64;
    let mut failures = 0;
    loop {
        let join = match joins.recv() {
            Ok(join) => join,
            Err(RecvError::Disconnected) => return,
            Err(RecvError::Io(e)) => {
                pause_after_failure(&mut failures, "a queue's joins", &e);
                continue;
            }
            // A forged or undecodable join: nobody to answer.
            Err(_) => continue,
        };
        failures = 0;
        next += 1;
        let id = next;
        // Joined before the first request of this consumer: handled before its reader exists.
        hub.handle(Some(Event::Joined(id, join.replies)));
        let requests = join.requests;
        requests.not_inherited();
        let reader = hub.clone();
        let started = thread::Builder::new().name("cuda-mp-queue-consumer".into()).spawn(move || {
            let mut failures = 0;
            loop {
                match requests.recv() {
                    Ok(ctl) => {
                        failures = 0;
                        reader.handle(Some(Event::Request(id, ctl)))
                    }
                    // Closed: it left, or its process died.
                    Err(RecvError::Disconnected) => {
                        reader.handle(Some(Event::Left(id)));
                        return;
                    }
                    // Not a message: the transport failed. Do not spin on a persistent failure.
                    Err(RecvError::Io(e)) => pause_after_failure(&mut failures, "a queue consumer's requests", &e),
                    // Not a request, or a frame not taken in: cut off, but read on until the
                    // channel closes, so its later `Got`s count (README.md, "States of a message").
                    Err(e) => reader.handle(Some(Event::Unreadable(id, e.to_string()))),
                }
            }
        });
        if started.is_err() {
            hub.handle(Some(Event::Left(id)));
        }
    }
}

fn failure(f: &SendFailure) -> Failure {
    match f {
        SendFailure::Serialize(m) => Failure::Discarded(m.clone()),
        SendFailure::OutOfDescriptors { limit } => Failure::OutOfDescriptors(*limit),
        other => Failure::Io(other.to_string()),
    }
}

impl<T: Serialize + DeserializeOwned + Send + 'static> Dispatcher<T> {
    fn new() -> Self {
        Dispatcher {
            backlog: VecDeque::new(),
            consumers: HashMap::new(),
            waiting: VecDeque::new(),
            inbox_closed: false,
            delivered: 0,
            requeued: 0,
            discarded: 0,
            undecodable: 0,
            done: Vec::new(),
            rejects: HashMap::new(),
        }
    }

    fn handle(&mut self, event: Event<T>) {
        match event {
            Event::Put(v) => {
                self.backlog.push_back(Arc::new(Mutex::new(v)));
                self.serve();
            }
            Event::Undecodable => self.undecodable += 1,
            Event::InboxClosed => {
                self.inbox_closed = true;
                self.serve();
            }
            Event::Joined(id, replies) => {
                self.consumers.insert(id, Consumer { replies: Some(replies), in_flight: VecDeque::new(), wants: 0 });
            }
            Event::Request(id, ctl) => self.request(id, ctl),
            Event::Left(id) => {
                self.leave(id);
                self.serve();
            }
            Event::Unreadable(id, why) => {
                self.answer(id, Reply::Failed(Failure::Unreadable(why), 0));
                self.cut_off(id);
            }
        }
    }

    fn request(&mut self, id: u64, ctl: Ctl) {
        let Some(c) = self.consumers.get_mut(&id) else { return };
        if c.replies.is_none() {
            // Cut off: only its acknowledgements still count, for messages it did return.
            if let Ctl::Got(_) | Ctl::Reject(_) = ctl
                && let Some(item) = c.in_flight.pop_front()
            {
                self.acknowledged(item, matches!(ctl, Ctl::Got(_)), id);
                self.serve();
            }
            return;
        }
        match ctl {
            Ctl::Want(n) => {
                self.want(id, n);
                self.serve();
            }
            Ctl::TryWant => {
                // While it wants messages the consumer tells this answer from theirs only if it
                // is not an `Item`. Nothing is lost: a consumer that wants messages is sent the
                // backlog's first, those a put took in without sending included (see `put`).
                if c.wants > 0 {
                    self.serve();
                    self.answer(id, Reply::Empty);
                } else if let Some((from, item)) =
                    self.first_for(id).and_then(|from| self.backlog.remove(from).map(|item| (from, item)))
                {
                    self.hand(id, item, false, from);
                } else {
                    let reply = if self.drained() { Reply::Closed } else { Reply::Empty };
                    self.answer(id, reply);
                }
            }
            Ctl::Cancel => {
                self.withdraw(id);
                self.answer(id, Reply::Cancelled);
            }
            Ctl::Got(n) | Ctl::Reject(n) => {
                if let Some(item) = c.in_flight.pop_front() {
                    self.acknowledged(item, matches!(ctl, Ctl::Got(_)), id);
                }
                self.want(id, n);
                // Serves what it wants now; and the last delivery may be what the waiting
                // consumers wait for to be told the queue is closed.
                self.serve();
            }
            Ctl::Stats => {
                let stats = self.stats();
                self.answer(id, Reply::Stats(stats));
            }
        }
    }

    /// A message consumer `id` took (`got`), or could not decode: that goes back first in the
    /// backlog, or is dropped, as `Ctl::Reject` says.
    fn acknowledged(&mut self, item: Item<T>, got: bool, id: u64) {
        if got {
            if !self.rejects.is_empty() {
                self.rejects.remove(&key(&item));
            }
            self.delivered += 1;
            self.done.push(item);
            return;
        }
        let rejecters = self.rejects.entry(key(&item)).or_default();
        if !rejecters.contains(&id) {
            rejecters.push(id);
        }
        let drop_it =
            rejecters.len() >= MAX_REJECTS || (self.rejects.len() > MAX_REFUSED && !self.drop_oldest_refused_by_all());
        // Past `MAX_REFUSED` messages held back for other consumers, the oldest that every
        // consumer refused goes to make room; if there is none, the new one is not held.
        if drop_it {
            self.discard(item);
        } else {
            self.requeued += 1;
            self.backlog.push_front(item);
        }
    }

    /// Where in the backlog the first message for consumer `id` is: the first it has not
    /// refused (at most `MAX_REFUSED` refused ones are kept, so the look is short).
    fn first_for(&self, id: u64) -> Option<usize> {
        if self.rejects.is_empty() {
            return (!self.backlog.is_empty()).then_some(0);
        }
        self.backlog
            .iter()
            .position(|item| self.rejects.get(&key(item)).is_none_or(|rejecters| !rejecters.contains(&id)))
    }

    /// True when every consumer there is could not decode `item`.
    fn refused_by_all(&self, item: &Item<T>) -> bool {
        self.rejects.get(&key(item)).is_some_and(|rejecters| self.refused_by_everyone(rejecters))
    }

    /// True when `rejecters` are every consumer there is.
    fn refused_by_everyone(&self, rejecters: &[u64]) -> bool {
        self.consumers.keys().all(|c| rejecters.contains(c))
    }

    /// Drops a message (counted as discarded), with its record of refusals.
    fn discard(&mut self, item: Item<T>) {
        if !self.rejects.is_empty() {
            self.rejects.remove(&key(&item));
        }
        self.discarded += 1;
        self.done.push(item);
    }

    /// Drops the first message in the backlog that every consumer refused; false if none did.
    fn drop_oldest_refused_by_all(&mut self) -> bool {
        let at = self.backlog.iter().position(|item| self.refused_by_all(item));
        let Some(item) = at.and_then(|at| self.backlog.remove(at)) else { return false };
        self.discard(item);
        true
    }

    /// A message taken from `from` in the backlog that could not be sent goes back there.
    fn put_back(&mut self, item: Item<T>, from: usize) {
        let at = from.min(self.backlog.len());
        self.backlog.insert(at, item);
    }

    /// Adds `n` messages to what a consumer wants, putting it in the waiting line.
    fn want(&mut self, id: u64, n: u32) {
        let Some(c) = self.consumers.get_mut(&id) else { return };
        if c.replies.is_none() {
            return;
        }
        if n > 0 && c.wants == 0 {
            self.waiting.push_back(id);
        }
        c.wants = c.wants.saturating_add(n);
    }

    /// Withdraws every message a consumer wants, taking it out of the waiting line; how many
    /// it wanted.
    fn withdraw(&mut self, id: u64) -> u32 {
        let Some(c) = self.consumers.get_mut(&id) else { return 0 };
        let wanted = c.wants;
        if c.wants > 0 {
            c.wants = 0;
            self.waiting.retain(|&w| w != id);
        }
        wanted
    }

    /// Every producer gone, nothing in the backlog, nothing sent and unacknowledged (which
    /// could come back if its consumer dies).
    fn drained(&self) -> bool {
        self.inbox_closed && self.backlog.is_empty() && self.consumers.values().all(|c| c.in_flight.is_empty())
    }

    /// The next consumer to serve: of those waiting, the ones with the fewest messages in
    /// flight, and of them the first in line (README.md, "Serving order and fairness").
    fn next_in_line(&self) -> Option<usize> {
        let mut best: Option<(usize, usize)> = None;
        for (at, id) in self.waiting.iter().enumerate() {
            let held = self.consumers.get(id).map_or(0, |c| c.in_flight.len());
            if best.is_none_or(|(_, fewest)| held < fewest) {
                best = Some((at, held));
                if held == 0 {
                    break;
                }
            }
        }
        best.map(|(at, _)| at)
    }

    /// Hands backlog messages to waiting consumers (see `next_in_line`); a consumer served that
    /// still wants more goes to the back of the line. Once drained, tells every waiting
    /// consumer the queue is closed. Afterwards the backlog is empty or nobody wants a message.
    fn serve(&mut self) {
        loop {
            while !self.backlog.is_empty() {
                let (at, from) = if self.rejects.is_empty() {
                    let Some(at) = self.next_in_line() else { break };
                    (at, 0)
                } else {
                    // A message that consumers could not decode waits for another: the first in
                    // line with a message it has not refused takes that one.
                    let found =
                        self.waiting.iter().enumerate().find_map(|(at, &id)| self.first_for(id).map(|from| (at, from)));
                    let Some(found) = found else { break };
                    found
                };
                let Some(id) = self.waiting.remove(at) else { break };
                let Some(c) = self.consumers.get_mut(&id) else { continue };
                c.wants -= 1;
                if c.wants > 0 {
                    self.waiting.push_back(id);
                }
                let item = self.backlog.remove(from).expect("a position in the backlog");
                self.hand(id, item, true, from);
            }
            if !self.drop_refused_by_all() {
                break;
            }
        }
        if self.drained() {
            while let Some(id) = self.waiting.pop_front() {
                if let Some(c) = self.consumers.get_mut(&id) {
                    c.wants = 0;
                    self.answer(id, Reply::Closed);
                }
            }
        }
    }

    /// Sends one message to a consumer and keeps it as in flight until acknowledged (`wanted`:
    /// it answers one of the messages the consumer wants, already counted off); a send that
    /// fails puts it back in the backlog where it was taken (or discards it, when it cannot be
    /// encoded) and
    /// withdraws what the consumer wants.
    fn hand(&mut self, id: u64, item: Item<T>, wanted: bool, from: usize) {
        let Some(replies) = self.consumers.get_mut(&id).and_then(|c| c.replies.as_ref()) else {
            self.put_back(item, from);
            return;
        };
        // `try_send`: a put never waits for a consumer (README.md, "Threads").
        // The value's `Serialize` is the user's code, run here under the lock on a thread of
        // the queue's or a putting one: a panic in it discards the message (the consumer is
        // told, as for one that cannot be encoded) rather than unwinding through the
        // dispatcher's state with the message out of the backlog and the consumer's want used.
        let sent = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            replies.try_send(Reply::Item(Slot::Shared(item.clone())))
        }));
        let f = match sent {
            Ok(Ok(())) => {
                crate::sys::kill_point("queue-handed");
                if let Some(c) = self.consumers.get_mut(&id) {
                    c.in_flight.push_back(item);
                }
                return;
            }
            Ok(Err(e)) if e.is_disconnected() => {
                // Its process is gone (or it dropped its handle): another consumer gets it.
                self.put_back(item, from);
                self.requeued += 1;
                self.cut_off(id);
                return;
            }
            Ok(Err(e)) => e.failure().map_or_else(|| Failure::Io("the reply channel is full".into()), failure),
            Err(_) => Failure::Discarded("the message's Serialize panicked".into()),
        };
        match f {
            Failure::Discarded(_) => self.discard(item),
            _ => self.put_back(item, from),
        }
        // One failure reported once, to the consumer's next get, rather than once for each
        // message it wants; that get asks again.
        let withdrawn = self.withdraw(id).saturating_add(u32::from(wanted));
        self.answer(id, Reply::Failed(f, withdrawn));
    }

    /// Sends an answer that is not a message; a consumer that cannot be reached is cut off.
    fn answer(&mut self, id: u64, reply: Reply<T>) {
        let Some(replies) = self.consumers.get(&id).and_then(|c| c.replies.as_ref()) else { return };
        if replies.try_send(reply).is_err() {
            self.cut_off(id);
        }
    }

    /// After a failed send: sends the consumer nothing more and drops the reply channel's
    /// sending end. What is in flight to it stays until its request channel closes (`leave`):
    /// unread `Got`s may still come (README.md, "States of a message").
    fn cut_off(&mut self, id: u64) {
        self.withdraw(id);
        if let Some(c) = self.consumers.get_mut(&id) {
            c.replies = None;
        }
    }

    /// Forgets a consumer; its unacknowledged messages go back first in the backlog, in the
    /// order they were sent.
    fn leave(&mut self, id: u64) {
        let Some(c) = self.consumers.remove(&id) else { return };
        if c.wants > 0 {
            self.waiting.retain(|&w| w != id);
        }
        self.requeued += c.in_flight.len() as u64;
        for item in c.in_flight.into_iter().rev() {
            self.backlog.push_front(item);
        }
    }

    /// Drops the messages that every consumer there is could not decode once no producer is
    /// left (they would keep the queue from closing); until then they wait for a consumer that
    /// joins later.
    fn drop_refused_by_all(&mut self) -> bool {
        if self.rejects.is_empty() || self.consumers.is_empty() || !self.inbox_closed {
            return false;
        }
        // The backlog is gone through only when some held message was refused by everyone:
        // this runs at every turn while one waits for another consumer.
        if !self.rejects.values().any(|rejecters| self.refused_by_everyone(rejecters)) {
            return false;
        }
        let backlog = std::mem::take(&mut self.backlog);
        let (dropped, kept): (Vec<_>, Vec<_>) = backlog.into_iter().partition(|item| self.refused_by_all(item));
        self.backlog = kept.into();
        let any = !dropped.is_empty();
        for item in dropped {
            self.discard(item);
        }
        any
    }

    fn stats(&self) -> QueueStats {
        QueueStats {
            backlog: self.backlog.len(),
            in_flight: self.consumers.values().map(|c| c.in_flight.len()).sum(),
            consumers: self.consumers.len(),
            waiting: self.consumers.values().filter(|c| c.wants > 0 && c.in_flight.is_empty()).count(),
            closed: self.inbox_closed,
            delivered: self.delivered,
            requeued: self.requeued,
            discarded: self.discarded,
            undecodable: self.undecodable,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::queue::look_until;

    /// A dispatcher with consumers 1 and 2 and `n` messages put, and the consumers' replies.
    fn two_consumers(n: u32) -> (Dispatcher<u32>, Receiver<Reply<u32>>, Receiver<Reply<u32>>) {
        let mut d = Dispatcher::<u32>::new();
        let (r1, c1) = channel::<Reply<u32>>().unwrap();
        let (r2, c2) = channel::<Reply<u32>>().unwrap();
        d.handle(Event::Joined(1, r1));
        d.handle(Event::Joined(2, r2));
        for i in 0..n {
            d.handle(Event::Put(i));
        }
        (d, c1, c2)
    }

    /// Consumer `id` takes the message the dispatcher hands it and refuses it.
    fn take_and_refuse(d: &mut Dispatcher<u32>, id: u64, replies: &Receiver<Reply<u32>>) {
        d.handle(Event::Request(id, Ctl::TryWant));
        assert!(matches!(replies.recv(), Ok(Reply::Item(_))));
        d.handle(Event::Request(id, Ctl::Reject(0)));
    }

    /// Held back past the bound, a message every consumer refused makes room for one that
    /// another consumer may still decode.
    #[test]
    fn messages_refused_by_everyone_make_room_for_one_refused_by_some() {
        let (mut d, c1, c2) = two_consumers(MAX_REFUSED as u32);
        // Broken messages: both consumers refuse each.
        for _ in 0..MAX_REFUSED {
            take_and_refuse(&mut d, 1, &c1);
            take_and_refuse(&mut d, 2, &c2);
        }
        assert_eq!((d.stats().backlog, d.stats().discarded), (MAX_REFUSED, 0));
        // One for consumer 2's GPU, which consumer 1 takes first.
        d.handle(Event::Put(1000));
        d.handle(Event::Request(1, Ctl::TryWant));
        assert!(matches!(c1.recv(), Ok(Reply::Item(Slot::Owned(1000)))));
        d.handle(Event::Request(1, Ctl::Reject(0)));
        assert_eq!((d.stats().backlog, d.stats().discarded), (MAX_REFUSED, 1), "the oldest broken one made room");
        d.handle(Event::Request(2, Ctl::Want(1)));
        assert!(matches!(c2.recv(), Ok(Reply::Item(Slot::Owned(1000)))), "consumer 2 gets it");
    }

    /// A consumer that refused many messages another consumer may decode still gets the next
    /// one it can take, however far back in the backlog.
    #[test]
    fn a_consumer_looks_past_every_message_it_refused() {
        let (mut d, c1, _c2) = two_consumers(100);
        for _ in 0..99 {
            take_and_refuse(&mut d, 1, &c1);
        }
        d.handle(Event::Request(1, Ctl::Want(1)));
        let got = c1.recv_timeout(std::time::Duration::from_secs(5));
        assert!(matches!(got, Ok(Reply::Item(Slot::Owned(99)))), "the one message it did not refuse");
        assert_eq!((d.stats().backlog, d.stats().discarded), (99, 0), "the refused ones wait for consumer 2");
    }

    /// A consumer that returned a message and left: the dispatcher fails to send it the next
    /// one before reading the `Got` it wrote for the one it returned. That message must count
    /// as delivered, not go back to the backlog.
    #[test]
    fn a_failed_send_takes_back_nothing_before_the_consumer_s_requests_are_read() {
        let mut d = Dispatcher::<u32>::new();
        let (replies, consumer) = channel::<Reply<u32>>().unwrap();
        d.handle(Event::Joined(1, replies));
        for i in 0..4 {
            d.handle(Event::Put(i));
        }
        d.handle(Event::Request(1, Ctl::Want(2)));
        let first = consumer.recv().unwrap();
        assert!(matches!(first, Reply::Item(Slot::Owned(0))));
        // It returns 0 and 1 (its Gots are on their way) and leaves.
        drop(consumer);
        // The close reaches the sending end on its own time: wait until a send sees it, so
        // that the dispatcher's next send fails (a send that still got through would only be
        // taken back when the consumer's `Left` is handled, another path).
        let replies = d.consumers[&1].replies.clone().expect("not cut off yet");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            match replies.send(Reply::Empty) {
                Ok(()) => {
                    assert!(std::time::Instant::now() < deadline, "the dropped receiver never showed as gone");
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                Err(e) if e.is_disconnected() => break,
                Err(e) => panic!("a probe failed otherwise than disconnected: {e}"),
            }
        }
        drop(replies);
        d.handle(Event::Request(1, Ctl::Got(1)));
        // Sending 2 failed: 2 is back, the consumer is sent nothing more.
        assert_eq!((d.stats().backlog, d.stats().in_flight, d.stats().requeued), (2, 1, 1));
        d.handle(Event::Request(1, Ctl::Got(1)));
        d.handle(Event::Left(1));
        let s = d.stats();
        assert_eq!((s.delivered, s.requeued, s.backlog, s.in_flight, s.consumers), (2, 1, 2, 0, 0), "{s:?}");
    }

    /// A try of a consumer that wants messages while the backlog holds values a put took in
    /// without sending them (it found others pending): they are sent first, then `Empty`, so
    /// a put made earlier in the queue's process is seen by the try.
    #[test]
    fn a_try_sees_what_a_put_took_in_without_sending() {
        let mut d = Dispatcher::<u32>::new();
        let (replies, consumer) = channel::<Reply<u32>>().unwrap();
        d.handle(Event::Joined(1, replies));
        d.handle(Event::Request(1, Ctl::Want(1)));
        // As `put` leaves it when it finds values pending: in the backlog, not sent.
        d.backlog.push_back(Arc::new(Mutex::new(5)));
        d.handle(Event::Request(1, Ctl::TryWant));
        assert!(matches!(consumer.recv(), Ok(Reply::Item(Slot::Owned(5)))));
        assert!(matches!(consumer.recv(), Ok(Reply::Empty)));
    }

    /// A put that holds the lock and finds puts pending takes them and its own value into the
    /// backlog without sending any, and wakes the server: the server's turn sends what is due
    /// to the consumer that waits, with no other event to come.
    #[test]
    fn puts_taken_in_without_a_send_reach_a_waiting_consumer_through_the_server() {
        use std::time::Duration;
        const WAIT: Duration = Duration::from_secs(10);
        let ends = start::<u32>().unwrap();
        let (requests, requests_rx) = channel::<Ctl>().unwrap();
        let (replies_tx, replies) = channel::<Reply<u32>>().unwrap();
        ends.join.send(Join { requests: requests_rx, replies: replies_tx }).unwrap();
        requests.send(Ctl::Want(2)).unwrap();
        let waiting = look_until(WAIT, || ends.local.state.lock().unwrap().stats().waiting, |&n| n != 0);
        assert!(waiting != 0, "the consumer's want was never read");
        // A put that found the lock taken left its value pending, and another put comes.
        ends.local.pending().push(1);
        ends.local.put(2);
        for expected in [1, 2] {
            match replies.recv_timeout(WAIT) {
                Ok(Reply::Item(Slot::Owned(v))) => assert_eq!(v, expected),
                Ok(_) => panic!("message {expected}: another answer came"),
                Err(e) => panic!("message {expected} did not reach the waiting consumer: {e}"),
            }
        }
    }

    /// A consumer sends something that is not a request while it holds a message: it is cut
    /// off (told so), and the message it holds is not handed to another consumer; the `Got`
    /// it writes for it still counts, and nothing goes back to the backlog when it leaves.
    #[test]
    fn an_unreadable_request_cuts_its_consumer_off_without_taking_back_what_it_holds() {
        use std::time::Duration;
        const WAIT: Duration = Duration::from_secs(10);
        let ends = start::<u32>().unwrap();
        // Requests written by hand: a `Ctl` is its variant's index, then its number (postcard),
        // which a pair of bytes encodes alike; index 99 is no request.
        let listener = crate::Listener::<Ctl>::bind().unwrap();
        let forger = Sender::<(u8, u8)>::connect(listener.name()).unwrap();
        let (replies_tx, replies) = channel::<Reply<u32>>().unwrap();
        ends.join.send(Join { requests: listener.accept_timeout(WAIT).unwrap(), replies: replies_tx }).unwrap();
        ends.local.put(7);
        forger.send((0, 1)).unwrap(); // Want(1)
        assert!(matches!(replies.recv_timeout(WAIT), Ok(Reply::Item(Slot::Owned(7)))));
        forger.send((99, 0)).unwrap();
        assert!(matches!(replies.recv_timeout(WAIT), Ok(Reply::Failed(Failure::Unreadable(_), _))));
        // Another consumer wants a message: the one the first holds is not its.
        let (requests, requests_rx) = channel::<Ctl>().unwrap();
        let (replies_tx, other) = channel::<Reply<u32>>().unwrap();
        ends.join.send(Join { requests: requests_rx, replies: replies_tx }).unwrap();
        requests.send(Ctl::Want(1)).unwrap();
        assert!(
            other.recv_timeout(Duration::from_millis(300)).is_err(),
            "a message held by a live consumer was handed out again"
        );
        // The first returns it and leaves: delivered once, nothing taken back.
        forger.send((3, 0)).unwrap(); // Got(0)
        drop(forger);
        let stats = look_until(WAIT, || ends.local.state.lock().unwrap().stats(), |s| s.consumers == 1);
        assert_eq!(
            (stats.delivered, stats.requeued, stats.backlog, stats.in_flight, stats.consumers),
            (1, 0, 0, 0, 1),
            "{stats:?}"
        );
    }
}
