//! 15: a trainer publishes 7B-shaped weights (291 bf16 tensors, 13.5 GB) to a rollout engine on
//! another host at each step, through remote channels: the control messages on TCP, the
//! weights' bytes by NCCL, and the rollout checks every element. Here the two "hosts" are two
//! processes on GPUs 0 and 1 of one machine: `network_only` makes them take the route two hosts
//! take, and `--nccl-network` forces NCCL onto its network transport (sockets) instead of
//! NVLink. Needs two CUDA GPUs and NCCL.
//!
//!     cargo run --release --example 15_cross_host_weights -- --nccl-network --steps 3
//!
//! On two real hosts the rollout binds `0.0.0.0:PORT`, the trainer connects to
//! `rollout-host:PORT`, both ends hold the same secret (`CUDA_MP_REMOTE_SECRET`, or
//! `RemoteOptions::secret` as here), and `network_only` is left out: two hosts are always on
//! the network route, and one host's processes share memory instead.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Instant;

use common::{Outcome, TIMEOUT};
use cuda_mp::{Bundle, BundleBuilder, Device, GpuTensor, Receiver, RemoteListener, RemoteOptions, Sender, bf16, spawn};
use serde::{Deserialize, Serialize};

/// What the rollout tells the trainer, on a remote channel of its own.
#[derive(Serialize, Deserialize)]
enum Report {
    /// Where to send the weights.
    Listening(SocketAddr),
    /// Every element of step `step`'s weights checked: `mismatches` were wrong.
    Checked {
        step: u32,
        mismatches: u64,
    },
    Failed(String),
}

/// The value of element `j` of tensor `i` at `step`: exact in bf16 (integers up to 70).
fn expected(i: usize, j: usize, step: u32) -> f32 {
    ((j % 64) + i % 5 + step as usize) as f32
}

fn options() -> RemoteOptions {
    // Two processes of one machine standing in for two hosts: take the network route. Both
    // prove the secret (here a fixed one; on real hosts, one generated and handed out once).
    RemoteOptions::default().network_only(true).secret(b"example 15: a secret both hosts hold")
}

/// The first sender that proves the secret. A peer that does not (a port scanner, a host
/// without the secret, a sender of another message type) is refused and reported, and the
/// listener goes on listening: an open port must not let a stranger end the run.
fn accept_proven<T: Serialize + serde::de::DeserializeOwned + 'static>(
    listener: &RemoteListener<T>,
) -> cuda_mp::Result<Receiver<T>> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        match listener.accept_timeout(deadline.saturating_duration_since(Instant::now())) {
            Err(refused @ (cuda_mp::Error::Unsupported(_) | cuda_mp::Error::Malformed(_))) => {
                eprintln!("refused a peer: {refused}");
            }
            accepted => return accepted,
        }
    }
}

/// The rollout engine, on GPU 1: receives each step's weights and checks every element.
fn rollout(trainer: SocketAddr) {
    let reports = Sender::<Report>::connect_remote_with(trainer, options()).expect("reach the trainer");
    let run = || -> cuda_mp::Result<()> {
        let listener = RemoteListener::<(u32, Bundle)>::bind_with("127.0.0.1:0", options().device(1))?;
        reports
            .send(Report::Listening(listener.local_addr()?))
            .map_err(|e| cuda_mp::Error::Send(e.failure().clone()))?;
        let weights = accept_proven(&listener)?;
        for received in weights.iter_results() {
            let (step, bundle) = received?;
            let mismatches = check(&bundle, step)?;
            let _ = reports.send(Report::Checked { step, mismatches });
        }
        Ok(())
    };
    if let Err(e) = run() {
        let _ = reports.send(Report::Failed(e.to_string()));
    }
}

/// Counts the elements of `bundle` that are not step `step`'s, on all cores.
fn check(bundle: &Bundle, step: u32) -> cuda_mp::Result<u64> {
    let mut mismatches = 0;
    for (i, (name, _)) in common::llama7b_shapes().iter().enumerate() {
        let t = bundle.get::<bf16>(name)?;
        if t.device().ordinal() != 1 {
            return Err(cuda_mp::Error::Unsupported(format!("{name} arrived on gpu {}", t.device().ordinal())));
        }
        let values = t.to_vec()?;
        let chunk = values.len().div_ceil(16).max(1);
        mismatches += std::thread::scope(|s| {
            let parts: Vec<_> = values
                .chunks(chunk)
                .enumerate()
                .map(|(c, part)| {
                    s.spawn(move || {
                        let start = c * chunk;
                        part.iter().enumerate().filter(|&(k, x)| x.to_f32() != expected(i, start + k, step)).count()
                            as u64
                    })
                })
                .collect();
            parts.into_iter().map(|p| p.join().unwrap_or(u64::MAX)).sum::<u64>()
        });
    }
    Ok(mismatches)
}

fn run() -> Outcome {
    let gpus = common::require_gpu()?;
    common::ensure(gpus >= 2, "this example needs two GPUs (one per stand-in host)")?;
    if let Err(e) = cuda_mp::nccl_library() {
        return Err(format!("this example needs NCCL: {e}").into());
    }
    let steps: u32 = common::arg("--steps", 3)?;
    let dev = Device::get(0)?;

    // 1. The trainer listens for the rollout's reports and starts the rollout "on another host".
    let reports = RemoteListener::<Report>::bind_with("127.0.0.1:0", options())?;
    let child = spawn(reports.local_addr()?, rollout);
    let reports = accept_proven(&reports)?;
    let Report::Listening(addr) = reports.recv_timeout(TIMEOUT)? else {
        return Err("the rollout did not say where it listens".into());
    };

    // 2. The weights: one bundle, and one pattern tensor per distinct shape to fill it from.
    let shapes = common::llama7b_shapes();
    let weights = shapes.iter().fold(BundleBuilder::new(), |b, (n, s)| b.add::<bf16>(n.clone(), s)).build(&dev)?;
    let mut patterns: HashMap<Vec<usize>, GpuTensor<bf16>> = HashMap::new();
    for (_, shape) in &shapes {
        if !patterns.contains_key(shape) {
            let n: usize = shape.iter().product();
            let host: Vec<bf16> = (0..n).map(|j| bf16::from_f32((j % 64) as f32)).collect();
            patterns.insert(shape.clone(), GpuTensor::from_vec(&dev, shape, host)?);
        }
    }
    println!(
        "trainer: {} tensors, {:.1} GB in one allocation on gpu 0; rollout on gpu 1 at {addr}",
        weights.len(),
        weights.byte_len() as f64 / 1e9
    );

    // 3. Each step: update in place, publish, and wait for the rollout's check.
    let tx = Sender::<(u32, Bundle)>::connect_remote_with(addr, options())?;
    println!("route: {:?} (NCCL {:?})", tx.route(), cuda_mp::nccl_library()?);
    let mut ok = true;
    for step in 1..=steps {
        let start = Instant::now();
        for (i, (name, shape)) in shapes.iter().enumerate() {
            let t = weights.get::<bf16>(name)?;
            t.copy_from(&patterns[shape])?;
            t.add_scalar((i % 5 + step as usize) as f64)?;
        }
        // The send would wait for these kernels anyway (same stream); waiting here keeps them
        // out of the publish time.
        dev.synchronize()?;
        println!("step {step}: updated in {:.1} ms; publishing", start.elapsed().as_secs_f64() * 1e3);
        let start = Instant::now();
        tx.send((step, weights.clone()))?;
        let sent = start.elapsed();
        println!("step {step}: sent and acknowledged in {:.1} ms", sent.as_secs_f64() * 1e3);
        match reports.recv_timeout(TIMEOUT * 5)? {
            Report::Checked { step: seen, mismatches } => {
                println!(
                    "step {step}: {:.1} GB/s; rollout checked step {seen}: {mismatches} wrong elements",
                    weights.byte_len() as f64 / sent.as_secs_f64() / 1e9
                );
                ok &= seen == step && mismatches == 0;
            }
            Report::Failed(e) => return Err(format!("the rollout failed: {e}").into()),
            Report::Listening(_) => return Err("the rollout spoke out of turn".into()),
        }
    }
    drop(tx);
    child.join()?;
    common::ensure(ok, "the rollout saw wrong weights")
}

#[cuda_mp::main]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::args().any(|a| a == "--nccl-network") {
        // NCCL's network transport (sockets), as between two hosts; the rollout inherits it.
        // SAFETY: no other thread exists yet to read the environment (`init` starts none).
        unsafe {
            std::env::set_var("NCCL_P2P_DISABLE", "1");
            std::env::set_var("NCCL_SHM_DISABLE", "1");
        }
    }
    common::verdict(run(), "the rollout read every element of every step's 7B weights, moved by NCCL")
}
