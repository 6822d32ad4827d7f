//! The lifetime protocol on the CPU, in one process: owners of other processes are simulated
//! by storage ids with foreign owner tokens, and their liveness tables by shared memory made
//! here. Cross-process behaviour of the same protocol is tested in tests/ with real processes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use super::export::{Change, Grant, lease_message};
use super::import::{owner_gone, recheck, revoke, table_arrived};
use super::lease::CacheTicket;
use super::table::{Table, owner};
use super::*;
use crate::wire;

/// Memory that counts how often it was closed.
struct Mapping {
    closed: Arc<AtomicU64>,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        self.closed.fetch_add(1, Ordering::SeqCst);
    }
}

/// Waits (10 s at most, failing with `what`) until `freed` counts `n` frees, which the reaper
/// and the disposer make on threads of their own.
fn wait_freed(freed: &AtomicU64, n: u64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while freed.load(Ordering::SeqCst) < n {
        assert!(Instant::now() < deadline, "{what}");
        let _ = wait_for_lifetime(Duration::from_millis(50), |_| false);
    }
}

/// The lease a grant made outside a channel carries.
fn lease_of(g: &Grant) -> &Lease {
    match &g.claim {
        Claim::Lease { lease, .. } => lease,
        other => panic!("a grant outside a channel made {other:?}"),
    }
}

fn foreign_owner() -> u128 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    0xfeed_0000_0000_0000_0000_0000_0000_0000 | NEXT.fetch_add(1, Ordering::SeqCst) as u128
}

/// A table of `slots` cells in which `marked` slots hold `index`.
fn table_with(slots: usize, marked: &[(u32, u64)]) -> Table {
    let cells = crate::os::SharedCells::zeroed(slots).unwrap();
    for &(slot, index) in marked {
        cells.cell(slot).unwrap().store(index, Ordering::SeqCst);
    }
    Table::from_memory(cells.memory().clone())
}

fn imported(owner: u128, index: u64) -> (StorageId, Arc<AtomicU64>, Arc<Mapping>) {
    let closed = Arc::new(AtomicU64::new(0));
    let id = StorageId::foreign(owner, index);
    let handle = import(id, "fake", |_| None, || Ok(Arc::new(Mapping { closed: closed.clone() }))).unwrap();
    (id, closed, handle)
}

#[test]
fn a_second_import_reuses_the_mapping_and_opens_nothing() {
    let owner = foreign_owner();
    let (id, _, first) = imported(owner, 1);
    let again = import(id, "fake", |_| None, || -> Result<Arc<Mapping>> { panic!("opened twice") }).unwrap();
    assert!(Arc::ptr_eq(&first, &again));
}

#[test]
fn a_parked_mapping_is_cached_while_the_owner_holds_it_and_evicted_on_revocation() {
    let owner = foreign_owner();
    state().owner_tables.insert(owner, Some(table_with(8, &[(3, 1)])));
    let (id, closed, handle) = imported(owner, 1);
    let memory: AnyStorage = handle;
    assert!(park_idle(id, "fake", Some(CacheTicket { slot: 3 }), memory).is_none(), "cached");
    // A new message for it revives the cached mapping: nothing is opened.
    let revived = import(
        id,
        "fake",
        |m| m.downcast::<Mapping>().ok(),
        || -> Result<Arc<Mapping>> { panic!("the cached mapping should be revived") },
    )
    .unwrap();
    assert!(park_idle(id, "fake", Some(CacheTicket { slot: 3 }), revived).is_none());
    revoke(owner, Some(&[1]));
    assert_eq!(closed.load(Ordering::SeqCst), 1, "revocation closes the cached mapping");
    assert!(!state().idle.keys().any(|(i, _)| *i == id));
    owner_gone(owner);
}

#[test]
fn a_mapping_of_a_storage_the_owner_dropped_is_not_cached() {
    let owner = foreign_owner();
    state().owner_tables.insert(owner, Some(table_with(8, &[(3, 0)])));
    let (id, closed, handle) = imported(owner, 1);
    let back = park_idle(id, "fake", Some(CacheTicket { slot: 3 }), handle);
    assert!(back.is_some(), "handed back to be closed");
    drop(back);
    assert_eq!(closed.load(Ordering::SeqCst), 1);
    // Without a ticket, nothing is ever cached.
    let (id, closed, handle) = imported(owner, 2);
    drop(park_idle(id, "fake", None, handle));
    assert_eq!(closed.load(Ordering::SeqCst), 1);
    owner_gone(owner);
}

#[test]
fn mappings_parked_before_the_table_arrives_are_checked_when_it_does() {
    let owner = foreign_owner();
    // Subscribed, table on its way.
    state().owner_tables.insert(owner, None);
    let (live, live_closed, h1) = imported(owner, 1);
    let (dead, dead_closed, h2) = imported(owner, 2);
    assert!(park_idle(live, "fake", Some(CacheTicket { slot: 0 }), h1).is_none());
    assert!(park_idle(dead, "fake", Some(CacheTicket { slot: 1 }), h2).is_none());
    // The owner still holds storage 1 (slot 0) but dropped storage 2 (slot 1).
    table_arrived(owner, table_with(4, &[(0, 1)]));
    assert_eq!(dead_closed.load(Ordering::SeqCst), 1, "the dropped storage's mapping is evicted");
    assert_eq!(live_closed.load(Ordering::SeqCst), 0, "the held one stays cached");
    // The owner goes away: everything of it is evicted.
    owner_gone(owner);
    assert_eq!(live_closed.load(Ordering::SeqCst), 1);
}

/// A recheck (the owner dropped more storages than it listed) closes the cached mappings whose
/// slot no longer holds them, a slot taken by another storage since included, and keeps the
/// rest; without the owner's table it closes them all.
#[test]
fn a_recheck_closes_what_the_owners_table_no_longer_holds() {
    let owner = foreign_owner();
    let cells = crate::os::SharedCells::zeroed(4).unwrap();
    for (slot, index) in [(0, 1), (1, 2), (2, 3)] {
        cells.cell(slot).unwrap().store(index, Ordering::SeqCst);
    }
    state().owner_tables.insert(owner, Some(Table::from_memory(cells.memory().clone())));
    let parked: Vec<Arc<AtomicU64>> = (1..=3)
        .map(|index| {
            let (id, closed, handle) = imported(owner, index);
            let slot = index as u32 - 1;
            assert!(park_idle(id, "fake", Some(CacheTicket { slot }), handle).is_none(), "cached");
            closed
        })
        .collect();
    // The owner dropped storage 2 and gave storage 3's slot to storage 9.
    cells.cell(1).unwrap().store(0, Ordering::SeqCst);
    cells.cell(2).unwrap().store(9, Ordering::SeqCst);
    recheck(owner);
    // Off the reaper's thread, evicted mappings close before `recheck` returns.
    let closed = |n: usize| parked[n].load(Ordering::SeqCst);
    assert_eq!((closed(0), closed(1), closed(2)), (0, 1, 1), "only the held storage stays cached");
    // No table (its memory could not be mapped): nothing can be told apart, all are closed.
    state().owner_tables.insert(owner, None);
    recheck(owner);
    assert_eq!(closed(0), 1, "a recheck without a table closes every cached mapping");
    owner_gone(owner);
}

/// A table that every holder could write (or that does not map) ends the subscription, as
/// the owner's exit does: nothing stays cached on the word of a table this process cannot
/// read, and a later `Recheck` cannot find the owner without one.
#[test]
fn a_table_that_does_not_map_ends_the_subscription() {
    let owner = foreign_owner();
    state().owner_tables.insert(owner, None);
    let (id, closed, handle) = imported(owner, 1);
    assert!(park_idle(id, "fake", Some(CacheTicket { slot: 0 }), handle).is_none(), "cached meanwhile");
    let socket = super::reaper::watch_revocations(owner);
    let loose = crate::sys::MemoryFile::zeroed(super::table::TABLE_BYTES).unwrap();
    super::lease::send(&socket, &super::lease::Revocation::Table, &[&loose], crate::sys::Wait::Not).unwrap();
    let ended = wait_for_lifetime(Duration::from_secs(10), |_| closed.load(Ordering::SeqCst) == 1);
    assert!(ended.is_ok(), "the mapping cached on the subscription stayed");
    assert!(!state().owner_tables.contains_key(&owner), "the subscription is over");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.peer_closed() {
        assert!(Instant::now() < deadline, "the subscriber kept its end of the socket");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_close_in_progress_makes_a_new_import_of_the_same_storage_wait() {
    let owner = foreign_owner();
    let id = StorageId::foreign(owner, 9);
    let started = Arc::new(Barrier::new(2));
    let closer = {
        let started = started.clone();
        std::thread::spawn(move || {
            close_import(id, "fake", || {
                started.wait();
                std::thread::sleep(Duration::from_millis(200));
            })
        })
    };
    started.wait();
    let t = Instant::now();
    let closed = Arc::new(AtomicU64::new(0));
    import(id, "fake", |_| None, || Ok(Arc::new(Mapping { closed: closed.clone() }))).unwrap();
    assert!(t.elapsed() >= Duration::from_millis(150), "the open waited for the close");
    closer.join().unwrap();
}

#[test]
fn opens_of_different_storages_run_in_parallel_and_the_same_storage_opens_once() {
    let owner = foreign_owner();
    let opens = Arc::new(AtomicU64::new(0));
    let delay = Duration::from_millis(300);
    let t = Instant::now();
    let threads: Vec<_> = [1u64, 2, 1, 2]
        .into_iter()
        .map(|index| {
            let opens = opens.clone();
            std::thread::spawn(move || {
                let id = StorageId::foreign(owner, index);
                import(
                    id,
                    "fake",
                    |_| None,
                    || {
                        opens.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(delay);
                        Ok(Arc::new(index))
                    },
                )
                .unwrap()
            })
        })
        .collect();
    // Meanwhile the lock is free: counters answer at once.
    std::thread::sleep(Duration::from_millis(50));
    let q = Instant::now();
    let _ = lifetime_stats();
    assert!(q.elapsed() < Duration::from_millis(100), "the state lock was held across an open");
    let handles: Vec<Arc<u64>> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(t.elapsed() < delay * 2, "two opens ran one after the other: {:?}", t.elapsed());
    assert_eq!(opens.load(Ordering::SeqCst), 2, "each storage opened once");
    assert!(Arc::ptr_eq(&handles[0], &handles[2]) && Arc::ptr_eq(&handles[1], &handles[3]));
}

#[test]
fn a_failed_open_leaves_nothing_behind() {
    let owner = foreign_owner();
    let id = StorageId::foreign(owner, 4);
    let r = import(id, "fake", |_| None, || -> Result<Arc<u8>> { Err(Error::Malformed("no".into())) });
    assert!(r.is_err());
    let s = state();
    assert!(!s.opening.contains_key(&(id, "fake")) && !s.imported.contains_key(&(id, "fake")));
}

/// Claims per message lease, as the owner counts them, through the reaper's entry points.
#[test]
fn claims_per_lease_are_released_once_and_forged_releases_are_ignored() {
    let reaper = reaper::reaper().unwrap();
    let (a, b) = (StorageId::new_local(), StorageId::new_local());
    let freed = Arc::new(AtomicU64::new(0));
    let keep = |freed: &Arc<AtomicU64>| -> AnyStorage { Arc::new(Mapping { closed: freed.clone() }) };
    // One message carries both storages under one lease.
    let (grants, _fds) = wire::encode_scope(|| {
        let ga = grant(a, 16, LeaseMode::Counted, false, || keep(&freed), None).unwrap();
        let gb = grant(b, 16, LeaseMode::Counted, false, || keep(&freed), None).unwrap();
        (ga, gb)
    });
    let key = lease_of(&grants.0).key();
    assert_eq!(key, lease_of(&grants.1).key(), "one lease per message");
    assert_eq!(state().covers[&key].len(), 2);
    // A forged release of a storage the lease does not cover changes nothing.
    lease_message(key, 0xdead, Change::Release(1));
    lease_message(key + 1_000_000, a.index(), Change::Release(1));
    assert!(state().exported.contains_key(&a) && state().exported.contains_key(&b));
    // Forwarding adds a claim; two releases then free `a`, a third is ignored.
    lease_message(key, a.index(), Change::Retain);
    lease_message(key, a.index(), Change::Release(1));
    assert_eq!(freed.load(Ordering::SeqCst), 0, "one claim on a is left");
    lease_message(key, a.index(), Change::Release(1));
    assert_eq!(freed.load(Ordering::SeqCst), 1, "a is freed at its last release");
    lease_message(key, a.index(), Change::Release(1));
    // The lease closes: what it still covers (b) is released, by the reaper, which watches the
    // lease channel (closing it here too would count the lease twice).
    drop(grants);
    wait_freed(&freed, 2, "b was never freed");
    assert_eq!(freed.load(Ordering::SeqCst), 2);
    assert!(!state().covers.contains_key(&key));
    let _ = reaper;
}

#[test]
fn a_lease_channel_carries_releases_to_the_reaper() {
    let id = StorageId::new_local();
    let freed = Arc::new(AtomicU64::new(0));
    let keep: AnyStorage = Arc::new(Mapping { closed: freed.clone() });
    let (g, _fds) = wire::encode_scope(|| grant(id, 16, LeaseMode::Counted, false, move || keep, None).unwrap());
    // A holder's claim, ended by dropping its cover: the release travels on the channel.
    let cover = Cover::new(lease_of(&g).clone(), id, LeaseMode::Counted);
    drop(g);
    drop(cover);
    wait_freed(&freed, 1, "the release never arrived");
}

/// Every holder of a per-storage lease holds a copy of one channel: a `Release` or `Retain`
/// sent on it, by any holder, forged or repeated, must not end the claim that all of them share.
#[test]
fn releases_on_a_per_storage_lease_free_nothing_that_other_holders_use() {
    let id = StorageId::new_local();
    let freed = Arc::new(AtomicU64::new(0));
    let keep: AnyStorage = Arc::new(Mapping { closed: freed.clone() });
    let g = wire::encode_scope(|| grant(id, 16, LeaseMode::Shared, true, move || keep, None).unwrap()).0;
    let key = lease_of(&g).key();
    // Two holders of the storage: each has a copy of the lease.
    let (first, second) = (lease_of(&g).clone(), lease_of(&g).clone());
    drop(g);
    for _ in 0..3 {
        lease_message(key, id.index(), Change::Release(1));
    }
    lease_message(key, id.index(), Change::Retain);
    assert!(state().exported.contains_key(&id), "a release on a per-storage lease ended the shared claim");
    assert_eq!(freed.load(Ordering::SeqCst), 0);
    // The owner's handles go; the holders' copies still claim it.
    handles_dropped(id);
    drop(first);
    assert_eq!(freed.load(Ordering::SeqCst), 0, "freed while a holder still holds the lease");
    // The last copy closes: the reaper sees the channel close and frees it, once (the retain
    // above added nothing that would keep it).
    drop(second);
    wait_freed(&freed, 1, "the storage was never freed");
    assert_eq!(freed.load(Ordering::SeqCst), 1);
    assert!(!state().exported.contains_key(&id));
}

#[test]
fn a_panic_inside_an_open_leaves_the_storage_openable() {
    let id = StorageId::foreign(foreign_owner(), 1);
    let panicked = std::panic::catch_unwind(|| {
        let _ = import(id, "fake", |_| None, || -> Result<Arc<Mapping>> { panic!("the driver's open panicked") });
    });
    assert!(panicked.is_err());
    assert!(!state().opening.contains_key(&(id, "fake")), "the storage is left marked as opening");
    let closed = Arc::new(AtomicU64::new(0));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(import(id, "fake", |_| None, || Ok(Arc::new(Mapping { closed }))).is_ok());
    });
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(true), "a later import of it waits for ever");
}

#[test]
fn a_condition_of_wait_for_lifetime_may_call_cuda_mp() {
    // The condition runs without the lifetime lock: reading the counters inside it does not
    // deadlock.
    let stats = wait_for_lifetime(Duration::from_secs(10), |s| lifetime_stats().freed_storages >= s.freed_storages);
    assert!(stats.is_ok());
}

/// Two holders of one storage, each through a connection of its own: releases on one
/// connection's lease, forged, repeated or larger than what it holds, end only the claims
/// counted there; the other holder's claim keeps the storage.
#[test]
fn releases_on_one_connection_free_nothing_that_another_connection_holds() {
    let id = StorageId::new_local();
    let freed = Arc::new(AtomicU64::new(0));
    let keep: AnyStorage = Arc::new(Mapping { closed: freed.clone() });
    let (a, b) = (Arc::new(Connection::default()), Arc::new(Connection::default()));
    let on = |connection: &Arc<Connection>| {
        let keep = keep.clone();
        let (grant, claims, introduce) =
            wire::encode_scope_on(connection, || grant(id, 16, LeaseMode::Shared, true, move || keep, None).unwrap());
        assert!(matches!(grant.claim, Claim::Connection { .. }), "counted on the connection, whatever the kind");
        assert_eq!(claims.len(), 1);
        (claims[0].0, introduce)
    };
    let (key_a, intro_a) = on(&a);
    let (key_b, intro_b) = on(&b);
    assert_ne!(key_a, key_b, "one lease per connection");
    assert_eq!((intro_a.len(), intro_b.len()), (1, 1), "a connection's first message introduces its lease");
    // A second message on `a` counts a second claim on the same lease, and introduces it again
    // until a frame that did is written.
    let (again, intro) = on(&a);
    assert_eq!((again, intro.len()), (key_a, 1));
    assert_ne!(intro[0].name.key, key_a, "a lease's name is not its key here");
    a.introduced(intro[0].name.key);
    let (_, intro) = on(&a);
    assert!(intro.is_empty(), "introduced once written");
    // `a` holds three claims: many releases on its lease end those, and nothing of `b`'s.
    lease_message(key_a, id.index(), Change::Release(1_000));
    lease_message(key_a, id.index(), Change::Release(1));
    lease_message(key_a, 0xdead, Change::Release(1));
    assert!(state().exported.contains_key(&id), "releases on one connection ended another's claim");
    assert_eq!(freed.load(Ordering::SeqCst), 0);
    // `b`'s one claim, released (twice: the second is ignored), frees it.
    lease_message(key_b, id.index(), Change::Release(1));
    lease_message(key_b, id.index(), Change::Release(1));
    assert!(!state().exported.contains_key(&id));
    drop(keep);
    wait_freed(&freed, 1, "the storage was never freed");
    assert_eq!(freed.load(Ordering::SeqCst), 1);
    drop((intro_a, intro_b));
}

/// How long the free of a storage `b` takes once its last holder goes, while a holder of
/// another storage `a` has written `links` `Link` records on `a`'s lease, in one write, naming a
/// home that never answers.
fn time_to_free_behind_links(links: u128) -> Duration {
    use super::lease::Control;
    let name = format!("cuda-mp-silent-{:032x}", crate::sys::random_u128());
    let _silent = crate::sys::Listening::bind_abstract(&name).unwrap(); // never accepts
    let (a, b) = (StorageId::new_local(), StorageId::new_local());
    let freed = Arc::new(AtomicU64::new(0));
    let keep_a: AnyStorage = Arc::new(Mapping { closed: Arc::new(AtomicU64::new(0)) });
    let keep_b: AnyStorage = Arc::new(Mapping { closed: freed.clone() });
    let ga = wire::encode_scope(|| grant(a, 16, LeaseMode::Counted, false, move || keep_a, None).unwrap()).0;
    let gb = wire::encode_scope(|| grant(b, 16, LeaseMode::Counted, false, move || keep_b, None).unwrap()).0;
    let mut records = Vec::new();
    for token in 0..links {
        let ticket = crate::handover::SpawnTicket { home: name.clone(), token, batch: None };
        records.extend(Control::Link(ticket).record().unwrap());
    }
    crate::sys::write_record(std::os::fd::AsFd::as_fd(&*lease_of(&ga).tx), &records).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    // b's only holder goes: its lease closes, and b is freed on the disposer's thread.
    let start = Instant::now();
    drop(gb);
    wait_freed(&freed, 1, "b was never freed");
    let took = start.elapsed();
    drop(ga);
    took
}

/// A holder subscribes to revocations under a home that never answers (a stopped process, or
/// a name nobody answers under): the fetch of its subscription holds up no free (it held them
/// up for the 30 s of a fetch, before, and then for as long as a subscription's deposit lasts).
#[test]
fn a_subscriber_that_never_answers_holds_up_no_free() {
    let took = time_to_free_behind_links(1);
    assert!(took < Duration::from_millis(900), "b's free waited {took:?} behind a subscriber's fetch");
}

/// A holder that floods its lease with `Link` records naming a home that never answers holds
/// up no free: the fetches run on a thread of their own, at most 64 waiting per lease (eight
/// records held up every free queued behind them for eight seconds, before).
#[test]
fn links_flooding_a_lease_hold_up_no_free() {
    let took = time_to_free_behind_links(8);
    assert!(took < Duration::from_millis(900), "b's free waited {took:?} behind forged Link records");
}

/// A byte that starts no record, after another holder's `Retain` in the same read, loses the
/// stray bytes only: the `Retain` counts, so the storage outlives the first `Release` (the
/// whole read was dropped, before, and the storage freed while the other holder held it).
#[test]
fn a_stray_byte_loses_no_record_read_before_it() {
    use super::lease::Control;
    let id = StorageId::new_local();
    let freed = Arc::new(AtomicU64::new(0));
    let keep: AnyStorage = Arc::new(Mapping { closed: freed.clone() });
    let (g, _fds) = wire::encode_scope(|| grant(id, 16, LeaseMode::Counted, false, move || keep, None).unwrap());
    let lease = lease_of(&g).clone();
    let key = lease.key();
    let mut bytes = Control::Retain(id.index()).record().unwrap();
    bytes.push(0xff);
    crate::sys::write_record(std::os::fd::AsFd::as_fd(&*lease.tx), &bytes).unwrap();
    let counted = || state().covers.get(&key).and_then(|c| c.get(&id.index())).copied();
    let deadline = Instant::now() + Duration::from_secs(5);
    while counted() != Some(2) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(counted(), Some(2), "the Retain before the stray byte counts");
    Control::Release(id.index(), 1).send(&lease.tx).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(freed.load(Ordering::SeqCst), 0, "freed while the other holder's claim stands");
    drop((g, lease));
}

/// Two holders of one storage (they share its lease's pipe) subscribe at once, both `Link`s in
/// one read of the lease: each is fetched and sent the owner's table (a cap of one waiting
/// `Link` per lease dropped the second).
#[test]
fn two_holders_linking_on_one_lease_at_once_are_both_subscribed() {
    use super::lease::Control;
    let id = StorageId::new_local();
    let keep: AnyStorage = Arc::new(Mapping { closed: Arc::new(AtomicU64::new(0)) });
    // Cached: the owner keeps a liveness table, which a subscriber is sent.
    let g = wire::encode_scope(|| grant(id, 16, LeaseMode::Counted, true, move || keep, None).unwrap()).0;
    let mut records = Vec::new();
    let mut subscribers = Vec::new();
    for _ in 0..2 {
        let (tx, rx) = crate::sys::Socket::pair().unwrap();
        let ticket = crate::handover::ticket().unwrap();
        crate::handover::append_expiring(&ticket, Arc::new(tx), crate::handover::SUBSCRIPTION_TTL, true).unwrap();
        records.extend(Control::Link(ticket).record().unwrap());
        subscribers.push(rx);
    }
    crate::sys::write_record(std::os::fd::AsFd::as_fd(&*lease_of(&g).tx), &records).unwrap();
    let told: Vec<bool> = subscribers
        .iter()
        .map(|rx| {
            let until = Instant::now() + Duration::from_secs(3);
            matches!(rx.recv(super::lease::MESSAGE_BYTES, crate::sys::Wait::Until(until)), Ok(Some(_)))
        })
        .collect();
    drop(g);
    assert_eq!(told, [true, true], "each holder that linked was sent the owner's table");
}

/// A sender that exits right after its sends: its lease stays known (later messages of it,
/// still unread, name it) until the receiver has read everything, and then goes.
#[test]
fn a_gone_senders_lease_is_kept_until_the_receiver_forgets_it() {
    let leases = ConnectionLeases::default();
    let (rx, tx) = crate::sys::lease_pipe().unwrap();
    let gone = ConnectionKey { owner: foreign_owner(), key: 1 };
    assert!(leases.adopt(gone, Lease::accept(Arc::new(tx)).unwrap()));
    drop(rx);
    let mut alive = Vec::new();
    for key in 0..40u64 {
        let (rx, tx) = crate::sys::lease_pipe().unwrap();
        alive.push(rx);
        assert!(leases.adopt(ConnectionKey { owner: foreign_owner(), key }, Lease::accept(Arc::new(tx)).unwrap()));
    }
    assert!(leases.get(&gone).is_some(), "adopting sweeps nothing");
    let due = leases.gone_if_due();
    assert_eq!(due, [gone], "only the gone sender's");
    assert!(leases.get(&gone).is_some(), "kept until forgotten");
    leases.forget(&due);
    assert!(leases.get(&gone).is_none());
    assert_eq!(leases.all().len(), 40);
}

/// A lease introduced again under its own name is kept once; under another name, refused.
#[test]
fn a_lease_is_known_under_one_name() {
    let leases = ConnectionLeases::default();
    let (_rx, tx) = crate::sys::lease_pipe().unwrap();
    let name = ConnectionKey { owner: foreign_owner(), key: 1 };
    let lease = Lease::accept(Arc::new(tx)).unwrap();
    assert!(leases.adopt(name, lease.clone()));
    assert!(leases.adopt(name, lease.clone()), "the same introduction again");
    assert!(!leases.adopt(ConnectionKey { owner: name.owner, key: 2 }, lease));
    assert_eq!(leases.all().len(), 1);
}

/// A forged record that names itself as its own segment is refused, not waited on for ever.
#[test]
fn an_import_that_needs_itself_to_open_is_refused() {
    let id = StorageId::foreign(foreign_owner(), 3);
    let got = import::<Mapping>(
        id,
        "fake",
        |_| None,
        || {
            let inner = import::<Mapping>(id, "fake", |_| None, || unreachable!("not opened twice"));
            assert!(matches!(&inner, Err(crate::Error::Malformed(_))), "refused");
            inner
        },
    );
    assert!(got.is_err());
    assert!(!state().opening.contains_key(&(id, "fake")), "and unmarked");
}

/// Two forged records that name each other as their segments, decoded on two threads at once:
/// the import that would close the cycle of waits is refused, so neither waits for ever.
#[test]
fn imports_that_need_each_other_to_open_are_refused() {
    let (a, b) = (StorageId::foreign(foreign_owner(), 4), StorageId::foreign(foreign_owner(), 5));
    let both_opening = Arc::new(Barrier::new(2));
    // Opens `this`, which needs `other`, which (opened here) needs `this` again.
    let open = |this: StorageId, other: StorageId, both_opening: Arc<Barrier>| {
        move || {
            import::<Mapping>(
                this,
                "fake",
                |_| None,
                || {
                    both_opening.wait();
                    import::<Mapping>(
                        other,
                        "fake",
                        |_| None,
                        || import::<Mapping>(this, "fake", |_| None, || unreachable!()),
                    )
                },
            )
        }
    };
    let first = std::thread::spawn(open(a, b, both_opening.clone()));
    let second = std::thread::spawn(open(b, a, both_opening));
    let (first, second) = (first.join().unwrap(), second.join().unwrap());
    let refused = |r: &crate::Result<Arc<Mapping>>| matches!(r, Err(crate::Error::Malformed(_)));
    assert!(refused(&first) && refused(&second), "{:?} {:?}", first.err(), second.err());
    let s = state();
    assert!(!s.opening.contains_key(&(a, "fake")) && !s.opening.contains_key(&(b, "fake")));
    assert!(!s.waiting.values().any(|(id, _)| *id == a || *id == b), "no thread is left marked as waiting");
}

/// The last handle of a mapping whose owner no longer holds the storage is handed back to be
/// closed: until it is closed, a new import of the storage waits, rather than opening a
/// second mapping beside it.
#[test]
fn an_import_waits_for_a_mapping_handed_back_to_be_closed() {
    let id = StorageId::foreign(foreign_owner(), 1);
    let mapping = || Ok(Arc::new(Mapping { closed: Arc::default() }));
    let handle = import::<Mapping>(id, "fake", |_| None, mapping).unwrap();
    // The mapping's memory, apart from the user's handle (which is being dropped).
    let memory: AnyStorage = Arc::new(1u8);
    drop(handle);
    let back = park_idle(id, "fake", None, memory);
    assert!(back.is_some(), "not kept: the owner's table is unknown");
    let opened = Arc::new(AtomicU64::new(0));
    let again = {
        let opened = opened.clone();
        std::thread::spawn(move || {
            import::<Mapping>(
                id,
                "fake",
                |_| None,
                || {
                    opened.fetch_add(1, Ordering::SeqCst);
                    mapping()
                },
            )
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(opened.load(Ordering::SeqCst), 0, "a second mapping was opened before the first was closed");
    close_import(id, "fake", || drop(back));
    assert!(again.join().unwrap().is_ok());
    assert_eq!(opened.load(Ordering::SeqCst), 1, "opened again once closed");
}

/// A forked child closes its copies of the reading ends this process's reaper watches (the
/// lease pipes it reads, its ends of its subscribers' revocation sockets): holders and
/// subscribers see the parent gone when it is, not when its last forked child is.
#[test]
fn a_forked_child_closes_the_reading_ends_its_parent_watches() {
    let open = |fd: std::os::fd::RawFd| std::path::Path::new(&format!("/proc/self/fd/{fd}")).exists();
    let id = StorageId::new_local();
    let freed = Arc::new(AtomicU64::new(0));
    let keep: AnyStorage = Arc::new(Mapping { closed: freed.clone() });
    let (g, _fds) = wire::encode_scope(|| grant(id, 16, LeaseMode::Counted, true, move || keep, None).unwrap());
    // A subscriber to this process's revocations: the reaper watches this process's end too.
    let (tx, subscriber) = crate::sys::Socket::pair().unwrap();
    let ticket = crate::handover::ticket().unwrap();
    crate::handover::append_expiring(&ticket, Arc::new(tx), crate::handover::SUBSCRIPTION_TTL, true).unwrap();
    let link = super::lease::Control::Link(ticket).record().unwrap();
    crate::sys::write_record(std::os::fd::AsFd::as_fd(&*lease_of(&g).tx), &link).unwrap();
    let until = Instant::now() + Duration::from_secs(5);
    assert!(matches!(subscriber.recv(super::lease::MESSAGE_BYTES, crate::sys::Wait::Until(until)), Ok(Some(_))));
    // The table goes to the subscriber before its end joins the owner's list and the reaper's
    // set, both under the owner lock.
    while owner().subscribers.is_empty() {
        assert!(Instant::now() < until, "the subscriber never joined the owner's list");
        std::thread::sleep(Duration::from_millis(1));
    }
    // Tried again where the reaper's thread (or another test's) held its set at the fork, or
    // another test made or closed a descriptor between the listing and the fork.
    let closed = (0..50).any(|_| {
        let watched = reaper::watched_descriptors();
        assert!(!watched.is_empty(), "the reaper watches the grant's lease");
        let closed = crate::sys::fork_and_run(|| watched.iter().all(|&fd| !open(fd))).expect("fork");
        closed || {
            std::thread::sleep(Duration::from_millis(20));
            false
        }
    });
    assert!(closed, "every forked child kept a reading end its parent's reaper watches");
    // The parent's own are untouched: the lease's close still reaches its reaper.
    drop(g);
    wait_freed(&freed, 1, "the storage was never freed");
}
