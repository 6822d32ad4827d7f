//! 09: a Rust producer hands a GPU tensor to a PyTorch consumer (`examples/09_rust_to_torch.py`,
//! started by this program), which computes on it in place (`t.mul_(2).add_(1)`) on torch's
//! stream; the producer then sees the result in its own memory.
//!
//!     cargo run --release --example 09_rust_to_torch            # needs a GPU, torch, the cuda_mp package

mod common;

use common::{Outcome, PythonPeer, TIMEOUT};
use cuda_mp::{Device, GpuTensor, HostTensor, Listener, Sender};

fn run() -> Outcome {
    common::require_gpu()?;
    let dev = Device::get(0)?;
    let n = 1 << 20;
    let t = GpuTensor::<f32>::from_vec(&dev, &[1024, n / 1024], (0..n).map(|i| i as f32).collect())?;
    let acks = Listener::<HostTensor<f64>>::bind()?;
    let mut consumer = PythonPeer::start("examples/09_rust_to_torch.py", &[acks.name()])?;
    let tx = Sender::<GpuTensor<f32>>::connect(&consumer.line_after("LISTEN ")?)?;
    let acks = acks.accept_timeout(TIMEOUT)?;
    // The whole tensor, then a strided view of it (rows 10..20, transposed).
    tx.send(t.clone())?;
    let sum = acks.recv_timeout(TIMEOUT)?.to_vec()[0];
    let view = t.narrow(0, 10, 10)?.transpose(0, 1)?;
    tx.send(view.clone())?;
    let view_sum = acks.recv_timeout(TIMEOUT)?.to_vec()[0];
    drop(tx);
    consumer.finish()?;
    let now = t.to_vec()?;
    let rows_10_to_20 = 10 * 1024..20 * 1024;
    for (i, v) in now.iter().enumerate() {
        let once = 2.0 * i as f32 + 1.0;
        let want = if rows_10_to_20.contains(&i) { 2.0 * once + 1.0 } else { once };
        common::ensure(*v == want, &format!("element {i} is {v}, expected {want}"))?;
    }
    println!("producer: torch's sums {sum} and {view_sum}; every element of this process's memory as expected");
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    common::verdict(
        run(),
        "PyTorch computed in place on the Rust producer's GPU memory, twice, and the producer saw it",
    )
}
