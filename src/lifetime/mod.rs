//! Cross-process lifetime of shared storage: leases, limbo, the import table, the idle cache,
//! revocation and the reaper. It knows nothing of what a storage is: storages are
//! `Arc<dyn Any + Send + Sync>` here. See README.md here for the states and the lock order.

mod connection;
mod courier;
mod export;
mod ids;
mod import;
mod lease;
mod reaper;
mod table;
#[cfg(test)]
mod tests;

use std::any::Any;
use std::collections::HashMap;

use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::fork::ForkLocal;

pub(crate) use connection::{
    Connection, ConnectionKey, ConnectionLeases, Introduction, KnownSegments, OwnerAlive, TravelledSegment,
    connection_open,
};
pub(crate) use courier::{wait_for_releases, wait_for_releases_at_exit};
pub use export::{HolderStats, holder_stats};
pub(crate) use export::{
    LiveStorage, LocalStorage, forward, grant, handles_dropped, local_storage, revive_local, withdraw,
};
pub use ids::StorageId;
pub(crate) use ids::process_token;
pub(crate) use import::{DeferredRelease, close_import, import, park_idle, subscribe};
pub(crate) use lease::{CacheTicket, Claim, Cover, Lease, LeaseMode, NOT_A_LEASE};
#[cfg(any(test, feature = "testing"))]
pub(crate) use reaper::spare_leases;

/// A storage as the lifetime machinery sees it: anything shareable, kept alive by `Arc`.
pub(crate) type AnyStorage = Arc<dyn Any + Send + Sync>;
type WeakStorage = Weak<dyn Any + Send + Sync>;

/// The import table's key: a storage and the kind of mapping (one per GPU that maps it).
type ImportKey = (StorageId, &'static str);

/// Counters of the lifetime machinery in this process, for tests and monitoring.
///
/// ```
/// let stats = cuda_mp::lifetime_stats();
/// assert!(stats.freed_storages <= stats.freed_storages + stats.live_storages as u64);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LifetimeStats {
    /// Storages allocated by this process that are not yet freed.
    pub live_storages: usize,
    /// Storages allocated by this process and freed since it started.
    pub freed_storages: u64,
    /// Storages of this process held alive for other processes (in limbo or still in use here).
    pub exported_storages: usize,
    /// Storages of other processes that this process forwarded in messages (on channels, as
    /// spawn arguments, results or pool calls, as bytes) and keeps a claim on for the processes
    /// it sent them to, until the last of those drops them or dies.
    pub relayed_storages: usize,
    /// Open lease channels on this process's storages: one per channel this process sent
    /// storages on, held by its receiver for as long as it holds the channel or anything that
    /// came through it; outside channels (spawn arguments, pool calls) one per message of host
    /// storages or of storages this process forwards (one per forwarded storage where
    /// procspawn encodes a result on its own), and one per GPU storage of its own while this
    /// process holds it and it is shared.
    pub outstanding_leases: usize,
    /// Lease channels made since the process started: one per channel and sending process
    /// (again only after the last one of that channel closed), and outside channels as
    /// `outstanding_leases` says.
    pub leases_granted: u64,
    /// Lease channels closed since the process started (every copy dropped, or reclaimed from
    /// dead processes).
    pub leases_released: u64,
    /// Storages of other processes mapped in this process and in use.
    pub imported_storages: usize,
    /// Mappings of other processes' storages kept open here after their last use, for reuse
    /// while their owners still hold them.
    pub cached_mappings: usize,
    /// Mappings of other processes' storages opened since the process started (a message for
    /// a storage already mapped here, in use or cached, opens nothing).
    pub opened_mappings: u64,
    /// File descriptors of GPU (VMM) memory this process holds to share it: one per VMM
    /// storage allocated here (exported at allocation) or mapped here, while it lives. Each
    /// message that carries the storage parks a copy of it, which lives while the message does.
    /// The caching allocators' segments are not counted here (see `Device::allocator_stats` and
    /// `mapped_segments`).
    pub offered_descriptors: usize,
    /// Segments of other processes' caching allocators mapped here (by the blocks in use here,
    /// or cached): what fresh tensors from those processes are cut from. Not counted in the
    /// mapping counters above.
    pub mapped_segments: usize,
    /// Segments of other processes' caching allocators opened since the process started (the
    /// only driver opens that fresh pooled tensors cost).
    pub opened_segments: u64,
}

/// Everything the lifetime machinery tracks in this process, under one lock (see README.md
/// for the lock order). The maps keyed by this process's own numbers hash with FxHash (a
/// handoff looks them up several times); those keyed by what peers send keep SipHash.
#[derive(Default)]
struct State {
    /// The owner registry: storages of this process that other processes may hold.
    exported: FxHashMap<StorageId, export::Exported>,
    /// Relays (`export.rs`): a storage of another process this one forwarded ->
    /// its relay entry in `exported`.
    relays: HashMap<StorageId, StorageId>,
    /// Claims per open lease channel of this process: storage index -> number of claims.
    covers: FxHashMap<u64, FxHashMap<u64, usize>>,
    /// Open lease channels of this process that are per-storage (README.md, "Leases and claims").
    shared_leases: FxHashSet<u64>,
    /// Those of them that lease a caching allocator's segment, counted in no statistics.
    uncounted_leases: FxHashSet<u64>,
    /// Exported storages whose last claim is gone and whose memory is being freed right now
    /// (outside the lock); still counted as exported until done.
    freeing: usize,
    /// The import table: mappings of other processes' storages in use here.
    imported: HashMap<ImportKey, WeakStorage>,
    /// Mappings kept after their last use, with their slot in the owner's table.
    idle: HashMap<ImportKey, (AnyStorage, u32)>,
    /// Mappings evicted from `idle` and being closed right now (off the reaper's thread);
    /// still counted as cached until done.
    evicting: usize,
    /// Mappings being opened right now (outside the lock), by the thread opening each: a
    /// second import of the same storage waits for the first.
    opening: HashMap<ImportKey, std::thread::ThreadId>,
    /// The storage each thread waits in `import` to see opened (to refuse a wait that would
    /// close a cycle of opens).
    waiting: HashMap<std::thread::ThreadId, ImportKey>,
    /// Mappings being closed right now (outside the lock): not to be opened again until done.
    /// (Counted: an eviction and the close it leads to each hold a mark.)
    closing: HashMap<ImportKey, usize>,
    /// Claims whose release waits behind a fence (`DeferredRelease`).
    deferred_releases: usize,
    /// Liveness tables of owners this process subscribed to (`None` until the table arrives).
    owner_tables: HashMap<u128, Option<table::Table>>,
    /// The segment tables of this process's channel ends, told of revocations.
    segment_tables: Vec<connection::WeakSegments>,
    stats: LifetimeStats,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    /// Threads waiting on `changed`. Counted under the state lock before each wait, so a
    /// change made under the lock and notified after it either is seen by the waiter's own
    /// check or finds the waiter counted: `notify` may then skip the wake-up system call when
    /// nobody waits, which is almost always (it runs at every send, release and free).
    waiters: AtomicUsize,
}

/// Per process: a forked child starts with nothing exported, imported or cached (what it
/// inherited is its parent's).
static SHARED: ForkLocal<Shared> = ForkLocal::new(|| Shared {
    state: Mutex::new(State::default()),
    changed: Condvar::new(),
    waiters: AtomicUsize::new(0),
});

fn state() -> MutexGuard<'static, State> {
    // Every update is a single insert, remove or counter change, so a lock poisoned by a panic
    // elsewhere still guards consistent maps.
    SHARED.get().state.lock().unwrap_or_else(|p| p.into_inner())
}

/// Waits for a change (for `timeout` at most; `None`: no limit), counted among the waiters.
fn wait(guard: MutexGuard<'static, State>, timeout: Option<Duration>) -> MutexGuard<'static, State> {
    let shared = SHARED.get();
    shared.waiters.fetch_add(1, Ordering::SeqCst);
    let guard = match timeout {
        Some(timeout) => shared.changed.wait_timeout(guard, timeout).unwrap_or_else(|p| p.into_inner()).0,
        None => shared.changed.wait(guard).unwrap_or_else(|p| p.into_inner()),
    };
    shared.waiters.fetch_sub(1, Ordering::SeqCst);
    guard
}

/// Wakes the waiters after a change made under the state lock (call it after the change).
fn notify() {
    let shared = SHARED.get();
    if shared.waiters.load(Ordering::SeqCst) > 0 {
        shared.changed.notify_all();
    }
}

/// In a forked child, before anything else runs there (the `fork` module's child handler):
/// closes what it can reach without waiting of the parent's spare and per-storage leases, and
/// of the reading ends its reaper watches (docs/architecture.md, "Processes made by `fork`").
pub(crate) fn close_inherited_leases() {
    if let Some(shared) = SHARED.inherited() {
        let leases: Vec<Lease> = match shared.state.try_lock() {
            Ok(mut s) => s.exported.values_mut().filter_map(|e| e.shared_lease.take()).collect(),
            Err(_) => Vec::new(),
        };
        // Closing this process's copies; the parent's stay open.
        leases.into_iter().for_each(Lease::close_inherited);
    }
    reaper::close_inherited();
}

/// Tells revocations to `table` from now on (tables already dropped are forgotten here).
fn register_segment_table(table: connection::WeakSegments) {
    let mut s = state();
    s.segment_tables.retain(|t| t.strong_count() > 0);
    s.segment_tables.push(table);
}

/// Descriptors of GPU (VMM) memory this process holds to share it (per process generation).
static DESCRIPTORS: ForkLocal<AtomicUsize> = ForkLocal::new(|| AtomicUsize::new(0));

/// One more (`1`) or one fewer (`-1`) VMM descriptor held by this process.
#[cfg(feature = "cuda")]
pub(crate) fn descriptors_held(delta: isize) {
    let counter = DESCRIPTORS.get();
    if delta >= 0 {
        counter.fetch_add(delta as usize, Ordering::Relaxed);
    } else {
        counter.fetch_sub(delta.unsigned_abs(), Ordering::Relaxed);
    }
    notify();
}

impl State {
    /// Marks `key` as being closed, once more.
    fn mark_closing(&mut self, key: ImportKey) {
        *self.closing.entry(key).or_insert(0) += 1;
    }

    /// Takes one mark off `key`.
    fn unmark_closing(&mut self, key: &ImportKey) {
        if let Some(n) = self.closing.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                self.closing.remove(key);
            }
        }
    }
}

fn stats_of(s: &State) -> LifetimeStats {
    let mut stats = s.stats;
    // A caching allocator's segments are not the user's storages: only their blocks count.
    let internal = s.exported.keys().filter(|id| id.is_internal()).count();
    stats.exported_storages = s.exported.len() - internal - s.relays.len() + s.freeing;
    // Nor are the relays of another process's segments (a forwarded block's segment).
    stats.relayed_storages = s.relays.keys().filter(|of| !of.is_internal()).count();
    stats.imported_storages =
        s.imported.iter().filter(|((id, _), w)| !id.is_internal() && w.strong_count() > 0).count();
    stats.cached_mappings = s.idle.keys().filter(|(id, _)| !id.is_internal()).count() + s.evicting;
    stats.mapped_segments = s.imported.iter().filter(|((id, _), w)| id.is_internal() && w.strong_count() > 0).count()
        + s.idle.keys().filter(|(id, _)| id.is_internal()).count();
    stats.offered_descriptors = DESCRIPTORS.get().load(Ordering::Relaxed);
    stats
}

/// Current counters of this process.
///
/// ```
/// let before = cuda_mp::lifetime_stats();
/// let t = cuda_mp::HostTensor::<u8>::zeros(&[16]).unwrap();
/// assert_eq!(cuda_mp::lifetime_stats().live_storages, before.live_storages + 1);
/// drop(t);
/// ```
pub fn lifetime_stats() -> LifetimeStats {
    stats_of(&state())
}

/// Waits until `condition` holds for the counters, or `timeout` passes. Wakes on every change
/// (a storage freed, a lease granted or released), never by polling.
///
/// ```
/// use std::time::Duration;
/// let stats = cuda_mp::wait_for_lifetime(Duration::from_secs(1), |s| s.cached_mappings == 0).unwrap();
/// assert_eq!(stats.cached_mappings, 0);
/// ```
pub fn wait_for_lifetime(timeout: Duration, condition: impl Fn(&LifetimeStats) -> bool) -> Result<LifetimeStats> {
    let deadline = crate::os::instant_after(timeout);
    let mut stats = lifetime_stats();
    loop {
        // The caller's condition runs without the lock: it may take time, or call cuda-mp.
        if condition(&stats) {
            return Ok(stats);
        }
        let guard = state();
        let now = stats_of(&guard);
        if now != stats {
            // Changed while the condition ran: look again before waiting.
            stats = now;
            continue;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout(timeout));
        }
        // Every change is made under the lock and notified after it: none is missed between
        // the comparison above and this wait (the waiter is counted under the lock).
        stats = stats_of(&wait(guard, Some(left)));
    }
}
