//! The import table and the idle cache: other processes' storages mapped here, each once per
//! process, opened and closed outside the lock.

use std::any::Any;
use std::collections::HashSet;
use std::sync::{Arc, Weak};
use std::thread::ThreadId;

use super::lease::{CacheTicket, Cover, Lease};
use super::table::{NO_SLOT, Table};
use super::{AnyStorage, ImportKey, State, StorageId, notify, reaper, state, wait};
use crate::error::{Error, Result};

/// The storage `id` of another process as mapped here, under import key `kind`: the handle in
/// use, else a cached idle mapping passed to `revive`, else the one `open` makes.
///
/// `open` runs outside the lock; only an import of the same storage waits for it, or for its
/// close (README.md, "States of a storage").
pub(crate) fn import<H: Any + Send + Sync>(
    id: StorageId,
    kind: &'static str,
    revive: impl FnOnce(AnyStorage) -> Option<Arc<H>>,
    open: impl FnOnce() -> Result<Arc<H>>,
) -> Result<Arc<H>> {
    let key: ImportKey = (id, kind);
    let me = std::thread::current().id();
    let mut s = state();
    // Wait while the storage is being opened or closed, or while its last handle is being
    // dropped (it is about to be cached or closed).
    loop {
        if let Some(&opener) = s.opening.get(&key) {
            // An open that (through the opens it waits for) waits for this thread would wait
            // for ever: forged block records naming themselves, or each other, as segments.
            if waits_for(&s, opener, me) {
                s.waiting.remove(&me);
                return Err(Error::Malformed(format!("a record of storage {id} needs that storage to open it")));
            }
        } else if !(s.closing.contains_key(&key) || s.imported.get(&key).is_some_and(|w| w.strong_count() == 0)) {
            break;
        }
        s.waiting.insert(me, key);
        s = wait(s, None);
    }
    s.waiting.remove(&me);
    if let Some(existing) = s.imported.get(&key).and_then(Weak::upgrade)
        && let Ok(handle) = existing.downcast::<H>()
    {
        return Ok(handle);
    }
    if let Some(handle) = s.idle.remove(&key).and_then(|(memory, _)| revive(memory)) {
        let any: AnyStorage = handle.clone();
        s.imported.insert(key, Arc::downgrade(&any));
        drop(s);
        notify();
        return Ok(handle);
    }
    s.opening.insert(key, me);
    drop(s);
    // Unmarks the key however `open` ends: a panic in it must not leave every later import of
    // the storage waiting for ever.
    let mark = Opening(key);
    let started = std::time::Instant::now();
    let opened = open();
    let took = started.elapsed();
    match &opened {
        Ok(_) if took >= SLOW_OPEN => {
            tracing::warn!(storage = %id, kind, took_ms = took.as_millis() as u64, "opening a mapping was slow")
        }
        Ok(_) => tracing::debug!(storage = %id, kind, took_us = took.as_micros() as u64, "opened a mapping"),
        Err(e) => tracing::warn!(storage = %id, kind, error = %e, "could not open a mapping"),
    }
    let mut s = state();
    if let Ok(handle) = &opened {
        let any: AnyStorage = handle.clone();
        s.imported.insert(key, Arc::downgrade(&any));
        if id.is_internal() {
            s.stats.opened_segments += 1;
        } else {
            s.stats.opened_mappings += 1;
        }
    }
    drop(s);
    drop(mark);
    opened
}

/// Whether `opener` (the thread opening a storage) waits, through the chain of opens each
/// thread waits for, for thread `me`.
fn waits_for(s: &State, opener: ThreadId, me: ThreadId) -> bool {
    let mut thread = opener;
    // A chain is at most as long as the threads waiting; the bound keeps a bug from looping.
    for _ in 0..=s.waiting.len() {
        if thread == me {
            return true;
        }
        match s.waiting.get(&thread).and_then(|key| s.opening.get(key)) {
            Some(&next) => thread = next,
            None => return false,
        }
    }
    false
}

/// An open of a mapping that takes this long is reported (`warn`): mappings open in
/// microseconds to a few milliseconds, so this is a device or process in trouble.
const SLOW_OPEN: std::time::Duration = std::time::Duration::from_millis(100);

/// A storage being opened by this thread: the `opening` mark, removed (and waiters woken) when
/// dropped, after the import table was updated.
struct Opening(ImportKey);

impl Drop for Opening {
    fn drop(&mut self) {
        state().opening.remove(&self.0);
        notify();
    }
}

/// Subscribes to revocations from the owner of `id` (once per owner), through a lease on one of
/// its storages, so that mappings of its storages can be cached after use.
pub(crate) fn subscribe(id: StorageId, lease: &Lease) {
    {
        // Marked (its table on its way) before the subscription is made, in one look: two
        // imports of a new owner's storages at once subscribe once.
        let mut s = state();
        if id.is_local() || s.owner_tables.contains_key(&id.owner()) {
            return;
        }
        s.owner_tables.insert(id.owner(), None);
    }
    if !reaper::subscribe(id.owner(), lease) {
        // No revocations will come: the mark goes (unless another subscription made it
        // since), and so do the mappings cached meanwhile.
        let owner = id.owner();
        let evicted = {
            let mut s = state();
            if matches!(s.owner_tables.get(&owner), Some(None)) {
                s.owner_tables.remove(&owner);
            }
            evict_owners(&mut s, owner)
        };
        dispose_evicted(evicted);
    }
}

/// The last user handle of an imported storage is gone. Keeps its mapping (`memory`) cached
/// when the owner still holds the storage; otherwise hands it back to be closed.
pub(crate) fn park_idle(
    id: StorageId,
    kind: &'static str,
    ticket: Option<CacheTicket>,
    memory: AnyStorage,
) -> Option<AnyStorage> {
    let key = (id, kind);
    let slot = ticket.map_or(NO_SLOT, |t| t.slot);
    let mut s = state();
    // Cache while the owner holds the storage; also while the owner's table is still on its
    // way (the mapping is checked when it arrives, or evicted if the owner goes away first).
    let keep = match s.owner_tables.get(&id.owner()) {
        Some(Some(table)) => table.holds(slot, id),
        Some(None) => slot != NO_SLOT,
        None => false,
    };
    // A mapping handed back to be closed stays in the import table (its handle dead) until
    // `close_import` marks it closing: a new import waits for the close meanwhile, rather than
    // opening a second mapping beside the one about to close.
    if keep && s.imported.get(&key).is_some_and(|w| w.strong_count() == 0) {
        s.imported.remove(&key);
    }
    let (result, replaced) = if keep {
        // A second mapping of the storage parked while one is cached: the older one is
        // closed, outside the lock (closing takes it).
        (None, s.idle.insert(key, (memory, slot)))
    } else {
        (Some(memory), None)
    };
    drop(s);
    drop(replaced);
    notify();
    result
}

/// Runs `close` for a mapping of another process's storage that is being dropped. Other
/// imports go on meanwhile; only a new import of the same storage waits for it.
pub(crate) fn close_import(id: StorageId, kind: &'static str, close: impl FnOnce()) {
    let key = (id, kind);
    {
        let mut s = state();
        if s.imported.get(&key).is_some_and(|w| w.strong_count() == 0) {
            s.imported.remove(&key);
        }
        s.mark_closing(key);
    }
    close();
    state().unmark_closing(&key);
    notify();
}

/// A claim whose release waits behind a fence (work queued on its memory, `Memory`'s drop):
/// counted until it is released, so that [`wait_for_releases`](super::wait_for_releases)
/// waits for it too.
pub(crate) struct DeferredRelease(Option<Cover>);

impl DeferredRelease {
    pub(crate) fn new(cover: Cover) -> DeferredRelease {
        state().deferred_releases += 1;
        DeferredRelease(Some(cover))
    }
}

impl Drop for DeferredRelease {
    fn drop(&mut self) {
        // The release is posted before the count goes down.
        drop(self.0.take());
        state().deferred_releases -= 1;
        notify();
    }
}

/// An owner's liveness table arrived: keep it, and evict the mappings cached while it was on
/// its way whose storages the owner no longer holds.
pub(super) fn table_arrived(owner: u128, table: Table) {
    let (evicted, tables) = {
        let mut s = state();
        let dead: Vec<ImportKey> = s
            .idle
            .iter()
            .filter(|((id, _), (_, slot))| id.owner() == owner && !table.holds(*slot, *id))
            .map(|(k, _)| *k)
            .collect();
        s.owner_tables.insert(owner, Some(table.clone()));
        (evict(&mut s, &dead), s.segment_tables.clone())
    };
    // Channel ends' segments the owner gave up before this process subscribed.
    in_segment_tables(tables, move |t| t.table_arrived(owner, &table));
    // Closing the mappings takes the lock again: outside it, and off the reaper's thread.
    dispose_evicted(evicted);
}

/// The owner dropped more storages than it could list (`Revocation::Recheck`): every cached
/// mapping and kept segment of it is checked against its table, as when the table arrived
/// (each slot was cleared before the storage's revocation was posted). The table comes first
/// on the socket, and one that does not map ends the subscription; without one all the same,
/// every cached mapping of the owner is closed (they are only a cache).
pub(super) fn recheck(owner: u128) {
    let table = state().owner_tables.get(&owner).cloned().flatten();
    match table {
        Some(table) => table_arrived(owner, table),
        None => {
            let evicted = evict_owners(&mut state(), owner);
            dispose_evicted(evicted);
        }
    }
}

/// Runs `take` on every channel end's segment table still alive and drops what it takes out:
/// after the state lock (a table's lock is never held while taking it), off the reaper's
/// thread (a table, or an end, may be dropped there last, and a GPU segment's unmap waits).
fn in_segment_tables(
    tables: Vec<super::connection::WeakSegments>,
    take: impl Fn(&super::KnownSegments) -> Vec<AnyStorage> + Send + 'static,
) {
    if tables.iter().any(|t| t.strong_count() > 0) {
        super::courier::dispose(move || {
            let taken: Vec<AnyStorage> = tables.iter().filter_map(|t| t.upgrade()).flat_map(|t| take(&t)).collect();
            drop(taken);
        });
    }
}

/// Takes every cached mapping of `owner`'s storages out of the idle cache, as [`evict`] does.
fn evict_owners(s: &mut State, owner: u128) -> Vec<(ImportKey, AnyStorage)> {
    let keys: Vec<ImportKey> = s.idle.keys().filter(|(id, _)| id.owner() == owner).copied().collect();
    evict(s, &keys)
}

/// Takes `keys` out of the idle cache, under the lock: each is marked closing (a new import of
/// it waits until it is closed) and still counts as cached until then.
fn evict(s: &mut State, keys: &[ImportKey]) -> Vec<(ImportKey, AnyStorage)> {
    let evicted: Vec<(ImportKey, AnyStorage)> =
        keys.iter().filter_map(|k| s.idle.remove(k).map(|(m, _)| (*k, m))).collect();
    s.evicting += evicted.len();
    for (k, _) in &evicted {
        s.mark_closing(*k);
    }
    evicted
}

/// Closes mappings that [`evict`] took: outside the lock, and off the reaper's thread, as
/// closing a GPU mapping waits for the device.
fn dispose_evicted(evicted: Vec<(ImportKey, AnyStorage)>) {
    if !evicted.is_empty() {
        super::courier::dispose(move || {
            let keys: Vec<ImportKey> = evicted.iter().map(|(k, _)| *k).collect();
            drop(evicted);
            let mut s = state();
            s.evicting -= keys.len();
            for k in &keys {
                s.unmark_closing(k);
            }
            drop(s);
            notify();
        });
    }
    notify();
}

/// The owner dropped these storages (or, for `None`, went away): evict cached mappings, in one
/// pass over the idle cache however many storages one revocation names.
pub(super) fn revoke(owner: u128, indices: Option<&[u64]>) {
    let indices: Option<HashSet<u64>> = indices.map(|i| i.iter().copied().collect());
    let (evicted, tables) = {
        let mut s = state();
        let keys: Vec<ImportKey> = s
            .idle
            .keys()
            .filter(|(id, _)| id.owner() == owner && indices.as_ref().is_none_or(|i| i.contains(&id.index())))
            .copied()
            .collect();
        (evict(&mut s, &keys), s.segment_tables.clone())
    };
    // Channel ends' segments given up, or of an owner gone.
    in_segment_tables(tables, move |t| t.revoke(owner, indices.as_ref()));
    if !evicted.is_empty() {
        tracing::debug!(
            owner = format_args!("{owner:032x}"),
            mappings = evicted.len(),
            "revoked: cached mappings closed"
        );
    }
    dispose_evicted(evicted);
}

/// The owner's revocation channel closed: it is gone, and its storages with it.
pub(super) fn owner_gone(owner: u128) {
    tracing::debug!(owner = format_args!("{owner:032x}"), "an owner of mapped storages is gone");
    state().owner_tables.remove(&owner);
    revoke(owner, None);
}
