//! The owner registry: storages of this process that other processes may hold, the claims on
//! them per lease, and limbo (memory kept after this process's own handles are gone).

use std::sync::{Arc, Weak};

use super::connection::{Connection, ConnectionKey, Introduction, Slot};
use super::lease::{CacheTicket, Claim, Cover, Lease, LeaseMode};
use super::table::{NO_SLOT, owner};
use super::{AnyStorage, State, StorageId, WeakStorage, notify, reaper, state};
use crate::error::Result;
use crate::wire;

pub(super) struct Exported {
    /// The memory, kept while any claim is open (limbo once the user handles are gone).
    keep_alive: AnyStorage,
    /// The user handle a message coming back to this process resolves to while it lives.
    handle: Option<WeakStorage>,
    /// Claims over every lease.
    claims: usize,
    /// Slot in this process's liveness table, or [`NO_SLOT`].
    slot: u32,
    /// Per-storage mode: this process's copy of the storage's lease, cloned into every message
    /// and dropped when its handles are gone (or, in a forked child, closed: see
    /// `close_inherited_leases`).
    pub(super) shared_lease: Option<Lease>,
    /// For a relay (a storage of another process that this one forwarded: `forward`): that
    /// storage. `keep_alive` is then this process's own claim on it.
    relay_of: Option<StorageId>,
    /// For a relay: the leases its own claim depends on (the forwarder's cover's anchors and
    /// lease when the relay was made), given to every holder it relays to.
    relay_chain: Vec<Lease>,
    /// The storage's size (for the holders' statistics).
    bytes: u64,
}

/// Counts one live storage of this process from construction to drop. Embed one in every
/// storage this process allocates. It also tells a storage that a forked child inherited from
/// its parent, which the child neither counts nor may share.
#[derive(Debug)]
pub(crate) struct LiveStorage {
    generation: u64,
    /// False for a caching allocator's segment, which is not one of the user's storages.
    counted: bool,
}

impl LiveStorage {
    pub(crate) fn new(counted: bool) -> LiveStorage {
        if counted {
            state().stats.live_storages += 1;
        }
        LiveStorage { generation: crate::fork::generation(), counted }
    }

    /// False in a forked child for a storage its parent allocated before the fork.
    pub(crate) fn is_this_process(&self) -> bool {
        self.generation == crate::fork::generation()
    }
}

impl Drop for LiveStorage {
    fn drop(&mut self) {
        if !self.is_this_process() || !self.counted {
            // The parent's storage, counted in the parent; or an allocator's segment.
            return;
        }
        {
            let mut s = state();
            s.stats.live_storages -= 1;
            s.stats.freed_storages += 1;
        }
        notify();
    }
}

/// A claim for one outgoing message, and for cacheable kinds the storage's slot in the
/// liveness table.
#[derive(Debug)]
pub(crate) struct Grant {
    pub(crate) claim: Claim,
    pub(crate) ticket: Option<CacheTicket>,
}

/// Grants a claim on local storage `id` for the message being encoded. Until it is released
/// the storage's memory (`keep_alive`) stays here, whatever this process does with its own
/// handles (limbo). `handle` is the user handle that a message coming back resolves to.
/// `cache` asks for a slot in the liveness table, so that receivers may keep their mapping
/// after use while this process holds the storage.
/// On a channel the claim is counted on the connection's lease, whatever `mode` (README.md,
/// "Leases and claims").
pub(crate) fn grant(
    id: StorageId,
    bytes: usize,
    mode: LeaseMode,
    cache: bool,
    keep_alive: impl FnOnce() -> AnyStorage,
    handle: Option<WeakStorage>,
) -> Result<Grant> {
    tracing::trace!(storage = %id, "exporting a storage");
    let reaper = reaper::reaper()?;
    let bytes = bytes as u64;
    if let Some(connection) = wire::connection() {
        return grant_on_connection(reaper, &connection, (id, bytes), cache, keep_alive, handle);
    }
    let grant = match mode {
        LeaseMode::Shared => {
            let mut s = state();
            if let Some(e) = s.exported.get(&id)
                && let Some(lease) = &e.shared_lease
            {
                let ticket = ticket(cache, || e.slot);
                return Ok(Grant { claim: Claim::Lease { lease: lease.clone(), counted: false }, ticket });
            }
            let lease = reaper.new_lease()?;
            if id.is_internal() {
                // A caching allocator's segment: not one of the user's storages.
                s.uncounted_leases.insert(lease.key());
            } else {
                opened_lease(&mut s);
            }
            s.shared_leases.insert(lease.key());
            let entry = claim(&mut s, (id, bytes), lease.key(), keep_alive, handle);
            entry.shared_lease = Some(lease.clone());
            let ticket = ticket(cache, || slot_of(entry, id));
            Grant { claim: Claim::Lease { lease, counted: false }, ticket }
        }
        LeaseMode::Counted => {
            let lease = message_lease(reaper)?;
            let mut s = state();
            let entry = claim(&mut s, (id, bytes), lease.key(), keep_alive, handle);
            let ticket = ticket(cache, || slot_of(entry, id));
            Grant { claim: Claim::Lease { lease, counted: true }, ticket }
        }
    };
    notify();
    Ok(grant)
}

/// A claim counted on this process's lease on the channel the message is encoded for.
fn grant_on_connection(
    reaper: &'static reaper::Reaper,
    connection: &Connection,
    (id, bytes): (StorageId, u64),
    cache: bool,
    keep_alive: impl FnOnce() -> AnyStorage,
    handle: Option<WeakStorage>,
) -> Result<Grant> {
    let mut s = state();
    let (key, name, unsent) = connection_lease(&mut s, reaper, connection)?;
    let entry = claim(&mut s, (id, bytes), key, keep_alive, handle);
    let ticket = ticket(cache, || slot_of(entry, id));
    drop(s);
    notify();
    Ok(Grant { claim: connection_claim(key, name, unsent, id.index(), Vec::new()), ticket })
}

/// The connection's lease `(key, name, the lease while no frame has introduced it)`: made on
/// the connection's first message (or after the last one closed), and introduced by the frame
/// until one that does has been written.
fn connection_lease(
    s: &mut State,
    reaper: &'static reaper::Reaper,
    connection: &Connection,
) -> Result<(u64, u64, Option<Lease>)> {
    let mut slot = connection.lock();
    Ok(match slot.as_ref() {
        // Open as long as the owner counts claims on it (the reaper has not seen it close).
        Some(current) if s.covers.contains_key(&current.key) => (current.key, current.name, current.unsent.clone()),
        _ => {
            let lease = reaper.new_lease()?;
            opened_lease(s);
            s.covers.insert(lease.key(), Default::default());
            let name = crate::sys::random_u128() as u64;
            *slot = Some(Slot { key: lease.key(), name, unsent: Some(lease.clone()) });
            (lease.key(), name, Some(lease))
        }
    })
}

/// Lists a claim on entry `index` of connection lease `key` with the message being encoded.
fn connection_claim(key: u64, name: u64, unsent: Option<Lease>, index: u64, anchors: Vec<Lease>) -> Claim {
    let name = ConnectionKey { owner: super::process_token(), key: name };
    wire::connection_claim(key, index, unsent.map(|lease| Introduction { name, lease }), name.key);
    Claim::Connection { name, index, anchors }
}

/// The claim to send with a storage of another process that this one holds through `cover`: a
/// counted claim inside a message is relayed (`Cover::chain`), otherwise the forwarder's lease
/// travels itself (`Cover::forward`). README.md, "Leases and claims".
pub(crate) fn forward(cover: &Cover, bytes: usize) -> Result<Claim> {
    if !cover.is_counted() {
        return Ok(cover.forward());
    }
    let connection = wire::connection();
    if connection.is_none() && !wire::in_message() {
        return Ok(cover.forward());
    }
    let reaper = reaper::reaper()?;
    let counting = match connection {
        Some(connection) => Counting::Connection(connection),
        None => Counting::Message(message_lease(reaper)?),
    };
    relay(reaper, &counting, cover, bytes as u64)
}

/// The lease of the message being encoded, made on its first counted claim (outside channels).
fn message_lease(reaper: &'static reaper::Reaper) -> Result<Lease> {
    wire::per_message(|| {
        let lease = reaper.new_lease()?;
        opened_lease(&mut state());
        Ok(lease)
    })
}

/// Where a relay counts the claims of the holders a message makes.
enum Counting {
    /// This process's lease on the channel the message is encoded for.
    Connection(Arc<Connection>),
    /// The lease of the message (outside a channel).
    Message(Lease),
}

/// A relayed claim's lease as the message gives it: named (a connection's, introduced by the
/// frame while `unsent`), or carried.
enum ToSend {
    Named(u64, Option<Lease>),
    Lease(Lease),
}

fn relay(reaper: &'static reaper::Reaper, counting: &Counting, cover: &Cover, bytes: u64) -> Result<Claim> {
    let id = cover.id();
    // This process's own claim for a new relay, made outside the lock (its `Retain` is posted
    // to the courier); dropped (released) if another send made the relay meanwhile.
    let mut hold = None;
    loop {
        let mut s = state();
        let known = s.relays.get(&id).copied();
        if known.is_none() && hold.is_none() {
            drop(s);
            hold = Some(cover.retain());
            continue;
        }
        let relay = known.unwrap_or_else(StorageId::new_local);
        // The lease key, and the claim to send but for its entry and anchors.
        let (key, to_send) = match counting {
            Counting::Connection(connection) => {
                let (key, name, unsent) = connection_lease(&mut s, reaper, connection)?;
                (key, ToSend::Named(name, unsent))
            }
            Counting::Message(lease) => (lease.key(), ToSend::Lease(lease.clone())),
        };
        let entry =
            claim(&mut s, (relay, bytes), key, || Arc::new(hold.take().expect("a new relay has its claim")), None);
        if known.is_none() {
            entry.relay_of = Some(id);
            entry.relay_chain = cover.chain();
        }
        let chain = entry.relay_chain.clone();
        s.relays.insert(id, relay);
        drop(s);
        drop(hold);
        notify();
        return Ok(match to_send {
            ToSend::Named(name, unsent) => connection_claim(key, name, unsent, relay.index(), chain),
            ToSend::Lease(lease) => Claim::Relayed { lease, index: relay.index(), anchors: chain },
        });
    }
}

/// Takes back claims granted for a message that was not sent after all (its encode or its
/// write failed): `(lease key, storage index)`, one claim each.
pub(crate) fn withdraw(claims: &[(u64, u64)]) {
    for &(key, index) in claims {
        lease_message(key, index, Change::Release(1));
    }
}

fn opened_lease(s: &mut State) {
    s.stats.outstanding_leases += 1;
    s.stats.leases_granted += 1;
}

fn claim(
    s: &mut State,
    (id, bytes): (StorageId, u64),
    lease: u64,
    keep_alive: impl FnOnce() -> AnyStorage,
    handle: Option<WeakStorage>,
) -> &mut Exported {
    *s.covers.entry(lease).or_default().entry(id.index()).or_insert(0) += 1;
    let entry = s.exported.entry(id).or_insert_with(|| Exported {
        keep_alive: keep_alive(),
        handle,
        claims: 0,
        slot: NO_SLOT,
        shared_lease: None,
        relay_of: None,
        relay_chain: Vec::new(),
        bytes,
    });
    entry.claims += 1;
    entry
}

/// The ticket of a grant that receivers may cache: none without a slot in this process's
/// liveness table (a full table), since receivers could not tell when the storage is gone
/// (and a segment without one travels whole rather than being kept by the channel end).
fn ticket(cache: bool, slot: impl FnOnce() -> u32) -> Option<CacheTicket> {
    cache.then(slot).filter(|&slot| slot != NO_SLOT).map(|slot| CacheTicket { slot })
}

fn slot_of(entry: &mut Exported, id: StorageId) -> u32 {
    if entry.slot == NO_SLOT {
        entry.slot = owner().take_slot(id);
    }
    entry.slot
}

/// This process dropped its last handle on local storage `id`: receivers may no longer keep
/// idle mappings of it. The memory itself stays until the last claim is released.
pub(crate) fn handles_dropped(id: StorageId) {
    let (slot, shared_lease) = match state().exported.get_mut(&id) {
        // A message that came back made a new handle (`revive_local`) before this drop got
        // here: that one holds the storage now, and its slot stays marked.
        Some(e) if e.handle.as_ref().is_some_and(|h| h.strong_count() > 0) => return,
        Some(e) => (e.slot, e.shared_lease.take()),
        None => return,
    };
    // This process's copy of the shared lease goes: the claim ends when the holders' copies do.
    drop(shared_lease);
    if slot != NO_SLOT {
        // Told after the owner lock, through the courier (which never makes this wait): a
        // receiver that checks the cleared slot after missing it sees the storage dead.
        let subscribers = owner().revoke(slot, id.index());
        super::courier::revoke(subscribers, id.index());
    }
}

/// What a holder says about one storage on a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Change {
    /// It drops this many claims.
    Release(u64),
    /// It passes one claim on to another process.
    Retain,
}

/// A record on lease `lease` of this process about storage `index`: what the lease does not
/// hold, and any record on a per-storage lease, is ignored (README.md, "Leases and claims").
pub(super) fn lease_message(lease: u64, index: u64, change: Change) {
    let mut s = state();
    if s.shared_leases.contains(&lease) {
        return;
    }
    let Some(count) = s.covers.get_mut(&lease).and_then(|c| c.get_mut(&index)) else { return };
    if *count == 0 {
        return;
    }
    let n = match change {
        Change::Retain => {
            *count += 1;
            if let Some(e) = s.exported.get_mut(&StorageId::local(index)) {
                e.claims += 1;
            }
            return;
        }
        Change::Release(n) => n.min(*count as u64) as usize,
    };
    *count -= n;
    if *count == 0
        && let Some(c) = s.covers.get_mut(&lease)
    {
        c.remove(&index);
    }
    release(s, &[(index, n)]);
}

/// Lease channel `lease` closed: every claim still on it is released.
pub(super) fn lease_closed(lease: u64) {
    let mut s = state();
    if !s.uncounted_leases.remove(&lease) {
        s.stats.outstanding_leases -= 1;
        s.stats.leases_released += 1;
    }
    s.shared_leases.remove(&lease);
    let claims: Vec<(u64, usize)> = s.covers.remove(&lease).map(|c| c.into_iter().collect()).unwrap_or_default();
    release(s, &claims);
    if !claims.is_empty() {
        // Its holders' copies all closed with claims on it: they exited (or were killed)
        // holding what it covers. Logged outside the lock.
        tracing::debug!(lease, storages = claims.len(), "reclaimed the storages of a lease whose holders are gone");
    }
}

/// Releases claims; frees storages whose last claim went, outside the lock.
fn release(mut s: std::sync::MutexGuard<'static, State>, claims: &[(u64, usize)]) {
    let mut freed = Vec::new();
    let mut relays = Vec::new();
    for &(index, n) in claims {
        let id = StorageId::local(index);
        let Some(e) = s.exported.get_mut(&id) else { continue };
        e.claims = e.claims.saturating_sub(n);
        if e.claims == 0 {
            match s.exported.remove(&id) {
                Some(e @ Exported { relay_of: Some(of), .. }) => {
                    s.relays.remove(&of);
                    relays.push(e);
                }
                Some(e) => freed.push(e),
                None => {}
            }
        }
    }
    s.freeing += freed.len();
    drop(s);
    // A relay's end only releases this process's own claim (through the courier).
    drop(relays);
    if !freed.is_empty() {
        {
            let mut o = owner();
            for e in &freed {
                o.free_slot(e.slot);
            }
        }
        // Freeing may call into the driver (and wait for the device): outside the lock, and
        // off the reaper's thread.
        super::courier::dispose(move || {
            let n = freed.len();
            drop(freed);
            state().freeing -= n;
            notify();
        });
    }
    notify();
}

/// A local storage named by a message that came back to this process: the live user handle if
/// there is one, else the storage's memory (to wrap in a new handle), while it is claimed.
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
pub(crate) fn revive_local(id: StorageId, handle: &AnyStorage) {
    let mut s = state();
    if let Some(e) = s.exported.get_mut(&id) {
        e.handle = Some(Arc::downgrade(handle));
        if e.slot != NO_SLOT {
            owner().mark(e.slot, id.index());
        }
    }
}

/// What other processes hold of this process's storages through one lease.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HolderStats {
    /// The lease, by a number of this process's own: on a channel, one per channel and
    /// sending process (all the processes that hold its receiving end); outside channels, one
    /// per message, or one per GPU storage shared by all its holders.
    pub lease: u64,
    /// This process's storages held through it (relays of storages it forwarded included).
    pub storages: usize,
    /// Claims on them (a storage received twice and not dropped counts twice).
    pub claims: usize,
    /// Bytes of those storages.
    pub bytes: u64,
}

/// What other processes hold of this process's storages, per lease they hold them through,
/// most bytes first: who keeps this process's memory alive. A caching allocator's segments
/// are not counted (their blocks are).
///
/// ```
/// let held: u64 = cuda_mp::holder_stats().iter().map(|h| h.bytes).sum();
/// assert_eq!(held, 0, "nothing sent yet");
/// ```
pub fn holder_stats() -> Vec<HolderStats> {
    let s = state();
    let mut holders: Vec<HolderStats> = s
        .covers
        .iter()
        .map(|(&lease, claims)| {
            let mut holder = HolderStats { lease, storages: 0, claims: 0, bytes: 0 };
            for (&index, &count) in claims {
                let id = StorageId::local(index);
                // Neither this process's segments nor its relays of another's count.
                let counts = |e: &&Exported| !id.is_internal() && !e.relay_of.is_some_and(|of| of.is_internal());
                let Some(entry) = s.exported.get(&id).filter(|e| count > 0 && counts(e)) else { continue };
                holder.storages += 1;
                holder.claims += count;
                holder.bytes += entry.bytes;
            }
            holder
        })
        .filter(|h| h.storages > 0)
        .collect();
    drop(s);
    holders.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.lease.cmp(&b.lease)));
    holders
}

#[cfg(test)]
mod tickets {
    use super::*;

    /// A full liveness table gives no slot: such a grant carries no ticket, so that receivers
    /// do not cache it and a segment travels whole instead of being introduced to be kept.
    #[test]
    fn a_grant_without_a_slot_has_no_ticket() {
        assert_eq!(ticket(true, || NO_SLOT).map(|t| t.slot), None);
        assert_eq!(ticket(true, || 7).map(|t| t.slot), Some(7));
        assert_eq!(ticket(false, || unreachable!("no slot taken for what is not cached")).map(|t| t.slot), None);
    }
}
