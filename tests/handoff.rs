//! Values as bytes (`cuda_mp::to_bytes` / `from_bytes`) through a transport that is not a
//! channel (a file here), across real processes: the receiver shares the sender's memory, the
//! memory lives until the receiver drops it, bytes decode once and not after their time, a
//! receiver killed after decoding gives its claims back, and mutated bytes are errors. Batches
//! (`HandoffBatch`): one deposit for many values, decoded by one process each once, in any
//! order; not before the batch is finished; what is left undecoded goes at the batch's time.

use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cuda_mp::{Builder, HandoffBatch, HostTensor, Sender, channel, from_bytes, spawn, to_bytes, wait_for_lifetime};

mod common;

cuda_mp::enable_test_support!();

static SERIAL: Mutex<()> = Mutex::new(());
const WAIT: Duration = Duration::from_secs(20);

fn serial() -> std::sync::MutexGuard<'static, ()> {
    common::serial(&SERIAL, WAIT)
}

/// Writes `bytes` to a fresh file of this process, and gives its path: the transport.
fn through_a_file(bytes: &[u8]) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let name = format!("cuda-mp-handoff-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
    let path = std::env::temp_dir().join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// The counters with nothing of this test's alive: none exported, no lease out.
fn settled() -> cuda_mp::LifetimeStats {
    common::settled_lifetime(WAIT)
}

fn back_to(before: &cuda_mp::LifetimeStats, what: &str) {
    wait_for_lifetime(WAIT, |s| {
        s.live_storages == before.live_storages
            && s.exported_storages == before.exported_storages
            && s.outstanding_leases == before.outstanding_leases
    })
    .unwrap_or_else(|s| panic!("{what}: {s:?}, started at {before:?}"));
}

fn add_100_and_decode_twice(path: PathBuf) -> (f32, String) {
    let bytes = std::fs::read(&path).unwrap();
    let t: HostTensor<f32> = from_bytes(&bytes).unwrap();
    t.map_inplace(|x| x + 100.0);
    let again = from_bytes::<HostTensor<f32>>(&bytes).unwrap_err().to_string();
    (t.to_vec().iter().sum(), again)
}

#[test]
fn a_host_tensor_crosses_a_file_as_bytes_and_shares_memory_with_its_sender() {
    let _g = serial();
    let before = settled();
    let t = HostTensor::<f32>::from_vec(&[2, 2], vec![1.0, 2.0, 3.0, 4.0]).unwrap();
    let path = through_a_file(&to_bytes(&t, WAIT).unwrap());
    let (sum, again) = spawn(path.clone(), add_100_and_decode_twice).join().unwrap();
    std::fs::remove_file(path).unwrap();
    assert_eq!(sum, 410.0, "the child read the sender's values");
    assert_eq!(t.to_vec(), vec![101.0, 102.0, 103.0, 104.0], "the child's writes are seen here: one memory");
    assert!(again.contains("holds none"), "bytes decode once: {again}");
    drop(t);
    back_to(&before, "the storage is freed once the child and the sender dropped it");
}

fn decode_report_and_hold((path, ready): (PathBuf, Sender<i64>)) {
    let t: HostTensor<i64> = from_bytes(&std::fs::read(path).unwrap()).unwrap();
    ready.send(t.to_vec().iter().sum()).unwrap();
    std::thread::sleep(Duration::from_secs(600));
}

#[test]
fn the_memory_lives_while_the_receiver_holds_it_and_comes_back_when_it_is_killed() {
    let _g = serial();
    let before = settled();
    let t = HostTensor::<i64>::from_vec(&[1000], (0..1000).collect()).unwrap();
    let path = through_a_file(&to_bytes(&t, WAIT).unwrap());
    drop(t);
    let (ready_tx, ready_rx) = channel().unwrap();
    let mut child = Builder::new().spawn((path.clone(), ready_tx), decode_report_and_hold).unwrap();
    assert_eq!(
        ready_rx.recv_timeout(WAIT).unwrap(),
        499_500,
        "the child read the values after the sender dropped them"
    );
    std::fs::remove_file(path).unwrap();
    let held = cuda_mp::lifetime_stats();
    assert_eq!(held.live_storages, before.live_storages + 1, "the child's claim keeps the storage: {held:?}");
    child.kill().unwrap();
    back_to(&before, "the killed child's claim is reclaimed");
}

#[test]
fn bytes_nobody_decodes_give_their_claims_back_when_their_time_is_up() {
    let _g = serial();
    let before = settled();
    let t = HostTensor::<u8>::from_vec(&[64], vec![7; 64]).unwrap();
    let ttl = Duration::from_millis(300);
    // Before the deposit, whose time counts from its making inside `to_bytes`.
    let sent = Instant::now();
    let bytes = to_bytes(&t, ttl).unwrap();
    drop(t);
    assert_eq!(cuda_mp::lifetime_stats().live_storages, before.live_storages + 1, "the deposit holds the storage");
    back_to(&before, "the deposit is dropped when its time is up");
    assert!(sent.elapsed() >= ttl, "not before its time: {:?}", sent.elapsed());
    let late = from_bytes::<HostTensor<u8>>(&bytes).unwrap_err().to_string();
    assert!(late.contains("holds none"), "{late}");
}

/// A value whose time runs out while it is still being encoded (a slow `Serialize`) is an
/// error, and leaves nothing waiting: its later descriptors used to start a deposit of their
/// own, numbered from 0 again, and the bytes (said to be made) could never be decoded.
#[test]
fn a_value_whose_time_runs_out_while_it_encodes_is_an_error() {
    struct Slow;
    impl serde::Serialize for Slow {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            std::thread::sleep(Duration::from_millis(400));
            s.serialize_unit()
        }
    }
    let _g = serial();
    let before = settled();
    let a = HostTensor::<u8>::from_vec(&[8], vec![1; 8]).unwrap();
    let b = HostTensor::<u8>::from_vec(&[8], vec![2; 8]).unwrap();
    let err = to_bytes(&(&a, Slow, &b), Duration::from_millis(300)).unwrap_err().to_string();
    assert!(err.contains("was up before it was encoded whole"), "{err}");
    drop((a, b));
    back_to(&before, "nothing of the value waits");
    // In time, the same value goes.
    let a = HostTensor::<u8>::from_vec(&[8], vec![1; 8]).unwrap();
    let bytes = to_bytes(&(&a, Slow, &a), WAIT).unwrap();
    let (x, (), y): (HostTensor<u8>, (), HostTensor<u8>) = from_bytes(&bytes).unwrap();
    assert!(x.shares_storage_with(&a) && y.shares_storage_with(&a));
}

#[test]
fn a_decode_as_the_wrong_type_is_an_error_and_gives_the_claims_back() {
    let _g = serial();
    let before = settled();
    let t = HostTensor::<f32>::from_vec(&[3], vec![1.0, 2.0, 3.0]).unwrap();
    let bytes = to_bytes(&t, WAIT).unwrap();
    drop(t);
    let wrong = from_bytes::<HostTensor<i32>>(&bytes).unwrap_err().to_string();
    assert!(wrong.contains("dtype mismatch"), "{wrong}");
    back_to(&before, "what the failed decode fetched is closed");
}

/// Found by the `handoff_bytes` fuzz target: bytes whose first descriptor's ticket was edited
/// from "no batch" to "a batch, kept 136 years" made their decoder keep what that descriptor's
/// fetch brought and the value did not take (the lease), and with it the sender's storage, for
/// as long as the edited ticket said. What a decoder keeps of a batch now lasts no longer than
/// the deposit had left at its home.
#[test]
fn an_edited_ticket_keeps_nothing_past_its_deposits_time() {
    let _g = serial();
    let before = settled();
    let t = HostTensor::<f32>::full(&[4], 1.0).unwrap();
    let bytes = to_bytes(&t, Duration::from_secs(2)).unwrap();
    drop(t);
    // The first ticket: its home's name (13 + 32 characters), its token (a varint), its batch.
    let at = bytes.windows(13).position(|w| w == b"cuda-mp-home-").expect("a ticket in the bytes");
    let mut batch = at + 45;
    while bytes[batch] & 0x80 != 0 {
        batch += 1;
    }
    batch += 1;
    assert_eq!(bytes[batch], 0, "a ticket of no batch");
    let mut forged = bytes[..batch].to_vec();
    forged.extend([1, 0xff, 0xff, 0xff, 0xff, 0x0f]);
    forged.extend(&bytes[batch + 1..]);
    // Its check written again, so that the decoder reads it.
    let decoded = from_bytes::<HostTensor<f32>>(&cuda_mp::testing::seal_handoff(&forged));
    assert!(decoded.is_err(), "the ticket of its second descriptor is another: {decoded:?}");
    back_to(&before, "the sender's storage is freed once the deposit's time is up");
}

#[test]
fn mutated_bytes_are_errors_or_values_and_leave_nothing_behind() {
    let _g = serial();
    // What this process makes at its first handoff and keeps (its home, its tables) is made
    // before the count.
    let warm = HostTensor::<i16>::from_vec(&[1], vec![0]).unwrap();
    drop(from_bytes::<HostTensor<i16>>(&to_bytes(&warm, WAIT).unwrap()).unwrap());
    drop(warm);
    let before = settled();
    let descriptors = common::open_descriptors();
    let t = HostTensor::<i16>::from_vec(&[8], (0..8).collect()).unwrap();
    let bytes = to_bytes(&t, WAIT).unwrap();
    // Damaged on their way (every byte with its bits flipped, every truncation): refused by
    // their check before anything is fetched, so the intact bytes decode after all of them.
    for i in 0..bytes.len() {
        let mut damaged = bytes.clone();
        damaged[i] ^= 0xff;
        let err = from_bytes::<HostTensor<i16>>(&damaged).expect_err("damaged bytes decoded");
        assert!(matches!(err, cuda_mp::Error::Malformed(_)), "{err}");
    }
    for n in 0..bytes.len() {
        assert!(from_bytes::<HostTensor<i16>>(&bytes[..n]).is_err(), "a truncation to {n} bytes decoded");
    }
    let intact = from_bytes::<HostTensor<i16>>(&bytes).expect("damaged bytes took what the intact ones carry");
    assert_eq!(intact.to_vec(), (0..8).collect::<Vec<i16>>());
    drop(intact);
    // Forged: the value's own bytes edited, with the check written again (what one who has
    // the bytes can make), each against a deposit of its own: an error or a value, never a
    // panic; a deposit is taken at most once, and what a failed decode fetched is released.
    let head = cuda_mp::testing::HANDOFF_HEAD;
    let fresh = || to_bytes(&t, Duration::from_secs(2)).unwrap();
    // (The length of the bytes varies a little with the ticket's numbers.)
    for i in head.. {
        let real = fresh();
        if i >= real.len() {
            drop(from_bytes::<HostTensor<i16>>(&real));
            break;
        }
        let mut forged = real.clone();
        forged[i] ^= 0xff;
        let forged = from_bytes::<HostTensor<i16>>(&cuda_mp::testing::seal_handoff(&forged));
        if let Ok(v) = &forged {
            assert_eq!(v.to_vec().len(), 8);
        }
        let real = from_bytes::<HostTensor<i16>>(&real);
        assert!(!(forged.is_ok() && real.is_ok()), "byte {i} edited: the deposit was taken twice");
    }
    for n in head.. {
        let real = fresh();
        if n >= real.len() {
            drop(from_bytes::<HostTensor<i16>>(&real));
            break;
        }
        let cut = cuda_mp::testing::seal_handoff(&real[..n]);
        assert!(from_bytes::<HostTensor<i16>>(&cut).is_err(), "a truncation to {n} bytes decoded");
        drop(from_bytes::<HostTensor<i16>>(&real));
    }
    drop(t);
    // The deposit is taken by a decode or dropped at its time: nothing of it stays.
    back_to(&before, "every claim is back");
    common::eventually(WAIT, &format!("this process's descriptors are back to {descriptors}"), || {
        common::open_descriptors() <= descriptors
    });
}

#[cfg(feature = "cuda")]
fn add_one_on_the_gpu(path: PathBuf) -> Vec<f32> {
    let t: cuda_mp::GpuTensor<f32> = from_bytes(&std::fs::read(path).unwrap()).unwrap();
    t.add_scalar(1.0).unwrap();
    t.synchronize().unwrap();
    t.to_vec().unwrap()
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_gpu_tensor_crosses_a_file_as_bytes_and_shares_device_memory() {
    let _g = serial();
    let dev = common::gpu();
    let before = settled();
    let data: Vec<f32> = (0..1024).map(|x| x as f32).collect();
    let t = cuda_mp::GpuTensor::from_vec(&dev, &[32, 32], data.clone()).unwrap();
    let path = through_a_file(&to_bytes(&t, WAIT).unwrap());
    let seen = spawn(path.clone(), add_one_on_the_gpu).join().unwrap();
    std::fs::remove_file(path).unwrap();
    let plus_one: Vec<f32> = data.iter().map(|x| x + 1.0).collect();
    assert_eq!(seen, plus_one, "the child read the sender's device memory and wrote to it");
    assert_eq!(t.to_vec().unwrap(), plus_one, "the child's write is seen here");
    drop(t);
    back_to(&before, "the device memory is freed once both dropped it");
}

fn send_back_as_bytes((path, back, done): (PathBuf, Sender<Vec<u8>>, cuda_mp::Receiver<()>)) {
    let t: HostTensor<f32> = from_bytes(&std::fs::read(path).unwrap()).unwrap();
    back.send(to_bytes(&t, WAIT).unwrap()).unwrap();
    drop(t);
    // Alive until the owner decoded: the bytes name descriptors that wait here.
    let _ = done.recv_timeout(WAIT);
}

#[test]
fn received_memory_goes_back_to_its_owner_as_bytes() {
    let _g = serial();
    let before = settled();
    let t = HostTensor::<f32>::from_vec(&[3], vec![1.0, 2.0, 3.0]).unwrap();
    let path = through_a_file(&to_bytes(&t, WAIT).unwrap());
    let (back_tx, back_rx) = channel().unwrap();
    let (done_tx, done_rx) = channel().unwrap();
    let child = spawn((path.clone(), back_tx, done_rx), send_back_as_bytes);
    let back: Vec<u8> = back_rx.recv_timeout(WAIT).unwrap();
    let mine: HostTensor<f32> = from_bytes(&back).unwrap();
    done_tx.send(()).unwrap();
    child.join().unwrap();
    std::fs::remove_file(path).unwrap();
    mine.fill(9.0);
    assert_eq!(t.to_vec(), vec![9.0; 3], "what came back is this process's own memory");
    drop((t, mine));
    back_to(&before, "nothing of the round trip stays");
}

/// `n` host tensors, the i-th full of i, as the bytes of one finished batch of time `ttl`.
fn batch_of(n: usize, ttl: Duration) -> (Vec<HostTensor<i32>>, Vec<Vec<u8>>) {
    let tensors: Vec<HostTensor<i32>> = (0..n).map(|i| HostTensor::full(&[256], i as i32).unwrap()).collect();
    let mut batch = HandoffBatch::new(ttl).unwrap();
    let bytes = tensors.iter().map(|t| batch.to_bytes(t).unwrap()).collect();
    batch.finish().unwrap();
    (tensors, bytes)
}

/// Decodes every value, last first, adds 1000 to each, and tries each again: the first element
/// of each, and how many second decodes failed.
fn decode_backwards_and_again(bytes: Vec<Vec<u8>>) -> (Vec<i32>, usize) {
    let mut firsts = Vec::new();
    for b in bytes.iter().rev() {
        let t: HostTensor<i32> = from_bytes(b).unwrap();
        t.map_inplace(|x| x + 1000);
        firsts.push(t.to_vec()[0]);
    }
    let refused = bytes.iter().filter(|b| from_bytes::<HostTensor<i32>>(b).is_err()).count();
    firsts.reverse();
    (firsts, refused)
}

#[test]
fn a_batch_crosses_to_one_process_that_decodes_each_value_once_in_any_order() {
    let _g = serial();
    let before = settled();
    let (tensors, bytes) = batch_of(300, WAIT);
    let (firsts, refused) = spawn(bytes, decode_backwards_and_again).join().unwrap();
    assert_eq!(firsts, (1000..1300).collect::<Vec<i32>>(), "each value read and written by the child");
    assert_eq!(refused, 300, "no value decodes twice");
    for (i, t) in tensors.iter().enumerate() {
        assert_eq!(t.to_vec(), vec![i as i32 + 1000; 256], "the child's writes are seen here: one memory");
    }
    drop(tensors);
    back_to(&before, "every storage is freed once both sides dropped it");
}

#[test]
fn a_batch_decodes_only_once_finished_and_one_dropped_unfinished_gives_its_claims_back() {
    let _g = serial();
    let before = settled();
    let t = HostTensor::<f32>::from_vec(&[2], vec![1.0, 2.0]).unwrap();
    let mut batch = HandoffBatch::new(WAIT).unwrap();
    let bytes = batch.to_bytes(&t).unwrap();
    let early = from_bytes::<HostTensor<f32>>(&bytes).unwrap_err().to_string();
    assert!(early.contains("not finished"), "{early}");
    batch.finish().unwrap();
    assert_eq!(from_bytes::<HostTensor<f32>>(&bytes).unwrap().to_vec(), vec![1.0, 2.0]);
    let mut unfinished = HandoffBatch::new(WAIT).unwrap();
    let never = unfinished.to_bytes(&t).unwrap();
    assert!(format!("{unfinished:?}").contains("values: 1"), "{unfinished:?}");
    drop((t, unfinished));
    back_to(&before, "the unfinished batch is withdrawn with its claims");
    assert!(from_bytes::<HostTensor<f32>>(&never).is_err());
}

fn decode_first_report_and_hold((bytes, ready): (Vec<Vec<u8>>, Sender<i32>)) {
    let t: HostTensor<i32> = from_bytes(&bytes[0]).unwrap();
    ready.send(t.to_vec().iter().sum()).unwrap();
    std::thread::sleep(Duration::from_secs(600));
}

#[test]
fn values_of_a_batch_left_undecoded_give_their_claims_back_at_its_time_and_a_killed_holder_its_own() {
    let _g = serial();
    let before = settled();
    let ttl = Duration::from_secs(2);
    let (tensors, bytes) = batch_of(3, ttl);
    let sent = Instant::now();
    drop(tensors);
    let (ready_tx, ready_rx) = channel().unwrap();
    let mut child = Builder::new().spawn((bytes, ready_tx), decode_first_report_and_hold).unwrap();
    assert_eq!(ready_rx.recv_timeout(WAIT).unwrap(), 0, "the child read the first value");
    // The two values it did not decode are kept there for it until the batch's time is up.
    let held = cuda_mp::lifetime_stats();
    if sent.elapsed() < ttl {
        assert_eq!(held.live_storages, before.live_storages + 3, "{held:?}");
    }
    wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages + 1)
        .unwrap_or_else(|s| panic!("the undecoded values' claims come back at the batch's time: {s:?}"));
    assert!(sent.elapsed() >= ttl, "not before: {:?}", sent.elapsed());
    child.kill().unwrap();
    back_to(&before, "the killed child's claim is reclaimed");
}

/// Deposits two values, hands their bytes over, waits until the first was decoded (so that the
/// decoder keeps a connection to this process's home), then forks a child that only sleeps
/// (as a forked worker that never uses cuda-mp) and ends; gives the child's pid.
fn deposit_then_fork((out, go): (Sender<(Vec<u8>, Vec<u8>)>, cuda_mp::Receiver<()>)) -> i32 {
    let t = HostTensor::<f32>::full(&[64], 3.0).unwrap();
    let first = to_bytes(&t, WAIT).unwrap();
    let second = to_bytes(&t, WAIT).unwrap();
    out.send((first, second)).unwrap();
    go.recv_timeout(WAIT).unwrap();
    // SAFETY: the child only sleeps and `_exit`s.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        std::thread::sleep(Duration::from_secs(60));
        // SAFETY: ends the child at once, without its parent's exit hooks.
        unsafe { libc::_exit(0) };
    }
    pid
}

/// A process that forked a child and ended: bytes it handed out fail to decode at once, not
/// after the fetch's wait, although the child lives on with a copy of every descriptor its
/// parent had (the home's listener, and the connection the decoder keeps to it).
#[test]
fn bytes_of_a_process_that_forked_and_ended_fail_at_once() {
    let _g = serial();
    let (out, bytes) = channel().unwrap();
    let (go, go_rx) = channel().unwrap();
    let child = spawn((out, go_rx), deposit_then_fork);
    let (first, second) = bytes.recv_timeout(WAIT).unwrap();
    let t: HostTensor<f32> = from_bytes(&first).unwrap();
    assert_eq!(t.to_vec(), vec![3.0; 64]);
    go.send(()).unwrap();
    let forked = child.join().unwrap();
    assert!(forked > 0, "fork failed");
    let start = Instant::now();
    let err = from_bytes::<HostTensor<f32>>(&second).unwrap_err();
    let took = start.elapsed();
    // SAFETY: kills the sleeping child of the process that ended (it is nobody else's).
    unsafe { libc::kill(forked, libc::SIGKILL) };
    assert!(took < Duration::from_secs(5), "the decode failed only after {took:?}: {err}");
    assert!(err.to_string().contains("has exited before this process took them"), "{err}");
}

/// Bytes of another protocol version (or without the mark) are refused as such, before
/// anything they carry is taken: the real bytes decode after.
#[test]
fn bytes_of_another_version_are_refused_and_take_nothing() {
    let _g = serial();
    let t = HostTensor::<i16>::from_vec(&[4], vec![1, 2, 3, 4]).unwrap();
    let bytes = to_bytes(&t, WAIT).unwrap();
    let mut older = bytes.clone();
    older[3] -= 1;
    let said = from_bytes::<HostTensor<i16>>(&older).unwrap_err().to_string();
    assert!(said.contains(&format!("protocol version {}", bytes[3] - 1)), "{said}");
    let said = from_bytes::<HostTensor<i16>>(&bytes[3..]).unwrap_err().to_string();
    assert!(said.contains("not the bytes of a value"), "{said}");
    let back = from_bytes::<HostTensor<i16>>(&bytes).unwrap();
    assert!(back.shares_storage_with(&t));
}
