//! The host caching allocator across real processes: fresh host tensors cut from memory-file
//! segments that a receiver maps once, blocks reused only once every process dropped them, a
//! killed consumer's blocks reclaimed, and descriptors and /dev/shm back at the start.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use cuda_mp::{
    Error, HostTensor, Receiver, Sender, channel, empty_host_cache, host_allocator_stats, lifetime_stats,
    set_host_cache_limit, set_host_caching, spawn, wait_for_lifetime,
};

mod common;

use common::shm_entries;

cuda_mp::enable_test_support!();

static SERIAL: Mutex<()> = Mutex::new(());
const WAIT: Duration = Duration::from_secs(60);

/// One test at a time, each starting from an allocator that holds nothing, caching on.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    let g = common::serial(&SERIAL, WAIT);
    set_host_caching(true);
    set_host_cache_limit(None);
    eventually("no block of an earlier test still held", || host_allocator_stats().blocks == 0);
    empty_host_cache();
    g
}

/// Waits until `f` holds, or fails with `what`.
fn eventually(what: &str, f: impl FnMut() -> bool) {
    common::eventually(WAIT, what, f)
}

fn open_descriptors() -> usize {
    common::open_descriptors()
}

/// Checks each tensor's first and last element against its number, replies with the number,
/// and at the end the segments and mappings this process opened.
fn check_each((rx, reply, done): (Receiver<(u32, HostTensor<f32>)>, Sender<u32>, Sender<(u64, u64)>)) {
    while let Ok((i, t)) = rx.recv() {
        let v = t.to_vec();
        assert!(v[0] == i as f32 && v[v.len() - 1] == i as f32, "tensor {i} holds {} .. {}", v[0], v[v.len() - 1]);
        drop(t);
        reply.send(i).unwrap();
    }
    let s = lifetime_stats();
    done.send((s.opened_segments, s.opened_mappings)).unwrap();
}

#[test]
fn fresh_tensors_are_cut_from_one_segment_that_the_receiver_maps_once() {
    let _g = serial();
    let before = host_allocator_stats();
    let (tx, rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let (done_tx, done_rx) = channel().unwrap();
    let child = spawn((rx, reply_tx, done_tx), check_each);
    for i in 0..1000u32 {
        // 16 KiB each, fresh every time; a window of 8 in flight.
        let t = HostTensor::<f32>::full(&[4 << 10], i as f32).unwrap();
        tx.send((i, t)).unwrap();
        if i >= 8 {
            assert_eq!(reply_rx.recv_timeout(WAIT).unwrap(), i - 8);
        }
    }
    for i in 992..1000 {
        assert_eq!(reply_rx.recv_timeout(WAIT).unwrap(), i);
    }
    drop(tx);
    let (segments, mappings) = match done_rx.recv_timeout(WAIT) {
        Ok(counts) => counts,
        Err(e) => panic!("no counts from the receiver ({e}); it ended with {:?}", child.join()),
    };
    child.join().unwrap();
    let after = host_allocator_stats();
    // 1,000 fresh 16 KiB tensors, 8 in flight, fit one 2 MiB segment when every release has
    // landed by the next allocation; releases travel on their own, so a loaded machine may
    // need one or two more (a full test run saw three); without reuse, eight.
    let allocated = after.segments_allocated - before.segments_allocated;
    assert!((1..=3).contains(&allocated), "{allocated} segments for 1,000 fresh 16 KiB tensors");
    assert_eq!(segments, allocated, "the receiver mapped each segment once");
    assert_eq!(mappings, 1000, "and each fresh tensor is a storage of its own");
    assert_eq!(after.allocations - before.allocations, 1000);
    eventually("every block back once the receiver dropped it", || host_allocator_stats().blocks == 0);
}

/// Keeps each tensor it receives while the producer reallocates, checking its pattern the
/// whole time; replies with the verdict once it dropped the tensor.
fn hold_and_check((rx, go, reply): (Receiver<(i64, HostTensor<i64>)>, Receiver<()>, Sender<Result<(), String>>)) {
    while let Ok((v, t)) = rx.recv() {
        reply.send(Ok(())).unwrap();
        let mut bad = 0;
        // Until the producer has written its new tensors (and a while after).
        loop {
            bad += t.to_vec().iter().filter(|&&x| x != v).count();
            if go.try_recv().is_ok() {
                break;
            }
        }
        bad += t.to_vec().iter().filter(|&&x| x != v).count();
        drop(t);
        reply.send(if bad == 0 { Ok(()) } else { Err(format!("{bad} reads saw another tensor's values")) }).unwrap();
    }
}

#[test]
fn a_block_is_reused_only_after_every_holder_dropped_it() {
    let _g = serial();
    let (tx, rx) = channel().unwrap();
    let (go_tx, go_rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let child = spawn((rx, go_rx, reply_tx), hold_and_check);
    for round in 0..20i64 {
        let t = HostTensor::<i64>::full(&[1 << 14], round).unwrap(); // 128 KiB
        let ptr = t.storage().as_ptr();
        tx.send((round, t)).unwrap();
        // Dropped here: the consumer holds the only reference.
        reply_rx.recv_timeout(WAIT).unwrap().unwrap();
        // Fresh tensors of the same size written at once: none may take the held block.
        let over: Vec<_> = (0..8).map(|_| HostTensor::<i64>::full(&[1 << 14], -1).unwrap()).collect();
        assert!(over.iter().all(|o| o.storage().as_ptr() != ptr), "round {round}: a held block was handed out");
        go_tx.send(()).unwrap();
        let verdict = reply_rx.recv_timeout(WAIT).unwrap();
        assert_eq!(verdict, Ok(()), "round {round}");
        drop(over);
        // Once the consumer's release lands, the block is handed out again.
        eventually("the block comes back", || HostTensor::<i64>::zeros(&[1 << 14]).unwrap().storage().as_ptr() == ptr);
    }
    drop(tx);
    child.join().unwrap();
}

#[test]
fn a_reused_block_is_zeroed_and_holds_what_it_is_made_with() {
    let _g = serial();
    let a = HostTensor::<i32>::full(&[1000], 0x5ead_beef).unwrap();
    let ptr = a.storage().as_ptr();
    drop(a);
    let b = HostTensor::<i32>::zeros(&[1000]).unwrap();
    assert_eq!(b.storage().as_ptr(), ptr, "the freed block is the best fit");
    assert_eq!(b.to_vec(), vec![0; 1000]);
    drop(b);
    let c = HostTensor::from_vec(&[999], vec![7i32; 999]).unwrap();
    assert_eq!(c.storage().as_ptr(), ptr);
    assert_eq!(c.to_vec(), vec![7; 999]);
}

/// Receives tensors until the channel closes, checking each against its number and
/// acknowledging it.
fn ack_each((rx, ack): (Receiver<(u32, HostTensor<i32>)>, Sender<u32>)) {
    while let Ok((i, t)) = rx.recv() {
        assert_eq!(t.to_vec()[0], i as i32);
        ack.send(i).unwrap();
    }
}

#[test]
fn a_hundred_thousand_fresh_tensors_to_four_consumers_one_killed_leave_nothing_behind() {
    let _g = serial();
    // Warm-up: a consumer that takes a few tensors and exits, so that what a process sets up
    // once (spare leases, its liveness table) is there before the counts start.
    {
        let (tx, rx) = channel().unwrap();
        let (ack_tx, ack_rx) = channel().unwrap();
        let child = spawn((rx, ack_tx), ack_each);
        for i in 0..100 {
            tx.send((i, HostTensor::<i32>::full(&[1024], i as i32).unwrap())).unwrap();
            assert_eq!(ack_rx.recv_timeout(WAIT).unwrap(), i);
        }
        drop(tx);
        child.join().unwrap();
    }
    eventually("the warm-up's blocks back", || host_allocator_stats().blocks == 0);
    let before = common::settled_lifetime(WAIT);
    empty_host_cache();
    let made_before = host_allocator_stats().segments_allocated;
    let fds = open_descriptors();
    let shm = shm_entries();
    let mut consumers = Vec::new();
    for _ in 0..4 {
        let (tx, rx) = channel().unwrap();
        let (ack_tx, ack_rx) = channel().unwrap();
        consumers.push((tx, ack_rx, spawn((rx, ack_tx), ack_each), 0u32));
    }
    const N: u32 = 100_000;
    const WINDOW: u32 = 32;
    let mut alive = 4;
    for i in 0..N {
        if i == N / 2 {
            // One consumer killed midway, with up to a window of tensors unacknowledged.
            let (_, _, child, _) = &mut consumers[3];
            child.kill().unwrap();
            alive = 3;
        }
        let c = &mut consumers[(i % alive) as usize];
        let t = HostTensor::<i32>::full(&[1024], i as i32).unwrap(); // 4 KiB, fresh
        c.0.send((i, t)).unwrap();
        c.3 += 1;
        if c.3 > WINDOW {
            c.1.recv_timeout(WAIT).unwrap();
            c.3 -= 1;
        }
    }
    let killed = consumers.pop().unwrap();
    for (tx, ack, child, outstanding) in consumers {
        for _ in 0..outstanding {
            ack.recv_timeout(WAIT).unwrap();
        }
        drop(tx);
        child.join().unwrap();
    }
    drop(killed);
    eventually("every block back, the killed consumer's included", || host_allocator_stats().blocks == 0);
    if let Err(e) = wait_for_lifetime(WAIT, |s| {
        s.live_storages == before.live_storages && s.outstanding_leases == before.outstanding_leases
    }) {
        panic!("every storage freed and every lease closed: {e}; before {before:?}, now {:?}", lifetime_stats());
    }
    // Counted from the start of the run: segments made by the tests before it are not its own.
    let made = host_allocator_stats().segments_allocated - made_before;
    assert!(made < 20, "blocks were reused: {made} segments made");
    assert!(empty_host_cache() > 0);
    assert_eq!(host_allocator_stats().reserved_bytes, 0);
    eventually("descriptors back to where they started", || open_descriptors() <= fds);
    assert_eq!(shm_entries(), shm, "files left in /dev/shm");
}

/// Holds what it receives until told to drop it; reports the segments it maps.
fn hold_until_told((rx, cmd, reply): (Receiver<HostTensor<u8>>, Receiver<()>, Sender<usize>)) {
    let t = rx.recv().unwrap();
    reply.send(lifetime_stats().mapped_segments).unwrap();
    cmd.recv().unwrap();
    drop(t);
    reply.send(lifetime_stats().mapped_segments).unwrap();
    // Cached until the owner gives the segment up.
    cmd.recv().unwrap();
    let deadline = Instant::now() + WAIT;
    while lifetime_stats().mapped_segments > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    reply.send(lifetime_stats().mapped_segments).unwrap();
    let _ = cmd.recv();
}

#[test]
fn a_receiver_keeps_a_segment_mapped_until_the_owner_gives_it_up() {
    let _g = serial();
    let (tx, rx) = channel().unwrap();
    let (cmd_tx, cmd_rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let child = spawn((rx, cmd_rx, reply_tx), hold_until_told);
    tx.send(HostTensor::<u8>::full(&[5 << 20], 7).unwrap()).unwrap(); // a 20 MiB segment
    assert_eq!(reply_rx.recv_timeout(WAIT).unwrap(), 1);
    cmd_tx.send(()).unwrap();
    assert_eq!(reply_rx.recv_timeout(WAIT).unwrap(), 1, "the receiver keeps the segment mapped after the drop");
    eventually("the block back", || host_allocator_stats().blocks == 0);
    assert_eq!(empty_host_cache(), 20 << 20);
    assert_eq!(host_allocator_stats().reserved_bytes, 0);
    cmd_tx.send(()).unwrap();
    assert_eq!(reply_rx.recv_timeout(WAIT).unwrap(), 0, "the receiver unmapped the segment given up");
    drop(cmd_tx);
    child.join().unwrap();
}

#[test]
fn the_cache_limit_refuses_a_segment_past_it_and_caching_can_be_turned_off() {
    let _g = serial();
    set_host_cache_limit(Some(30 << 20));
    // Two 10 MiB tensors fill one 20 MiB segment; a third would need a second one.
    let a = HostTensor::<u8>::zeros(&[10 << 20]).unwrap();
    let b = HostTensor::<u8>::zeros(&[10 << 20]).unwrap();
    let err = HostTensor::<u8>::zeros(&[10 << 20]).unwrap_err();
    assert!(matches!(err, Error::CacheLimit { limit, .. } if limit == 30 << 20), "{err}");
    assert!(err.is_out_of_memory());
    drop(a);
    // The freed block is reused: no new segment needed.
    let c = HostTensor::<u8>::zeros(&[10 << 20]).unwrap();
    assert_eq!(host_allocator_stats().segments, 1);
    // Larger tensors are memory files of their own, outside the limit.
    let big = HostTensor::<u8>::zeros(&[64 << 20]).unwrap();
    assert_eq!(host_allocator_stats().segments, 1);
    drop((b, c, big));
    set_host_cache_limit(None);

    set_host_caching(false);
    let own = HostTensor::<f32>::full(&[1024], 2.0).unwrap();
    assert_eq!(host_allocator_stats().blocks, 0, "one memory file per tensor");
    assert_eq!(host_allocator_stats().reserved_bytes, 0, "unused segments given up when turned off");
    assert_eq!(own.to_vec(), vec![2.0; 1024]);
    set_host_caching(true);
}

#[test]
fn fragmentation_is_bounded_by_the_segments_live_blocks_pin() {
    let _g = serial();
    // Worst case: one live 4 KiB block in each of four full segments pins all four.
    let mut all: Vec<_> = (0..4 * 512).map(|_| HostTensor::<u8>::zeros(&[4096]).unwrap()).collect();
    let s = host_allocator_stats();
    assert_eq!((s.segments, s.reserved_bytes), (4, 8 << 20));
    let kept: Vec<_> = all.drain(..).enumerate().filter(|(i, _)| i % 512 == 0).map(|(_, t)| t).collect();
    let s = host_allocator_stats();
    assert_eq!(s.allocated_bytes, 4 * 4096);
    assert_eq!(empty_host_cache(), 0, "no segment is wholly free");
    // The holes are reused before any new segment: a 1 MiB tensor fits one.
    let mid = HostTensor::<u8>::zeros(&[1 << 20]).unwrap();
    assert_eq!(host_allocator_stats().segments, 4);
    assert_eq!(host_allocator_stats().largest_free_block, (2 << 20) - 4096);
    drop((kept, mid));
    assert_eq!(empty_host_cache(), 8 << 20, "every segment whole again once its blocks are back");
}

/// Sends a fresh 4 KiB host tensor for each number of `numbers`, full of its number.
fn send_fresh(tx: &Sender<(u32, HostTensor<f32>)>, numbers: std::ops::Range<u32>) {
    for i in numbers {
        tx.send((i, HostTensor::<f32>::full(&[1024], i as f32).unwrap())).unwrap();
    }
}

/// Sends `n` fresh 4 KiB host tensors (tensor `i` full of `i`), each after the reply to the one
/// before; then, when told, `n` more at once; then ends when told.
fn produce_in_two_halves((tx, replies, go, n): (Sender<(u32, HostTensor<f32>)>, Receiver<u32>, Receiver<()>, u32)) {
    for i in 0..n {
        send_fresh(&tx, i..i + 1);
        assert_eq!(replies.recv_timeout(WAIT).unwrap(), i);
    }
    go.recv_timeout(WAIT).unwrap();
    send_fresh(&tx, n..2 * n);
    go.recv_timeout(WAIT).unwrap();
}

/// Receives `n` tensors numbered from `first` and checks each one's values.
fn receive_and_check((rx, first, n): (Receiver<(u32, HostTensor<f32>)>, u32, u32)) -> Result<(), String> {
    check_messages(&rx, first, n)
}

fn check_messages(rx: &Receiver<(u32, HostTensor<f32>)>, first: u32, n: u32) -> Result<(), String> {
    for i in first..first + n {
        let (k, t) = rx.recv_timeout(WAIT).map_err(|e| format!("message {i}: {e}"))?;
        if k != i || t.to_vec().iter().any(|&x| x != i as f32) {
            return Err(format!("message {i} came as {k} holding {:?}", &t.to_vec()[..2]));
        }
    }
    Ok(())
}

/// A segment's memory file travels once per channel: the later blocks of it name it, carry no
/// descriptor and so take the ring; a receiving end sent on to another process takes the
/// segments along, so the blocks that follow still decode there.
#[test]
fn a_segment_travels_once_per_channel_and_its_blocks_take_the_ring() {
    let _g = serial();
    const N: u32 = 50;
    let (tx, rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let (go_tx, go_rx) = channel().unwrap();
    let producer = spawn((tx, reply_rx, go_rx, N), produce_in_two_halves);
    let before = (cuda_mp::testing::ring_messages_received(), lifetime_stats().opened_segments);
    let deadline = Instant::now() + WAIT;
    for i in 0..N {
        // Never asleep in the kernel, so that a message without descriptors takes the ring.
        let (k, t) = loop {
            match rx.try_recv() {
                Ok(got) => break got,
                Err(e) if e.is_empty() && Instant::now() < deadline => std::hint::spin_loop(),
                Err(e) => panic!("message {i}: {e}"),
            }
        };
        assert_eq!(k, i);
        assert!(t.to_vec().iter().all(|&x| x == i as f32), "message {i} holds another tensor's values");
        drop(t);
        reply_tx.send(i).unwrap();
    }
    let ring = cuda_mp::testing::ring_messages_received() - before.0;
    let segments = lifetime_stats().opened_segments - before.1;
    // The first carries the segment, the ring is introduced after three more (read by then).
    assert!(ring >= N as u64 - 5, "{ring} of {N} fresh host tensors took the ring");
    assert_eq!(segments, 1, "one segment mapped for {N} fresh tensors");
    // The end moves to another process, with the segment it keeps; the producer goes on.
    let consumer = spawn((rx, N, N), receive_and_check);
    go_tx.send(()).unwrap();
    assert_eq!(consumer.join().unwrap(), Ok(()));
    go_tx.send(()).unwrap();
    producer.join().unwrap();
}

/// The memory files of segments this process holds: 2 MiB and more (a channel's ring, 128 KiB,
/// is a memory file too).
fn segment_files() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().contains("memfd")))
        .filter(|e| std::fs::metadata(e.path()).is_ok_and(|m| m.len() >= 2 << 20))
        .count()
}

/// Sends `n` fresh host tensors and exits at once.
fn send_and_exit((tx, n): (Sender<(u32, HostTensor<f32>)>, u32)) {
    send_fresh(&tx, 0..n);
}

/// A producer that exits right after its sends: every message still decodes (the later ones
/// name a segment only the first one carried), and once the end has read everything, the
/// segment it kept for that producer is let go: descriptors are back where they were.
#[test]
fn a_producer_that_exits_after_its_sends_leaves_its_segment_until_everything_is_read() {
    let _g = serial();
    let (tx, rx) = channel().unwrap();
    let producer = spawn((tx, 20u32), send_and_exit);
    producer.join().unwrap();
    let baseline = segment_files();
    assert_eq!(check_messages(&rx, 0, 20), Ok(()));
    assert_eq!(segment_files(), baseline + 1, "the end keeps the segment while a message may name it");
    eventually("the exited producer's segment let go once everything was read", || {
        assert!(rx.try_recv().is_err());
        segment_files() == baseline
    });
}

/// Sends `n` fresh host tensors, then exits when told.
fn send_then_exit_when_told((tx, n, go): (Sender<(u32, HostTensor<f32>)>, u32, Receiver<()>)) {
    send_fresh(&tx, 0..n);
    go.recv_timeout(WAIT).unwrap();
}

/// A producer that exits after its consumer has read everything: the consumer's end lets the
/// producer's segment go without another receive.
#[test]
fn a_producer_that_exits_after_everything_was_read_leaves_its_segment_at_once() {
    let _g = serial();
    let (tx, rx) = channel().unwrap();
    let (go_tx, go_rx) = channel().unwrap();
    let baseline = segment_files();
    let producer = spawn((tx, 5u32, go_rx), send_then_exit_when_told);
    assert_eq!(check_messages(&rx, 0, 5), Ok(()));
    assert_eq!(segment_files(), baseline + 1, "the end keeps the segment while the producer may name it");
    go_tx.send(()).unwrap();
    producer.join().unwrap();
    eventually("the exited producer's segment let go with no receive after its exit", || segment_files() == baseline);
    drop(rx);
}

/// Receives one tensor, forwards it to `to`, and reports what its statistics say it holds for
/// others; then waits to be killed.
fn forward_and_report(
    (rx, to, report): (Receiver<HostTensor<u8>>, Sender<HostTensor<u8>>, Sender<(usize, usize, u64)>),
) {
    to.send(rx.recv().unwrap()).unwrap();
    let held = cuda_mp::holder_stats();
    let storages = held.iter().map(|h| h.storages).sum();
    let bytes = held.iter().map(|h| h.bytes).sum();
    report.send((lifetime_stats().relayed_storages, storages, bytes)).unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

/// A process that forwards a block of another process's caching allocator relays the block,
/// and (internally) the block's segment: its statistics count the block alone, as the
/// allocator's own do (they counted the 2 MiB segment as a second storage, before).
#[test]
fn a_forwarded_block_counts_once_in_the_forwarders_statistics() {
    let _g = serial();
    let (to_b, b_rx) = channel().unwrap();
    let (to_c, c_rx) = channel::<HostTensor<u8>>().unwrap();
    let (report_tx, report) = channel().unwrap();
    let mut b = spawn((b_rx, to_c, report_tx), forward_and_report);
    to_b.send(HostTensor::<u8>::full(&[512], 7).unwrap()).unwrap();
    let (relayed, storages, bytes) = report.recv_timeout(WAIT).unwrap();
    let forwarded = c_rx.recv_timeout(WAIT).unwrap();
    assert_eq!(forwarded.to_vec(), vec![7; 512]);
    b.kill().unwrap();
    assert_eq!((relayed, storages, bytes), (1, 1, 512), "relayed storages, holders' storages and bytes");
}

/// Sends a message that does not decode (the first block of a fresh segment behind an odd
/// number), then one whose block names the same segment, and exits.
fn send_one_that_fails_then_one_that_names_its_segment(tx: Sender<(common::Even, HostTensor<f32>)>) {
    let first = HostTensor::<f32>::full(&[1024], 1.0).unwrap();
    let second = HostTensor::<f32>::full(&[1024], 2.0).unwrap();
    tx.send((common::Even(1), first)).unwrap();
    tx.send((common::Even(2), second)).unwrap();
}

/// A message whose value fails to decode does not take the segment it introduced along: the
/// next message, whose block only names that segment, decodes; and the failed one's block is
/// let go.
#[test]
fn a_message_that_fails_to_decode_leaves_the_segment_it_introduced_to_the_next() {
    let _g = serial();
    let (tx, rx) = channel::<(common::Even, HostTensor<f32>)>().unwrap();
    let producer = spawn(tx, send_one_that_fails_then_one_that_names_its_segment);
    producer.join().unwrap();
    match rx.recv_timeout(WAIT) {
        Err(e) => assert!(matches!(e, cuda_mp::RecvTimeoutError::Malformed(_)), "{e}"),
        Ok(got) => panic!("a message with an odd number decoded: {got:?}"),
    }
    let (n, t) = rx.recv_timeout(WAIT).expect("the block names the segment the failed message introduced");
    assert_eq!(n.0, 2);
    assert!(t.to_vec().iter().all(|&x| x == 2.0), "the second block holds its own values");
    drop((t, rx));
    eventually("nothing of the producer's left mapped", || {
        let s = lifetime_stats();
        s.imported_storages == 0 && s.cached_mappings == 0
    });
}
