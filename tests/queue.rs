//! One queue, many producers and consumers in many processes: each message delivered once, a
//! killed consumer losing nothing it had not received and releasing what it held, messages
//! prefetched by a consumer that leaves or is killed going to another, per-producer order,
//! timeouts, closing, consumers joining and leaving, fairness among waiting consumers, and the
//! queue's end with its creator.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cuda_mp::{
    GetError, GetTimeoutError, HostTensor, Queue, QueueConsumer, Receiver, Sender, TryGetError, channel,
    lifetime_stats, spawn, wait_for_lifetime,
};

mod common;

cuda_mp::enable_test_support!();

/// Tests that share tensors run one at a time, so that the lifetime counters they read are
/// their own.
static SERIAL: Mutex<()> = Mutex::new(());
const WAIT: Duration = Duration::from_secs(20);

fn serial() -> std::sync::MutexGuard<'static, ()> {
    common::serial(&SERIAL, WAIT)
}

const N: u32 = 10_000;
const BYTES: usize = 4096;

/// The contents of tensor `i`: its index in the first four bytes, then a pattern of it.
fn pattern(i: u32) -> Vec<u8> {
    let mut v: Vec<u8> =
        (0..BYTES).map(|j| (i as usize).wrapping_mul(31).wrapping_add(j * 7) as u8 ^ (i >> 8) as u8).collect();
    v[..4].copy_from_slice(&i.to_le_bytes());
    v
}

/// The index a tensor carries, after checking every byte of it.
fn index_of(t: &HostTensor<u8>) -> u32 {
    let v = t.to_vec();
    assert_eq!(v.len(), BYTES);
    let i = u32::from_le_bytes([v[0], v[1], v[2], v[3]]);
    assert!(i < N, "index {i} out of range");
    assert!(v == pattern(i), "tensor {i} does not hold its pattern");
    i
}

/// Files in /dev/shm, but those of named sync objects (which other test programs may be
/// making right now; this test makes none).
fn shm_entries() -> BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| !n.starts_with("cuda-mp-sync."))
        .collect()
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < WAIT, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Gets until the queue is closed, reporting each index; the holder keeps every tensor it got.
fn consume((rank, queue, report, hold): (usize, QueueConsumer<HostTensor<u8>>, Sender<(usize, u32)>, bool)) -> usize {
    let mut held = Vec::new();
    let mut n = 0;
    loop {
        match queue.get() {
            Ok(t) => {
                report.send((rank, index_of(&t))).unwrap();
                n += 1;
                if hold {
                    held.push(t);
                }
            }
            Err(GetError::Disconnected) => return n,
            Err(e) => panic!("consumer {rank}: {e}"),
        }
    }
}

/// Receives reports until `total` have come in all; a timeout says what each consumer reported
/// and what the queue holds.
fn reports_until(
    rx: &Receiver<(usize, u32)>,
    seen: &mut [Vec<u32>],
    total: usize,
    queue: &QueueConsumer<HostTensor<u8>>,
) {
    while seen.iter().map(Vec::len).sum::<usize>() < total {
        match rx.recv_timeout(WAIT) {
            Ok((rank, i)) => seen[rank].push(i),
            Err(e) => panic!(
                "no report for {WAIT:?} ({e}), waiting for {total}: reports per consumer {:?}, queue {:?}",
                seen.iter().map(Vec::len).collect::<Vec<_>>(),
                queue.stats()
            ),
        }
    }
}

#[test]
fn four_consumers_drain_ten_thousand_tensors_and_a_killed_one_loses_nothing() {
    let _g = serial();
    let shm_before = shm_entries();
    let before = lifetime_stats();
    let queue = Queue::<HostTensor<u8>>::new().unwrap();
    let watcher = queue.consumer();
    let (report_tx, report_rx) = channel().unwrap();
    // Consumer 0 keeps every tensor it gets, and is the one killed.
    let mut consumers: Vec<_> =
        (0..4).map(|rank| spawn((rank, queue.consumer(), report_tx.clone(), rank == 0), consume)).collect();
    drop(report_tx);
    let mut seen = vec![Vec::new(); 4];

    for i in 0..N / 2 {
        queue.put(HostTensor::from_vec(&[BYTES], pattern(i)).unwrap()).unwrap();
    }
    reports_until(&report_rx, &mut seen, N as usize / 2, &watcher);
    // Every consumer waits in a get with nothing left. Stopped there, consumer 0 will not read
    // the next message the dispatcher sends it.
    wait_until("all four consumers wait", || {
        let s = watcher.stats().unwrap();
        s.waiting == 4 && s.backlog == 0 && s.in_flight == 0
    });
    // Waiting in a get, each consumer has asked for its prefetch (at least one message): the
    // stopped one will be sent that many.
    let ahead = watcher.prefetch().max(1) as u64;
    let victim = consumers[0].pid().unwrap();
    // Our own child, alive (it is waiting in a get).
    common::stop_process(victim);
    let got_before_stop = seen[0].len();
    assert!(got_before_stop > 0, "consumer 0 took part");

    for i in N / 2..N {
        queue.put(HostTensor::from_vec(&[BYTES], pattern(i)).unwrap()).unwrap();
    }
    reports_until(&report_rx, &mut seen, N as usize * 3 / 4, &watcher);
    let s = watcher.stats().unwrap();
    assert!(s.in_flight >= 1, "the stopped consumer has a message it has not received: {s:?}");
    // Killed midway, holding the tensors it received and messages it never read.
    consumers[0].kill().unwrap();
    drop(queue); // the last producer: the others drain the queue, then stop
    reports_until(&report_rx, &mut seen, N as usize, &watcher);

    assert_eq!(seen[0].len(), got_before_stop, "nothing reached the stopped consumer's code");
    for (rank, c) in consumers.into_iter().enumerate().skip(1) {
        assert_eq!(c.join().unwrap(), seen[rank].len(), "consumer {rank} reported all it got");
        assert!(!seen[rank].is_empty(), "consumer {rank} took part");
    }
    let mut all: Vec<u32> = seen.concat();
    all.sort_unstable();
    assert_eq!(all.len(), N as usize, "no message delivered twice");
    assert!(all.iter().copied().eq(0..N), "every message delivered");
    let s = watcher.stats().unwrap();
    assert_eq!(s.requeued, ahead, "the killed consumer's unread messages went to another: {s:?}");
    assert_eq!((s.delivered, s.backlog, s.in_flight, s.closed), (N as u64, 0, 0, true), "{s:?}");
    drop(watcher);

    // Everything dropped: the killed consumer's tensors are reclaimed with the rest.
    let after = wait_for_lifetime(WAIT, |s| {
        s.live_storages == before.live_storages
            && s.exported_storages == before.exported_storages
            && s.outstanding_leases == before.outstanding_leases
    })
    .unwrap_or_else(|_| panic!("storages or leases left: {:?} (before {before:?})", lifetime_stats()));
    assert_eq!(after.freed_storages - before.freed_storages, N as u64);
    assert_eq!(shm_entries(), shm_before, "files left in /dev/shm");
}

type Tagged = (u32, u32, HostTensor<i32>);

fn produce((id, queue, n): (u32, Queue<Tagged>, u32)) {
    for k in 0..n {
        queue.put((id, k, HostTensor::full(&[16], (id * 100_000 + k) as i32).unwrap())).unwrap();
    }
}

#[test]
fn several_producer_processes_keep_their_order_for_one_consumer() {
    let _g = serial();
    let before = lifetime_stats();
    let queue = Queue::<Tagged>::new().unwrap();
    let consumer = queue.consumer();
    let producers: Vec<_> = (0..3).map(|id| spawn((id, queue.clone(), 300), produce)).collect();
    drop(queue);
    let mut next = [0u32; 3];
    loop {
        match consumer.get_timeout(WAIT) {
            Ok((id, k, t)) => {
                assert_eq!(k, next[id as usize], "producer {id}'s messages in the order put");
                next[id as usize] += 1;
                assert_eq!(t.to_vec(), vec![(id * 100_000 + k) as i32; 16]);
            }
            Err(GetTimeoutError::Disconnected) => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(next, [300; 3]);
    for p in producers {
        p.join().unwrap();
    }
    drop(consumer);
    wait_for_lifetime(WAIT, |s| s.imported_storages == before.imported_storages).expect("imports released");
}

/// Checks every tagged tensor until the queue is closed; how many per producer.
fn check_tagged(queue: QueueConsumer<Tagged>) -> Vec<u32> {
    let mut next = vec![0u32; 2];
    for (id, k, t) in queue.iter() {
        assert_eq!(k, next[id as usize]);
        next[id as usize] += 1;
        assert_eq!(t.to_vec(), vec![(id * 100_000 + k) as i32; 16]);
    }
    next
}

#[test]
fn tensors_from_producers_that_exited_reach_a_consumer_process() {
    let _g = serial();
    let before = lifetime_stats();
    let queue = Queue::<Tagged>::new().unwrap();
    for id in 0..2 {
        spawn((id, queue.clone(), 100), produce).join().unwrap();
    }
    // Both producers are gone; their tensors wait here, forwarded on to another process.
    let consumer = spawn(queue.consumer(), check_tagged);
    drop(queue);
    assert_eq!(consumer.join().unwrap(), vec![100, 100]);
    wait_for_lifetime(WAIT, |s| s.imported_storages == before.imported_storages).expect("imports released");
}

fn put_numbers((queue, n): (Queue<u32>, u32)) {
    for i in 0..n {
        queue.put(i).unwrap();
    }
}

#[test]
fn get_timeout_times_out_and_disconnected_comes_after_the_backlog() {
    let queue = Queue::<u32>::new().unwrap();
    let consumer = queue.consumer();
    assert_eq!(consumer.try_get(), Err(TryGetError::Empty));
    let start = Instant::now();
    assert_eq!(consumer.get_timeout(Duration::from_millis(100)), Err(GetTimeoutError::Timeout));
    assert!(start.elapsed() >= Duration::from_millis(100));
    assert!(consumer.get_timeout(Duration::ZERO).unwrap_err().is_timeout());

    // A producer process puts three and exits; the handle here was the only other producer.
    spawn((queue.clone(), 3), put_numbers).join().unwrap();
    drop(queue);
    for i in 0..3 {
        assert_eq!(consumer.get_timeout(WAIT), Ok(i), "the backlog is drained first");
    }
    assert_eq!(consumer.get(), Err(GetError::Disconnected));
    assert_eq!(consumer.try_get(), Err(TryGetError::Disconnected));
    assert_eq!(consumer.get_timeout(WAIT), Err(GetTimeoutError::Disconnected));
    let s = consumer.stats().unwrap();
    assert!(s.closed && s.backlog == 0 && s.delivered == 3, "{s:?}");
    assert_eq!(GetError::Disconnected.to_string(), "getting from an empty and closed queue");
    assert_eq!(GetTimeoutError::Timeout.to_string(), "timed out waiting on queue");
}

#[test]
fn gets_that_time_out_while_messages_arrive_lose_none() {
    let queue = Queue::<u32>::new().unwrap();
    let consumer = queue.consumer();
    let producer = std::thread::spawn(move || {
        for i in 0..2000 {
            queue.put(i).unwrap();
            if i % 50 == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    });
    let mut got = Vec::new();
    let mut timeouts = 0;
    loop {
        match consumer.get_timeout(Duration::from_micros(100)) {
            Ok(i) => got.push(i),
            Err(GetTimeoutError::Timeout) => timeouts += 1,
            Err(GetTimeoutError::Disconnected) => break,
            Err(e) => panic!("{e}"),
        }
    }
    producer.join().unwrap();
    assert!(got.iter().copied().eq(0..2000), "each once, in order ({timeouts} timeouts)");
    let s = consumer.stats().unwrap();
    assert_eq!((s.delivered, s.requeued, s.waiting), (2000, 0, 0), "{s:?}");
}

fn take_some((queue, n, report): (QueueConsumer<u32>, usize, Sender<u32>)) {
    for _ in 0..n {
        report.send(queue.get().unwrap()).unwrap();
    }
    // Leaves the queue here, with messages still in it.
}

#[test]
fn consumers_join_and_leave_at_any_time() {
    let queue = Queue::<u32>::new().unwrap();
    for i in 0..200 {
        queue.put(i).unwrap();
    }
    let (tx, rx) = channel().unwrap();
    spawn((queue.consumer(), 50, tx.clone()), take_some).join().unwrap();
    let a = spawn((queue.consumer(), 70, tx.clone()), take_some);
    let b = spawn((queue.consumer(), 70, tx.clone()), take_some);
    a.join().unwrap();
    b.join().unwrap();
    let mut got: Vec<u32> = (0..190).map(|_| rx.recv_timeout(WAIT).unwrap()).collect();
    // The last ten, here.
    got.extend((0..10).map(|_| queue.get_timeout(WAIT).unwrap()));
    got.sort_unstable();
    assert!(got.iter().copied().eq(0..200));
    assert_eq!(queue.try_get(), Err(TryGetError::Empty));
    // The `Got`s of the consumers that left are read by their own readers, which a question
    // on this handle's channel may overtake.
    wait_until("every acknowledgement read", || queue.stats().is_ok_and(|s| s.delivered == 200));
    let s = queue.stats().unwrap();
    assert_eq!((s.delivered, s.backlog), (200, 0), "{s:?}");
    // Each consumer that left had asked for messages ahead of gets it did not make: those it
    // was sent (or that could not be sent, as it was gone) went back to the queue.
    let ahead = queue.consumer().prefetch() as u64;
    assert!(s.requeued <= 3 * ahead, "{s:?}");
}

#[test]
fn handles_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Queue<HostTensor<u8>>>();
    check::<QueueConsumer<HostTensor<u8>>>();
    check::<cuda_mp::Feed>();
}

fn create_and_exit(tx: Sender<(Queue<u32>, QueueConsumer<u32>)>) {
    let queue = Queue::new().unwrap();
    tx.send((queue.clone(), queue.consumer())).unwrap();
    // Returns: this process exits, and the queue with it.
}

#[test]
fn the_queue_ends_when_its_creator_exits() {
    let (tx, rx) = channel().unwrap();
    let child = spawn(tx, create_and_exit);
    let (queue, consumer) = rx.recv_timeout(WAIT).unwrap();
    child.join().unwrap();
    assert_eq!(consumer.get_timeout(WAIT), Err(GetTimeoutError::Disconnected));
    assert_eq!(queue.get(), Err(GetError::Disconnected));
    // The process may take a moment to close everything it had open.
    wait_until("a put fails", || match queue.put(1) {
        Ok(()) => false,
        Err(e) => {
            assert!(e.is_disconnected(), "{e}");
            assert_eq!(e.into_inner(), 1);
            true
        }
    });
}

/// Makes a queue, hands it out, forks a child without `exec` that only sleeps (as a forked CPU
/// worker would), says the child's pid, then waits to be killed.
fn create_fork_and_wait(tx: Sender<(Queue<u32>, QueueConsumer<u32>, i32)>) {
    let queue = Queue::new().unwrap();
    let consumer = queue.consumer();
    // SAFETY: the child only sleeps and `_exit`s.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        std::thread::sleep(Duration::from_secs(60));
        // SAFETY: ends the child without its parent's exit hooks.
        unsafe { libc::_exit(0) };
    }
    tx.send((queue.clone(), consumer, pid)).unwrap();
    loop {
        std::thread::park();
    }
}

/// The queue ends with its creator even where the creator forked a child without `exec`: the
/// child's copies of the dispatcher's ends are closed (before, puts went on succeeding, and
/// their messages were lost, for as long as the child lived).
#[test]
fn the_queue_ends_with_its_creator_whatever_it_forked() {
    let (tx, rx) = channel().unwrap();
    let mut creator = spawn(tx, create_fork_and_wait);
    let (queue, consumer, forked) = rx.recv_timeout(WAIT).unwrap();
    queue.put(1).unwrap();
    assert_eq!(consumer.get_timeout(WAIT), Ok(1));
    creator.kill().unwrap();
    let ended = Instant::now();
    let mut put = Ok(());
    while put.is_ok() && ended.elapsed() < Duration::from_secs(10) {
        put = queue.put(2);
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: signals the creator's forked child, which only sleeps.
    unsafe { libc::kill(forked, libc::SIGKILL) };
    let err = put.expect_err("puts went on succeeding 10 s after the queue's creator was killed");
    assert!(err.is_disconnected(), "{err}");
    assert_eq!(consumer.get_timeout(WAIT), Err(GetTimeoutError::Disconnected));
}

/// `stats` waits for a `get` of another thread on the same handle; `stats_timeout` gives up at
/// its limit, and answers once the handle is free.
#[test]
fn stats_timeout_gives_up_while_another_thread_gets() {
    let queue = Queue::<u32>::new().unwrap();
    let consumer = queue.consumer();
    std::thread::scope(|s| {
        let getting = s.spawn(|| consumer.get_timeout(Duration::from_secs(3)));
        std::thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        assert_eq!(consumer.stats_timeout(Duration::from_millis(300)), Err(GetTimeoutError::Timeout));
        assert!(started.elapsed() < Duration::from_secs(2), "it waited past its limit: {:?}", started.elapsed());
        queue.put(5).unwrap();
        assert_eq!(getting.join().unwrap(), Ok(5));
    });
    assert_eq!(consumer.stats_timeout(WAIT).unwrap().consumers, 1);
    // A limit shorter than a round trip, on a free handle of a queue that keeps up: answered,
    // and the handle stays one consumer (a time-out would start it afresh each call).
    for limit in [Duration::ZERO, Duration::from_micros(50)].into_iter().cycle().take(20) {
        assert_eq!(consumer.stats_timeout(limit).map(|s| s.consumers), Ok(1));
    }
}

fn create_and_wait(tx: Sender<(Queue<u32>, QueueConsumer<u32>)>) {
    let queue = Queue::new().unwrap();
    tx.send((queue.clone(), queue.consumer())).unwrap();
    loop {
        std::thread::park();
    }
}

/// `stats_timeout`, `get_timeout` and `try_get` keep to their limits while the dispatcher does
/// not answer (its process stopped), and the handle is answered again once it does.
#[test]
fn timed_calls_keep_to_their_limits_while_the_dispatcher_is_stopped() {
    let (tx, rx) = channel().unwrap();
    let mut creator = spawn(tx, create_and_wait);
    let (queue, consumer) = rx.recv_timeout(WAIT).unwrap();
    assert_eq!(consumer.stats_timeout(WAIT).unwrap().consumers, 1);
    let pid = creator.pid().unwrap();
    // Stopped for sure before the ask (a signal is delivered when the kernel gets to it).
    common::stop_process(pid);
    let timed = |call: &dyn Fn() -> String| {
        let started = Instant::now();
        let outcome = call();
        (outcome, started.elapsed())
    };
    let stats = timed(&|| format!("{:?}", consumer.stats_timeout(Duration::from_millis(300))));
    let get = timed(&|| format!("{:?}", consumer.get_timeout(Duration::from_millis(200))));
    let try_get = timed(&|| format!("{:?}", consumer.try_get()));
    // SAFETY: signals our own child.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) }, 0);
    for ((outcome, took), want) in [(stats, "Err(Timeout)"), (get, "Err(Timeout)"), (try_get, "Err(Empty)")] {
        assert_eq!(outcome, want);
        assert!(took < Duration::from_secs(3), "{outcome}: it waited {took:?}");
    }
    // The endpoints the handle left are seen gone one by one.
    wait_until("the handle is one consumer again", || consumer.stats_timeout(WAIT).unwrap().consumers == 1);
    queue.put(5).unwrap();
    assert_eq!(consumer.get_timeout(WAIT), Ok(5), "and gets");
    creator.kill().unwrap();
}

#[test]
fn a_dropped_consumer_gives_back_what_it_prefetched_in_order() {
    let queue = Queue::<u32>::new().unwrap();
    let watcher = queue.consumer();
    for i in 0..10 {
        queue.put(i).unwrap();
    }
    let a = queue.consumer().with_prefetch(3);
    assert_eq!(a.get(), Ok(0));
    // Three asked for ahead of the next get and sent; the counters' answer comes after them,
    // so reading it takes them off the channel into the handle.
    let s = a.stats().unwrap();
    assert_eq!((s.backlog, s.in_flight, s.delivered), (6, 3, 1), "{s:?}");
    drop(a);
    wait_until("the dropped consumer's messages are back", || {
        let s = watcher.stats().unwrap();
        (s.backlog, s.in_flight, s.requeued) == (9, 0, 3)
    });
    drop(queue);
    let b = watcher.clone();
    assert_eq!(b.iter().collect::<Vec<_>>(), (1..10).collect::<Vec<_>>(), "each once, in the order put");
    let s = watcher.stats().unwrap();
    assert_eq!((s.delivered, s.requeued, s.in_flight, s.closed), (10, 3, 0, true), "{s:?}");
}

/// Gets one tensor and reports it, then waits to be killed with the messages it asked for
/// ahead still unread in its channel.
fn get_one_and_stop((queue, report): (QueueConsumer<HostTensor<u8>>, Sender<u32>)) {
    let t = queue.get().unwrap();
    report.send(index_of(&t)).unwrap();
    loop {
        std::thread::park();
    }
}

/// Puts one tensor of its own, then, when told, waits until nobody holds it any more and
/// says whether that happened while it still holds the queue.
fn put_one_and_watch((queue, said, go): (Queue<HostTensor<u8>>, Sender<bool>, Receiver<()>)) {
    queue.put(HostTensor::from_vec(&[BYTES], pattern(0)).unwrap()).unwrap();
    go.recv().unwrap();
    let freed = wait_for_lifetime(WAIT, |s| s.live_storages == 0 && s.exported_storages == 0).is_ok();
    said.send(freed).unwrap();
    drop(queue);
}

/// A producer's tensor, handed on by the dispatcher to a consumer that is killed holding it,
/// is freed then, while the queue (and the dispatcher's channel from the producer) lives on.
#[test]
fn a_tensor_held_by_a_killed_consumer_is_freed_while_the_queue_lives_on() {
    let _g = serial();
    let queue = Queue::<HostTensor<u8>>::new().unwrap();
    let (said_tx, said_rx) = channel().unwrap();
    let (go_tx, go_rx) = channel().unwrap();
    let producer = spawn((queue.clone(), said_tx, go_rx), put_one_and_watch);
    let (tx, rx) = channel().unwrap();
    let mut victim = spawn((queue.consumer(), tx), get_one_and_stop);
    assert_eq!(rx.recv_timeout(WAIT).unwrap(), 0);
    victim.kill().unwrap();
    go_tx.send(()).unwrap();
    assert!(said_rx.recv_timeout(WAIT * 2).unwrap(), "the producer's tensor outlived the consumer that held it");
    producer.join().unwrap();
    drop(queue);
}

#[test]
fn a_killed_consumer_loses_none_of_the_messages_it_prefetched() {
    const M: u32 = 100;
    let _g = serial();
    let before = lifetime_stats();
    let queue = Queue::<HostTensor<u8>>::new().unwrap();
    let watcher = queue.consumer();
    for i in 0..M {
        queue.put(HostTensor::from_vec(&[BYTES], pattern(i)).unwrap()).unwrap();
    }
    let (tx, rx) = channel().unwrap();
    let mut victim = spawn((queue.consumer().with_prefetch(4), tx), get_one_and_stop);
    assert_eq!(rx.recv_timeout(WAIT).unwrap(), 0);
    wait_until("four messages are prefetched", || {
        let s = watcher.stats().unwrap();
        (s.delivered, s.in_flight, s.backlog) == (1, 4, M as usize - 5)
    });
    victim.kill().unwrap();
    wait_until("the killed consumer's messages are back", || watcher.stats().unwrap().requeued == 4);
    drop(queue);
    let got: Vec<u32> = watcher.iter().map(|t| index_of(&t)).collect();
    assert_eq!(got, (1..M).collect::<Vec<_>>(), "each once, in the order put");
    let s = watcher.stats().unwrap();
    assert_eq!((s.delivered, s.requeued, s.in_flight, s.closed), (M as u64, 4, 0, true), "{s:?}");
    drop(watcher);
    wait_for_lifetime(WAIT, |s| {
        s.live_storages == before.live_storages
            && s.exported_storages == before.exported_storages
            && s.outstanding_leases == before.outstanding_leases
    })
    .unwrap_or_else(|_| panic!("storages or leases left: {:?} (before {before:?})", lifetime_stats()));
}

#[test]
fn a_waiting_consumer_is_served_before_another_gets_one_more_ahead() {
    let queue = Queue::<u32>::new().unwrap();
    let watcher = queue.consumer();
    let a = queue.consumer().with_prefetch(2);
    queue.put(0).unwrap();
    assert_eq!(a.get(), Ok(0));
    // `a` still asks for two ahead of its next get, and is first in line: it gets this one.
    queue.put(1).unwrap();
    wait_until("a has one prefetched", || watcher.stats().unwrap().in_flight == 1);
    let b = queue.consumer().with_prefetch(2);
    let (tx, rx) = std::sync::mpsc::channel();
    let waiting = std::thread::spawn(move || {
        tx.send(b.get()).unwrap();
        b
    });
    wait_until("b waits", || watcher.stats().unwrap().waiting == 1);
    // `a` wants one more and is ahead in line, but holds one already: `b`, with none, goes
    // first.
    queue.put(2).unwrap();
    assert_eq!(rx.recv_timeout(WAIT).expect("b is served"), Ok(2));
    assert_eq!(a.get(), Ok(1));
    let b = waiting.join().unwrap();
    drop(queue);
    assert_eq!(a.get(), Err(GetError::Disconnected));
    assert_eq!(b.get(), Err(GetError::Disconnected));
}

#[test]
fn one_consumer_gets_in_put_order_whichever_way_it_gets() {
    const M: u32 = 3000;
    let queue = Queue::<u32>::new().unwrap();
    let consumer = queue.consumer().with_prefetch(4);
    let producer = std::thread::spawn(move || {
        for i in 0..M {
            queue.put(i).unwrap();
            if i % 100 == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    });
    let mut got = Vec::new();
    for k in 0u32.. {
        if k % 50 == 0 {
            consumer.stats().unwrap();
        }
        let next = match k % 3 {
            0 => consumer.get(),
            1 => match consumer.try_get() {
                Err(TryGetError::Empty) => continue,
                other => other.map_err(|e| match e {
                    TryGetError::Disconnected => GetError::Disconnected,
                    e => panic!("{e}"),
                }),
            },
            _ => match consumer.get_timeout(Duration::from_micros(200)) {
                Err(GetTimeoutError::Timeout) => continue,
                other => other.map_err(|e| match e {
                    GetTimeoutError::Disconnected => GetError::Disconnected,
                    e => panic!("{e}"),
                }),
            },
        };
        match next {
            Ok(i) => got.push(i),
            Err(GetError::Disconnected) => break,
            Err(e) => panic!("{e}"),
        }
    }
    producer.join().unwrap();
    assert!(got.iter().copied().eq(0..M), "each once, in order");
    let s = consumer.stats().unwrap();
    assert_eq!((s.delivered, s.requeued, s.in_flight, s.waiting), (M as u64, 0, 0, 0), "{s:?}");
}

/// The program's lock that [`Locked`] messages take as they are encoded.
static PROGRAM_LOCK: Mutex<()> = Mutex::new(());

/// Set once a [`Locked`] message's encoding has begun.
static ENCODING_LOCKED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A message whose `Serialize` takes a lock of the program's (as serde's does for a message
/// holding an `Arc<Mutex<_>>`).
#[derive(Debug, serde::Deserialize)]
struct Locked(u32);

impl serde::Serialize for Locked {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        ENCODING_LOCKED.store(true, std::sync::atomic::Ordering::SeqCst);
        let _held = PROGRAM_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        s.serialize_u32(self.0)
    }
}

/// One put is being sent to a waiting consumer, its `Serialize` waiting for a lock that
/// another thread holds; that thread's own put returns (it does not wait for the first put's
/// send, which waits for it), and both messages arrive.
#[test]
fn a_put_does_not_wait_for_another_puts_send() {
    let queue = Queue::<Locked>::new().unwrap();
    let consumer = queue.consumer().with_prefetch(0);
    let getter =
        std::thread::spawn(move || (0..2).map(|_| consumer.get_timeout(WAIT).map(|m| m.0)).collect::<Vec<_>>());
    wait_until("the consumer waits", || queue.stats().is_ok_and(|s| s.waiting == 1));
    let held = PROGRAM_LOCK.lock().unwrap();
    let first = queue.clone();
    let sending = std::thread::spawn(move || first.put(Locked(1)).is_ok());
    // It has taken the dispatcher (on its thread or the server's) and waits in `Serialize`.
    wait_until("the first put is being encoded", || ENCODING_LOCKED.load(std::sync::atomic::Ordering::SeqCst));
    let (done, put_returned) = std::sync::mpsc::channel();
    let second = queue.clone();
    std::thread::spawn(move || done.send(second.put(Locked(2)).is_ok()));
    let returned = put_returned.recv_timeout(Duration::from_secs(5));
    drop(held);
    assert_eq!(returned, Ok(true), "a put waited for another put's send, which waited for a lock its thread held");
    assert!(sending.join().unwrap());
    let mut got: Vec<u32> = getter.join().unwrap().into_iter().map(|m| m.expect("a message")).collect();
    got.sort();
    assert_eq!(got, [1, 2]);
}

/// A message whose `Serialize` panics for the value 13.
#[derive(Debug, serde::Deserialize)]
struct Unlucky(u32);

impl serde::Serialize for Unlucky {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        assert_ne!(self.0, 13, "unlucky");
        s.serialize_u32(self.0)
    }
}

/// A message whose encoding panics on its way to a consumer is dropped, the consumer's get
/// says so once, and the queue goes on: the next messages arrive.
#[test]
fn a_message_whose_serialize_panics_is_dropped_and_the_queue_goes_on() {
    let queue = Queue::<Unlucky>::new().unwrap();
    let consumer = queue.consumer().with_prefetch(0);
    for i in [12, 13, 14] {
        queue.put(Unlucky(i)).unwrap();
    }
    assert_eq!(consumer.get_timeout(WAIT).unwrap().0, 12);
    match consumer.get_timeout(WAIT) {
        Err(GetTimeoutError::Malformed(why)) => assert!(why.contains("panicked"), "{why}"),
        other => panic!("the get of the message that could not be encoded returned {other:?}"),
    }
    assert_eq!(consumer.get_timeout(WAIT).unwrap().0, 14);
    // Asked on the consumer's own channel, after its acknowledgements.
    let stats = consumer.stats().unwrap();
    assert_eq!((stats.discarded, stats.delivered, stats.backlog), (1, 2, 0), "{stats:?}");
}

/// A message whose `Serialize` panics for 13 and, for 99, waits until [`Gated::open`] (the
/// queue's dispatcher holds its lock meanwhile, so puts of other threads wait in line).
#[derive(Debug, serde::Deserialize)]
struct Gated(u32);

static GATE_OPEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static GATE_REACHED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl Gated {
    fn open() {
        GATE_OPEN.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl serde::Serialize for Gated {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use std::sync::atomic::Ordering::SeqCst;
        assert_ne!(self.0, 13, "unlucky");
        if self.0 == 99 {
            GATE_REACHED.store(true, SeqCst);
            while !GATE_OPEN.load(SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        s.serialize_u32(self.0)
    }
}

/// A consumer's acknowledgement (which asks for one more message) that crosses the
/// dispatcher's report of a failed send (which withdraws what the consumer wanted): both sides
/// still count the one more message alike, so the consumer's later gets, tries and statistics
/// are answered in turn.
#[test]
fn an_acknowledgement_that_crosses_a_failed_send_keeps_both_sides_counting_alike() {
    let _one = serial();
    let queue = Queue::<Gated>::new().unwrap();
    let c = queue.consumer(); // two asked for ahead
    let d = queue.consumer().with_prefetch(0);
    queue.put(Gated(1)).unwrap();
    assert_eq!(c.get_timeout(WAIT).unwrap().0, 1);
    let s = c.stats().unwrap();
    assert_eq!((s.delivered, s.in_flight), (1, 0), "{s:?}");
    queue.put(Gated(2)).unwrap(); // sent to c, unread in its channel
    let d_get = std::thread::spawn(move || d.get_timeout(WAIT).map(|m| m.0));
    wait_until("d waits", || queue.stats().is_ok_and(|s| s.waiting == 1));
    // 99 goes to d (fewest in flight); its encoding holds the dispatcher's lock.
    let q = queue.clone();
    let slow = std::thread::spawn(move || q.put(Gated(99)).unwrap());
    wait_until("99 is being encoded", || GATE_REACHED.load(std::sync::atomic::Ordering::SeqCst));
    // c takes 2: its acknowledgement (asking for one more) waits for the lock.
    assert_eq!(c.get_timeout(WAIT).unwrap().0, 2);
    // 13 waits too, and is taken in first: its send to c fails, withdrawing what c wanted,
    // before the dispatcher reads the acknowledgement.
    queue.put(Gated(13)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    Gated::open();
    slow.join().unwrap();
    assert_eq!(d_get.join().unwrap().unwrap(), 99);
    match c.get_timeout(WAIT) {
        Err(GetTimeoutError::Malformed(why)) => assert!(why.contains("panicked"), "{why}"),
        other => panic!("expected the discard of 13, got {other:?}"),
    }
    // c still wants the one its acknowledgement asked for, and is sent 3 for it.
    queue.put(Gated(3)).unwrap();
    wait_until("3 is in flight", || queue.stats().is_ok_and(|s| s.in_flight == 1));
    let s = c.stats().unwrap_or_else(|e| panic!("the statistics of a consumer that asked for 3: {e}"));
    assert_eq!(s.in_flight, 1, "{s:?}");
    assert_eq!(c.try_get().unwrap().0, 3);
    assert!(c.try_get().unwrap_err().is_empty());
    queue.put(Gated(4)).unwrap();
    assert_eq!(c.get_timeout(WAIT).unwrap().0, 4);
}

/// A message of a tensor whose encoding panics after the tensor's.
struct TensorThenPanic(HostTensor<f32>);

impl serde::Serialize for TensorThenPanic {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeTuple;
        let mut t = s.serialize_tuple(2)?;
        t.serialize_element(&self.0)?;
        panic!("a Serialize that panics after its tensor");
    }
}

impl<'de> serde::Deserialize<'de> for TensorThenPanic {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        <(HostTensor<f32>, u8) as serde::Deserialize>::deserialize(d).map(|(t, _)| TensorThenPanic(t))
    }
}

/// Messages whose encoding panicked after their tensor's are discarded, and their tensors
/// freed while the queue and its consumer live on: what their encoding counted on the
/// channel's lease is taken back.
#[test]
fn tensors_of_messages_whose_serialize_panicked_are_freed() {
    let _g = serial();
    let before = lifetime_stats();
    let queue = Queue::<TensorThenPanic>::new().unwrap();
    let consumer = queue.consumer().with_prefetch(0);
    // The first message introduces the channel's lease; the second is counted on it.
    for v in [1.0, 2.0] {
        queue.put(TensorThenPanic(HostTensor::full(&[1024], v).unwrap())).unwrap();
    }
    assert!(consumer.get_timeout(WAIT).is_err());
    assert!(consumer.get_timeout(WAIT).is_err());
    assert_eq!(queue.stats().unwrap().discarded, 2);
    let freed = wait_for_lifetime(WAIT, |s| {
        s.live_storages == before.live_storages && s.exported_storages == before.exported_storages
    });
    assert!(freed.is_ok(), "the tensors of discarded messages are alive: {:?} (before {before:?})", lifetime_stats());
}

/// Threads of the queue's process put at once, while consumers of the same process get: every
/// message arrives once, and each consumer gets each thread's messages in the order put (puts
/// that find the dispatcher busy wait in line, not in a heap of their own).
#[test]
fn puts_of_many_threads_arrive_once_and_in_each_threads_order() {
    const THREADS: u32 = 8;
    const EACH: u32 = 2_000;
    let queue = Queue::<(u32, u32)>::new().unwrap();
    let getters: Vec<_> = (0..2)
        .map(|_| {
            let consumer = queue.consumer();
            std::thread::spawn(move || {
                let mut got = Vec::new();
                while let Ok(m) = consumer.get_timeout(WAIT) {
                    got.push(m);
                }
                got
            })
        })
        .collect();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let queue = queue.clone();
            s.spawn(move || (0..EACH).for_each(|i| queue.put((t, i)).unwrap()));
        }
    });
    drop(queue);
    let mut all = BTreeSet::new();
    for getter in getters {
        let got = getter.join().unwrap();
        for t in 0..THREADS {
            let mine: Vec<u32> = got.iter().filter(|m| m.0 == t).map(|m| m.1).collect();
            assert!(mine.windows(2).all(|w| w[0] < w[1]), "thread {t}'s messages out of order");
        }
        for m in got {
            assert!(all.insert(m), "{m:?} delivered twice");
        }
    }
    assert_eq!(all.len(), (THREADS * EACH) as usize, "messages lost");
}

/// A message whose `Drop` panics (the dispatcher drops its own copy once the message is
/// delivered).
#[derive(serde::Serialize, serde::Deserialize)]
struct PanicsOnDrop(u32);

impl Drop for PanicsOnDrop {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            panic!("a Drop that panics");
        }
    }
}

/// The dispatcher drops what was delivered on the thread that read the acknowledgement: a
/// `Drop` that panics there does not end that thread, and the consumer's next gets are served.
#[test]
fn a_message_whose_drop_panics_does_not_stop_its_consumers_gets() {
    let queue = Queue::<PanicsOnDrop>::new().unwrap();
    let consumer = queue.consumer().with_prefetch(0);
    for i in 0..3 {
        queue.put(PanicsOnDrop(i)).unwrap();
    }
    for i in 0..3 {
        let got = consumer.get_timeout(WAIT).expect("a get after a delivered message's Drop panicked");
        assert_eq!(got.0, i);
        std::mem::forget(got);
    }
}

/// The queue's creator for the test below: puts three numbers and hands out a consumer, then
/// sits at its descriptor limit until told (saying so: 1), frees its descriptors (saying so:
/// 0), and ends when told.
fn creator_at_its_descriptor_limit((out, at_limit, ctl): (Sender<QueueConsumer<u32>>, Sender<u8>, Receiver<u8>)) {
    let queue = Queue::<u32>::new().unwrap();
    for i in 0..3 {
        queue.put(i).unwrap();
    }
    out.send(queue.consumer()).unwrap();
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    let had = common::set_soft_limit(open + 64);
    let mut held = Vec::new();
    while let Ok(f) = std::fs::File::open("/dev/null") {
        held.push(f);
    }
    // A message of no descriptor.
    at_limit.send(1).unwrap();
    assert_eq!(ctl.recv().unwrap(), 1);
    drop(held);
    common::set_soft_limit(had);
    at_limit.send(0).unwrap();
    assert_eq!(ctl.recv().unwrap(), 2);
}

/// A consumer that joins while the queue's process is out of descriptors (its join's channels
/// cannot be taken in there) is told so, not that the queue is closed; once the queue's process
/// has descriptors again, its next get joins and gets.
#[test]
fn a_consumer_whose_join_is_lost_at_the_descriptor_limit_is_not_told_the_queue_closed() {
    let (out_tx, out) = channel().unwrap();
    let (at_limit_tx, at_limit) = channel::<u8>().unwrap();
    let (ctl, ctl_rx) = channel::<u8>().unwrap();
    let mut creator = spawn((out_tx, at_limit_tx, ctl_rx), creator_at_its_descriptor_limit);
    let consumer = out.recv_timeout(WAIT).unwrap();
    assert_eq!(at_limit.recv_timeout(WAIT).unwrap(), 1);
    let first = consumer.get_timeout(Duration::from_secs(5));
    ctl.send(1).unwrap();
    assert_eq!(at_limit.recv_timeout(WAIT).unwrap(), 0, "the creator has its descriptors again");
    let second = consumer.get_timeout(WAIT);
    ctl.send(2).unwrap();
    creator.join_timeout(WAIT).unwrap();
    match first {
        Err(GetTimeoutError::Io(e)) => assert!(e.to_string().contains("could not take this consumer in"), "{e}"),
        other => panic!("a get while the queue's process was out of descriptors: {other:?}"),
    }
    assert_eq!(second.unwrap(), 0);
}

thread_local! {
    /// Whether this thread's gets refuse every 13 (see `Picky`), as a consumer that does not see
    /// a message's GPU would.
    static REFUSE_ALL_13: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A value that encodes and does not decode: 13 never does, 14 not on a thread that refuses it.
#[derive(Debug, PartialEq)]
struct Picky(u32);

impl serde::Serialize for Picky {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u32(self.0)
    }
}

impl<'de> serde::Deserialize<'de> for Picky {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Picky, D::Error> {
        match u32::deserialize(d)? {
            13 => Err(serde::de::Error::custom("13 does not decode")),
            14 if REFUSE_ALL_13.get() => Err(serde::de::Error::custom("14 does not decode here")),
            n => Ok(Picky(n)),
        }
    }
}

/// Gets until one returns a message, counting the errors before it (each must say the message
/// that did not decode was handed on or dropped).
fn get_past_errors(get: impl Fn() -> Result<Picky, String>) -> (Picky, usize) {
    let t = Instant::now();
    let mut errors = 0;
    loop {
        match get() {
            Ok(value) => return (value, errors),
            Err(e) if e == "empty" && t.elapsed() < WAIT => std::thread::sleep(Duration::from_millis(1)),
            Err(e) => {
                assert!(e.contains("could not decode it") && t.elapsed() < WAIT, "{e}");
                errors += 1;
            }
        }
    }
}

#[test]
fn a_message_no_consumer_can_decode_is_dropped_and_the_order_kept() {
    for prefetch in [0, 2] {
        let queue = Queue::<Picky>::new().unwrap();
        let consumer = queue.consumer().with_prefetch(prefetch);
        for n in [1, 13, 2, 3] {
            queue.put(Picky(n)).unwrap();
        }
        // The only consumer could not decode it: it is not handed that one again, and nothing
        // overtook it.
        assert_eq!(consumer.get().unwrap(), Picky(1));
        assert_eq!(get_past_errors(|| consumer.get().map_err(|e| e.to_string())), (Picky(2), 1), "prefetch {prefetch}");
        assert_eq!(consumer.get_timeout(WAIT).unwrap(), Picky(3));
        assert!(consumer.get_timeout(Duration::from_millis(100)).unwrap_err().is_timeout());
        // It waits for a consumer that joins later, while a producer is left...
        let stats = queue.stats().unwrap();
        assert_eq!((stats.discarded, stats.requeued, stats.backlog), (0, 1, 1), "prefetch {prefetch}: {stats:?}");
        // ...and is dropped once none is: the consumer there is told the queue is closed.
        drop(queue);
        let end = consumer.get_timeout(WAIT).unwrap_err();
        assert!(end.is_disconnected(), "prefetch {prefetch}: {end}");
    }
    // The same through `try_get`, whose answer is the undecodable message itself.
    let queue = Queue::<Picky>::new().unwrap();
    let consumer = queue.consumer().with_prefetch(0);
    for n in [13, 4] {
        queue.put(Picky(n)).unwrap();
    }
    let try_get = || match consumer.try_get() {
        Err(TryGetError::Empty) => Err("empty".to_string()),
        other => other.map_err(|e| e.to_string()),
    };
    assert_eq!(get_past_errors(try_get), (Picky(4), 1));
    let stats = queue.stats().unwrap();
    assert_eq!((stats.discarded, stats.requeued, stats.backlog), (0, 1, 1), "{stats:?}");
}

/// A message whose `Deserialize` panics on 13.
#[derive(Debug, PartialEq, serde::Serialize)]
struct Touchy(u32);

impl<'de> serde::Deserialize<'de> for Touchy {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = <u32 as serde::Deserialize>::deserialize(d)?;
        assert_ne!(n, 13, "13 panics");
        Ok(Touchy(n))
    }
}

#[test]
fn a_message_whose_decoding_panics_is_refused_as_undecodable_not_first_in_line_for_ever() {
    for try_get in [false, true] {
        let queue = Queue::<Touchy>::new().unwrap();
        let consumer = queue.consumer().with_prefetch(0);
        queue.put(Touchy(13)).unwrap();
        queue.put(Touchy(2)).unwrap();
        let get = || {
            if try_get {
                match consumer.try_get() {
                    Err(TryGetError::Empty) => Err("empty".to_string()),
                    other => other.map_err(|e| e.to_string()),
                }
            } else {
                consumer.get_timeout(WAIT).map_err(|e| e.to_string())
            }
        };
        let t = Instant::now();
        let (got, errors) = loop {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(get)) {
                Ok(Err(e)) if e == "empty" && t.elapsed() < WAIT => std::thread::sleep(Duration::from_millis(1)),
                Ok(Err(e)) => {
                    assert!(e.contains("decoding panicked") && e.contains("13 panics"), "try_get {try_get}: {e}");
                    assert!(t.elapsed() < WAIT, "try_get {try_get}: {e}");
                }
                Ok(Ok(value)) => break (value, queue.stats().unwrap().requeued),
                Err(_) => panic!("try_get {try_get}: the get panicked"),
            }
        };
        assert_eq!((got, errors), (Touchy(2), 1), "try_get {try_get}");
    }
}

#[test]
fn a_message_one_consumer_cannot_decode_goes_to_another_and_each_once() {
    let queue = Queue::<Picky>::new().unwrap();
    for n in [1, 2, 14, 4] {
        queue.put(Picky(n)).unwrap();
    }
    // A consumer that reads ahead, then asks for the counters: 2 and 14 are read ahead of their
    // gets; 14's refusal must not take 2 for it.
    let refusing = queue.consumer().with_prefetch(2);
    let taking = queue.consumer().with_prefetch(0);
    let got = std::thread::scope(|s| {
        s.spawn(|| {
            REFUSE_ALL_13.set(true);
            let mut got = vec![refusing.get().unwrap().0];
            let _ = refusing.stats().unwrap();
            let mut errors = 0;
            loop {
                match refusing.get_timeout(Duration::from_millis(500)) {
                    Ok(Picky(n)) => got.push(n),
                    Err(e) if e.is_timeout() => break,
                    Err(e) => {
                        assert!(e.to_string().contains("could not decode it"), "{e}");
                        errors += 1;
                    }
                }
            }
            (got, errors)
        })
        .join()
        .unwrap()
    });
    // The other consumer gets 14 (if the first did not take 4 before); each message once.
    let mut all = got.0.clone();
    while let Ok(Picky(n)) = taking.get_timeout(Duration::from_millis(500)) {
        all.push(n);
    }
    all.sort_unstable();
    assert_eq!(all, [1, 2, 4, 14], "each message once: {got:?}");
    assert_eq!(got.1, 1, "one refusal");
    drop((refusing, taking));
    let stats = queue.stats().unwrap();
    assert_eq!((stats.discarded, stats.requeued, stats.delivered), (0, 1, 4), "{stats:?}");
}
