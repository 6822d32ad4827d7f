//! 06: a trainer updates a bundle of weights in place each step and publishes it to two
//! rollout processes, which check that they read exactly that step's weights. The whole bundle
//! is one allocation: each rollout opens its handle once, and every re-publish opens nothing.
//! Needs a CUDA GPU.
//!
//!     cargo run --release --example 06_weight_sync

mod common;

use std::time::Instant;

use common::{Outcome, TIMEOUT};
use cuda_mp::{Bundle, BundleBuilder, Device, Receiver, Sender, bf16, channel, lifetime_stats, spawn};

const STEPS: i64 = 5;
const LAYERS: usize = 8;

fn names() -> Vec<String> {
    (0..LAYERS).flat_map(|l| [format!("layers.{l}.weight"), format!("layers.{l}.bias")]).collect()
}

/// Checks every element of every tensor against the published step.
fn rollout((rx, reply): (Receiver<Bundle>, Sender<Result<(i64, u64), String>>)) {
    let mut weights = None;
    while let Ok(b) = rx.recv() {
        let check = || -> cuda_mp::Result<i64> {
            let step = b.get::<i64>("step")?.to_vec()?[0];
            for n in names() {
                let bad = b.get::<bf16>(&n)?.to_vec()?.iter().filter(|x| x.to_f32() != step as f32).count();
                if bad > 0 {
                    return Err(cuda_mp::Error::Unsupported(format!("{n}: {bad} elements are not step {step}")));
                }
            }
            Ok(step)
        };
        let r = check().map(|s| (s, lifetime_stats().opened_mappings)).map_err(|e| e.to_string());
        weights = Some(b); // keep the latest weights, as a rollout worker would
        if reply.send(r).is_err() {
            break;
        }
    }
    drop(weights);
}

fn run() -> Outcome {
    common::require_gpu()?;
    let dev = Device::get(0)?;
    let mut builder = BundleBuilder::new();
    for (i, n) in names().into_iter().enumerate() {
        builder = if i % 2 == 0 { builder.add::<bf16>(n, &[1024, 1024]) } else { builder.add::<bf16>(n, &[1024]) };
    }
    let weights = builder.add::<i64>("step", &[1]).build(&dev)?;
    println!("trainer: {} tensors, {:.1} MB in one allocation", weights.len(), weights.byte_len() as f64 / 1e6);
    let mut rollouts = Vec::new();
    for _ in 0..2 {
        let (tx, rx) = channel()?;
        let (reply_tx, reply_rx) = channel()?;
        rollouts.push((tx, reply_rx, spawn((rx, reply_tx), rollout)));
    }
    let mut ok = true;
    for step in 1..=STEPS {
        for n in names() {
            weights.get::<bf16>(&n)?.fill(bf16::from_f32(step as f32))?; // the in-place update
        }
        weights.get::<i64>("step")?.fill(step)?;
        let start = Instant::now();
        for (tx, _, _) in &rollouts {
            tx.send(weights.clone())?;
        }
        for (r, (_, reply, _)) in rollouts.iter().enumerate() {
            match reply.recv_timeout(TIMEOUT)? {
                Ok((seen, opened)) => {
                    println!("step {step}: rollout {r} read step {seen} weights, handles opened so far: {opened}");
                    ok &= seen == step && opened == 1;
                }
                Err(e) => {
                    println!("step {step}: rollout {r} failed: {e}");
                    ok = false;
                }
            }
        }
        println!("step {step}: published and verified by both in {:.2} ms", start.elapsed().as_secs_f64() * 1e3);
    }
    for (tx, _, child) in rollouts {
        drop(tx);
        child.join()?;
    }
    common::ensure(ok, "a rollout read the wrong weights or reopened the bundle")
}

#[cuda_mp::main]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    common::verdict(run(), "both rollouts read exactly each step's weights, one handle each")
}
