//! Running out of file descriptors is an error that says so, never a panic or a "malformed
//! message": every shared storage of its own (a host tensor made with the caching allocator
//! off, say) and every lease is a descriptor.

use std::time::Duration;

use cuda_mp::{Error, HostTensor, Receiver, RecvTimeoutError, Sender, TryRecvError, channel, spawn};
use serde::Serialize;
use serde::de::DeserializeOwned;

mod common;

cuda_mp::enable_test_support!();

const WAIT: Duration = Duration::from_secs(30);

/// One test at a time: the descriptor limit and the descriptor table are the whole process's,
/// so a test that lowers the limit here (or counts the lowest free number) would make another's
/// spawn or receive fail, or find room that another test's descriptor left when it closed.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Lowers this process's soft descriptor limit to `headroom` above what it has open (after
/// cuda-mp's own start-up, which raises it to the hard limit).
fn leave_headroom(headroom: u64) -> u64 {
    drop(HostTensor::<u8>::zeros(&[1]).unwrap());
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    let limit = open + headroom;
    common::set_soft_limit(limit);
    limit
}

fn allocate_until_it_fails(caching: bool) -> String {
    cuda_mp::set_host_caching(caching);
    let limit = leave_headroom(8);
    let mut held = Vec::new();
    for _ in 0..1000 {
        match HostTensor::<u8>::zeros(&[64]) {
            Ok(t) => held.push(t),
            Err(Error::OutOfDescriptors { limit: said }) => {
                assert_eq!(said, limit);
                return format!("out of descriptors after {}", held.len());
            }
            Err(other) => return format!("unexpected error: {other}"),
        }
    }
    "never failed".into()
}

#[test]
fn allocating_past_the_descriptor_limit_is_an_error_that_says_so() {
    let _g = serial();
    let said = spawn(false, allocate_until_it_fails).join().unwrap();
    assert!(said.starts_with("out of descriptors after"), "{said}");
}

#[test]
fn fresh_host_tensors_of_the_caching_allocator_cost_no_descriptor_each() {
    let _g = serial();
    let said = spawn(true, allocate_until_it_fails).join().unwrap();
    assert_eq!(said, "never failed", "1,000 tensors in one segment, with 8 descriptors to spare");
}

/// Items in one message to a receiver with [`RECEIVER_HEADROOM`] descriptors to spare: more
/// than it can take if each carried a descriptor.
const ITEMS: usize = 40;

/// What a receiver has to spare: room for what its first message from a new sender opens once
/// (the sender's ring, the wake-ups, the segment: 7 descriptors on Linux 6.x), with a few over,
/// and far fewer than [`ITEMS`].
const RECEIVER_HEADROOM: u64 = 12;

/// Lowers its limit, then receives one message of many items: says what became of it.
fn receive_with_little_room<T: DeserializeOwned>((rx, ready, reply): (Receiver<Vec<T>>, Sender<()>, Sender<String>)) {
    leave_headroom(RECEIVER_HEADROOM);
    ready.send(()).unwrap();
    let said = match rx.recv_timeout(WAIT) {
        Err(RecvTimeoutError::OutOfDescriptors { .. }) => "out of descriptors".to_string(),
        Err(other) => format!("unexpected error: {other}"),
        Ok(v) => format!("received {} items", v.len()),
    };
    reply.send(said).unwrap();
}

/// Sends `items` to a process that has lowered its descriptor limit first; what it said of the
/// message, and how it ended.
fn sent_to_a_receiver_with_little_room<T: Serialize + DeserializeOwned>(
    items: impl FnOnce() -> Vec<T>,
) -> (Result<String, RecvTimeoutError>, Result<(), cuda_mp::JoinError>) {
    let (tx, rx) = channel().unwrap();
    let (ready_tx, ready_rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let child = spawn((rx, ready_tx, reply_tx), receive_with_little_room::<T>);
    ready_rx.recv_timeout(WAIT).unwrap();
    tx.send(items()).unwrap();
    let said = reply_rx.recv_timeout(WAIT);
    (said, child.join())
}

#[test]
fn receiving_past_the_descriptor_limit_is_an_error_that_says_so() {
    let _g = serial();
    let (said, joined) = sent_to_a_receiver_with_little_room(|| {
        // A memory file per tensor (this process's other tests do not depend on the allocator).
        cuda_mp::set_host_caching(false);
        (0..ITEMS).map(|_| HostTensor::<u8>::zeros(&[8]).unwrap()).collect::<Vec<_>>()
    });
    assert_eq!(said.as_deref().ok(), Some("out of descriptors"), "{said:?} {joined:?}");
    joined.unwrap();
}

/// Allocates `n` tensors with the caching allocator on, in a process of its own.
fn pooled_tensors((n, tx): (usize, Sender<Vec<HostTensor<u8>>>)) {
    cuda_mp::set_host_caching(true);
    tx.send((0..n).map(|_| HostTensor::<u8>::zeros(&[8]).unwrap()).collect()).unwrap();
}

#[test]
fn a_message_of_blocks_of_one_segment_carries_its_descriptor_once() {
    let _g = serial();
    let (tx, rx) = channel().unwrap();
    let (ready_tx, ready_rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let receiver = spawn((rx, ready_tx, reply_tx), receive_with_little_room::<HostTensor<u8>>);
    ready_rx.recv_timeout(WAIT).unwrap();
    spawn((ITEMS, tx), pooled_tensors).join().unwrap();
    assert_eq!(reply_rx.recv_timeout(WAIT).unwrap(), format!("received {ITEMS} items"));
    receiver.join().unwrap();
}

/// Files made before the limit is lowered, then sent: each parks its descriptor in a socket
/// pair of its own, which the limit refuses.
fn send_files_with_little_room(tx: Sender<Vec<cuda_mp::testing::CarriedFile>>) -> String {
    let files: Vec<_> = (0..20)
        .map(|i| {
            cuda_mp::testing::CarriedFile(
                std::fs::File::open(if i % 2 == 0 { "/dev/null" } else { "/dev/zero" }).unwrap(),
            )
        })
        .collect();
    leave_headroom(3);
    match tx.send(files) {
        Ok(()) => "sent".into(),
        Err(e) if e.to_string().contains("descriptor") => "out of descriptors".into(),
        Err(e) => format!("unexpected error: {e}"),
    }
}

#[test]
fn parking_descriptors_past_the_limit_is_an_error_that_says_so() {
    let _g = serial();
    let (tx, rx) = channel().unwrap();
    let said = spawn(tx, send_files_with_little_room).join().unwrap();
    assert_eq!(said, "out of descriptors");
    drop(rx);
}

#[test]
fn receiving_parked_descriptors_past_the_limit_is_an_error_that_says_so() {
    let _g = serial();
    let (said, joined) = sent_to_a_receiver_with_little_room(|| {
        (0..ITEMS).map(|_| cuda_mp::testing::CarriedFile(std::fs::File::open("/dev/null").unwrap())).collect::<Vec<_>>()
    });
    assert_eq!(said.as_deref().ok(), Some("out of descriptors"), "{said:?} {joined:?}");
    joined.unwrap();
}

/// A message that carries a descriptor or not.
#[derive(serde::Serialize, serde::Deserialize)]
enum Carrying {
    Number(u32),
    File(cuda_mp::testing::CarriedFile),
    Bytes(u32, Vec<u8>),
}

/// Lowers the soft descriptor limit to the lowest free descriptor number: no new descriptor
/// can be made (nor received) until its drop puts the limit back.
struct NoRoom(u64);

impl NoRoom {
    fn now() -> NoRoom {
        let lowest_free = std::fs::File::open("/dev/null").map(|f| std::os::fd::AsRawFd::as_raw_fd(&f)).unwrap();
        NoRoom(common::set_soft_limit(lowest_free as u64))
    }
}

impl Drop for NoRoom {
    fn drop(&mut self) {
        common::set_soft_limit(self.0);
    }
}

fn null_file() -> Carrying {
    Carrying::File(cuda_mp::testing::CarriedFile(std::fs::File::open("/dev/null").unwrap()))
}

/// What a receive gave, in a word.
fn said(got: Result<Carrying, RecvTimeoutError>) -> String {
    match got {
        Ok(Carrying::Number(n)) => format!("number {n}"),
        Ok(Carrying::Bytes(n, _)) => format!("bytes {n}"),
        Ok(Carrying::File(_)) => "file".into(),
        Err(RecvTimeoutError::OutOfDescriptors { .. }) => "out of descriptors".into(),
        Err(e) => format!("error: {e}"),
    }
}

/// A message with a descriptor, then one without (which goes to the sender's ring, numbered
/// after the first), while the receiver can take no descriptor: the first is lost, the
/// second comes.
fn a_lost_frame_then_a_ring_message(_: ()) -> Vec<String> {
    let (tx, rx) = channel::<Carrying>().unwrap();
    // The first messages introduce the sender's ring; reading them adopts it.
    for i in 0..6 {
        tx.send(Carrying::Number(i)).unwrap();
    }
    for _ in 0..6 {
        rx.recv_timeout(WAIT).unwrap();
    }
    tx.send(null_file()).unwrap();
    tx.send(Carrying::Number(100)).unwrap();
    let first = {
        let _no_room = NoRoom::now();
        said(rx.recv_timeout(Duration::from_secs(5)))
    };
    vec![first, said(rx.recv_timeout(Duration::from_secs(5)))]
}

#[test]
fn a_message_lost_for_want_of_descriptors_does_not_hold_up_its_senders_later_ones() {
    let _g = serial();
    let said = spawn((), a_lost_frame_then_a_ring_message).join().unwrap();
    assert_eq!(said, ["out of descriptors", "number 100"]);
}

/// A bounded channel of one place, full with a message that carries a descriptor, read while
/// the receiver can take none: the lost message's place is free again. (A first message
/// introduces the sender's ring, whose frame carries descriptors of its own.)
fn a_lost_message_on_a_full_bounded_channel(_: ()) -> Vec<String> {
    let (tx, rx) = cuda_mp::bounded::<Carrying>(1).unwrap();
    tx.send(Carrying::Number(0)).unwrap();
    rx.recv_timeout(WAIT).unwrap();
    tx.send(null_file()).unwrap();
    let first = {
        let _no_room = NoRoom::now();
        said(rx.recv_timeout(Duration::from_secs(5)))
    };
    let sent = match tx.send_timeout(Carrying::Number(1), Duration::from_secs(5)) {
        Ok(()) => "sent".to_string(),
        Err(e) => format!("send failed: {e}"),
    };
    vec![first, sent, said(rx.recv_timeout(Duration::from_secs(5)))]
}

#[test]
fn a_message_lost_for_want_of_descriptors_gives_its_place_back() {
    let _g = serial();
    let said = spawn((), a_lost_message_on_a_full_bounded_channel).join().unwrap();
    assert_eq!(said, ["out of descriptors", "sent", "number 1"]);
}

/// Sends numbers until told to `go` (so that the receiver adopts its ring), then `Bytes`
/// messages 0..[`MESSAGES`] (1 KiB each: more than its ring and the socket hold, so that most
/// spill into batches, each handed on with a descriptor), says so, waits for `go` again (the
/// receiver has read all it could), sends [`LATER`] more, and lives until told to quit.
fn send_a_backlog((tx, go, sent, quit): (Sender<Carrying>, Receiver<()>, Sender<()>, Receiver<()>)) {
    while go.try_recv().is_err() {
        for _ in 0..32 {
            tx.send(Carrying::Number(0)).unwrap(); // bursts: the ring is for a receiver awake
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    for i in 0..MESSAGES {
        tx.send(Carrying::Bytes(i, vec![7; 1024])).unwrap();
    }
    sent.send(()).unwrap();
    // Once the batches are handed on, later messages take the ring again, numbered after them.
    cuda_mp::flush_sends(WAIT).unwrap();
    go.recv_timeout(WAIT).unwrap();
    for i in MESSAGES..MESSAGES + LATER {
        tx.send(Carrying::Bytes(i, vec![7; 16])).unwrap();
        if i % 16 == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let _ = quit.recv_timeout(WAIT);
}

const MESSAGES: u32 = 4_000;
/// Messages sent after the backlog was handed on.
const LATER: u32 = 400;

/// A sender process (`send_a_backlog`) whose backlog this process read while it could take no
/// descriptor, until nothing more came (every batch's redirect cut short, the last one's
/// messages never to come); the sender waits to be told to send its later messages.
struct LostBacklog {
    rx: Receiver<Carrying>,
    go: Sender<()>,
    quit: Sender<()>,
    sender: cuda_mp::JoinHandle<()>,
    /// How many receives failed for want of descriptors.
    lost: usize,
    /// The numbers that came, in the order they came.
    got: Vec<u32>,
}

fn lose_a_backlog() -> LostBacklog {
    let (tx, rx) = channel::<Carrying>().unwrap();
    let (go, go_rx) = channel().unwrap();
    let (sent_tx, sent_rx) = channel().unwrap();
    let (quit, quit_rx) = channel().unwrap();
    let sender = spawn((tx, go_rx, sent_tx, quit_rx), send_a_backlog);
    let start = std::time::Instant::now();
    while cuda_mp::testing::ring_messages_received() == 0 {
        assert!(start.elapsed() < WAIT, "no message came through the sender's ring");
        rx.recv_timeout(WAIT).unwrap();
    }
    go.send(()).unwrap();
    sent_rx.recv_timeout(WAIT).unwrap();
    let (mut lost, mut got) = (0, Vec::<u32>::new());
    let _no_room = NoRoom::now();
    loop {
        match rx.recv_timeout(Duration::from_secs(2)) {
            Ok(Carrying::Bytes(i, _)) => got.push(i),
            Ok(_) => {}
            Err(RecvTimeoutError::OutOfDescriptors { .. }) => lost += 1,
            Err(RecvTimeoutError::Timeout) => break,
            other => panic!("{}", said(other)),
        }
    }
    LostBacklog { rx, go, quit, sender, lost, got }
}

/// Loses a backlog, then receives the later messages with room again, never asleep in the
/// kernel (`try_recv`), so that they take the sender's ring, numbered after the lost batches:
/// nothing else comes to say that their turn has come. How many receives failed, and the
/// numbers that came, in the order they came.
fn receive_a_backlog_with_no_room(_: ()) -> (usize, Vec<u32>) {
    let LostBacklog { rx, go, quit, sender, lost, got } = lose_a_backlog();
    let got = receive_the_later_messages((rx, go, got));
    quit.send(()).unwrap();
    sender.join().unwrap();
    (lost, got)
}

/// Tells the sender to `go` on, and receives until its last later message, never asleep in the
/// kernel: the numbers that came after `got`.
fn receive_the_later_messages((rx, go, mut got): (Receiver<Carrying>, Sender<()>, Vec<u32>)) -> Vec<u32> {
    let rings_before = cuda_mp::testing::ring_messages_received();
    go.send(()).unwrap();
    let start = std::time::Instant::now();
    while got.last() != Some(&(MESSAGES + LATER - 1)) {
        match rx.try_recv() {
            Ok(Carrying::Bytes(i, _)) => got.push(i),
            Ok(_) => {}
            Err(TryRecvError::Empty) => {
                let waited = start.elapsed();
                assert!(waited < Duration::from_secs(10), "no message for {waited:?} after {}", got.len());
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(cuda_mp::testing::ring_messages_received() > rings_before, "no later message took the ring");
    got
}

#[test]
fn a_batch_lost_for_want_of_descriptors_does_not_hold_up_later_messages() {
    let _g = serial();
    let (lost, got) = spawn((), receive_a_backlog_with_no_room).join().unwrap();
    assert!(lost > 0 && got.len() < (MESSAGES + LATER) as usize, "{lost} receives failed, {} messages came", got.len());
    assert!(got.windows(2).all(|w| w[0] < w[1]), "out of order");
}

/// Loses a backlog, lets the later messages go to the sender's ring while this process is
/// awake, then selects: whether the select saw a message ready (the gap is stepped over),
/// and what a receive then got.
fn select_after_a_lost_backlog(_: ()) -> (String, String) {
    let LostBacklog { rx, go, quit, sender, .. } = lose_a_backlog();
    go.send(()).unwrap();
    std::thread::sleep(Duration::from_millis(500)); // awake, not in the kernel: the ring
    let mut select = cuda_mp::Select::new();
    select.add(&rx);
    let selected = format!("{:?}", select.select_timeout(Duration::from_secs(3)));
    let received = said(rx.recv_timeout(Duration::from_secs(3)));
    quit.send(()).unwrap();
    sender.join().unwrap();
    (selected, received)
}

#[test]
fn a_select_sees_a_message_after_a_batch_lost_for_want_of_descriptors() {
    let _g = serial();
    let (selected, received) = spawn((), select_after_a_lost_backlog).join().unwrap();
    assert_eq!((selected.as_str(), received.as_str()), ("Ok(0)", "bytes 4000"));
}

/// Loses a backlog, then hands the receiving end to another process, which receives the later
/// messages: the numbers that came there.
fn move_the_receiver_after_a_lost_backlog(_: ()) -> Vec<u32> {
    let LostBacklog { rx, go, quit, sender, .. } = lose_a_backlog();
    let got = spawn((rx, go, Vec::new()), receive_the_later_messages).join().unwrap();
    quit.send(()).unwrap();
    sender.join().unwrap();
    got
}

#[test]
fn a_receiver_moved_after_a_batch_lost_for_want_of_descriptors_is_not_held_up() {
    let _g = serial();
    let got = spawn((), move_the_receiver_after_a_lost_backlog).join().unwrap();
    assert_eq!(got, (MESSAGES..MESSAGES + LATER).collect::<Vec<_>>());
}

/// Sends a tensor of its own (the connection's lease, introduced while the receiver has room),
/// then, each when told, the first block of a fresh segment (whose introduction the receiver,
/// out of descriptors, loses) and more blocks of that segment until told to stop.
fn send_a_lease_then_blocks_of_one_segment((tx, go): (Sender<HostTensor<f32>>, Receiver<bool>)) {
    cuda_mp::set_host_caching(false);
    tx.send(HostTensor::<f32>::full(&[4], 0.0).unwrap()).unwrap();
    go.recv().unwrap();
    cuda_mp::set_host_caching(true);
    let mut held = vec![HostTensor::<f32>::full(&[1024], 1.0).unwrap()];
    tx.send(held[0].clone()).unwrap();
    let mut k = 2.0;
    while go.recv().unwrap() {
        let t = HostTensor::<f32>::full(&[1024], k).unwrap();
        tx.send(t.clone()).unwrap();
        held.push(t);
        k += 1.0;
    }
}

/// A segment whose introduction a receiver lost (out of descriptors, the kernel dropped the
/// frame's descriptors) is introduced again: the block already on its way that names it fails
/// as malformed, and the receiver asks the owner (on its connection lease) to introduce it
/// again, so a later block of the same segment decodes.
#[test]
fn a_segment_whose_introduction_was_lost_is_introduced_again() {
    let _g = serial();
    let (tx, rx) = channel::<HostTensor<f32>>().unwrap();
    let (go_tx, go_rx) = channel::<bool>().unwrap();
    let producer = spawn((tx, go_rx), send_a_lease_then_blocks_of_one_segment);
    let first = rx.recv_timeout(WAIT).unwrap();
    let lost = {
        let _room = NoRoom::now();
        go_tx.send(true).unwrap();
        rx.recv_timeout(WAIT).map(|t| t.to_vec()[0])
    };
    assert!(matches!(lost, Err(RecvTimeoutError::OutOfDescriptors { .. })), "{lost:?}");
    // The next block only names the segment: it fails, and has the owner introduce it again.
    go_tx.send(true).unwrap();
    let named = rx.recv_timeout(WAIT).map(|t| t.to_vec()[0]);
    match &named {
        Err(RecvTimeoutError::Malformed(m)) => assert!(m.contains("never given"), "{m}"),
        other => panic!("a block naming a segment this end never got: {other:?}"),
    }
    // The owner's reaper reads the request on its own time: a few blocks may still only name it.
    let mut tries = 0;
    let value = loop {
        tries += 1;
        assert!(tries <= 50, "the segment was never introduced again");
        go_tx.send(true).unwrap();
        match rx.recv_timeout(WAIT) {
            Ok(t) => break t.to_vec()[0],
            Err(RecvTimeoutError::Malformed(_)) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(value, (tries + 2) as f32, "the block holds its own values");
    go_tx.send(false).unwrap();
    producer.join().unwrap();
    drop(first);
}

/// Arguments whose `Serialize` panics with an index out of bounds: a bug of the caller's.
struct PanickingArguments;

impl serde::Serialize for PanickingArguments {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        let empty: Vec<u8> = Vec::new();
        let _ = empty[std::hint::black_box(3usize)];
        unreachable!("the index is out of bounds")
    }
}

impl<'de> serde::Deserialize<'de> for PanickingArguments {
    fn deserialize<D: serde::Deserializer<'de>>(_: D) -> Result<Self, D::Error> {
        Ok(PanickingArguments)
    }
}

/// Spawns with no descriptor to spare, then again once there is room, then with a start
/// limit too short to meet and few descriptors to spare, then with arguments that panic as
/// they are encoded, few descriptors to spare: what each gave.
fn spawn_with_no_room(_: ()) -> (String, String, String, String) {
    let failed = {
        let _room = NoRoom::now();
        match cuda_mp::Builder::new().spawn(7u32, |n| n + 1) {
            Ok(child) => format!("started: {:?}", child.join()),
            Err(cuda_mp::JoinError::OutOfDescriptors { limit }) => format!("out of descriptors, limit {limit}"),
            Err(other) => format!("other error: {other}"),
        }
    };
    let later = match spawn(7u32, |n| n + 1).join() {
        Ok(n) => format!("joined {n}"),
        Err(e) => format!("error: {e}"),
    };
    leave_headroom(48);
    let short = cuda_mp::Builder::new().start_timeout(Duration::from_nanos(1)).spawn(7u32, |n| n + 1);
    let timed_out = match short.map(|child| child.join()) {
        Ok(Ok(n)) => format!("joined {n}"),
        Err(e) | Ok(Err(e)) => format!("{e:?}"),
    };
    let panicked = match cuda_mp::Builder::new().spawn(PanickingArguments, |_| 1u8) {
        Ok(child) => format!("started: {:?}", child.join()),
        Err(e) => format!("{e:?}"),
    };
    (failed, later, timed_out, panicked)
}

#[test]
fn spawning_past_the_descriptor_limit_is_an_error_that_says_so() {
    let _g = serial();
    let (failed, later, timed_out, panicked) = spawn((), spawn_with_no_room).join().unwrap();
    assert!(failed.starts_with("out of descriptors, limit "), "{failed}");
    assert_eq!(later, "joined 8", "a spawn once there is room again starts");
    // Close to the limit, a failure of another kind says what it is: a start limit not met,
    // and a panic of the caller's own code whatever it says.
    assert!(timed_out == "Timeout" || timed_out == "joined 8", "{timed_out}");
    assert!(panicked.starts_with("Failed(\"index out of bounds"), "{panicked}");
}
