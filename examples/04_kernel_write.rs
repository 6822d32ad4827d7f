//! 04: a kernel in another process writes this process's GPU memory. The sender fills
//! 0, 1, 2, ... on the GPU; the receiver runs a kernel that adds 100 in place to the sender's
//! memory; the sender reads back 100, 101, 102, ... Needs a CUDA GPU.
//!
//!     cargo run --release --example 04_kernel_write

mod common;

use common::{Outcome, TIMEOUT};
use cuda_mp::{Device, GpuTensor, Receiver, Sender, channel, spawn};

const N: usize = 1 << 20;

fn receiver((rx, done): (Receiver<GpuTensor<i32>>, Sender<u64>)) {
    let t = rx.recv().expect("receive");
    println!("receiver: mapped {} elements at device address {:#x}", t.numel(), t.device_ptr());
    // The add kernel is queued on the device stream, after the wait on the sender's event.
    t.add_scalar(100.0).expect("launch the kernel");
    t.synchronize().expect("finish the kernel");
    done.send(t.device_ptr()).expect("report");
}

fn run() -> Outcome {
    common::require_gpu()?;
    let dev = Device::get(0)?;
    let t = GpuTensor::from_vec(&dev, &[N], (0..N as i32).collect())?;
    let (tx, rx) = channel()?;
    let (done_tx, done_rx) = channel()?;
    let child = spawn((rx, done_tx), receiver);
    tx.send(t.clone())?;
    done_rx.recv_timeout(TIMEOUT)?;
    child.join()?;
    let back = t.to_vec()?;
    println!("sender: first values {:?} ... last {}", &back[..5], back[N - 1]);
    common::ensure(back.iter().enumerate().all(|(i, &v)| v == i as i32 + 100), "wrong values")
}

#[cuda_mp::main]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    common::verdict(run(), "the receiver's kernel wrote i + 100 into the sender's memory")
}
