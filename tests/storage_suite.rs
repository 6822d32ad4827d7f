//! One suite of lifetime tests run over every storage kind, across real processes: fake
//! storage (the GPU protocol: a lease per storage, idle cache, revocation; no GPU needed), host
//! shared memory (a memory file per tensor, or blocks of the caching allocator's segments), and
//! GPU memory (ignored without a GPU).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cuda_mp::testing::{FakeTensor, fake_mappings_closed};
use cuda_mp::{
    Device, GpuMemoryKind, GpuTensor, HostTensor, Receiver, Sender, Tensor, channel, lifetime_stats, spawn,
    wait_for_lifetime,
};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

mod common;

cuda_mp::enable_test_support!();

static SERIAL: Mutex<()> = Mutex::new(());
const WAIT: Duration = Duration::from_secs(30);

fn serial() -> std::sync::MutexGuard<'static, ()> {
    common::serial(&SERIAL, WAIT)
}

/// A storage kind under test: how to make a tensor of it.
trait Kind: 'static {
    type S: Send + Sync + 'static;
    fn make(len: usize) -> Tensor<f32, Self::S>;
}

struct Fake;
impl Kind for Fake {
    type S = cuda_mp::testing::FakeStorage;
    fn make(len: usize) -> FakeTensor<f32> {
        FakeTensor::fake(&[len], Duration::ZERO).unwrap()
    }
}

/// Host memory, a memory file per tensor or a block of the caching allocator's.
fn host_tensor(len: usize, caching: bool) -> HostTensor<f32> {
    cuda_mp::set_host_caching(caching);
    let t = HostTensor::zeros(&[len]).unwrap();
    assert!(!caching || cuda_mp::host_allocator_stats().blocks > 0, "a block of the allocator's");
    t
}

struct Host;
impl Kind for Host {
    type S = cuda_mp::HostStorage;
    fn make(len: usize) -> HostTensor<f32> {
        host_tensor(len, false)
    }
}

struct HostPooled;
impl Kind for HostPooled {
    type S = cuda_mp::HostStorage;
    fn make(len: usize) -> HostTensor<f32> {
        host_tensor(len, true)
    }
}

/// GPU memory of one kind (legacy IPC or VMM), whatever the size: an allocation of its own, or
/// with `segments` a block of the caching allocator's segments of that kind.
fn gpu_tensor(len: usize, kind: GpuMemoryKind, segments: bool) -> GpuTensor<f32> {
    let dev = Device::get(0).expect("this test needs a CUDA GPU");
    dev.set_caching(segments);
    if segments {
        dev.set_memory_kind(GpuMemoryKind::Auto);
        dev.set_segment_kind(kind).unwrap();
    } else {
        dev.set_memory_kind(kind);
    }
    let t = GpuTensor::zeros(&dev, &[len]).unwrap();
    assert_eq!(t.storage().memory_kind(), kind);
    t
}

struct GpuLegacy;
impl Kind for GpuLegacy {
    type S = cuda_mp::GpuStorage;
    fn make(len: usize) -> GpuTensor<f32> {
        gpu_tensor(len, GpuMemoryKind::Legacy, false)
    }
}

struct GpuPooled;
impl Kind for GpuPooled {
    type S = cuda_mp::GpuStorage;
    fn make(len: usize) -> GpuTensor<f32> {
        gpu_tensor(len, GpuMemoryKind::Legacy, true)
    }
}

struct GpuVmm;
impl Kind for GpuVmm {
    type S = cuda_mp::GpuStorage;
    fn make(len: usize) -> GpuTensor<f32> {
        gpu_tensor(len, GpuMemoryKind::Vmm, false)
    }
}

struct GpuVmmPooled;
impl Kind for GpuVmmPooled {
    type S = cuda_mp::GpuStorage;
    fn make(len: usize) -> GpuTensor<f32> {
        gpu_tensor(len, GpuMemoryKind::Vmm, true)
    }
}

#[derive(Debug, Serialize, Deserialize)]
enum Cmd {
    /// Keep only the tensors at these positions.
    Keep(Vec<usize>),
    /// Send the tensors on, then drop them.
    Forward,
    Drop,
}

type Msg<S> = Vec<Tensor<f32, S>>;

/// Receives a message of tensors, says how many, then follows commands.
#[allow(clippy::type_complexity)]
fn holder<S>((rx, cmd, reply, next): (Receiver<Msg<S>>, Receiver<Cmd>, Sender<usize>, Option<Sender<Msg<S>>>))
where
    Tensor<f32, S>: Serialize + DeserializeOwned,
{
    let mut held = rx.recv().unwrap();
    reply.send(held.len()).unwrap();
    while let Ok(c) = cmd.recv() {
        match c {
            Cmd::Keep(keep) => {
                held = held.into_iter().enumerate().filter(|(i, _)| keep.contains(i)).map(|(_, t)| t).collect();
            }
            Cmd::Forward => {
                next.as_ref().unwrap().send(std::mem::take(&mut held)).unwrap();
            }
            Cmd::Drop => held.clear(),
        }
        reply.send(held.len()).unwrap();
    }
}

type Child<S> = (Sender<Msg<S>>, Sender<Cmd>, Receiver<usize>, cuda_mp::JoinHandle<()>);

fn start<S>(next: Option<Sender<Msg<S>>>) -> Child<S>
where
    Tensor<f32, S>: Serialize + DeserializeOwned,
{
    let (tx, rx) = channel().unwrap();
    let (cmd_tx, cmd_rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let child = spawn((rx, cmd_rx, reply_tx, next), holder::<S>);
    (tx, cmd_tx, reply_rx, child)
}

fn ask<S>(c: &Child<S>, cmd: Cmd) -> usize {
    c.1.send(cmd).unwrap();
    c.2.recv_timeout(WAIT).unwrap()
}

/// Every storage released and freed (the channels' leases may still be open).
fn settled(before: cuda_mp::LifetimeStats) -> cuda_mp::LifetimeStats {
    wait_for_lifetime(WAIT, |s| {
        s.live_storages == before.live_storages
            && s.exported_storages == before.exported_storages
            && s.offered_descriptors == before.offered_descriptors
    })
    .expect("every storage released and freed")
}

/// Every lease closed: the receivers of the channels that carried storages are gone.
fn closed(before: cuda_mp::LifetimeStats) {
    wait_for_lifetime(WAIT, |s| s.outstanding_leases == before.outstanding_leases)
        .expect("a connection's lease outlived its receiver");
}

/// The producer drops its tensors at once; the consumer keeps one of three; the other two are
/// freed then, the last when the consumer drops it.
fn a_kept_tensor_pins_only_its_own_storage<K: Kind>()
where
    Tensor<f32, K::S>: Serialize + DeserializeOwned,
{
    let _g = serial();
    let before = lifetime_stats();
    let c = start::<K::S>(None);
    c.0.send((0..3).map(|_| K::make(64)).collect()).unwrap();
    assert_eq!(c.2.recv_timeout(WAIT).unwrap(), 3);
    assert_eq!(lifetime_stats().live_storages, before.live_storages + 3, "limbo keeps all three");
    assert_eq!(ask(&c, Cmd::Keep(vec![1])), 1);
    wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages + 1).expect("the two dropped ones are freed");
    assert_eq!(ask(&c, Cmd::Drop), 0);
    settled(before);
    drop(c.1);
    c.3.join().unwrap();
    closed(before);
}

/// A consumer killed while holding tensors releases them all at once.
fn a_sigkilled_holder_is_reclaimed<K: Kind>()
where
    Tensor<f32, K::S>: Serialize + DeserializeOwned,
{
    let _g = serial();
    let before = lifetime_stats();
    let mut c = start::<K::S>(None);
    c.0.send((0..5).map(|_| K::make(16)).collect()).unwrap();
    assert_eq!(c.2.recv_timeout(WAIT).unwrap(), 5);
    c.3.kill().unwrap();
    settled(before);
    closed(before);
}

/// Makes its exit slow, then holds the tensors it receives until it is killed: a memory file
/// of 1 GiB whose pages the kernel frees as the process's descriptors close at its exit, after
/// those of higher numbers (the channel's lease among them), as a CUDA driver's descriptors
/// opened early stop the GPU work the process queued only then.
fn hold_with_a_slow_exit<S>((rx, reply): (Receiver<Msg<S>>, Sender<usize>))
where
    Tensor<f32, S>: Serialize + DeserializeOwned,
{
    use std::io::Write;
    let memfd = rustix::fs::memfd_create("cuda-mp-test-slow-exit", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let mut file = std::fs::File::from(memfd);
    let chunk = vec![1u8; 1 << 20];
    (0..1024).for_each(|_| file.write_all(&chunk).unwrap());
    // Copies in every free descriptor number below those to come: the lease that arrives
    // lies above the file's last copy, and closes before it.
    let copies: Vec<_> = (0..64).map(|_| file.try_clone().unwrap()).collect();
    let held = rx.recv().unwrap();
    reply.send(held.len()).unwrap();
    std::thread::sleep(WAIT * 2);
    drop((held, file, copies));
}

/// Whether the process of `pidfd` has exited (every thread of it: a main thread that ended
/// first shows as a zombie while the others run).
fn exited(pidfd: &std::os::fd::OwnedFd) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    poll(&mut fds, Some(&Timespec { tv_sec: 0, tv_nsec: 0 })).unwrap() == 1
}

/// A holder killed while it holds tensors, whose exit takes a while once its descriptors
/// (its lease among them) have closed: what it held is freed only once it has exited (until
/// then GPU work it queued may still write to the memory).
fn a_killed_holder_is_reclaimed_only_once_it_has_exited<K: Kind>()
where
    Tensor<f32, K::S>: Serialize + DeserializeOwned,
{
    let _g = serial();
    let before = lifetime_stats();
    let (tx, rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let mut child = spawn((rx, reply_tx), hold_with_a_slow_exit::<K::S>);
    tx.send((0..5).map(|_| K::make(16)).collect()).unwrap();
    assert_eq!(reply_rx.recv_timeout(WAIT).unwrap(), 5);
    // A SIGKILL that does not reap the child, as `kill()` does: its exit is watched here.
    let pid = rustix::process::Pid::from_raw(child.pid().unwrap() as i32).unwrap();
    let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
    wait_for_lifetime(WAIT, |s| {
        s.live_storages == before.live_storages && s.exported_storages == before.exported_storages
    })
    .expect("what the killed holder held is freed");
    assert!(exited(&pidfd), "freed while the killed holder was still exiting");
    child.kill().unwrap();
    settled(before);
    closed(before);
}

/// Starts holders A and B, sends two storages to A, which forwards both to B: gives (A, B).
fn forward_two<K: Kind>() -> (Child<K::S>, Child<K::S>)
where
    Tensor<f32, K::S>: Serialize + DeserializeOwned,
{
    let b = start::<K::S>(None);
    let a = start::<K::S>(Some(b.0.clone()));
    a.0.send(vec![K::make(8), K::make(8)]).unwrap();
    assert_eq!(a.2.recv_timeout(WAIT).unwrap(), 2);
    assert_eq!(ask(&a, Cmd::Forward), 0);
    assert_eq!(b.2.recv_timeout(WAIT).unwrap(), 2, "B got both");
    (a, b)
}

/// Parent -> A -> B: A forwards and drops; the memory lives until B drops it.
fn a_forwarded_storage_lives_until_the_last_holder_drops_it<K: Kind>()
where
    Tensor<f32, K::S>: Serialize + DeserializeOwned,
{
    let _g = serial();
    let before = lifetime_stats();
    let (a, b) = forward_two::<K>();
    drop(a.1);
    a.3.join().unwrap();
    assert_eq!(lifetime_stats().live_storages, before.live_storages + 2, "B still holds both after A exited");
    assert_eq!(ask(&b, Cmd::Drop), 0);
    settled(before);
    drop(b.1);
    b.3.join().unwrap();
    closed(before);
}

/// Parent -> A -> B, then A is killed: B's copies of the leases up the chain keep the claims
/// A held for it counted, so the memory lives until B drops it.
fn a_forwarded_storage_outlives_its_killed_forwarder<K: Kind>()
where
    Tensor<f32, K::S>: Serialize + DeserializeOwned,
{
    let _g = serial();
    let before = lifetime_stats();
    let (mut a, b) = forward_two::<K>();
    a.3.kill().unwrap();
    // A is gone (it held the only sender of its replies); a wrong release would come now.
    assert!(a.2.recv_timeout(WAIT).unwrap_err().is_disconnected());
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(lifetime_stats().live_storages, before.live_storages + 2, "B still holds both after A was killed");
    assert_eq!(ask(&b, Cmd::Drop), 0);
    settled(before);
    drop(b.1);
    b.3.join().unwrap();
    closed(before);
}

/// B of the test below: drops a first message that comes on `second` (a block of the same
/// segment, for the caching allocators: the segment is then introduced on `second`), forwards
/// what comes on `first` to C and drops it; on a word, forwards what comes on `second` to D and
/// drops it; then waits to be killed.
#[allow(clippy::type_complexity)]
fn forward_twice<S>(
    (first, second, to_c, to_d, go, done): (
        Receiver<Msg<S>>,
        Receiver<Msg<S>>,
        Sender<Msg<S>>,
        Sender<Msg<S>>,
        Receiver<()>,
        Sender<()>,
    ),
) where
    Tensor<f32, S>: Serialize + DeserializeOwned,
{
    drop(second.recv().unwrap());
    to_c.send(first.recv().unwrap()).unwrap();
    done.send(()).unwrap();
    go.recv().unwrap();
    to_d.send(second.recv().unwrap()).unwrap();
    done.send(()).unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

/// Parent -> B -> C on one channel, then the same storage Parent -> B -> D on another, B
/// having dropped it in between, then B is killed: B's relay of the storage (its own claim,
/// counted on the lease of the first channel) is used again for D, and D's copies of the
/// leases up the chain must be the ones that claim stands on. They were those of B's second
/// mapping: once C let go, B's death freed the storage while D held it (host memory; a block
/// of the caching allocator was handed out again).
fn a_relay_used_again_after_its_forwarder_took_the_storage_again_outlives_the_forwarder<K: Kind>()
where
    Tensor<f32, K::S>: Serialize + DeserializeOwned,
{
    let _g = serial();
    let before = lifetime_stats();
    let c = start::<K::S>(None);
    let d = start::<K::S>(None);
    let (first_tx, first_rx) = channel().unwrap();
    let (second_tx, second_rx) = channel().unwrap();
    let (go_tx, go_rx) = channel().unwrap();
    let (done_tx, done_rx) = channel().unwrap();
    let mut b = spawn((first_rx, second_rx, c.0.clone(), d.0.clone(), go_rx, done_tx), forward_twice::<K::S>);
    let (x, y) = (K::make(64), K::make(64));
    second_tx.send(vec![y]).unwrap();
    first_tx.send(vec![x.clone()]).unwrap();
    done_rx.recv_timeout(WAIT).unwrap();
    assert_eq!(c.2.recv_timeout(WAIT).unwrap(), 1, "C holds it");
    // B's first mapping goes (its relay's claim stays), then it takes the storage again.
    std::thread::sleep(Duration::from_millis(200));
    second_tx.send(vec![x.clone()]).unwrap();
    go_tx.send(()).unwrap();
    done_rx.recv_timeout(WAIT).unwrap();
    assert_eq!(d.2.recv_timeout(WAIT).unwrap(), 1, "D holds it");
    assert_eq!(ask(&c, Cmd::Drop), 0);
    drop(x);
    wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages + 1).expect("D's alone is left");
    b.kill().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(lifetime_stats().live_storages, before.live_storages + 1, "freed while D holds it, once B was killed");
    assert_eq!(ask(&d, Cmd::Drop), 0);
    settled(before);
    drop((c.1, d.1, first_tx, second_tx));
    c.3.join().unwrap();
    d.3.join().unwrap();
    closed(before);
}

/// Parent -> A -> B while A lives on (holding the channel the storages came on, as a queue's
/// dispatcher does): the storages are freed when B drops them, not when A exits.
fn a_storage_forwarded_by_a_live_process_is_freed_at_the_last_drop<K: Kind>()
where
    Tensor<f32, K::S>: Serialize + DeserializeOwned,
{
    let _g = serial();
    let before = lifetime_stats();
    let (a, b) = forward_two::<K>();
    assert_eq!(ask(&b, Cmd::Drop), 0);
    settled(before);
    drop((a.1, b.1));
    a.3.join().unwrap();
    b.3.join().unwrap();
    closed(before);
}

/// Parent -> A -> B while A lives on, holding both channels (as a queue's dispatcher does);
/// B is killed holding what A forwarded: the storages are freed then, not when A ends.
fn a_forwarded_storage_whose_new_holder_is_killed_is_freed_at_once<K: Kind>()
where
    Tensor<f32, K::S>: Serialize + DeserializeOwned,
{
    let _g = serial();
    let before = lifetime_stats();
    let (a, mut b) = forward_two::<K>();
    b.3.kill().unwrap();
    settled(before);
    drop(a.1);
    a.3.join().unwrap();
    closed(before);
}

/// Holds the tensors of its spawn argument, says how many, and waits to be killed.
fn hold_argument<S>((held, reply): (Msg<S>, Sender<usize>))
where
    Tensor<f32, S>: Serialize + DeserializeOwned,
{
    reply.send(held.len()).unwrap();
    std::thread::sleep(WAIT * 2);
}

/// How a forwarder passes on, outside channels, tensors it received on a channel.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
enum PassOn {
    /// As a child's spawn argument; the child is killed once it holds them.
    SpawnArgument,
    /// As a pool call's argument; the pool is terminated once its worker holds them.
    PoolCall,
    /// As bytes (`to_bytes`) that nobody decodes, living 500 ms.
    BytesNeverDecoded,
}

/// Receives tensors on a channel, passes them on as `how` says, drops its own, says so (how
/// many the new holder held, or how many bytes it encoded), and keeps the channel they came on
/// (as a long-lived worker does) until told to end.
#[allow(clippy::type_complexity)]
fn pass_on_outside_channels<S: Send + Sync + 'static>(
    (rx, reply, end, how): (Receiver<Msg<S>>, Sender<usize>, Receiver<()>, PassOn),
) where
    Tensor<f32, S>: Serialize + DeserializeOwned,
{
    let held = rx.recv().unwrap();
    let n = match how {
        PassOn::SpawnArgument => {
            let (child_reply, child_held) = channel().unwrap();
            let mut child = spawn((held.clone(), child_reply), hold_argument::<S>);
            let n = child_held.recv_timeout(WAIT).unwrap();
            child.kill().unwrap();
            n
        }
        PassOn::PoolCall => {
            let pool = cuda_mp::Pool::new(1).unwrap();
            let (worker_reply, worker_held) = channel().unwrap();
            let _call = pool.apply_async((held.clone(), worker_reply), hold_argument::<S>);
            let n = worker_held.recv_timeout(WAIT).unwrap();
            pool.terminate();
            n
        }
        PassOn::BytesNeverDecoded => cuda_mp::to_bytes(&held, Duration::from_millis(500)).unwrap().len(),
    };
    drop(held);
    reply.send(n).unwrap();
    let _ = end.recv_timeout(WAIT * 2);
}

/// Parent -> A on a channel, A passes the storages on outside channels (`how`), and their new
/// holder goes (killed, its pool terminated, or the bytes' time to live ended) while A lives
/// on holding the channel: the storages are freed then, not when A ends.
fn passed_on_outside_channels_is_freed_when_its_holder_goes<K: Kind>(how: PassOn)
where
    Tensor<f32, K::S>: Serialize + DeserializeOwned,
{
    let _g = serial();
    let before = lifetime_stats();
    let (tx, rx) = channel().unwrap();
    let (reply_tx, reply) = channel().unwrap();
    let (end, end_rx) = channel().unwrap();
    let a = spawn((rx, reply_tx, end_rx, how), pass_on_outside_channels::<K::S>);
    tx.send(vec![K::make(8), K::make(8)]).unwrap();
    let n = reply.recv_timeout(WAIT).unwrap();
    match how {
        PassOn::SpawnArgument => assert_eq!(n, 2, "B held both"),
        PassOn::PoolCall => assert_eq!(n, 2, "the worker held both"),
        PassOn::BytesNeverDecoded => assert!(n > 0, "A encoded them"),
    }
    settled(before);
    end.send(()).unwrap();
    drop(tx);
    a.join().unwrap();
    closed(before);
}

/// A message with more tensors than one transport message can carry descriptors for.
fn many_tensors_cross_in_one_message<K: Kind>(n: usize)
where
    Tensor<f32, K::S>: Serialize + DeserializeOwned,
{
    let _g = serial();
    let before = lifetime_stats();
    let c = start::<K::S>(None);
    c.0.send((0..n).map(|_| K::make(4)).collect()).unwrap();
    assert_eq!(c.2.recv_timeout(WAIT).unwrap(), n);
    assert_eq!(ask(&c, Cmd::Keep(vec![0, n - 1])), 2);
    wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages + 2).expect("all but two freed");
    assert_eq!(ask(&c, Cmd::Drop), 0);
    settled(before);
    drop(c.1);
    c.3.join().unwrap();
    closed(before);
}

/// A message that comes back to its owner hands back the very storage, and releases its claim.
fn a_message_back_to_the_owner_is_the_same_storage<K: Kind>()
where
    Tensor<f32, K::S>: Serialize + DeserializeOwned,
{
    let _g = serial();
    let before = lifetime_stats();
    let (tx, rx) = channel::<Msg<K::S>>().unwrap();
    let t = K::make(12);
    tx.send(vec![t.clone(), t.reshape(&[3, 4]).unwrap()]).unwrap();
    let back = rx.recv().unwrap();
    assert!(back[0].shares_storage_with(&t) && back[1].shares_storage_with(&t));
    assert_eq!(back[1].shape(), &[3, 4]);
    drop((t, back));
    settled(before);
    drop(rx);
    closed(before);
}

/// Serializing a tensor anywhere but in a cuda-mp channel is an error and changes nothing.
fn other_serializers_are_refused<K: Kind>()
where
    Tensor<f32, K::S>: Serialize + DeserializeOwned,
{
    let _g = serial();
    let before = lifetime_stats();
    let t = K::make(4);
    let err = serde_json::to_string(&t).unwrap_err().to_string();
    assert!(err.contains("only through cuda-mp channels"), "{err}");
    assert_eq!(lifetime_stats().exported_storages, before.exported_storages);
    assert_eq!(lifetime_stats().leases_granted, before.leases_granted);
    drop(t);
    // The process can still spawn and send.
    let c = start::<K::S>(None);
    c.0.send(vec![K::make(4)]).unwrap();
    assert_eq!(c.2.recv_timeout(WAIT).unwrap(), 1);
    drop(c.1);
    c.3.join().unwrap();
    settled(before);
}

fn hand_back<S>(v: Msg<S>) -> Msg<S> {
    v
}

/// Spawn arguments and results carry tensors too, in a process of its own and in a pool.
fn spawn_arguments_and_results_carry_tensors<K: Kind>()
where
    Tensor<f32, K::S>: Serialize + DeserializeOwned,
{
    let _g = serial();
    let before = lifetime_stats();
    // Results travel in procspawn's own message: up to 32 descriptors of ours fit (see the docs).
    let sent: Msg<K::S> = (0..25).map(|_| K::make(8)).collect();
    let back = spawn(sent.clone(), hand_back::<K::S>).join().unwrap();
    assert_eq!(back.len(), 25);
    assert!(back.iter().zip(&sent).all(|(a, b)| a.shares_storage_with(b)), "the same storages came back");
    let pool = cuda_mp::Pool::new(2).unwrap();
    let back2 = pool.spawn(sent[..3].to_vec(), hand_back::<K::S>).join().unwrap();
    assert!(back2[2].shares_storage_with(&sent[2]));
    pool.shutdown();
    drop((sent, back, back2));
    settled(before);
    closed(before);
}

/// Receives `n` messages, dropping each, then says how many; then keeps the next one until
/// killed.
fn drop_n<S>((rx, reply, n): (Receiver<Tensor<f32, S>>, Sender<usize>, usize))
where
    Tensor<f32, S>: Serialize + DeserializeOwned,
{
    let mut seen = 0;
    while seen < n && rx.recv_timeout(WAIT).is_ok() {
        seen += 1;
    }
    reply.send(seen).unwrap();
    let _kept = rx.recv_timeout(WAIT);
    let _ = rx.recv_timeout(WAIT);
}

/// Every message of a connection counts its claims on one lease: sending the same storage and
/// fresh ones many times grants one lease, and a consumer killed afterwards releases them all.
fn one_lease_per_connection<K: Kind>()
where
    Tensor<f32, K::S>: Serialize + DeserializeOwned,
{
    let _g = serial();
    let before = lifetime_stats();
    let (tx, rx) = channel().unwrap();
    let (reply_tx, reply) = channel().unwrap();
    let mut child = spawn((rx, reply_tx, 200usize), drop_n::<K::S>);
    let kept = K::make(16);
    for i in 0..200 {
        let t = if i % 2 == 0 { kept.clone() } else { K::make(16) };
        tx.send(t).unwrap();
    }
    assert_eq!(reply.recv_timeout(WAIT).unwrap(), 200);
    let s = lifetime_stats();
    assert_eq!(s.leases_granted - before.leases_granted, 1, "200 messages on one connection");
    assert_eq!(s.outstanding_leases, before.outstanding_leases + 1);
    drop(kept);
    settled(before);
    // The receiver still holds the channel, and with it the lease: one more message uses it,
    // and the consumer keeps that one until it is killed.
    let last = K::make(16);
    tx.send(last.clone()).unwrap();
    drop(last);
    wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages + 1).expect("kept by the consumer");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(lifetime_stats().live_storages, before.live_storages + 1, "the kept storage was freed");
    child.kill().unwrap();
    settled(before);
    closed(before);
    assert_eq!(lifetime_stats().leases_granted - before.leases_granted, 1);
}

/// A receiver that moves to another process takes the connection's leases along: a message
/// that names the lease (introduced by an earlier message, received here) decodes there.
fn a_receiver_moved_to_another_process_keeps_its_connection_leases<K: Kind>()
where
    Tensor<f32, K::S>: Serialize + DeserializeOwned,
{
    let _g = serial();
    let before = lifetime_stats();
    let (tx, rx) = channel::<Tensor<f32, K::S>>().unwrap();
    let (first, second) = (K::make(4), K::make(4));
    tx.send(first.clone()).unwrap();
    drop(rx.recv_timeout(WAIT).unwrap());
    // Names the lease the first message introduced; waits on the socket while `rx` moves.
    tx.send(second.clone()).unwrap();
    let (reply_tx, reply) = channel().unwrap();
    let child = spawn((rx, reply_tx), |(rx, reply): (Receiver<Tensor<f32, K::S>>, Sender<Vec<usize>>)| {
        let t = rx.recv_timeout(WAIT).unwrap();
        reply.send(t.shape().to_vec()).unwrap();
    });
    assert_eq!(reply.recv_timeout(WAIT).unwrap(), vec![4]);
    child.join().unwrap();
    drop((first, second));
    settled(before);
    closed(before);
}

/// Receives tensors, keeping every third (dropping the rest), and says how many it received
/// after each; until killed.
fn keep_some<S>((rx, progress): (Receiver<Tensor<f32, S>>, Sender<usize>))
where
    Tensor<f32, S>: Serialize + DeserializeOwned,
{
    let mut kept = Vec::new();
    let mut seen = 0;
    while let Ok(t) = rx.recv() {
        seen += 1;
        if seen % 3 == 0 {
            kept.push(t);
        }
        if progress.send(seen).is_err() {
            break;
        }
    }
}

/// A consumer killed at any point of a stream (messages in flight on its channel, some of its
/// tensors kept, mappings cached, a connection lease introduced or not yet) leaves nothing
/// claimed and no lease open.
fn a_consumer_killed_at_any_point_of_a_stream_leaves_nothing_behind<K: Kind>()
where
    Tensor<f32, K::S>: Serialize + DeserializeOwned,
{
    let _g = serial();
    let before = lifetime_stats();
    let resent: Vec<Tensor<f32, K::S>> = (0..4).map(|_| K::make(8)).collect();
    for kill_after in [0usize, 1, 7, 60] {
        let (tx, rx) = channel().unwrap();
        let (progress_tx, progress) = channel().unwrap();
        let mut child = spawn((rx, progress_tx), keep_some::<K::S>);
        let mut seen = 0;
        for i in 0..120usize {
            // Fresh and resent storages alike.
            let t = if i % 2 == 0 { K::make(8) } else { resent[i % resent.len()].clone() };
            if tx.send(t).is_err() {
                break;
            }
            if seen < kill_after {
                seen = progress.recv_timeout(WAIT).unwrap();
            }
            if i == kill_after {
                child.kill().unwrap();
            }
        }
        drop(tx);
    }
    drop(resent);
    settled(before);
    closed(before);
}

macro_rules! suite {
    ($module:ident, $kind:ty, $many:expr $(, #[$attr:meta])?) => {
        mod $module {
            use super::*;

            #[test]
            $(#[$attr])?
            fn a_kept_tensor_pins_only_its_own_storage() {
                super::a_kept_tensor_pins_only_its_own_storage::<$kind>();
            }

            #[test]
            $(#[$attr])?
            fn a_sigkilled_holder_is_reclaimed() {
                super::a_sigkilled_holder_is_reclaimed::<$kind>();
            }

            #[test]
            $(#[$attr])?
            fn a_killed_holder_is_reclaimed_only_once_it_has_exited() {
                super::a_killed_holder_is_reclaimed_only_once_it_has_exited::<$kind>();
            }

            #[test]
            $(#[$attr])?
            fn a_forwarded_storage_lives_until_the_last_holder_drops_it() {
                super::a_forwarded_storage_lives_until_the_last_holder_drops_it::<$kind>();
            }

            #[test]
            $(#[$attr])?
            fn a_relay_used_again_after_its_forwarder_took_the_storage_again_outlives_the_forwarder() {
                super::a_relay_used_again_after_its_forwarder_took_the_storage_again_outlives_the_forwarder::<$kind>();
            }

            #[test]
            $(#[$attr])?
            fn a_storage_forwarded_by_a_live_process_is_freed_at_the_last_drop() {
                super::a_storage_forwarded_by_a_live_process_is_freed_at_the_last_drop::<$kind>();
            }

            #[test]
            $(#[$attr])?
            fn a_forwarded_storage_outlives_its_killed_forwarder() {
                super::a_forwarded_storage_outlives_its_killed_forwarder::<$kind>();
            }

            #[test]
            $(#[$attr])?
            fn a_forwarded_storage_whose_new_holder_is_killed_is_freed_at_once() {
                super::a_forwarded_storage_whose_new_holder_is_killed_is_freed_at_once::<$kind>();
            }

            #[test]
            $(#[$attr])?
            fn a_spawn_argument_forwarded_from_a_channel_is_freed_when_its_holder_is_killed() {
                super::passed_on_outside_channels_is_freed_when_its_holder_goes::<$kind>(PassOn::SpawnArgument);
            }

            #[test]
            $(#[$attr])?
            fn a_pool_call_forwarded_from_a_channel_is_freed_when_its_worker_is_terminated() {
                super::passed_on_outside_channels_is_freed_when_its_holder_goes::<$kind>(PassOn::PoolCall);
            }

            #[test]
            $(#[$attr])?
            fn bytes_forwarded_from_a_channel_and_never_decoded_free_their_storages() {
                super::passed_on_outside_channels_is_freed_when_its_holder_goes::<$kind>(PassOn::BytesNeverDecoded);
            }

            #[test]
            $(#[$attr])?
            fn many_tensors_cross_in_one_message() {
                super::many_tensors_cross_in_one_message::<$kind>($many);
            }

            #[test]
            $(#[$attr])?
            fn a_message_back_to_the_owner_is_the_same_storage() {
                super::a_message_back_to_the_owner_is_the_same_storage::<$kind>();
            }

            #[test]
            $(#[$attr])?
            fn spawn_arguments_and_results_carry_tensors() {
                super::spawn_arguments_and_results_carry_tensors::<$kind>();
            }

            #[test]
            $(#[$attr])?
            fn other_serializers_are_refused() {
                super::other_serializers_are_refused::<$kind>();
            }

            #[test]
            $(#[$attr])?
            fn a_consumer_killed_at_any_point_of_a_stream_leaves_nothing_behind() {
                super::a_consumer_killed_at_any_point_of_a_stream_leaves_nothing_behind::<$kind>();
            }

            #[test]
            $(#[$attr])?
            fn one_lease_per_connection() {
                super::one_lease_per_connection::<$kind>();
            }

            #[test]
            $(#[$attr])?
            fn a_receiver_moved_to_another_process_keeps_its_connection_leases() {
                super::a_receiver_moved_to_another_process_keeps_its_connection_leases::<$kind>();
            }
        }
    };
}

suite!(fake, Fake, 1_000);
suite!(host, Host, 10_000);
suite!(host_pooled, HostPooled, 10_000);
suite!(gpu_legacy, GpuLegacy, 1_000, #[ignore = "needs a CUDA GPU"]);
suite!(gpu_pooled, GpuPooled, 1_000, #[ignore = "needs a CUDA GPU"]);
suite!(gpu_vmm, GpuVmm, 1_000, #[ignore = "needs a CUDA GPU"]);
suite!(gpu_vmm_pooled, GpuVmmPooled, 1_000, #[ignore = "needs a CUDA GPU"]);

/// Sends one fake storage whose mapping takes `delay_ms`, then waits to be killed.
fn send_slow((tx, delay_ms): (Sender<FakeTensor<f32>>, u64)) {
    tx.send(FakeTensor::fake(&[1], Duration::from_millis(delay_ms)).unwrap()).unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn a_send_is_not_held_up_by_an_import_opening_meanwhile() {
    let _g = serial();
    let (tx, rx) = channel::<FakeTensor<f32>>().unwrap();
    let mut child = spawn((tx, 1500), send_slow);
    let sender = std::thread::spawn(|| {
        // Once the import below is opening:
        std::thread::sleep(Duration::from_millis(500));
        let (tx, rx) = channel::<HostTensor<u8>>().unwrap();
        let s = Instant::now();
        tx.send(HostTensor::zeros(&[16]).unwrap()).unwrap();
        let _ = lifetime_stats();
        let took = s.elapsed();
        drop(rx.recv().unwrap());
        took
    });
    let t = Instant::now();
    let slow = rx.recv_timeout(WAIT).unwrap();
    assert!(t.elapsed() >= Duration::from_millis(1400), "the open took its time");
    let took = sender.join().unwrap();
    assert!(took < Duration::from_millis(300), "a send waited for another thread's open: {took:?}");
    drop(slow);
    child.kill().unwrap();
}

/// Two messages received in two threads open their storages at the same time.
fn send_two((a, b, delay_ms): (Sender<FakeTensor<f32>>, Sender<FakeTensor<f32>>, u64)) {
    let delay = Duration::from_millis(delay_ms);
    a.send(FakeTensor::fake(&[1], delay).unwrap()).unwrap();
    b.send(FakeTensor::fake(&[1], delay).unwrap()).unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn two_threads_import_different_storages_in_parallel() {
    let _g = serial();
    let (a_tx, a_rx) = channel::<FakeTensor<f32>>().unwrap();
    let (b_tx, b_rx) = channel::<FakeTensor<f32>>().unwrap();
    let mut child = spawn((a_tx, b_tx, 800), send_two);
    let t = Instant::now();
    let other = std::thread::spawn(move || b_rx.recv_timeout(WAIT).unwrap());
    let a = a_rx.recv_timeout(WAIT).unwrap();
    let b = other.join().unwrap();
    let took = t.elapsed();
    assert!(took < Duration::from_millis(1500), "the two opens ran one after the other: {took:?}");
    assert_ne!(a.storage_id(), b.storage_id());
    child.kill().unwrap();
}

/// A resent fake storage is mapped once and kept cached until its owner drops it.
fn resend((tx, go): (Sender<FakeTensor<f32>>, Receiver<()>)) {
    let t = FakeTensor::fake(&[4], Duration::ZERO).unwrap();
    tx.send(t.clone()).unwrap();
    go.recv().unwrap();
    tx.send(t.clone()).unwrap();
    go.recv().unwrap();
    drop(t);
    go.recv().unwrap();
}

#[test]
fn a_resent_storage_is_mapped_once_and_unmapped_when_its_owner_drops_it() {
    let _g = serial();
    let (tx, rx) = channel().unwrap();
    let (go_tx, go_rx) = channel().unwrap();
    let child = spawn((tx, go_rx), resend);
    let before = lifetime_stats();
    let closed = fake_mappings_closed();
    let first = rx.recv_timeout(WAIT).unwrap();
    drop(first);
    wait_for_lifetime(WAIT, |s| s.cached_mappings == before.cached_mappings + 1).expect("kept cached");
    go_tx.send(()).unwrap();
    let second = rx.recv_timeout(WAIT).unwrap();
    assert_eq!(lifetime_stats().opened_mappings, before.opened_mappings + 1, "mapped once");
    drop(second);
    go_tx.send(()).unwrap();
    wait_for_lifetime(WAIT, |s| s.cached_mappings == before.cached_mappings)
        .expect("revoked when the owner dropped it");
    assert_eq!(fake_mappings_closed(), closed + 1);
    go_tx.send(()).unwrap();
    child.join().unwrap();
}

/// Receives a fake tensor, "queues work" on it that runs 800 ms, drops it and says how long
/// the drop took; exits when told (an exit would close its lease, releasing everything).
fn drop_while_busy((rx, reply, go): (Receiver<FakeTensor<f32>>, Sender<Duration>, Receiver<()>)) {
    let t = rx.recv().unwrap();
    t.queue_work(Duration::from_millis(800));
    let start = Instant::now();
    drop(t);
    reply.send(start.elapsed()).unwrap();
    let _ = go.recv();
}

#[test]
fn a_mappings_release_waits_for_the_work_queued_on_it_and_its_drop_does_not() {
    let _g = serial();
    let before = lifetime_stats();
    let (tx, rx) = channel().unwrap();
    let (reply_tx, reply) = channel().unwrap();
    let (go, go_rx) = channel().unwrap();
    let child = spawn((rx, reply_tx, go_rx), drop_while_busy);
    tx.send(FakeTensor::<f32>::fake(&[4], Duration::ZERO).unwrap()).unwrap(); // our handle goes with it
    let took = reply.recv_timeout(WAIT).unwrap();
    let replied = Instant::now();
    assert!(took < Duration::from_millis(300), "the drop waited for the work: {took:?}");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        lifetime_stats().exported_storages,
        before.exported_storages + 1,
        "the claim was released before the work queued on the mapping was done"
    );
    wait_for_lifetime(WAIT, |s| s.exported_storages == before.exported_storages).expect("released after the work");
    assert!(replied.elapsed() >= Duration::from_millis(400), "released {:?} after the drop", replied.elapsed());
    go.send(()).unwrap();
    child.join().unwrap();
    settled(before);
}

/// Receives a fake tensor to keep (by then its owner's liveness table is here), then one to
/// "queue work" on that runs 800 ms; drops it and returns at once.
fn drop_busy_and_exit(rx: Receiver<FakeTensor<f32>>) {
    let _kept = rx.recv().unwrap();
    let t = rx.recv().unwrap();
    t.queue_work(Duration::from_millis(800));
}

#[test]
fn a_process_that_exits_right_after_its_drop_releases_after_the_work_queued_on_it() {
    let _g = serial();
    let before = lifetime_stats();
    let (tx, rx) = channel().unwrap();
    let child = spawn(rx, drop_busy_and_exit);
    let kept = FakeTensor::<f32>::fake(&[4], Duration::ZERO).unwrap();
    tx.send(kept.clone()).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // The exit that follows the release closes the child's lease, which releases the kept
    // tensor too, maybe before the wait below looks: so the second tensor counts as released
    // once at most one of the two is still exported.
    let sent = Instant::now();
    tx.send(FakeTensor::<f32>::fake(&[4], Duration::ZERO).unwrap()).unwrap(); // our handle goes with it
    wait_for_lifetime(WAIT, |s| s.exported_storages <= before.exported_storages + 1).expect("released");
    assert!(sent.elapsed() >= Duration::from_millis(700), "released {:?} after the send", sent.elapsed());
    child.join().unwrap();
    drop(kept);
    settled(before);
}

/// A state dict as torch sends it: many GPU tensors by name in one message.
fn count_state_dict((rx, reply): (Receiver<HashMap<String, GpuTensor<f32>>>, Sender<usize>)) {
    let dict = rx.recv().unwrap();
    reply.send(dict.values().map(|t| t.numel()).sum()).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_state_dict_of_a_thousand_gpu_tensors_crosses_in_one_message() {
    let _g = serial();
    let before = lifetime_stats();
    let dev = Device::get(0).expect("this test needs a CUDA GPU");
    let dict: HashMap<String, GpuTensor<f32>> =
        (0..1000).map(|i| (format!("layer.{i}.weight"), GpuTensor::zeros(&dev, &[i % 7 + 1]).unwrap())).collect();
    let expected: usize = dict.values().map(|t| t.numel()).sum();
    let (tx, rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let child = spawn((rx, reply_tx), count_state_dict);
    tx.send(dict).unwrap();
    assert_eq!(reply_rx.recv_timeout(WAIT).unwrap(), expected);
    child.join().unwrap();
    settled(before);
    closed(before);
}

/// Caches what it receives (drops it while the owner holds it), says how many mappings it
/// caches, and once told reports how many of them revocations closed.
fn cache_and_wait((rx, ready, go): (Receiver<Vec<FakeTensor<f32>>>, Sender<usize>, Receiver<()>)) {
    let closed_before = fake_mappings_closed();
    drop(rx.recv_timeout(WAIT).unwrap());
    ready.send(lifetime_stats().cached_mappings).unwrap();
    go.recv_timeout(Duration::from_secs(120)).unwrap();
    wait_for_lifetime(WAIT, |s| s.cached_mappings == 0).expect("revocations never arrived");
    ready.send((fake_mappings_closed() - closed_before) as usize).unwrap();
}

/// An owner's drops never wait for a subscriber that does not read: revocations to a stopped
/// process wait in this process (coalesced), and reach it once it reads again.
#[test]
fn drops_do_not_wait_for_a_subscriber_that_never_reads() {
    const N: usize = 2_000;
    let _serial = serial();
    let (tx, rx) = channel().unwrap();
    let (ready_tx, ready) = channel().unwrap();
    let (go, go_rx) = channel().unwrap();
    let mut child = spawn((rx, ready_tx, go_rx), cache_and_wait);
    let tensors: Vec<FakeTensor<f32>> = (0..N).map(|_| Fake::make(4)).collect();
    tx.send(tensors.clone()).unwrap();
    assert_eq!(ready.recv_timeout(WAIT).unwrap(), N, "the subscriber caches every mapping");
    let pid = child.pid().unwrap() as libc::pid_t;
    // SAFETY: signals our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let (done_tx, done) = std::sync::mpsc::channel();
    let dropper = std::thread::spawn(move || {
        let started = Instant::now();
        drop(tensors);
        let _ = done_tx.send(started.elapsed());
    });
    let took = done.recv_timeout(Duration::from_secs(5));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let took = took.expect("dropping the owner's tensors waited for a stopped subscriber");
    dropper.join().unwrap();
    go.send(()).unwrap();
    assert_eq!(ready.recv_timeout(WAIT).unwrap(), N, "every revocation reached the subscriber once it read again");
    child.join_timeout(WAIT).unwrap();
    wait_for_lifetime(WAIT, |s| s.exported_storages == 0 && s.outstanding_leases == 0).unwrap();
    eprintln!("{N} drops with a stopped subscriber took {took:?}");
}

/// Drops what it receives, each message as it comes, and the channel it came on (which closes
/// the channel's lease, after the release), and says so.
fn drop_each((fakes, hosts, said): (Receiver<FakeTensor<f32>>, Receiver<HostTensor<f32>>, Sender<()>)) {
    drop(fakes.recv_timeout(WAIT).unwrap());
    drop(fakes);
    said.send(()).unwrap();
    drop(hosts.recv_timeout(WAIT).unwrap());
    drop(hosts);
    said.send(()).unwrap();
}

/// A free that waits (a GPU free waits for the device) does not hold up the reaper: another
/// storage's release is processed meanwhile.
#[test]
fn a_slow_free_does_not_hold_up_other_releases() {
    let _serial = serial();
    let before = lifetime_stats();
    let (fake_tx, fake_rx) = channel().unwrap();
    let (host_tx, host_rx) = channel().unwrap();
    let (said_tx, said) = channel().unwrap();
    let mut child = spawn((fake_rx, host_rx, said_tx), drop_each);
    // Freed when the child drops it (this process drops its handle first): takes 3 s.
    let slow = FakeTensor::<f32>::fake_freed_slowly(&[4], Duration::ZERO, Duration::from_secs(3)).unwrap();
    fake_tx.send(slow).unwrap();
    said.recv_timeout(WAIT).unwrap();
    // The reaper has seen the fake's lease close (so its free is queued first).
    wait_for_lifetime(WAIT, |s| s.leases_released == before.leases_released + 1).unwrap();
    // The slow free is under way. A host storage sent now and dropped by the child is released
    // at once all the same.
    let host = HostTensor::<f32>::zeros(&[4]).unwrap();
    host_tx.send(host.clone()).unwrap();
    drop(host);
    said.recv_timeout(WAIT).unwrap();
    let started = Instant::now();
    // Both leases closed and processed while the slow free still runs (the reaper does not
    // free: frees run in order on a thread of their own).
    let during = wait_for_lifetime(Duration::from_secs(2), |s| {
        s.outstanding_leases == before.outstanding_leases && s.leases_released == before.leases_released + 2
    });
    let during = during.unwrap_or_else(|e| {
        panic!("the host storage's release waited for another storage's free ({e}): {:?}", lifetime_stats())
    });
    assert_eq!(during.freed_storages, before.freed_storages, "the slow free finished first: the test proves nothing");
    let took = started.elapsed();
    child.join_timeout(WAIT).unwrap();
    wait_for_lifetime(WAIT, |s| {
        s.exported_storages == before.exported_storages && s.live_storages == before.live_storages
    })
    .expect("both storages freed");
    eprintln!("the host release took {took:?} while a 3 s free ran");
}

/// A sender that arrives anew with every request (a reply channel's sender, passed with each
/// call) goes on with its process's one lease on the channel: the receiver does not collect a
/// lease per request.
#[test]
fn a_sender_that_comes_with_every_request_uses_one_lease() {
    let _g = serial();
    let before = lifetime_stats();
    let (tx, rx) = channel::<FakeTensor<f32>>().unwrap();
    let (carrier_tx, carrier_rx) = channel::<Sender<FakeTensor<f32>>>().unwrap();
    let mut tx = Some(tx);
    for _ in 0..20 {
        let sender = tx.take().unwrap();
        sender.send(Fake::make(4)).unwrap();
        // Travels, and is dropped here: this process holds no sender of the channel meanwhile.
        carrier_tx.send(sender).unwrap();
        tx = Some(carrier_rx.recv_timeout(WAIT).unwrap());
        drop(rx.recv_timeout(WAIT).unwrap());
    }
    let granted = lifetime_stats().leases_granted - before.leases_granted;
    assert_eq!(granted, 1, "20 requests made {granted} leases on one channel");
    drop((tx, rx));
    settled(before);
    closed(before);
}
