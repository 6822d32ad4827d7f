//! 13: a pool of worker processes computes in place on one host tensor of this process. Each
//! job gets a view of a block of rows and squares it: the workers write disjoint parts of the
//! same shared memory, nothing is copied, and nothing needs to be sent back. Runs without a GPU.
//!
//!     cargo run --release --example 13_host_pool

mod common;

use std::collections::BTreeSet;

use common::{Outcome, TIMEOUT};
use cuda_mp::{HostTensor, Pool};

const WORKERS: usize = 4;
const BLOCKS: usize = 12;
const ROWS: usize = 64;
const COLS: usize = 256;

/// Squares every element of its block in place and says which process did it.
fn job(block: HostTensor<f32>) -> u32 {
    block.map_inplace(|x| x * x);
    std::process::id()
}

fn run() -> Outcome {
    // Whole numbers below 1000, whose squares f32 holds exactly.
    let values: Vec<f32> = (0..BLOCKS * ROWS * COLS).map(|i| (i % 1000) as f32).collect();
    let t = HostTensor::from_vec(&[BLOCKS * ROWS, COLS], values.clone())?;
    let pool = Pool::new(WORKERS)?;
    let mut handles = Vec::new();
    for b in 0..BLOCKS {
        handles.push(pool.spawn(t.narrow(0, b * ROWS, ROWS)?, job));
    }
    let mut pids = BTreeSet::new();
    for (b, mut h) in handles.into_iter().enumerate() {
        let pid = h.join_timeout(TIMEOUT)?;
        pids.insert(pid);
        println!("block {b:2}: rows {:3}..{:3} squared in place by worker {pid}", b * ROWS, (b + 1) * ROWS);
    }
    pool.shutdown();
    println!("{BLOCKS} jobs ran on {} worker processes", pids.len());
    let squared = t.to_vec().iter().zip(&values).all(|(now, was)| *now == was * was);
    common::ensure(squared, "the shared tensor does not hold the squares")
}

#[cuda_mp::main]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    common::verdict(run(), "the pool squared every block of this process's shared memory in place")
}
