//! Connection leases: one lease per channel and sending process, not one per message. The
//! owner counts its claims per storage; a message that carries storages names the lease by
//! `(owner, key)` and carries no descriptor for it, except the first message of the
//! connection, whose frame introduces the lease (`src/channel/frame.rs`). The receiver keeps
//! the connection's leases for as long as it holds the channel, so that every later message
//! can name them; the lease closes (and every claim still on it is released) when the
//! receiver has dropped the channel and every storage that came through it, or died.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use super::lease::Lease;

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

/// The receiving side, one per channel end: the leases its senders introduced, by name.
#[derive(Default)]
pub(crate) struct ConnectionLeases {
    leases: Mutex<Known>,
}

#[derive(Default)]
struct Known {
    by_name: HashMap<ConnectionKey, Lease>,
    /// The size after the last sweep for leases of owners that are gone.
    swept: usize,
}

impl fmt::Debug for ConnectionLeases {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectionLeases").field("leases", &self.lock().by_name.len()).finish()
    }
}

/// Leases of owners that are gone are dropped when the table has doubled since the last sweep
/// (and has at least this many): a receiver that outlives many senders keeps none of theirs.
const SWEEP_AT: usize = 32;

impl ConnectionLeases {
    fn lock(&self) -> MutexGuard<'_, Known> {
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps a lease a frame introduced (a second introduction of one already known changes
    /// nothing: its copy is closed).
    pub(crate) fn adopt(&self, name: ConnectionKey, lease: Lease) {
        let mut known = self.lock();
        known.by_name.entry(name).or_insert(lease);
        if known.by_name.len() >= SWEEP_AT.max(2 * known.swept) {
            known.by_name.retain(|_, lease| !crate::sys::reader_gone(&*lease.tx));
            known.swept = known.by_name.len();
        }
    }

    /// The lease named `name`, if a frame of this channel introduced it.
    pub(crate) fn get(&self, name: &ConnectionKey) -> Option<Lease> {
        self.lock().by_name.get(name).cloned()
    }

    /// Every lease known, to travel with the channel end to another process.
    pub(crate) fn all(&self) -> Vec<(ConnectionKey, Lease)> {
        self.lock().by_name.iter().map(|(k, l)| (*k, l.clone())).collect()
    }

    /// A table of the leases a channel end brought along from another process.
    pub(crate) fn from_leases(leases: impl IntoIterator<Item = (ConnectionKey, Lease)>) -> Arc<ConnectionLeases> {
        let table = ConnectionLeases::default();
        {
            let mut known = table.lock();
            known.by_name.extend(leases);
            known.swept = known.by_name.len();
        }
        Arc::new(table)
    }
}
