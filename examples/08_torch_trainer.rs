//! 08: a PyTorch trainer publishes its weights to this Rust rollout process every step. The
//! trainer (`examples/08_torch_trainer.py`, started by this program) packs its state dict into
//! one cuda-mp allocation, updates it in place each step and sends it; this process receives a
//! `Bundle` on the trainer's memory, checks every element of every tensor, and acknowledges.
//!
//!     cargo run --release --example 08_torch_trainer            # needs a GPU, torch, the cuda_mp package
//!
//! The Python package must be importable (`pip install ./python`, or PYTHONPATH naming the
//! folder where it is installed).

mod common;

use common::{Outcome, PythonPeer, TIMEOUT};
use cuda_mp::{Bundle, HostTensor, Listener, Sender, bf16};

/// The value the trainer gives element `j` of tensor number `i` at `step`.
fn expected(i: usize, j: usize, step: i64) -> f32 {
    ((j % 7) + i) as f32 + step as f32
}

fn verify(b: &Bundle, step: i64) -> Outcome<usize> {
    let mut checked = 0;
    for (i, entry) in b.entries().iter().enumerate() {
        let values: Vec<f32> = match entry.dtype() {
            cuda_mp::DType::BF16 => b.get::<bf16>(entry.name())?.to_vec()?.into_iter().map(f32::from).collect(),
            cuda_mp::DType::F32 => b.get::<f32>(entry.name())?.to_vec()?,
            other => return Err(format!("tensor {} has element type {other}", entry.name()).into()),
        };
        for (j, v) in values.iter().enumerate() {
            if *v != expected(i, j, step) {
                return Err(
                    format!("step {step}: {}[{j}] is {v}, expected {}", entry.name(), expected(i, j, step)).into()
                );
            }
        }
        checked += values.len();
    }
    Ok(checked)
}

fn run() -> Outcome {
    common::require_gpu()?;
    let steps: i64 = common::arg("--steps", 5)?;
    let weights = Listener::<Bundle>::bind()?;
    let mut trainer = PythonPeer::start("examples/08_torch_trainer.py", &[weights.name(), &steps.to_string()])?;
    let acks = Sender::<HostTensor<i64>>::connect(&trainer.line_after("LISTEN ")?)?;
    let rx = weights.accept_timeout(TIMEOUT)?;
    for step in 1..=steps {
        let bundle = rx.recv_timeout(TIMEOUT)?;
        let checked = verify(&bundle, step)?;
        println!(
            "rollout: step {step}: {} tensors, {checked} elements checked, {} allocation(s)",
            bundle.len(),
            bundle.allocations()
        );
        acks.send(HostTensor::from_vec(&[2], vec![step, checked as i64])?)?;
    }
    drop(acks);
    trainer.finish()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    common::verdict(run(), "the Rust rollout read every element of every step the PyTorch trainer published")
}
