//! Host tensors across real processes: shared writes, release timing, dead consumers, forwarding.

use std::sync::Mutex;
use std::time::Duration;

use cuda_mp::{HostTensor, Receiver, Sender, channel, lifetime_stats, spawn, wait_for_lifetime};

mod common;

cuda_mp::enable_test_support!();

static SERIAL: Mutex<()> = Mutex::new(());
const WAIT: Duration = Duration::from_secs(10);

fn serial() -> std::sync::MutexGuard<'static, ()> {
    common::serial(&SERIAL, WAIT)
}

fn add_100_then_read_back((rx, ack, go): (Receiver<HostTensor<f32>>, Sender<()>, Receiver<()>)) -> f32 {
    let t = rx.recv().unwrap();
    t.map_inplace(|x| x + 100.0);
    ack.send(()).unwrap();
    go.recv().unwrap();
    t.to_vec()[0]
}

#[test]
fn writes_by_either_process_are_seen_by_the_other() {
    let _g = serial();
    let (tx, rx) = channel().unwrap();
    let (ack_tx, ack_rx) = channel().unwrap();
    let (go_tx, go_rx) = channel().unwrap();
    let child = spawn((rx, ack_tx, go_rx), add_100_then_read_back);
    let t = HostTensor::<f32>::from_vec(&[2, 3], vec![0., 1., 2., 3., 4., 5.]).unwrap();
    tx.send(t.clone()).unwrap();
    ack_rx.recv_timeout(WAIT).unwrap();
    assert_eq!(t.to_vec(), vec![100., 101., 102., 103., 104., 105.], "the child's writes are visible here");
    t.narrow(1, 0, 1).unwrap().fill(-7.0);
    go_tx.send(()).unwrap();
    assert_eq!(child.join().unwrap(), -7.0, "the parent's write is visible in the child");
}

#[derive(serde::Serialize, serde::Deserialize, Debug)]
enum Cmd {
    Read,
    Drop,
}

fn hold_until_told((rx, cmd, reply): (Receiver<HostTensor<i64>>, Receiver<Cmd>, Sender<i64>)) {
    let mut t = Some(rx.recv().unwrap());
    reply.send(t.as_ref().unwrap().to_vec().iter().sum()).unwrap();
    while let Ok(c) = cmd.recv() {
        match c {
            Cmd::Read => reply.send(t.as_ref().unwrap().to_vec().iter().sum()).unwrap(),
            Cmd::Drop => {
                t = None;
                reply.send(0).unwrap();
            }
        }
    }
    assert!(t.is_none());
}

#[test]
fn producer_drops_first_and_release_happens_when_the_consumer_drops() {
    let _g = serial();
    let before = lifetime_stats();
    let (tx, rx) = channel().unwrap();
    let (cmd_tx, cmd_rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let child = spawn((rx, cmd_rx, reply_tx), hold_until_told);
    let t = HostTensor::<i64>::from_vec(&[1000], (0..1000).collect()).unwrap();
    tx.send(t.clone()).unwrap();
    assert_eq!(reply_rx.recv_timeout(WAIT).unwrap(), 499_500);
    drop(t);
    let s = lifetime_stats();
    assert_eq!(s.live_storages, before.live_storages + 1, "limbo keeps the storage while the consumer holds it");
    assert_eq!(s.exported_storages, before.exported_storages + 1);
    cmd_tx.send(Cmd::Read).unwrap();
    assert_eq!(reply_rx.recv_timeout(WAIT).unwrap(), 499_500, "the consumer still reads valid data");
    assert_eq!(lifetime_stats().live_storages, before.live_storages + 1);
    cmd_tx.send(Cmd::Drop).unwrap();
    reply_rx.recv_timeout(WAIT).unwrap();
    // The consumer's release frees the storage; the connection's lease stays while the
    // consumer holds the channel, and closes when it exits.
    let after = wait_for_lifetime(WAIT, |s| {
        s.live_storages == before.live_storages && s.exported_storages == before.exported_storages
    })
    .expect("released after the drop");
    assert_eq!(after.freed_storages, before.freed_storages + 1);
    assert_eq!(after.outstanding_leases, before.outstanding_leases + 1);
    drop(cmd_tx);
    child.join().unwrap();
    wait_for_lifetime(WAIT, |s| s.outstanding_leases == before.outstanding_leases)
        .expect("the connection's lease closes with the consumer");
}

fn hold_forever((rx, ack): (Receiver<HostTensor<u8>>, Sender<()>)) {
    let t = rx.recv().unwrap();
    ack.send(()).unwrap();
    loop {
        std::thread::park();
        assert_eq!(t.numel(), 64);
    }
}

#[test]
fn a_sigkilled_consumer_is_reclaimed() {
    let _g = serial();
    let before = lifetime_stats();
    let (tx, rx) = channel().unwrap();
    let (ack_tx, ack_rx) = channel().unwrap();
    let mut child = spawn((rx, ack_tx), hold_forever);
    let t = HostTensor::<u8>::zeros(&[64]).unwrap();
    tx.send(t).unwrap();
    ack_rx.recv_timeout(WAIT).unwrap();
    let s = lifetime_stats();
    assert_eq!(s.live_storages, before.live_storages + 1, "held by the consumer");
    assert_eq!(s.outstanding_leases, before.outstanding_leases + 1);
    child.kill().unwrap();
    let after = wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages)
        .expect("the dead consumer's lease is reclaimed");
    assert_eq!(after.outstanding_leases, before.outstanding_leases);
    assert_eq!(after.leases_released, before.leases_released + 1);
}

fn forward((rx, next): (Receiver<HostTensor<i32>>, Sender<HostTensor<i32>>)) {
    let t = rx.recv().unwrap();
    t.map_inplace(|x| x * 10);
    next.send(t).unwrap();
}

fn last_hop((rx, reply, cmd): (Receiver<HostTensor<i32>>, Sender<Vec<i32>>, Receiver<Cmd>)) {
    let t = rx.recv().unwrap();
    t.map_inplace(|x| x + 1);
    reply.send(t.to_vec()).unwrap();
    cmd.recv().unwrap();
    drop(t);
    reply.send(vec![]).unwrap();
    let _ = cmd.recv();
}

#[test]
fn forwarding_parent_to_a_to_b_keeps_the_storage_alive_until_all_are_done() {
    let _g = serial();
    let before = lifetime_stats();
    let (to_a, a_rx) = channel().unwrap();
    let (to_b, b_rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let (cmd_tx, cmd_rx) = channel().unwrap();
    let b = spawn((b_rx, reply_tx, cmd_rx), last_hop);
    let a = spawn((a_rx, to_b), forward);
    let t = HostTensor::<i32>::from_vec(&[4], vec![1, 2, 3, 4]).unwrap();
    to_a.send(t.clone()).unwrap();
    assert_eq!(reply_rx.recv_timeout(WAIT).unwrap(), vec![11, 21, 31, 41]);
    a.join().unwrap();
    assert_eq!(t.to_vec(), vec![11, 21, 31, 41], "both hops wrote the parent's memory");
    drop(t);
    assert_eq!(lifetime_stats().live_storages, before.live_storages + 1, "B still holds it after A exited");
    cmd_tx.send(Cmd::Drop).unwrap();
    assert_eq!(reply_rx.recv_timeout(WAIT).unwrap(), Vec::<i32>::new());
    wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages).expect("released once B dropped it");
    drop(cmd_tx);
    b.join().unwrap();
}

#[test]
fn a_channel_inside_one_process_hands_back_the_same_storage() {
    let _g = serial();
    let before = lifetime_stats();
    let (tx, rx) = channel().unwrap();
    let t = HostTensor::<f32>::zeros(&[3, 4]).unwrap();
    tx.send(t.transpose(0, 1).unwrap()).unwrap();
    let back: HostTensor<f32> = rx.recv().unwrap();
    assert!(back.shares_storage_with(&t), "no second mapping in the same process");
    assert_eq!(back.shape(), &[4, 3]);
    assert_eq!(back.strides(), &[1, 4]);
    back.fill(2.0);
    assert!(t.to_vec().iter().all(|&x| x == 2.0));
    drop((t, back));
    wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages).expect("freed once the claim is released");
    drop(rx);
    wait_for_lifetime(WAIT, |s| s.outstanding_leases == before.outstanding_leases)
        .expect("the connection's lease closes with its receiver");
}

#[test]
fn many_handoffs_leave_nothing_behind() {
    let _g = serial();
    let before = lifetime_stats();
    let fds_before = common::open_descriptors();
    let (tx, rx) = channel().unwrap();
    let (ack_tx, ack_rx) = channel().unwrap();
    let child = spawn((rx, ack_tx), |(rx, ack): (Receiver<HostTensor<f32>>, Sender<f32>)| {
        while let Ok(t) = rx.recv() {
            ack.send(t.to_vec()[0]).unwrap();
        }
    });
    for i in 0..500 {
        let t = HostTensor::<f32>::full(&[256], i as f32).unwrap();
        tx.send(t).unwrap();
        assert_eq!(ack_rx.recv_timeout(WAIT).unwrap(), i as f32);
    }
    drop(tx);
    child.join().unwrap();
    let after = wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages && s.outstanding_leases == 0)
        .expect("every storage freed");
    assert_eq!(after.freed_storages, before.freed_storages + 500);
    assert_eq!(after.leases_granted - before.leases_granted, 1, "one lease for the connection, none per message");
    // The child's descriptors of this process's (its subscription, its connection) close on
    // the lease threads, soon after it exits: not always before the join returns. A segment
    // the caching allocator made while blocks were on their way back is memory kept for the
    // next tensors, not a leak: it is given up first.
    let open = common::open_descriptors;
    let deadline = std::time::Instant::now() + WAIT;
    while (cuda_mp::empty_host_cache(), open()).1 > fds_before + 4 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let fds_after = open();
    let what: Vec<_> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|p| p.display().to_string())
        .collect();
    assert!(fds_after <= fds_before + 4, "descriptors leak: {fds_before} before, {fds_after} after: {what:?}");
}

/// Receives tensors until told to stop, holding them all; reports how many it holds after each,
/// and drops them all when `drop` says so.
fn hold_all((rx, drop_all, report): (Receiver<HostTensor<u8>>, Receiver<()>, Sender<usize>)) {
    let mut held = Vec::new();
    while let Ok(t) = rx.recv() {
        held.push(t);
        report.send(held.len()).unwrap();
    }
    drop_all.recv().unwrap();
    held.clear();
    report.send(0).unwrap();
    // Alive a while after: what ends its claims is the drop, not its exit.
    std::thread::sleep(Duration::from_secs(2));
}

#[test]
fn holder_statistics_say_which_holder_keeps_how_much_of_this_process_memory() {
    let _g = serial();
    // One allocation per tensor: each is a storage of its own size.
    cuda_mp::set_host_caching(false);
    let before = cuda_mp::holder_stats();
    assert!(before.is_empty(), "{before:?}");
    let mut children = Vec::new();
    let mut holders = Vec::new();
    for sizes in [vec![4096usize, 4096], vec![1 << 20]] {
        let (tx, rx) = channel::<HostTensor<u8>>().unwrap();
        let (drop_tx, drop_rx) = channel().unwrap();
        let (report_tx, report) = channel().unwrap();
        children.push(spawn((rx, drop_rx, report_tx), hold_all));
        for (i, &n) in sizes.iter().enumerate() {
            let t = HostTensor::<u8>::zeros(&[n]).unwrap();
            tx.send(t.clone()).unwrap();
            assert_eq!(report.recv_timeout(WAIT).unwrap(), i + 1);
        }
        holders.push((tx, drop_tx, report));
    }
    let stats = cuda_mp::holder_stats();
    let seen: Vec<(usize, usize, u64)> = stats.iter().map(|h| (h.storages, h.claims, h.bytes)).collect();
    assert_eq!(seen, [(1, 1, 1 << 20), (2, 2, 8192)], "most bytes first: {stats:?}");
    // The first child drops what it holds: its holder is gone.
    let (tx, drop_tx, report) = holders.remove(0);
    drop(tx);
    drop_tx.send(()).unwrap();
    assert_eq!(report.recv_timeout(WAIT).unwrap(), 0);
    common::eventually(WAIT, "the first holder's claims released", || cuda_mp::holder_stats().len() == 1);
    assert_eq!(cuda_mp::holder_stats()[0].bytes, 1 << 20);
    // The second is killed: its holder is gone too.
    let mut second = children.pop().unwrap();
    second.kill().unwrap();
    common::eventually(WAIT, "the killed holder's claims released", || cuda_mp::holder_stats().is_empty());
    drop(holders);
    children.pop().unwrap().join().unwrap();
    cuda_mp::set_host_caching(true);
}

/// Receives `x` and `y` from the owner, sends `x` on to the receiver, says so, and holds `y`
/// until it is killed.
fn forward_x_hold_y(
    (rx, to_r, ready): (
        Receiver<Vec<cuda_mp::testing::FakeTensor<f32>>>,
        Sender<cuda_mp::testing::FakeTensor<f32>>,
        Sender<()>,
    ),
) {
    let mut got = rx.recv_timeout(WAIT).unwrap();
    let y = got.pop().unwrap();
    let x = got.pop().unwrap();
    to_r.send(x).unwrap();
    ready.send(()).unwrap();
    std::thread::sleep(Duration::from_secs(600));
    drop(y);
}

/// Receives `x` through the forwarder, drops it, says what it keeps cached, and waits.
fn receive_and_drop((rx, ready, go): (Receiver<cuda_mp::testing::FakeTensor<f32>>, Sender<usize>, Receiver<()>)) {
    drop(rx.recv_timeout(WAIT).unwrap());
    let stats = wait_for_lifetime(WAIT, |s| s.imported_storages == 0).unwrap();
    ready.send(stats.cached_mappings).unwrap();
    let _ = go.recv_timeout(Duration::from_secs(60));
}

/// A mapping that came through a forwarder is not kept cached once dropped: its claim holds
/// the leases up the chain, and a cached one kept whatever the forwarder held when it was
/// killed (`y`, which nobody else held) alive for as long as the owner kept `x`.
#[test]
fn a_dropped_mapping_that_came_through_a_forwarder_keeps_nothing_of_a_dead_forwarder() {
    let _g = serial();
    let before = lifetime_stats();
    let (to_f, f_rx) = channel().unwrap();
    let (to_r, r_rx) = channel().unwrap();
    let (f_ready_tx, f_ready) = channel().unwrap();
    let (r_ready_tx, r_ready) = channel().unwrap();
    let (go, go_rx) = channel().unwrap();
    let mut forwarder = spawn((f_rx, to_r, f_ready_tx), forward_x_hold_y);
    let receiver = spawn((r_rx, r_ready_tx, go_rx), receive_and_drop);
    let x = cuda_mp::testing::FakeTensor::<f32>::fake(&[4], Duration::ZERO).unwrap();
    let y = cuda_mp::testing::FakeTensor::<f32>::fake(&[4], Duration::ZERO).unwrap();
    to_f.send(vec![x.clone(), y.clone()]).unwrap();
    f_ready.recv_timeout(WAIT).unwrap();
    assert_eq!(r_ready.recv_timeout(WAIT).unwrap(), 0, "nothing kept cached of what came through a forwarder");
    forwarder.kill().unwrap();
    drop(y);
    let freed = wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages + 1);
    go.send(()).unwrap();
    receiver.join().unwrap();
    drop(x);
    assert!(freed.is_ok(), "y, held by nobody but the killed forwarder, still lives: {:?}", lifetime_stats());
}

/// Sends `n` fresh host tensors, keeping none, then waits up to `limit` until every one came
/// back (released by the receiver); true if they all did.
fn send_fresh_and_wait_for_releases((n, tx, limit): (usize, Sender<HostTensor<u8>>, Duration)) -> bool {
    for i in 0..n {
        tx.send(HostTensor::<u8>::full(&[8], i as u8).unwrap()).unwrap();
    }
    wait_for_lifetime(limit, |s| s.exported_storages == 0).is_ok()
}

/// Stops `child` (SIGSTOP) and waits until it is stopped; its pid, for the `SIGCONT`.
fn stop<T>(child: &cuda_mp::JoinHandle<T>) -> i32 {
    let pid = child.pid().expect("the child runs");
    common::stop_process(pid);
    pid as i32
}

/// An owner that stops reading (SIGSTOP) while a receiver drops 20,000 of its tensors: the
/// releases it is owed fill its lease pipe and wait in the receiver, and another owner's
/// release still goes out at once; the stopped owner gets every release once it goes on.
#[test]
fn releases_owed_to_a_stopped_owner_hold_up_no_other_owner() {
    let _g = serial();
    const N: usize = 20_000;
    let (tx, rx) = channel().unwrap();
    let stopped = spawn((N, tx, Duration::from_secs(60)), send_fresh_and_wait_for_releases);
    let from_stopped: Vec<HostTensor<u8>> = (0..N).map(|_| rx.recv_timeout(WAIT).unwrap()).collect();
    let (tx, rx) = channel().unwrap();
    let mut other = spawn((1, tx, Duration::from_secs(10)), send_fresh_and_wait_for_releases);
    let from_other = rx.recv_timeout(WAIT).unwrap();
    let pid = stop(&stopped);
    drop(from_stopped);
    drop(from_other);
    let other_released = other.join_timeout(Duration::from_secs(30));
    // What an exit waits for without limit (the messages) is done; the releases it waits a
    // minute for at most are not.
    let backlogs = cuda_mp::flush_backlogs(Duration::from_secs(10));
    let sends = cuda_mp::flush_sends(Duration::from_millis(200));
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert!(matches!(other_released, Ok(true)), "the other owner's release waited: {other_released:?}");
    assert!(backlogs.is_ok(), "{backlogs:?}");
    assert!(sends.as_ref().is_err_and(|e| e.is_timeout()), "releases to a stopped owner were sent: {sends:?}");
    assert!(stopped.join().unwrap(), "the stopped owner got every release once it went on");
}

/// Receives one tensor, says what it holds, and drops it when told.
fn receive_one_and_hold((rx, reply, go): (Receiver<HostTensor<u8>>, Sender<u8>, Receiver<()>)) {
    let t = rx.recv_timeout(WAIT).unwrap();
    reply.send(t.to_vec()[0]).unwrap();
    go.recv_timeout(Duration::from_secs(60)).unwrap();
}

/// Sends `n` fresh host tensors, keeping none; once all but one were released, says whether
/// that one stays exported for another 0.5 s (its holder is told to drop it only after), then
/// waits up to `limit` for its release too; true if it came.
fn send_fresh_and_watch_the_last(
    (n, tx, said, limit): (usize, Sender<HostTensor<u8>>, Sender<bool>, Duration),
) -> bool {
    for i in 0..n {
        tx.send(HostTensor::<u8>::full(&[8], i as u8).unwrap()).unwrap();
    }
    let all_but_one = wait_for_lifetime(limit, |s| s.exported_storages <= 1).is_ok();
    let still_held = wait_for_lifetime(Duration::from_millis(500), |s| s.exported_storages == 0).is_err();
    said.send(all_but_one && still_held).unwrap();
    wait_for_lifetime(limit, |s| s.exported_storages == 0).is_ok()
}

/// A forward of a stopped owner's tensor, with that owner's lease pipe full of releases it
/// has not read, does not wait for the owner (the forwarder's claim for its relay waits in
/// its courier, summed with the forwarder's own release), reaches the next holder, and the
/// owner keeps the tensor while that holder does, then gets its release.
#[test]
fn forwarding_a_stopped_owners_tensor_does_not_wait_for_the_owner() {
    let _g = serial();
    const N: usize = 20_000;
    let (tx, rx) = channel().unwrap();
    let (said_tx, said) = channel().unwrap();
    let owner = spawn((N, tx, said_tx, Duration::from_secs(60)), send_fresh_and_watch_the_last);
    let mut from_owner: Vec<HostTensor<u8>> = (0..N).map(|_| rx.recv_timeout(WAIT).unwrap()).collect();
    let kept = from_owner.pop().unwrap();
    let pid = stop(&owner);
    drop(from_owner);
    let full = cuda_mp::flush_sends(Duration::from_millis(200));
    let (to_next, next_rx) = channel().unwrap();
    let (reply_tx, reply) = channel().unwrap();
    let (go, go_rx) = channel().unwrap();
    let next = spawn((next_rx, reply_tx, go_rx), receive_one_and_hold);
    let (sent_tx, sent) = std::sync::mpsc::channel();
    let sender = std::thread::spawn(move || {
        let started = std::time::Instant::now();
        let ok = to_next.send(kept).is_ok();
        let _ = sent_tx.send(started.elapsed());
        ok
    });
    let took = sent.recv_timeout(Duration::from_secs(5));
    let got = reply.recv_timeout(WAIT);
    // SAFETY: as in `stop`.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert!(full.is_err_and(|e| e.is_timeout()), "the owner's pipe was not full: the test proves nothing");
    assert!(took.is_ok(), "the forward waited for the stopped owner");
    assert!(sender.join().unwrap());
    assert_eq!(got.unwrap(), (N - 1) as u8, "the next holder read the forwarded tensor");
    let held = said.recv_timeout(Duration::from_secs(60));
    go.send(()).unwrap();
    next.join().unwrap();
    assert!(held.unwrap(), "the owner released the forwarded tensor while the next holder had it");
    assert!(owner.join().unwrap(), "the owner got every release once it went on");
}
