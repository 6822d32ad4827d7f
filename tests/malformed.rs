//! Malformed, truncated and forged messages give errors, never panics, and lose nothing.

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use cuda_mp::{HostTensor, Listener, RecvError, lifetime_stats, wait_for_lifetime};
use serde::ser::SerializeTuple;
use serde::{Deserialize, Serialize, Serializer};

mod common;
use common::{
    Claim, ForgedHost, ForgedSegment, ForgedSegmentRef, ForgedTensor, Slot, connect, lease_pipe, sealed_memory, slot,
    socket_pair,
};
use cuda_mp::testing::CarriedFile;

const WAIT: Duration = Duration::from_secs(10);

/// The lifetime counters are per process, and several tests here read them while others
/// import and release storages: every test runs alone.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    common::serial(&SERIAL, WAIT)
}

/// Raw bytes, written as they are (no length prefix).
#[derive(Deserialize)]
struct Raw(Vec<u8>);

impl Serialize for Raw {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut t = s.serialize_tuple(self.0.len())?;
        for b in &self.0 {
            t.serialize_element(b)?;
        }
        t.end()
    }
}

fn forged(dtype: u8, shape: Vec<usize>, bytes: usize) -> ForgedTensor<CarriedFile, CarriedFile> {
    let (lease, _) = lease_pipe();
    let strides = vec![1; shape.len()];
    ForgedTensor {
        dtype,
        shape,
        strides,
        offset: 0,
        owner: 0xdead_beef,
        index: 1,
        bytes: bytes as u64,
        lease: Claim::Lease(CarriedFile(lease), true),
        ticket: None,
        memory: ForgedHost::File(Some(CarriedFile(sealed_memory(16, 0)))),
    }
}

fn malformed(r: Result<HostTensor<f32>, RecvError>) -> String {
    match r {
        Err(RecvError::Malformed(m)) => m,
        other => panic!("expected a malformed-message error, got {other:?}"),
    }
}

#[test]
fn random_bytes_are_rejected() {
    let _g = serial();
    let (tx, rx) = connect::<Raw, HostTensor<f32>>();
    let mut seed = 0x1234_5678_9abc_def0u64;
    for len in [0usize, 1, 3, 17, 64, 300] {
        let bytes = (0..len)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect();
        tx.send(Raw(bytes)).unwrap();
        malformed(rx.recv_timeout(WAIT).map_err(|e| match e {
            cuda_mp::RecvTimeoutError::Malformed(m) => RecvError::Malformed(m),
            other => panic!("{other}"),
        }));
    }
}

#[test]
fn a_truncated_message_is_rejected() {
    let _g = serial();
    let (tx, rx) = connect::<Raw, HostTensor<f32>>();
    // dtype f32, a shape claiming 3 dimensions, then the message ends.
    tx.send(Raw(vec![0, 3, 2])).unwrap();
    malformed(rx.recv());
}

#[test]
fn descriptor_slots_out_of_range_are_rejected() {
    let _g = serial();
    let (tx, rx) = connect::<ForgedTensor<Slot, Slot>, HostTensor<f32>>();
    let f = ForgedTensor {
        dtype: 0,
        shape: vec![2],
        strides: vec![1],
        offset: 0,
        owner: 1,
        index: 1,
        bytes: 8,
        lease: Claim::Lease(slot(9), true),
        ticket: None,
        memory: ForgedHost::File(Some(slot(5))),
    };
    tx.send(f).unwrap();
    let m = malformed(rx.recv());
    assert!(!m.is_empty());

    // A real shared-memory region, but the lease points at a channel slot that is not there.
    let (tx, rx) = connect::<ForgedTensor<CarriedFile, Slot>, HostTensor<f32>>();
    let f = ForgedTensor {
        dtype: 0,
        shape: vec![2],
        strides: vec![1],
        offset: 0,
        owner: 1,
        index: 1,
        bytes: 8,
        lease: Claim::Lease(slot(7), true),
        ticket: None,
        memory: ForgedHost::File(Some(CarriedFile(sealed_memory(8, 1)))),
    };
    tx.send(f).unwrap();
    let m = malformed(rx.recv());
    assert!(m.contains("does not carry"), "{m}");
}

#[test]
fn a_view_beyond_its_storage_is_rejected() {
    let _g = serial();
    let (tx, rx) = connect::<ForgedTensor<CarriedFile, CarriedFile>, HostTensor<f32>>();
    tx.send(forged(0, vec![100], 16)).unwrap();
    let m = malformed(rx.recv());
    assert!(m.contains("view reaches element 100 but the storage holds 4"), "{m}");
    // The claimed size exceeds the memory that came with the message.
    tx.send(forged(0, vec![2], 4096)).unwrap();
    let m = malformed(rx.recv());
    assert!(m.contains("shared memory of 16 bytes where 4096 were promised") && !m.contains("exited"), "{m}");
    // Strides past isize::MAX, and strides that overflow.
    let mut f = forged(0, vec![2, 2], 16);
    f.strides = vec![usize::MAX, 1];
    tx.send(f).unwrap();
    let m = malformed(rx.recv());
    assert!(m.contains("a stride over isize::MAX"), "{m}");
    let mut f = forged(0, vec![4, 2], 16);
    f.strides = vec![isize::MAX as usize, 1];
    tx.send(f).unwrap();
    let m = malformed(rx.recv());
    assert!(m.contains("overflows"), "{m}");
}

#[test]
fn host_memory_sealed_against_writes_is_rejected() {
    let _g = serial();
    // Mapped read-only in the receiver, the tensor's first write would fault: refused instead.
    let (tx, rx) = connect::<ForgedTensor<CarriedFile, CarriedFile>, HostTensor<f32>>();
    let mut f = forged(0, vec![4], 16);
    let frozen = sealed_memory(16, 0);
    rustix::fs::fcntl_add_seals(&frozen, rustix::fs::SealFlags::WRITE).unwrap();
    f.memory = ForgedHost::File(Some(CarriedFile(frozen)));
    tx.send(f).unwrap();
    let m = malformed(rx.recv());
    assert!(m.contains("sealed against writes"), "{m}");
}

/// A block of `bytes` bytes at `offset` of a forged segment of `segment_len` bytes whose
/// memory is `fd`.
fn forged_block(
    offset: u64,
    bytes: usize,
    segment_len: u64,
    fd: Option<std::fs::File>,
) -> ForgedTensor<CarriedFile, CarriedFile> {
    let (lease, _) = lease_pipe();
    let segment = ForgedSegment {
        owner: 0xdead_beef,
        index: 1 << 63 | 1,
        bytes: segment_len,
        lease: Claim::Lease(CarriedFile(lease), true),
        ticket: None,
        fd: fd.map(CarriedFile),
    };
    let mut f = forged(0, vec![bytes / 4], bytes);
    f.index = 2;
    f.memory = ForgedHost::Block(ForgedSegmentRef::Whole(Box::new(segment)), offset);
    f
}

#[test]
fn a_forged_host_block_is_rejected_and_maps_nothing() {
    let _g = serial();
    let (tx, rx) = connect::<ForgedTensor<CarriedFile, CarriedFile>, HostTensor<f32>>();
    let before = lifetime_stats();
    // Past its segment's end.
    tx.send(forged_block(4000, 256, 4096, Some(sealed_memory(4096, 0)))).unwrap();
    let m = malformed(rx.recv());
    assert!(m.contains("host block of 256 bytes at offset 4000 exceeds its 4096-byte segment"), "{m}");
    // An offset that would make its words unaligned.
    tx.send(forged_block(4, 16, 4096, Some(sealed_memory(4096, 0)))).unwrap();
    let m = malformed(rx.recv());
    assert!(m.contains("not a multiple of 8"), "{m}");
    // No segment at all.
    let mut f = forged_block(0, 16, 4096, None);
    f.memory = ForgedHost::Block(ForgedSegmentRef::Taken, 0);
    tx.send(f).unwrap();
    let m = malformed(rx.recv());
    assert!(m.contains("host block without its segment"), "{m}");
    // A segment named as one this channel knows, which it was never given.
    let mut f = forged_block(0, 16, 4096, None);
    f.memory =
        ForgedHost::Block(ForgedSegmentRef::Known { via: 0xdead_beef, owner: 0xdead_beef, index: 1 << 63 | 1 }, 0);
    tx.send(f).unwrap();
    let m = malformed(rx.recv());
    assert!(m.contains("which its channel was never given"), "{m}");
    // A segment without its memory, smaller than it claims, or sealed against writes.
    tx.send(forged_block(0, 16, 4096, None)).unwrap();
    let m = malformed(rx.recv());
    assert!(m.contains("host segment without its memory"), "{m}");
    tx.send(forged_block(0, 16, 1 << 20, Some(sealed_memory(4096, 0)))).unwrap();
    let m = malformed(rx.recv());
    assert!(m.contains("where 1048576 were promised") && !m.contains("exited"), "{m}");
    let frozen = sealed_memory(4096, 0);
    rustix::fs::fcntl_add_seals(&frozen, rustix::fs::SealFlags::WRITE).unwrap();
    tx.send(forged_block(0, 16, 4096, Some(frozen))).unwrap();
    let m = malformed(rx.recv());
    assert!(m.contains("sealed against writes"), "{m}");
    // A segment's memory that is not a sealed memory file.
    tx.send(forged_block(0, 16, 4096, Some(std::fs::File::open("/dev/zero").unwrap()))).unwrap();
    let m = malformed(rx.recv());
    assert!(m.contains("not a sealed memory file"), "{m}");
    let after = lifetime_stats();
    assert_eq!(after.mapped_segments, before.mapped_segments, "nothing stays mapped");
    assert_eq!(after.imported_storages, before.imported_storages);
}

#[test]
fn an_unknown_dtype_tag_is_rejected() {
    let _g = serial();
    let (tx, rx) = connect::<ForgedTensor<CarriedFile, CarriedFile>, HostTensor<f32>>();
    tx.send(forged(42, vec![2], 16)).unwrap();
    let m = malformed(rx.recv());
    assert!(m.starts_with("unknown dtype tag 42 (the sender sends "), "{m}");
}

#[test]
fn a_dtype_mismatch_is_an_error_and_releases_the_claim() {
    let _g = serial();
    let before = lifetime_stats();
    let (tx, rx) = connect::<HostTensor<cuda_mp::f16>, HostTensor<f32>>();
    let t = HostTensor::<cuda_mp::f16>::zeros(&[8]).unwrap();
    tx.send(t.clone()).unwrap();
    let m = malformed(rx.recv());
    assert!(m.starts_with("dtype mismatch: expected f32, found f16 (the sender sends cuda_mp::"), "{m}");
    drop(t);
    wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages)
        .expect("the rejected message's claim is released and the storage freed");
    drop((tx, rx));
    wait_for_lifetime(WAIT, |s| s.outstanding_leases == before.outstanding_leases)
        .expect("the connection's lease closes with its receiver");
}

/// A socket connected to the listener `name`, to write by hand what a peer says.
fn raw_peer(name: &str) -> std::os::fd::OwnedFd {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType, connect, socket_with};
    let fd = socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None).unwrap();
    connect(&fd, &SocketAddrUnix::new(name).unwrap()).unwrap();
    fd
}

#[test]
fn a_peer_that_is_not_cuda_mp_is_refused() {
    let _g = serial();
    let listener = Listener::<u32>::bind().unwrap();
    // A peer that connects and writes something else than our hello.
    let fd = raw_peer(listener.name());
    rustix::net::send(&fd, b"hello", rustix::net::SendFlags::empty()).unwrap();
    let err = listener.accept_timeout(WAIT).unwrap_err();
    assert!(err.to_string().contains("not a cuda-mp sender"), "{err}");
}

#[test]
fn a_named_connection_of_another_version_is_refused_with_both_versions() {
    let _g = serial();
    let listener = Listener::<u32>::bind().unwrap();
    let fd = raw_peer(listener.name());
    // The transport's header (no descriptor), then a hello's magic and version 4.
    let mut hello = 0u32.to_le_bytes().to_vec();
    hello.extend_from_slice(b"cuda-mp\0");
    hello.push(4);
    rustix::net::send(&fd, &hello, rustix::net::SendFlags::empty()).unwrap();
    let err = listener.accept_timeout(WAIT).unwrap_err();
    let said = err.to_string();
    assert!(said.contains("protocol version") && said.contains(" here, 4 at the peer"), "{said}");
}

#[test]
fn a_message_of_another_type_on_a_named_connection_names_both_types() {
    let _g = serial();
    let listener = Listener::<Vec<String>>::bind().unwrap();
    let tx = cuda_mp::Sender::<u64>::connect(listener.name()).unwrap();
    let rx = listener.accept_timeout(WAIT).unwrap();
    // Three messages on the socket, the next ones in the sender's ring: both paths say it.
    for _ in 0..6 {
        tx.send(7).unwrap();
    }
    for _ in 0..6 {
        match rx.recv_timeout(WAIT) {
            Err(cuda_mp::RecvTimeoutError::Malformed(m)) => assert!(
                m.contains("(the sender sends u64, this receiver takes alloc::vec::Vec<alloc::string::String>)"),
                "{m}"
            ),
            other => panic!("expected a malformed message, got {other:?}"),
        }
    }
    // Types that differ but whose bytes agree are not refused: what decodes is delivered (a
    // sender of `DynTensor` and a receiver of `Tensor<f32>`, say).
    let listener = Listener::<u64>::bind().unwrap();
    let tx = cuda_mp::Sender::<u32>::connect(listener.name()).unwrap();
    let rx = listener.accept_timeout(WAIT).unwrap();
    tx.send(7).unwrap();
    assert_eq!(rx.recv_timeout(WAIT).unwrap(), 7);
}

/// What the forger sends: a genuine tensor (read back field by field, or as a tensor), or a
/// forged record.
#[derive(Serialize, Deserialize)]
enum Sent {
    Genuine(HostTensor<f32>),
    Forged(ForgedTensor<CarriedFile, CarriedFile>),
    Fields(HostTensor<f32>),
}

/// What the receiver reads, variant by variant.
#[derive(Serialize, Deserialize)]
enum Received {
    Genuine(HostTensor<f32>),
    Forged(HostTensor<f32>),
    Fields(ForgedTensor<CarriedFile, CarriedFile>),
}

/// A record that names a connection claim its message does not list (a copy of a genuine
/// record, its claim repeated or its index changed) is refused, and releases nothing: the
/// receiver's genuine claim on that storage keeps it alive after its owner drops it.
#[test]
fn a_forged_connection_claim_is_refused_and_releases_nothing() {
    let _g = serial();
    let before = lifetime_stats();
    let (tx, rx) = connect::<Sent, Received>();
    let held = HostTensor::<f32>::full(&[4], 7.0).unwrap();
    tx.send(Sent::Genuine(held.clone())).unwrap();
    let Ok(Received::Genuine(kept)) = rx.recv_timeout(WAIT) else { panic!("the genuine tensor") };
    // The genuine record, field by field: its claim is counted on the channel's lease.
    tx.send(Sent::Fields(held.clone())).unwrap();
    let Ok(Received::Fields(record)) = rx.recv_timeout(WAIT) else { panic!("the genuine record") };
    let Claim::Connection(owner, key, index) = record.lease.clone() else { panic!("a connection claim") };
    for forged_index in [index, index + 1, u64::MAX] {
        let mut forged = ForgedTensor { lease: Claim::Connection(owner, key, forged_index), ..record_copy(&record) };
        forged.index = forged_index;
        tx.send(Sent::Forged(forged)).unwrap();
        match rx.recv_timeout(WAIT) {
            Err(cuda_mp::RecvTimeoutError::Malformed(m)) => assert!(m.contains("does not carry"), "{m}"),
            Ok(_) => panic!("a forged claim was accepted"),
            Err(other) => panic!("{other}"),
        }
    }
    drop(record);
    // The owner's handle goes: the receiver's genuine claim alone keeps the memory.
    drop(held);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(lifetime_stats().live_storages, before.live_storages + 1, "a forged claim released the storage");
    assert_eq!(kept.to_vec(), vec![7.0; 4]);
    drop(kept);
    wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages).expect("freed at the genuine release");
}

/// The fields of a record read back, with a fresh copy of its memory's descriptor.
fn record_copy(r: &ForgedTensor<CarriedFile, CarriedFile>) -> ForgedTensor<CarriedFile, CarriedFile> {
    ForgedTensor {
        dtype: r.dtype,
        shape: r.shape.clone(),
        strides: r.strides.clone(),
        offset: r.offset,
        owner: r.owner,
        index: r.index,
        bytes: r.bytes,
        lease: r.lease.clone(),
        ticket: r.ticket,
        memory: r.memory.clone(),
    }
}

/// A lease must be a pipe's writing end: a socket, a memory file or `/dev/null` in its place is
/// refused before the storage is looked at (a holder would write its records, and subscribe to
/// revocations, through it).
#[test]
fn a_lease_that_is_not_a_pipes_writing_end_is_refused() {
    let _g = serial();
    let (tx, rx) = connect::<ForgedTensor<CarriedFile, CarriedFile>, HostTensor<f32>>();
    let (_, pipe_reader) = lease_pipe();
    let not_leases = [socket_pair().0, sealed_memory(16, 0), std::fs::File::open("/dev/null").unwrap(), pipe_reader];
    for not_a_lease in not_leases {
        let mut f = forged(0, vec![4], 16);
        f.lease = Claim::Lease(CarriedFile(not_a_lease), true);
        tx.send(f).unwrap();
        let m = malformed(rx.recv());
        assert!(m.contains("lease that is not a pipe's writing end"), "{m}");
    }
    tx.send(forged(0, vec![4], 16)).unwrap();
    assert_eq!(rx.recv().unwrap().to_vec(), vec![0.0; 4], "the channel goes on; a real pipe is a lease");
}

/// A lease a peer left blocking is taken as an open file of the receiver's own (made
/// non-blocking there): the file the peer sent, shared with every process that holds it, keeps
/// its flags.
#[test]
fn a_lease_left_blocking_is_taken_without_changing_the_senders_file() {
    use std::os::fd::AsRawFd;
    let _g = serial();
    let (tx, rx) = connect::<ForgedTensor<CarriedFile, CarriedFile>, HostTensor<f32>>();
    let mut f = forged(0, vec![4], 16);
    // A reader lives, as the owner of a real lease would.
    let (lease, _reader) = lease_pipe();
    let senders = lease.try_clone().unwrap();
    f.lease = Claim::Lease(CarriedFile(lease), true);
    // SAFETY: reads the flags of a descriptor this test owns.
    let flags = || unsafe { libc::fcntl(senders.as_raw_fd(), libc::F_GETFL) };
    assert_eq!(flags() & libc::O_NONBLOCK, 0, "the test's lease is blocking");
    tx.send(f).unwrap();
    assert_eq!(rx.recv().unwrap().to_vec(), vec![0.0; 4]);
    assert_eq!(flags() & libc::O_NONBLOCK, 0, "the receiver changed the sender's open file");
}

#[test]
fn a_peer_that_connects_and_says_nothing_holds_no_accept_past_its_time() {
    let _g = serial();
    let listener = Listener::<u32>::bind().unwrap();
    let _silent = raw_peer(listener.name());
    let start = std::time::Instant::now();
    let got = listener.try_accept_for(Duration::from_millis(20)).unwrap();
    assert!(got.is_none(), "no peer said hello");
    assert!(start.elapsed() < Duration::from_secs(5), "waited {:?} for the silent peer", start.elapsed());
    // The listener is kept, and the next sender is taken in.
    let tx = cuda_mp::Sender::<u32>::connect(listener.name()).unwrap();
    let rx = listener.try_accept_for(WAIT).unwrap().expect("the sender");
    tx.send(8).unwrap();
    assert_eq!(rx.recv().unwrap(), 8);
}
