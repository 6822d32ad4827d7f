//! Connection leases: one lease per channel and sending process, introduced by the first
//! frame that carries storages and named by later messages (README.md, "Leases and claims").

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use super::lease::{CacheTicket, Lease};
use super::table::NO_SLOT;
use super::{AnyStorage, StorageId, WeakStorage};
use crate::fork::ForkLocal;

/// A connection lease as a message names it: the owner's process token and the lease's name,
/// 64 random bits the owner chose for it (another sender on the channel cannot guess it, so it
/// cannot name this lease in claims or introductions of its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub(crate) struct ConnectionKey {
    pub(crate) owner: u128,
    pub(crate) key: u64,
}

/// The sending side, one per channel in each process: the key of this process's lease on the
/// channel and, until a frame that introduces it has been written, the lease itself.
#[derive(Default)]
pub(crate) struct Connection {
    slot: Mutex<Option<Slot>>,
    /// Caching allocators' segments a message of this process on the channel introduced
    /// (`KnownSegments`): later messages name them.
    segments: Mutex<SentSegments>,
}

/// The segments a connection introduced, each with a weak handle on this process's storage
/// of it (only to forget those gone: a segment named again after it was forgotten is
/// introduced again, which changes nothing but the message's size).
#[derive(Default)]
struct SentSegments {
    ids: rustc_hash::FxHashMap<StorageId, WeakStorage>,
    /// The size after the last sweep for segments gone here.
    swept: usize,
}

pub(super) struct Slot {
    pub(super) key: u64,
    /// The lease's name in messages ([`ConnectionKey::key`]).
    pub(super) name: u64,
    /// This process's copy of the lease's sending end, kept only until a frame introducing it
    /// is written: after that the receiver holds it, and a copy here would keep the lease open
    /// (and its claims alive) after the receiver died.
    pub(super) unsent: Option<Lease>,
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let slot = self.lock();
        f.debug_struct("Connection")
            .field("lease", &slot.as_ref().map(|s| s.key))
            .field("introduced", &slot.as_ref().map(|s| s.unsent.is_none()))
            .finish()
    }
}

/// Segments that receivers said they do not keep (`Control::Forget`), by the key of the lease
/// of the connection that introduced them, until that connection looks. Per process: a forked
/// child's connections are its own (and a lock its parent's reaper held at the fork would stay
/// held in the child).
static FORGOTTEN: ForkLocal<Mutex<Vec<(u64, u64)>>> = ForkLocal::new(Default::default);
/// Whether `FORGOTTEN` holds any (looked at without its lock on every block sent).
static ANY_FORGOTTEN: AtomicBool = AtomicBool::new(false);

/// Requests to introduce a segment again that one lease's connection keeps until it looks.
const FORGOTTEN_PER_LEASE: usize = 64;

/// A receiver says it does not keep segment `index`, introduced on the connection of the
/// lease `key` (its reaper read the record): the next block of it there introduces it again.
/// Entries of leases closed since are dropped as the list grows.
pub(super) fn forgotten(key: u64, index: u64) {
    // `FORGOTTEN` is taken last: which of its leases are still open is looked up first, under
    // the state lock alone.
    let full = FORGOTTEN.get().lock().unwrap_or_else(|p| p.into_inner()).len() >= 1024;
    let open: Option<std::collections::HashSet<u64>> = full.then(|| super::state().covers.keys().copied().collect());
    let mut forgotten = FORGOTTEN.get().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(open) = open {
        forgotten.retain(|(k, _)| open.contains(k));
    }
    // A lease's own share is bounded too (64 of the 1,024): one holder that floods its lease
    // with requests leaves room for the others' (sixteen that do fill the list).
    let of_this_lease = forgotten.iter().filter(|(k, _)| *k == key).count();
    if forgotten.len() < 1024 && of_this_lease < FORGOTTEN_PER_LEASE && !forgotten.contains(&(key, index)) {
        forgotten.push((key, index));
    }
    ANY_FORGOTTEN.store(!forgotten.is_empty(), Ordering::SeqCst);
}

/// True while `connection`'s lease is open (the owner still counts claims on it).
pub(crate) fn connection_open(connection: &Connection) -> bool {
    let key = connection.lock().as_ref().map(|s| s.key);
    key.is_some_and(|key| super::state().covers.contains_key(&key))
}

impl Connection {
    pub(super) fn lock(&self) -> MutexGuard<'_, Option<Slot>> {
        self.slot.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A frame introducing the lease named `name` was written: the receiver holds the lease
    /// from now on, and this process lets go of its copy.
    pub(crate) fn introduced(&self, name: u64) {
        if let Some(slot) = self.lock().as_mut().filter(|s| s.name == name) {
            slot.unsent = None;
        }
    }

    /// Whether a message of this process on the channel introduced segment `id`.
    pub(crate) fn knows_segment(&self, id: StorageId) -> bool {
        if ANY_FORGOTTEN.load(Ordering::Acquire) {
            self.take_forgotten();
        }
        self.segments.lock().unwrap_or_else(|p| p.into_inner()).ids.contains_key(&id)
    }

    /// Takes out the segments that the receiver said it does not keep (`forgotten`), so that
    /// the next block of each introduces it again.
    fn take_forgotten(&self) {
        let Some(key) = self.lock().as_ref().map(|s| s.key) else { return };
        let indices: Vec<u64> = {
            let mut forgotten = FORGOTTEN.get().lock().unwrap_or_else(|p| p.into_inner());
            let mine = forgotten.iter().filter(|(k, _)| *k == key).map(|(_, i)| *i).collect();
            forgotten.retain(|(k, _)| *k != key);
            if forgotten.is_empty() {
                ANY_FORGOTTEN.store(false, Ordering::SeqCst);
            }
            mine
        };
        if !indices.is_empty() {
            let mut sent = self.segments.lock().unwrap_or_else(|p| p.into_inner());
            for index in indices {
                sent.ids.remove(&StorageId::local(index));
            }
        }
    }

    /// A message introducing these segments was written: later messages may name them.
    pub(crate) fn segments_introduced(&self, segments: &[(StorageId, WeakStorage)]) {
        let mut sent = self.segments.lock().unwrap_or_else(|p| p.into_inner());
        sent.ids.extend(segments.iter().cloned());
        if sent.ids.len() >= SWEEP_AT.max(2 * sent.swept) {
            sent.ids.retain(|_, segment| segment.strong_count() > 0);
            sent.swept = sent.ids.len();
        }
    }

    /// A message that was to introduce the lease named `name` was not sent: while no frame has
    /// introduced it, the connection lets it go (the next message makes another), so that this
    /// process's copy does not keep it, and the claims of messages already sent with it, open
    /// for ever on a channel whose receiver never got it.
    pub(crate) fn not_introduced(&self, name: u64) {
        let mut slot = self.lock();
        if slot.as_ref().is_some_and(|s| s.name == name && s.unsent.is_some()) {
            *slot = None;
        }
    }
}

/// A lease a frame introduces: its name and its sending end (the frame's descriptor).
#[derive(Debug, Clone)]
pub(crate) struct Introduction {
    pub(crate) name: ConnectionKey,
    pub(crate) lease: Lease,
}

/// A segment a channel end brought along from another process, mapped here.
pub(crate) struct TravelledSegment {
    pub(crate) via: u128,
    pub(crate) id: StorageId,
    pub(crate) segment: AnyStorage,
    pub(crate) ticket: Option<CacheTicket>,
    pub(crate) alive: OwnerAlive,
}

/// The receiving side, one per channel end: the leases its senders introduced, by name, and
/// the segments they introduced.
#[derive(Default)]
pub(crate) struct ConnectionLeases {
    leases: Mutex<Known>,
    segments: Arc<KnownSegments>,
}

#[derive(Default)]
struct Known {
    by_name: HashMap<ConnectionKey, Lease>,
    /// The pipes of `by_name`'s leases (device, inode): one pipe is known under one name.
    pipes: HashSet<(u64, u64)>,
    /// The size after the last sweep for leases of owners that are gone.
    swept: usize,
}

impl Known {
    /// Keeps `lease` under `name` unless its pipe is known already (under this name or
    /// another); false when it is under another, or its pipe cannot be told.
    fn keep(&mut self, name: ConnectionKey, lease: Lease) -> bool {
        if self.by_name.contains_key(&name) {
            return true;
        }
        match crate::sys::file_identity(lease.tx.as_fd()) {
            Some(pipe) if self.pipes.insert(pipe) => {
                self.by_name.insert(name, lease);
                true
            }
            _ => false,
        }
    }
}

impl fmt::Debug for ConnectionLeases {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectionLeases").field("leases", &self.lock().by_name.len()).finish()
    }
}

/// Leases of owners that are gone (and entries of segments gone) are dropped when their table
/// has doubled since the last sweep (and has at least this many), once everything their owners
/// sent was read: a receiver that outlives many senders keeps none of theirs.
const SWEEP_AT: usize = 32;

impl ConnectionLeases {
    fn lock(&self) -> MutexGuard<'_, Known> {
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps a lease a frame introduced (a second introduction of one already known changes
    /// nothing: its copy is closed). False, and nothing kept, for a pipe known under another
    /// name: a sender introduces each of its leases under one name, so such a frame is forged
    /// (else one pipe introduced again and again would take a descriptor here each time).
    pub(crate) fn adopt(&self, name: ConnectionKey, lease: Lease) -> bool {
        self.lock().keep(name, lease)
    }

    /// The leases whose owners are gone, once the table has doubled since the last sweep (and
    /// holds at least [`SWEEP_AT`]); none otherwise. Their owners' messages may still wait to
    /// be read: the receiver [`forget`](Self::forget)s them once it has read everything that
    /// came before this look.
    pub(crate) fn gone_if_due(&self) -> Vec<ConnectionKey> {
        let mut known = self.lock();
        if known.by_name.len() < SWEEP_AT.max(2 * known.swept) {
            return Vec::new();
        }
        known.swept = known.by_name.len();
        known.by_name.iter().filter(|(_, lease)| crate::sys::reader_gone(&*lease.tx)).map(|(name, _)| *name).collect()
    }

    /// Drops the leases `names` (of owners gone, all of whose messages were read).
    pub(crate) fn forget(&self, names: &[ConnectionKey]) {
        let mut known = self.lock();
        for name in names {
            if let Some(pipe) = known.by_name.remove(name).and_then(|l| crate::sys::file_identity(l.tx.as_fd())) {
                known.pipes.remove(&pipe);
            }
        }
        known.swept = known.by_name.len();
    }

    /// The lease named `name`, if a frame of this channel introduced it.
    pub(crate) fn get(&self, name: &ConnectionKey) -> Option<Lease> {
        self.lock().by_name.get(name).cloned()
    }

    /// Asks the sending process `owner` to introduce its segment `index` again, which a block
    /// it sent names and this end does not keep: on each of its leases here (the one of its
    /// connection now takes it; `Control::Forget`).
    pub(crate) fn ask_to_introduce(&self, owner: u128, index: u64) {
        let leases: Vec<Lease> =
            self.lock().by_name.iter().filter(|(name, _)| name.owner == owner).map(|(_, l)| l.clone()).collect();
        for lease in leases {
            super::courier::post(lease.tx.clone(), super::lease::Control::Forget(index));
        }
    }

    /// Every lease known, to travel with the channel end to another process.
    pub(crate) fn all(&self) -> Vec<(ConnectionKey, Lease)> {
        self.lock().by_name.iter().map(|(k, l)| (*k, l.clone())).collect()
    }

    /// A table of the leases and segments a channel end brought along from another process.
    pub(crate) fn from_leases(
        leases: impl IntoIterator<Item = (ConnectionKey, Lease)>,
        segments: Vec<TravelledSegment>,
    ) -> Arc<ConnectionLeases> {
        let table = ConnectionLeases::default();
        {
            let mut known = table.lock();
            for (name, lease) in leases {
                known.keep(name, lease);
            }
            known.swept = known.by_name.len();
        }
        for TravelledSegment { via, id, segment, ticket, alive } in segments {
            table.segments.remember(via, id, segment, ticket, alive);
        }
        Arc::new(table)
    }

    /// The segments this end's senders introduced.
    pub(crate) fn segments(&self) -> &Arc<KnownSegments> {
        &self.segments
    }
}

/// The caching allocators' segments that the senders of one channel end introduced, each
/// mapped here and held for as long as its sender may name it (this process's own only
/// weakly, to travel with the end): by `(sender's process token, segment)`. An entry goes when
/// the segment's owner gives it up (a revocation, or the owner's liveness table says so: no
/// block of it is left anywhere, so nothing names it again), when its owner, which introduced
/// it, has exited and the end has read everything (`forget_gone`), or with the end.
#[derive(Default)]
pub(crate) struct KnownSegments {
    table: Mutex<SegmentTable>,
    /// Says whether the end has read everything sent to it (`None`: cannot tell now).
    reads: Mutex<Option<ReadsProbe>>,
}

/// See [`KnownSegments::watch_reads`].
pub(crate) type ReadsProbe = Box<dyn Fn() -> Option<bool> + Send + Sync>;

/// Whether a segment's owner is still alive (its lease's reading end open).
pub(crate) type OwnerAlive = Box<dyn Fn() -> bool + Send + Sync>;

#[derive(Default)]
struct SegmentTable {
    by_id: HashMap<(u128, StorageId), Kept>,
    /// The size after the last sweep for this process's own segments gone.
    swept: usize,
    /// Owners whose exit the reaper reported (or that no revocation would reach: exited
    /// already, or not subscribed to), each with its number in that order; their entries wait
    /// for the end to have read everything they sent, and for the owner to be really gone.
    gone: HashMap<u128, u64>,
    /// Owners marked so far.
    told: u64,
    /// Registered with the revocations (`super::register_segment_table`).
    registered: bool,
}

/// A segment as an end keeps it: another process's, mapped here (with its slot in the owner's
/// liveness table, and how to tell whether the owner lives); or this process's own (a
/// channel within the process), weakly: it must not keep this process's memory from its
/// allocator, and while a block of it is named somewhere it lives anyway. Kept only to travel
/// with the end.
enum Kept {
    Held { segment: AnyStorage, slot: u32, alive: OwnerAlive },
    Own(WeakStorage),
}

impl Kept {
    fn get(&self) -> Option<AnyStorage> {
        match self {
            Kept::Held { segment, .. } => Some(segment.clone()),
            Kept::Own(segment) => segment.upgrade(),
        }
    }
}

impl SegmentTable {
    fn mark_gone(&mut self, owner: u128) {
        self.told += 1;
        let told = self.told;
        self.gone.entry(owner).or_insert(told);
    }
}

impl fmt::Debug for KnownSegments {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KnownSegments").field("segments", &self.lock().by_id.len()).finish()
    }
}

impl KnownSegments {
    fn lock(&self) -> MutexGuard<'_, SegmentTable> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `segment`, which its owner (process `via`) introduced: weakly when it is this
    /// process's own. `ticket`: its slot in the owner's liveness table; `alive`: whether the
    /// owner lives. A segment its owner no longer holds (its table says so) is not kept; one
    /// whose owner exited already, or that no revocation would reach (this process is not
    /// subscribed to the owner), waits for `forget_gone`. An entry it replaces is dropped
    /// after the lock.
    pub(crate) fn remember(
        self: &Arc<Self>,
        via: u128,
        id: StorageId,
        segment: AnyStorage,
        ticket: Option<CacheTicket>,
        alive: OwnerAlive,
    ) {
        let slot = ticket.map_or(NO_SLOT, |t| t.slot);
        // Looked up before the table's lock, which is never held while taking the state's.
        let (subscribed, held) = if id.is_local() {
            (true, true)
        } else {
            let s = super::state();
            match s.owner_tables.get(&id.owner()) {
                Some(Some(table)) => (true, table.holds(slot, id)),
                Some(None) => (true, true),
                None => (false, true),
            }
        };
        if !held {
            return;
        }
        let (replaced, register) = {
            let mut t = self.lock();
            let kept = if id.is_local() {
                Kept::Own(Arc::downgrade(&segment))
            } else {
                if !subscribed || slot == NO_SLOT || !alive() {
                    t.mark_gone(id.owner());
                }
                Kept::Held { segment, slot, alive }
            };
            let replaced = t.by_id.insert((via, id), kept);
            if t.by_id.len() >= SWEEP_AT.max(2 * t.swept) {
                t.by_id.retain(|_, kept| !matches!(kept, Kept::Own(segment) if segment.strong_count() == 0));
                t.swept = t.by_id.len();
            }
            (replaced, !std::mem::replace(&mut t.registered, true))
        };
        drop(replaced);
        if register {
            super::register_segment_table(Arc::downgrade(self));
        }
    }

    /// The segment `id` as the sender of process `via` introduced it.
    pub(crate) fn get(&self, via: u128, id: StorageId) -> Option<AnyStorage> {
        self.lock().by_id.get(&(via, id)).and_then(Kept::get)
    }

    /// Every entry whose owner lives, to travel with the channel end.
    pub(crate) fn all(&self) -> Vec<((u128, StorageId), AnyStorage)> {
        self.lock()
            .by_id
            .iter()
            .filter(|(_, kept)| !matches!(kept, Kept::Held { alive, .. } if !alive()))
            .filter_map(|(k, kept)| Some((*k, kept.get()?)))
            .collect()
    }

    /// How to tell, without waiting, whether the end has read everything sent to it: an owner
    /// that exits while it has lets its segments go at once.
    pub(crate) fn watch_reads(&self, probe: ReadsProbe) {
        *self.reads.lock().unwrap_or_else(|p| p.into_inner()) = Some(probe);
    }

    /// Takes out the entries of segments their owner gave up (`Some(indices)`); or, for an
    /// owner gone (`None`), those it introduced when the end has read everything (else they
    /// wait for [`KnownSegments::forget_gone`]). Runs on the disposer's thread.
    pub(super) fn revoke(&self, owner: u128, indices: Option<&HashSet<u64>>) -> Vec<AnyStorage> {
        let Some(indices) = indices else {
            let told = {
                let mut t = self.lock();
                if !t.by_id.keys().any(|(via, _)| *via == owner) {
                    // Nothing of the owner's here: one that comes later is marked as it comes.
                    return Vec::new();
                }
                t.mark_gone(owner);
                t.told
            };
            let read = self.reads.lock().unwrap_or_else(|p| p.into_inner()).as_ref().and_then(|probe| probe());
            if read != Some(true) {
                return Vec::new();
            }
            // The reaper may learn of the death (its revocation socket closed) a moment before
            // the kernel has closed the rest of the process's descriptors (the lease the entries
            // look at): a short wait here, on the disposer's thread. An owner that still lives
            // after it (a subscription that ended without its death) keeps its entries.
            let mut taken = Vec::new();
            let until = std::time::Instant::now() + OWNER_EXIT;
            loop {
                taken.extend(self.take_gone(told));
                if !self.lock().gone.contains_key(&owner) || std::time::Instant::now() >= until {
                    return taken;
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        };
        let mut t = self.lock();
        let keys: Vec<(u128, StorageId)> =
            t.by_id.keys().filter(|(_, id)| id.owner() == owner && indices.contains(&id.index())).copied().collect();
        keys.iter().filter_map(|k| t.by_id.remove(k)).filter_map(|kept| kept.get()).collect()
    }

    /// The owner's liveness table arrived: takes out the entries of its segments that it no
    /// longer holds (given up before this process subscribed, or while the end travelled).
    pub(super) fn table_arrived(&self, owner: u128, table: &super::table::Table) -> Vec<AnyStorage> {
        let mut t = self.lock();
        let keys: Vec<(u128, StorageId)> = t
            .by_id
            .iter()
            .filter(|((_, id), kept)| {
                id.owner() == owner && matches!(kept, Kept::Held { slot, .. } if !table.holds(*slot, *id))
            })
            .map(|(k, _)| *k)
            .collect();
        keys.iter().filter_map(|k| t.by_id.remove(k)).filter_map(|kept| kept.get()).collect()
    }

    /// Where the owners marked gone stand now: passed to [`KnownSegments::forget_gone`] after
    /// a look that found nothing.
    pub(crate) fn told_gone(&self) -> u64 {
        self.lock().told
    }

    /// The end has read everything there was, in a look that started after `told` owners were
    /// marked: every message those of them that have exited sent had arrived before (a
    /// process's sends arrive before its death is seen), so the segments they introduced are
    /// named by no message any more. Dropped here.
    pub(crate) fn forget_gone(&self, told: u64) {
        drop(self.take_gone(told));
    }

    /// Takes out the entries that the first `told` owners marked introduced, where the owner
    /// has really exited (a mark for an owner that lives stays: a subscription that ended
    /// without its death, say).
    fn take_gone(&self, told: u64) -> Vec<AnyStorage> {
        let mut t = self.lock();
        if t.gone.is_empty() {
            return Vec::new();
        }
        let marked: Vec<u128> = t.gone.iter().filter(|(_, n)| **n <= told).map(|(o, _)| *o).collect();
        let mut taken = Vec::new();
        for owner in marked {
            let keys: Vec<(u128, StorageId)> = t.by_id.keys().filter(|(via, _)| *via == owner).copied().collect();
            let mut left = false;
            for k in keys {
                match t.by_id.get(&k) {
                    Some(Kept::Held { alive, .. }) if alive() => left = true,
                    _ => taken.extend(t.by_id.remove(&k).and_then(|kept| kept.get())),
                }
            }
            if !left {
                t.gone.remove(&owner);
            }
        }
        taken
    }
}

/// How long an owner whose death the reaper reported may take to close its leases.
const OWNER_EXIT: std::time::Duration = std::time::Duration::from_millis(250);

/// A weak handle on a segment table, for the revocations.
pub(super) type WeakSegments = Weak<KnownSegments>;
