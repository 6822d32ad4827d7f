//! 01: the main demo. Hand a tensor to a worker process through a channel, let it add 1 in
//! place, and see the change here. The worker maps the same memory; nothing is copied.
//!
//! With a CUDA GPU the tensor lives on the GPU (shared through CUDA IPC); without one, this
//! says so and does the same handoff with a host tensor in shared memory.
//!
//!     cargo run --release --example 01_queue_handoff
//!
//! cuda-mp reports what it does as `tracing` events, silent unless a subscriber is installed;
//! this example installs one that reads `RUST_LOG`:
//!
//!     RUST_LOG=cuda_mp=debug cargo run --release --example 01_queue_handoff

mod common;

use common::{Outcome, TIMEOUT};
use cuda_mp::{Device, GpuTensor, HostTensor, Receiver, channel, cuda_available, spawn};
use tracing_subscriber::EnvFilter;

/// Prints cuda-mp's events to stderr as `RUST_LOG` asks (nothing when it is unset). A worker is
/// a fresh run of this program that does not run `main`, so each worker calls this too.
fn log_from_env() {
    let filter = EnvFilter::from_default_env();
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

fn gpu_worker(rx: Receiver<GpuTensor<f32>>) {
    log_from_env();
    let t = rx.recv().expect("receive the tensor");
    t.add_scalar(1.0).expect("add 1 on the gpu");
    // The parent reads after this process ends, so the kernel must be done by then.
    t.synchronize().expect("finish the kernel");
}

fn host_worker(rx: Receiver<HostTensor<f32>>) {
    log_from_env();
    let t = rx.recv().expect("receive the tensor");
    t.map_inplace(|x| x + 1.0);
}

/// Sends the values as a GPU tensor to a worker and reads them back once it is done.
fn gpu_handoff(values: &[f32]) -> Outcome<Vec<f32>> {
    let dev = Device::get(0)?;
    println!("GPU {} ({})", dev.ordinal(), dev.uuid_string());
    let t = GpuTensor::from_vec(&dev, &[4, 5], values.to_vec())?;
    let (tx, rx) = channel()?;
    let mut child = spawn(rx, gpu_worker);
    tx.send(t.clone())?;
    child.join_timeout(TIMEOUT)?;
    Ok(t.to_vec()?)
}

/// The same with a host tensor in shared memory.
fn host_handoff(values: &[f32]) -> Outcome<Vec<f32>> {
    let t = HostTensor::from_vec(&[4, 5], values.to_vec())?;
    let (tx, rx) = channel()?;
    let mut child = spawn(rx, host_worker);
    tx.send(t.clone())?;
    child.join_timeout(TIMEOUT)?;
    Ok(t.to_vec())
}

fn mean(v: &[f32]) -> f64 {
    v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64
}

fn run() -> Outcome {
    let before = common::random_values(20);
    let after = if cuda_available() {
        gpu_handoff(&before)?
    } else {
        let why = Device::count().err().map(|e| e.to_string()).unwrap_or_else(|| "no GPU is visible".into());
        println!("notice: no CUDA GPU ({why}); doing the same handoff with host tensors in shared memory");
        host_handoff(&before)?
    };
    let (b, a) = (mean(&before), mean(&after));
    println!("mean before: {b:.6}  mean after: {a:.6}  (rose by {:.6})", a - b);
    common::ensure(before.iter().zip(&after).all(|(b, a)| *a == *b + 1.0), "elements did not rise by exactly 1")
}

#[cuda_mp::main]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    log_from_env();
    common::verdict(run(), "the worker's in-place add is visible here, every element exactly +1")
}
