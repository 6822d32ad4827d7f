//! Descriptors of any kind carried inline in messages (what VMM memory's descriptor does), on
//! the CPU: they outlive their sender, any number travel in one message, and forged or reused
//! ones are errors.

use std::io::{Read, Seek, SeekFrom, Write};
use std::time::Duration;

use cuda_mp::testing::CarriedFile;
use cuda_mp::{Receiver, RecvTimeoutError, Sender, channel, spawn};

mod common;

cuda_mp::enable_test_support!();

const WAIT: Duration = Duration::from_secs(30);

/// One test at a time: one of them counts this process's leases and exported storages.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    common::serial(&SERIAL, WAIT)
}

/// A file of this process holding `text`, not named anywhere.
fn file_with(text: &str) -> std::fs::File {
    let mut f = tempfile();
    f.write_all(text.as_bytes()).unwrap();
    f
}

fn tempfile() -> std::fs::File {
    let path = std::env::temp_dir().join(format!(
        "cuda-mp-descriptors-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    f
}

fn read_all(mut f: &std::fs::File) -> String {
    f.seek(SeekFrom::Start(0)).unwrap();
    let mut s = String::new();
    f.read_to_string(&mut s).unwrap();
    s
}

/// Sends `n` files and exits at once.
fn send_files_and_exit((tx, n): (Sender<Vec<CarriedFile>>, usize)) {
    let files = (0..n).map(|i| CarriedFile(file_with(&format!("file {i}")))).collect();
    tx.send(files).unwrap();
}

#[test]
fn descriptors_in_flight_outlive_their_sender_and_any_number_travel_in_one_message() {
    let _g = serial();
    let (tx, rx): (Sender<Vec<CarriedFile>>, Receiver<Vec<CarriedFile>>) = channel().unwrap();
    // More than ipc-channel's 64 and the kernel's 253 descriptors per transport message.
    spawn((tx, 300), send_files_and_exit).join().unwrap();
    // The sender has exited: its files are still there, each the one it wrote.
    let files = rx.recv_timeout(WAIT).unwrap();
    assert_eq!(files.len(), 300);
    for (i, f) in files.iter().enumerate() {
        assert_eq!(read_all(&f.0), format!("file {i}"));
    }
}

#[test]
fn a_received_descriptor_is_the_senders_file() {
    let _g = serial();
    let (tx, rx) = channel::<CarriedFile>().unwrap();
    let mine = file_with("before");
    tx.send(CarriedFile(mine.try_clone().unwrap())).unwrap();
    let got = rx.recv_timeout(WAIT).unwrap();
    (&got.0).write_all(b" and after").unwrap();
    assert_eq!(read_all(&mine), "before and after");
}

/// The wire form of a carried descriptor, under the forger's control: its index among the
/// message's descriptors (and no spawn ticket).
#[derive(serde::Serialize, serde::Deserialize)]
struct ForgedCarried(u32, Option<()>);

#[test]
fn a_message_naming_a_descriptor_it_does_not_carry_is_malformed_and_the_receiver_goes_on() {
    let _g = serial();
    let (tx, rx) = common::connect::<ForgedCarried, CarriedFile>();
    for index in [0, 1, 70_000, u32::MAX] {
        tx.send(ForgedCarried(index, None)).unwrap();
        match rx.recv_timeout(WAIT) {
            Err(RecvTimeoutError::Malformed(m)) => assert!(m.contains("does not carry"), "{m}"),
            other => panic!("expected a malformed message, got {other:?}"),
        }
    }
    let (good_tx, good_rx) = channel::<CarriedFile>().unwrap();
    good_tx.send(CarriedFile(file_with("fine"))).unwrap();
    assert_eq!(read_all(&good_rx.recv_timeout(WAIT).unwrap().0), "fine");
}

#[test]
fn a_descriptor_named_twice_in_one_message_is_taken_once() {
    let _g = serial();
    // The second value of the message names the first one's descriptor again.
    let (tx, rx) = common::connect::<(CarriedFile, ForgedCarried), (CarriedFile, CarriedFile)>();
    tx.send((CarriedFile(file_with("once")), ForgedCarried(0, None))).unwrap();
    match rx.recv_timeout(WAIT) {
        Err(RecvTimeoutError::Malformed(m)) => assert!(m.contains("twice"), "{m}"),
        other => panic!("expected a malformed message, got {other:?}"),
    }
    // A genuine message of two descriptors after it arrives whole.
    let (tx, rx) = common::connect::<(CarriedFile, CarriedFile), (CarriedFile, CarriedFile)>();
    tx.send((CarriedFile(file_with("a")), CarriedFile(file_with("b")))).unwrap();
    let (a, b) = rx.recv_timeout(WAIT).unwrap();
    assert_eq!((read_all(&a.0), read_all(&b.0)), ("a".to_string(), "b".to_string()));
}

#[test]
fn a_message_of_many_storages_that_does_not_decode_is_an_error_and_keeps_nothing_claimed() {
    let _g = serial();
    use cuda_mp::testing::FakeTensor;
    let before = cuda_mp::lifetime_stats();
    // Three storages to a receiver of another element type: the first tensor is refused, and
    // the claims of the other two, never reached, are released too.
    let (tx, rx) = common::connect::<Vec<FakeTensor<f32>>, Vec<FakeTensor<i32>>>();
    let sent: Vec<FakeTensor<f32>> = (0..3).map(|_| FakeTensor::fake(&[4], Duration::ZERO).unwrap()).collect();
    tx.send(sent.clone()).unwrap();
    match rx.recv_timeout(WAIT) {
        Err(RecvTimeoutError::Malformed(m)) => assert!(m.contains("dtype"), "{m}"),
        other => panic!("expected a malformed message, got {other:?}"),
    }
    drop(sent);
    cuda_mp::wait_for_lifetime(WAIT, |s| s.exported_storages == before.exported_storages)
        .expect("the claims of a message that did not decode are kept");
    // The channel goes on.
    tx.send(vec![FakeTensor::fake(&[4], Duration::ZERO).unwrap()]).unwrap();
    assert!(matches!(rx.recv_timeout(WAIT), Err(RecvTimeoutError::Malformed(_))));
    cuda_mp::wait_for_lifetime(WAIT, |s| s.exported_storages == before.exported_storages).unwrap();
    // The connection's lease lives as long as its receiver.
    assert_eq!(cuda_mp::lifetime_stats().outstanding_leases, before.outstanding_leases + 1);
    drop(rx);
    cuda_mp::wait_for_lifetime(WAIT, |s| s.outstanding_leases == before.outstanding_leases)
        .expect("the connection's lease outlived its receiver");
}

/// Receives one message that does not decode; says how many descriptors it had open before
/// and after.
fn receive_one_undecodable((rx, counts): (Receiver<(CarriedFile, u64, CarriedFile)>, Sender<(usize, usize, String)>)) {
    let open = common::open_descriptors;
    // The channel's own descriptors are open already; the message is waiting.
    let before = open();
    let said = match rx.recv_timeout(WAIT) {
        Err(RecvTimeoutError::Malformed(m)) => m,
        other => format!("not malformed: {other:?}"),
    };
    counts.send((before, open(), said)).unwrap();
}

#[test]
fn a_message_of_many_parked_descriptors_that_does_not_decode_closes_them_all() {
    let _g = serial();
    // Files sent to a receiver that expects something else where the second one is.
    let (tx, rx) = common::connect::<(CarriedFile, CarriedFile, CarriedFile), (CarriedFile, u64, CarriedFile)>();
    tx.send((CarriedFile(file_with("a")), CarriedFile(file_with("b")), CarriedFile(file_with("c")))).unwrap();
    let (counts_tx, counts) = channel().unwrap();
    let mut child = spawn((rx, counts_tx), receive_one_undecodable);
    let (before, after, said) = counts.recv_timeout(WAIT).unwrap();
    child.join_timeout(WAIT).unwrap();
    assert!(!said.starts_with("not malformed"), "{said}");
    assert!(after <= before, "descriptors left open by a message that did not decode: {before} before, {after} after");
}
