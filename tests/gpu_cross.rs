//! Cross-GPU handoff through peer access. Needs two CUDA GPUs with peer access, except the
//! same-GPU case; all are ignored by a plain `cargo test`.

use std::sync::Arc;
use std::time::Duration;

use common::gpus;
use cuda_mp::{Device, GpuTensor, IpcPayload, Receiver, Sender, channel, spawn};

mod common;

cuda_mp::enable_test_support!();

const WAIT: Duration = Duration::from_secs(60);

/// Maps the payload on `access`, checks it holds 0, 1, 2, ..., adds 1000 there, and copies the
/// result into memory of its own on `access` to read it back.
fn map_check_add((rx, access, reply): (Receiver<IpcPayload>, usize, Sender<Result<Vec<f32>, String>>)) {
    let r = (|| -> cuda_mp::Result<Vec<f32>> {
        let dev = Device::get(access)?;
        let p = rx.recv().map_err(|e| cuda_mp::Error::Malformed(e.to_string()))?;
        let t = GpuTensor::<f32>::from_ipc_payload_on(p, &dev)?;
        let seen = t.to_vec()?;
        if seen.iter().enumerate().any(|(i, &v)| v != i as f32) {
            return Err(cuda_mp::Error::Unsupported("the receiver read values the sender had not finished".into()));
        }
        t.add_scalar(1000.0)?;
        let local = GpuTensor::<f32>::zeros(&dev, t.shape())?;
        local.copy_from(&t)?;
        local.to_vec()
    })();
    let _ = reply.send(r.map_err(|e| e.to_string()));
}

fn handoff(src: &Arc<Device>, access: usize) {
    let n = 1 << 16;
    let t = GpuTensor::<f32>::zeros(src, &[n]).unwrap();
    let values = GpuTensor::from_vec(src, &[n], (0..n).map(|i| i as f32).collect()).unwrap();
    // Queued, maybe not finished when sent: the receiver waits for it through the event.
    t.copy_from(&values).unwrap();
    let (tx, rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let child = spawn((rx, access, reply_tx), map_check_add);
    tx.send(t.ipc_payload().unwrap()).unwrap();
    let seen = reply_rx.recv_timeout(WAIT).unwrap().unwrap();
    child.join().unwrap();
    drop(values);
    let expect: Vec<f32> = (0..n).map(|i| i as f32 + 1000.0).collect();
    assert_eq!(seen, expect, "the receiver's copy on gpu {access}");
    assert_eq!(t.to_vec().unwrap(), expect, "the sender's memory on gpu {}", src.ordinal());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn mapping_on_the_owners_gpu_through_the_peer_path_works() {
    let devs = gpus(1);
    handoff(&devs[0], 0);
}

#[test]
#[ignore = "needs two CUDA GPUs with peer access"]
fn cross_gpu_handoff_in_both_directions() {
    let devs = gpus(2);
    devs[1].require_peer_access(&devs[0]).unwrap();
    devs[0].require_peer_access(&devs[1]).unwrap();
    handoff(&devs[0], 1);
    handoff(&devs[1], 0);
}

#[test]
#[ignore = "needs two CUDA GPUs with peer access"]
fn peer_copy_between_gpus_in_one_process() {
    let devs = gpus(2);
    let a = GpuTensor::from_vec(&devs[0], &[2, 3], vec![1i32, 2, 3, 4, 5, 6]).unwrap();
    let b = GpuTensor::<i32>::zeros(&devs[1], &[2, 3]).unwrap();
    b.copy_from(&a).unwrap();
    assert_eq!(b.to_vec().unwrap(), vec![1, 2, 3, 4, 5, 6]);
    let t = GpuTensor::<i32>::zeros(&devs[1], &[3, 2]).unwrap();
    assert!(t.copy_from(&a.transpose(0, 1).unwrap()).is_err(), "strided views do not copy between gpus");
}
