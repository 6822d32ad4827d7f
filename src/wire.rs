//! The encode and decode contexts of one message: the descriptors its values carry (shared
//! memory, lease and channel sockets, VMM memory), values shared by every storage of the
//! message (its lease), and what a failed encode or decode was about.
//!
//! [`encode`] (or [`encode_scope`]) and [`decode`] push a context for that one message (an
//! encode nested inside, of another message, gets its own); tensors refuse any other
//! serializer, changing nothing. How descriptors travel (by index, once each) and what no
//! value took is closed: docs/architecture.md, "Message format".

use std::any::Any;
use std::cell::RefCell;
use std::collections::HashMap;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
pub(crate) use crate::handover::SpawnTicket;
use crate::lifetime::{
    AnyStorage, Connection, ConnectionKey, ConnectionLeases, Cover, Introduction, KnownSegments, StorageId,
};
use crate::sys::Socket;

pub(crate) use crate::sys::Held;

/// A descriptor's place in a message.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Carried {
    /// Its index among the message's descriptors.
    index: u32,
    /// For spawn arguments: where the child fetches the descriptors.
    spawn: Option<SpawnTicket>,
}

struct Encoding {
    fds: Vec<Held>,
    /// Descriptors carried so far, by dedup key, with their index.
    numbered: rustc_hash::FxHashMap<u64, u32>,
    /// Values shared by every storage of the message, by type.
    shared: Vec<Box<dyn Any>>,
    /// For spawn arguments: whether this is their encoding, and the ticket their descriptors
    /// wait under at this process's home (made at the first one).
    spawn: Option<Option<SpawnTicket>>,
    /// How long descriptors deposited at this process's home wait for their fetch.
    spawn_ttl: Duration,
    /// For a message on a channel: this process's side of the connection, whose lease counts
    /// the message's claims.
    connection: Option<Arc<Connection>>,
    /// Claims counted on the connection's lease for this message: (lease key, storage index).
    claims: Vec<OwnClaim>,
    /// The connection lease the message's frame must introduce (not yet known to be sent).
    introduce: Vec<Introduction>,
    /// Segments the message introduces on the connection (known to the receiver once it is
    /// sent).
    segments: Vec<(StorageId, std::sync::Weak<dyn Any + Send + Sync>)>,
    /// Their records, each with its kind's tag: in the message's trailer, adopted by the receiver
    /// before it decodes the value.
    intros: Vec<(u8, Vec<u8>)>,
    /// For a message to another host: what its encoding keeps (`src/storage/remote.rs`); its
    /// values then carry no descriptor and export no storage.
    remote: Option<Remote>,
}

/// What a message to or from another host keeps while it is encoded or decoded (its
/// transfers, its budget): the remote codec's own, which this module only holds.
pub(crate) type Remote = Box<dyn Any>;

impl Encoding {
    fn new(spawn: Option<Option<SpawnTicket>>, connection: Option<Arc<Connection>>) -> Encoding {
        Encoding {
            fds: Vec::new(),
            numbered: Default::default(),
            shared: Vec::new(),
            spawn,
            spawn_ttl: crate::handover::ARGUMENT_TTL,
            connection,
            claims: Vec::new(),
            introduce: Vec::new(),
            segments: Vec::new(),
            intros: Vec::new(),
            remote: None,
        }
    }
}

/// A descriptor of a message being decoded.
enum Slot {
    Fd(OwnedFd),
    /// Taken as a descriptor that several values share (a lease carried once).
    Shared(Arc<OwnedFd>),
    Taken,
}

#[derive(Default)]
struct Decoding {
    slots: Vec<Slot>,
    /// For a message from a channel: a cover for each claim the message lists, by connection
    /// lease and storage, for its records to take. What no record took is released when
    /// decoding ends.
    claims: HashMap<(ConnectionKey, u64), Vec<Cover>>,
    /// For a message from a channel: the segments its end's senders introduced.
    segments: Option<Arc<KnownSegments>>,
    /// Segments its blocks name that the end does not keep, by the process that sent them.
    missing: Vec<(u128, StorageId)>,
    /// For a message from another host: what its decoding keeps (`src/storage/remote.rs`).
    #[cfg_attr(not(feature = "remote"), allow(dead_code))]
    remote: Option<Remote>,
}

thread_local! {
    static ENCODING: RefCell<Vec<Encoding>> = const { RefCell::new(Vec::new()) };
    static DECODING: RefCell<Vec<Decoding>> = const { RefCell::new(Vec::new()) };
    /// The descriptors of this process's spawn arguments, fetched from its parent.
    /// With until when what its values did not take may be kept (a batch's).
    static SPAWNED: RefCell<Option<Fetched>> = const { RefCell::new(None) };
    /// Why the current operation's encode or decode failed (serde's error types cannot say),
    /// and the error it was where that is a time-out or descriptor exhaustion rather than a
    /// malformed message.
    static FAILURE: RefCell<Option<(String, Option<Error>)>> = const { RefCell::new(None) };
}

/// A message encoded: its bytes and the descriptors to send with them; on a channel also the
/// connection lease its frame introduces and the claims it counts there. Claims of a message
/// dropped unsent are taken back ([`Encoded::sent`] says it was sent).
pub(crate) struct Encoded {
    pub(crate) bytes: Vec<u8>,
    pub(crate) fds: Vec<Held>,
    pub(crate) introduce: Vec<Introduction>,
    claims: Vec<OwnClaim>,
    segments: Vec<(StorageId, std::sync::Weak<dyn Any + Send + Sync>)>,
    connection: Option<Arc<Connection>>,
}

impl Encoded {
    /// The message was written: its claims stand, and the lease it introduced is the
    /// receiver's to hold from now on.
    pub(crate) fn sent(mut self) {
        self.claims.clear();
        if let Some(connection) = &self.connection {
            for i in &self.introduce {
                connection.introduced(i.name.key);
            }
            if !self.segments.is_empty() {
                connection.segments_introduced(&self.segments);
            }
        }
    }
}

impl Drop for Encoded {
    fn drop(&mut self) {
        // Not sent (`sent` empties `claims`): take its claims back, and let go of a lease only
        // it was to introduce.
        if self.claims.is_empty() {
            return;
        }
        let claims: Vec<(u64, u64)> = self.claims.iter().map(|c| (c.lease, c.index)).collect();
        crate::lifetime::withdraw(&claims);
        if let Some(connection) = &self.connection {
            for i in &self.introduce {
                connection.not_introduced(i.name.key);
            }
        }
    }
}

/// A claim a message counts on this process's connection lease: the lease's key here, its
/// name in messages, and the storage's index.
#[derive(Debug, Clone, Copy)]
struct OwnClaim {
    lease: u64,
    name: u64,
    index: u64,
}

/// Encodes `value` as one message (postcard) on a channel whose sending side in this process
/// is `connection`, collecting its descriptors; claims on this process's storages are counted
/// on the connection's lease. The error says why (a tensor that cannot be exported, say).
pub(crate) fn encode_on<T: Serialize + ?Sized>(
    value: &T,
    connection: &Arc<Connection>,
) -> std::result::Result<Encoded, String> {
    // A message of a tensor or a few is a few hundred bytes: one allocation, not a doubling.
    let (bytes, mut e) =
        scope(Encoding::new(None, Some(connection.clone())), || postcard::to_extend(value, Vec::with_capacity(256)));
    let intros = std::mem::take(&mut e.intros);
    let mut encoded = unsent(e);
    // On failure `encoded` drops: the claims made before it are taken back.
    let mut bytes = bytes.map_err(|e| take_failure().unwrap_or_else(|| format!("{e:?}")))?;
    append_trailer(&mut bytes, &intros, &encoded.claims);
    encoded.bytes = bytes;
    Ok(encoded)
}

/// What a message's encoding collected, as a message not sent yet (its claims taken back if
/// it is dropped so).
fn unsent(e: Encoding) -> Encoded {
    Encoded {
        bytes: Vec::new(),
        fds: e.fds,
        introduce: e.introduce,
        claims: e.claims,
        segments: e.segments,
        connection: e.connection,
    }
}

/// Runs `encode` (the serialization of one message) with a fresh context: values inside may
/// carry descriptors and export storages. Returns its result and the descriptors it carried.
#[cfg(test)]
pub(crate) fn encode_scope<R>(encode: impl FnOnce() -> R) -> (R, Vec<Held>) {
    let (result, e) = scope(Encoding::new(None, None), encode);
    (result, e.fds)
}

/// Like [`encode_scope`], for a message on a channel whose sending side here is `connection`:
/// gives the claims counted on its lease and the introductions too.
#[cfg(test)]
pub(crate) fn encode_scope_on<R>(
    connection: &Arc<Connection>,
    encode: impl FnOnce() -> R,
) -> (R, Vec<(u64, u64)>, Vec<Introduction>) {
    let (result, e) = scope(Encoding::new(None, Some(connection.clone())), encode);
    (result, e.claims.iter().map(|c| (c.lease, c.index)).collect(), e.introduce)
}

/// Like [`encode_scope`], for the arguments of a spawn that procspawn serializes: the
/// descriptors wait at this process's home, and each one's place says where the child fetches
/// it. Gives the ticket they wait under, if they carried any (to withdraw them should the child
/// end before it fetched them).
pub(crate) fn encode_spawn_scope<R>(encode: impl FnOnce() -> R) -> (R, Option<SpawnTicket>) {
    let (result, e) = scope(Encoding::new(Some(None), None), encode);
    (result, e.spawn.flatten())
}

/// Encodes `value` (postcard, after the bytes `head` holds) with its descriptors deposited at
/// this process's home for `ttl` (for the one process that decodes them: [`decode_handoff`]),
/// under `ticket` (or a fresh one made at the first descriptor): the bytes or why they are
/// not, and the ticket the descriptors wait under.
pub(crate) fn encode_deposited<T: Serialize + ?Sized>(
    value: &T,
    head: Vec<u8>,
    ticket: Option<SpawnTicket>,
    ttl: Duration,
) -> (std::result::Result<Vec<u8>, String>, Option<SpawnTicket>) {
    let mut context = Encoding::new(Some(ticket), None);
    context.spawn_ttl = ttl;
    let (bytes, e) = scope(context, || postcard::to_extend(value, head));
    (bytes.map_err(|error| take_failure().unwrap_or_else(|| format!("{error:?}"))), e.spawn.flatten())
}

/// Decodes bytes made by [`encode_deposited`], fetching their descriptors from the home of the
/// process that encoded them (once: a second decode of the same bytes finds nothing there).
/// Runs apart from any decode this thread is in; descriptors it fetched and did not take are
/// closed before it returns.
pub(crate) fn decode_handoff<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    struct Restore(Vec<Decoding>, Option<Fetched>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let outer = std::mem::take(&mut self.0);
            let spawned = self.1.take();
            let inner = DECODING.with(|d| std::mem::replace(&mut *d.borrow_mut(), outer));
            let fetched = SPAWNED.with(|s| std::mem::replace(&mut *s.borrow_mut(), spawned));
            // Closed outside the borrows: untaken covers release their claims as they go; what
            // a batch's values not decoded yet will take is kept for them.
            drop(inner);
            put_back(fetched);
        }
    }
    let outer = DECODING.with(|d| std::mem::take(&mut *d.borrow_mut()));
    let spawned = SPAWNED.with(|s| s.borrow_mut().take());
    let restore = Restore(outer, spawned);
    FAILURE.with(|f| f.borrow_mut().take());
    let result = postcard::from_bytes::<T>(bytes);
    drop(restore);
    result.map_err(|e| match FAILURE.with(|f| f.borrow_mut().take()) {
        Some((_, Some(error))) => error,
        Some((why, None)) => Error::Malformed(why),
        None => Error::Malformed(format!("undecodable bytes ({e:?})")),
    })
}

/// Runs `encode` with `context` pushed, and gives back what it collected.
fn scope<R>(context: Encoding, encode: impl FnOnce() -> R) -> (R, Encoding) {
    struct Pop;
    impl Drop for Pop {
        fn drop(&mut self) {
            // Also after a panic: a stale context would let the next serializer export.
            let popped = ENCODING.with(|e| e.borrow_mut().pop());
            // A panic in a value's `Serialize`: the message is never sent, so what it counted on
            // the connection's lease is taken back, as for one that failed to encode.
            if std::thread::panicking()
                && let Some(e) = popped
            {
                drop(unsent(e));
            }
        }
    }
    FAILURE.with(|f| f.borrow_mut().take());
    ENCODING.with(|e| e.borrow_mut().push(context));
    let pop = Pop;
    let result = encode();
    let collected = ENCODING.with(|e| {
        e.borrow_mut().last_mut().map(|e| std::mem::replace(e, Encoding::new(None, None))).expect("pushed above")
    });
    drop(pop);
    (result, collected)
}

/// Runs `encode` (the serialization of one message for another host) in a context of its own
/// that keeps `remote`; gives `encode`'s result and `remote` back. A message encoded inside it
/// (a local send in a value's `Serialize`) gets its own context, and is local.
#[cfg(feature = "remote")]
pub(crate) fn encode_remote<R>(remote: Remote, encode: impl FnOnce() -> R) -> (R, Remote) {
    let mut context = Encoding::new(None, None);
    context.remote = Some(remote);
    let (result, mut e) = scope(context, encode);
    (result, e.remote.take().expect("kept by the context"))
}

/// Like [`encode_remote`], for the deserialization of one message from another host.
#[cfg(feature = "remote")]
pub(crate) fn decode_remote<R>(remote: Remote, decode: impl FnOnce() -> R) -> (R, Remote) {
    let pop = push_decoding(Decoding { remote: Some(remote), ..Default::default() });
    let result = decode();
    let remote =
        DECODING.with(|d| d.borrow_mut().last_mut().and_then(|d| d.remote.take())).expect("kept by the context");
    drop(pop);
    (result, remote)
}

/// Runs `f` on what the message being encoded keeps for another host, if it goes to one.
#[cfg(feature = "remote")]
pub(crate) fn with_remote_encoding<R>(f: impl FnOnce(&mut Remote) -> R) -> Option<R> {
    ENCODING.with(|e| e.borrow_mut().last_mut().and_then(|e| e.remote.as_mut()).map(f))
}

/// Runs `f` on what the message being decoded keeps for another host, if it came from one.
#[cfg(feature = "remote")]
pub(crate) fn with_remote_decoding<R>(f: impl FnOnce(&mut Remote) -> R) -> Option<R> {
    DECODING.with(|d| d.borrow_mut().last_mut().and_then(|d| d.remote.as_mut()).map(f))
}

/// True while the message being encoded on this thread goes to another host.
#[cfg(feature = "remote")]
pub(crate) fn is_remote_encoding() -> bool {
    ENCODING.with(|e| e.borrow().last().is_some_and(|e| e.remote.is_some()))
}

/// True while the message being decoded on this thread came from another host.
#[cfg(feature = "remote")]
pub(crate) fn is_remote_decoding() -> bool {
    DECODING.with(|d| d.borrow().last().is_some_and(|d| d.remote.is_some()))
}

/// The channel connection the message being encoded goes on, if it goes on one.
pub(crate) fn connection() -> Option<Arc<Connection>> {
    ENCODING.with(|e| e.borrow().last().and_then(|e| e.connection.clone()))
}

/// Records a claim counted on the connection's lease `key` for the message being encoded, and
/// the lease's introduction when its frame must carry one (once per message).
pub(crate) fn connection_claim(key: u64, index: u64, introduce: Option<Introduction>, name: u64) {
    ENCODING.with(|e| {
        if let Some(e) = e.borrow_mut().last_mut() {
            e.claims.push(OwnClaim { lease: key, name, index });
            if let Some(i) = introduce
                && !e.introduce.iter().any(|known| known.name == i.name)
            {
                e.introduce.push(i);
            }
        }
    });
}

/// The bytes of one claim in a message's list: the lease's key and the storage's index.
const CLAIM_BYTES: usize = 16;

/// A message's last byte when it lists claims.
const WITH_CLAIMS: u8 = 1;
/// A message's last byte when it introduces segments.
const WITH_SEGMENTS: u8 = 2;

/// Appends what a message on a channel carries beside its value: the segments it introduces
/// (their records, read by the receiver before the value: a value that fails to decode does
/// not take them along, and later messages name them) and the claims it counts on its
/// sender's connection leases. Then a last byte: [`WITH_SEGMENTS`] and [`WITH_CLAIMS`], or 0.
/// Layout (little-endian; a claim names its lease by its name): docs/architecture.md,
/// "Message format", Connection leases and the claims list.
fn append_trailer(bytes: &mut Vec<u8>, intros: &[(u8, Vec<u8>)], claims: &[OwnClaim]) {
    let mut last = 0;
    if !intros.is_empty() {
        let start = bytes.len();
        for (kind, record) in intros {
            bytes.push(*kind);
            bytes.extend((record.len() as u32).to_le_bytes());
            bytes.extend(record);
        }
        let len = (bytes.len() - start) as u32;
        bytes.extend(len.to_le_bytes());
        last |= WITH_SEGMENTS;
    }
    if !claims.is_empty() {
        bytes.reserve(claims.len() * CLAIM_BYTES + 21);
        for OwnClaim { name: key, index, .. } in claims {
            bytes.extend(key.to_le_bytes());
            bytes.extend(index.to_le_bytes());
        }
        bytes.extend(crate::lifetime::process_token().to_le_bytes());
        bytes.extend((claims.len() as u32).to_le_bytes());
        last |= WITH_CLAIMS;
    }
    bytes.push(last);
}

/// Covers of the claims a message lists, by connection lease and storage.
type Covers = HashMap<(ConnectionKey, u64), Vec<Cover>>;

/// A channel message taken apart (see [`append_trailer`]): its value's bytes, the segments it
/// introduces (tag and record each) and a cover for each claim it lists. A claim on a lease
/// the channel does not know gets no cover: a record that names it is refused.
struct Parts<'b> {
    value: &'b [u8],
    intros: Vec<(u8, &'b [u8])>,
    covers: Covers,
}

fn split_trailer<'b>(bytes: &'b [u8], leases: &ConnectionLeases) -> std::result::Result<Parts<'b>, String> {
    let not_ours = || "a message whose trailer (claims, segments) does not add up".to_string();
    let (&last, mut body) = bytes.split_last().ok_or_else(not_ours)?;
    if last & !(WITH_CLAIMS | WITH_SEGMENTS) != 0 {
        return Err(not_ours());
    }
    let mut covers = Covers::new();
    if last & WITH_CLAIMS != 0 {
        let tail = body.len().checked_sub(20).ok_or_else(not_ours)?;
        let owner = u128::from_le_bytes(body[tail..tail + 16].try_into().expect("16 bytes"));
        let n = u32::from_le_bytes(body[tail + 16..].try_into().expect("4 bytes")) as usize;
        let start = n.checked_mul(CLAIM_BYTES).and_then(|len| tail.checked_sub(len)).ok_or_else(not_ours)?;
        for claim in body[start..tail].chunks_exact(CLAIM_BYTES) {
            let key = u64::from_le_bytes(claim[..8].try_into().expect("8 bytes"));
            let index = u64::from_le_bytes(claim[8..].try_into().expect("8 bytes"));
            let name = ConnectionKey { owner, key };
            if let Some(lease) = leases.get(&name) {
                covers.entry((name, index)).or_default().push(Cover::counted(lease, owner, index));
            }
        }
        body = &body[..start];
    }
    let mut intros = Vec::new();
    if last & WITH_SEGMENTS != 0 {
        let tail = body.len().checked_sub(4).ok_or_else(not_ours)?;
        let len = u32::from_le_bytes(body[tail..].try_into().expect("4 bytes")) as usize;
        let start = tail.checked_sub(len).ok_or_else(not_ours)?;
        let mut section = &body[start..tail];
        while let Some((&kind, rest)) = section.split_first() {
            let (len, rest) = rest.split_first_chunk::<4>().ok_or_else(not_ours)?;
            let len = u32::from_le_bytes(*len) as usize;
            if rest.len() < len {
                return Err(not_ours());
            }
            let (record, rest) = rest.split_at(len);
            intros.push((kind, record));
            section = rest;
        }
        body = &body[..start];
    }
    Ok(Parts { value: body, intros, covers })
}

/// Decodes `bytes` (postcard), a part of the message being decoded (a segment's record): its
/// descriptors and claims are the message's.
pub(crate) fn decode_part<X: DeserializeOwned>(bytes: &[u8]) -> Result<X> {
    let (part, rest) = postcard::take_from_bytes(bytes).map_err(|e| {
        Error::Malformed(take_failure().unwrap_or_else(|| format!("an undecodable segment record ({e:?})")))
    })?;
    if !rest.is_empty() {
        return Err(Error::Malformed(format!("a segment record with {} bytes past its end", rest.len())));
    }
    Ok(part)
}

/// Whether this process introduced segment `id` on the channel of the message being encoded,
/// before or earlier in this message: then the block names it, as sent by process `via`
/// (returned).
pub(crate) fn segment_known(id: StorageId) -> Option<u128> {
    ENCODING.with(|e| {
        let e = e.borrow();
        let encoding = e.last()?;
        let connection = encoding.connection.as_ref()?;
        let known = encoding.segments.iter().any(|(s, _)| *s == id) || connection.knows_segment(id);
        known.then(crate::lifetime::process_token)
    })
}

/// The message being encoded introduces segment `id` (held here by `segment`) on its channel,
/// with its kind's tag and `record`, which travel in the message's trailer: the receiving end
/// adopts it before it decodes the value, and keeps it. Outside a channel's message: nothing.
pub(crate) fn introduce_segment(id: StorageId, segment: &AnyStorage, kind: u8, record: Vec<u8>) {
    ENCODING.with(|e| {
        if let Some(encoding) = e.borrow_mut().last_mut()
            && encoding.connection.is_some()
        {
            encoding.segments.push((id, Arc::downgrade(segment)));
            encoding.intros.push((kind, record));
        }
    })
}

/// For a message being encoded on a channel: the process token its blocks name as the
/// sender of the segments it introduces. `None` outside a channel's message (no segment is
/// introduced there).
pub(crate) fn introducing_as() -> Option<u128> {
    ENCODING.with(|e| e.borrow().last().and_then(|e| e.connection.as_ref()).map(|_| crate::lifetime::process_token()))
}

/// A segment that a block of the message being decoded names, as the sender of process `via`
/// introduced it on the channel; `None` outside a channel's message, or if it never did (or
/// the end let it go): the sender is then asked to introduce it again once the message is
/// decoded.
pub(crate) fn known_segment(via: u128, id: StorageId) -> Option<AnyStorage> {
    DECODING.with(|d| {
        let mut d = d.borrow_mut();
        let d = d.last_mut()?;
        let found = d.segments.as_ref()?.get(via, id);
        if found.is_none() && !id.is_local() && !d.missing.contains(&(via, id)) {
            d.missing.push((via, id));
        }
        found
    })
}

/// Keeps `segment`, introduced by the message being decoded (sent by process `via`, its
/// owner), with the channel end, for the messages after it that name it (see
/// [`KnownSegments::remember`]). Outside a channel's message: nothing.
pub(crate) fn remember_segment(
    via: u128,
    id: StorageId,
    segment: AnyStorage,
    ticket: Option<crate::lifetime::CacheTicket>,
    alive: crate::lifetime::OwnerAlive,
) {
    let table = DECODING.with(|d| d.borrow().last().and_then(|d| d.segments.clone()));
    if let Some(table) = table {
        table.remember(via, id, segment, ticket, alive);
    }
}

/// Takes the cover of a claim on storage `index` through connection lease `name` that the
/// message being decoded lists (each claim once).
pub(crate) fn take_connection_cover(name: ConnectionKey, index: u64) -> Option<Cover> {
    DECODING.with(|d| d.borrow_mut().last_mut().and_then(|d| d.claims.get_mut(&(name, index))).and_then(Vec::pop))
}

/// True while procspawn encodes a value outside any context of ours (a spawned function's
/// result): its descriptors then wait at this process's home for the decoder to fetch.
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

/// Fails unless a cuda-mp encode context is open on this thread. Call before changing any
/// state for an export.
pub(crate) fn require_scope() -> Result<()> {
    match ENCODING.with(|e| e.borrow().last().map(|e| e.remote.is_some())) {
        Some(false) => Ok(()),
        Some(true) => Err(to_another_host()),
        None if in_procspawn() => Ok(()),
        None => Err(outside_scope()),
    }
}

/// What a message to another host cannot carry: descriptors, and storages shared in place.
fn to_another_host() -> Error {
    Error::Unsupported("a message to another host carries no descriptors (channels, files, shared memory)".into())
}

/// Whether a message is being encoded on this thread (a cuda-mp encode context, or procspawn's
/// own), rather than a storage exported by hand.
pub(crate) fn in_message() -> bool {
    ENCODING.with(|e| !e.borrow().is_empty()) || in_procspawn()
}

/// The value of type `V` shared by every storage of the message being encoded, made by `make`
/// on first use.
pub(crate) fn per_message<V: Clone + 'static>(make: impl FnOnce() -> Result<V>) -> Result<V> {
    let found = ENCODING.with(|e| match e.borrow().last() {
        Some(e) if e.remote.is_some() => Err(to_another_host()),
        Some(e) => Ok(e.shared.iter().find_map(|v| v.downcast_ref::<V>()).cloned()),
        None if in_procspawn() => Ok(None),
        None => Err(outside_scope()),
    })?;
    if let Some(v) = found {
        return Ok(v);
    }
    let v = make()?;
    ENCODING.with(|e| {
        if let Some(e) = e.borrow_mut().last_mut() {
            e.shared.push(Box::new(v.clone()));
        }
    });
    Ok(v)
}

/// Places a descriptor in the message being encoded. One with a `dedup` key already carried in
/// this message is carried once (the receiver takes it with [`take_shared_fd`]).
pub(crate) fn carry(fd: Held, dedup: Option<u64>) -> Result<Carried> {
    ENCODING.with(|e| {
        let mut e = e.borrow_mut();
        let Some(e) = e.last_mut() else {
            if in_procspawn() {
                let ticket = crate::handover::deposit_one(fd)?;
                return Ok(Carried { index: 0, spawn: Some(ticket) });
            }
            return Err(outside_scope());
        };
        if e.remote.is_some() {
            return Err(to_another_host());
        }
        if let Some(ticket) = &mut e.spawn {
            // Spawn arguments are decoded outside a receive of ours: each value owns its own,
            // and it waits at this process's home from now on, before the call is handed over.
            let first = ticket.is_none();
            let ticket = match ticket {
                Some(ticket) => ticket,
                None => ticket.insert(crate::handover::ticket()?),
            };
            let index = crate::handover::append_expiring(ticket, fd, e.spawn_ttl, first)?;
            return Ok(Carried { index, spawn: Some(ticket.clone()) });
        }
        if let Some(&index) = dedup.and_then(|k| e.numbered.get(&k)) {
            return Ok(Carried { index, spawn: None });
        }
        let index =
            u32::try_from(e.fds.len()).ok().filter(|&i| (i as usize) < crate::sys::MESSAGE_FDS).ok_or_else(|| {
                Error::Unsupported(format!("a message carries at most {} descriptors", crate::sys::MESSAGE_FDS))
            })?;
        e.fds.push(fd);
        if let Some(k) = dedup {
            e.numbered.insert(k, index);
        }
        Ok(Carried { index, spawn: None })
    })
}

/// Serializes a copy of `fd` carried in the message being encoded: the serde side of a type
/// that carries a descriptor of its own (the test helpers' files).
#[cfg(any(test, feature = "testing"))]
pub(crate) fn serialize_fd<S: serde::Serializer>(
    fd: std::os::fd::BorrowedFd<'_>,
    serializer: S,
) -> std::result::Result<S::Ok, S::Error> {
    let copy = fd.try_clone_to_owned().map_err(|e| encode_error(descriptor_error(e.into())))?;
    carry(Arc::new(copy), None).map_err(encode_error)?.serialize(serializer)
}

/// Deserializes a descriptor carried by [`serialize_fd`], and takes it.
#[cfg(any(test, feature = "testing"))]
pub(crate) fn deserialize_fd<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<OwnedFd, D::Error> {
    let carried = Carried::deserialize(deserializer)?;
    take(carried).map_err(decode_error)
}

/// An I/O error, named as descriptor exhaustion when that is what it is.
pub(crate) fn descriptor_error(e: Error) -> Error {
    if crate::sys::out_of_descriptors() {
        let limit = crate::sys::descriptor_limit();
        tracing::warn!(limit, "this process is out of file descriptors");
        Error::OutOfDescriptors { limit }
    } else {
        e
    }
}

/// Decodes one message (postcard) with its descriptors at hand. Whatever its values did not
/// take is closed before this returns. The error says why it does not decode.
#[cfg(test)]
pub(crate) fn decode<T: DeserializeOwned>(bytes: &[u8], fds: Vec<OwnedFd>) -> std::result::Result<T, String> {
    decode_on(bytes, fds, None, |_, _| Err(Error::Malformed("no segment is introduced outside a channel".into())))
}

/// Like [`decode`], for a message from a channel whose senders introduced `leases` (the
/// message ends with the segments it introduces, and its list of claims on them). `adopt`
/// adopts each segment from its kind's tag and record, in the message's decoding context and
/// before its value is decoded: the channel end keeps it ([`remember_segment`]).
pub(crate) fn decode_on<T: DeserializeOwned>(
    bytes: &[u8],
    fds: Vec<OwnedFd>,
    leases: Option<&ConnectionLeases>,
    adopt: fn(u8, &[u8]) -> Result<()>,
) -> std::result::Result<T, String> {
    let Parts { value, intros, covers: claims } = match leases {
        Some(leases) => split_trailer(bytes, leases)?,
        None => Parts { value: bytes, intros: Vec::new(), covers: Covers::new() },
    };
    let pop = push_decoding(Decoding {
        slots: fds.into_iter().map(Slot::Fd).collect(),
        claims,
        segments: leases.map(|l| l.segments().clone()),
        ..Default::default()
    });
    // The segments first: they stay with the channel end whatever the value does.
    let result = match intros.iter().try_for_each(|&(kind, record)| adopt(kind, record)) {
        Ok(()) => postcard::from_bytes::<T>(value)
            .map_err(|e| take_failure().unwrap_or_else(|| format!("undecodable message ({e:?})"))),
        Err(e) => Err(format!("a segment the message introduces: {e}")),
    };
    let missing = DECODING.with(|d| d.borrow_mut().last_mut().map(|d| std::mem::take(&mut d.missing)));
    drop(pop);
    // Each sender of a segment this end does not keep introduces it again with its next block
    // of it (its introduction was lost: a frame whose descriptors the kernel dropped, or one
    // that could not be mapped here), so that only the messages already on their way fail.
    if let Some(leases) = leases {
        for (via, id) in missing.into_iter().flatten() {
            leases.ask_to_introduce(via, id.index());
        }
    }
    result
}

/// Pops this thread's innermost decoding context as it drops (also after a panic).
struct PopDecoding;

impl Drop for PopDecoding {
    fn drop(&mut self) {
        // Dropped outside the borrow: untaken covers release their claims as they go.
        let popped = DECODING.with(|d| d.borrow_mut().pop());
        drop(popped);
    }
}

/// Pushes `context` as this thread's innermost decoding, a failure recorded before forgotten.
fn push_decoding(context: Decoding) -> PopDecoding {
    FAILURE.with(|f| f.borrow_mut().take());
    DECODING.with(|d| d.borrow_mut().push(context));
    PopDecoding
}

fn with_slot<R>(carried: &Carried, f: impl FnOnce(&mut Slot) -> Result<R>) -> Result<R> {
    let index = carried.index as usize;
    let missing = || Error::Malformed(format!("message refers to descriptor {index}, which it does not carry"));
    // The innermost decoding of this thread, or this process's spawn arguments.
    let mut f = Some(f);
    let done = DECODING.with(|d| {
        let mut d = d.borrow_mut();
        d.last_mut().map(|d| match d.slots.get_mut(index) {
            Some(slot) => (f.take().expect("called once"))(slot),
            None => Err(missing()),
        })
    });
    if let Some(done) = done {
        return done;
    }
    let Some(ticket) = &carried.spawn else { return Err(outside_scope()) };
    let f = f.take().expect("called once");
    SPAWNED.with(|s| {
        let mut s = s.borrow_mut();
        if s.as_ref().is_none_or(|fetched| fetched.ticket != *ticket) {
            // A batch this process fetched before keeps what its other values take.
            let (fds, left, until) = match ticket.batch.and_then(|_| crate::handover::kept(ticket)) {
                Some(kept) => kept,
                None => {
                    let (fds, time_left) = crate::handover::fetch(ticket)?;
                    let count = fds.len();
                    (fds.into_iter().map(Some).collect(), count, crate::handover::keep_until(ticket, time_left))
                }
            };
            let fetched = Fetched { ticket: ticket.clone(), fds, left, shared: HashMap::new(), until };
            let replaced = s.replace(fetched);
            put_back(replaced);
        }
        let fetched = s.as_mut().expect("just set");
        // The slot is lent to `f` and put back: O(1) a value, not a pass over the whole batch.
        let mut slot = match (fetched.shared.get(&index), fetched.fds.get_mut(index)) {
            (Some(fd), _) => Slot::Shared(fd.clone()),
            (None, Some(fd)) => fd.take().map_or(Slot::Taken, Slot::Fd),
            (None, None) => return Err(missing()),
        };
        let was_fd = matches!(slot, Slot::Fd(_));
        let result = f(&mut slot);
        if was_fd && !matches!(slot, Slot::Fd(_)) {
            fetched.left -= 1;
        }
        match slot {
            Slot::Fd(fd) => fetched.fds[index] = Some(fd),
            Slot::Shared(fd) => drop(fetched.shared.insert(index, fd)),
            Slot::Taken => {}
        }
        // Every descriptor taken (spawn arguments share none): nothing is kept here.
        if fetched.left == 0 {
            *s = None;
        }
        result
    })
}

/// Descriptors fetched from another process's home under a ticket (`None` once taken), how
/// many are left, those taken as shared by the value being decoded (dropped with it), and
/// until when those its batch's other values will take may be kept.
struct Fetched {
    ticket: SpawnTicket,
    fds: Vec<Option<OwnedFd>>,
    left: usize,
    shared: HashMap<usize, Arc<OwnedFd>>,
    until: std::time::Instant,
}

/// Closes what a decode fetched and did not take, but keeps what the values of a batch that
/// are not decoded yet will take.
fn put_back(fetched: Option<Fetched>) {
    let Some(Fetched { ticket, fds, left, until, .. }) = fetched else { return };
    if ticket.batch.is_some() {
        crate::handover::keep(&ticket, fds, left, until);
    }
}

/// Takes a descriptor out of the message being decoded (each index once).
pub(crate) fn take(carried: Carried) -> Result<OwnedFd> {
    let index = carried.index;
    with_slot(&carried, |slot| match std::mem::replace(slot, Slot::Taken) {
        Slot::Fd(fd) => Ok(fd),
        other => {
            *slot = other;
            Err(Error::Malformed(format!("message refers to descriptor {index} twice")))
        }
    })
}

/// Takes a socket out of the message being decoded (a channel's end, carried once per value),
/// checked to be a Unix `SOCK_SEQPACKET` socket: this process will read or write frames on it.
pub(crate) fn take_socket(carried: Carried) -> Result<Arc<Socket>> {
    let socket =
        Socket::from_fd(take(carried)?).map_err(|e| Error::Malformed(format!("a socket slot of the message: {e}")))?;
    Ok(Arc::new(socket))
}

/// Takes a descriptor out of the message being decoded that several values of the message may
/// share (a lease): one descriptor for all of them.
pub(crate) fn take_shared_fd(carried: Carried) -> Result<Arc<OwnedFd>> {
    take_shared_fd_as(carried, Some).map(|fd| fd.expect("taken as it is"))
}

/// As [`take_shared_fd`], through `accept` (which may refuse it, or give another descriptor
/// for it): what it gives stays in the message for its other values that share the
/// descriptor, so that what it opens is opened once.
pub(crate) fn take_shared_fd_as(
    carried: Carried,
    accept: impl FnOnce(Arc<OwnedFd>) -> Option<Arc<OwnedFd>>,
) -> Result<Option<Arc<OwnedFd>>> {
    with_slot(&carried, |slot| {
        let fd = match std::mem::replace(slot, Slot::Taken) {
            Slot::Fd(fd) => Arc::new(fd),
            Slot::Shared(fd) => fd,
            Slot::Taken => return Err(Error::Malformed("message refers to a descriptor taken already".into())),
        };
        let accepted = accept(fd.clone());
        *slot = Slot::Shared(accepted.clone().unwrap_or(fd));
        Ok(accepted)
    })
}

/// Records why the current encode or decode failed and returns the reason as text (for
/// serde's error types).
pub(crate) fn fail(error: &Error) -> String {
    let text = match error {
        Error::Malformed(m) => m.clone(),
        other => other.to_string(),
    };
    let typed = match error {
        Error::Timeout(after) => Some(Error::Timeout(*after)),
        Error::OutOfDescriptors { limit } => Some(Error::OutOfDescriptors { limit: *limit }),
        _ => None,
    };
    FAILURE.with(|f| *f.borrow_mut() = Some((text.clone(), typed)));
    text
}

/// The failure recorded by this operation, if any (and forgets it).
pub(crate) fn take_failure() -> Option<String> {
    FAILURE.with(|f| f.borrow_mut().take()).map(|(text, _)| text)
}

/// An encode failure as the serializer's error.
pub(crate) fn encode_error<E: serde::ser::Error>(error: Error) -> E {
    E::custom(fail(&error))
}

/// A decode failure as the deserializer's error.
pub(crate) fn decode_error<E: serde::de::Error>(error: Error) -> E {
    E::custom(fail(&error))
}

/// Deserializes a sequence of at most `most` items: the first item past them is refused
/// (`Malformed`, `too_many(most)` saying why), so a forged length collects nothing more
/// (shapes, and a remote bundle's allocations and table).
pub(crate) fn bounded_seq<'de, T: Deserialize<'de>, D: serde::Deserializer<'de>>(
    deserializer: D,
    most: usize,
    too_many: fn(usize) -> String,
) -> std::result::Result<Vec<T>, D::Error> {
    struct AtMost<T> {
        most: usize,
        too_many: fn(usize) -> String,
        _item: std::marker::PhantomData<fn() -> T>,
    }
    impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for AtMost<T> {
        type Value = Vec<T>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "a sequence of at most {} items", self.most)
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Vec<T>, A::Error> {
            // Room for the items the message says it holds, within the bound and a few.
            let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(self.most).min(16));
            while let Some(item) = seq.next_element()? {
                if items.len() == self.most {
                    return Err(decode_error(Error::Malformed((self.too_many)(self.most))));
                }
                items.push(item);
            }
            Ok(items)
        }
    }
    deserializer.deserialize_seq(AtMost { most, too_many, _item: std::marker::PhantomData })
}

/// An I/O error of a system call, as ours.
pub(crate) fn io_error(e: io::Error) -> Error {
    descriptor_error(Error::Io(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn socket() -> Held {
        Arc::new(Socket::pair().unwrap().0)
    }

    #[cfg(feature = "remote")]
    #[test]
    fn a_message_for_another_host_carries_no_descriptor_and_one_encoded_inside_it_is_local() {
        let ((refused, inner), remote) = encode_remote(Box::new(7u32), || {
            assert!(is_remote_encoding());
            let refused = carry(socket(), None).is_err() && require_scope().is_err();
            let (inner, fds) = encode_scope(|| !is_remote_encoding() && carry(socket(), None).is_ok());
            assert!(is_remote_encoding(), "the remote context is back after the local one");
            (refused, inner && fds.len() == 1)
        });
        assert!(refused, "a descriptor in a message to another host");
        assert!(inner, "a local message inside a remote one is local");
        assert_eq!(remote.downcast_ref::<u32>(), Some(&7));
        assert!(!is_remote_encoding());
        /// Says, as it decodes, whether its message came from another host.
        struct Probe(bool);
        impl<'de> Deserialize<'de> for Probe {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Probe, D::Error> {
                u8::deserialize(d)?;
                Ok(Probe(is_remote_decoding()))
            }
        }
        let (seen, _) = decode_remote(Box::new(5u32), || {
            let local = decode::<Probe>(&[1], Vec::new()).map(|p| p.0);
            (with_remote_decoding(|s| s.downcast_ref::<u32>().copied()).flatten(), local, is_remote_decoding())
        });
        assert_eq!(seen, (Some(5), Ok(false), true), "a local message inside a remote one decodes as local");
        assert!(!is_remote_decoding());
    }

    #[test]
    fn outside_a_scope_nothing_is_carried() {
        assert!(carry(socket(), None).is_err());
        assert!(require_scope().is_err());
        assert!(per_message(|| Ok(1u8)).is_err());
    }

    #[test]
    fn a_shared_descriptor_travels_once_and_nested_encodes_keep_their_own() {
        let (carried, fds) = encode_scope(|| {
            let mut v = Vec::new();
            for i in 0..300u64 {
                v.push(carry(socket(), Some(i)).unwrap());
            }
            // A repeated key is carried once.
            v.push(carry(socket(), Some(0)).unwrap());
            // A message encoded meanwhile has its own descriptors.
            let (_, inner) = encode_scope(|| carry(socket(), None).unwrap());
            assert_eq!(inner.len(), 1);
            assert_eq!(per_message(|| Ok(5u32)).unwrap(), 5);
            assert_eq!(per_message(|| Ok(6u32)).unwrap(), 5, "made once per message");
            v
        });
        assert_eq!(fds.len(), 300);
        assert_eq!(carried.last().unwrap().index, 0);
        assert!(require_scope().is_err(), "scope closed: exporting is refused again");
    }

    /// A lease left blocking, shared by two values of one message, is opened again once: both
    /// values hold the one non-blocking file of this process's own.
    #[test]
    fn a_blocking_lease_shared_by_two_values_is_opened_again_once() {
        use crate::lifetime::Lease;
        use std::os::fd::AsRawFd;
        let (_reader, writer) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        let senders = writer.try_clone().unwrap();
        let shared = (Carried { index: 0, spawn: None }, Carried { index: 0, spawn: None });
        let (a, b): (Lease, Lease) = decode(&postcard::to_allocvec(&shared).unwrap(), vec![writer]).unwrap();
        assert_eq!(a.fd().as_raw_fd(), b.fd().as_raw_fd(), "opened again for each value");
        assert!(rustix::fs::fcntl_getfl(a.fd()).unwrap().contains(rustix::fs::OFlags::NONBLOCK));
        assert!(!rustix::fs::fcntl_getfl(&senders).unwrap().contains(rustix::fs::OFlags::NONBLOCK));
    }

    #[test]
    fn decoding_takes_each_descriptor_once_and_closes_the_rest() {
        let (a, b) = Socket::pair().unwrap();
        let fds = vec![OwnedFd::from(b), OwnedFd::from(Socket::pair().unwrap().0)];
        // Takes the first twice as a shared descriptor (a lease), never the second.
        let shared: (Carried, Carried) = (Carried { index: 0, spawn: None }, Carried { index: 0, spawn: None });
        let bytes = postcard::to_allocvec(&shared).unwrap();
        #[derive(Deserialize)]
        struct Two(#[serde(deserialize_with = "sock")] Arc<OwnedFd>, #[serde(deserialize_with = "sock")] Arc<OwnedFd>);
        fn sock<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Arc<OwnedFd>, D::Error> {
            take_shared_fd(Carried::deserialize(d)?).map_err(decode_error)
        }
        let two: Two = decode(&bytes, fds).unwrap();
        assert!(Arc::ptr_eq(&two.0, &two.1));
        assert!(!a.peer_closed());
        drop(two);
        assert!(a.peer_closed(), "the last copy gone, the socket is closed");
        // A forged index.
        let forged = postcard::to_allocvec(&Carried { index: 3, spawn: None }).unwrap();
        #[derive(Debug, Deserialize)]
        struct One(
            #[serde(deserialize_with = "deserialize_fd")]
            #[allow(dead_code)]
            OwnedFd,
        );
        let err = decode::<One>(&forged, vec![]).unwrap_err();
        assert!(err.contains("does not carry"), "{err}");
    }

    mod fuzz {
        use proptest::prelude::*;

        use super::*;
        use crate::lifetime::Lease;

        proptest! {
            #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

            /// Any bytes as a channel message: its trailer is refused or read, never a panic,
            /// and what is left of the message is a prefix of it.
            #[test]
            fn any_trailer_is_read_without_a_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
                let leases = ConnectionLeases::default();
                if let Ok(Parts { value, intros, covers }) = split_trailer(&bytes, &leases) {
                    prop_assert!(bytes.starts_with(value));
                    prop_assert!(intros.iter().all(|(_, r)| r.len() < bytes.len()));
                    prop_assert!(covers.is_empty(), "no lease is known: no cover");
                }
            }

            /// Segments and claims appended to a message read back: the message's bytes whole,
            /// each segment's tag and record, and a cover for each claim on a lease the channel
            /// knows.
            #[test]
            fn trailer_reads_back(
                message in proptest::collection::vec(any::<u8>(), 0..64),
                intros in proptest::collection::vec((any::<u8>(), proptest::collection::vec(any::<u8>(), 0..40)), 0..4),
                claims in proptest::collection::vec((0u64..3, any::<u64>()), 0..20),
            ) {
                let owner = crate::lifetime::process_token();
                let leases = ConnectionLeases::default();
                // Keys 0 and 1 are known here, key 2 is not.
                for key in 0..2 {
                    leases.adopt(ConnectionKey { owner, key }, Lease::accept(Arc::new(crate::sys::lease_pipe().unwrap().1)).unwrap());
                }
                let mut bytes = message.clone();
                let own: Vec<OwnClaim> =
                    claims.iter().map(|&(name, index)| OwnClaim { lease: name, name, index }).collect();
                append_trailer(&mut bytes, &intros, &own);
                let Parts { value, intros: read, covers } = split_trailer(&bytes, &leases).unwrap();
                prop_assert_eq!(value, &message[..]);
                let read: Vec<(u8, Vec<u8>)> = read.into_iter().map(|(k, r)| (k, r.to_vec())).collect();
                prop_assert_eq!(read, intros);
                let known = claims.iter().filter(|(key, _)| *key < 2).count();
                prop_assert_eq!(covers.values().map(Vec::len).sum::<usize>(), known);
                // The covers are dropped here: their releases go to leases nobody reads.
            }
        }
    }
}
