//! Channel semantics across processes: queues with many producers, pipes, names, timeouts and
//! disconnection when a peer dies.

use std::time::{Duration, Instant};

use cuda_mp::{Duplex, HostTensor, Listener, RecvError, RecvTimeoutError, Sender, TryRecvError, channel, pipe, spawn};

cuda_mp::enable_test_support!();

const WAIT: Duration = Duration::from_secs(10);

fn produce((id, tx): (i32, Sender<(i32, HostTensor<i32>)>)) {
    for k in 0..10 {
        tx.send((id, HostTensor::full(&[8], id * 100 + k).unwrap())).unwrap();
    }
}

#[test]
fn many_producers_feed_one_receiver_until_all_are_gone() {
    let (tx, rx) = channel().unwrap();
    let children: Vec<_> = (0..4).map(|id| spawn((id, tx.clone()), produce)).collect();
    drop(tx);
    let mut seen = vec![Vec::new(); 4];
    loop {
        match rx.recv_timeout(WAIT) {
            Ok((id, t)) => {
                let v = t.to_vec();
                assert!(v.iter().all(|&x| x == v[0]), "tensor from producer {id} is uniform");
                assert_eq!(v[0] / 100, id);
                seen[id as usize].push(v[0] % 100);
            }
            Err(RecvTimeoutError::Disconnected) => break,
            Err(e) => panic!("unexpected {e}"),
        }
    }
    for (id, ks) in seen.iter().enumerate() {
        assert_eq!(ks, &(0..10).collect::<Vec<_>>(), "producer {id}'s messages arrive in order");
    }
    for c in children {
        c.join().unwrap();
    }
}

#[test]
fn recv_timeout_and_try_recv_report_an_empty_channel() {
    let (tx, rx) = channel::<u32>().unwrap();
    assert_eq!(rx.try_recv(), Err(TryRecvError::Empty));
    let start = Instant::now();
    assert_eq!(rx.recv_timeout(Duration::from_millis(100)), Err(RecvTimeoutError::Timeout));
    assert!(start.elapsed() >= Duration::from_millis(100));
    tx.send(7).unwrap();
    assert_eq!(rx.recv_timeout(WAIT), Ok(7));
    drop(tx);
    // Another test of this binary may be starting a process right now: between its fork and
    // its exec the child holds a copy of every descriptor, the sender's too, so the
    // disconnection can show a moment late.
    let deadline = Instant::now() + WAIT;
    let mut seen = rx.try_recv();
    while seen == Err(TryRecvError::Empty) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
        seen = rx.try_recv();
    }
    assert_eq!(seen, Err(TryRecvError::Disconnected));
    assert_eq!(rx.recv(), Err(RecvError::Disconnected));
}

fn hold_sender_forever((tx, ready): (Sender<u32>, Sender<()>)) {
    ready.send(()).unwrap();
    loop {
        std::thread::park();
        let _ = &tx;
    }
}

#[test]
fn a_receiver_sees_disconnection_when_the_sending_process_dies() {
    let (tx, rx) = channel::<u32>().unwrap();
    let (ready_tx, ready_rx) = channel().unwrap();
    let mut child = spawn((tx, ready_tx), hold_sender_forever);
    ready_rx.recv_timeout(WAIT).unwrap();
    assert_eq!(rx.try_recv(), Err(TryRecvError::Empty));
    child.kill().unwrap();
    assert_eq!(rx.recv_timeout(WAIT), Err(RecvTimeoutError::Disconnected));
}

fn receive_once(rx: cuda_mp::Receiver<u32>) -> u32 {
    rx.recv().unwrap()
}

#[test]
fn a_sender_gets_its_value_back_when_the_receiving_process_is_gone() {
    let (tx, rx) = channel::<u32>().unwrap();
    let child = spawn(rx, receive_once);
    tx.send(1).unwrap();
    assert_eq!(child.join().unwrap(), 1);
    // The result arrives just before the child exits; its descriptors close when it does.
    let deadline = Instant::now() + WAIT;
    let err = loop {
        match tx.send(2) {
            Err(e) => break e,
            Ok(()) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(()) => panic!("sends still succeed {WAIT:?} after the receiving process ended"),
        }
    };
    assert!(err.is_disconnected(), "{err}");
    assert_eq!(err.to_string(), "sending on a disconnected channel");
    assert_eq!(err.into_inner(), 2);
}

/// Receives in step with the sender until `u32::MAX`; gives how many came through its ring. It
/// polls rather than sleeps in the kernel (a sender writes no ring to a sleeping receiver), so
/// that the ring is taken however slowly the sender comes back to it.
fn receive_in_step((rx, acks): (cuda_mp::Receiver<u32>, Sender<()>)) -> u64 {
    let before = cuda_mp::testing::ring_messages_received();
    let deadline = Instant::now() + WAIT;
    loop {
        match rx.try_recv() {
            Ok(u32::MAX) => break,
            Ok(_) => acks.send(()).unwrap(),
            Err(TryRecvError::Empty) if Instant::now() < deadline => std::thread::yield_now(),
            Err(e) => panic!("the child's receive failed: {e}"),
        }
    }
    cuda_mp::testing::ring_messages_received() - before
}

/// A message that would take the ring (where a write cannot fail) after a pause looks first:
/// the first send to a receiver that died meanwhile fails, with the value back, not some
/// messages later.
#[test]
fn the_first_send_after_a_pause_to_a_receiver_gone_meanwhile_fails() {
    let (tx, rx) = channel::<u32>().unwrap();
    let (ack_tx, acks) = channel::<()>().unwrap();
    let child = spawn((rx, ack_tx), receive_in_step);
    for i in 0..20 {
        tx.send(i).unwrap();
        acks.recv_timeout(WAIT).unwrap();
    }
    tx.send(u32::MAX).unwrap();
    assert!(child.join().unwrap() > 0, "the child received from this process's ring");
    // Its descriptors are closed once it has exited: a pause longer than the look's interval.
    std::thread::sleep(Duration::from_millis(20));
    let err = tx.send(7).unwrap_err();
    assert!(err.is_disconnected(), "{err}");
    assert_eq!(err.into_inner(), 7);
}

fn echo_doubled(end: Duplex<i64, HostTensor<i64>>) {
    while let Ok(t) = end.recv() {
        t.map_inplace(|x| x * 2);
        end.send(t.to_vec().iter().sum()).unwrap();
    }
}

#[test]
fn pipe_carries_both_directions() {
    let (here, there) = pipe::<HostTensor<i64>, i64>().unwrap();
    let child = spawn(there, echo_doubled);
    for n in 1..5i64 {
        let t = HostTensor::from_vec(&[n as usize], (1..=n).collect()).unwrap();
        here.send(t.clone()).unwrap();
        assert_eq!(here.recv_timeout(WAIT).unwrap(), n * (n + 1));
        assert_eq!(t.to_vec(), (1..=n).map(|x| 2 * x).collect::<Vec<_>>());
    }
    drop(here);
    child.join().unwrap();
}

fn connect_and_send(name: String) {
    let tx = Sender::<HostTensor<f64>>::connect(&name).unwrap();
    tx.send(HostTensor::full(&[2, 2], 1.5).unwrap()).unwrap();
}

fn connect_by_file(path: String) {
    let tx = Sender::<String>::connect_file(&path, WAIT).unwrap();
    tx.send("hello by file".into()).unwrap();
}

#[test]
fn unrelated_processes_connect_by_name_or_file() {
    let listener = Listener::<HostTensor<f64>>::bind().unwrap();
    let child = spawn(listener.name().to_owned(), connect_and_send);
    let rx = listener.accept_timeout(WAIT).unwrap();
    assert_eq!(rx.recv_timeout(WAIT).unwrap().to_vec(), vec![1.5; 4]);
    child.join().unwrap();
    assert_eq!(rx.recv_timeout(WAIT).unwrap_err(), RecvTimeoutError::Disconnected);

    let dir = std::env::temp_dir().join(format!("cuda-mp-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("name");
    let child = spawn(path.to_string_lossy().into_owned(), connect_by_file);
    let listener = Listener::<String>::bind().unwrap();
    listener.publish_to(&path).unwrap();
    let rx = listener.accept_timeout(WAIT).unwrap();
    assert_eq!(rx.recv_timeout(WAIT).unwrap(), "hello by file");
    child.join().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn accept_and_connect_time_out_instead_of_hanging() {
    let listener = Listener::<u8>::bind().unwrap();
    let err = listener.accept_timeout(Duration::from_millis(100)).unwrap_err();
    assert!(matches!(err, cuda_mp::Error::Timeout(_)), "{err}");
    let missing = std::env::temp_dir().join("cuda-mp-no-such-listener");
    let err = Sender::<u8>::connect_file(&missing, Duration::from_millis(50)).unwrap_err();
    assert!(matches!(err, cuda_mp::Error::Timeout(_)), "{err}");
    assert!(Sender::<u8>::connect("/nonexistent/socket").is_err());
    assert!(Sender::<u8>::connect("bad\0name").is_err());
}

/// A name file planted as a FIFO (which would hold a read for ever), as a symbolic link, or
/// writable by its group or by others is refused at once, not waited on; a published one is the user's alone.
#[test]
fn connect_file_refuses_a_planted_fifo_link_or_writable_file_at_once() {
    let listener = Listener::<u8>::bind().unwrap();
    let dir = std::env::temp_dir().join(format!("cuda-mp-test-planted-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let published = dir.join("published");
    listener.publish_to(&published).unwrap();
    let mode =
        |p: &std::path::Path| std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(p).unwrap().permissions());
    assert_eq!(mode(&published) & 0o777, 0o600, "published for this user alone");
    let fifo = dir.join("fifo");
    let status = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(status.success());
    let link = dir.join("link");
    std::os::unix::fs::symlink(&published, &link).unwrap();
    let writable = dir.join("writable");
    std::fs::write(&writable, listener.name()).unwrap();
    std::fs::set_permissions(&writable, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    // Its group may write it (a member could point it at another listener of this user's).
    let group = dir.join("group");
    std::fs::write(&group, listener.name()).unwrap();
    std::fs::set_permissions(&group, std::os::unix::fs::PermissionsExt::from_mode(0o664)).unwrap();
    // The same name in a file of this user's alone is taken.
    let own = dir.join("own");
    std::fs::write(&own, listener.name()).unwrap();
    std::fs::set_permissions(&own, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let sender = Sender::<u8>::connect_file(&own, WAIT).expect("a name file only this user may write is taken");
    drop(sender);
    let (tx, rx) = std::sync::mpsc::channel();
    let paths = [fifo, link, writable, group];
    let tried = paths.clone();
    std::thread::spawn(move || {
        let got: Vec<_> =
            tried.iter().map(|p| Sender::<u8>::connect_file(p, Duration::from_millis(200)).map(drop)).collect();
        let _ = tx.send(got);
    });
    let got = rx.recv_timeout(WAIT).expect("connect_file waited past its limit on a planted file");
    let _ = std::fs::remove_dir_all(&dir);
    for (path, result) in paths.iter().zip(got) {
        let err = result.expect_err("a planted file was followed");
        assert!(
            matches!(&err, cuda_mp::Error::Io(e) if e.kind() == std::io::ErrorKind::PermissionDenied),
            "{}: {err}",
            path.display()
        );
    }
}

/// A value whose serialization fails with its own reason.
struct Unsendable;

impl serde::Serialize for Unsendable {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom("this value refuses to be sent"))
    }
}

impl<'de> serde::Deserialize<'de> for Unsendable {
    fn deserialize<D: serde::Deserializer<'de>>(_: D) -> Result<Self, D::Error> {
        Ok(Unsendable)
    }
}

#[test]
fn a_failed_send_reports_its_own_reason_not_an_earlier_one() {
    // An earlier failure on this thread: a tensor given to another serializer.
    let t = HostTensor::<f32>::zeros(&[2]).unwrap();
    assert!(serde_json::to_string(&t).is_err());
    let (tx, _rx) = channel::<Unsendable>().unwrap();
    let err = tx.send(Unsendable).unwrap_err();
    match err.failure() {
        cuda_mp::SendFailure::Serialize(reason) => {
            assert!(!reason.contains("only through cuda-mp channels"), "a stale reason: {reason}")
        }
        other => panic!("{other:?}"),
    }
}

/// A message of each path a send may take: small ones (a ring, once the channel has carried a
/// few; the socket or a backlog when the ring is full), ones with a fresh host tensor (its
/// descriptor: the socket), large ones (shared memory).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
enum Mixed {
    Small(i32, u32),
    Tensor(i32, u32, HostTensor<i32>),
    Large(i32, u32, Vec<u8>),
}

const MIXED: u32 = 3_000;

fn produce_mixed((id, tx): (i32, Sender<Mixed>)) {
    for k in 0..MIXED {
        let m = match k % 20 {
            3 => Mixed::Tensor(id, k, HostTensor::full(&[4], k as i32).unwrap()),
            5 => Mixed::Large(id, k, vec![k as u8; 20_000]),
            _ => Mixed::Small(id, k),
        };
        tx.send(m).unwrap();
        if k.is_multiple_of(400) {
            // The receiver goes to sleep now and then.
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

#[test]
fn messages_of_every_path_arrive_in_order_per_producer() {
    let (tx, rx) = channel().unwrap();
    let children: Vec<_> = (0..3).map(|id| spawn((id, tx.clone()), produce_mixed)).collect();
    drop(tx);
    // Behind from the start: the rings fill, then the socket, then the producers' backlogs.
    std::thread::sleep(Duration::from_millis(300));
    let mut next = [0u32; 3];
    let mut received = 0u32;
    loop {
        let (id, k) = match rx.recv_timeout(WAIT) {
            Ok(Mixed::Small(id, k)) => (id, k),
            Ok(Mixed::Tensor(id, k, t)) => {
                assert_eq!(t.to_vec(), vec![k as i32; 4]);
                (id, k)
            }
            Ok(Mixed::Large(id, k, bytes)) => {
                assert!(bytes.len() == 20_000 && bytes.iter().all(|&b| b == k as u8));
                (id, k)
            }
            Err(RecvTimeoutError::Disconnected) => break,
            Err(e) => panic!("unexpected {e}"),
        };
        assert_eq!(k, next[id as usize], "producer {id}'s messages in the order sent");
        next[id as usize] += 1;
        received += 1;
        if received.is_multiple_of(1_000) {
            // And falls behind now and then.
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    assert_eq!(next, [MIXED; 3], "every message once");
    for c in children {
        c.join().unwrap();
    }
}

/// Once a channel has carried a few messages from a process, a small message without
/// descriptors sent while nothing is unread and the receiver is not asleep takes the ring.
#[test]
fn small_messages_take_the_ring_while_the_receiver_keeps_up() {
    let (tx, rx) = channel::<u64>().unwrap();
    let before = cuda_mp::testing::ring_messages_received();
    for i in 0..10 {
        tx.send(i).unwrap();
        assert_eq!(rx.try_recv(), Ok(i));
    }
    // The first four went to the socket (the fourth after the ring's introduction).
    assert_eq!(cuda_mp::testing::ring_messages_received() - before, 6);
    // Sent together: both in the ring, in order.
    tx.send(10).unwrap();
    tx.send(11).unwrap();
    assert_eq!((rx.try_recv(), rx.try_recv()), (Ok(10), Ok(11)));
    assert_eq!(cuda_mp::testing::ring_messages_received() - before, 8);
    drop(tx);
    assert_eq!(rx.recv_timeout(WAIT), Err(RecvTimeoutError::Disconnected));
}

fn count_up((tx, n): (Sender<u32>, u32)) {
    for i in 0..n {
        tx.send(i).unwrap();
    }
}

fn receive_rest((rx, report): (cuda_mp::Receiver<u32>, Sender<Vec<u32>>)) {
    report.send(rx.iter().collect()).unwrap();
}

/// The receiving end moves to another process in the middle of a stream, with messages in the
/// producer's ring and on the socket: the new holder goes on where this process stopped.
#[test]
fn a_receiver_moved_in_the_middle_of_a_stream_goes_on_in_order() {
    const N: u32 = 200_000;
    let (tx, rx) = channel().unwrap();
    let producer = spawn((tx, N), count_up);
    let mut got: Vec<u32> = (0..20_000).map(|_| rx.recv_timeout(WAIT).unwrap()).collect();
    let (report_tx, report) = channel().unwrap();
    let heir = spawn((rx, report_tx), receive_rest);
    got.extend(report.recv_timeout(Duration::from_secs(60)).unwrap());
    assert_eq!(got.len(), N as usize, "nothing lost or repeated");
    assert!(got.iter().copied().eq(0..N), "in order across the move");
    producer.join().unwrap();
    heir.join().unwrap();
}

/// Waits in `Select` and in `recv_async` end for messages written to a ring, whether the
/// receiver was awake when they were sent (bursts) or asleep (one now and then).
#[test]
fn select_and_async_receives_wake_for_messages_of_a_ring() {
    const N: u32 = 400;
    let bursts = |tx: Sender<u32>| {
        std::thread::spawn(move || {
            for i in 0..N {
                tx.send(i).unwrap();
                if i.is_multiple_of(50) {
                    std::thread::sleep(Duration::from_millis(3));
                }
            }
        })
    };
    let (tx, rx) = channel::<u32>().unwrap();
    let sender = bursts(tx);
    let mut spurious = 0;
    for i in 0..N {
        loop {
            let mut select = cuda_mp::Select::new();
            select.add(&rx);
            select.select_timeout(WAIT).expect("woken for every message");
            // Ready means the next receive would not wait, but may rarely be spurious (as
            // `Select` says: a frame that introduces the sender's ring, say): select again.
            match rx.try_recv() {
                Ok(got) => {
                    assert_eq!(got, i, "in order");
                    break;
                }
                Err(cuda_mp::TryRecvError::Empty) => spurious += 1,
                Err(e) => panic!("message {i}: {e}"),
            }
        }
    }
    assert!(spurious <= N / 20, "ready for nothing {spurious} times in {N} messages");
    sender.join().unwrap();

    let (tx, rx) = channel::<u32>().unwrap();
    let sender = bursts(tx);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    runtime.block_on(async {
        for i in 0..N {
            let got = tokio::time::timeout(WAIT, rx.recv_async()).await.expect("woken for every message");
            assert_eq!(got, Ok(i));
        }
    });
    sender.join().unwrap();
}

/// Enough messages, each received before the next is sent, for the sender's ring to be made
/// and adopted: later small messages take the ring while the receiver is awake.
fn warm_up_ring(tx: &Sender<u64>, rx: &cuda_mp::Receiver<u64>) {
    for i in 0..20 {
        tx.send(i).unwrap();
        assert_eq!(rx.recv().unwrap(), i);
    }
}

/// A task counting its wakes.
struct CountWakes(std::sync::atomic::AtomicUsize);

impl std::task::Wake for CountWakes {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// An async receive that starts while another thread receives with a limit is woken once that
/// thread gives up and a message then goes to the sender's ring (the receiver was awake, so
/// the ring wakes nobody): it waits for the other thread to let go of the receiver, then
/// looks itself.
#[test]
fn an_async_receive_beside_a_timed_receive_is_woken_for_a_ring_message() {
    use std::future::Future;
    let (tx, rx) = channel::<u64>().unwrap();
    warm_up_ring(&tx, &rx);
    let wakes = std::sync::Arc::new(CountWakes(std::sync::atomic::AtomicUsize::new(0)));
    let waker = std::task::Waker::from(wakes.clone());
    let mut cx = std::task::Context::from_waker(&waker);
    std::thread::scope(|s| {
        let other = s.spawn(|| rx.recv_timeout(Duration::from_millis(400)));
        std::thread::sleep(Duration::from_millis(100));
        let mut future = std::pin::pin!(rx.recv_async());
        assert!(future.as_mut().poll(&mut cx).is_pending(), "nothing sent yet");
        assert!(other.join().unwrap().is_err(), "the other receive timed out");
        tx.send(99).unwrap();
        // Polled only when woken, as an executor does.
        let deadline = Instant::now() + WAIT;
        let mut seen = 0;
        let got = loop {
            while wakes.0.load(std::sync::atomic::Ordering::SeqCst) == seen {
                assert!(Instant::now() < deadline, "the task was never woken for the message");
                std::thread::sleep(Duration::from_millis(1));
            }
            seen = wakes.0.load(std::sync::atomic::Ordering::SeqCst);
            if let std::task::Poll::Ready(got) = future.as_mut().poll(&mut cx) {
                break got;
            }
        };
        assert_eq!(got, Ok(99));
    });
}

/// The same for `Select`: it reports the receiver once the other thread gave up and the
/// message came.
#[test]
fn a_select_beside_a_timed_receive_sees_a_ring_message() {
    let (tx, rx) = channel::<u64>().unwrap();
    warm_up_ring(&tx, &rx);
    std::thread::scope(|s| {
        let other = s.spawn(|| rx.recv_timeout(Duration::from_millis(400)));
        let tx = &tx;
        let sender = s.spawn(move || {
            assert!(other.join().unwrap().is_err(), "the other receive timed out");
            tx.send(99).unwrap();
        });
        std::thread::sleep(Duration::from_millis(100));
        let mut select = cuda_mp::Select::new();
        select.add(&rx);
        let deadline = Instant::now() + WAIT;
        let got = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            select.select_timeout(left).expect("the message is seen");
            match rx.try_recv() {
                Ok(got) => break got,
                Err(TryRecvError::Empty) => continue,
                Err(e) => panic!("{e}"),
            }
        };
        assert_eq!(got, 99);
        sender.join().unwrap();
    });
}

/// Sends five small messages, then, when told, many more, saying when 20,000 are sent.
fn flood((tx, go, said): (Sender<Mixed>, cuda_mp::Receiver<()>, Sender<()>)) {
    for k in 0..5 {
        tx.send(Mixed::Small(0, k)).unwrap();
    }
    go.recv().unwrap();
    for k in 5..100_000 {
        tx.send(Mixed::Small(0, k)).unwrap();
        if k == 20_000 {
            said.send(()).unwrap();
        }
    }
}

fn send_one_tensor((tx, said): (Sender<Mixed>, Sender<()>)) {
    tx.send(Mixed::Tensor(1, 0, HostTensor::full(&[4], 7).unwrap())).unwrap();
    said.send(()).unwrap();
}

/// A sender that keeps its ring full does not hold up another's frame on the socket: the
/// frame comes after at most a few of the ring's messages.
#[test]
fn a_full_ring_does_not_hold_up_another_senders_frame() {
    let (tx, rx) = channel().unwrap();
    let (go_tx, go) = channel().unwrap();
    let (said_tx, said) = channel().unwrap();
    let flooder = spawn((tx.clone(), go, said_tx.clone()), flood);
    for k in 0..5 {
        assert!(matches!(rx.recv_timeout(WAIT), Ok(Mixed::Small(0, n)) if n == k));
    }
    // The flooder's ring is known now; the other's frame goes to the socket, then the flood.
    let other = spawn((tx, said_tx), send_one_tensor);
    said.recv_timeout(WAIT).unwrap();
    go_tx.send(()).unwrap();
    said.recv_timeout(WAIT).unwrap();
    let mut before = 0;
    loop {
        match rx.recv_timeout(WAIT).unwrap() {
            Mixed::Tensor(1, 0, t) => {
                assert_eq!(t.to_vec(), vec![7; 4]);
                break;
            }
            Mixed::Small(0, _) => before += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(before <= 64, "{before} messages of the full ring came first");
    other.join().unwrap();
    drop(rx);
    let _ = flooder.join();
}

/// A process whose last sender of a channel goes while the receiver has not read what it put in
/// its ring, and which gets another sender of that channel later (one that comes with a
/// request, say), keeps its order: the new sender's first messages, which take the socket,
/// come after the old ones still in the ring (1000 came after 21, before).
#[test]
fn a_later_sender_of_the_same_channel_in_one_process_keeps_its_order() {
    let (tx, rx) = channel::<u32>().unwrap();
    let (carry_tx, carry_rx) = channel::<Sender<u32>>().unwrap();
    carry_tx.send(tx.clone()).unwrap();
    let mut got = Vec::new();
    // The first messages take the socket, then the ring is made; the receiver adopts it.
    for i in 0..6 {
        tx.send(i).unwrap();
    }
    for _ in 0..6 {
        got.push(rx.recv_timeout(Duration::from_secs(10)).unwrap());
    }
    for i in 6..60 {
        tx.send(i).unwrap();
    }
    // The last sender here goes with most of those unread in its ring.
    drop(tx);
    let later = carry_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    later.send(1000).unwrap();
    for _ in 6..61 {
        got.push(rx.recv_timeout(Duration::from_secs(10)).unwrap());
    }
    let want: Vec<u32> = (0..60).chain([1000]).collect();
    assert_eq!(got, want, "one process's messages out of order");
}

/// The last sender gone with messages unread in its ring (kept aside for a later sender of
/// this process): the receiver gets them all, then the channel's end at once.
#[test]
fn the_end_comes_right_after_what_a_gone_senders_ring_held() {
    let (tx, rx) = channel::<u32>().unwrap();
    for i in 0..6 {
        tx.send(i).unwrap();
    }
    for _ in 0..6 {
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
    }
    for i in 6..60 {
        tx.send(i).unwrap();
    }
    drop(tx);
    for i in 6..60 {
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), i);
    }
    let t = Instant::now();
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Err(RecvTimeoutError::Disconnected));
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
}

#[test]
fn a_send_with_no_time_left_to_a_full_channel_whose_receiver_is_gone_says_disconnected() {
    let (tx, rx) = cuda_mp::bounded::<u8>(1).unwrap();
    tx.send(1).unwrap();
    drop(rx);
    assert!(tx.send_timeout(2, Duration::ZERO).unwrap_err().is_disconnected());
    assert!(tx.try_send(3).unwrap_err().is_disconnected());
}

#[test]
fn a_connect_to_a_listener_that_does_not_accept_gives_up_at_its_timeout() {
    let listener = Listener::<u8>::bind().unwrap();
    let path = std::env::temp_dir().join(format!("cuda-mp-full-backlog-{}.name", std::process::id()));
    listener.publish_to(&path).unwrap();
    // Nobody accepts: connects fill the backlog, then one times out.
    let mut held = Vec::new();
    let start = Instant::now();
    let err = loop {
        match Sender::<u8>::connect_file(&path, Duration::from_millis(100)) {
            Ok(tx) => held.push(tx),
            Err(e) => break e,
        }
        assert!(held.len() < 4096, "the backlog never filled");
    };
    let _ = std::fs::remove_file(&path);
    assert!(err.is_timeout(), "{err}");
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}", start.elapsed());
}

#[test]
fn listeners_publishing_at_once_each_write_their_own_name() {
    let dir = std::env::temp_dir().join(format!("cuda-mp-publish-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = (Listener::<u8>::bind().unwrap(), Listener::<u8>::bind().unwrap());
    let (pa, pb) = (dir.join("srv.a"), dir.join("srv.b"));
    for _ in 0..300 {
        std::thread::scope(|s| {
            let other = s.spawn(|| b.publish_to(&pb));
            a.publish_to(&pa).unwrap();
            other.join().unwrap().unwrap();
        });
        assert_eq!(std::fs::read_to_string(&pa).unwrap(), a.name());
        assert_eq!(std::fs::read_to_string(&pb).unwrap(), b.name());
    }
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(left.len(), 2, "no temporary file left: {left:?}");
}

#[test]
fn a_connect_file_that_finds_a_gone_listeners_name_waits_for_the_next_one() {
    let path = std::env::temp_dir().join(format!("cuda-mp-restarted-{}.name", std::process::id()));
    drop({
        let old = Listener::<u8>::bind().unwrap();
        old.publish_to(&path).unwrap();
        old
    });
    let restarted = std::thread::spawn({
        let path = path.clone();
        move || {
            std::thread::sleep(Duration::from_millis(300));
            let new = Listener::<u8>::bind().unwrap();
            new.publish_to(&path).unwrap();
            new.accept_timeout(Duration::from_secs(10)).unwrap().recv().unwrap()
        }
    });
    let tx = Sender::<u8>::connect_file(&path, Duration::from_secs(10)).unwrap();
    tx.send(6).unwrap();
    assert_eq!(restarted.join().unwrap(), 6);
    let _ = std::fs::remove_file(&path);
}

/// The processor time the calling thread has used.
fn thread_cpu_time() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// Receives one message that comes `after` the receive began; the processor time the receive
/// used.
fn cpu_time_of_a_receive(rx: &cuda_mp::Receiver<u8>, tx: Sender<u8>, after: Duration) -> Duration {
    let sender = std::thread::spawn(move || {
        std::thread::sleep(after);
        tx.send(1).unwrap();
    });
    let before = thread_cpu_time();
    assert_eq!(rx.recv_timeout(WAIT).unwrap(), 1);
    let used = thread_cpu_time() - before;
    sender.join().unwrap();
    used
}

/// A receiver set to spin looks for its message awake for up to that long (it uses the
/// processor meanwhile); one with the process's spin sleeps while it waits.
#[test]
fn a_receiver_set_to_spin_waits_awake_and_one_that_is_not_sleeps() {
    let (tx, rx) = channel::<u8>().unwrap();
    let process = rx.spin();
    assert!(process <= Duration::from_millis(1), "the process's spin: {process:?}");
    rx.set_spin(Some(Duration::from_secs(2)));
    assert_eq!(rx.spin(), Duration::from_secs(2));
    let spinning = cpu_time_of_a_receive(&rx, tx.clone(), Duration::from_millis(200));
    rx.set_spin(None);
    assert_eq!(rx.spin(), process, "back to the process's");
    let sleeping = cpu_time_of_a_receive(&rx, tx, Duration::from_millis(200));
    assert!(spinning >= Duration::from_millis(20), "a spinning receive used {spinning:?} of a processor in 200 ms");
    assert!(sleeping < Duration::from_millis(20), "a sleeping receive used {sleeping:?} of a processor in 200 ms");
}
