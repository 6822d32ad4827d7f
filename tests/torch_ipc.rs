//! PyTorch's own CUDA IPC handles between cuda-mp processes: a handle made with
//! `to_torch_ipc` opened with `from_torch_ipc` in another process, sent on from there with
//! cuda-mp, and released through PyTorch's reference counter. These need a CUDA GPU: they are
//! ignored by a plain `cargo test` and fail with a clear message when run where no GPU is
//! usable. (The tests against PyTorch itself are python/tests/test_torch_handles.py.)

use std::io::{Read, Seek, SeekFrom};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cuda_mp::{
    DType, Device, DynTensor, Error, GpuStorage, GpuTensor, Layout, Receiver, Sender, TorchIpcHandle, channel, spawn,
    torch_ipc_stats, wait_for_lifetime,
};

mod common;

cuda_mp::enable_test_support!();

static SERIAL: Mutex<()> = Mutex::new(());
const WAIT: Duration = Duration::from_secs(60);

fn serial() -> std::sync::MutexGuard<'static, ()> {
    common::serial(&SERIAL, WAIT)
}

use common::gpu;

/// A handle as it travels in these tests: its eight values.
type Fields = (usize, Vec<u8>, u64, u64, Vec<u8>, u64, Vec<u8>, bool);

fn fields(h: &TorchIpcHandle) -> Fields {
    (
        h.device,
        h.handle.clone(),
        h.storage_bytes,
        h.storage_offset_bytes,
        h.ref_counter.clone(),
        h.ref_counter_slot,
        h.event_handle.clone(),
        h.event_sync_required,
    )
}

fn handle(
    (device, handle, storage_bytes, storage_offset_bytes, ref_counter, slot, event_handle, sync): Fields,
) -> TorchIpcHandle {
    TorchIpcHandle {
        device,
        handle,
        storage_bytes,
        storage_offset_bytes,
        ref_counter,
        ref_counter_slot: slot,
        event_handle,
        event_sync_required: sync,
    }
}

/// The value of a slot of a reference-counter file, or None once the file is gone.
fn slot_value(h: &TorchIpcHandle) -> Option<i64> {
    let path = format!("/dev/shm{}", String::from_utf8_lossy(&h.ref_counter));
    let mut f = std::fs::File::open(path).ok()?;
    f.seek(SeekFrom::Start(64 + 8 * h.ref_counter_slot)).unwrap();
    let mut b = [0u8; 8];
    f.read_exact(&mut b).unwrap();
    Some(i64::from_ne_bytes(b))
}

fn wait_until(what: &str, condition: impl Fn() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Opens PyTorch's handle (after two failed tries, which must leave its slot alone), sends the
/// tensor on to another process, drops its own, and stays until told to quit.
fn opener((rx, on, reply, quit): (Receiver<Fields>, Sender<DynTensor<GpuStorage>>, Sender<String>, Receiver<()>)) {
    let h = handle(rx.recv().unwrap());
    let check = || -> Result<(), String> {
        let mut past = h.clone();
        past.storage_offset_bytes = 1 << 40;
        match GpuStorage::from_torch_ipc(&past) {
            Err(Error::Malformed(_)) => {}
            other => return Err(format!("a storage past its block: {other:?}")),
        }
        let mut forged = h.clone();
        forged.handle = vec![0; 64];
        if GpuStorage::from_torch_ipc(&forged).is_ok() {
            return Err("a forged handle was opened".into());
        }
        let storage = GpuStorage::from_torch_ipc(&h).map_err(|e| e.to_string())?;
        match GpuStorage::from_torch_ipc(&h) {
            Err(Error::Malformed(m)) if m.contains("rebuilt once") => {}
            other => return Err(format!("the same share twice: {other:?}")),
        }
        let t = DynTensor::new(storage, Layout::contiguous(&[4, 8]).unwrap(), DType::F32).map_err(|e| e.to_string())?;
        on.send(t).map_err(|e| e.to_string())
    };
    reply
        .send(match check() {
            Ok(()) => "sent".into(),
            Err(e) => e,
        })
        .unwrap();
    let _ = quit.recv();
}

/// Adds one to the tensor it receives, reports it, and drops it when told.
fn writer((rx, reply, drop_now): (Receiver<DynTensor<GpuStorage>>, Sender<Vec<f32>>, Receiver<()>)) {
    let t = rx.recv().unwrap().typed::<f32>().unwrap();
    t.add_scalar(1.0).unwrap();
    t.synchronize().unwrap();
    reply.send(t.to_vec().unwrap()).unwrap();
    drop_now.recv().unwrap();
    drop(t);
    reply.send(Vec::new()).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_torch_handle_is_opened_elsewhere_sent_on_and_released_once() {
    let dev = gpu();
    let _g = serial();
    // PyTorch opens legacy handles only; VMM segments are the default where the GPU has VMM.
    dev.set_segment_kind(cuda_mp::GpuMemoryKind::Legacy).unwrap();
    let before = torch_ipc_stats();
    let live_before = cuda_mp::lifetime_stats().live_storages;
    let data: Vec<f32> = (0..32).map(|x| x as f32).collect();
    let t = GpuTensor::from_vec(&dev, &[4, 8], data.clone()).unwrap();
    t.add_scalar(0.0).unwrap(); // work queued: the handle carries an event
    let dynamic: DynTensor<GpuStorage> = t.clone().into();
    let h = dynamic.storage().to_torch_ipc().unwrap();
    assert_eq!((h.handle.len(), h.storage_bytes, h.storage_offset_bytes), (64, 128, 0));
    assert_eq!(h.event_handle.len(), 64);
    assert_eq!(slot_value(&h), Some(1), "a fresh slot set to 1");
    assert_eq!(torch_ipc_stats().outstanding, before.outstanding + 1);
    drop(dynamic);

    let (fields_tx, fields_rx) = channel().unwrap();
    let (on_tx, on_rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let (quit_tx, quit_rx) = channel().unwrap();
    let (values_tx, values_rx) = channel().unwrap();
    let (drop_tx, drop_rx) = channel().unwrap();
    let a = spawn((fields_rx, on_tx, reply_tx, quit_rx), opener);
    let b = spawn((on_rx, values_tx, drop_rx), writer);
    fields_tx.send(fields(&h)).unwrap();
    assert_eq!(reply_rx.recv_timeout(WAIT).unwrap(), "sent");
    let plus_one: Vec<f32> = data.iter().map(|x| x + 1.0).collect();
    assert_eq!(values_rx.recv_timeout(WAIT).unwrap(), plus_one, "the third process wrote the memory");
    assert_eq!(t.to_vec().unwrap(), plus_one, "the write is seen here");
    // The opener dropped its tensor, but the writer's lease keeps its storage, and so the slot.
    assert_eq!(slot_value(&h), Some(1), "released while a cuda-mp receiver holds the storage");
    assert_eq!(torch_ipc_stats().outstanding, before.outstanding + 1);
    drop_tx.send(()).unwrap();
    assert_eq!(values_rx.recv_timeout(WAIT).unwrap(), Vec::<f32>::new());
    wait_until("the share to be released", || torch_ipc_stats().outstanding == before.outstanding);
    assert!(matches!(slot_value(&h), None | Some(0)), "released exactly once: {:?}", slot_value(&h));
    assert_eq!(torch_ipc_stats().released, before.released + 1);
    drop(t);
    wait_for_lifetime(WAIT, |s| s.live_storages == live_before).expect("the storage is freed once released");
    quit_tx.send(()).unwrap();
    a.join().unwrap();
    b.join().unwrap();
    dev.set_segment_kind(cuda_mp::GpuMemoryKind::Auto).unwrap();
}

/// Sends a tensor of its own, and keeps it until told.
fn send_one((tx, done): (Sender<GpuTensor<f32>>, Receiver<()>)) {
    let dev = Device::get(0).unwrap();
    tx.send(GpuTensor::<f32>::zeros(&dev, &[8]).unwrap()).unwrap();
    done.recv().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn received_vmm_and_empty_storages_to_pytorch() {
    let dev = gpu();
    let _g = serial();
    let (tx, rx) = channel().unwrap();
    let (done_tx, done_rx) = channel().unwrap();
    let child = spawn((tx, done_rx), send_one);
    let received: DynTensor<GpuStorage> = rx.recv_timeout(WAIT).unwrap().into();
    let e = received.storage().to_torch_ipc().unwrap_err();
    assert!(matches!(&e, Error::Unsupported(m) if m.contains("another process")), "{e}");
    drop(received);
    done_tx.send(()).unwrap();
    child.join().unwrap();
    if dev.supports_memory_kind(cuda_mp::GpuMemoryKind::Vmm).unwrap() {
        dev.set_memory_kind(cuda_mp::GpuMemoryKind::Vmm);
        let v: DynTensor<GpuStorage> = GpuTensor::<f32>::zeros(&dev, &[16]).unwrap().into();
        dev.set_memory_kind(cuda_mp::GpuMemoryKind::Auto);
        let e = v.storage().to_torch_ipc().unwrap_err();
        assert!(matches!(&e, Error::Unsupported(m) if m.contains("vmm")), "{e}");
    }
    // An empty storage shares nothing and holds nothing, whatever its memory (here a block of
    // the default segments: VMM where the device has it).
    let before = torch_ipc_stats();
    let empty: DynTensor<GpuStorage> = GpuTensor::<f32>::zeros(&dev, &[0]).unwrap().into();
    let h = empty.storage().to_torch_ipc().unwrap();
    assert!(h.handle.is_empty() && h.ref_counter.is_empty() && !h.event_sync_required);
    assert_eq!(torch_ipc_stats().outstanding, before.outstanding);
    let back = GpuStorage::from_torch_ipc(&h).unwrap();
    assert_eq!(back.byte_len(), 0);
}
