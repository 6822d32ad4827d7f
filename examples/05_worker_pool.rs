//! 05: a pool of worker processes receives GPU tensors, computes on them in place and returns
//! them: the returned tensors are the parent's own memory, not copies. Needs a CUDA GPU;
//! 13_host_pool does the same kind of work on host tensors.
//!
//!     cargo run --release --example 05_worker_pool

mod common;

use common::Outcome;
use cuda_mp::{Device, GpuTensor, Pool};

const WORKERS: usize = 4;
const JOBS: usize = 12;

/// Adds `k` to every element in place and hands the tensor back.
fn job((t, k): (GpuTensor<f32>, f64)) -> (u32, GpuTensor<f32>) {
    t.add_scalar(k).expect("add on the gpu");
    t.synchronize().expect("finish before returning");
    (std::process::id(), t)
}

fn run() -> Outcome {
    common::require_gpu()?;
    let dev = Device::get(0)?;
    let pool = Pool::new(WORKERS)?;
    let inputs: Vec<GpuTensor<f32>> =
        (0..JOBS).map(|i| GpuTensor::full(&dev, &[256, 256], i as f32)).collect::<Result<_, _>>()?;
    let handles: Vec<_> =
        inputs.iter().enumerate().map(|(i, t)| pool.spawn((t.clone(), i as f64 * 10.0), job)).collect();
    let mut pids = std::collections::BTreeSet::new();
    let mut ok = true;
    for (i, h) in handles.into_iter().enumerate() {
        let (pid, back) = h.join()?;
        pids.insert(pid);
        let expected = i as f32 * 11.0;
        let same_memory = back.shares_storage_with(&inputs[i]);
        let values_ok = inputs[i].to_vec()?.iter().all(|&x| x == expected);
        println!(
            "job {i:2}: worker {pid}, every element {expected}: {values_ok}, returned the same memory: {same_memory}"
        );
        ok &= same_memory && values_ok;
    }
    println!("{} jobs ran on {} worker processes", JOBS, pids.len());
    pool.shutdown();
    common::ensure(ok && pids.len() > 1, "wrong values, copies or a single worker")
}

#[cuda_mp::main]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    common::verdict(run(), "the pool computed in place on the parent's GPU memory")
}
