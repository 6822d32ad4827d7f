//! Cross-process lifetime of shared storage: leases, limbo, revocation and the reaper. See
//! README.md here.

use std::any::Any;
use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use ipc_channel::ipc::{self, IpcReceiverSet, IpcSelectionResult, IpcSender, IpcSharedMemory};
use once_cell::sync::{Lazy, OnceCell};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A storage as the lifetime machinery sees it: anything shareable, kept alive by `Arc`.
pub(crate) type AnyStorage = Arc<dyn Any + Send + Sync>;
type WeakStorage = Weak<dyn Any + Send + Sync>;

/// Identifies a storage across processes: the process that allocated it and its number there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StorageId {
    owner: u128,
    index: u64,
}

impl StorageId {
    /// A fresh id for a storage allocated by this process.
    pub(crate) fn new_local() -> StorageId {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        StorageId { owner: process_token(), index: NEXT.fetch_add(1, Ordering::Relaxed) }
    }

    /// True when this process allocated the storage.
    pub fn is_local(&self) -> bool {
        self.owner == process_token()
    }

    /// The token of the process that allocated the storage.
    pub(crate) fn owner(&self) -> u128 {
        self.owner
    }
}

/// A random 128-bit identity of this process, fixed at first use (pids can be reused; these
/// are not).
pub(crate) fn process_token() -> u128 {
    static TOKEN: Lazy<u128> = Lazy::new(|| {
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let mut hi = RandomState::new().build_hasher();
        hi.write_u128(nanos);
        hi.write_u32(std::process::id());
        let mut lo = RandomState::new().build_hasher();
        lo.write_u64(hi.finish());
        ((hi.finish() as u128) << 64) | lo.finish() as u128
    });
    *TOKEN
}

/// A claim on a storage that another process owns. It is the sending end of a channel whose
/// receiving end the owner watches: when every copy of it is dropped, or every process that
/// held one has died, the owner sees the channel close and releases its reference.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Lease(IpcSender<Control>);

/// What a message carries besides the lease so that the receiver can cache the storage's
/// mapping after its last use: the storage's slot in the owner's liveness table. (The receiver
/// subscribes to the owner's revocations through the lease itself.)
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct CacheTicket {
    slot: u32,
}

impl CacheTicket {
    /// The storage's slot in its owner's liveness table.
    pub(crate) fn slot(&self) -> u32 {
        self.slot
    }
}

/// Receiver to owner, on a lease channel: subscribe to revocations.
#[derive(Debug, Serialize, Deserialize)]
enum Control {
    Link { revocations: IpcSender<Revocation> },
}

/// Owner to consumer.
#[derive(Debug, Serialize, Deserialize)]
enum Revocation {
    /// The owner's liveness table: slot `s` holds the index of the storage it tracks while the
    /// owner's own handles on it are alive, 0 otherwise.
    Table(IpcSharedMemory),
    /// The owner dropped its handles on storage `index`: drop cached mappings of it.
    Storage(u64),
}

const TABLE_SLOTS: usize = 1 << 16;
const NO_SLOT: u32 = u32::MAX;

/// Counters of the lifetime machinery in this process, for tests and monitoring.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LifetimeStats {
    /// Storages allocated by this process that are not yet freed.
    pub live_storages: usize,
    /// Storages allocated by this process and freed since it started.
    pub freed_storages: u64,
    /// Storages of this process held alive for other processes (in limbo or still in use here).
    pub exported_storages: usize,
    /// Open lease channels on this process's storages (held by other processes, by messages in
    /// flight, or for GPU storage by this process while it holds the storage).
    pub outstanding_leases: usize,
    /// Lease channels made since the process started: one per message for host storage, one per
    /// GPU storage per period of being shared (every message of that period carries a copy).
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
}

struct Exported {
    keep_alive: AnyStorage,
    handle: Option<WeakStorage>,
    leases: usize,
    slot: u32,
    /// The owner's copy of the storage's shared lease channel, cloned into every message and
    /// dropped when the owner's handles are gone.
    shared_lease: Option<IpcSender<Control>>,
}

struct Owner {
    table: Option<Table>,
    free_slots: Vec<u32>,
    subscribers: Vec<IpcSender<Revocation>>,
}

#[derive(Default)]
struct State {
    exported: HashMap<StorageId, Exported>,
    imported: HashMap<(StorageId, &'static str), WeakStorage>,
    /// Mappings kept after their last use, with their slot in the owner's table.
    idle: HashMap<(StorageId, &'static str), (AnyStorage, u32)>,
    /// Exported storages whose last lease is gone and whose memory is being freed right now
    /// (outside the lock); still counted as exported until done.
    freeing: usize,
    /// Mappings being closed right now (outside the lock): not to be opened again until done.
    closing: std::collections::HashSet<(StorageId, &'static str)>,
    /// Liveness tables of owners this process subscribed to (`None` until the table arrives).
    owner_tables: HashMap<u128, Option<Table>>,
    stats: LifetimeStats,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

static SHARED: Lazy<Shared> = Lazy::new(|| Shared { state: Mutex::new(State::default()), changed: Condvar::new() });

fn state() -> MutexGuard<'static, State> {
    // Every update is a single insert, remove or counter change, so a lock poisoned by a panic
    // elsewhere still guards consistent maps.
    SHARED.state.lock().unwrap_or_else(|p| p.into_inner())
}

fn notify() {
    SHARED.changed.notify_all();
}

fn owner() -> MutexGuard<'static, Owner> {
    static OWNER: Lazy<Mutex<Owner>> =
        Lazy::new(|| Mutex::new(Owner { table: None, free_slots: Vec::new(), subscribers: Vec::new() }));
    OWNER.lock().unwrap_or_else(|p| p.into_inner())
}

/// A liveness table mapped in this process: shared memory accessed only through atomics.
struct Table {
    cells: *const AtomicU64,
    len: usize,
    shm: IpcSharedMemory,
}

// SAFETY: the mapping is owned by `shm` and only accessed atomically.
unsafe impl Send for Table {}
// SAFETY: as above.
unsafe impl Sync for Table {}

impl Table {
    fn new(mut shm: IpcSharedMemory) -> Table {
        // SAFETY: the pointer is only used for atomic accesses, which other processes' writes
        // cannot make undefined.
        let bytes = unsafe { shm.deref_mut() };
        Table { cells: bytes.as_mut_ptr() as *const AtomicU64, len: bytes.len() / 8, shm }
    }

    fn cell(&self, slot: u32) -> Option<&AtomicU64> {
        if (slot as usize) < self.len {
            // SAFETY: in bounds; the mapping is page-aligned, so every cell is 8-byte aligned.
            Some(unsafe { &*self.cells.add(slot as usize) })
        } else {
            None
        }
    }
}

fn table_cell(table: &Table, slot: u32) -> Option<&AtomicU64> {
    table.cell(slot)
}

fn stats_of(s: &State) -> LifetimeStats {
    let mut stats = s.stats;
    stats.exported_storages = s.exported.len() + s.freeing;
    stats.imported_storages = s.imported.values().filter(|w| w.strong_count() > 0).count();
    stats.cached_mappings = s.idle.len();
    stats
}

/// Current counters.
pub fn lifetime_stats() -> LifetimeStats {
    stats_of(&state())
}

/// Waits until `condition` holds for the counters, or `timeout` passes. Wakes on every change
/// (a storage freed, a lease granted or released), never by polling.
pub fn wait_for_lifetime(timeout: Duration, condition: impl Fn(&LifetimeStats) -> bool) -> Result<LifetimeStats> {
    let deadline = Instant::now() + timeout;
    let mut guard = state();
    loop {
        let stats = stats_of(&guard);
        if condition(&stats) {
            return Ok(stats);
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Timeout(timeout));
        }
        guard = SHARED.changed.wait_timeout(guard, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
    }
}

/// Counts one live storage of this process from construction to drop. Embed one in every
/// storage type this process allocates.
#[derive(Debug)]
pub(crate) struct LiveStorage(());

impl LiveStorage {
    pub(crate) fn new() -> LiveStorage {
        state().stats.live_storages += 1;
        LiveStorage(())
    }
}

impl Drop for LiveStorage {
    fn drop(&mut self) {
        {
            let mut s = state();
            s.stats.live_storages -= 1;
            s.stats.freed_storages += 1;
        }
        notify();
    }
}

/// How a storage's messages carry leases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeaseMode {
    /// A new lease channel per message; the storage's handle is its memory.
    PerMessage,
    /// One lease channel per storage, shared by every message while the owner holds handles
    /// on it (see [`handles_dropped`]); no channel is made on the send path.
    PerStorage,
}

/// Grants a lease on a local storage for one outgoing message. Until the lease is released the
/// storage's memory (`keep_alive`) stays here, whatever this process does with its own handles
/// (limbo). `handle`, when given, is the user-facing handle that a message coming back to this
/// process resolves to while it lives.
pub(crate) fn grant_lease(
    id: StorageId,
    keep_alive: impl FnOnce() -> AnyStorage,
    handle: Option<WeakStorage>,
    mode: LeaseMode,
) -> Result<Lease> {
    let reaper = reaper()?;
    let lease = {
        let mut s = state();
        if let Some(shared) = s.exported.get(&id).and_then(|e| e.shared_lease.as_ref()) {
            return Ok(Lease(shared.clone()));
        }
        let lease = reaper.new_lease(id)?;
        let entry = s.exported.entry(id).or_insert_with(|| Exported {
            keep_alive: keep_alive(),
            handle,
            leases: 0,
            slot: NO_SLOT,
            shared_lease: None,
        });
        entry.leases += 1;
        if mode == LeaseMode::PerStorage {
            entry.shared_lease = Some(lease.0.clone());
        }
        s.stats.outstanding_leases += 1;
        s.stats.leases_granted += 1;
        lease
    };
    notify();
    Ok(lease)
}

/// A ticket that lets the receiver keep its mapping of `id` cached after use, for as long as
/// this process holds handles on the storage. Call after [`grant_lease`].
pub(crate) fn cache_ticket(id: StorageId) -> Result<CacheTicket> {
    let mut s = state();
    let Some(entry) = s.exported.get_mut(&id) else {
        return Ok(CacheTicket { slot: NO_SLOT });
    };
    if entry.slot == NO_SLOT {
        let mut o = owner();
        if o.table.is_none() {
            o.table = Some(Table::new(IpcSharedMemory::from_byte(0, TABLE_SLOTS * 8)));
            o.free_slots = (0..TABLE_SLOTS as u32).rev().collect();
        }
        if let Some(slot) = o.free_slots.pop() {
            if let Some(cell) = o.table.as_ref().and_then(|t| table_cell(t, slot)) {
                cell.store(id.index, Ordering::SeqCst);
            }
            entry.slot = slot;
        }
    }
    Ok(CacheTicket { slot: entry.slot })
}

/// This process dropped its last handle on local storage `id`: receivers may no longer keep
/// idle mappings of it. The memory itself stays until the last lease is released.
pub(crate) fn handles_dropped(id: StorageId) {
    let (slot, shared_lease) = match state().exported.get_mut(&id) {
        Some(e) => (e.slot, e.shared_lease.take()),
        None => return,
    };
    // The owner's copy of the shared lease goes: the lease ends when the receivers' copies do.
    drop(shared_lease);
    if slot == NO_SLOT {
        return;
    }
    let mut o = owner();
    // Mark the storage dead before telling anyone: a receiver that checks the table after
    // missing the revocation sees it dead.
    if let Some(cell) = o.table.as_ref().and_then(|t| table_cell(t, slot)) {
        cell.store(0, Ordering::SeqCst);
    }
    o.subscribers.retain(|s| s.send(Revocation::Storage(id.index)).is_ok());
}

fn release_lease(id: StorageId) {
    let dropped = {
        let mut s = state();
        let Some(entry) = s.exported.get_mut(&id) else { return };
        entry.leases -= 1;
        let last = entry.leases == 0;
        s.stats.outstanding_leases -= 1;
        s.stats.leases_released += 1;
        if last {
            s.freeing += 1;
            s.exported.remove(&id)
        } else {
            None
        }
    };
    if let Some(entry) = dropped {
        if entry.slot != NO_SLOT {
            let mut o = owner();
            if let Some(cell) = o.table.as_ref().and_then(|t| table_cell(t, entry.slot)) {
                cell.store(0, Ordering::SeqCst);
            }
            o.free_slots.push(entry.slot);
        }
        // Freeing may call into the driver: do it outside the lock.
        drop(entry);
        state().freeing -= 1;
    }
    notify();
}

/// A local storage named by a message that came back to this process: the live user handle if
/// there is one, else the storage's memory (to wrap in a new handle), while it is leased.
pub(crate) enum LocalStorage {
    Handle(AnyStorage),
    Memory(AnyStorage),
}

pub(crate) fn local_storage(id: StorageId) -> Option<LocalStorage> {
    let s = state();
    let e = s.exported.get(&id)?;
    Some(match e.handle.as_ref().and_then(Weak::upgrade) {
        Some(h) => LocalStorage::Handle(h),
        None => LocalStorage::Memory(e.keep_alive.clone()),
    })
}

/// Records a new user handle for a local storage revived by a returning message.
pub(crate) fn revive_local(id: StorageId, handle: WeakStorage) {
    let mut s = state();
    if let Some(e) = s.exported.get_mut(&id) {
        e.handle = Some(handle);
        if let Some(cell) = owner().table.as_ref().and_then(|t| table_cell(t, e.slot)) {
            cell.store(id.index, Ordering::SeqCst);
        }
    }
}

/// The storage `id` of another process as mapped here: the handle in use, else a cached idle
/// mapping passed to `revive`, else the one `open` makes. Both run under the import lock, so a
/// mapping is never opened while another of the same storage is closing.
pub(crate) fn import<H: Any + Send + Sync>(
    id: StorageId,
    kind: &'static str,
    revive: impl FnOnce(AnyStorage) -> Option<Arc<H>>,
    open: impl FnOnce() -> Result<Arc<H>>,
) -> Result<Arc<H>> {
    let mut s = state();
    // A handle can be opened only once per process: wait while a mapping of it is closing, or
    // while its last handle is being dropped (it is about to be cached or closed).
    while s.closing.contains(&(id, kind)) || s.imported.get(&(id, kind)).is_some_and(|w| w.strong_count() == 0) {
        s = SHARED.changed.wait(s).unwrap_or_else(|p| p.into_inner());
    }
    if let Some(existing) = s.imported.get(&(id, kind)).and_then(Weak::upgrade) {
        if let Ok(handle) = existing.downcast::<H>() {
            return Ok(handle);
        }
    }
    let handle = match s.idle.remove(&(id, kind)).and_then(|(memory, _)| revive(memory)) {
        Some(handle) => handle,
        None => {
            let handle = open()?;
            s.stats.opened_mappings += 1;
            handle
        }
    };
    let as_any: AnyStorage = handle.clone();
    s.imported.insert((id, kind), Arc::downgrade(&as_any));
    drop(s);
    notify();
    Ok(handle)
}

/// Subscribes to revocations from the owner of `id` (once per owner), through a lease on one of
/// its storages, so that mappings of its storages can be cached after use.
pub(crate) fn subscribe(id: StorageId, lease: &Lease) {
    if id.is_local() || state().owner_tables.contains_key(&id.owner) {
        return;
    }
    let Ok(reaper) = reaper() else { return };
    let Ok((tx, rx)) = ipc::channel::<Revocation>() else { return };
    if lease.0.send(Control::Link { revocations: tx }).is_ok() {
        state().owner_tables.insert(id.owner, None);
        reaper.watch(Watched::Revocations(id.owner), rx.to_opaque());
    }
}

/// The last user handle of an imported storage is gone. Keeps its mapping (`memory`) cached
/// when the owner still holds the storage; otherwise hands it back to be closed.
pub(crate) fn park_idle(id: StorageId, kind: &'static str, slot: u32, memory: AnyStorage) -> Option<AnyStorage> {
    let mut s = state();
    if s.imported.get(&(id, kind)).is_some_and(|w| w.strong_count() == 0) {
        s.imported.remove(&(id, kind));
    }
    // Cache while the owner holds the storage; also while the owner's table is still on its
    // way (the mapping is checked when it arrives, or evicted if the owner goes away first).
    let keep = match s.owner_tables.get(&id.owner) {
        Some(Some(table)) => table_cell(table, slot).is_some_and(|c| c.load(Ordering::SeqCst) == id.index),
        Some(None) => slot != NO_SLOT,
        None => false,
    };
    let result = if keep {
        s.idle.insert((id, kind), (memory, slot));
        None
    } else {
        Some(memory)
    };
    drop(s);
    notify();
    result
}

/// Runs `close` for a mapping of another process's storage that is being dropped. Other
/// imports go on meanwhile; only a new import of the same storage waits for it.
pub(crate) fn close_import(id: StorageId, kind: &'static str, close: impl FnOnce()) {
    {
        let mut s = state();
        if s.imported.get(&(id, kind)).is_some_and(|w| w.strong_count() == 0) {
            s.imported.remove(&(id, kind));
        }
        s.closing.insert((id, kind));
    }
    close();
    state().closing.remove(&(id, kind));
    notify();
}

/// An owner's liveness table arrived: keep it, and evict the mappings cached while it was on
/// its way whose storages the owner no longer holds.
fn table_arrived(owner: u128, table: Table) {
    let evicted: Vec<AnyStorage> = {
        let mut s = state();
        let dead: Vec<_> = s
            .idle
            .iter()
            .filter(|((id, _), (_, slot))| {
                id.owner == owner && table_cell(&table, *slot).is_none_or(|c| c.load(Ordering::SeqCst) != id.index)
            })
            .map(|(k, _)| *k)
            .collect();
        s.owner_tables.insert(owner, Some(table));
        dead.iter().filter_map(|k| s.idle.remove(k)).map(|(m, _)| m).collect()
    };
    drop(evicted);
    notify();
}

fn revoke(owner: u128, index: Option<u64>) {
    let evicted: Vec<AnyStorage> = {
        let mut s = state();
        let keys: Vec<_> =
            s.idle.keys().filter(|(id, _)| id.owner == owner && index.is_none_or(|i| id.index == i)).copied().collect();
        keys.iter().filter_map(|k| s.idle.remove(k)).map(|(m, _)| m).collect()
    };
    // Closing the mappings takes the lock again: outside it.
    drop(evicted);
    notify();
}

/// What the reaper watches.
#[derive(Debug, Clone, Copy)]
enum Watched {
    Lease(StorageId),
    /// A pre-made lease channel not yet handed out.
    Spare,
    Revocations(u128),
}

/// Watches the receiving ends of leases (which also carry subscriptions to revocations) and
/// this process's own subscriptions.
struct Reaper {
    pending: Mutex<Vec<(Watched, ipc::OpaqueIpcReceiver)>>,
    wake_pending: AtomicBool,
    wake: Mutex<IpcSender<()>>,
    watched: Mutex<HashMap<u64, Watched>>,
    spares: Mutex<Vec<(u64, IpcSender<Control>)>>,
    /// Set once this process grants a lease: only then are spare lease channels kept.
    granting: AtomicBool,
}

const SPARE_LEASES: usize = 64;

fn reaper() -> Result<&'static Reaper> {
    static REAPER: OnceCell<Reaper> = OnceCell::new();
    REAPER.get_or_try_init(|| {
        raise_descriptor_limit();
        let (wake, wake_rx) = ipc::channel::<()>()?;
        let mut set = IpcReceiverSet::new()?;
        let wake_id = set.add(wake_rx)?;
        let watched = HashMap::new();
        std::thread::Builder::new().name("cuda-mp-reaper".into()).spawn(move || reap(set, wake_id))?;
        Ok(Reaper {
            pending: Mutex::new(Vec::new()),
            wake_pending: AtomicBool::new(false),
            wake: Mutex::new(wake),
            watched: Mutex::new(watched),
            spares: Mutex::new(Vec::new()),
            granting: AtomicBool::new(false),
        })
    })
}

impl Reaper {
    fn watch(&self, what: Watched, rx: ipc::OpaqueIpcReceiver) {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).push((what, rx));
        self.wake();
    }

    fn wake(&self) {
        if !self.wake_pending.swap(true, Ordering::SeqCst) {
            // The reaper thread lives as long as the process, so the wake channel is open.
            let _ = self.wake.lock().unwrap_or_else(|p| p.into_inner()).send(());
        }
    }

    /// A lease channel for `id`: a spare one already watched when there is one (no system call
    /// on the send path), else a new one.
    fn new_lease(&self, id: StorageId) -> Result<Lease> {
        self.granting.store(true, Ordering::Relaxed);
        let spare = {
            let mut spares = self.spares.lock().unwrap_or_else(|p| p.into_inner());
            let spare = spares.pop();
            if spares.len() < SPARE_LEASES / 4 {
                self.wake();
            }
            spare
        };
        if let Some((set_id, tx)) = spare {
            self.watched.lock().unwrap_or_else(|p| p.into_inner()).insert(set_id, Watched::Lease(id));
            return Ok(Lease(tx));
        }
        let (tx, rx) = ipc::channel::<Control>()?;
        self.watch(Watched::Lease(id), rx.to_opaque());
        Ok(Lease(tx))
    }
}

fn reap(mut set: IpcReceiverSet, wake_id: u64) {
    let Ok(reaper) = reaper() else { return };
    loop {
        let events = match set.select() {
            Ok(events) => events,
            Err(e) => {
                eprintln!("cuda-mp: lease watcher failed, leases are no longer released: {e}");
                return;
            }
        };
        for event in events {
            match event {
                IpcSelectionResult::MessageReceived(id, _) if id == wake_id => {
                    reaper.wake_pending.store(false, Ordering::SeqCst);
                }
                IpcSelectionResult::MessageReceived(id, message) => {
                    let what = reaper.watched.lock().unwrap_or_else(|p| p.into_inner()).get(&id).copied();
                    match what {
                        Some(Watched::Lease(_)) => {
                            if let Ok(Control::Link { revocations }) = message.to::<Control>() {
                                let mut o = owner();
                                if let Some(table) = &o.table {
                                    if revocations.send(Revocation::Table(table.shm.clone())).is_ok() {
                                        o.subscribers.push(revocations);
                                    }
                                }
                            }
                        }
                        Some(Watched::Revocations(owner)) => match message.to::<Revocation>() {
                            Ok(Revocation::Table(table)) => table_arrived(owner, Table::new(table)),
                            Ok(Revocation::Storage(index)) => revoke(owner, Some(index)),
                            Err(_) => {}
                        },
                        // Anything else is forged or stale: ignored.
                        _ => {}
                    }
                }
                IpcSelectionResult::ChannelClosed(id) => {
                    let what = reaper.watched.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
                    match what {
                        Some(Watched::Lease(storage)) => release_lease(storage),
                        Some(Watched::Revocations(owner)) => {
                            // The owner is gone: its storages with it.
                            state().owner_tables.remove(&owner);
                            revoke(owner, None);
                        }
                        _ => {}
                    }
                }
            }
        }
        let pending = std::mem::take(&mut *reaper.pending.lock().unwrap_or_else(|p| p.into_inner()));
        for (what, rx) in pending {
            match set.add_opaque(rx) {
                Ok(id) => {
                    reaper.watched.lock().unwrap_or_else(|p| p.into_inner()).insert(id, what);
                }
                // Cannot watch it (out of descriptors): release now rather than leak forever.
                Err(_) => {
                    if let Watched::Lease(storage) = what {
                        release_lease(storage)
                    }
                }
            }
        }
        refill_spares(reaper, &mut set);
    }
}

/// Every lease is a descriptor: lift the soft limit on descriptors to the hard limit, as
/// servers that hold many sockets do.
fn raise_descriptor_limit() {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `limit` is a valid, writable rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 && limit.rlim_cur < limit.rlim_max {
        limit.rlim_cur = limit.rlim_max;
        // SAFETY: `limit` is a valid rlimit; raising the soft limit up to the hard one is allowed.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
    }
}

fn refill_spares(reaper: &Reaper, set: &mut IpcReceiverSet) {
    if !reaper.granting.load(Ordering::Relaxed) {
        return;
    }
    let missing = SPARE_LEASES.saturating_sub(reaper.spares.lock().unwrap_or_else(|p| p.into_inner()).len());
    for _ in 0..missing {
        let Ok((tx, rx)) = ipc::channel::<Control>() else { return };
        let Ok(id) = set.add(rx) else { return };
        reaper.watched.lock().unwrap_or_else(|p| p.into_inner()).insert(id, Watched::Spare);
        reaper.spares.lock().unwrap_or_else(|p| p.into_inner()).push((id, tx));
    }
}
