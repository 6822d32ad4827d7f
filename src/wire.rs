//! The serde side channel of one message: the descriptors its storages carry (shared memory,
//! lease channels), what a failed encode or decode was about, and values shared by every
//! storage of the message (its lease). Cleared per operation.
//!
//! ipc-channel carries descriptors out of band (`SCM_RIGHTS`), at most 64 per transport
//! message. A message may hold any number of tensors, so its descriptors are spread: the first
//! [`INLINE_DESCRIPTORS`] travel in the message itself, the rest in batches on a private
//! channel whose receiving end travels with the first of them; the receiver reads the batches
//! as it decodes. A descriptor that appears twice in one message (a lease shared by its
//! storages) travels once.
//!
//! Tensors are encoded only inside a scope opened by a cuda-mp channel or spawn
//! ([`encode_scope`]); any other serializer gets an error and no state changes.
//!
//! A channel's send encodes its message and writes the message's frame (to the socket, or to
//! the sender's backlog) inside one scope, on the calling thread: the transport's write takes
//! exactly the descriptors this encoding left in its thread-locals, and deferred sends run
//! after it. The feeder thread that hands a backlog on writes only redirect frames, which
//! carry no descriptor of a message (`src/channel/README.md`).

use std::any::Any;
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ipc_channel::ipc::{self, IpcReceiver, IpcSender, IpcSharedMemory, OpaqueIpcSender};
use ipc_channel::TryRecvError;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Descriptors of ours carried in the transport message itself; the transport allows 64 in
/// all, and the rest are left to channels the user put in the message.
pub(crate) const INLINE_DESCRIPTORS: usize = 32;

/// Descriptors per overflow batch (the transport's limit is 64 per message).
const BATCH_DESCRIPTORS: usize = 60;

/// How long a receiver waits for a message's overflow batches, which the sender writes right
/// after the message itself.
const OVERFLOW_WAIT: Duration = Duration::from_secs(30);

/// A descriptor as it travels.
pub(crate) enum Descriptor {
    /// Shared memory (a memfd), shared with its storage until the message is sent.
    Memory(Arc<IpcSharedMemory>),
    /// The sending end of a channel.
    Channel(OpaqueIpcSender),
}

/// The wire form of [`Descriptor`].
#[derive(Serialize)]
enum DescriptorRef<'a> {
    Memory(&'a IpcSharedMemory),
    Channel(&'a OpaqueIpcSender),
}

#[derive(Deserialize)]
enum DescriptorOwned {
    Memory(IpcSharedMemory),
    Channel(OpaqueIpcSender),
}

impl Serialize for Descriptor {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Descriptor::Memory(m) => DescriptorRef::Memory(m),
            Descriptor::Channel(c) => DescriptorRef::Channel(c),
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Descriptor {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        Ok(match DescriptorOwned::deserialize(deserializer)? {
            DescriptorOwned::Memory(m) => Descriptor::Memory(Arc::new(m)),
            DescriptorOwned::Channel(c) => Descriptor::Channel(c),
        })
    }
}

/// A descriptor's place in a message.
#[derive(Serialize, Deserialize)]
pub(crate) struct Carried {
    /// Which message this belongs to (a receiver starts afresh on a new one).
    message: u64,
    how: How,
    /// Whether later parts of the message may refer to this descriptor again (the receiver
    /// then keeps a copy until the message is decoded).
    keep: bool,
}

#[derive(Serialize, Deserialize)]
enum How {
    /// In the transport message.
    Inline(Descriptor),
    /// The next descriptor of the overflow batches; the first one brings their channel.
    Overflow(Option<IpcReceiver<Batch>>),
    /// The same channel as the message's `n`-th descriptor.
    Again(u32),
}

/// One overflow batch.
#[derive(Serialize, Deserialize)]
struct Batch(Vec<Descriptor>);

struct Encoding {
    message: u64,
    /// Whether a channel carried twice travels once (not for spawn arguments, which the child
    /// decodes outside a cuda-mp receive: it could not drop its copies afterwards).
    dedup: bool,
    inline: usize,
    /// Descriptors carried so far, by dedup key, with their number in the message.
    numbered: HashMap<u64, u32>,
    count: u32,
    overflow: Vec<Descriptor>,
    batches: Option<IpcSender<Batch>>,
    /// Values shared by every storage of the message, by type.
    shared: Vec<Box<dyn Any>>,
    /// Sends of our own to run once the message is sent.
    deferred: Vec<Box<dyn FnOnce() + Send>>,
}

#[derive(Default)]
struct Decoding {
    message: Option<u64>,
    /// Channels by their number in the message (memory is never referred to again).
    numbered: Vec<Option<OpaqueIpcSender>>,
    batches: Option<IpcReceiver<Batch>>,
    arrived: VecDeque<Descriptor>,
}

thread_local! {
    static ENCODING: RefCell<Option<Encoding>> = const { RefCell::new(None) };
    static DECODING: RefCell<Decoding> = RefCell::new(Decoding::default());
    /// Why the current operation's encode or decode failed (serde's error types cannot say).
    static FAILURE: RefCell<Option<String>> = const { RefCell::new(None) };
}

fn next_message() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    // Distinct across processes too: a receiver may see messages of many senders in turn.
    (crate::lifetime::process_token() as u64) ^ NEXT.fetch_add(1, Ordering::Relaxed).rotate_left(40)
}

/// What an encode scope leaves to do once its message is sent: the overflow batches.
#[must_use = "the overflow must be sent after the message"]
pub(crate) struct Overflow {
    batches: Option<(IpcSender<Batch>, Vec<Descriptor>)>,
}

impl std::fmt::Debug for Overflow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Overflow").field("descriptors", &self.batches.as_ref().map_or(0, |b| b.1.len())).finish()
    }
}

impl Overflow {
    /// How many batches [`send`](Self::send) writes to the overflow channel.
    pub(crate) fn batches(&self) -> usize {
        self.batches.as_ref().map_or(0, |b| b.1.len().div_ceil(BATCH_DESCRIPTORS))
    }

    /// The most bytes one batch's frame holds: per descriptor its kind and index (a varint),
    /// and the batch's length.
    pub(crate) const BATCH_BYTES: usize = BATCH_DESCRIPTORS * 11 + 16;

    /// Sends the descriptors that did not fit in the message, after the message itself.
    pub(crate) fn send(self) -> Result<()> {
        let Some((tx, descriptors)) = self.batches else { return Ok(()) };
        let mut descriptors = descriptors.into_iter().peekable();
        while descriptors.peek().is_some() {
            let batch = Batch(descriptors.by_ref().take(BATCH_DESCRIPTORS).collect());
            tx.send(batch)
                .map_err(|e| Error::Io(std::io::Error::other(format!("sending overflow descriptors: {e}"))))?;
        }
        Ok(())
    }
}

/// Runs `encode` (a transport's serialization of one message) with this module's context:
/// tensors inside may export their storages. Returns its result and the overflow to send once
/// the message is sent. Nested scopes join the outer one.
pub(crate) fn encode_scope<R>(encode: impl FnOnce() -> R) -> (R, Overflow) {
    scope(true, encode)
}

/// Like [`encode_scope`], for spawn arguments: descriptors are not shared within the message.
pub(crate) fn encode_spawn_scope<R>(encode: impl FnOnce() -> R) -> (R, Overflow) {
    scope(false, encode)
}

fn scope<R>(dedup: bool, encode: impl FnOnce() -> R) -> (R, Overflow) {
    if ENCODING.with(|e| e.borrow().is_some()) {
        return (encode(), Overflow { batches: None });
    }
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            // Also after a panic: a stale context would let the next serializer export.
            ENCODING.with(|e| e.borrow_mut().take());
        }
    }
    FAILURE.with(|f| f.borrow_mut().take());
    ENCODING.with(|e| *e.borrow_mut() = Some(Encoding::new(dedup)));
    let reset = Reset;
    let result = encode();
    let state = ENCODING.with(|e| e.borrow_mut().take());
    drop(reset);
    let Some(state) = state else { return (result, Overflow { batches: None }) };
    for action in state.deferred {
        action();
    }
    let batches = state.batches.map(|tx| (tx, state.overflow));
    (result, Overflow { batches })
}

impl Encoding {
    fn new(dedup: bool) -> Encoding {
        Encoding {
            message: next_message(),
            dedup,
            inline: 0,
            numbered: HashMap::new(),
            count: 0,
            overflow: Vec::new(),
            batches: None,
            shared: Vec::new(),
            deferred: Vec::new(),
        }
    }
}

/// True while procspawn encodes a spawned function's result (or arguments of a spawn that did
/// not go through cuda-mp): a transport message, but not one of ours. Tensors then travel with
/// their descriptors in the message itself, each on its own.
fn in_procspawn() -> bool {
    procspawn::serde::in_ipc_mode()
}

fn outside_scope() -> Error {
    Error::Unsupported(
        "tensors cross processes only through cuda-mp channels and spawn arguments; \
         this serializer is not one"
            .into(),
    )
}

/// Runs `action` (a send of our own on some channel) once the message being encoded on this
/// thread is sent, or now when none is. The transport's send takes every descriptor serialized
/// so far on its thread, so a send in the middle of encoding would carry off the message's.
pub(crate) fn defer(action: impl FnOnce() + Send + 'static) {
    let action: Box<dyn FnOnce() + Send> = Box::new(action);
    let left = ENCODING.with(|e| match e.borrow_mut().as_mut() {
        Some(e) => {
            e.deferred.push(action);
            None
        }
        None => Some(action),
    });
    match left {
        // Inside procspawn's encoding, which we cannot wait for: send from another thread.
        Some(action) if in_procspawn() => {
            let _ = std::thread::spawn(action).join();
        }
        Some(action) => action(),
        None => {}
    }
}

/// Fails unless a cuda-mp encode scope is open on this thread. Call before changing any
/// state for an export.
pub(crate) fn require_scope() -> Result<()> {
    if ENCODING.with(|e| e.borrow().is_some()) || in_procspawn() {
        Ok(())
    } else {
        Err(outside_scope())
    }
}

/// The value of type `V` shared by every storage of the message being encoded, made by `make`
/// on first use.
pub(crate) fn per_message<V: Clone + 'static>(make: impl FnOnce() -> Result<V>) -> Result<V> {
    let found = ENCODING.with(|e| {
        let e = e.borrow();
        match e.as_ref() {
            Some(e) => Ok(e.shared.iter().find_map(|v| v.downcast_ref::<V>()).cloned()),
            None if in_procspawn() => Ok(None),
            None => Err(outside_scope()),
        }
    })?;
    if let Some(v) = found {
        return Ok(v);
    }
    let v = make()?;
    ENCODING.with(|e| {
        if let Some(e) = e.borrow_mut().as_mut() {
            e.shared.push(Box::new(v.clone()));
        }
    });
    Ok(v)
}

/// Places a descriptor in the message being encoded. A channel with a `dedup` key already
/// carried in this message is carried once.
pub(crate) fn carry(descriptor: Descriptor, dedup: Option<u64>) -> Result<Carried> {
    ENCODING.with(|e| {
        let mut e = e.borrow_mut();
        let Some(e) = e.as_mut() else {
            if in_procspawn() {
                return Ok(Carried { message: next_message(), how: How::Inline(descriptor), keep: false });
            }
            return Err(outside_scope());
        };
        let dedup = dedup.filter(|_| e.dedup);
        if let Some(&n) = dedup.and_then(|k| e.numbered.get(&k)) {
            return Ok(Carried { message: e.message, how: How::Again(n), keep: false });
        }
        if let Some(k) = dedup {
            e.numbered.insert(k, e.count);
        }
        e.count += 1;
        let how = if e.inline < INLINE_DESCRIPTORS {
            e.inline += 1;
            How::Inline(descriptor)
        } else {
            e.overflow.push(descriptor);
            if e.batches.is_none() {
                let (tx, rx) = ipc::channel::<Batch>().map_err(|e| descriptor_error(e.into()))?;
                e.batches = Some(tx);
                How::Overflow(Some(rx))
            } else {
                How::Overflow(None)
            }
        };
        Ok(Carried { message: e.message, how, keep: dedup.is_some() })
    })
}

/// After a send that failed part-way through serializing, the transport keeps the descriptors
/// serialized so far in thread-locals, and its next send on this thread would carry them off:
/// send them to a throwaway channel instead (closing them).
pub(crate) fn discard_leftovers() {
    if let Ok((tx, rx)) = ipc::channel::<()>() {
        let _ = tx.send(());
        drop(rx);
    }
}

/// An I/O error, named as descriptor exhaustion when that is what it is.
pub(crate) fn descriptor_error(e: Error) -> Error {
    if crate::os::out_of_descriptors() {
        Error::OutOfDescriptors { limit: crate::os::descriptor_limit() }
    } else {
        e
    }
}

/// The byte a parked descriptor's message carries.
const PARKED: u8 = 0x70;

/// Carries any descriptor (VMM memory's, say) in the message being encoded, as ipc-channel
/// cannot: it is sent with `SCM_RIGHTS` into a fresh socket pair, and the pair's other end
/// travels in the message as a channel. The kernel keeps the descriptor alive while it is in
/// flight (also after this process exits), until the receiver takes it ([`unpark`]) or the
/// message is dropped unread.
pub(crate) fn park(fd: std::os::fd::BorrowedFd<'_>) -> Result<Carried> {
    use std::os::fd::AsFd;
    let (tx, rx) = ipc::channel::<()>().map_err(|e| descriptor_error(e.into()))?;
    let end = crate::channel::socket_copy(&format!("{rx:?}")).ok_or_else(|| {
        Error::Io(std::io::Error::other("the transport's socket cannot be used to park a descriptor"))
    })?;
    crate::sys::send_with_fds(end.as_fd(), &[PARKED], &[fd]).map_err(|e| descriptor_error(e.into()))?;
    // Only `tx`'s end is left: the message queued at it is read from there.
    drop((end, rx));
    carry(Descriptor::Channel(tx.to_opaque()), None)
}

/// Serializes `fd` parked in the message being encoded ([`park`]): the serde side of any type
/// that carries a descriptor of its own.
pub(crate) fn serialize_parked<S: serde::Serializer>(
    fd: std::os::fd::BorrowedFd<'_>,
    serializer: S,
) -> std::result::Result<S::Ok, S::Error> {
    park(fd).map_err(encode_error)?.serialize(serializer)
}

/// Deserializes a descriptor parked by [`serialize_parked`] and takes it ([`unpark`]).
pub(crate) fn deserialize_parked<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<std::os::fd::OwnedFd, D::Error> {
    let carried = Carried::deserialize(deserializer)?;
    unpark(carried).map_err(decode_error)
}

/// Takes the descriptor parked in `carried` by [`park`]. A channel with nothing parked in it,
/// something else, or more than one descriptor is malformed.
pub(crate) fn unpark(carried: Carried) -> Result<std::os::fd::OwnedFd> {
    use std::os::fd::AsFd;
    let Descriptor::Channel(tx) = take(carried)? else {
        return Err(Error::Malformed("a parked descriptor's slot carries shared memory".into()));
    };
    let end = crate::channel::socket_copy(&format!("{tx:?}"))
        .ok_or_else(|| Error::Malformed("a parked descriptor's slot is not a socket of ours".into()))?;
    let mut byte = [0u8; 1];
    let got = crate::sys::recv_with_fds(end.as_fd(), &mut byte, 1);
    // Nothing queued: empty (`WouldBlock`), or at its end (its other end closed, and what it
    // held already taken).
    let nothing = matches!(&got, Ok((0, fds)) if fds.is_empty())
        || matches!(&got, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
    if nothing {
        return Err(Error::Malformed("a parked descriptor's socket holds no descriptor".into()));
    }
    match got {
        Ok((1, mut fds)) if byte[0] == PARKED && fds.len() == 1 => Ok(fds.remove(0)),
        Ok(_) => Err(Error::Malformed("a parked descriptor's socket holds something else".into())),
        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
            Err(Error::Malformed(format!("a parked descriptor's socket holds something else ({e})")))
        }
        Err(e) => Err(descriptor_error(e.into())),
    }
}

/// Starts decoding a new message on this thread: forgets the previous one's descriptors.
pub(crate) fn decode_begin() {
    DECODING.with(|d| *d.borrow_mut() = Decoding::default());
    FAILURE.with(|f| f.borrow_mut().take());
}

/// Ends decoding a message: drops this module's copies of its descriptors (a lease copy kept
/// here would keep the lease open), keeping the failure reason for the caller.
pub(crate) fn decode_end() {
    let done = DECODING.with(|d| std::mem::take(&mut *d.borrow_mut()));
    drop(done);
}

/// Takes a descriptor out of the message being decoded.
pub(crate) fn take(carried: Carried) -> Result<Descriptor> {
    DECODING.with(|d| {
        let mut d = d.borrow_mut();
        if d.message != Some(carried.message) {
            // A message decoded without `decode_begin` (spawn arguments): start afresh.
            *d = Decoding { message: Some(carried.message), ..Decoding::default() };
        }
        let descriptor = match carried.how {
            How::Again(n) => {
                let channel = d.numbered.get(n as usize).and_then(Option::as_ref).ok_or_else(|| {
                    Error::Malformed(format!("message refers to descriptor {n}, which it has not carried"))
                })?;
                return Ok(Descriptor::Channel(channel.clone()));
            }
            How::Inline(descriptor) => descriptor,
            How::Overflow(batches) => {
                if let Some(rx) = batches {
                    d.batches = Some(rx);
                }
                next_overflow(&mut d)?
            }
        };
        let numbered = match &descriptor {
            Descriptor::Channel(c) if carried.keep => Some(c.clone()),
            _ => None,
        };
        d.numbered.push(numbered);
        Ok(descriptor)
    })
}

fn next_overflow(d: &mut Decoding) -> Result<Descriptor> {
    loop {
        if let Some(descriptor) = d.arrived.pop_front() {
            return Ok(descriptor);
        }
        let rx = d
            .batches
            .take()
            .ok_or_else(|| Error::Malformed("message refers to overflow descriptors without their channel".into()))?;
        // The transport's decoding keeps the message's descriptors in thread-locals that a
        // nested receive would overwrite: receive the batch on a thread of its own.
        let (rx, received) = std::thread::spawn(move || {
            let received = rx.try_recv_timeout(OVERFLOW_WAIT);
            (rx, received)
        })
        .join()
        .map_err(|_| Error::Malformed("an overflow batch could not be decoded".into()))?;
        d.batches = Some(rx);
        match received {
            Ok(Batch(batch)) if !batch.is_empty() => d.arrived.extend(batch),
            Ok(_) => return Err(Error::Malformed("empty overflow batch".into())),
            Err(TryRecvError::Empty) => {
                return Err(Error::Malformed(format!(
                    "the message's remaining descriptors did not arrive within {OVERFLOW_WAIT:?}"
                )))
            }
            Err(TryRecvError::IpcError(ipc_channel::IpcError::Disconnected)) => {
                return Err(Error::Malformed("the sender closed the message's overflow before sending it all".into()))
            }
            Err(TryRecvError::IpcError(e)) => {
                return Err(descriptor_error(Error::Malformed(format!("cannot receive overflow descriptors: {e:?}"))))
            }
        }
    }
}

/// Records why the current encode or decode failed and returns the reason as text (for
/// serde's error types).
pub(crate) fn fail(error: &Error) -> String {
    let text = match error {
        Error::Malformed(m) => m.clone(),
        other => other.to_string(),
    };
    FAILURE.with(|f| *f.borrow_mut() = Some(text.clone()));
    text
}

/// The failure recorded by this operation, if any (and forgets it).
pub(crate) fn take_failure() -> Option<String> {
    FAILURE.with(|f| f.borrow_mut().take())
}

/// An encode failure as the serializer's error.
pub(crate) fn encode_error<E: serde::ser::Error>(error: Error) -> E {
    E::custom(fail(&error))
}

/// A decode failure as the deserializer's error.
pub(crate) fn decode_error<E: serde::de::Error>(error: Error) -> E {
    E::custom(fail(&error))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn channel_descriptor() -> Descriptor {
        let (tx, _rx) = ipc::channel::<()>().unwrap();
        Descriptor::Channel(tx.to_opaque())
    }

    #[test]
    fn outside_a_scope_nothing_is_carried() {
        assert!(carry(channel_descriptor(), None).is_err());
        assert!(require_scope().is_err());
        assert!(per_message(|| Ok(1u8)).is_err());
    }

    #[test]
    fn descriptors_beyond_the_inline_budget_go_to_the_overflow_once_per_key() {
        let (carried, overflow) = encode_scope(|| {
            let mut v = Vec::new();
            for i in 0..INLINE_DESCRIPTORS + 70 {
                v.push(carry(channel_descriptor(), Some(i as u64)).unwrap());
            }
            // A repeated key is carried once.
            v.push(carry(channel_descriptor(), Some(0)).unwrap());
            assert_eq!(per_message(|| Ok(5u32)).unwrap(), 5);
            assert_eq!(per_message(|| Ok(6u32)).unwrap(), 5, "made once per message");
            v
        });
        assert!(matches!(carried[0].how, How::Inline(_)));
        assert!(matches!(carried[INLINE_DESCRIPTORS].how, How::Overflow(Some(_))));
        assert!(matches!(carried[INLINE_DESCRIPTORS + 1].how, How::Overflow(None)));
        assert!(matches!(carried.last().unwrap().how, How::Again(0)));
        assert_eq!(overflow.batches.as_ref().unwrap().1.len(), 70);
        overflow.send().unwrap();
        // The receiving side, in the same order.
        decode_begin();
        let n = carried.len();
        for c in carried {
            take(c).unwrap();
        }
        DECODING.with(|d| assert_eq!(d.borrow().numbered.len(), n - 1));
        // Scope closed: exporting is refused again.
        assert!(require_scope().is_err());
    }

    #[test]
    fn a_reference_to_an_uncarried_descriptor_is_malformed() {
        decode_begin();
        let forged = Carried { message: 42, how: How::Again(3), keep: false };
        assert!(matches!(take(forged), Err(Error::Malformed(_))));
        let forged = Carried { message: 43, how: How::Overflow(None), keep: false };
        assert!(matches!(take(forged), Err(Error::Malformed(_))));
    }
}
