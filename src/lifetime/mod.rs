//! Cross-process lifetime of shared storage: leases, limbo and the reaper. See README.md here.

use std::any::Any;
use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use ipc_channel::ipc::{self, IpcReceiver, IpcReceiverSet, IpcSelectionResult, IpcSender};
use once_cell::sync::Lazy;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A storage as the lifetime machinery sees it: anything shareable, kept alive by `Arc`.
pub(crate) type AnyStorage = Arc<dyn Any + Send + Sync>;

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
pub(crate) struct Lease(IpcSender<()>);

/// Counters of the lifetime machinery in this process, for tests and monitoring.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LifetimeStats {
    /// Storages allocated by this process that are not yet freed.
    pub live_storages: usize,
    /// Storages allocated by this process and freed since it started.
    pub freed_storages: u64,
    /// Storages of this process held alive for other processes (in limbo or still in use here).
    pub exported_storages: usize,
    /// Leases of this process's storages held by other processes or by messages in flight.
    pub outstanding_leases: usize,
    /// Leases granted since the process started (one per storage per message sent).
    pub leases_granted: u64,
    /// Leases released since the process started (dropped, or reclaimed from dead processes).
    pub leases_released: u64,
    /// Storages of other processes mapped in this process.
    pub imported_storages: usize,
}

struct Exported {
    keep_alive: AnyStorage,
    leases: usize,
}

#[derive(Default)]
struct State {
    exported: HashMap<StorageId, Exported>,
    imported: HashMap<(StorageId, &'static str), Weak<dyn Any + Send + Sync>>,
    stats: LifetimeStats,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

static SHARED: Lazy<Shared> = Lazy::new(|| Shared { state: Mutex::new(State::default()), changed: Condvar::new() });

fn state() -> MutexGuard<'static, State> {
    // A panic while holding the lock cannot leave the maps inconsistent (every update is a
    // single insert, remove or counter change), so a poisoned lock is still usable.
    SHARED.state.lock().unwrap_or_else(|p| p.into_inner())
}

fn notify() {
    SHARED.changed.notify_all();
}

/// Current counters.
pub fn lifetime_stats() -> LifetimeStats {
    let s = state();
    let mut stats = s.stats;
    stats.exported_storages = s.exported.len();
    stats.imported_storages = s.imported.values().filter(|w| w.strong_count() > 0).count();
    stats
}

/// Waits until `condition` holds for the counters, or `timeout` passes. Wakes on every change
/// (a storage freed, a lease granted or released), never by polling.
pub fn wait_for_lifetime(timeout: Duration, condition: impl Fn(&LifetimeStats) -> bool) -> Result<LifetimeStats> {
    let deadline = Instant::now() + timeout;
    let mut guard = state();
    loop {
        let mut stats = guard.stats;
        stats.exported_storages = guard.exported.len();
        stats.imported_storages = guard.imported.values().filter(|w| w.strong_count() > 0).count();
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

/// Grants a lease on a local storage for one outgoing message. Until that lease is released
/// the storage is kept alive here, whatever this process does with its own handles (limbo).
pub(crate) fn grant_lease(id: StorageId, storage: impl FnOnce() -> AnyStorage) -> Result<Lease> {
    let (tx, rx) = ipc::channel::<()>()?;
    {
        let mut s = state();
        s.exported.entry(id).or_insert_with(|| Exported { keep_alive: storage(), leases: 0 }).leases += 1;
        s.stats.outstanding_leases += 1;
        s.stats.leases_granted += 1;
    }
    reaper()?.watch(id, rx);
    notify();
    Ok(Lease(tx))
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
            s.exported.remove(&id).map(|e| e.keep_alive)
        } else {
            None
        }
    };
    // Freeing may call into the driver: do it outside the lock.
    drop(dropped);
    notify();
}

/// The local storage `id`, when it is alive and leased (a message this process sent came back).
pub(crate) fn local_storage(id: StorageId) -> Option<AnyStorage> {
    state().exported.get(&id).map(|e| e.keep_alive.clone())
}

/// The storage `id` of another process as mapped here: the existing mapping when this process
/// already holds one (a storage is mapped once per process), else the one `open` makes.
/// `open` runs under the import lock, so a mapping is never opened while another is closing.
pub(crate) fn import<S: Any + Send + Sync>(
    id: StorageId,
    kind: &'static str,
    open: impl FnOnce() -> Result<Arc<S>>,
) -> Result<Arc<S>> {
    let mut s = state();
    if let Some(existing) = s.imported.get(&(id, kind)).and_then(Weak::upgrade) {
        if let Ok(storage) = existing.downcast::<S>() {
            return Ok(storage);
        }
    }
    let storage = open()?;
    let as_any: AnyStorage = storage.clone();
    s.imported.insert((id, kind), Arc::downgrade(&as_any));
    drop(s);
    notify();
    Ok(storage)
}

/// Runs `close` for an imported storage that is being dropped, under the import lock, and
/// forgets the mapping unless a newer one replaced it.
pub(crate) fn close_import(id: StorageId, kind: &'static str, close: impl FnOnce()) {
    {
        let mut s = state();
        close();
        if s.imported.get(&(id, kind)).is_some_and(|w| w.strong_count() == 0) {
            s.imported.remove(&(id, kind));
        }
    }
    notify();
}

/// Watches the receiving ends of granted leases and releases a lease when its channel closes.
struct Reaper {
    pending: Mutex<Vec<(StorageId, IpcReceiver<()>)>>,
    wake_pending: AtomicBool,
    wake: Mutex<IpcSender<()>>,
}

fn reaper() -> Result<&'static Reaper> {
    static REAPER: once_cell::sync::OnceCell<Reaper> = once_cell::sync::OnceCell::new();
    REAPER.get_or_try_init(|| {
        let (wake, wake_rx) = ipc::channel::<()>()?;
        let mut set = IpcReceiverSet::new()?;
        let wake_id = set.add(wake_rx)?;
        std::thread::Builder::new().name("cuda-mp-reaper".into()).spawn(move || reap(set, wake_id))?;
        Ok(Reaper { pending: Mutex::new(Vec::new()), wake_pending: AtomicBool::new(false), wake: Mutex::new(wake) })
    })
}

impl Reaper {
    fn watch(&self, id: StorageId, rx: IpcReceiver<()>) {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).push((id, rx));
        if !self.wake_pending.swap(true, Ordering::SeqCst) {
            // The reaper thread lives as long as the process, so the wake channel is open.
            let _ = self.wake.lock().unwrap_or_else(|p| p.into_inner()).send(());
        }
    }

    fn take_pending(&self) -> Vec<(StorageId, IpcReceiver<()>)> {
        std::mem::take(&mut *self.pending.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

fn reap(mut set: IpcReceiverSet, wake_id: u64) {
    let mut watched: HashMap<u64, StorageId> = HashMap::new();
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
                // Nothing is ever sent on a lease; a forged message on one is ignored.
                IpcSelectionResult::MessageReceived(..) => {}
                IpcSelectionResult::ChannelClosed(id) => {
                    if let Some(storage) = watched.remove(&id) {
                        release_lease(storage);
                    }
                }
            }
        }
        for (storage, rx) in reaper.take_pending() {
            match set.add(rx) {
                Ok(id) => {
                    watched.insert(id, storage);
                }
                // Cannot watch it (out of descriptors): release now rather than leak forever.
                Err(_) => release_lease(storage),
            }
        }
    }
}
