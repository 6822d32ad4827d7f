//! The storage seam: what one kind of shareable memory implements ([`StorageKind`]), and the
//! one path every storage takes across a process boundary ([`export`], [`import`], and the
//! serde implementation of `Tensor<T, S>` for every storage).
//!
//! A storage's three objects (raw memory, [`Memory`], [`Handle`]): docs/architecture.md, "The
//! storage seam", and "Adding a storage kind"; what its last handle's drop does:
//! src/lifetime/README.md, "States of a storage".

pub(crate) mod pools;
#[cfg(feature = "remote")]
pub(crate) mod remote;

pub use pools::AllocatorStats;

use std::fmt;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::lifetime::{self, AnyStorage, CacheTicket, Claim, Cover, LeaseMode, LiveStorage, LocalStorage, StorageId};
use crate::profile::{self, Phase};
use crate::tensor::{DynTensor, Tensor, TensorWire};
use crate::wire;

/// One kind of memory that can cross a process boundary.
pub(crate) trait StorageKind: Sized + Send + Sync + 'static {
    /// How messages outside a channel carry claims on this kind: a lease per message, or one
    /// per storage (on a channel every claim is counted on the connection's lease).
    const LEASE: LeaseMode;
    /// Whether a receiver keeps a mapping after its last use while the owner holds the
    /// storage (worth it when mapping is expensive).
    const CACHE_IDLE: bool;
    /// The memory: an allocation of this process, or a mapping of another's. Dropping it frees
    /// or unmaps; a mapping is dropped outside every lock.
    type Raw: Send + Sync + 'static;
    /// The kind's part of a storage's record on the wire (descriptors inside it travel through
    /// the [`wire`] module).
    type Wire: Serialize + DeserializeOwned;
    /// Where a receiver maps the memory (a GPU, say), and which import table entry that is.
    type Place;

    /// The record of memory allocated here, for one message.
    fn export(memory: &Memory<Self>) -> Result<Self::Wire>;
    /// The record of memory mapped from another process, passed on to a third.
    fn forward(memory: &Memory<Self>) -> Result<Self::Wire>;
    /// Where to map `wire`'s memory (the place asked for, or the kind's own choice), and the
    /// import table key of mappings made there.
    fn place(wire: &Self::Wire, requested: Option<&Self::Place>) -> Result<(Self::Place, &'static str)>;
    /// Checks that this process's own `memory`, named by a message that came back, may be used
    /// at the place asked for.
    fn check_local(memory: &Memory<Self>, requested: Option<&Self::Place>) -> Result<()>;
    /// Maps another process's memory of `bytes` bytes (checking that the memory holds them).
    /// Runs outside every lock: imports of other storages, sends and releases go on meanwhile.
    fn open(wire: &mut Self::Wire, bytes: usize, place: &Self::Place) -> Result<Self::Raw>;
    /// Runs once the storage is resolved (newly opened, cached, or already in use here) and
    /// before its tensor is handed out: for example, wait for the sender's queued work. It
    /// gets what `open` left of the record (all of it when nothing was opened).
    fn arrived(memory: &Memory<Self>, wire: &mut Self::Wire, place: &Self::Place, arrival: Arrival) -> Result<()>;
    /// Whether `wire` names the memory of `memory`, which this process maps already under the
    /// record's storage id. Any sender can write any id: a record that names a mapped storage
    /// with other memory is forged, and must not decode to the mapped memory (nor poison it).
    fn same_memory(memory: &Memory<Self>, wire: &Self::Wire) -> bool;
    /// A record of this process's own storage came back (a channel within this process, or
    /// a round trip): the rest of the record is the kind's to use (a block names its segment,
    /// which the channel end keeps for where it may go next). Default: nothing.
    fn returned(_wire: &mut Self::Wire) -> Result<()> {
        Ok(())
    }
    /// Imported memory whose last handle is gone: a fence after the work this process queued
    /// on it, if the kind may let go of the memory now (nothing unmapped) and release its
    /// claim once that work is done, off the dropping thread. `None` (the default): the drop
    /// of the raw memory waits for whatever it must, and the claim is released after it.
    fn fence(_raw: &mut Self::Raw) -> Option<Box<dyn Fence>> {
        None
    }
    /// Whether a receiver may keep this mapping cached once its last handle is gone (where
    /// `CACHE_IDLE` says so): not while work that would outlive the process is queued on it
    /// (src/lifetime/README.md, after "Why it is correct"); a GPU's ends with its context.
    fn cacheable(_raw: &Self::Raw) -> bool {
        true
    }
    /// Another process's caching-allocator segment, just mapped here (by a block's record, or
    /// with a receiving end that moved): statistics that count storages leave it out, as the
    /// owner's do. Default: nothing.
    fn opened_segment(_raw: &Self::Raw) {}
}

/// What waits behind a fence (the release of a claim).
pub(crate) type Close = Box<dyn FnOnce() + Send>;

/// A point in the work a process queued on some memory ([`StorageKind::fence`]).
pub(crate) trait Fence: Send {
    /// Runs `close` once the work before the fence is done (on another thread, in order with
    /// what waits behind the other fences of the same queue).
    fn then(self: Box<Self>, close: Close);

    /// Whether an exiting process waits (a while) for what waits behind this fence.
    fn waited_at_exit(&self) -> bool {
        true
    }
}

/// Whether an arriving storage's memory was mapped by this import or was known here already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arrival {
    /// Mapped by this import: nothing in this process has its address yet.
    Mapped,
    /// In use here, cached, or this process's own: its address may be held (in a CUDA graph,
    /// say).
    Known,
}

/// Where memory came from.
enum Origin {
    /// Allocated here; counted while it lives.
    Local(LiveStorage),
    /// Mapped from another process under a claim on one of its leases.
    Imported { cover: Cover, ticket: Option<CacheTicket> },
}

/// A storage's memory with its identity: what leases keep alive and the idle cache holds.
pub(crate) struct Memory<K: StorageKind> {
    id: StorageId,
    len: usize,
    /// The import table key (imported memory).
    key: &'static str,
    origin: Origin,
    /// `Some` until dropped.
    raw: Option<K::Raw>,
}

impl<K: StorageKind> Memory<K> {
    /// Memory allocated by this process, as storage `id`.
    fn local_as(id: StorageId, len: usize, raw: K::Raw) -> Arc<Memory<K>> {
        let counted = !id.is_internal();
        Arc::new(Memory { id, len, key: "", origin: Origin::Local(LiveStorage::new(counted)), raw: Some(raw) })
    }

    /// The raw memory.
    pub(crate) fn raw(&self) -> &K::Raw {
        self.raw.as_ref().expect("raw memory lives until the memory is dropped")
    }

    /// The storage's identity across processes.
    pub(crate) fn id(&self) -> StorageId {
        self.id
    }

    /// Size in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// True when mapped from another process.
    pub(crate) fn is_imported(&self) -> bool {
        matches!(self.origin, Origin::Imported { .. })
    }

    /// False once the process that owns the storage has ended (never for this process's own).
    pub(crate) fn owner_alive(&self) -> bool {
        match &self.origin {
            Origin::Local(_) => true,
            Origin::Imported { cover, .. } => cover.owner_alive(),
        }
    }
}

impl<K: StorageKind> Drop for Memory<K> {
    fn drop(&mut self) {
        let mut raw = self.raw.take();
        let (id, key) = (self.id, self.key);
        match &mut self.origin {
            // Freed before the live count drops, so that a counter that says "freed" is true.
            Origin::Local(_) => drop(raw),
            // A new import of the same storage waits until the mapping is closed; the claim
            // is released after the close.
            Origin::Imported { cover, .. } => match raw.as_mut().and_then(K::fence) {
                // The kind waits for the work behind the fence, not this thread: the mapping
                // closes now, its claim is released once the work is done.
                Some(fence) if fence.waited_at_exit() => {
                    let release = lifetime::DeferredRelease::new(cover.take());
                    finish_closes_at_exit();
                    lifetime::close_import(id, key, || drop(raw));
                    fence.then(Box::new(move || drop(release)));
                }
                Some(fence) => {
                    let release = cover.take();
                    lifetime::close_import(id, key, || drop(raw));
                    fence.then(Box::new(move || drop(release)));
                }
                None => lifetime::close_import(id, key, || drop(raw)),
            },
        }
    }
}

/// Makes this process, when it exits, first wait (a minute at most) for the releases that
/// wait behind fences: a process that drops a received tensor and returns from `main`
/// releases it after its work, as one whose drop waited did. (Registered here, after the CUDA
/// driver was loaded, so that it runs before the driver's own exit handlers.)
fn finish_closes_at_exit() {
    // Once per generation: a forked child's releases are its own, for `before_exit`.
    static INSTALLED: crate::fork::ForkLocal<std::sync::OnceLock<bool>> =
        crate::fork::ForkLocal::new(std::sync::OnceLock::new);
    INSTALLED.get().get_or_init(|| crate::process::at_exit(finish_closes));
}

extern "C" fn finish_closes() {
    let _ = crate::os::catch_quietly(lifetime::wait_for_releases_at_exit);
}

/// A user handle on a storage's memory; the public storage types wrap one.
pub(crate) struct Handle<K: StorageKind> {
    memory: Arc<Memory<K>>,
}

impl<K: StorageKind> Handle<K> {
    /// A handle on new memory of this process.
    pub(crate) fn new_local(len: usize, raw: K::Raw) -> Handle<K> {
        Handle { memory: Memory::local_as(StorageId::new_local(), len, raw) }
    }

    /// A handle on new memory that a caching allocator carves storages out of: shared like
    /// any storage, counted in no storage statistics.
    pub(crate) fn new_internal(len: usize, raw: K::Raw) -> Handle<K> {
        Handle { memory: Memory::local_as(StorageId::new_internal(), len, raw) }
    }

    /// The memory.
    pub(crate) fn memory(&self) -> &Memory<K> {
        &self.memory
    }

    /// True when this handle is all that holds the memory: no claim, no registry entry, no
    /// cached mapping elsewhere keeps it, so it may be refilled for a new storage.
    #[cfg(feature = "remote")]
    pub(crate) fn holds_alone(&mut self) -> bool {
        !self.memory.is_imported() && Arc::get_mut(&mut self.memory).is_some()
    }
}

impl<K: StorageKind> Drop for Handle<K> {
    fn drop(&mut self) {
        let m = &self.memory;
        match &m.origin {
            Origin::Local(_) => lifetime::handles_dropped(m.id),
            // Not kept when it came through a forwarder: its anchors would keep a dead forwarder's
            // claims counted (src/lifetime/README.md, after "Why it is correct").
            Origin::Imported { ticket, cover } if K::CACHE_IDLE && K::cacheable(m.raw()) && !cover.is_relayed() => {
                let memory: AnyStorage = m.clone();
                // Kept for reuse while the owner holds it; otherwise closed right here.
                drop(lifetime::park_idle(m.id, m.key, *ticket, memory));
            }
            Origin::Imported { .. } => {}
        }
    }
}

impl<K: StorageKind> fmt::Debug for Handle<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Storage")
            .field("id", &self.memory.id)
            .field("bytes", &self.memory.len)
            .field("imported", &self.memory.is_imported())
            .finish()
    }
}

/// A public storage type: a user handle of one kind. Tensors hold `Arc`s of it.
pub(crate) trait Shared: Send + Sync + Sized + 'static {
    /// The kind of memory.
    type Kind: StorageKind;
    /// The handle inside.
    fn handle(&self) -> &Handle<Self::Kind>;
    /// Wraps a handle.
    fn from_handle(handle: Handle<Self::Kind>) -> Self;
}

/// A storage as it travels: identity, size, the claim's lease, the cache ticket, and the
/// kind's own record.
#[derive(Serialize, Deserialize)]
pub(crate) struct Record<W> {
    pub(crate) id: StorageId,
    pub(crate) bytes: u64,
    pub(crate) lease: Claim,
    pub(crate) ticket: Option<CacheTicket>,
    pub(crate) kind: W,
}

/// The kinds of caching allocators' segments a channel message introduces: the tag the
/// receiving end adopts one by (its record is a [`CarriedSegment`] of that kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum SegmentTag {
    /// A host segment (`CarriedSegment<HostSegment>`).
    Host = 0,
    /// A GPU segment (`CarriedSegment<GpuStorage>`).
    Gpu = 1,
}

impl SegmentTag {
    /// The kind a tag names.
    pub(crate) fn from_tag(tag: u8) -> Option<SegmentTag> {
        [SegmentTag::Host, SegmentTag::Gpu].into_iter().find(|k| *k as u8 == tag)
    }
}

/// How a block's record refers to the caching allocator's segment it is cut from (`R`: the
/// segment's record).
#[derive(Serialize, Deserialize)]
pub(crate) enum SegmentRef<R> {
    /// The segment's record, exported for this message (outside a channel).
    Whole(Box<R>),
    /// A segment that process `via` introduced on this channel: in this message (its record
    /// travels in its trailer, adopted before its value is decoded: `wire.rs`) or before.
    Known { via: u128, id: StorageId },
    /// Taken by the import.
    Taken,
}

impl<W> SegmentRef<Record<W>> {
    /// The segment's storage id (`None` once taken).
    pub(crate) fn id(&self) -> Option<StorageId> {
        match self {
            SegmentRef::Whole(record) => Some(record.id),
            SegmentRef::Known { id, .. } => Some(*id),
            SegmentRef::Taken => None,
        }
    }

    /// How a block of `segment` refers to it in the message being encoded; `export` makes the
    /// segment's record where one travels, and `carried` turns it into the record that
    /// introduces a segment of tag `tag` on a channel.
    pub(crate) fn of<S: Shared, C: Serialize>(
        segment: &Arc<S>,
        tag: SegmentTag,
        export: impl FnOnce() -> Result<Record<W>>,
        carried: impl FnOnce(Record<W>) -> C,
    ) -> Result<Self> {
        let m = &segment.handle().memory;
        // Only an owner introduces its segments: a receiver that kept a segment forwarded to it
        // would keep the leases up the chain (its claim's anchors) open, and with them whatever
        // a forwarder that died held.
        if !m.is_imported()
            && let Some(via) = wire::segment_known(m.id)
        {
            return Ok(SegmentRef::Known { via, id: m.id });
        }
        let record = export()?;
        // A segment without a slot in this process's liveness table could not be revoked
        // where it is kept: it travels whole.
        if !m.is_imported()
            && record.ticket.is_some()
            && let Some(via) = wire::introducing_as()
        {
            // Serialized here, in the message's context: its descriptors and claim are the
            // message's.
            let record = postcard::to_allocvec(&carried(record)).map_err(|e| {
                Error::Encode(wire::take_failure().unwrap_or_else(|| format!("a segment's record ({e})")))
            })?;
            let any: AnyStorage = segment.clone();
            wire::introduce_segment(m.id, &any, tag as u8, record);
            return Ok(SegmentRef::Known { via, id: m.id });
        }
        Ok(SegmentRef::Whole(Box::new(record)))
    }

    /// The segment's record, where one travels.
    #[cfg(feature = "cuda")]
    pub(crate) fn record(&self) -> Option<&Record<W>> {
        match self {
            SegmentRef::Whole(record) => Some(record),
            SegmentRef::Known { .. } | SegmentRef::Taken => None,
        }
    }

    /// The segment: imported from its record by `import`, or the one the channel end keeps.
    /// `None` where the record was taken.
    pub(crate) fn resolve<S: Shared>(
        &mut self,
        import: impl FnOnce(Record<W>) -> Result<Arc<S>>,
    ) -> Result<Option<Arc<S>>> {
        match std::mem::replace(self, SegmentRef::Taken) {
            SegmentRef::Whole(record) => import(*record).map(Some),
            SegmentRef::Known { via, id } => match wire::known_segment(via, id).and_then(|s| s.downcast::<S>().ok()) {
                Some(segment) => Ok(Some(segment)),
                // This process's own, introduced where the end was before.
                None if id.is_local() => local::<S>(id).map(Some),
                None => Err(Error::Malformed(format!(
                    "a block names segment {id}, which its channel was never given (or let go of, its owner having \
                     exited)"
                ))),
            },
            SegmentRef::Taken => Ok(None),
        }
    }
}

/// Whether the owner of `storage` (mapped here) still lives.
pub(crate) fn owner_alive<S: Shared>(storage: &Arc<S>) -> lifetime::OwnerAlive {
    let storage = Arc::downgrade(storage);
    Box::new(move || storage.upgrade().is_some_and(|s| s.handle().memory.owner_alive()))
}

/// A segment a channel end keeps (its owner named it there), as it travels with the end: the
/// segment forwarded as a storage of kind `S`.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub(crate) struct CarriedSegment<S: Shared>(Record<<S::Kind as StorageKind>::Wire>);

impl<S: Shared> CarriedSegment<S> {
    /// `segment`'s record, if it is a storage of type `S`.
    pub(crate) fn carry(segment: &AnyStorage) -> Option<Result<CarriedSegment<S>>> {
        let segment = segment.clone().downcast::<S>().ok()?;
        Some(export(&segment, true).map(CarriedSegment))
    }

    /// The segment mapped here; `None` (with a warning) when it cannot be mapped here: only
    /// the blocks that name it then fail, not the end.
    pub(crate) fn adopt(self, via: u128) -> Option<lifetime::TravelledSegment> {
        let id = self.0.id;
        self.map(via)
            .inspect_err(|e| {
                tracing::warn!(segment = %id, error = %e, "a segment a channel end brought along could not be mapped")
            })
            .ok()
    }

    /// A segment that the message being decoded introduces (its record `bytes`), mapped here
    /// and kept by the channel end for the blocks that name it, in this message and later
    /// ones.
    pub(crate) fn introduced(bytes: &[u8]) -> Result<()> {
        let carried: CarriedSegment<S> = wire::decode_part(bytes)?;
        // Only an owner introduces its segments (`SegmentRef::of`): its blocks name it as
        // sent by the owner. This process's own (a channel within it) is kept weakly.
        let owner = carried.0.id.owner();
        let lifetime::TravelledSegment { via, id, segment, ticket, alive } = carried.map(owner)?;
        wire::remember_segment(via, id, segment, ticket, alive);
        Ok(())
    }

    fn map(self, via: u128) -> Result<lifetime::TravelledSegment> {
        let (id, ticket) = (self.0.id, self.0.ticket);
        let segment = import::<S>(self.0, None)?;
        let alive = owner_alive(&segment);
        Ok(lifetime::TravelledSegment { via, id, segment, ticket, alive })
    }
}

/// Exports a storage for one message: a claim on it (a lease), the kind's record. Refused,
/// with no state changed, outside a cuda-mp channel or spawn, unless `explicit` (a payload
/// made by hand holds its own lease).
pub(crate) fn export<S: Shared>(storage: &Arc<S>, explicit: bool) -> Result<Record<<S::Kind as StorageKind>::Wire>> {
    profile::timed(Phase::Export, || export_now(storage, explicit))
}

fn export_now<S: Shared>(storage: &Arc<S>, explicit: bool) -> Result<Record<<S::Kind as StorageKind>::Wire>> {
    if !explicit {
        wire::require_scope()?;
    }
    let m = &storage.handle().memory;
    let (lease, ticket, kind) = match &m.origin {
        Origin::Local(live) if !live.is_this_process() => {
            return Err(Error::Unsupported(
                "this storage was allocated by the parent before this process forked: a forked child cannot share \
                 it (receive it through a channel instead, allocate it after the fork, or start processes with \
                 spawn or forkserver)"
                    .into(),
            ));
        }
        Origin::Local(_) => {
            let kind = S::Kind::export(m)?;
            let keep = m.clone();
            let user: AnyStorage = storage.clone();
            let grant = lifetime::grant(
                m.id,
                m.len,
                S::Kind::LEASE,
                S::Kind::CACHE_IDLE,
                move || keep,
                Some(Arc::downgrade(&user)),
            )?;
            crate::sys::kill_point("export");
            (grant.claim, grant.ticket, kind)
        }
        Origin::Imported { cover, ticket } => {
            let claim = lifetime::forward(cover, m.len)?;
            crate::sys::kill_point("forward");
            (claim, *ticket, S::Kind::forward(m)?)
        }
    };
    Ok(Record { id: m.id, bytes: m.len as u64, lease, ticket, kind })
}

/// Imports a storage from a record: this process's own (a message that came back), a mapping
/// in use here or cached, or a new mapping at `requested` (or the kind's choice); then checks
/// its size and runs the kind's arrival step.
pub(crate) fn import<S: Shared>(
    record: Record<<S::Kind as StorageKind>::Wire>,
    requested: Option<&<S::Kind as StorageKind>::Place>,
) -> Result<Arc<S>> {
    let Record { id, bytes, lease, ticket, mut kind } = record;
    let bytes = usize::try_from(bytes).map_err(|_| Error::Malformed("storage size overflows".into()))?;
    // The message's claim: kept by a new mapping, added to the cover of a mapping this process
    // already holds through the same lease, otherwise ended when this returns.
    let mut cover = Some(Cover::of_claim(lease, id)?);
    let storage = if id.is_local() {
        let storage = local::<S>(id)?;
        S::Kind::check_local(&storage.handle().memory, requested)?;
        S::Kind::returned(&mut kind)?;
        storage
    } else {
        let (place, key) = S::Kind::place(&kind, requested)?;
        if ticket.is_some()
            && S::Kind::CACHE_IDLE
            && let Some(cover) = &cover
        {
            lifetime::subscribe(id, cover.owner_lease());
        }
        let storage = lifetime::import(
            id,
            key,
            |memory| {
                memory.downcast::<Memory<S::Kind>>().ok().map(|memory| Arc::new(S::from_handle(Handle { memory })))
            },
            || {
                let cover = cover.take().expect("opened once");
                let raw = profile::timed(Phase::Open, || S::Kind::open(&mut kind, bytes, &place))
                    // A record refused for what it says is refused whoever holds its memory
                    // (and a segment's open already says when its owner had exited).
                    .map_err(|e| match e {
                        Error::Malformed(_) | Error::OwnerExited(_) => e,
                        e if cover.owner_alive() => e,
                        e => Error::OwnerExited(e.to_string()),
                    })?;
                if id.is_internal() {
                    S::Kind::opened_segment(&raw);
                }
                crate::sys::kill_point("import");
                let origin = Origin::Imported { cover, ticket };
                let memory = Arc::new(Memory { id, len: bytes, key, origin, raw: Some(raw) });
                Ok(Arc::new(S::from_handle(Handle { memory })))
            },
        )?;
        // The mapping took the message's claim when this import made it.
        let arrival = if cover.is_none() { Arrival::Mapped } else { Arrival::Known };
        if arrival == Arrival::Known && !S::Kind::same_memory(&storage.handle().memory, &kind) {
            return Err(Error::Malformed(format!(
                "a message names storage {id}, which this process maps, with other memory"
            )));
        }
        // Mapped already: the mapping's cover holds this message's claim from now on when it
        // can (the same counted lease), so that re-sending a storage costs no release.
        if let (Some(new), Origin::Imported { cover: held, .. }) = (cover.take(), &storage.handle().memory.origin) {
            cover = held.absorb(new);
        }
        profile::timed(Phase::EventWait, || S::Kind::arrived(&storage.handle().memory, &mut kind, &place, arrival))?;
        storage
    };
    drop(cover);
    let held = storage.handle().memory.len;
    if held != bytes {
        return Err(Error::Malformed(format!("message claims {bytes} bytes for a storage held here with {held}")));
    }
    Ok(storage)
}

/// This process's storage `id`, named by a message that came back: the live user handle, or
/// a new one on the memory that claims kept alive.
fn local<S: Shared>(id: StorageId) -> Result<Arc<S>> {
    let found = match lifetime::local_storage(id) {
        Some(LocalStorage::Handle(h)) => h.downcast::<S>().ok(),
        Some(LocalStorage::Memory(m)) => m.downcast::<Memory<S::Kind>>().ok().map(|memory| {
            let handle = Arc::new(S::from_handle(Handle { memory }));
            let user: AnyStorage = handle.clone();
            lifetime::revive_local(id, &user);
            handle
        }),
        None => None,
    };
    found.ok_or_else(|| Error::Malformed("message names a storage of this process that is not shared".into()))
}

impl<T: Element, S: Shared> Serialize for Tensor<T, S> {
    fn serialize<Se: Serializer>(&self, serializer: Se) -> std::result::Result<Se::Ok, Se::Error> {
        #[cfg(feature = "remote")]
        if remote::is_encoding() {
            return remote::encode_tensor(&self.storage, T::DTYPE, &self.layout, serializer);
        }
        let record = export(&self.storage, false).map_err(wire::encode_error)?;
        TensorWire::new::<T>(&self.layout, record).serialize(serializer)
    }
}

impl<'de, T: Element, S: Shared> Deserialize<'de> for Tensor<T, S> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        #[cfg(feature = "remote")]
        if remote::is_decoding() {
            let t = remote::decode_tensor::<S, D>(deserializer, Some(T::DTYPE))?;
            return Ok(Tensor::from_parts(t.storage, t.layout));
        }
        let wire = TensorWire::<Record<<S::Kind as StorageKind>::Wire>>::deserialize(deserializer)?;
        decode_tensor(wire, None).map_err(wire::decode_error)
    }
}

impl<S: Shared> Serialize for DynTensor<S> {
    fn serialize<Se: Serializer>(&self, serializer: Se) -> std::result::Result<Se::Ok, Se::Error> {
        #[cfg(feature = "remote")]
        if remote::is_encoding() {
            return remote::encode_tensor(&self.storage, self.dtype, &self.layout, serializer);
        }
        let record = export(&self.storage, false).map_err(wire::encode_error)?;
        TensorWire::of_dtype(self.dtype, &self.layout, record).serialize(serializer)
    }
}

impl<'de, S: Shared> Deserialize<'de> for DynTensor<S> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        #[cfg(feature = "remote")]
        if remote::is_decoding() {
            return remote::decode_tensor::<S, D>(deserializer, None);
        }
        let wire = TensorWire::<Record<<S::Kind as StorageKind>::Wire>>::deserialize(deserializer)?;
        decode_dyn(wire, None, None).map_err(wire::decode_error)
    }
}

/// Rebuilds a tensor from its wire form: checks the dtype, imports the storage, checks the
/// view against it.
pub(crate) fn decode_tensor<T: Element, S: Shared>(
    wire: TensorWire<Record<<S::Kind as StorageKind>::Wire>>,
    requested: Option<&<S::Kind as StorageKind>::Place>,
) -> Result<Tensor<T, S>> {
    let t = decode_dyn(wire, Some(T::DTYPE), requested)?;
    Ok(Tensor::from_parts(t.storage, t.layout))
}

/// Rebuilds a tensor of the dtype its wire names, which must be `expected` when given (checked
/// before the storage is imported, so a mismatch changes nothing).
fn decode_dyn<S: Shared>(
    wire: TensorWire<Record<<S::Kind as StorageKind>::Wire>>,
    expected: Option<DType>,
    requested: Option<&<S::Kind as StorageKind>::Place>,
) -> Result<DynTensor<S>> {
    profile::timed(Phase::Decode, || {
        let (dtype, record, layout) = wire.any_dtype()?;
        if let Some(expected) = expected.filter(|&e| e != dtype) {
            return Err(Error::DTypeMismatch { expected, found: dtype });
        }
        let storage = import::<S>(record, requested)?;
        let layout = layout.check(storage.handle().memory.len, dtype)?;
        Ok(DynTensor { storage, layout, dtype })
    })
}
