//! Leases and covers, as the holder sees them, and the messages that travel on lease
//! channels.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::StorageId;
use crate::error::Result;
use crate::sys::{MemoryFile, Socket, Wait};
use crate::wire::{self, Carried, Held};

/// How a storage kind's messages carry leases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeaseMode {
    /// One lease channel per message, covering every storage of this kind in it; a holder
    /// that drops one storage says so on the lease (`Release`), and the channel's close
    /// releases whatever is left.
    PerMessage,
    /// One lease channel per storage, shared by every message while the owner holds handles
    /// on it; no channel is made on the send path, and a holder's claim is its copy of the
    /// channel.
    PerStorage,
}

/// Holder to owner, on a lease channel.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Control {
    /// Subscribe to the owner's revocations (the message's one descriptor is where to send
    /// them).
    Link,
    /// The holder dropped its claim on storage `index` (per-message leases).
    Release(u64),
    /// The holder passes a claim on storage `index` on to another process: one more claim
    /// through this lease (per-message leases).
    Retain(u64),
}

/// Owner to holder.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Revocation {
    /// The owner's liveness table (the message's one descriptor): slot `s` holds the index of
    /// the storage it tracks while the owner's own handles on it are alive, 0 otherwise.
    Table,
    /// The owner dropped its handles on these storages: drop cached mappings of them.
    Storages(Vec<u64>),
}

/// The most bytes of a message on a lease or revocation socket.
pub(super) const MESSAGE_BYTES: usize = 16 << 10;

/// Sends a small message of ours (postcard), with `fds`, on `socket`.
pub(super) fn send<M: Serialize>(
    socket: &Socket,
    message: &M,
    fds: &[&dyn std::os::fd::AsFd],
    wait: Wait,
) -> io::Result<()> {
    let bytes = postcard::to_allocvec(message).map_err(|e| io::Error::other(e.to_string()))?;
    let fds: Vec<_> = fds.iter().map(|fd| fd.as_fd()).collect();
    socket.send(&[&bytes], &fds, wait)
}

/// The memory of a liveness table that arrived in a `Revocation::Table`.
pub(super) fn table_memory(fds: Vec<std::os::fd::OwnedFd>) -> Option<Arc<MemoryFile>> {
    let fd = fds.into_iter().next()?;
    MemoryFile::open(fd, 8).ok().map(Arc::new)
}

/// The sending end of a lease channel, whose receiving end the storage's owner watches.
#[derive(Debug, Clone)]
pub(crate) struct Lease {
    pub(super) tx: Arc<Socket>,
    /// Identity within this process, so that a message carries one lease once.
    key: u64,
}

fn next_key() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Lease {
    pub(super) fn new(tx: Arc<Socket>) -> Lease {
        Lease { tx, key: next_key() }
    }

    /// Identity in this process; in the owner, the key its claims are counted under.
    pub(super) fn key(&self) -> u64 {
        self.key
    }

    /// Places the lease in the message being encoded (once per message).
    fn carry(&self) -> Result<Carried> {
        let held: Held = self.tx.clone();
        wire::carry(held, Some(self.key))
    }

    /// Takes a lease out of the message being decoded.
    fn take(carried: Carried) -> Result<Lease> {
        Ok(Lease::new(wire::take_lease_socket(carried)?))
    }
}

impl Serialize for Lease {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        self.carry().map_err(wire::encode_error)?.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Lease {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        Lease::take(Carried::deserialize(deserializer)?).map_err(wire::decode_error)
    }
}

/// One claim on one storage through a lease. Dropping it ends the claim: for a per-message
/// lease it says so on the lease; for a per-storage lease the dropped copy of the channel is
/// the claim.
#[derive(Debug)]
pub(crate) struct Cover {
    lease: Lease,
    id: StorageId,
    mode: LeaseMode,
    /// The process generation that holds the claim: a forked child's copy of its parent's
    /// cover is not a claim of its own, and its drop releases nothing.
    generation: u64,
}

impl Cover {
    pub(crate) fn new(lease: Lease, id: StorageId, mode: LeaseMode) -> Cover {
        Cover { lease, id, mode, generation: crate::fork::generation() }
    }

    /// A lease to send with this storage to another process: the same lease, plus one claim
    /// on it for the new holder when claims are counted per message.
    pub(crate) fn forward(&self) -> Lease {
        if self.mode == LeaseMode::PerMessage {
            // Sent before the message that carries the claim, so the owner reads it before the
            // new holder's release, which comes later on the same channel.
            let _ = send(&self.lease.tx, &Control::Retain(self.id.index()), &[], Wait::Forever);
        }
        self.lease.clone()
    }

    pub(crate) fn lease(&self) -> &Lease {
        &self.lease
    }

    /// False once the storage's owner has exited (its end of the lease is closed).
    pub(crate) fn owner_alive(&self) -> bool {
        self.id.is_local() || !self.lease.tx.peer_closed()
    }
}

impl Drop for Cover {
    fn drop(&mut self) {
        if self.mode == LeaseMode::PerMessage && self.generation == crate::fork::generation() {
            // Sent by the courier: a drop never waits for the owner to read.
            super::courier::release(self.lease.tx.clone(), self.id.index());
        }
    }
}

/// What lets a receiver keep a mapping cached after use: the storage's slot in its owner's
/// liveness table.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub(crate) struct CacheTicket {
    pub(super) slot: u32,
}
