//! Events, barriers, locks and semaphores between processes: passed in spawn arguments and over
//! channels, or met by name; timeouts, a lock holder killed while holding it, forged messages,
//! and /dev/shm left as it was.

use std::collections::BTreeSet;
use std::io::ErrorKind;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cuda_mp::{
    Barrier, Error, Event, HostTensor, Lock, LockError, Receiver, RecvError, Semaphore, Sender, channel, spawn, spawn_n,
};
use serde::{Deserialize, Serialize};

mod common;
use common::{Slot, connect, sealed_bytes, slot, socket_pair};
use cuda_mp::testing::CarriedFile;

cuda_mp::enable_test_support!();

const WAIT: Duration = Duration::from_secs(20);

/// Tests that use names run one at a time, so that the /dev/shm test sees only its own files.
static NAMED: Mutex<()> = Mutex::new(());

fn named() -> MutexGuard<'static, ()> {
    NAMED.lock().unwrap_or_else(|p| p.into_inner())
}

/// A name of this test process.
fn unique(tag: &str) -> String {
    format!("test-{}-{tag}", std::process::id())
}

/// The files of named sync objects in /dev/shm.
fn sync_files() -> BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("cuda-mp-sync."))
        .collect()
}

fn not_found(e: Error) -> bool {
    matches!(e, Error::Io(e) if e.kind() == ErrorKind::NotFound)
}

fn assert_took(took: Duration, timeout: Duration) {
    assert!(took >= timeout && took < timeout + Duration::from_millis(800), "took {took:?} for {timeout:?}");
}

fn wait_for_event((event, ready): (Event, Sender<()>)) -> bool {
    ready.send(()).unwrap();
    event.wait_timeout(WAIT)
}

#[test]
fn an_event_releases_four_processes() {
    let event = Event::new().unwrap();
    let (tx, rx) = channel().unwrap();
    let children: Vec<_> = (0..4).map(|_| spawn((event.clone(), tx.clone()), wait_for_event)).collect();
    for _ in 0..4 {
        rx.recv_timeout(WAIT).unwrap();
    }
    std::thread::sleep(Duration::from_millis(50));
    assert!(children.iter().all(|c| c.is_alive()), "the children wait for the event");
    event.set();
    for child in children {
        assert!(child.join().unwrap(), "a child timed out instead of seeing the event");
    }
    // Cleared, it blocks again.
    event.clear();
    assert!(!event.wait_timeout(Duration::from_millis(20)));
}

const ROUNDS: usize = 20;

/// Each round: write this rank's slot, meet, check every slot, meet again.
fn barrier_rounds((rank, (barrier, slots)): (usize, (Barrier, HostTensor<i64>))) -> Vec<(usize, bool)> {
    let mine = slots.select(0, rank).unwrap();
    let mut arrivals = Vec::new();
    for round in 1..=ROUNDS as i64 {
        mine.fill(round);
        let arrived = barrier.wait_timeout(WAIT).unwrap();
        arrivals.push((arrived.index(), arrived.is_leader()));
        assert_eq!(
            slots.to_vec(),
            vec![round; 4],
            "rank {rank} passed the barrier before every write of round {round}"
        );
        barrier.wait_timeout(WAIT).unwrap();
    }
    arrivals
}

#[test]
fn a_barrier_holds_four_processes_round_after_round() {
    let barrier = Barrier::new(4).unwrap();
    let slots = HostTensor::<i64>::zeros(&[4]).unwrap();
    let per_rank = spawn_n(4, (barrier.clone(), slots), barrier_rounds).unwrap();
    for round in 0..ROUNDS {
        let mut indices: Vec<usize> = per_rank.iter().map(|r| r[round].0).collect();
        indices.sort();
        assert_eq!(indices, vec![0, 1, 2, 3], "round {round}");
        let leaders: Vec<(usize, bool)> = per_rank.iter().map(|r| r[round]).filter(|a| a.1).collect();
        assert_eq!(leaders, vec![(3, true)], "one leader per round, the last to arrive");
    }
    assert_eq!(barrier.n_waiting(), 0);
    assert!(!barrier.is_broken());
}

const INCREMENTS: i64 = 200;

/// Read, pause, write: without the lock, increments of other processes would be lost.
fn increment(lock: &Lock, counter: &HostTensor<i64>) {
    for _ in 0..INCREMENTS {
        let _guard = lock.acquire().unwrap();
        let v = counter.to_vec()[0];
        std::thread::sleep(Duration::from_micros(20));
        counter.fill(v + 1);
    }
}

fn increment_under_lock((_, (lock, start, counter)): (usize, (Lock, Barrier, HostTensor<i64>))) {
    start.wait_timeout(WAIT).unwrap(); // all at once
    increment(&lock, &counter);
}

#[test]
fn a_lock_excludes_four_processes() {
    let lock = Lock::new().unwrap();
    let start = Barrier::new(4).unwrap();
    let counter = HostTensor::<i64>::zeros(&[1]).unwrap();
    spawn_n(4, (lock.clone(), start, counter.clone()), increment_under_lock).unwrap();
    assert_eq!(counter.to_vec()[0], 4 * INCREMENTS);
    assert!(!lock.is_locked());
}

/// Everything arrives over a channel: takes the lock and a permit, sets the event, meets.
fn use_received(rx: Receiver<(Event, Barrier, Lock, Semaphore)>) -> bool {
    let (event, barrier, lock, semaphore) = rx.recv_timeout(WAIT).unwrap();
    let guard = lock.acquire().unwrap();
    semaphore.acquire().forget();
    event.set();
    barrier.wait_timeout(WAIT).unwrap(); // the parent has looked at the lock
    drop(guard);
    barrier.wait_timeout(WAIT).unwrap().is_leader()
}

#[test]
fn sync_objects_travel_over_channels() {
    let (tx, rx) = channel().unwrap();
    let child = spawn(rx, use_received);
    let (event, barrier, lock, semaphore) =
        (Event::new().unwrap(), Barrier::new(2).unwrap(), Lock::new().unwrap(), Semaphore::new(1).unwrap());
    tx.send((event.clone(), barrier.clone(), lock.clone(), semaphore.clone())).unwrap();
    // Set once the child holds the lock and a permit.
    assert!(event.wait_timeout(WAIT));
    assert_eq!(lock.holder(), child.pid());
    assert!(lock.try_acquire().unwrap_err().is_would_block());
    assert_eq!(semaphore.value(), 0);
    barrier.wait_timeout(WAIT).unwrap();
    let leader = barrier.wait_timeout(WAIT).unwrap().is_leader();
    assert!(leader != child.join().unwrap(), "one leader");
    assert!(!lock.is_locked());
    semaphore.release().unwrap();
    assert!(semaphore.try_acquire().is_some());
}

fn hold_lock_until((lock, held, release): (Lock, Sender<()>, Event)) {
    let _guard = lock.acquire().unwrap();
    held.send(()).unwrap();
    release.wait_timeout(WAIT);
}

fn wait_at_barrier(barrier: Barrier) -> bool {
    barrier.wait().unwrap_err().is_broken()
}

#[test]
fn timeouts_return_in_about_their_time() {
    let timeout = Duration::from_millis(200);

    let event = Event::new().unwrap();
    let start = Instant::now();
    assert!(!event.wait_timeout(timeout));
    assert_took(start.elapsed(), timeout);

    let semaphore = Semaphore::new(0).unwrap();
    let start = Instant::now();
    assert!(semaphore.acquire_timeout(timeout).is_none());
    assert_took(start.elapsed(), timeout);

    // A lock held by another process.
    let lock = Lock::new().unwrap();
    let (held_tx, held_rx) = channel().unwrap();
    let release = Event::new().unwrap();
    let holder = spawn((lock.clone(), held_tx, release.clone()), hold_lock_until);
    held_rx.recv_timeout(WAIT).unwrap();
    let start = Instant::now();
    assert!(lock.acquire_timeout(timeout).unwrap_err().is_timeout());
    assert_took(start.elapsed(), timeout);
    assert!(lock.try_acquire().unwrap_err().is_would_block());
    release.set();
    drop(lock.acquire_timeout(WAIT).unwrap());
    holder.join().unwrap();

    // A barrier of three with two parties: the one that times out breaks it for the other.
    let barrier = Barrier::new(3).unwrap();
    let other = spawn(barrier.clone(), wait_at_barrier);
    let deadline = Instant::now() + WAIT;
    while barrier.n_waiting() == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let start = Instant::now();
    assert!(barrier.wait_timeout(timeout).unwrap_err().is_timeout());
    assert_took(start.elapsed(), timeout);
    assert!(other.join().unwrap(), "the other party sees the barrier broken");
    assert!(barrier.is_broken());
    barrier.reset();
    assert!(!barrier.is_broken());
}

fn hold_and_sleep((lock, tx): (Lock, Sender<u32>)) {
    let _guard = lock.acquire().unwrap();
    tx.send(std::process::id()).unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

/// Waits for the lock in its own process: the dead holder's pid when this waiter took over.
fn wait_for_lock(lock: Lock) -> Option<u32> {
    match lock.acquire_timeout(WAIT) {
        Err(LockError::OwnerDied { pid, .. }) => Some(pid),
        Ok(_) => None,
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn a_lock_whose_holder_is_killed_passes_to_a_waiter_with_owner_died() {
    let lock = Lock::new().unwrap();
    let (tx, rx) = channel().unwrap();
    let mut holder = spawn((lock.clone(), tx), hold_and_sleep);
    let pid = rx.recv_timeout(WAIT).unwrap();
    assert_eq!(lock.holder(), Some(pid));
    // Waiters in two processes, this one and another: exactly one takes the lock over.
    let waiter = spawn(lock.clone(), wait_for_lock);
    std::thread::sleep(Duration::from_millis(100));
    holder.kill().unwrap();
    let killed = Instant::now();
    let here = match lock.acquire_timeout(WAIT) {
        Err(LockError::OwnerDied { pid, .. }) => Some(pid),
        Ok(_) => None,
        Err(e) => panic!("{e}"),
    };
    let took = killed.elapsed();
    let there = waiter.join().unwrap();
    assert_eq!([here, there].into_iter().flatten().collect::<Vec<_>>(), vec![pid], "one waiter is told");
    assert!(took < Duration::from_secs(2), "the dead holder was noticed after {took:?}");
    let _ = holder.join();
    assert!(!lock.is_locked());
    drop(lock.try_acquire().unwrap());
}

fn meet_by_name((_, (prefix, counter)): (usize, (String, HostTensor<i64>))) {
    let lock = Lock::open_or_create(&format!("{prefix}-lock")).unwrap();
    let barrier = Barrier::open_or_create(&format!("{prefix}-barrier"), 4).unwrap();
    let go = Event::open(&format!("{prefix}-go")).unwrap();
    // Every rank holds the same lock once all have arrived.
    barrier.wait_timeout(WAIT).unwrap();
    assert!(go.wait_timeout(WAIT));
    increment(&lock, &counter);
}

#[test]
fn processes_meet_by_name() {
    let _named = named();
    let prefix = unique("meet");
    let go = Event::create(&format!("{prefix}-go")).unwrap();
    go.set();
    let counter = HostTensor::<i64>::zeros(&[1]).unwrap();
    spawn_n(4, (prefix.clone(), counter.clone()), meet_by_name).unwrap();
    assert_eq!(counter.to_vec()[0], 4 * INCREMENTS);
    // The children's names went with them; ours goes when dropped.
    assert!(not_found(Lock::open(&format!("{prefix}-lock")).unwrap_err()));
    assert!(not_found(Barrier::open(&format!("{prefix}-barrier")).unwrap_err()));
    assert!(sync_files().iter().any(|f| f.contains(&prefix)));
    drop(go);
    assert!(!sync_files().iter().any(|f| f.contains(&prefix)));
}

fn create_named_and_sleep((prefix, tx): (String, Sender<()>)) {
    let _e = Event::create(&format!("{prefix}-e")).unwrap();
    let _l = Lock::create(&format!("{prefix}-l")).unwrap();
    let _b = Barrier::create(&format!("{prefix}-b"), 2).unwrap();
    let _s = Semaphore::create(&format!("{prefix}-s"), 1).unwrap();
    tx.send(()).unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn named_objects_leave_dev_shm_as_it_was() {
    let _named = named();
    let before = sync_files();
    let prefix = unique("shm");
    let name = |tag: &str| format!("{prefix}-{tag}");
    {
        let event = Event::create(&name("e")).unwrap();
        let lock = Lock::open_or_create(&name("l")).unwrap();
        let barrier = Barrier::create(&name("b"), 2).unwrap();
        let semaphore = Semaphore::open_or_create(&name("s"), 1).unwrap();
        assert_eq!(sync_files().len(), before.len() + 4);
        let opened = Event::open(&name("e")).unwrap();
        assert!(Event::create(&name("e")).is_err(), "the name is taken");
        assert!(Barrier::open_or_create(&name("b"), 3).is_err(), "two parties, not three");
        drop((lock, barrier, semaphore));
        // The creator goes: its name goes, the opened handle still works.
        drop(event);
        assert!(not_found(Event::open(&name("e")).unwrap_err()));
        opened.set();
        assert!(opened.is_set());
    }
    assert_eq!(sync_files(), before);

    // A creator killed while holding its objects leaves its names; the next use of a name
    // removes them.
    let (tx, rx) = channel().unwrap();
    let mut creator = spawn((prefix.clone(), tx), create_named_and_sleep);
    rx.recv_timeout(WAIT).unwrap();
    assert_eq!(sync_files().len(), before.len() + 4);
    creator.kill().unwrap();
    let _ = creator.join();
    assert_eq!(sync_files().len(), before.len() + 4, "left behind by the killed creator");
    assert!(not_found(Event::open(&name("e")).unwrap_err()));
    assert!(not_found(Semaphore::open(&name("s")).unwrap_err()));
    let fresh = Lock::open_or_create(&name("l")).unwrap();
    assert!(!fresh.is_locked());
    let barrier = Barrier::create(&name("b"), 3).unwrap();
    assert_eq!(barrier.parties(), 3, "a new barrier, not the killed creator's");
    drop((fresh, barrier));
    assert_eq!(sync_files(), before);
}

/// A sync object as it travels, with every field under the forger's control.
#[derive(Serialize, Deserialize)]
enum ForgedSync<M> {
    Memory { kind: u32, memory: M },
    Named { kind: u32, name: String, id: u64 },
}

type Forged = ForgedSync<CarriedFile>;

fn malformed<T: std::fmt::Debug>(r: Result<T, RecvError>) -> String {
    match r {
        Err(RecvError::Malformed(m)) => m,
        other => panic!("expected a malformed-message error, got {other:?}"),
    }
}

fn memory(kind: u32, bytes: Vec<u8>) -> Forged {
    ForgedSync::Memory { kind, memory: CarriedFile(sealed_bytes(&bytes)) }
}

/// The bytes of a sync object's header: magic, layout version 1 and kind.
fn header(kind: u32) -> Vec<u8> {
    let mut bytes = vec![0u8; 64];
    bytes[..4].copy_from_slice(&u32::from_be_bytes(*b"CMSY").to_ne_bytes());
    bytes[4..8].copy_from_slice(&(1u32 << 16 | kind).to_ne_bytes());
    bytes
}

#[test]
fn forged_sync_objects_are_errors() {
    let (tx, rx) = connect::<Forged, Event>();
    tx.send(memory(1, vec![0; 16])).unwrap();
    assert!(malformed(rx.recv()).contains("shared memory of 16 bytes where 64 were promised"));
    tx.send(memory(1, vec![0; 64])).unwrap();
    assert!(malformed(rx.recv()).contains("not a sync object"));
    tx.send(memory(9, header(1))).unwrap();
    assert!(malformed(rx.recv()).contains("unknown kind 9"));
    tx.send(memory(3, header(1))).unwrap();
    assert!(malformed(rx.recv()).contains("expected an Event, the message carries a Lock"));
    tx.send(memory(1, header(3))).unwrap();
    assert!(malformed(rx.recv()).contains("expected an Event, found a Lock"));
    let (socket, _keep) = socket_pair();
    tx.send(ForgedSync::Memory { kind: 1, memory: CarriedFile(socket) }).unwrap();
    assert!(malformed(rx.recv()).contains("not a sealed memory file"));
    let (slot_tx, slot_rx) = connect::<ForgedSync<Slot>, Event>();
    slot_tx.send(ForgedSync::Memory { kind: 1, memory: slot(3) }).unwrap();
    assert!(malformed(slot_rx.recv()).contains("refers to descriptor 3"));
    tx.send(ForgedSync::Named { kind: 1, name: unique("never-made"), id: 1 }).unwrap();
    assert!(malformed(rx.recv()).contains("no longer exists"));
    tx.send(ForgedSync::Named { kind: 1, name: "../../etc/passwd".into(), id: 1 }).unwrap();
    assert!(malformed(rx.recv()).contains("is not a sync object name"));
    // A well-formed header in memory sealed against writes: mapped read-only here, where the
    // object's first write would fault, so refused.
    let frozen = sealed_bytes(&header(1));
    rustix::fs::fcntl_add_seals(&frozen, rustix::fs::SealFlags::WRITE).unwrap();
    tx.send(ForgedSync::Memory { kind: 1, memory: CarriedFile(frozen) }).unwrap();
    assert!(malformed(rx.recv()).contains("writable shared memory"));
    // A well-formed header of the right kind works.
    tx.send(memory(1, header(1))).unwrap();
    let event = rx.recv().unwrap();
    assert!(!event.is_set());

    let (tx, rx) = connect::<Forged, Barrier>();
    tx.send(memory(2, header(2))).unwrap();
    assert!(malformed(rx.recv()).contains("a barrier of 0 parties"));

    let (tx, rx) = connect::<Lock, Event>();
    tx.send(Lock::new().unwrap()).unwrap();
    assert!(malformed(rx.recv()).contains("expected an Event, the message carries a Lock"));
}

#[test]
fn a_named_object_sent_over_a_channel_is_opened_by_name() {
    let _named = named();
    let name = unique("sent");
    let event = Event::create(&name).unwrap();
    let (tx, rx) = channel::<Event>().unwrap();
    tx.send(event.clone()).unwrap();
    let received = rx.recv().unwrap();
    assert_eq!(received.name(), Some(name.as_str()));
    event.set();
    assert!(received.is_set());
    // Sent, then dropped by its creator before it arrives: an error that says so.
    tx.send(event.clone()).unwrap();
    drop((event, received));
    assert!(malformed(rx.recv()).contains("no longer exists"));
    // Replaced by another of the same name meanwhile.
    let first = Event::create(&name).unwrap();
    tx.send(first.clone()).unwrap();
    drop(first);
    let _second = Event::create(&name).unwrap();
    assert!(malformed(rx.recv()).contains("was replaced"));
}

/// A named object's file that others may open, or that another user owns, is refused: a local
/// user of another account gets nothing from it, and cannot plant one for us to map.
#[test]
fn a_named_object_open_to_others_or_owned_by_another_user_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let _named = named();
    let name = unique("foreign");
    let event = Event::create(&name).unwrap();
    let path = format!("/dev/shm/cuda-mp-sync.event.{name}");
    let mode = |m: u32| std::fs::set_permissions(&path, std::fs::Permissions::from_mode(m)).unwrap();
    let refused = |what: &str| match Event::open(&name) {
        Err(Error::Io(e)) => {
            assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{what}: {e}");
            assert!(e.to_string().contains("refused"), "{what}: {e}");
        }
        other => panic!("{what}: opened ({other:?})"),
    };
    Event::open(&name).expect("this user's own object, mode 600");
    mode(0o644);
    refused("readable by others");
    mode(0o660);
    refused("open to the group");
    mode(0o600);
    // Another user's file (only root can give one away: CI and the GPU machine run as root).
    if rustix::process::geteuid().is_root() {
        std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
        refused("owned by another user");
        std::os::unix::fs::chown(&path, Some(0), Some(0)).unwrap();
    }
    // A file with a second name (a hard link, which another user could make of ours under the
    // name of another object where `fs.protected_hardlinks` is off) is refused under either.
    let second = format!("/dev/shm/cuda-mp-sync.event.{}", unique("second-name"));
    std::fs::hard_link(&path, &second).unwrap();
    refused("a file with a second name");
    std::fs::remove_file(&second).unwrap();
    let opened = Event::open(&name).unwrap();
    opened.set();
    assert!(event.is_set());
}

/// More users than parties (three threads at a barrier of two): a round may open and the next
/// fill before a released waiter looks, and that waiter is released all the same (it read a
/// break, thousands of times in 60,000 waits).
#[test]
fn more_users_than_parties_see_no_break_that_did_not_happen() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let barrier = cuda_mp::Barrier::new(2).unwrap();
    let spurious = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                for _ in 0..5_000 {
                    match barrier.wait_timeout(Duration::from_secs(10)) {
                        Ok(_) => {}
                        // The last round's one left over, once the others are done.
                        Err(_) if barrier.is_broken() => break,
                        Err(_) => {
                            spurious.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                barrier.abort();
            });
        }
    });
    assert_eq!(spurious.load(Ordering::Relaxed), 0, "waits that read a break while nothing broke");
}

/// Forks; the child runs `f` and exits with its code. The child's exit code, or `None` where
/// it did not exit.
fn in_forked_child(f: impl FnOnce() -> i32) -> Option<i32> {
    // SAFETY: the child runs `f` on its only thread and leaves with `_exit`, never returning
    // into the test harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(101);
        // SAFETY: ends the forked child without running the parent's exit handlers.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for the child forked above; `status` is a valid place to write.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    (waited == pid && libc::WIFEXITED(status)).then(|| libc::WEXITSTATUS(status))
}

/// A process that is pid 1 of its namespace (a container's first process) makes a lock, then
/// a pid namespace for its children, and forks: the child, pid 1 too, is in another
/// namespace, and refuses the lock (its holders' pids mean nothing there) instead of taking
/// its parent's pid namespace, and start time, for its own.
#[test]
fn a_child_of_the_same_pid_in_another_namespace_refuses_its_parents_lock() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("only root can make a pid namespace: the test is not run");
        return;
    }
    let _g = named();
    let name = unique("pid-namespace");
    let code = in_forked_child(|| {
        // SAFETY: unshare changes only the pid namespace this process's children are made in.
        if unsafe { libc::unshare(libc::CLONE_NEWPID) } != 0 {
            return 10;
        }
        // The first child is pid 1 of the new namespace.
        in_forked_child(|| {
            let Ok(lock) = Lock::create(&name) else { return 11 };
            drop(lock.acquire());
            // SAFETY: as above.
            if std::process::id() != 1 || unsafe { libc::unshare(libc::CLONE_NEWPID) } != 0 {
                return 12;
            }
            let opened = in_forked_child(|| match Lock::open(&name) {
                Err(e) if e.to_string().contains("another pid namespace") => 0,
                Err(_) => 13,
                Ok(_) => 14,
            });
            opened.unwrap_or(15)
        })
        .unwrap_or(16)
    });
    if code == Some(10) {
        eprintln!("this process may not make a pid namespace (a container without CAP_SYS_ADMIN): the test is not run");
        return;
    }
    assert_eq!(code, Some(0), "0: refused; 14: the child took the lock of another pid namespace");
}
