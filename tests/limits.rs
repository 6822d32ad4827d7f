//! Running out of file descriptors is an error that says so, never a panic or a "malformed
//! message": every shared storage of its own (a host tensor made with the caching allocator
//! off, say) and every lease is a descriptor.

use std::time::Duration;

use cuda_mp::{Error, HostTensor, Receiver, RecvTimeoutError, Sender, channel, spawn};
use serde::Serialize;
use serde::de::DeserializeOwned;

cuda_mp::enable_test_support!();

const WAIT: Duration = Duration::from_secs(30);

/// Lowers this process's soft descriptor limit to `headroom` above what it has open (after
/// cuda-mp's own start-up, which raises it to the hard limit).
fn leave_headroom(headroom: u64) -> u64 {
    drop(HostTensor::<u8>::zeros(&[1]).unwrap());
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    let limit = open + headroom;
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `r` is a valid, writable rlimit; lowering the soft limit is always allowed.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        r.rlim_cur = limit as libc::rlim_t;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &r), 0);
    }
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
    let said = spawn(false, allocate_until_it_fails).join().unwrap();
    assert!(said.starts_with("out of descriptors after"), "{said}");
}

#[test]
fn fresh_host_tensors_of_the_caching_allocator_cost_no_descriptor_each() {
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
    let (tx, rx) = channel().unwrap();
    let said = spawn(tx, send_files_with_little_room).join().unwrap();
    assert_eq!(said, "out of descriptors");
    drop(rx);
}

#[test]
fn receiving_parked_descriptors_past_the_limit_is_an_error_that_says_so() {
    let (said, joined) = sent_to_a_receiver_with_little_room(|| {
        (0..ITEMS).map(|_| cuda_mp::testing::CarriedFile(std::fs::File::open("/dev/null").unwrap())).collect::<Vec<_>>()
    });
    assert_eq!(said.as_deref().ok(), Some("out of descriptors"), "{said:?} {joined:?}");
    joined.unwrap();
}
