//! Leases and covers, as the holder sees them, the records holders write on lease pipes, and
//! the messages owners send on revocation sockets.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use super::StorageId;
use super::connection::ConnectionKey;
use crate::error::{Error, Result};
use crate::handover::SpawnTicket;
use crate::sys::{MemoryFile, Socket, Wait};
use crate::wire::{self, Carried, Held};

/// How claims are held on a lease. On a channel every claim is counted on the connection's
/// lease; outside one (spawn arguments, pool calls) a storage kind's mode says which lease its
/// messages carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeaseMode {
    /// The owner counts claims per storage on the lease; a holder that drops one says so on
    /// the lease (`Release`), and the lease's close releases whatever is left. Outside a
    /// channel: one lease per message, covering every storage of this kind in it.
    Counted,
    /// One lease per storage, shared by every message while the owner holds handles on it;
    /// none is made on the send path, and a holder's claim is its copy of the lease.
    Shared,
}

/// Holder to owner, a record on a lease pipe (`src/sys/pipe.rs`).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Control {
    /// Subscribe to the owner's revocations: the sending end of the socket to send them on
    /// waits at the subscriber's home under this ticket (`src/handover.rs`).
    Link(SpawnTicket),
    /// The holder dropped `count` claims on storage `index` (counted leases).
    Release(u64, u64),
    /// The holder passes a claim on storage `index` on to another process: one more claim
    /// through this lease (counted leases).
    Retain(u64),
    /// The holder's channel end does not keep segment `index`, which a block the owner sent
    /// on the connection of this lease names (its introduction was lost, or could not be
    /// mapped there): the owner introduces it again with its next block there.
    Forget(u64),
    /// A process holds a copy of this lease: its id, start time and pid namespace
    /// (`Holder`), written once per process and lease, before anything it holds through the
    /// lease is used there. When the lease closes while that process is ending, the owner
    /// releases what the lease carried only once its exit is complete.
    Holder(Holder),
}

/// A process that holds a copy of a lease, as it names itself on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Holder {
    pub(crate) pid: u32,
    /// In clock ticks since boot: with the pid, which process this is.
    pub(crate) start: u64,
    /// The inode of its pid namespace: its pid means nothing in another.
    pub(crate) namespace: u64,
}

impl Holder {
    /// This process; `None` while its start time is unknown (`/proc` unreadable, say out of
    /// descriptors), without which its pid could stand for any process. A pid namespace that
    /// cannot be read is named 0: an owner that cannot read its own either (the same host's
    /// rules) takes it, one that can refuses it.
    pub(super) fn this() -> Option<Holder> {
        let me = Holder {
            pid: crate::sys::own_pid(),
            start: crate::sys::own_start(),
            namespace: crate::sys::pid_namespace(),
        };
        (me.start != 0).then_some(me)
    }
}

/// Why a message whose lease is not a pipe's writing end is malformed.
pub(crate) const NOT_A_LEASE: &str = "message carries a lease that is not a pipe's writing end";

const RELEASE: u8 = 1;
const RETAIN: u8 = 2;
const LINK: u8 = 3;
const RELEASE_MANY: u8 = 4;
const FORGET: u8 = 5;
const HOLDER: u8 = 6;

impl Control {
    /// The record: a tag, then 8 bytes of index (and 8 of count for more than one release),
    /// 2 bytes of length and the ticket, or a holder's 4 bytes of pid, 8 of start time and 8
    /// of namespace.
    pub(super) fn record(&self) -> io::Result<Vec<u8>> {
        let (tag, body) = match self {
            Control::Release(index, 1) => (RELEASE, index.to_le_bytes().to_vec()),
            Control::Release(index, count) => (RELEASE_MANY, [index.to_le_bytes(), count.to_le_bytes()].concat()),
            Control::Retain(index) => (RETAIN, index.to_le_bytes().to_vec()),
            Control::Forget(index) => (FORGET, index.to_le_bytes().to_vec()),
            Control::Holder(h) => {
                (HOLDER, [&h.pid.to_le_bytes()[..], &h.start.to_le_bytes(), &h.namespace.to_le_bytes()].concat())
            }
            Control::Link(ticket) => {
                let ticket = postcard::to_allocvec(ticket).map_err(|e| io::Error::other(e.to_string()))?;
                let mut body = (ticket.len() as u16).to_le_bytes().to_vec();
                body.extend(ticket);
                (LINK, body)
            }
        };
        let mut record = vec![tag];
        record.extend(body);
        Ok(record)
    }

    /// The records at the start of `bytes`, and how many bytes they took (a record cut off at
    /// the end waits for the rest); with `true` when a byte that starts no record of ours came
    /// after them, where the reader drops the rest of what it read (the records before it,
    /// other holders' among them, still count).
    pub(super) fn parse(bytes: &[u8]) -> (Vec<Control>, usize, bool) {
        let mut at = 0;
        let mut out = Vec::new();
        while at < bytes.len() {
            let rest = &bytes[at..];
            let word =
                |b: &[u8], at: usize| b.get(at..at + 8).map(|i| u64::from_le_bytes(i.try_into().expect("8 bytes")));
            match rest[0] {
                RELEASE | RETAIN | FORGET => {
                    let Some(i) = word(rest, 1) else { break };
                    out.push(match rest[0] {
                        RELEASE => Control::Release(i, 1),
                        RETAIN => Control::Retain(i),
                        _ => Control::Forget(i),
                    });
                    at += 9;
                }
                RELEASE_MANY => {
                    let (Some(i), Some(n)) = (word(rest, 1), word(rest, 9)) else { break };
                    out.push(Control::Release(i, n));
                    at += 17;
                }
                HOLDER => {
                    let (Some(pid), Some(start), Some(namespace)) = (
                        rest.get(1..5).map(|p| u32::from_le_bytes(p.try_into().expect("4 bytes"))),
                        word(rest, 5),
                        word(rest, 13),
                    ) else {
                        break;
                    };
                    out.push(Control::Holder(Holder { pid, start, namespace }));
                    at += 21;
                }
                LINK => {
                    let Some(len) = rest.get(1..3).map(|l| u16::from_le_bytes([l[0], l[1]]) as usize) else { break };
                    let Some(ticket) = rest.get(3..3 + len) else { break };
                    let Ok(ticket) = postcard::from_bytes(ticket) else { return (out, at, true) };
                    out.push(Control::Link(ticket));
                    at += 3 + len;
                }
                _ => return (out, at, true),
            }
        }
        (out, at, false)
    }

    /// Writes the record to the lease `tx`, whole, waiting while the pipe is full.
    pub(super) fn send(&self, tx: &impl AsFd) -> io::Result<()> {
        crate::sys::write_record(tx.as_fd(), &self.record()?)
    }

    /// Writes the record to the lease `tx`, whole, if the pipe has room now (`Ok(false)`:
    /// nothing written).
    pub(super) fn try_send(&self, tx: &impl AsFd) -> io::Result<bool> {
        crate::sys::try_write_record(tx.as_fd(), &self.record()?)
    }
}

/// Owner to holder, on a revocation socket.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Revocation {
    /// The owner's liveness table (the message's one descriptor): slot `s` holds the index of
    /// the storage it tracks while the owner's own handles on it are alive, 0 otherwise.
    Table,
    /// The owner dropped its handles on these storages: drop cached mappings of them.
    Storages(Vec<u64>),
    /// The owner dropped more storages than one message lists (this subscriber did not read
    /// for a while): drop cached mappings of every storage whose slot in the table no longer
    /// holds it.
    Recheck,
}

/// The most bytes of a message on a revocation socket.
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
    // Only its owner may write it: a mark of another holder's would mislead the rest.
    MemoryFile::open_read_only(fd, super::table::TABLE_BYTES).ok().map(Arc::new)
}

/// The writing end of a lease pipe, whose reading end the storage's owner watches.
#[derive(Debug, Clone)]
pub(crate) struct Lease {
    pub(super) tx: Arc<OwnedFd>,
    /// Identity within this process, so that a message carries one lease once.
    key: u64,
}

fn next_key() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Lease {
    pub(super) fn new(tx: Arc<OwnedFd>) -> Lease {
        Lease { tx, key: next_key() }
    }

    /// Closes a forked child's copy of its parent's lease (in its fork handler; see
    /// `close_inherited_shared`).
    pub(super) fn close_inherited(self) {
        crate::sys::close_inherited_shared(self.tx);
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

    /// The lease's sending end, to attach to a frame that introduces it.
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.tx.as_fd()
    }

    /// A lease from a sending end that arrived (in a message's values, or a frame's
    /// introduction): a pipe's writing end, or `None` (a holder writes records to its lease,
    /// and learns of the owner's revocations through it: on anything else they would wait for
    /// an answer that never comes).
    pub(crate) fn accept(fd: Arc<OwnedFd>) -> Option<Lease> {
        crate::sys::accept_pipe_writer(fd).map(|fd| {
            announce(&fd);
            Lease::new(fd)
        })
    }

    /// Takes a lease out of the message being decoded: anything [`Lease::accept`] refuses
    /// makes the message malformed.
    fn take(carried: Carried) -> Result<Lease> {
        let fd = wire::take_shared_fd_as(carried, crate::sys::accept_pipe_writer)?;
        let fd = fd.ok_or_else(|| Error::Malformed(NOT_A_LEASE.into()))?;
        announce(&fd);
        Ok(Lease::new(fd))
    }
}

/// The leases (pipes, by identity) this process has named itself on.
static ANNOUNCED: crate::fork::ForkLocal<std::sync::Mutex<std::collections::HashSet<(u64, u64)>>> =
    crate::fork::ForkLocal::new(Default::default);

/// Names this process on lease `tx`, once per lease, before anything the lease covers is used
/// here (`Control::Holder`): a process killed while GPU work it queued still runs closes its
/// lease before the driver stops that work, and the owner waits for its exit. Without room in
/// the pipe now (its owner stopped reading), or while this process cannot tell its start time,
/// nothing is written, and a later arrival of the lease tries again; until then the owner
/// does not wait for this process.
fn announce(tx: &Arc<OwnedFd>) {
    announce_as(tx, Holder::this());
}

/// [`announce`] as `me` (`None`: unknown).
fn announce_as(tx: &Arc<OwnedFd>, me: Option<Holder>) {
    let Some(me) = me else { return };
    let Some(identity) = crate::sys::file_identity(tx.as_fd()) else { return };
    // The write is made under the lock (it never waits: the pipe is non-blocking), so that
    // another thread that takes the same lease meanwhile goes on only once it is written.
    let mut announced = ANNOUNCED.get().lock().unwrap_or_else(|p| p.into_inner());
    if announced.contains(&identity) {
        return;
    }
    if matches!(Control::Holder(me).try_send(tx), Ok(true)) {
        // Pipes closed since are not told apart from new ones: forgetting all of them now and
        // then costs a record on each lease that arrives again.
        if announced.len() >= MAX_ANNOUNCED {
            announced.clear();
        }
        announced.insert(identity);
    }
}

/// Leases remembered as announced at most.
const MAX_ANNOUNCED: usize = 4096;

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

/// The claim a storage's record in a message stands for.
#[derive(Debug)]
pub(crate) enum Claim {
    /// A claim through a lease the message carries (spawn arguments, pool calls, a storage
    /// forwarded from a third process), counted per storage on it or (`counted: false`) a
    /// per-storage lease whose every copy is one claim.
    Lease { lease: Lease, counted: bool },
    /// A counted claim on entry `index` of the lease the message carries, for a storage whose
    /// forwarder holds it for the new holder (outside a channel: its relay on the message's
    /// lease, or the forwarder's own lease, [`Cover::forward`]);
    /// `anchors` are the leases the claims behind it are counted on (see [`Cover`]).
    Relayed { lease: Lease, index: u64, anchors: Vec<Lease> },
    /// A claim on entry `index` counted on the connection lease `name`, which the message
    /// names and does not carry (the sender's side). `anchors` as for `Relayed`: empty for a
    /// storage of the sender's own.
    Connection { name: ConnectionKey, index: u64, anchors: Vec<Lease> },
    /// A connection claim as decoded: the cover the receiver made for it from the message's
    /// list of claims (`wire::take_connection_cover`).
    Counted(Cover),
}

/// A claim as it travels.
#[derive(Serialize, Deserialize)]
enum ClaimWire {
    Lease(Carried, bool),
    Connection(ConnectionKey, u64),
    Relayed(Carried, u64, Vec<Carried>),
    ConnectionRelayed(ConnectionKey, u64, Vec<Carried>),
}

fn carry_all(leases: &[Lease]) -> Result<Vec<Carried>> {
    leases.iter().map(Lease::carry).collect()
}

fn take_all(carried: Vec<Carried>) -> Result<Vec<Lease>> {
    carried.into_iter().map(Lease::take).collect()
}

impl Serialize for Claim {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let carried = |lease: &Lease| lease.carry().map_err(wire::encode_error);
        match self {
            Claim::Lease { lease, counted } => ClaimWire::Lease(carried(lease)?, *counted),
            Claim::Relayed { lease, index, anchors } => {
                ClaimWire::Relayed(carried(lease)?, *index, carry_all(anchors).map_err(wire::encode_error)?)
            }
            Claim::Connection { name, index, anchors } if anchors.is_empty() => ClaimWire::Connection(*name, *index),
            Claim::Connection { name, index, anchors } => {
                ClaimWire::ConnectionRelayed(*name, *index, carry_all(anchors).map_err(wire::encode_error)?)
            }
            Claim::Counted(_) => {
                return Err(wire::encode_error(Error::Unsupported("a decoded claim is not sent again".into())));
            }
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Claim {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let connection_cover = |name, index| {
            wire::take_connection_cover(name, index).ok_or_else(|| {
                wire::decode_error(Error::Malformed("message names a connection claim that it does not carry".into()))
            })
        };
        Ok(match ClaimWire::deserialize(deserializer)? {
            ClaimWire::Lease(carried, counted) => {
                Claim::Lease { lease: Lease::take(carried).map_err(wire::decode_error)?, counted }
            }
            ClaimWire::Relayed(carried, index, anchors) => Claim::Relayed {
                lease: Lease::take(carried).map_err(wire::decode_error)?,
                index,
                anchors: take_all(anchors).map_err(wire::decode_error)?,
            },
            ClaimWire::Connection(name, index) => Claim::Counted(connection_cover(name, index)?),
            ClaimWire::ConnectionRelayed(name, index, anchors) => {
                let anchors = take_all(anchors).map_err(wire::decode_error)?;
                let mut cover = connection_cover(name, index)?;
                cover.anchors = anchors;
                Claim::Counted(cover)
            }
        })
    }
}

/// Claims on one storage through a lease, ended when it drops, and for a storage that came
/// through a forwarder the leases up the chain (`anchors`). README.md, "Leases and claims".
#[derive(Debug)]
pub(crate) struct Cover {
    lease: Lease,
    id: StorageId,
    /// The entry the claims are counted under on the lease: the storage's index in its owner,
    /// or a forwarder's relay of it.
    index: u64,
    mode: LeaseMode,
    /// Claims this cover holds (counted leases).
    claims: AtomicU64,
    /// The process generation that holds the claim: a forked child's copy of its parent's
    /// cover is not a claim of its own, and its drop releases nothing.
    generation: u64,
    /// Copies of the leases the forwarders' claims are counted on, the owner's first.
    anchors: Vec<Lease>,
}

impl Cover {
    pub(crate) fn new(lease: Lease, id: StorageId, mode: LeaseMode) -> Cover {
        Cover::at(lease, id, id.index(), mode, Vec::new())
    }

    fn at(lease: Lease, id: StorageId, index: u64, mode: LeaseMode, anchors: Vec<Lease>) -> Cover {
        Cover { lease, id, index, mode, claims: AtomicU64::new(1), generation: crate::fork::generation(), anchors }
    }

    /// The cover of a claim decoded from a message. (A message that calls a counted lease
    /// per-storage only keeps its claim longer; one that calls a per-storage lease counted sends
    /// releases that its owner ignores.)
    pub(crate) fn of_claim(claim: Claim, id: StorageId) -> Result<Cover> {
        match claim {
            Claim::Lease { lease, counted: true } => Ok(Cover::new(lease, id, LeaseMode::Counted)),
            Claim::Lease { lease, counted: false } => Ok(Cover::new(lease, id, LeaseMode::Shared)),
            Claim::Relayed { lease, index, anchors } => Ok(Cover::at(lease, id, index, LeaseMode::Counted, anchors)),
            // A forwarder's relay: counted under the relay's own entry, for the storage named.
            Claim::Counted(mut cover) if !cover.anchors.is_empty() => {
                cover.id = id;
                Ok(cover)
            }
            Claim::Counted(cover) if cover.id == id => Ok(cover),
            Claim::Counted(_) => Err(Error::Malformed("a storage's record names another storage's claim".into())),
            Claim::Connection { .. } => Err(Error::Malformed("a connection claim that was not decoded".into())),
        }
    }

    /// The cover of one claim on entry `index` counted on a connection lease of the process
    /// whose token is `owner`.
    pub(crate) fn counted(lease: Lease, owner: u128, index: u64) -> Cover {
        Cover::new(lease, StorageId::foreign(owner, index), LeaseMode::Counted)
    }

    /// Takes over `other`'s claims when both are counted claims on the same storage through
    /// the same lease entry (a message that brought a storage already mapped here): nothing is
    /// sent now, and this cover's drop releases them all. Gives `other` back otherwise.
    pub(crate) fn absorb(&self, other: Cover) -> Option<Cover> {
        let same = self.mode == LeaseMode::Counted
            && other.mode == LeaseMode::Counted
            && self.id == other.id
            && self.index == other.index
            && self.lease.key() == other.lease.key()
            && self.generation == other.generation;
        if !same {
            return Some(other);
        }
        self.claims.fetch_add(other.claims.swap(0, Ordering::Relaxed), Ordering::Relaxed);
        None
    }

    /// The claim to send with this storage to another process where it is not relayed
    /// (`export.rs`): the same lease, plus one claim on it for the new holder when claims are
    /// counted.
    pub(crate) fn forward(&self) -> Claim {
        let counted = self.mode == LeaseMode::Counted;
        if counted {
            // Sent before the message that carries the claim, so the owner reads it before the
            // new holder's release, which comes later on the same channel.
            let _ = Control::Retain(self.index).send(&self.lease.tx);
        }
        if counted && self.is_relayed() {
            return Claim::Relayed { lease: self.lease.clone(), index: self.index, anchors: self.anchors.clone() };
        }
        Claim::Lease { lease: self.lease.clone(), counted }
    }

    /// True when the claim came through a forwarder: counted on its relay, or holding copies
    /// of the leases up the chain.
    pub(crate) fn is_relayed(&self) -> bool {
        self.index != self.id.index() || !self.anchors.is_empty()
    }

    /// True for claims counted on their lease (which a forwarder relays inside a message).
    pub(crate) fn is_counted(&self) -> bool {
        self.mode == LeaseMode::Counted
    }

    /// The storage this cover claims.
    pub(crate) fn id(&self) -> StorageId {
        self.id
    }

    /// One more claim through the same lease entry, in a cover of its own (a forwarder's claim
    /// for the holders it relays to). Its `Retain` goes by the courier, as this cover's release
    /// will, so that the send that makes the relay never waits for an owner that does not
    /// read: the claim is only this process's, and this cover's claim, held meanwhile, is
    /// released through the same queue after it (`courier.rs`, `Owed`). A forked child's
    /// cover of its parent's claim is released by the parent's courier, which knows nothing of
    /// the child's: the child writes its `Retain` itself, waiting for room, before the
    /// message. (The parent releases a pooled block only after its forked children are gone;
    /// other host memory may be released sooner, and then a late `Retain` is ignored, but its
    /// pages live as long as any mapping of them and are never handed out again.)
    pub(crate) fn retain(&self) -> Cover {
        if self.generation == crate::fork::generation() {
            super::courier::post(self.lease.tx.clone(), Control::Retain(self.index));
        } else {
            let _ = Control::Retain(self.index).send(&self.lease.tx);
        }
        Cover::at(self.lease.clone(), self.id, self.index, LeaseMode::Counted, Vec::new())
    }

    /// The anchors to give a holder this process relays the storage to: this cover's, then
    /// its own lease.
    pub(crate) fn chain(&self) -> Vec<Lease> {
        let mut chain = self.anchors.clone();
        chain.push(self.lease.clone());
        chain
    }

    /// A lease of the storage's owner: the one to subscribe to its revocations on.
    pub(crate) fn owner_lease(&self) -> &Lease {
        self.anchors.first().unwrap_or(&self.lease)
    }

    /// False once the storage's owner has exited (its end of the lease is closed).
    pub(crate) fn owner_alive(&self) -> bool {
        self.id.is_local() || !crate::sys::reader_gone(&*self.owner_lease().tx)
    }

    /// Moves the claims out into a cover of their own, to be released when that one drops;
    /// this one then releases nothing. (A release that waits behind a fence keeps them until
    /// the fence's work is done.)
    pub(crate) fn take(&mut self) -> Cover {
        Cover {
            lease: self.lease.clone(),
            id: self.id,
            index: self.index,
            mode: self.mode,
            claims: AtomicU64::new(std::mem::take(self.claims.get_mut())),
            generation: self.generation,
            anchors: std::mem::take(&mut self.anchors),
        }
    }
}

impl Drop for Cover {
    fn drop(&mut self) {
        let claims = *self.claims.get_mut();
        if self.mode == LeaseMode::Counted && claims > 0 && self.generation == crate::fork::generation() {
            // Sent by the courier: a drop never waits for the owner to read.
            super::courier::post(self.lease.tx.clone(), Control::Release(self.index, claims));
        }
    }
}

/// What lets a receiver keep a mapping cached after use: the storage's slot in its owner's
/// liveness table.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub(crate) struct CacheTicket {
    pub(super) slot: u32,
}

#[cfg(test)]
mod record_tests {
    use super::*;

    #[test]
    fn records_parse_back_whole_and_a_cut_one_waits() {
        let ticket = SpawnTicket { home: "cuda-mp-home-test".into(), token: 7, batch: None };
        let mut bytes = Vec::new();
        for c in [
            Control::Release(5, 1),
            Control::Link(ticket.clone()),
            Control::Retain(u64::MAX),
            Control::Release(7, 300),
            Control::Forget(9),
            Control::Holder(Holder { pid: 4_000_000, start: u64::MAX - 1, namespace: 4_026_531_836 }),
        ] {
            bytes.extend(c.record().unwrap());
        }
        let (parsed, used, stray) = Control::parse(&bytes);
        assert!(!stray);
        assert_eq!(
            parsed,
            vec![
                Control::Release(5, 1),
                Control::Link(ticket),
                Control::Retain(u64::MAX),
                Control::Release(7, 300),
                Control::Forget(9),
                Control::Holder(Holder { pid: 4_000_000, start: u64::MAX - 1, namespace: 4_026_531_836 }),
            ]
        );
        assert_eq!(used, bytes.len());
        let (parsed, used, _) = Control::parse(&bytes[..bytes.len() - 3]);
        assert_eq!((parsed.len(), used), (5, bytes.len() - 21), "the cut record waits");
        assert_eq!(Control::parse(&[9, 1, 2]), (vec![], 0, true), "not ours");
        // Records before a stray byte count (another holder's among them); what follows it
        // does not.
        let mut stray = Control::Retain(3).record().unwrap();
        stray.push(0xff);
        stray.extend(Control::Release(3, 1).record().unwrap());
        assert_eq!(Control::parse(&stray), (vec![Control::Retain(3)], 9, true));
    }

    /// What a lease pipe's reading end holds now, parsed.
    fn records_in(read: &OwnedFd) -> Vec<Control> {
        let mut buf = [0u8; 256];
        let n = crate::sys::read_available(read, &mut buf).unwrap().unwrap_or(0);
        Control::parse(&buf[..n]).0
    }

    /// A process that cannot tell its start time writes no record its owner would refuse,
    /// and does not count the lease as named: the lease's next arrival names it.
    #[test]
    fn a_holder_whose_start_is_unknown_names_itself_at_the_next_arrival() {
        let (read, write) = crate::sys::lease_pipe().unwrap();
        let write = Arc::new(write);
        announce_as(&write, None);
        assert_eq!(records_in(&read), vec![], "nothing written while the start time is unknown");
        let me = Holder { pid: 7, start: 11, namespace: 13 };
        announce_as(&write, Some(me));
        assert_eq!(records_in(&read), vec![Control::Holder(me)], "named at the next arrival");
        announce_as(&write, Some(me));
        assert_eq!(records_in(&read), vec![], "once per lease");
    }

    mod fuzz {
        use proptest::prelude::*;

        use super::*;

        proptest! {
            #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

            /// Any bytes on a lease pipe: records, up to a byte that is not ours, never a panic;
            /// the records read are what their bytes say.
            #[test]
            fn any_bytes_on_a_lease_parse_without_a_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
                let (records, used, _) = Control::parse(&bytes);
                prop_assert!(used <= bytes.len());
                for r in records {
                    let record = r.record().unwrap();
                    let (again, n, stray) = Control::parse(&record);
                    prop_assert_eq!((again, n, stray), (vec![r], record.len(), false));
                }
            }
        }
    }
}
