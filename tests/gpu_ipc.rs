//! GPU tensors over CUDA IPC, across real processes. These need a CUDA GPU: they are ignored by
//! a plain `cargo test` and fail with a clear message when run where no GPU is usable.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cuda_mp::{
    Builder, Device, GpuTensor, Receiver, RecvError, Sender, bf16, channel, lifetime_stats, spawn, wait_for_lifetime,
};
use serde::{Deserialize, Serialize};

mod common;

cuda_mp::enable_test_support!();

static SERIAL: Mutex<()> = Mutex::new(());
const WAIT: Duration = Duration::from_secs(60);

fn serial() -> std::sync::MutexGuard<'static, ()> {
    common::serial(&SERIAL, WAIT)
}

use common::{free_memory, gpu, shm_entries};
use cuda_mp::testing::CarriedFile;

#[derive(Serialize, Deserialize, Debug)]
enum Cmd {
    Read,
    Drop,
}

fn add_one_then_read((rx, reply, go): (Receiver<GpuTensor<f32>>, Sender<Vec<f32>>, Receiver<()>)) {
    let t = rx.recv().unwrap();
    t.add_scalar(1.0).unwrap();
    t.synchronize().unwrap();
    reply.send(t.to_vec().unwrap()).unwrap();
    go.recv().unwrap();
    reply.send(t.to_vec().unwrap()).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn contiguous_handoff_with_writes_in_both_directions() {
    let _g = serial();
    let dev = gpu();
    let (tx, rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let (go_tx, go_rx) = channel().unwrap();
    let child = spawn((rx, reply_tx, go_rx), add_one_then_read);
    let data: Vec<f32> = (0..20).map(|x| x as f32 * 0.5).collect();
    let t = GpuTensor::from_vec(&dev, &[4, 5], data.clone()).unwrap();
    tx.send(t.clone()).unwrap();
    let seen: Vec<f32> = reply_rx.recv_timeout(WAIT).unwrap();
    let plus_one: Vec<f32> = data.iter().map(|x| x + 1.0).collect();
    assert_eq!(seen, plus_one, "the child saw the parent's data and added one");
    assert_eq!(t.to_vec().unwrap(), plus_one, "the child's write is visible here");
    t.add_scalar(10.0).unwrap();
    t.synchronize().unwrap();
    go_tx.send(()).unwrap();
    let plus_eleven: Vec<f32> = data.iter().map(|x| x + 11.0).collect();
    assert_eq!(reply_rx.recv_timeout(WAIT).unwrap(), plus_eleven, "the parent's write is visible there");
    child.join().unwrap();
}

/// Sends a tensor with work queued on it (which records this process's event and registers
/// the exit hook that removes the event's file), then runs `before_exit`, then sends another
/// with 20 kernels still queued on it.
fn send_around_before_exit((tx, go): (Sender<GpuTensor<f32>>, Receiver<()>)) {
    let dev = Device::get(0).unwrap();
    let first = GpuTensor::<f32>::zeros(&dev, &[1 << 20]).unwrap();
    first.fill(1.0).unwrap();
    tx.send(first).unwrap();
    go.recv().unwrap();
    cuda_mp::before_exit();
    let t = GpuTensor::<f32>::zeros(&dev, &[1 << 26]).unwrap();
    for _ in 0..20 {
        t.add_scalar(1.0).unwrap();
    }
    tx.send(t).unwrap();
    go.recv().unwrap();
}

/// After `before_exit` (the driver's file of the sender's events removed, so no receiver can
/// open its event), a sent tensor still arrives with the work queued on it done.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_send_after_before_exit_still_orders_the_senders_work() {
    let _g = serial();
    let _dev = gpu();
    let (tx, rx) = channel().unwrap();
    let (go_tx, go_rx) = channel().unwrap();
    let child = spawn((tx, go_rx), send_around_before_exit);
    let first = rx.recv_timeout(WAIT).unwrap();
    assert!(first.to_vec().unwrap().iter().all(|&x| x == 1.0));
    drop(first);
    go_tx.send(()).unwrap();
    let t = rx.recv_timeout(WAIT).unwrap();
    let wrong = t.to_vec().unwrap().iter().filter(|&&x| x != 20.0).count();
    assert_eq!(wrong, 0, "elements read before the sender's kernels were done");
    drop(t);
    go_tx.send(()).unwrap();
    child.join().unwrap();
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct ViewInfo {
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
    contiguous: bool,
    values: Vec<f32>,
}

fn bf16_view_child((rx, reply, go): (Receiver<GpuTensor<bf16>>, Sender<ViewInfo>, Receiver<()>)) {
    let v = rx.recv().unwrap();
    let info = |v: &GpuTensor<bf16>| ViewInfo {
        shape: v.shape().to_vec(),
        strides: v.strides().to_vec(),
        offset: v.offset(),
        contiguous: v.is_contiguous(),
        values: v.to_vec().unwrap().iter().map(|x| x.to_f32()).collect(),
    };
    reply.send(info(&v)).unwrap();
    v.add_scalar(1.0).unwrap();
    v.synchronize().unwrap();
    reply.send(info(&v)).unwrap();
    go.recv().unwrap();
    reply.send(info(&v)).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn transposed_bf16_slice_handoff_with_writes_in_both_directions() {
    let _g = serial();
    let dev = gpu();
    let base_vals: Vec<f32> = (0..48).map(|x| x as f32).collect();
    let base = GpuTensor::from_vec(&dev, &[6, 8], base_vals.iter().map(|&x| bf16::from_f32(x)).collect()).unwrap();
    // Rows 1..5, columns 2..5, transposed: shape [3, 4], strides [1, 8], offset 10.
    let view = base.narrow(0, 1, 4).unwrap().narrow(1, 2, 3).unwrap().transpose(0, 1).unwrap();
    let expected: Vec<f32> = (0..3).flat_map(|c| (0..4).map(move |r| ((r + 1) * 8 + c + 2) as f32)).collect();
    let (tx, rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let (go_tx, go_rx) = channel().unwrap();
    let child = spawn((rx, reply_tx, go_rx), bf16_view_child);
    tx.send(view.clone()).unwrap();
    let first = reply_rx.recv_timeout(WAIT).unwrap();
    assert_eq!(
        first,
        ViewInfo { shape: vec![3, 4], strides: vec![1, 8], offset: 10, contiguous: false, values: expected.clone() }
    );
    let second = reply_rx.recv_timeout(WAIT).unwrap();
    assert_eq!(second.values, expected.iter().map(|x| x + 1.0).collect::<Vec<_>>());
    // Only the view's elements changed in the parent's base tensor.
    let now: Vec<f32> = base.to_vec().unwrap().iter().map(|x| x.to_f32()).collect();
    for (i, (&was, &is)) in base_vals.iter().zip(&now).enumerate() {
        let (r, c) = (i / 8, i % 8);
        let inside = (1..5).contains(&r) && (2..5).contains(&c);
        assert_eq!(is, if inside { was + 1.0 } else { was }, "element ({r}, {c})");
    }
    view.fill(bf16::from_f32(-3.0)).unwrap();
    view.synchronize().unwrap();
    go_tx.send(()).unwrap();
    assert_eq!(reply_rx.recv_timeout(WAIT).unwrap().values, vec![-3.0; 12]);
    child.join().unwrap();
}

fn hold_then_release((rx, cmd, reply): (Receiver<GpuTensor<f32>>, Receiver<Cmd>, Sender<bool>)) {
    let mut t = Some(rx.recv().unwrap());
    reply.send(true).unwrap();
    while let Ok(c) = cmd.recv() {
        match c {
            Cmd::Read => reply.send(t.as_ref().unwrap().to_vec().unwrap().iter().all(|&x| x == 3.0)).unwrap(),
            Cmd::Drop => {
                t = None;
                reply.send(true).unwrap();
            }
        }
    }
    assert!(t.is_none());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn eight_consumers_outlive_the_producer_and_memory_returns_to_baseline() {
    let _g = serial();
    let dev = gpu();
    let warm = GpuTensor::<f32>::full(&dev, &[1], 0.0).unwrap();
    drop(warm);
    let baseline = free_memory(&dev);
    let before = lifetime_stats();
    let t = GpuTensor::<f32>::full(&dev, &[16 << 20], 3.0).unwrap(); // 64 MiB
    let mut children = Vec::new();
    let mut cmds = Vec::new();
    let mut replies = Vec::new();
    for _ in 0..8 {
        let (tx, rx) = channel().unwrap();
        let (cmd_tx, cmd_rx) = channel().unwrap();
        let (reply_tx, reply_rx) = channel().unwrap();
        children.push(spawn((rx, cmd_rx, reply_tx), hold_then_release));
        tx.send(t.clone()).unwrap();
        cmds.push(cmd_tx);
        replies.push(reply_rx);
    }
    for r in &replies {
        assert!(r.recv_timeout(WAIT).unwrap());
    }
    drop(t);
    let s = lifetime_stats();
    assert_eq!(s.live_storages, before.live_storages + 1, "kept alive for the consumers");
    assert_eq!(s.outstanding_leases, before.outstanding_leases + 8, "one lease per connection, none per message");
    for c in &cmds {
        c.send(Cmd::Read).unwrap();
    }
    for r in &replies {
        assert!(r.recv_timeout(WAIT).unwrap(), "a consumer read wrong data after the producer dropped");
    }
    for (i, c) in cmds.iter().enumerate() {
        c.send(Cmd::Drop).unwrap();
        assert!(replies[i].recv_timeout(WAIT).unwrap());
        let s = lifetime_stats();
        if i < 7 {
            assert_eq!(s.live_storages, before.live_storages + 1, "freed before the last consumer dropped");
        }
    }
    wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages).expect("freed after the last consumer");
    drop(cmds);
    for c in children {
        c.join().unwrap();
    }
    // The caching allocator keeps the 64 MiB segment for the next tensor until told otherwise.
    assert!(dev.empty_cache() >= 64 << 20);
    let what = format!("device memory not back to baseline ({baseline} bytes free before)");
    common::eventually(WAIT, &what, || free_memory(&dev) + (2 << 20) >= baseline);
}

fn first_element((rx, reply): (Receiver<GpuTensor<f32>>, Sender<f32>)) {
    while let Ok(t) = rx.recv() {
        let v = t.narrow(0, 0, 1).unwrap().to_vec().unwrap()[0];
        reply.send(v).unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn ten_thousand_fresh_handoffs_leave_no_memory_behind() {
    let _g = serial();
    let dev = gpu();
    let initial = lifetime_stats();
    let (tx, rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let child = spawn((rx, reply_tx), first_element);
    // One handoff before the counts start: the driver backs a process's interprocess events
    // with a file in /dev/shm that it creates at the first and keeps for the process's life.
    tx.send(GpuTensor::<f32>::full(&dev, &[1024], -1.0).unwrap()).unwrap();
    assert_eq!(reply_rx.recv_timeout(WAIT).unwrap(), -1.0);
    let before = wait_for_lifetime(WAIT, |s| s.live_storages == initial.live_storages).expect("the first tensor freed");
    let baseline = free_memory(&dev);
    let shm_before = shm_entries();
    for i in 0..10_000 {
        let t = GpuTensor::<f32>::full(&dev, &[1024], i as f32).unwrap();
        tx.send(t).unwrap();
        assert_eq!(reply_rx.recv_timeout(WAIT).unwrap(), i as f32);
    }
    drop(tx);
    child.join().unwrap();
    let after = wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages && s.outstanding_leases == 0)
        .expect("every storage freed");
    assert_eq!(after.freed_storages - before.freed_storages, 10_000);
    let free = free_memory(&dev);
    assert!(free + (2 << 20) >= baseline, "device memory not back to baseline: {baseline} before, {free} after");
    assert_eq!(shm_entries(), shm_before, "files left in /dev/shm");
}

fn hold_forever((rx, ack): (Receiver<GpuTensor<f32>>, Sender<()>)) {
    let t = rx.recv().unwrap();
    t.add_scalar(1.0).unwrap();
    t.synchronize().unwrap();
    ack.send(()).unwrap();
    loop {
        std::thread::park();
        let _ = &t;
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_sigkilled_consumer_is_reclaimed() {
    let _g = serial();
    let dev = gpu();
    let before = lifetime_stats();
    let (tx, rx) = channel().unwrap();
    let (ack_tx, ack_rx) = channel().unwrap();
    let mut child = spawn((rx, ack_tx), hold_forever);
    let t = GpuTensor::<f32>::zeros(&dev, &[1 << 20]).unwrap();
    tx.send(t.clone()).unwrap();
    ack_rx.recv_timeout(WAIT).unwrap();
    assert_eq!(t.narrow(0, 0, 2).unwrap().to_vec().unwrap(), vec![1.0, 1.0]);
    drop(t);
    assert_eq!(lifetime_stats().live_storages, before.live_storages + 1);
    child.kill().unwrap();
    let after = wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages).expect("reclaimed");
    assert_eq!(after.outstanding_leases, before.outstanding_leases);
}

fn forward((rx, next): (Receiver<GpuTensor<i32>>, Sender<GpuTensor<i32>>)) {
    let t = rx.recv().unwrap();
    t.add_scalar(100.0).unwrap();
    next.send(t).unwrap();
}

fn last_hop((rx, reply, cmd): (Receiver<GpuTensor<i32>>, Sender<Vec<i32>>, Receiver<Cmd>)) {
    let t = rx.recv().unwrap();
    t.add_scalar(1.0).unwrap();
    reply.send(t.to_vec().unwrap()).unwrap();
    cmd.recv().unwrap();
    drop(t);
    reply.send(vec![]).unwrap();
    let _ = cmd.recv();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn forwarding_to_a_third_process_works_and_keeps_memory_alive() {
    let _g = serial();
    let dev = gpu();
    let before = lifetime_stats();
    let (to_a, a_rx) = channel().unwrap();
    let (to_b, b_rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let (cmd_tx, cmd_rx) = channel().unwrap();
    let b = spawn((b_rx, reply_tx, cmd_rx), last_hop);
    let a = spawn((a_rx, to_b), forward);
    let t = GpuTensor::from_vec(&dev, &[4], vec![1, 2, 3, 4]).unwrap();
    to_a.send(t.clone()).unwrap();
    assert_eq!(reply_rx.recv_timeout(WAIT).unwrap(), vec![102, 103, 104, 105]);
    a.join().unwrap();
    assert_eq!(t.to_vec().unwrap(), vec![102, 103, 104, 105]);
    drop(t);
    assert_eq!(lifetime_stats().live_storages, before.live_storages + 1, "B holds it after A exited");
    cmd_tx.send(Cmd::Drop).unwrap();
    reply_rx.recv_timeout(WAIT).unwrap();
    wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages).expect("released after B dropped");
    drop(cmd_tx);
    b.join().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_same_process_channel_hands_back_the_original_storage() {
    let _g = serial();
    let dev = gpu();
    let before = lifetime_stats();
    let (tx, rx) = channel().unwrap();
    let t = GpuTensor::<f32>::zeros(&dev, &[2, 3]).unwrap();
    tx.send(t.transpose(0, 1).unwrap()).unwrap();
    let back: GpuTensor<f32> = rx.recv().unwrap();
    assert!(back.shares_storage_with(&t));
    assert_eq!(back.device_ptr(), t.device_ptr());
    back.add_scalar(2.5).unwrap();
    assert_eq!(t.to_vec().unwrap(), vec![2.5; 6]);
    drop((t, back));
    wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages).expect("freed");
    drop(rx);
    wait_for_lifetime(WAIT, |s| s.outstanding_leases == before.outstanding_leases)
        .expect("the connection's lease closes with its receiver");
}

/// The wire layout of a GPU tensor, with every field under the forger's control; `M` is the
/// memory's own record (legacy or VMM), `L` the lease's slot.
#[derive(Serialize, Deserialize, Clone)]
struct ForgedGpu<M, L = CarriedFile> {
    dtype: u8,
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
    owner: u128,
    index: u64,
    bytes: u64,
    lease: common::Claim<L>,
    cache_ticket: Option<u32>,
    device_uuid: [u8; 16],
    /// 0: legacy IPC memory, 1: VMM memory.
    memory_variant: u32,
    memory: M,
    event_handle: Option<Vec<u8>>,
}

/// Legacy IPC memory: the allocation's handle and the storage's offset in it.
#[derive(Serialize, Deserialize, Clone)]
struct LegacyRecord {
    mem_handle: Vec<u8>,
    alloc_offset: u64,
}

/// VMM memory: its descriptor (carried in the message; `D` is its slot) and the allocation's
/// size.
#[derive(Serialize, Deserialize, Clone)]
struct VmmRecord<D = CarriedFile> {
    descriptor: D,
    size: u64,
}

fn forged(uuid: [u8; 16], mem_handle: Vec<u8>) -> ForgedGpu<LegacyRecord> {
    ForgedGpu {
        dtype: 0,
        shape: vec![4],
        strides: vec![1],
        offset: 0,
        owner: 77,
        index: 1,
        bytes: 16,
        lease: common::Claim::Lease(CarriedFile(common::lease_pipe().0), false),
        cache_ticket: None,
        device_uuid: uuid,
        memory_variant: 0,
        memory: LegacyRecord { mem_handle, alloc_offset: 0 },
        event_handle: None,
    }
}

fn expect_malformed(r: Result<GpuTensor<f32>, RecvError>) -> String {
    match r {
        Err(RecvError::Malformed(m)) => m,
        other => panic!("expected a malformed-message error, got {other:?}"),
    }
}

fn send_and_exit(tx: Sender<GpuTensor<f32>>) {
    let dev = Device::get(0).unwrap();
    // Legacy memory, which dies with its producer (VMM memory, the default for segments where
    // the GPU has it, would not).
    dev.set_memory_kind(cuda_mp::GpuMemoryKind::Legacy);
    let t = GpuTensor::<f32>::full(&dev, &[4], 1.0).unwrap();
    tx.send(t).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn forged_handles_and_handles_of_exited_producers_give_errors() {
    let _g = serial();
    let dev = gpu();
    let (tx, rx) = common::connect::<ForgedGpu<LegacyRecord>, GpuTensor<f32>>();

    tx.send(forged(dev.uuid(), (0..64).map(|i| (i * 37 + 11) as u8).collect())).unwrap();
    let m = expect_malformed(rx.recv());
    assert!(m.contains("cuIpcOpenMemHandle"), "{m}");
    tx.send(forged(dev.uuid(), vec![0; 10])).unwrap();
    let m = expect_malformed(rx.recv());
    assert!(m.contains("memory handle has 10 bytes"), "{m}");
    tx.send(forged([0xab; 16], vec![0; 64])).unwrap();
    let m = expect_malformed(rx.recv());
    assert!(m.contains("is not visible"), "{m}");

    let (tx, rx) = channel().unwrap();
    spawn(tx, send_and_exit).join().unwrap();
    let m = expect_malformed(rx.recv_timeout(WAIT).map_err(|e| RecvError::Malformed(e.to_string())));
    assert!(m.contains("cuIpcOpenMemHandle"), "{m}");
    // The channel stays usable after a rejected message.
    let own = GpuTensor::<f32>::zeros(&dev, &[1]).unwrap();
    let (tx2, rx2) = channel().unwrap();
    tx2.send(own).unwrap();
    assert!(rx2.recv().is_ok());
}

#[derive(Serialize, Deserialize, Debug)]
struct Seen {
    visible: Option<String>,
    uuid: Result<String, String>,
}

fn add_one_report_uuid((rx, reply): (Receiver<GpuTensor<f32>>, Sender<Seen>)) {
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let uuid = match rx.recv() {
        Ok(t) => {
            t.add_scalar(1.0).unwrap();
            t.synchronize().unwrap();
            Ok(t.device().uuid_string())
        }
        Err(e) => Err(e.to_string()),
    };
    reply.send(Seen { visible, uuid }).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn processes_with_different_visible_devices_map_the_same_gpu() {
    let _g = serial();
    let dev = gpu();
    let uuid = dev.uuid_string();
    let t = GpuTensor::<f32>::zeros(&dev, &[8]).unwrap();
    for visible in [uuid.clone(), "0".to_string()] {
        let (tx, rx) = channel().unwrap();
        let (reply_tx, reply_rx) = channel().unwrap();
        let child = Builder::new()
            .env("CUDA_VISIBLE_DEVICES", visible.clone())
            .spawn((rx, reply_tx), add_one_report_uuid)
            .unwrap();
        tx.send(t.clone()).unwrap();
        let seen = reply_rx.recv_timeout(WAIT).unwrap();
        assert_eq!(seen.visible.as_deref(), Some(visible.as_str()));
        assert_eq!(seen.uuid.as_deref(), Ok(uuid.as_str()), "the child mapped the same physical gpu");
        child.join().unwrap();
    }
    assert_eq!(t.to_vec().unwrap(), vec![2.0; 8], "both children wrote the parent's memory");

    // A process that sees no GPU gets a clear error, not a crash.
    let (tx, rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let child = Builder::new().env("CUDA_VISIBLE_DEVICES", "").spawn((rx, reply_tx), add_one_report_uuid).unwrap();
    tx.send(t.clone()).unwrap();
    let seen = reply_rx.recv_timeout(WAIT).unwrap();
    let err = seen.uuid.unwrap_err();
    assert!(err.contains("cuda is not available") || err.contains("not visible"), "{err}");
    child.join().unwrap();
}

fn receive_drop_report((rx, reply): (Receiver<GpuTensor<f32>>, Sender<(f32, u64, usize)>)) {
    while let Ok(t) = rx.recv() {
        let v = t.narrow(0, 0, 1).unwrap().to_vec().unwrap()[0];
        drop(t);
        let s = lifetime_stats();
        reply.send((v, s.opened_mappings, s.cached_mappings)).unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_resent_storage_is_mapped_once_and_the_cache_is_revoked_when_the_producer_drops_it() {
    let _g = serial();
    let dev = gpu();
    let before = lifetime_stats();
    let (tx, rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let child = spawn((rx, reply_tx), receive_drop_report);
    let t = GpuTensor::<f32>::zeros(&dev, &[4096]).unwrap();
    let mut last = (0.0, 0, 0);
    for i in 0..200 {
        t.fill(i as f32).unwrap();
        tx.send(t.clone()).unwrap();
        last = reply_rx.recv_timeout(WAIT).unwrap();
        assert_eq!(last.0, i as f32, "the consumer sees this round's value (event ordering)");
    }
    assert!(last.1 < 5, "the consumer opened the handle {} times in 200 rounds", last.1);
    assert_eq!(last.2, 1, "the consumer keeps one cached mapping");
    assert_eq!(lifetime_stats().live_storages, before.live_storages + 1);
    drop(t);
    wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages)
        .expect("the consumer's cached mapping is revoked and the memory freed");
    let leases = lifetime_stats().leases_granted - before.leases_granted;
    assert_eq!(leases, 1, "200 messages on one connection made {leases} leases");
    drop(tx);
    child.join().unwrap();
    wait_for_lifetime(WAIT, |s| s.outstanding_leases == before.outstanding_leases)
        .expect("the connection's lease closes with the consumer");
}

fn read_bundle((rx, reply): (Receiver<cuda_mp::Bundle>, Sender<Result<(Vec<f32>, i64, u64), String>>)) {
    let mut held = None;
    while let Ok(b) = rx.recv() {
        let r = (|| -> cuda_mp::Result<(Vec<f32>, i64, u64)> {
            let w = b.get::<bf16>("layer.0.weight")?;
            let step = b.get::<i64>("step")?.to_vec()?[0];
            if b.get::<f32>("layer.0.weight").is_ok() {
                return Err(cuda_mp::Error::Unsupported("a bf16 entry was handed out as f32".into()));
            }
            let vals = w.narrow(0, 0, 1)?.to_vec()?.iter().map(|x| x.to_f32()).collect();
            Ok((vals, step, lifetime_stats().opened_mappings))
        })();
        held = Some(b);
        reply.send(r.map_err(|e| e.to_string())).unwrap();
    }
    drop(held);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_bundle_is_published_with_one_handle_and_republished_in_place() {
    let _g = serial();
    let dev = gpu();
    let before = lifetime_stats();
    let bundle = cuda_mp::BundleBuilder::new()
        .add::<bf16>("layer.0.weight", &[3, 5])
        .add::<f32>("layer.0.bias", &[7])
        .add::<i64>("step", &[1])
        .build(&dev)
        .unwrap();
    assert_eq!(bundle.len(), 3);
    let w = bundle.get::<bf16>("layer.0.weight").unwrap();
    assert!(matches!(bundle.get::<f32>("layer.0.weight"), Err(cuda_mp::Error::DTypeMismatch { .. })));
    assert!(matches!(bundle.get::<f32>("missing"), Err(cuda_mp::Error::NoSuchTensor { .. })));
    let (tx, rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let child = spawn((rx, reply_tx), read_bundle);
    for step in 1..=5i64 {
        w.add_scalar(1.0).unwrap();
        bundle.get::<i64>("step").unwrap().fill(step).unwrap();
        tx.send(bundle.clone()).unwrap();
        let (vals, seen_step, opened) = reply_rx.recv_timeout(WAIT).unwrap().unwrap();
        assert_eq!(seen_step, step);
        assert_eq!(vals, vec![step as f32; 5], "the consumer reads this step's weights");
        assert_eq!(opened, 1, "one handle opened for the whole bundle, once");
    }
    drop((w, bundle));
    drop(tx);
    child.join().unwrap();
    wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages).expect("bundle freed");
}

fn sum_bundle((rx, reply): (Receiver<cuda_mp::Bundle>, Sender<(usize, usize, f32)>)) {
    let b = rx.recv().unwrap();
    let total: f32 = b.entries().iter().map(|e| b.get::<f32>(e.name()).unwrap().to_vec().unwrap()[0]).sum();
    reply.send((b.len(), b.allocations(), total)).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_bundle_of_a_hundred_allocations_crosses_in_one_message() {
    let _g = serial();
    let dev = gpu();
    let before = lifetime_stats();
    let mut builder = cuda_mp::BundleBuilder::new().chunk_bytes(4096);
    for i in 0..100 {
        builder = builder.add::<f32>(format!("t{i}"), &[1024]);
    }
    let bundle = builder.build(&dev).unwrap();
    assert_eq!(bundle.allocations(), 100);
    for i in 0..100 {
        bundle.get::<f32>(&format!("t{i}")).unwrap().fill(i as f32).unwrap();
    }
    let (tx, rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let child = spawn((rx, reply_tx), sum_bundle);
    tx.send(bundle.clone()).unwrap();
    assert_eq!(reply_rx.recv_timeout(WAIT).unwrap(), (100, 100, 4950.0));
    child.join().unwrap();
    drop(bundle);
    wait_for_lifetime(WAIT, |s| {
        s.live_storages == before.live_storages && s.outstanding_leases == before.outstanding_leases
    })
    .expect("every allocation freed");
}

#[derive(Serialize, Deserialize, Debug)]
enum Op {
    /// Add this to every element, then report the first element.
    AddAndRead(f32),
    Forward,
    Drop,
}

type ConsumerArgs =
    (Receiver<GpuTensor<f32>>, Receiver<Op>, Sender<Result<f32, String>>, Option<Sender<GpuTensor<f32>>>);

/// Receives one tensor (says whether it could), then follows orders.
fn consumer((rx, ops, reply, next): ConsumerArgs) {
    let mut held = match rx.recv_timeout(WAIT) {
        Ok(t) => {
            reply.send(Ok(0.0)).unwrap();
            Some(t)
        }
        Err(e) => {
            reply.send(Err(e.to_string())).unwrap();
            None
        }
    };
    while let Ok(op) = ops.recv() {
        let answer = match (op, held.as_ref()) {
            (Op::AddAndRead(x), Some(t)) => {
                t.add_scalar(x as f64).unwrap();
                Ok(t.to_vec().unwrap()[0])
            }
            (Op::Forward, Some(t)) => next.as_ref().unwrap().send(t.clone()).map(|_| 0.0).map_err(|e| e.to_string()),
            (Op::Drop, _) => {
                held = None;
                Ok(0.0)
            }
            (op, None) => Err(format!("{op:?} without a tensor")),
        };
        reply.send(answer).unwrap();
    }
}

/// Allocates 1 GiB of the given kind, sends it to every consumer, waits for the word, exits.
fn producer((txs, go, vmm): (Vec<Sender<GpuTensor<f32>>>, Receiver<()>, bool)) {
    let dev = Device::get(0).unwrap();
    dev.set_memory_kind(if vmm { cuda_mp::GpuMemoryKind::Vmm } else { cuda_mp::GpuMemoryKind::Legacy });
    let t = GpuTensor::<f32>::full(&dev, &[1 << 28], 1.0).unwrap();
    for tx in &txs {
        tx.send(t.clone()).unwrap();
    }
    go.recv().unwrap();
}

struct Consumer {
    tx: Sender<GpuTensor<f32>>,
    ops: Sender<Op>,
    reply: Receiver<Result<f32, String>>,
    child: cuda_mp::JoinHandle<()>,
}

fn start_consumer(next: Option<Sender<GpuTensor<f32>>>) -> Consumer {
    let (tx, rx) = channel().unwrap();
    let (ops, ops_rx) = channel().unwrap();
    let (reply_tx, reply) = channel().unwrap();
    let child = spawn((rx, ops_rx, reply_tx, next), consumer);
    Consumer { tx, ops, reply, child }
}

impl Consumer {
    fn ask(&self, op: Op) -> Result<f32, String> {
        self.ops.send(op).unwrap();
        self.reply.recv_timeout(WAIT).unwrap()
    }
}

/// The producer sends 1 GiB to three consumers and exits; the consumers keep writing it, one
/// forwards it to a fourth. Returns what the fourth said on receipt.
fn outlive_the_producer(vmm: bool) -> Result<f32, String> {
    let dev = gpu();
    let baseline = free_memory(&dev);
    let fourth = start_consumer(None);
    let cs: Vec<Consumer> =
        (0..3).map(|i| start_consumer(if i == 0 { Some(fourth.tx.clone()) } else { None })).collect();
    let (go_tx, go_rx) = channel().unwrap();
    let producer = spawn((cs.iter().map(|c| c.tx.clone()).collect(), go_rx, vmm), producer);
    for c in &cs {
        c.reply.recv_timeout(WAIT).unwrap().expect("each consumer maps the memory");
    }
    go_tx.send(()).unwrap();
    producer.join().unwrap();
    // The producer has exited: the three keep reading and writing the same memory.
    for (i, c) in cs.iter().enumerate() {
        assert_eq!(c.ask(Op::AddAndRead(1.0)), Ok(2.0 + i as f32), "consumer {i} sees every earlier write");
    }
    cs[0].ask(Op::Forward).unwrap();
    let fourth_got = fourth.reply.recv_timeout(WAIT).unwrap();
    if fourth_got.is_ok() {
        assert_eq!(fourth.ask(Op::AddAndRead(1.0)), Ok(5.0), "the fourth process writes the same memory");
    }
    let held = free_memory(&dev);
    for c in cs.iter().chain([&fourth]) {
        c.ask(Op::Drop).unwrap();
    }
    // The last holder dropped it: the 1 GiB is free again while the consumers still run.
    let deadline = std::time::Instant::now() + WAIT;
    while free_memory(&dev) < held + (900 << 20) {
        assert!(std::time::Instant::now() < deadline, "1 GiB not freed after the last holder dropped it");
        std::thread::sleep(Duration::from_millis(20));
    }
    for c in cs.into_iter().chain([fourth]) {
        drop(c.ops);
        c.child.join().unwrap();
    }
    assert!(free_memory(&dev) + (64 << 20) >= baseline, "device memory back to where it started");
    fourth_got
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn vmm_memory_outlives_its_producer_and_travels_on() {
    let _g = serial();
    if !gpu().supports_memory_kind(cuda_mp::GpuMemoryKind::Vmm).unwrap() {
        panic!("this GPU has no virtual memory management with file-descriptor export");
    }
    assert_eq!(outlive_the_producer(true), Ok(0.0));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn legacy_memory_of_an_exited_producer_cannot_be_mapped_and_the_error_says_why() {
    let _g = serial();
    let err = outlive_the_producer(false).unwrap_err();
    assert!(err.contains("has exited"), "{err}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn forged_vmm_records_give_errors() {
    let _g = serial();
    let dev = gpu();
    assert!(dev.supports_memory_kind(cuda_mp::GpuMemoryKind::Vmm).unwrap(), "this GPU has no VMM");
    dev.set_memory_kind(cuda_mp::GpuMemoryKind::Vmm);
    let t = GpuTensor::<f32>::full(&dev, &[1024], 2.0).unwrap();
    dev.set_memory_kind(cuda_mp::GpuMemoryKind::Auto);
    // Genuine records, read as plain fields: each send parks a descriptor of its own.
    let (genuine_tx, genuine_rx) = common::connect::<GpuTensor<f32>, ForgedGpu<VmmRecord>>();
    let genuine = || {
        genuine_tx.send(t.clone()).unwrap();
        let g = genuine_rx.recv_timeout(WAIT).unwrap();
        assert_eq!(g.memory_variant, 1, "vmm memory travels as its descriptor");
        g
    };
    let (tx, rx) = common::connect::<ForgedGpu<VmmRecord>, GpuTensor<f32>>();
    // Named as another process's storage, so the receiver imports the descriptor; its claim is
    // through a lease of the forger's (the genuine one is counted on the genuine channel).
    let as_foreign = |index: u64, g: ForgedGpu<VmmRecord>| ForgedGpu {
        owner: 0x1234,
        index,
        lease: common::Claim::Lease(CarriedFile(common::lease_pipe().0), false),
        ..g
    };
    let refused = |r: ForgedGpu<VmmRecord>| -> String {
        tx.send(r).unwrap();
        match rx.recv_timeout(WAIT) {
            Err(cuda_mp::RecvTimeoutError::Malformed(m)) => m,
            other => panic!("expected a malformed-message error, got {other:?}"),
        }
    };
    // A record naming a descriptor the message does not carry.
    let g = genuine();
    let (slot_tx, slot_rx) = common::connect::<ForgedGpu<VmmRecord<common::Slot>>, GpuTensor<f32>>();
    let memory = VmmRecord { descriptor: common::slot(9), size: g.memory.size };
    let g = as_foreign(1, g);
    let forged = ForgedGpu {
        dtype: g.dtype,
        shape: g.shape,
        strides: g.strides,
        offset: g.offset,
        owner: g.owner,
        index: g.index,
        bytes: g.bytes,
        lease: g.lease,
        cache_ticket: g.cache_ticket,
        device_uuid: g.device_uuid,
        memory_variant: g.memory_variant,
        memory,
        event_handle: g.event_handle,
    };
    slot_tx.send(forged).unwrap();
    match slot_rx.recv_timeout(WAIT) {
        Err(cuda_mp::RecvTimeoutError::Malformed(m)) => assert!(m.contains("does not carry"), "{m}"),
        other => panic!("expected a malformed-message error, got {other:?}"),
    }
    // A descriptor that is not VMM memory (a socket).
    let g = genuine();
    let memory = VmmRecord { descriptor: CarriedFile(common::socket_pair().0), size: g.memory.size };
    let m = refused(as_foreign(2, ForgedGpu { memory, ..g }));
    assert!(!m.is_empty());
    // The genuine record sent twice: each message carries its own copy of the descriptor.
    let g = genuine();
    tx.send(as_foreign(3, g.clone())).unwrap();
    assert_eq!(rx.recv_timeout(WAIT).unwrap().to_vec().unwrap(), vec![2.0; 1024]);
    let g = genuine();
    let size = g.memory.size;
    let m = refused(ForgedGpu { bytes: size + 4, ..as_foreign(4, g) });
    assert!(m.contains("in an allocation of"), "{m}");
    let g = genuine();
    let memory = VmmRecord { size: size + (2 << 20), ..g.memory.clone() };
    let m = refused(as_foreign(5, ForgedGpu { memory, ..g }));
    assert!(m.contains(&format!("{}", size + (2 << 20))), "the size it does not have: {m}");
    // A genuine record, as another process would receive it, maps the same memory.
    tx.send(as_foreign(6, genuine())).unwrap();
    let mapped = rx.recv_timeout(WAIT).unwrap();
    assert_eq!(mapped.to_vec().unwrap(), vec![2.0; 1024]);
}

/// A block of a caching allocator's segment: how it names the segment, and the block's offset
/// in it.
#[derive(Serialize, Deserialize, Clone)]
struct BlockRecord<S> {
    segment: common::ForgedSegmentRef<SegmentRecord<S>>,
    offset: u64,
}

impl<S> BlockRecord<S> {
    /// The segment's record, where one travels.
    fn record(&self) -> Option<&SegmentRecord<S>> {
        match &self.segment {
            common::ForgedSegmentRef::Whole(r) => Some(r),
            _ => None,
        }
    }
}

/// A segment's record: its identity, size and claim; 0: legacy memory, 1: VMM memory.
#[derive(Serialize, Deserialize, Clone)]
struct SegmentRecord<S> {
    owner: u128,
    index: u64,
    bytes: u64,
    lease: common::Claim<CarriedFile>,
    cache_ticket: Option<u32>,
    variant: u32,
    memory: S,
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn forged_blocks_of_vmm_segments_give_errors() {
    let _g = serial();
    let dev = gpu();
    dev.set_segment_kind(cuda_mp::GpuMemoryKind::Vmm).unwrap();
    let t = GpuTensor::<f32>::full(&dev, &[256], 3.0).unwrap();
    dev.set_segment_kind(cuda_mp::GpuMemoryKind::Legacy).unwrap();
    assert_eq!(t.storage().memory_kind(), cuda_mp::GpuMemoryKind::Vmm);
    type Block = ForgedGpu<BlockRecord<VmmRecord>>;
    // On a channel even the first block of a segment only names it: the segment's record
    // travels ahead of the message's value, for the receiving end to keep.
    let (genuine_tx, genuine_rx) = common::connect::<GpuTensor<f32>, Block>();
    genuine_tx.send(t.clone()).unwrap();
    let g = genuine_rx.recv_timeout(WAIT).unwrap();
    assert!(matches!(g.memory.segment, common::ForgedSegmentRef::Known { .. }), "named");
    drop((g, genuine_tx, genuine_rx));
    // Handed over as bytes (outside a channel), a block carries its segment's record.
    let genuine = || {
        let g: Block = cuda_mp::from_bytes(&cuda_mp::to_bytes(&t, WAIT).unwrap()).unwrap();
        assert_eq!(g.memory_variant, 2, "a block of a segment");
        let segment = g.memory.record().expect("the segment's record travels whole outside a channel");
        assert_eq!(segment.variant, 1, "the segment is vmm memory");
        g
    };
    // Named as another process's block and segment, claimed through leases of the forger's.
    let foreign = |index: u64, g: Block| {
        let segment = common::ForgedSegmentRef::Whole(Box::new(SegmentRecord {
            owner: 0x4321,
            index: 1000 + index,
            lease: common::Claim::Lease(CarriedFile(common::lease_pipe().0), false),
            ..g.memory.record().unwrap().clone()
        }));
        ForgedGpu {
            owner: 0x4321,
            index,
            lease: common::Claim::Lease(CarriedFile(common::lease_pipe().0), false),
            memory: BlockRecord { segment, ..g.memory },
            ..g
        }
    };
    let (tx, rx) = common::connect::<Block, GpuTensor<f32>>();
    let refused = |r: Block| -> String {
        tx.send(r).unwrap();
        match rx.recv_timeout(WAIT) {
            Err(cuda_mp::RecvTimeoutError::Malformed(m)) => m,
            other => panic!("expected a malformed-message error, got {other:?}"),
        }
    };
    // A block past its segment's end.
    let g = foreign(1, genuine());
    let size = g.memory.record().unwrap().bytes;
    let m = refused(Block { memory: BlockRecord { offset: size - 512, ..g.memory.clone() }, ..g });
    assert!(m.contains("exceeds its"), "{m}");
    // A block without its segment.
    let g = foreign(2, genuine());
    let m =
        refused(Block { memory: BlockRecord { segment: common::ForgedSegmentRef::Taken, ..g.memory.clone() }, ..g });
    assert!(m.contains("without its segment"), "{m}");
    // A block naming a segment its channel was never given.
    let g = foreign(7, genuine());
    let known = common::ForgedSegmentRef::Known { via: 0x4321, owner: 0x4321, index: 1007 };
    let m = refused(Block { memory: BlockRecord { segment: known, ..g.memory.clone() }, ..g });
    assert!(m.contains("which its channel was never given"), "{m}");
    // A segment whose descriptor is a socket, not VMM memory.
    let g = foreign(3, genuine());
    let mut segment = g.memory.record().unwrap().clone();
    segment.memory.descriptor = CarriedFile(common::socket_pair().0);
    let m = refused(Block {
        memory: BlockRecord { segment: common::ForgedSegmentRef::Whole(Box::new(segment)), ..g.memory.clone() },
        ..g
    });
    assert!(!m.is_empty());
    // A segment that claims more memory than its descriptor has.
    let g = foreign(4, genuine());
    let mut segment = g.memory.record().unwrap().clone();
    segment.memory.size += 2 << 20;
    segment.bytes += 2 << 20;
    let m = refused(Block {
        memory: BlockRecord { segment: common::ForgedSegmentRef::Whole(Box::new(segment)), ..g.memory.clone() },
        ..g
    });
    assert!(!m.is_empty());
    // A segment record of a third kind: a segment is never a block.
    let g = foreign(5, genuine());
    let mut segment = g.memory.record().unwrap().clone();
    segment.variant = 2;
    let m = refused(Block {
        memory: BlockRecord { segment: common::ForgedSegmentRef::Whole(Box::new(segment)), ..g.memory.clone() },
        ..g
    });
    assert!(!m.is_empty());
    // The genuine block, as another process would receive it, maps the same memory; the channel
    // stayed usable after every refusal.
    tx.send(foreign(6, genuine())).unwrap();
    let mapped = rx.recv_timeout(WAIT).unwrap();
    assert_eq!(mapped.to_vec().unwrap(), vec![3.0; 256]);
}

/// Allocates 1 GiB of VMM memory filled with 1.0, sends it to every sender and returns at
/// once: its messages are still in flight when it exits.
fn send_vmm_and_exit(txs: Vec<Sender<GpuTensor<f32>>>) {
    let dev = Device::get(0).unwrap();
    dev.set_memory_kind(cuda_mp::GpuMemoryKind::Vmm);
    let t = GpuTensor::<f32>::full(&dev, &[1 << 28], 1.0).unwrap();
    for tx in &txs {
        tx.send(t.clone()).unwrap();
    }
}

/// A consumer of the messages already waiting in `rx`.
fn consumer_of(rx: Receiver<GpuTensor<f32>>) -> Consumer {
    let (ops, ops_rx) = channel().unwrap();
    let (reply_tx, reply) = channel().unwrap();
    let child = spawn((rx, ops_rx, reply_tx, None), consumer);
    Consumer { tx: channel().unwrap().0, ops, reply, child }
}

/// The descriptor travels in the message: a producer that exits right after its send loses
/// nothing, whoever receives after its exit.
#[test]
#[ignore = "needs a CUDA GPU"]
fn vmm_memory_sent_by_a_producer_that_exits_at_once_is_received_after_its_exit() {
    let _g = serial();
    let dev = gpu();
    assert!(dev.supports_memory_kind(cuda_mp::GpuMemoryKind::Vmm).unwrap(), "this GPU has no VMM");
    let baseline = free_memory(&dev);
    let (txs, mut rxs): (Vec<Sender<GpuTensor<f32>>>, Vec<Receiver<GpuTensor<f32>>>) =
        (0..3).map(|_| channel().unwrap()).unzip();
    spawn(txs, send_vmm_and_exit).join().unwrap();
    // Two consumers start only now, after the producer's exit; the third later still.
    let last = rxs.pop().unwrap();
    let mut cs: Vec<Consumer> = rxs.into_iter().map(consumer_of).collect();
    for c in &cs {
        c.reply.recv_timeout(WAIT).unwrap().expect("a consumer started after the producer's exit maps the memory");
    }
    assert_eq!(cs[0].ask(Op::AddAndRead(1.0)), Ok(2.0));
    assert_eq!(cs[1].ask(Op::AddAndRead(1.0)), Ok(3.0), "the second consumer sees the first one's write");
    cs.push(consumer_of(last));
    cs[2].reply.recv_timeout(WAIT).unwrap().expect("the third consumer maps the memory");
    assert_eq!(cs[2].ask(Op::AddAndRead(1.0)), Ok(4.0), "the third consumer sees both writes");
    let held = free_memory(&dev);
    for c in &cs {
        c.ask(Op::Drop).unwrap();
    }
    let deadline = std::time::Instant::now() + WAIT;
    while free_memory(&dev) < held + (900 << 20) {
        assert!(std::time::Instant::now() < deadline, "1 GiB not freed after the last holder dropped it");
        std::thread::sleep(Duration::from_millis(20));
    }
    for c in cs {
        drop(c.ops);
        c.child.join().unwrap();
    }
    assert!(free_memory(&dev) + (64 << 20) >= baseline, "device memory back to where it started");
}

/// What the held producer is told to do next.
#[derive(Serialize, Deserialize, Debug)]
enum Step {
    Release(u32),
    Update,
    Exit,
}

/// Sends two fresh tensors whose fills wait behind a hold of its own stream, then follows
/// orders: release the hold, update the second tensor in place behind a new hold and send it
/// again. A process of its own, so that nothing else in it touches the GPU while it is held.
fn held_producer((tx, steps, done): (Sender<GpuTensor<f32>>, Receiver<Step>, Sender<()>)) {
    let dev = Device::get(0).unwrap();
    let flag = GpuTensor::<i32>::zeros(&dev, &[1]).unwrap();
    // Allocated before the hold: nothing but queued work while the stream is held.
    let unused = GpuTensor::<f32>::zeros(&dev, &[1024]).unwrap();
    let t = GpuTensor::<f32>::zeros(&dev, &[1024]).unwrap();
    // Before the hold, every first that may wait for the device's queued work: each kernel's
    // first launch (its code is loaded then) and the first export (the segment's IPC handle,
    // this process's interprocess event). Without a fill before the hold, the sends under it
    // never came.
    unused.fill(0.0).unwrap();
    unused.add_scalar(0.0).unwrap();
    let warm_up = unused.ipc_payload().unwrap();
    dev.synchronize().unwrap();
    drop(warm_up);
    let held = common::HeldStream::new(&dev, &flag);
    held.hold_until(1);
    unused.fill(3.0).unwrap();
    t.fill(7.0).unwrap();
    tx.send(unused.clone()).unwrap();
    tx.send(t.clone()).unwrap();
    done.send(()).unwrap();
    while let Ok(step) = steps.recv() {
        match step {
            Step::Release(value) => held.release(value),
            Step::Update => {
                held.hold_until(2);
                t.add_scalar(1.0).unwrap();
                tx.send(t.clone()).unwrap();
            }
            Step::Exit => break,
        }
        done.send(()).unwrap();
    }
    held.release(u32::MAX);
}

/// Receives a tensor to drop unused and one to read while the sender's stream is held, then
/// the second one's storage again while it is in use here. Reports the waits this process's
/// stream owes at each step, and what it read.
fn owe_then_use((rx, reply): (Receiver<GpuTensor<f32>>, Sender<(usize, Vec<f32>)>)) {
    let unused = rx.recv().unwrap();
    let dev = unused.device().clone();
    let owed = cuda_mp::testing::owed_waits(&dev);
    drop(unused); // must not wait for the sender's work
    let t = rx.recv().unwrap();
    reply.send((owed, vec![])).unwrap();
    let values = t.to_vec().unwrap(); // the first use waits for the sender's fill
    reply.send((cuda_mp::testing::owed_waits(&dev), values)).unwrap();
    let again = rx.recv().unwrap();
    reply.send((cuda_mp::testing::owed_waits(&dev), vec![])).unwrap();
    reply.send((0, again.to_vec().unwrap())).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_fresh_tensor_waits_for_its_sender_at_its_first_use_and_one_in_use_at_its_receive() {
    let _g = serial();
    gpu();
    let (tx, rx) = channel().unwrap();
    let (reply_tx, reply) = channel().unwrap();
    let (steps, steps_rx) = channel().unwrap();
    let (done_tx, done) = channel().unwrap();
    let consumer = spawn((rx, reply_tx), owe_then_use);
    let producer = spawn((tx, steps_rx, done_tx), held_producer);
    let step = |s: Step| {
        steps.send(s).unwrap();
        done.recv_timeout(WAIT).expect("the producer follows its steps");
    };
    done.recv_timeout(WAIT).expect("the producer sends two tensors while its stream is held");
    let (owed, _) = reply
        .recv_timeout(WAIT)
        .expect("the receiver answers while the sender's stream is held (dropping an unused tensor waits for nothing)");
    assert_eq!(owed, 1, "a fresh tensor owes its wait for the sender's event until it is used");
    // A receiver that did not wait would read the memory before the fill in this time.
    std::thread::sleep(Duration::from_millis(300));
    step(Step::Release(1));
    let (owed, values) = reply.recv_timeout(WAIT).unwrap();
    assert_eq!(values, vec![7.0; 1024], "the first use waited for the sender's fill");
    assert_eq!(owed, 0, "the first use queued the wait it owed");

    step(Step::Update);
    let (owed, _) = reply.recv_timeout(WAIT).unwrap();
    assert_eq!(owed, 0, "a storage in use here is waited on at its receive (its address may be held)");
    std::thread::sleep(Duration::from_millis(300));
    step(Step::Release(2));
    let (_, values) = reply.recv_timeout(WAIT).unwrap();
    assert_eq!(values, vec![8.0; 1024], "the receiver's stream waited for the sender's update");
    consumer.join().unwrap();
    steps.send(Step::Exit).unwrap();
    producer.join().unwrap();
}

/// Receives a tensor on a channel, exports it by hand (no message: its claim is the forwarder's
/// lease itself) and imports the payload back here: what it reads, or why it could not.
fn export_a_received_tensor_by_hand((rx, reply): (Receiver<GpuTensor<f32>>, Sender<Result<Vec<f32>, String>>)) {
    let t = rx.recv().unwrap();
    let read = t.ipc_payload().and_then(GpuTensor::<f32>::from_ipc_payload).and_then(|back| back.to_vec());
    reply.send(read.map_err(|e| e.to_string())).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_tensor_received_on_a_channel_exports_by_hand() {
    let _g = serial();
    let dev = gpu();
    let t = GpuTensor::<f32>::full(&dev, &[8], 2.5).unwrap();
    let (tx, rx) = channel().unwrap();
    let (reply_tx, reply) = channel().unwrap();
    let child = spawn((rx, reply_tx), export_a_received_tensor_by_hand);
    tx.send(t.clone()).unwrap();
    assert_eq!(reply.recv_timeout(WAIT).unwrap(), Ok(vec![2.5; 8]));
    child.join().unwrap();
}

/// Holds cuda-mp's stream through work it counts (a wait for a side stream held on a flag),
/// fills a tensor behind the hold and sends it; releases the hold when told; sends it again
/// after a synchronize; when told, fills it again and sends it after handing the stream out. Reports what it knew of
/// its stream at each step: idle after the first synchronize, busy after the fill, idle after
/// the second synchronize, and never known once the stream was handed out.
fn counted_producer((tx, release, report): (Sender<(GpuTensor<f32>, f32)>, Receiver<()>, Sender<Vec<bool>>)) {
    let dev = Device::get(0).unwrap();
    let t = GpuTensor::<f32>::zeros(&dev, &[1 << 20]).unwrap();
    let flag = GpuTensor::<i32>::zeros(&dev, &[1]).unwrap();
    let held = common::HeldStream::new(&dev, &flag);
    // Before the hold, the firsts that may wait for the device's queued work: the fill
    // kernel's first launch (its code is loaded then) and the first export (the segment's IPC
    // handle; this process's interprocess event too when the fill is still running).
    t.fill(0.0).unwrap();
    let warm_up = t.ipc_payload().unwrap();
    let mut known = Vec::new();
    dev.synchronize().unwrap();
    drop(warm_up);
    known.push(cuda_mp::testing::stream_known_idle(&dev));
    held.hold_counted_until(1);
    t.fill(5.0).unwrap();
    known.push(cuda_mp::testing::stream_known_idle(&dev));
    tx.send((t.clone(), 5.0)).unwrap();
    release.recv().unwrap();
    held.release(1);
    dev.synchronize().unwrap();
    known.push(cuda_mp::testing::stream_known_idle(&dev));
    tx.send((t.clone(), 5.0)).unwrap();
    // The receiver has checked both sends: the tensor may change.
    release.recv().unwrap();
    let _ = dev.stream();
    dev.synchronize().unwrap();
    known.push(cuda_mp::testing::stream_known_idle(&dev));
    t.fill(7.0).unwrap();
    tx.send((t.clone(), 7.0)).unwrap();
    report.send(known).unwrap();
}

/// Replies the waits owed on the tensors just received, then how many of their elements differ
/// from the values given beside them (counted on the GPU, behind those waits).
fn reply_owed_then_differing(reply: &Sender<i64>, checks: &[(&GpuTensor<f32>, f32)]) {
    let dev = Device::get(0).unwrap();
    reply.send(cuda_mp::testing::owed_waits(&dev) as i64).unwrap();
    let counter = GpuTensor::<i64>::zeros(&dev, &[1]).unwrap();
    for (t, value) in checks {
        t.count_not_equal(*value, &counter).unwrap();
    }
    reply.send(counter.to_vec().unwrap()[0]).unwrap();
}

/// For each tensor received: the waits its stream owes right after the receive (1 for fresh
/// memory whose sender's work was still queued), then how many elements differ from the value
/// sent with it.
fn owed_then_count((rx, reply): (Receiver<(GpuTensor<f32>, f32)>, Sender<i64>)) {
    while let Ok((t, value)) = rx.recv() {
        reply_owed_then_differing(&reply, &[(&t, value)]);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_send_knows_its_stream_idle_from_its_own_count_until_the_stream_is_handed_out() {
    let _g = serial();
    gpu();
    let (tx, rx) = channel().unwrap();
    let (reply_tx, reply) = channel().unwrap();
    let (report_tx, report) = channel().unwrap();
    let (release, release_rx) = channel().unwrap();
    let consumer = spawn((rx, reply_tx), owed_then_count);
    let producer = spawn((tx, release_rx, report_tx), counted_producer);
    let owed = reply.recv_timeout(WAIT).unwrap();
    assert_eq!(owed, 1, "the held work was counted: the send carried an event the receiver owes a wait on");
    // A receiver that did not wait would count the tensor's zeros in this time.
    std::thread::sleep(Duration::from_millis(300));
    release.send(()).unwrap();
    assert_eq!(reply.recv_timeout(WAIT).unwrap(), 0, "the receiver's count ran after the sender's fill");
    assert_eq!(reply.recv_timeout(WAIT).unwrap(), 0, "after a synchronize the send carries no event");
    assert_eq!(reply.recv_timeout(WAIT).unwrap(), 0);
    release.send(()).unwrap();
    reply.recv_timeout(WAIT).unwrap();
    assert_eq!(
        reply.recv_timeout(WAIT).unwrap(),
        0,
        "a send on a stream handed out asks the driver and orders the receiver after the fill"
    );
    let known = report.recv_timeout(WAIT).unwrap();
    assert_eq!(known, vec![true, false, true, false], "what the producer knew of its stream at each step");
    producer.join().unwrap();
    consumer.join().unwrap();
}

/// What a fresh process knows of its stream after each step: a fill, a copy from the host
/// (which waits for the stream), a fill, a copy to the host (which waits too), a fill, an
/// empty copy from the host (which waits all the same).
fn known_after_copies(_: ()) -> Vec<bool> {
    let dev = Device::get(0).unwrap();
    let t = GpuTensor::<f32>::zeros(&dev, &[1 << 20]).unwrap();
    let mut known = Vec::new();
    t.fill(1.0).unwrap();
    known.push(cuda_mp::testing::stream_known_idle(&dev));
    let small = GpuTensor::from_vec(&dev, &[4], vec![3f32; 4]).unwrap();
    known.push(cuda_mp::testing::stream_known_idle(&dev));
    t.fill(2.0).unwrap();
    known.push(cuda_mp::testing::stream_known_idle(&dev));
    let values = t.to_vec().unwrap();
    known.push(cuda_mp::testing::stream_known_idle(&dev));
    assert!(values.iter().all(|&x| x == 2.0), "the copy to the host came after the fill");
    assert_eq!(small.to_vec().unwrap(), vec![3.0; 4]);
    // An empty copy waits for the stream too: what it marks done is done.
    t.fill(4.0).unwrap();
    known.push(cuda_mp::testing::stream_known_idle(&dev));
    let empty = GpuTensor::<f32>::from_vec(&dev, &[0], Vec::new()).unwrap();
    known.push(cuda_mp::testing::stream_known_idle(&dev));
    // The driver agrees (asked last: handing the stream out ends the count's use).
    use cudarc::driver::sys;
    dev.context().bind_to_thread().unwrap();
    // SAFETY: the device's live stream, its context current.
    let query = unsafe { sys::cuStreamQuery(dev.stream().cu_stream()) };
    assert_eq!(query, sys::CUresult::CUDA_SUCCESS, "the stream known idle after the empty copy is idle");
    drop(empty);
    known
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_copy_to_or_from_the_host_leaves_the_stream_known_idle() {
    let _g = serial();
    gpu();
    let known = spawn((), known_after_copies).join().unwrap();
    assert_eq!(
        known,
        vec![false, true, false, true, false, true],
        "known idle after each step: fill, copy in, fill, copy out, fill, empty copy in"
    );
}

/// Two tensors in one message; serializing it holds the stream again (behind a second flag)
/// and fills the second tensor between the two exports, as a program's own `Serialize` may
/// queue work: the second must not ride on the first's record. The hold travels only on the
/// sending side.
struct FilledWhileSent(GpuTensor<f32>, GpuTensor<f32>, Option<Arc<cudarc::driver::CudaStream>>);

impl Serialize for FilledWhileSent {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{Error, SerializeTuple};
        let mut tuple = serializer.serialize_tuple(2)?;
        tuple.serialize_element(&self.0)?;
        if let Some(held) = &self.2 {
            // SAFETY: a live stream of the device's context.
            unsafe { self.1.device().wait_for_stream(held.cu_stream()) }.map_err(S::Error::custom)?;
        }
        self.1.fill(6.0).map_err(S::Error::custom)?;
        tuple.serialize_element(&self.1)?;
        tuple.end()
    }
}

impl<'de> Deserialize<'de> for FilledWhileSent {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let (a, b) = <(GpuTensor<f32>, GpuTensor<f32>)>::deserialize(deserializer)?;
        Ok(FilledWhileSent(a, b, None))
    }
}

/// Holds its stream through counted work (a wait for a side stream held until the flag is 1),
/// fills `a` with 5 and sends both tensors: the send holds the stream again (until the flag is
/// 2) and fills `b` with 6 between them. Sets the flag to 1, then 2, when told; ends at the
/// third word.
fn fill_while_sending((tx, release): (Sender<FilledWhileSent>, Receiver<()>)) {
    let dev = Device::get(0).unwrap();
    let a = GpuTensor::<f32>::zeros(&dev, &[1 << 20]).unwrap();
    let b = GpuTensor::<f32>::zeros(&dev, &[1 << 20]).unwrap();
    let flag = GpuTensor::<i32>::zeros(&dev, &[1]).unwrap();
    let held = common::HeldStream::new(&dev, &flag);
    a.fill(0.0).unwrap();
    let warm_up = a.ipc_payload().unwrap();
    dev.synchronize().unwrap();
    drop(warm_up);
    let second = held.side_held_until(2);
    held.hold_counted_until(1);
    a.fill(5.0).unwrap();
    tx.send(FilledWhileSent(a.clone(), b.clone(), Some(second))).unwrap();
    for value in [1, 2] {
        release.recv().unwrap();
        held.release(value);
    }
    dev.synchronize().unwrap();
    release.recv().unwrap();
}

/// Receives the two tensors; answers the waits owed, then how many elements of the first
/// differ from 5 and of the second from 6.
fn count_both((rx, reply): (Receiver<FilledWhileSent>, Sender<i64>)) {
    let FilledWhileSent(a, b, _) = rx.recv().unwrap();
    reply_owed_then_differing(&reply, &[(&a, 5.0), (&b, 6.0)]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn work_queued_between_the_tensors_of_one_message_is_waited_for() {
    let _g = serial();
    gpu();
    let (tx, rx) = channel().unwrap();
    let (reply_tx, reply) = channel().unwrap();
    let (release, release_rx) = channel().unwrap();
    let consumer = spawn((rx, reply_tx), count_both);
    let producer = spawn((tx, release_rx), fill_while_sending);
    assert_eq!(reply.recv_timeout(WAIT).unwrap(), 1, "the message carried the event, not complete");
    std::thread::sleep(Duration::from_millis(300));
    // The first hold ends: `a` is filled, `b` still held. A receiver waiting on a record
    // before `b`'s fill would count `b`'s zeros in this time.
    release.send(()).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    release.send(()).unwrap();
    assert_eq!(reply.recv_timeout(WAIT).unwrap(), 0, "both fills were done before the receiver's count");
    release.send(()).unwrap();
    producer.join().unwrap();
    consumer.join().unwrap();
}

/// Two small legacy allocations of their own (caching off), the second filled with 7.0 and
/// never sent; sends the first and the distance to the second, then waits to be told to go.
fn two_small_allocations((tx, go): (Sender<(GpuTensor<f32>, u64)>, Receiver<()>)) {
    let dev = Device::get(0).unwrap();
    dev.set_memory_kind(cuda_mp::GpuMemoryKind::Legacy);
    dev.set_caching(false);
    let sent = GpuTensor::<f32>::zeros(&dev, &[4]).unwrap();
    let unsent = GpuTensor::<f32>::full(&dev, &[4], 7.0).unwrap();
    dev.synchronize().unwrap();
    let distance = unsent.device_ptr().wrapping_sub(sent.device_ptr());
    tx.send((sent, distance)).unwrap();
    go.recv().unwrap();
    drop(unsent);
}

/// With caching off, each tensor is an allocation of its own, and its receiver maps nothing of
/// the sender's but that allocation: the driver may cut small allocations from one block, and a
/// handle to one maps the whole block (each allocation is therefore whole 2 MiB blocks).
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_receiver_of_one_small_allocation_maps_none_of_its_neighbours() {
    let _g = serial();
    let dev = gpu();
    let (tx, rx) = channel().unwrap();
    let (go_tx, go_rx) = channel().unwrap();
    let child = spawn((tx, go_rx), two_small_allocations);
    let (t, distance): (GpuTensor<f32>, u64) = rx.recv_timeout(WAIT).unwrap();
    let neighbour = t.device_ptr().wrapping_add(distance);
    dev.context().bind_to_thread().unwrap();
    let mut seen = [0f32; 4];
    // SAFETY: a copy of 16 bytes into `seen`; the driver refuses an address not mapped here.
    let read = unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut seen, neighbour) };
    go_tx.send(()).unwrap();
    drop(t);
    child.join().unwrap();
    assert!(
        read.is_err() || seen != [7.0; 4],
        "read {seen:?} of an allocation that was never sent ({distance} bytes on)"
    );
}
