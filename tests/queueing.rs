//! Queueing across real processes: unbounded sends that never wait for the reader (with host
//! tensors in the backlog), bounded channels, disconnection, the receive forms (try_iter,
//! `for x in &rx`, results with malformed messages), select over several processes, and
//! receives under tokio.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use cuda_mp::{
    HostTensor, Receiver, RecvError, Select, Sender, TrySendError, bounded, channel, lifetime_stats, spawn,
    wait_for_lifetime,
};

mod common;

cuda_mp::enable_test_support!();

static SERIAL: Mutex<()> = Mutex::new(());
const WAIT: Duration = Duration::from_secs(20);

fn serial() -> std::sync::MutexGuard<'static, ()> {
    common::serial(&SERIAL, WAIT)
}

/// Runs `f` on a thread of its own and fails if it has not returned after `limit`: a send that
/// stalls fails the test instead of hanging it.
fn within<R: Send + 'static>(limit: Duration, what: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done_tx.send(f());
    });
    match done_rx.recv_timeout(limit) {
        Ok(r) => r,
        Err(_) => panic!("{what} did not finish within {limit:?}: it stalled"),
    }
}

/// Waits for `go`, then receives everything until the channel disconnects; returns how many
/// arrived and whether they came as 0, 1, 2, ...
fn count_in_order((rx, go): (Receiver<u32>, Receiver<()>)) -> (u64, bool) {
    go.recv().unwrap();
    let mut n = 0u64;
    let mut in_order = true;
    for x in &rx {
        in_order &= x as u64 == n;
        n += 1;
    }
    (n, in_order)
}

#[test]
fn two_hundred_thousand_sends_with_nobody_receiving_all_return_then_arrive_in_order() {
    const N: u32 = 200_000;
    let (tx, rx) = channel::<u32>().unwrap();
    let (go_tx, go_rx) = channel().unwrap();
    let child = spawn((rx, go_rx), count_in_order);
    // The receiver exists but does not read: a socket holds a few hundred of these.
    let tx = within(Duration::from_secs(20), "200,000 sends", move || {
        let start = Instant::now();
        for i in 0..N {
            tx.send(i).unwrap();
        }
        println!("200,000 sends with nobody receiving took {:?}", start.elapsed());
        tx
    });
    go_tx.send(()).unwrap();
    // The backlog is still delivered after the last sender is gone.
    drop(tx);
    assert_eq!(child.join().unwrap(), (N as u64, true));
}

/// Waits for `go`, then receives every tensor, checks that each holds its index, and drops
/// them all; returns how many were right.
fn check_tensors((rx, go, done): (Receiver<(i32, HostTensor<i32>)>, Receiver<()>, Sender<i32>)) {
    go.recv().unwrap();
    let mut right = 0;
    let mut held = Vec::new();
    for (i, t) in &rx {
        if t.to_vec().iter().all(|&x| x == i) {
            right += 1;
        }
        held.push(t);
    }
    drop(held);
    done.send(right).unwrap();
}

#[test]
fn host_tensors_in_the_backlog_keep_their_memory_until_received_and_are_freed_after() {
    const N: i32 = 3000;
    let _g = serial();
    let before = lifetime_stats();
    let (tx, rx) = channel().unwrap();
    let (go_tx, go_rx) = channel().unwrap();
    let (done_tx, done_rx) = channel().unwrap();
    let child = spawn((rx, go_rx, done_tx), check_tensors);
    within(Duration::from_secs(20), "3,000 sends of host tensors", move || {
        for i in 0..N {
            // Our own handle is dropped at once: only the message keeps the memory.
            tx.send((i, HostTensor::full(&[64], i).unwrap())).unwrap();
        }
    });
    let held = lifetime_stats();
    assert_eq!(held.live_storages - before.live_storages, N as usize, "every tensor in the backlog is alive");
    assert_eq!(held.exported_storages - before.exported_storages, N as usize);
    go_tx.send(()).unwrap();
    assert_eq!(done_rx.recv_timeout(WAIT).unwrap(), N, "every tensor arrived with its contents");
    child.join().unwrap();
    wait_for_lifetime(WAIT, |s| {
        s.live_storages == before.live_storages && s.outstanding_leases == before.outstanding_leases
    })
    .expect("every tensor is freed once the receiver dropped it");
}

/// Receives one message per `go`, reporting each.
fn receive_on_demand((rx, go, got): (Receiver<u32>, Receiver<()>, Sender<u32>)) {
    while go.recv().is_ok() {
        match rx.recv() {
            Ok(x) => got.send(x).unwrap(),
            Err(_) => break,
        }
    }
}

#[test]
fn a_bounded_channel_waits_at_capacity_times_out_and_reports_full() {
    let (tx, rx) = bounded::<u32>(4).unwrap();
    assert_eq!(tx.capacity(), Some(4));
    let (go_tx, go_rx) = channel().unwrap();
    let (got_tx, got_rx) = channel().unwrap();
    let child = spawn((rx, go_rx, got_tx), receive_on_demand);
    for i in 0..4 {
        tx.try_send(i).unwrap();
    }
    match tx.try_send(4) {
        Err(TrySendError::Full(v)) => assert_eq!(v, 4),
        other => panic!("expected Full, got {other:?}"),
    }
    let start = Instant::now();
    let err = tx.send_timeout(4, Duration::from_millis(100)).unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert!(start.elapsed() >= Duration::from_millis(100));
    assert_eq!(err.into_inner(), 4);
    // A send waits while the channel is full, and goes through once one message is received.
    let tx = std::sync::Arc::new(tx);
    let start = Instant::now();
    let waiting = {
        let tx = tx.clone();
        std::thread::spawn(move || {
            tx.send(4).unwrap();
            Instant::now()
        })
    };
    std::thread::sleep(Duration::from_millis(150));
    assert!(!waiting.is_finished(), "a send into a full channel waits");
    go_tx.send(()).unwrap();
    assert_eq!(got_rx.recv_timeout(WAIT).unwrap(), 0);
    assert!(waiting.join().unwrap() >= start + Duration::from_millis(150), "it went through only then");
    for expected in 1..5 {
        go_tx.send(()).unwrap();
        assert_eq!(got_rx.recv_timeout(WAIT).unwrap(), expected);
    }
    // Empty again: a whole capacity fits without waiting.
    for i in 5..9 {
        tx.send_timeout(i, Duration::ZERO).unwrap();
    }
    drop(go_tx);
    child.join().unwrap();
}

/// Sends messages of 32 KiB (more than a ring's entry: each takes the socket or, once the
/// socket is full, the backlog) until it is killed: it runs with the kill point "sent" set to
/// its `count`th message, written to its backlog's open batch, which dies with it.
fn send_until_killed((tx, count): (Sender<Vec<u8>>, usize)) {
    for i in 0..=count {
        tx.send(vec![i as u8; 32 << 10]).unwrap();
    }
    unreachable!("killed at its message {count}");
}

#[test]
fn a_sender_killed_with_messages_in_its_backlog_gives_their_places_back() {
    let _g = serial();
    const CAPACITY: usize = 64;
    let (tx, rx) = bounded::<Vec<u8>>(CAPACITY).unwrap();
    let mut child = cuda_mp::Builder::new()
        .env(cuda_mp::testing::KILL_AT_ENV, format!("sent:{CAPACITY}"))
        .spawn((tx.clone(), CAPACITY), send_until_killed)
        .unwrap();
    assert!(child.join_timeout(WAIT).is_err(), "the sender is killed at its last message");
    assert!(matches!(tx.try_send(Vec::new()), Err(TrySendError::Full(_))), "the dead sender holds every place");
    // What reached the socket (and the batches handed on) before the kill comes; the rest of
    // the backlog died with the sender.
    let mut received = 0;
    while let Ok(message) = rx.recv_timeout(Duration::from_millis(300)) {
        assert_eq!(message, vec![received as u8; 32 << 10], "message {received} as sent");
        received += 1;
    }
    assert!(received < CAPACITY, "the sender's last messages were lost with its backlog ({received} received)");
    // Every place is free again: a whole capacity fits, and not one more.
    for i in 0..CAPACITY {
        assert!(tx.try_send(vec![1]).is_ok(), "place {i} of {CAPACITY} ({received} received from the sender)");
    }
    assert!(matches!(tx.try_send(vec![2]), Err(TrySendError::Full(_))), "the bound holds");
    for _ in 0..CAPACITY {
        assert_eq!(rx.recv_timeout(WAIT).unwrap(), vec![1]);
    }
}

fn hold_receiver_forever((rx, ready): (Receiver<u32>, Sender<()>)) {
    ready.send(()).unwrap();
    loop {
        std::thread::park();
        let _ = &rx;
    }
}

#[test]
fn sends_to_a_receiver_that_is_gone_fail_with_the_value_back() {
    // Unbounded, the receiver dropped in this process.
    let (tx, rx) = channel::<String>().unwrap();
    drop(rx);
    let err = tx.send("one".into()).unwrap_err();
    assert!(err.is_disconnected());
    assert_eq!(err.into_inner(), "one");
    match tx.try_send("two".into()) {
        Err(TrySendError::Disconnected(v)) => assert_eq!(v, "two"),
        other => panic!("expected Disconnected, got {other:?}"),
    }
    let err = tx.send_timeout("three".into(), Duration::from_secs(1)).unwrap_err();
    assert!(err.is_disconnected());
    assert_eq!(err.into_inner(), "three");

    // Bounded and full, the receiving process killed while a send waits.
    let (tx, rx) = bounded::<u32>(2).unwrap();
    let (ready_tx, ready_rx) = channel().unwrap();
    let mut child = spawn((rx, ready_tx), hold_receiver_forever);
    ready_rx.recv_timeout(WAIT).unwrap();
    tx.send(1).unwrap();
    tx.send(2).unwrap();
    let tx = std::sync::Arc::new(tx);
    let waiting = {
        let tx = tx.clone();
        std::thread::spawn(move || tx.send(3))
    };
    std::thread::sleep(Duration::from_millis(100));
    child.kill().unwrap();
    let err = waiting.join().unwrap().unwrap_err();
    assert!(err.is_disconnected(), "{err}");
    assert_eq!(err.into_inner(), 3);
    assert!(tx.try_send(4).unwrap_err().is_disconnected());

    // Unbounded with a backlog when the receiver goes: later sends fail.
    let (tx, rx) = channel::<u32>().unwrap();
    for i in 0..2000 {
        tx.send(i).unwrap();
    }
    drop(rx);
    let deadline = Instant::now() + WAIT;
    let err = loop {
        match tx.send(0) {
            Err(e) => break e,
            Ok(()) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(()) => panic!("sends still succeed {WAIT:?} after the receiver was dropped"),
        }
    };
    assert!(err.is_disconnected(), "{err}");
}

fn send_then_report((tx, n, sent): (Sender<u32>, u32, Sender<()>)) {
    for i in 0..n {
        tx.send(i).unwrap();
    }
    sent.send(()).unwrap();
}

#[test]
fn try_iter_takes_what_waits_and_for_x_in_rx_runs_to_the_end() {
    let (tx, rx) = channel::<u32>().unwrap();
    assert_eq!(rx.try_iter().count(), 0);
    let (sent_tx, sent_rx) = channel().unwrap();
    let child = spawn((tx, 5, sent_tx), send_then_report);
    sent_rx.recv_timeout(WAIT).unwrap();
    // Everything was sent before the report; it may still be on its way.
    let mut got = Vec::new();
    let deadline = Instant::now() + WAIT;
    while got.len() < 5 && Instant::now() < deadline {
        got.extend(rx.try_iter());
    }
    assert_eq!(got, vec![0, 1, 2, 3, 4]);
    assert!(rx.try_recv().is_err(), "nothing more");
    child.join().unwrap();

    // The worker exits after a backlog of its own: it is handed on first.
    let (tx, rx) = channel::<u32>().unwrap();
    let (sent_tx, sent_rx) = channel().unwrap();
    let child = spawn((tx, 20_000, sent_tx), send_then_report);
    sent_rx.recv_timeout(WAIT).unwrap();
    let mut n = 0;
    for x in &rx {
        assert_eq!(x, n);
        n += 1;
    }
    assert_eq!(n, 20_000, "the loop ends when the worker is gone, after its last message");
    child.join().unwrap();
}

#[test]
fn iterating_results_surfaces_a_malformed_message_and_goes_on() {
    // Bytes sent where strings are expected: invalid UTF-8 does not decode.
    let (tx, rx) = common::connect::<Vec<u8>, String>();
    tx.send(b"first".to_vec()).unwrap();
    tx.send(vec![0xff, 0xfe]).unwrap();
    tx.send(b"second".to_vec()).unwrap();
    drop(tx);
    let all: Vec<Result<String, RecvError>> = rx.iter_results().collect();
    assert_eq!(all.len(), 3, "{all:?}");
    assert_eq!(all[0].as_deref(), Ok("first"));
    assert!(matches!(&all[1], Err(RecvError::Malformed(_))), "{:?}", all[1]);
    assert_eq!(all[2].as_deref(), Ok("second"));

    // `iter` stops at the first failure instead.
    let (tx, rx) = common::connect::<Vec<u8>, String>();
    tx.send(b"only".to_vec()).unwrap();
    tx.send(vec![0xff]).unwrap();
    tx.send(b"never seen".to_vec()).unwrap();
    assert_eq!(rx.iter().collect::<Vec<_>>(), vec!["only".to_string()]);
}

fn send_later((id, tx): (u64, Sender<u64>)) {
    std::thread::sleep(Duration::from_millis(150 + 100 * id));
    for k in 0..3 {
        tx.send(id * 10 + k).unwrap();
    }
}

#[test]
fn select_waits_for_three_receivers_fed_by_three_processes() {
    let mut receivers = Vec::new();
    let mut children = Vec::new();
    for id in 0..3u64 {
        let (tx, rx) = channel::<u64>().unwrap();
        children.push(spawn((id, tx), send_later));
        receivers.push(rx);
    }
    let mut sel = Select::new();
    for rx in &receivers {
        sel.add(rx);
    }
    // Nothing for the first 150 ms.
    let start = Instant::now();
    assert!(sel.select_timeout(Duration::from_millis(50)).unwrap_err().is_timeout());
    assert!(start.elapsed() >= Duration::from_millis(50));
    let mut got = vec![Vec::new(); 3];
    let mut open = 3;
    while open > 0 {
        let i = sel.select_timeout(WAIT).expect("a receiver becomes ready");
        match receivers[i].try_recv() {
            Ok(x) => got[i].push(x),
            Err(e) if e.is_disconnected() => {
                sel.remove(i);
                open -= 1;
            }
            Err(e) => assert!(e.is_empty(), "{e}"),
        }
    }
    for (id, values) in got.iter().enumerate() {
        let id = id as u64;
        assert_eq!(values, &vec![id * 10, id * 10 + 1, id * 10 + 2], "receiver {id} got its process's messages");
    }
    assert!(sel.select_timeout(Duration::ZERO).is_err(), "nothing left to select");
    for c in children {
        c.join().unwrap();
    }
}

fn send_after_a_pause((tx, n): (Sender<u64>, u64)) {
    for i in 0..n {
        std::thread::sleep(Duration::from_millis(20));
        tx.send(i).unwrap();
    }
}

#[test]
fn recv_async_serves_tokio_tasks_on_both_runtimes() {
    // Current-thread runtime: the one thread must not block while nothing has arrived.
    let (tx, rx) = channel::<u64>().unwrap();
    let child = spawn((tx, 5), send_after_a_pause);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let ticks = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (got, ticks_at_first) = runtime.block_on(async {
        let counter = ticks.clone();
        tokio::spawn(async move {
            for _ in 0..100 {
                tokio::time::sleep(Duration::from_millis(5)).await;
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        });
        let mut got = Vec::new();
        let mut ticks_at_first = None;
        while let Ok(x) = rx.recv_async().await {
            ticks_at_first.get_or_insert(ticks.load(std::sync::atomic::Ordering::SeqCst));
            got.push(x);
        }
        (got, ticks_at_first)
    });
    assert_eq!(got, vec![0, 1, 2, 3, 4]);
    assert!(ticks_at_first.unwrap() > 0, "the timer task ran while the receive waited");
    child.join().unwrap();

    // Multi-thread runtime: receivers moved into spawned tasks, one as a stream.
    let (tx_a, rx_a) = channel::<u64>().unwrap();
    let (tx_b, rx_b) = channel::<u64>().unwrap();
    let children = [spawn((tx_a, 4), send_after_a_pause), spawn((tx_b, 4), send_after_a_pause)];
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).build().unwrap();
    let (a, b) = runtime.block_on(async move {
        let a = tokio::spawn(async move {
            let mut got = Vec::new();
            while let Ok(x) = rx_a.recv_async().await {
                got.push(x);
            }
            got
        });
        let b = tokio::spawn(async move {
            let mut stream = rx_b.into_stream();
            let mut got = Vec::new();
            while let Some(x) =
                std::future::poll_fn(|cx| futures_core::Stream::poll_next(std::pin::Pin::new(&mut stream), cx)).await
            {
                got.push(x.unwrap());
            }
            got
        });
        (a.await.unwrap(), b.await.unwrap())
    });
    assert_eq!(a, vec![0, 1, 2, 3]);
    assert_eq!(b, vec![0, 1, 2, 3]);
    for c in children {
        c.join().unwrap();
    }
}

#[test]
fn select_and_async_receives_follow_a_spilled_backlog() {
    const N: u32 = 5000;
    // Far more than the socket holds: most of these wait in the sender's backlog.
    let (tx, rx) = channel::<u32>().unwrap();
    for i in 0..N {
        tx.send(i).unwrap();
    }
    drop(tx);
    let mut sel = Select::new();
    let i = sel.add(&rx);
    let mut got = Vec::new();
    loop {
        assert_eq!(sel.select_timeout(WAIT), Ok(i));
        match rx.try_recv() {
            Ok(x) => got.push(x),
            Err(e) if e.is_disconnected() => break,
            Err(e) => assert!(e.is_empty(), "{e}"),
        }
    }
    assert_eq!(got, (0..N).collect::<Vec<_>>());

    let (tx, rx) = channel::<u32>().unwrap();
    for i in 0..N {
        tx.send(i).unwrap();
    }
    drop(tx);
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let got = runtime.block_on(async {
        let mut got = Vec::new();
        while let Ok(x) = rx.recv_async().await {
            got.push(x);
        }
        got
    });
    assert_eq!(got, (0..N).collect::<Vec<_>>());
}

fn count_rest((rx, first): (Receiver<u32>, u32)) -> (u32, bool) {
    let mut next = first;
    let mut in_order = true;
    for x in &rx {
        in_order &= x == next;
        next += 1;
    }
    (next - first, in_order)
}

#[test]
fn a_receiver_moved_to_another_process_in_the_middle_of_a_backlog_goes_on_in_order() {
    const N: u32 = 20_000;
    let (tx, rx) = channel::<u32>().unwrap();
    for i in 0..N {
        tx.send(i).unwrap();
    }
    drop(tx);
    // Deep enough to be reading a spilled batch, most likely.
    let taken = 3000;
    for i in 0..taken {
        assert_eq!(rx.recv().unwrap(), i);
    }
    let child = spawn((rx, taken), count_rest);
    assert_eq!(child.join().unwrap(), (N - taken, true));
}
