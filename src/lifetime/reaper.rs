//! The reaper: one thread per process that watches the reading ends of this process's lease
//! pipes (closing, or carrying releases and subscriptions) and this process's own
//! subscriptions to other owners' revocations (sockets), all in one `epoll` set.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use once_cell::sync::OnceCell;
use rustix::event::epoll;

use super::export::{Change, lease_closed, lease_message};
use super::import::{owner_gone, recheck, revoke, table_arrived};
use super::lease::{self, Control, Holder, Lease, Revocation};
use super::table::{SubscriberEnd, Table, owner};
use crate::error::Result;
use crate::fork::ForkLocal;
use crate::sys::{Socket, Wait};
use crate::wire::io_error;

/// What the reaper watches.
#[derive(Debug, Clone, Copy)]
enum Watched {
    /// A lease of this process, by its key.
    Lease(u64),
    /// A pre-made lease not yet handed out.
    Spare,
    /// Revocations from the owner with this token.
    Revocations(u128),
    /// This process's end of subscriber `n`'s revocation socket, which nothing is sent to:
    /// its end means the subscriber is gone.
    Subscriber(u64),
    /// A pidfd of a holder of lease `key` that was ending when the lease closed: the lease's
    /// claims are released once every such holder has exited.
    Exit(u64),
}

/// The reading end of what the reaper watches: a lease pipe, or a revocation socket.
#[derive(Clone)]
enum Source {
    Pipe(Arc<OwnedFd>),
    Socket(Arc<Socket>),
    /// A subscriber's revocation socket (which forked children close by themselves).
    Subscriber(SubscriberEnd),
    /// A pidfd, readable once its process has exited.
    Process(Arc<OwnedFd>),
}

impl Source {
    fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        match self {
            Source::Pipe(fd) | Source::Process(fd) => fd.as_fd(),
            Source::Socket(s) => s.as_fd(),
            Source::Subscriber(s) => s.as_fd(),
        }
    }
}

/// One watched reading end: what it is, and the bytes of a lease record not complete yet.
struct Entry {
    what: Watched,
    source: Source,
    partial: Vec<u8>,
    /// A lease pipe's identity (`sys::pipe_identity`), to know a lease of this process when
    /// one arrives.
    pipe: Option<(u64, u64)>,
    /// The processes that named themselves on a lease (`Control::Holder`).
    holders: Holders,
}

/// The processes that named themselves on a lease, at most [`MAX_HOLDERS`] at a time, and
/// when those that exited were last dropped to make room.
#[derive(Default)]
struct Holders {
    named: Vec<Holder>,
    pruned: Option<std::time::Instant>,
}

/// Holders of one lease remembered at most, those that exited since making room for new
/// ones: past as many living holders of one lease, the later ones are not waited for.
const MAX_HOLDERS: usize = 64;

/// The id of the reaper's bell in its epoll set (watched sockets count from 1).
const BELL: u64 = 0;

pub(super) struct Reaper {
    epoll: OwnedFd,
    /// Rung when spare leases run low.
    bell: OwnedFd,
    wake_pending: AtomicBool,
    /// Every watched reading end, by its id in the epoll set.
    watched: Mutex<HashMap<u64, Entry>>,
    next_id: AtomicU64,
    spares: Mutex<Vec<(u64, Arc<OwnedFd>)>>,
    /// Subscriptions whose owner has not answered yet, by owner, with when their deposit
    /// expires: while there are any, the reaper wakes to drop the expired ones.
    subscribing: Mutex<HashMap<u128, std::time::Instant>>,
    /// Set once this process grants a lease: only then are spare lease channels kept.
    granting: AtomicBool,
    /// Leases closed while holders of theirs were ending, by key: how many of those have not
    /// exited yet.
    ending: Mutex<HashMap<u64, usize>>,
}

/// Lease channels kept ready, so that a send makes no channel and wakes no thread.
const SPARE_LEASES: usize = 64;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The reaper of this process (a forked child builds its own).
static REAPER: ForkLocal<OnceCell<Reaper>> = ForkLocal::new(OnceCell::new);

/// The reaper of this process, started on first use (in a forked child too: the parent's
/// thread is not there).
pub(super) fn reaper() -> Result<&'static Reaper> {
    REAPER.get().get_or_try_init(|| {
        // Before any lease exists: a forked child closes its copies of this process's leases.
        crate::fork::on_fork_child(super::close_inherited_leases);
        crate::sys::raise_descriptor_limit();
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(|e| io_error(e.into()))?;
        let bell = crate::sys::bell().map_err(io_error)?;
        epoll::add(&epoll, &bell, epoll::EventData::new_u64(BELL), epoll::EventFlags::IN)
            .map_err(|e| io_error(e.into()))?;
        std::thread::Builder::new().name("cuda-mp-reaper".into()).spawn(reap)?;
        Ok(Reaper {
            epoll,
            bell,
            wake_pending: AtomicBool::new(false),
            watched: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(BELL + 1),
            spares: Mutex::new(Vec::new()),
            subscribing: Mutex::new(HashMap::new()),
            granting: AtomicBool::new(false),
            ending: Mutex::new(HashMap::new()),
        })
    })
}

impl Reaper {
    /// Watches `source` from now on (any thread may add to the set while the reaper waits).
    fn watch(&self, what: Watched, source: Source) -> io::Result<u64> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let pipe = match &source {
            Source::Pipe(fd) => crate::sys::file_identity(fd.as_fd()),
            Source::Socket(_) | Source::Subscriber(_) | Source::Process(_) => None,
        };
        let entry = Entry { what, source: source.clone(), partial: Vec::new(), pipe, holders: Holders::default() };
        lock(&self.watched).insert(id, entry);
        if let Err(e) = epoll::add(&self.epoll, source.fd(), epoll::EventData::new_u64(id), epoll::EventFlags::IN) {
            lock(&self.watched).remove(&id);
            return Err(e.into());
        }
        Ok(id)
    }

    fn wake(&self) {
        if !self.wake_pending.swap(true, Ordering::SeqCst) {
            crate::sys::ring(&self.bell);
        }
    }

    /// A new lease channel: a spare one already watched when there is one (no system call on
    /// the send path), else a new one.
    pub(super) fn new_lease(&'static self) -> Result<Lease> {
        self.granting.store(true, Ordering::Relaxed);
        let spare = {
            let mut spares = lock(&self.spares);
            let spare = spares.pop();
            if spares.len() < SPARE_LEASES / 4 {
                self.wake();
            }
            spare
        };
        if let Some((id, tx)) = spare {
            let lease = Lease::new(tx);
            if let Some(entry) = lock(&self.watched).get_mut(&id) {
                entry.what = Watched::Lease(lease.key());
            }
            return Ok(lease);
        }
        let (rx, tx) = crate::sys::lease_pipe().map_err(io_error)?;
        let lease = Lease::new(Arc::new(tx));
        if self.watch(Watched::Lease(lease.key()), Source::Pipe(Arc::new(rx))).is_err() {
            // Cannot watch it (out of descriptors): refuse the grant rather than never release.
            return Err(io_error(io::Error::other("cannot watch a new lease channel")));
        }
        Ok(lease)
    }
}

/// How many spare lease channels (pipes whose two ends this process holds) the reaper keeps
/// now; none before it started. The reaper tops them up on its own thread, at any time: a
/// count of this process's descriptors leaves them out.
#[cfg(any(test, feature = "testing"))]
pub(crate) fn spare_leases() -> usize {
    REAPER.get().get().map_or(0, |reaper| lock(&reaper.spares).len())
}

/// In a forked child: closes its copies of the parent's spare lease channels and of the
/// reading ends the parent's reaper watches (see `close_inherited_leases`). Open in a child
/// that outlives the parent, a lease's reading end would hide the parent's end from its
/// holders (their records pile up unread, and their exits wait for them), and a revocation
/// socket would hide it from the owners it subscribed to. (Its ends of its subscribers'
/// sockets, shared with the owner's list and the courier, are closed as `NotInherited`.)
pub(super) fn close_inherited() {
    let Some(reaper) = REAPER.inherited().and_then(OnceCell::get) else { return };
    // What a parent's thread held locked at the fork is left alone.
    fn take_unless_locked<T: Default>(m: &Mutex<T>) -> T {
        m.try_lock().map(|mut v| std::mem::take(&mut *v)).unwrap_or_default()
    }
    let spares = take_unless_locked(&reaper.spares);
    spares.into_iter().for_each(|(_, tx)| crate::sys::close_inherited_shared(tx));
    for entry in take_unless_locked(&reaper.watched).into_values() {
        match entry.source {
            Source::Pipe(fd) | Source::Process(fd) => crate::sys::close_inherited_shared(fd),
            Source::Socket(socket) => crate::sys::close_inherited_shared(socket),
            // Closed as `NotInherited` (by number); never dropped here, where it may be the
            // last copy: its drop would close that number a second time.
            Source::Subscriber(socket) => std::mem::forget(socket),
        }
    }
}

/// The reading ends this process's reaper watches (lease pipes and revocation sockets), by
/// number.
#[cfg(test)]
pub(super) fn watched_descriptors() -> Vec<std::os::fd::RawFd> {
    use std::os::fd::AsRawFd;
    reaper().map_or_else(|_| Vec::new(), |r| lock(&r.watched).values().map(|e| e.source.fd().as_raw_fd()).collect())
}

/// Subscribes to the revocations of owner `owner` through `lease`, one of its leases: the
/// sending end of a fresh socket pair waits at this process's home for the owner to fetch
/// (a pipe carries no descriptor), and the lease says where.
pub(super) fn subscribe(owner: u128, lease: &Lease) -> bool {
    let Ok(reaper) = reaper() else { return false };
    // A lease this process reads is no way to another owner: only a record edited to name
    // another process's storage comes with one (its mapping would be cached on a
    // subscription to this process itself, whose revocations never name it).
    let this = crate::sys::file_identity(lease.tx.as_fd());
    if this.is_none() || lock(&reaper.watched).values().any(|e| e.pipe == this) {
        return false;
    }
    // Each waits for its owner's fetch until it expires: a peer that names ever new owners
    // (or owners that never fetch) gets no more than this many, and no mappings cached.
    if crate::handover::expiring_deposits() >= MAX_PENDING_SUBSCRIPTIONS {
        return false;
    }
    let Ok((tx, rx)) = Socket::pair() else { return false };
    let Ok(ticket) = crate::handover::ticket() else { return false };
    // An owner that died before it fetched the subscription never will: when the deposit
    // expires its socket closes, which ends the subscription as the owner's death does.
    let expires = std::time::Instant::now() + crate::handover::SUBSCRIPTION_TTL;
    if crate::handover::append_expiring(&ticket, Arc::new(tx), crate::handover::SUBSCRIPTION_TTL, true).is_err() {
        return false;
    }
    // A lease that takes no record (its owner gone, or not a lease's writing end) is no way to
    // the owner: its socket is not left waiting for a fetch that cannot come. Nor does the
    // import wait for an owner whose pipe is full: a later import asks again.
    if !matches!(Control::Link(ticket.clone()).try_send(&lease.tx), Ok(true))
        || reaper.watch(Watched::Revocations(owner), Source::Socket(Arc::new(rx))).is_err()
    {
        crate::handover::withdraw(&ticket);
        return false;
    }
    lock(&reaper.subscribing).insert(owner, expires);
    // The reaper may be waiting without a deadline.
    crate::sys::ring(&reaper.bell);
    true
}

/// A revocation socket watched as owner `owner`'s, as a subscription makes one: the owner's end.
#[cfg(test)]
pub(super) fn watch_revocations(owner: u128) -> Socket {
    let (tx, rx) = Socket::pair().unwrap();
    reaper().unwrap().watch(Watched::Revocations(owner), Source::Socket(Arc::new(rx))).unwrap();
    tx
}

/// How long the reaper may wait: until the next subscription's deposit expires, if any.
fn next_expiry(reaper: &Reaper) -> Option<std::time::Duration> {
    let now = std::time::Instant::now();
    let mut subscribing = lock(&reaper.subscribing);
    if subscribing.values().any(|&e| e <= now) {
        subscribing.retain(|_, e| *e > now);
        drop(subscribing);
        crate::handover::expire();
        subscribing = lock(&reaper.subscribing);
    }
    // A millisecond past the deadline, so that the deposit has expired when the wait ends.
    subscribing.values().min().map(|e| e.saturating_duration_since(now) + std::time::Duration::from_millis(1))
}

/// Subscriptions (and spawn arguments) waiting for a fetch at most, before a receiver stops
/// subscribing to new owners' revocations.
const MAX_PENDING_SUBSCRIPTIONS: usize = 256;

fn reap() {
    super::courier::this_is_the_reaper();
    let Ok(reaper) = reaper() else { return };
    let mut events = Vec::with_capacity(256);
    loop {
        events.clear();
        let timeout = next_expiry(reaper)
            .map(|d| rustix::time::Timespec { tv_sec: d.as_secs() as _, tv_nsec: d.subsec_nanos() as _ });
        if let Err(e) = epoll::wait(&reaper.epoll, rustix::buffer::spare_capacity(&mut events), timeout.as_ref()) {
            if e == rustix::io::Errno::INTR {
                continue;
            }
            tracing::error!(error = %e, "the lease watcher failed: leases are no longer released");
            return;
        }
        for event in &events {
            let id = event.data.u64();
            if id == BELL {
                crate::sys::silence(&reaper.bell);
                reaper.wake_pending.store(false, Ordering::SeqCst);
                continue;
            }
            let Some(source) = lock(&reaper.watched).get(&id).map(|e| e.source.clone()) else { continue };
            let open = match &source {
                Source::Pipe(pipe) => drain_lease(reaper, id, pipe),
                Source::Socket(socket) => drain_revocations(reaper, id, socket),
                Source::Subscriber(socket) => drain_revocations(reaper, id, socket),
                // Readable: the process has exited.
                Source::Process(_) => false,
            };
            if !open {
                closed(reaper, id);
            }
        }
        refill_spares(reaper);
    }
}

/// Reads every record waiting on lease pipe `id`; false at its end (every holder's copy
/// closed).
fn drain_lease(reaper: &Reaper, id: u64, pipe: &OwnedFd) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        let n = match crate::sys::read_available(pipe, &mut buf) {
            Ok(Some(0)) => return true,
            Ok(Some(n)) => n,
            Ok(None) | Err(_) => return false,
        };
        // Read at the time of each read: a spare may have become a lease meanwhile.
        let (what, records) = {
            let mut watched = lock(&reaper.watched);
            let Some(entry) = watched.get_mut(&id) else { return true };
            entry.partial.extend_from_slice(&buf[..n]);
            let (mut records, used, stray) = Control::parse(&entry.partial);
            records.retain(|record| match record {
                Control::Holder(holder) => {
                    note_holder(&mut entry.holders, *holder);
                    false
                }
                _ => true,
            });
            if stray {
                // A byte that starts no record of ours: the records before it count (other
                // holders' among them: a lost `Retain` would free what a holder maps), what
                // follows it in this read does not.
                entry.partial.clear();
            } else {
                entry.partial.drain(..used);
            }
            (entry.what, records)
        };
        let Watched::Lease(key) = what else { continue };
        for record in records {
            match record {
                Control::Release(index, count) => lease_message(key, index, Change::Release(count)),
                Control::Retain(index) => lease_message(key, index, Change::Retain),
                Control::Forget(index) => super::connection::forgotten(key, index),
                Control::Holder(_) => {}
                // Fetched on the linker's thread, for no longer than the deposit lasts: why, and
                // the 64 per lease, in README.md, "States of a storage".
                Control::Link(ticket) => super::courier::link(key, move || {
                    let socket = crate::handover::fetch_within(&ticket, crate::handover::SUBSCRIPTION_TTL)
                        .ok()
                        .and_then(|(fds, _)| fds.into_iter().next());
                    if let Some(socket) = socket.and_then(|fd| Socket::from_fd(fd).ok()) {
                        owner().subscribe(socket);
                    }
                }),
            }
        }
    }
}

/// Adds `holder` to a lease's named holders: one that names no start time (which would stand
/// for any process with its pid) or another pid namespace is not waited for; with the list
/// full, holders that have exited since make room, looked for at most every 100 ms (each look
/// reads `/proc` for every holder, under the lock of what the reaper watches).
fn note_holder(holders: &mut Holders, holder: Holder) {
    let named = &mut holders.named;
    if holder.start == 0 || holder.namespace != crate::sys::pid_namespace() || named.contains(&holder) {
        return;
    }
    let now = std::time::Instant::now();
    if named.len() >= MAX_HOLDERS && holders.pruned.is_none_or(|at| now.duration_since(at) >= PRUNE_EVERY) {
        holders.pruned = Some(now);
        named.retain(|h| !crate::sys::process_gone(h.pid, h.start));
    }
    if named.len() < MAX_HOLDERS {
        named.push(holder);
    }
}

/// How often a lease's full list of holders is looked through for those that exited.
const PRUNE_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// Reads every message waiting on revocation socket `id`; false at its end (the owner is gone,
/// or, for a subscriber's socket, whose messages are discarded (cuda-mp sends none), the
/// subscriber).
fn drain_revocations(reaper: &Reaper, id: u64, socket: &Socket) -> bool {
    loop {
        let what = || lock(&reaper.watched).get(&id).map(|e| e.what);
        let message = match socket.recv(lease::MESSAGE_BYTES, Wait::Not) {
            Ok(Some(message)) => message,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
            // Cut short (the owner's table, its descriptor dropped at this process's limit):
            // a subscription without the table cannot check a `Recheck`, so it ends, as at the
            // owner's exit (a later import subscribes again). A subscriber's are discarded.
            Err(e) if e.kind() == io::ErrorKind::InvalidData => match what() {
                Some(Watched::Revocations(_)) => return false,
                _ => continue,
            },
            Ok(None) | Err(_) => return false,
        };
        let Some(Watched::Revocations(owner)) = what() else { continue };
        match postcard::from_bytes::<Revocation>(&message.bytes) {
            Ok(Revocation::Table) => {
                // The owner fetched the subscription: nothing of it is left to expire.
                lock(&reaper.subscribing).remove(&owner);
                // A table that does not map (or that every holder could write) ends it too.
                let Some(memory) = lease::table_memory(message.fds) else { return false };
                table_arrived(owner, Table::from_memory(memory));
            }
            Ok(Revocation::Storages(indices)) => revoke(owner, Some(&indices)),
            Ok(Revocation::Recheck) => recheck(owner),
            Err(_) => {}
        }
    }
}

/// Watches this process's end of subscriber `n`'s revocation socket, so that a subscriber
/// that exits is forgotten (and its socket closed) at once, not at the next revocation.
pub(super) fn watch_subscriber(n: u64, socket: SubscriberEnd) {
    if let Ok(reaper) = reaper() {
        let _ = reaper.watch(Watched::Subscriber(n), Source::Subscriber(socket));
    }
}

/// Watched reading end `id` is at its end: stops watching it, and releases what it stood for.
fn closed(reaper: &Reaper, id: u64) {
    let removed = lock(&reaper.watched).remove(&id);
    if let Some(entry) = removed {
        let _ = epoll::delete(&reaper.epoll, entry.source.fd());
        match entry.what {
            Watched::Lease(key) => lease_ended(reaper, key, &entry.holders.named),
            Watched::Exit(key) => {
                let mut ending = lock(&reaper.ending);
                let left = ending.get_mut(&key).map(|n| {
                    *n -= 1;
                    *n
                });
                if left == Some(0) {
                    ending.remove(&key);
                    drop(ending);
                    lease_closed(key);
                }
            }
            Watched::Revocations(owner) => owner_gone(owner),
            Watched::Subscriber(n) => owner().subscribers.retain(|(k, _)| *k != n),
            Watched::Spare => {}
        }
    }
}

/// Lease `key` has closed: releases what it carried, once every holder that was ending then
/// has exited. A process killed (or exiting) closes its descriptors from the last opened to
/// the first, so a lease it received after the CUDA driver opened its files closes before
/// the driver stops the GPU work it queued, which may still write to the memory for
/// milliseconds: freed then, or handed out again by a caching allocator, that memory would be
/// written by a dead process.
fn lease_ended(reaper: &Reaper, key: u64, holders: &[Holder]) {
    let mut waiting = 0;
    for holder in holders {
        let Some(pidfd) = crate::sys::ending(holder.pid, holder.start) else { continue };
        // (Where it cannot be watched, out of descriptors, it is not waited for.)
        if reaper.watch(Watched::Exit(key), Source::Process(Arc::new(pidfd))).is_ok() {
            waiting += 1;
        }
    }
    if waiting == 0 {
        lease_closed(key);
    } else {
        // Counted before any of those exits is read: this thread is the one that reads them.
        lock(&reaper.ending).insert(key, waiting);
    }
}

fn refill_spares(reaper: &Reaper) {
    if !reaper.granting.load(Ordering::Relaxed) {
        return;
    }
    let missing = SPARE_LEASES.saturating_sub(lock(&reaper.spares).len());
    for _ in 0..missing {
        let Ok((rx, tx)) = crate::sys::lease_pipe() else { return };
        let Ok(id) = reaper.watch(Watched::Spare, Source::Pipe(Arc::new(rx))) else { return };
        lock(&reaper.spares).push((id, Arc::new(tx)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn this() -> Holder {
        Holder::this().expect("this process's start time and pid namespace")
    }

    #[test]
    fn a_lease_names_holders_once_never_without_a_start_and_makes_room_from_those_that_exited() {
        let mut holders = Holders::default();
        note_holder(&mut holders, Holder { start: 0, ..this() });
        note_holder(&mut holders, Holder { namespace: this().namespace + 1, ..this() });
        assert!(holders.named.is_empty(), "no start time, or another namespace: not kept");
        note_holder(&mut holders, this());
        note_holder(&mut holders, this());
        assert_eq!(holders.named, [this()], "once");
        // Full of processes that are gone (this pid, other start times): a new one makes room.
        holders.named = (1..=MAX_HOLDERS as u64).map(|i| Holder { start: this().start + i, ..this() }).collect();
        let newcomer = Holder { pid: 1, start: 1, ..this() };
        note_holder(&mut holders, newcomer);
        assert_eq!(holders.named, [newcomer]);
    }
}
