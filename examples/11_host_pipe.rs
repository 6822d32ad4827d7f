//! 11: a two-way pipe between this process and a worker, carrying host tensors. Each round
//! trip sends a tensor in shared memory; the worker doubles it in place and sends it back, and
//! what comes back is this process's own memory, not a copy. Runs without a GPU.
//!
//!     cargo run --release --example 11_host_pipe

mod common;

use std::time::Instant;

use common::{Outcome, TIMEOUT};
use cuda_mp::{Duplex, HostTensor, pipe, spawn};

const ROUNDS: usize = 3;

/// Doubles every tensor it receives and returns it, until the parent closes its end.
fn worker(end: Duplex<HostTensor<f32>, HostTensor<f32>>) {
    while let Ok(t) = end.recv() {
        t.map_inplace(|x| 2.0 * x);
        if end.send(t).is_err() {
            break;
        }
    }
}

fn run() -> Outcome {
    let values = common::random_values(1 << 16);
    let t = HostTensor::from_vec(&[256, 256], values.clone())?;
    let (here, there) = pipe()?;
    let mut child = spawn(there, worker);
    for round in 1..=ROUNDS {
        let start = Instant::now();
        here.send(t.clone())?;
        let back = here.recv_timeout(TIMEOUT)?;
        let elapsed = start.elapsed();
        common::ensure(back.shares_storage_with(&t), "the worker returned a copy, not the same memory")?;
        println!("round {round}: {:?} sent, doubled and returned in {elapsed:?}: the same memory", back.shape());
    }
    // The worker's loop ends when this end is gone.
    drop(here);
    child.join_timeout(TIMEOUT)?;
    let factor = (1 << ROUNDS) as f32;
    common::ensure(
        t.to_vec().iter().zip(&values).all(|(now, was)| *now == factor * was),
        &format!("the elements are not {factor} times what they were"),
    )
}

#[cuda_mp::main]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    common::verdict(run(), "each round trip through the pipe doubled this process's shared memory in place")
}
