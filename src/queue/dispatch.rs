//! The dispatcher of a [`Queue`](super::Queue): the threads in the creating process that own
//! the backlog, and the messages between them and the consumers. See README.md here for the
//! protocol and why no message is lost or delivered twice.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::channel::{channel, Receiver, Sender};
use crate::error::{RecvError, Result, SendFailure};

use super::QueueStats;

/// A consumer's request, on the consumer's own channel to the dispatcher. Every request but
/// `Got` gets exactly one answer on the consumer's reply channel, in the order asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) enum Ctl {
    /// One message, whenever there is one (answered `Item`, `Closed` or `Failed`).
    Want,
    /// One message if one is waiting now (answered `Item`, `Empty`, `Closed` or `Failed`).
    TryWant,
    /// Withdraws a `Want` (answered `Cancelled`, after the `Want`'s own answer if it was
    /// already answered).
    Cancel,
    /// The last `Item` arrived and decoded: it is delivered. No answer.
    Got,
    /// The queue's counters (answered `Stats`).
    Stats,
}

/// The dispatcher's answer to one request.
#[derive(Serialize, Deserialize)]
#[serde(bound(serialize = "T: Serialize", deserialize = "T: DeserializeOwned"))]
pub(super) enum Reply<T> {
    /// A message; the consumer acknowledges it with `Got` once decoded.
    Item(Slot<T>),
    /// Nothing waiting (for `TryWant`).
    Empty,
    /// Every producer is gone and nothing is left or in flight.
    Closed,
    /// The `Want` is withdrawn.
    Cancelled,
    /// The counters.
    Stats(QueueStats),
    /// The dispatcher could not send the message it had for this request.
    Failed(Failure),
}

/// Why the dispatcher could not forward a message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) enum Failure {
    /// The message cannot be encoded again; it is discarded.
    Discarded(String),
    /// The operating system refused the send; the message stays first in the backlog.
    Io(String),
    /// The dispatcher's process is out of descriptors; the message stays first in the backlog.
    OutOfDescriptors(u64),
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

/// A consumer joining: the receiving end of its request channel (it keeps the sending end; the
/// channel closes when the consumer leaves or its process dies) and the sending end of its
/// reply channel (the dispatcher holds the only one, so the consumer sees the queue end when
/// the dispatcher's process does).
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub(super) struct Join<T> {
    pub(super) requests: Receiver<Ctl>,
    pub(super) replies: Sender<Reply<T>>,
}

/// What the reader threads, and puts made in this process, tell the dispatcher thread.
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
}

type Item<T> = Arc<Mutex<T>>;

struct Consumer<T> {
    replies: Sender<Reply<T>>,
    /// Sent, not yet acknowledged.
    in_flight: Option<Item<T>>,
    /// Has an unanswered `Want` (is in the waiting line). Answers are sent by the dispatcher
    /// thread alone, in order, so a `Cancel` finds its `Want` either waiting or answered.
    waiting: bool,
}

struct Dispatcher<T> {
    backlog: VecDeque<Item<T>>,
    consumers: HashMap<u64, Consumer<T>>,
    /// Consumers with an unanswered `Want`, first come first served.
    waiting: VecDeque<u64>,
    inbox_closed: bool,
    delivered: u64,
    requeued: u64,
    discarded: u64,
    undecodable: u64,
}

/// The ends of a queue whose dispatcher runs in this process.
pub(super) struct Ends<T> {
    /// Producers anywhere: the inbox.
    pub(super) inbox: Sender<T>,
    /// Producers in this process: the dispatcher's event queue itself, which takes the value
    /// as it is (no encoding, no descriptors, no lease).
    pub(super) local: mpsc::Sender<Event<T>>,
    /// Consumers anywhere.
    pub(super) join: Sender<Join<T>>,
}

/// Starts a queue's dispatcher in this process.
pub(super) fn start<T>() -> Result<Ends<T>>
where
    T: Serialize + DeserializeOwned + Send + 'static,
{
    let (inbox_tx, inbox_rx) = channel::<T>()?;
    let (join_tx, join_rx) = channel::<Join<T>>()?;
    let (events_tx, events_rx) = mpsc::channel::<Event<T>>();
    thread::Builder::new().name("cuda-mp-queue".into()).spawn(move || Dispatcher::new().run(events_rx))?;
    let puts = events_tx.clone();
    thread::Builder::new().name("cuda-mp-queue-puts".into()).spawn(move || read_puts(inbox_rx, puts))?;
    let joins = events_tx.clone();
    thread::Builder::new().name("cuda-mp-queue-joins".into()).spawn(move || read_joins(join_rx, joins))?;
    Ok(Ends { inbox: inbox_tx, local: events_tx, join: join_tx })
}

/// Moves every put into the dispatcher's unbounded event queue at once, so that a producer
/// never waits for a consumer.
fn read_puts<T: Serialize + DeserializeOwned>(inbox: Receiver<T>, events: mpsc::Sender<Event<T>>) {
    loop {
        let event = match inbox.recv() {
            Ok(v) => Event::Put(v),
            Err(RecvError::Disconnected) => {
                let _ = events.send(Event::InboxClosed);
                return;
            }
            Err(RecvError::Io(_)) => {
                // Not a message: the transport failed. Do not spin on a persistent failure.
                thread::sleep(std::time::Duration::from_millis(1));
                continue;
            }
            Err(_) => Event::Undecodable,
        };
        if events.send(event).is_err() {
            return;
        }
    }
}

/// Registers joining consumers and starts a reader of each one's requests.
fn read_joins<T: Serialize + DeserializeOwned + Send + 'static>(
    joins: Receiver<Join<T>>,
    events: mpsc::Sender<Event<T>>,
) {
    let mut next = 0u64;
    loop {
        let join = match joins.recv() {
            Ok(join) => join,
            Err(RecvError::Disconnected) => return,
            Err(RecvError::Io(_)) => {
                thread::sleep(std::time::Duration::from_millis(1));
                continue;
            }
            // A forged or undecodable join: nobody to answer.
            Err(_) => continue,
        };
        next += 1;
        let id = next;
        // Joined before the first request of this consumer: one thread sends both events in
        // that order, or this one sends Joined before the reader exists.
        if events.send(Event::Joined(id, join.replies)).is_err() {
            return;
        }
        let requests = join.requests;
        let tx = events.clone();
        let started = thread::Builder::new().name("cuda-mp-queue-consumer".into()).spawn(move || loop {
            match requests.recv() {
                Ok(ctl) => {
                    if tx.send(Event::Request(id, ctl)).is_err() {
                        return;
                    }
                }
                // Closed (left or died), or something that is not a request: either way this
                // consumer is done with.
                Err(_) => {
                    let _ = tx.send(Event::Left(id));
                    return;
                }
            }
        });
        if started.is_err() && events.send(Event::Left(id)).is_err() {
            return;
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
        }
    }

    /// Runs until every reader is gone: every handle of the queue, everywhere, dropped. What is
    /// left in the backlog is dropped then (its tensors released).
    fn run(mut self, events: mpsc::Receiver<Event<T>>) {
        while let Ok(event) = events.recv() {
            self.handle(event);
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
                self.consumers.insert(id, Consumer { replies, in_flight: None, waiting: false });
            }
            Event::Request(id, ctl) => self.request(id, ctl),
            Event::Left(id) => {
                self.leave(id);
                self.serve();
            }
        }
    }

    fn request(&mut self, id: u64, ctl: Ctl) {
        let Some(c) = self.consumers.get_mut(&id) else { return };
        match ctl {
            Ctl::Want => {
                if !c.waiting {
                    c.waiting = true;
                    self.waiting.push_back(id);
                }
                self.serve();
            }
            Ctl::TryWant => {
                if let Some(item) = self.backlog.pop_front() {
                    self.hand(id, item);
                } else {
                    let reply = if self.drained() { Reply::Closed } else { Reply::Empty };
                    self.answer(id, reply);
                }
            }
            Ctl::Cancel => {
                if c.waiting {
                    c.waiting = false;
                    self.waiting.retain(|&w| w != id);
                }
                self.answer(id, Reply::Cancelled);
            }
            Ctl::Got => {
                if c.in_flight.take().is_some() {
                    self.delivered += 1;
                    // The last delivery may be what the waiting consumers wait for to be told
                    // the queue is closed.
                    self.serve();
                }
            }
            Ctl::Stats => {
                let stats = self.stats();
                self.answer(id, Reply::Stats(stats));
            }
        }
    }

    /// Every producer gone, nothing in the backlog, nothing sent and unacknowledged (which
    /// could come back if its consumer dies).
    fn drained(&self) -> bool {
        self.inbox_closed && self.backlog.is_empty() && self.consumers.values().all(|c| c.in_flight.is_none())
    }

    /// Hands backlog messages to waiting consumers, first come first served; once drained,
    /// tells every waiting consumer the queue is closed.
    fn serve(&mut self) {
        while !self.backlog.is_empty() {
            let Some(id) = self.waiting.pop_front() else { return };
            let Some(c) = self.consumers.get_mut(&id) else { continue };
            c.waiting = false;
            let item = self.backlog.pop_front().expect("backlog checked non-empty");
            self.hand(id, item);
        }
        if self.drained() {
            while let Some(id) = self.waiting.pop_front() {
                if let Some(c) = self.consumers.get_mut(&id) {
                    c.waiting = false;
                    self.answer(id, Reply::Closed);
                }
            }
        }
    }

    /// Sends one message to a consumer and keeps it as in flight until acknowledged; a send
    /// that fails puts it back first in the backlog (or discards it, when it cannot be encoded).
    fn hand(&mut self, id: u64, item: Item<T>) {
        let Some(c) = self.consumers.get_mut(&id) else {
            self.backlog.push_front(item);
            return;
        };
        match c.replies.send(Reply::Item(Slot::Shared(item.clone()))) {
            Ok(()) => {
                // A consumer of this crate acknowledges before it asks again; one that does not
                // gets its older message put back rather than lost.
                if let Some(older) = c.in_flight.replace(item) {
                    self.backlog.push_front(older);
                    self.requeued += 1;
                }
            }
            Err(e) if e.is_disconnected() => {
                // Its process is gone (or it dropped its handle): another consumer gets it.
                self.backlog.push_front(item);
                self.requeued += 1;
                self.leave(id);
            }
            Err(e) => {
                let f = failure(e.failure());
                match f {
                    Failure::Discarded(_) => self.discarded += 1,
                    _ => self.backlog.push_front(item),
                }
                self.answer(id, Reply::Failed(f));
            }
        }
    }

    /// Sends an answer that is not a message; a consumer that cannot be reached is done with.
    fn answer(&mut self, id: u64, reply: Reply<T>) {
        let Some(c) = self.consumers.get(&id) else { return };
        if c.replies.send(reply).is_err() {
            self.leave(id);
        }
    }

    /// Forgets a consumer; its unacknowledged message goes back first in the backlog.
    fn leave(&mut self, id: u64) {
        let Some(c) = self.consumers.remove(&id) else { return };
        if c.waiting {
            self.waiting.retain(|&w| w != id);
        }
        if let Some(item) = c.in_flight {
            self.backlog.push_front(item);
            self.requeued += 1;
        }
    }

    fn stats(&self) -> QueueStats {
        QueueStats {
            backlog: self.backlog.len(),
            in_flight: self.consumers.values().filter(|c| c.in_flight.is_some()).count(),
            consumers: self.consumers.len(),
            waiting: self.waiting.len(),
            closed: self.inbox_closed,
            delivered: self.delivered,
            requeued: self.requeued,
            discarded: self.discarded,
            undecodable: self.undecodable,
        }
    }
}
