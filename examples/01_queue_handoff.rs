//! The main demo: hand a tensor to a worker process through a channel, let it add 1 in place,
//! and see the change here. The worker maps the same memory; nothing is copied.
//!
//! With a CUDA GPU the tensor lives on the GPU (shared through CUDA IPC); without one, this
//! says so and does the same handoff with a host tensor in shared memory.
//!
//!     cargo run --release --example 01_queue_handoff

use cuda_mp::{channel, cuda_available, spawn, Device, GpuTensor, HostTensor, Receiver, Sender};

/// A few pseudo-random numbers in [0, 1), seeded by the clock.
fn random_values(n: usize) -> Vec<f32> {
    let mut s =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
            | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32
        })
        .collect()
}

fn mean(v: &[f32]) -> f64 {
    v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64
}

fn gpu_worker((rx, ack): (Receiver<GpuTensor<f32>>, Sender<()>)) {
    let t = rx.recv().expect("receive the tensor");
    t.add_scalar(1.0).expect("add 1 on the gpu");
    t.synchronize().expect("finish the kernel before acknowledging");
    ack.send(()).expect("acknowledge");
}

fn host_worker((rx, ack): (Receiver<HostTensor<f32>>, Sender<()>)) {
    let t = rx.recv().expect("receive the tensor");
    t.map_inplace(|x| x + 1.0);
    ack.send(()).expect("acknowledge");
}

fn report(before: &[f32], after: &[f32]) -> bool {
    let exact = before.iter().zip(after).all(|(b, a)| *a == *b + 1.0);
    println!(
        "mean before: {:.6}  mean after: {:.6}  (rose by {:.6})",
        mean(before),
        mean(after),
        mean(after) - mean(before)
    );
    exact
}

fn run_gpu() -> Result<bool, Box<dyn std::error::Error>> {
    let dev = Device::get(0)?;
    println!("GPU {} ({})", dev.ordinal(), dev.uuid_string());
    let values = random_values(20);
    let t = GpuTensor::from_vec(&dev, &[4, 5], values.clone())?;
    let (tx, rx) = channel()?;
    let (ack_tx, ack_rx) = channel()?;
    let child = spawn((rx, ack_tx), gpu_worker);
    tx.send(t.clone())?;
    ack_rx.recv_timeout(std::time::Duration::from_secs(60))?;
    let after = t.to_vec()?;
    child.join()?;
    Ok(report(&values, &after))
}

fn run_host() -> Result<bool, Box<dyn std::error::Error>> {
    let values = random_values(20);
    let t = HostTensor::from_vec(&[4, 5], values.clone())?;
    let (tx, rx) = channel()?;
    let (ack_tx, ack_rx) = channel()?;
    let child = spawn((rx, ack_tx), host_worker);
    tx.send(t.clone())?;
    ack_rx.recv_timeout(std::time::Duration::from_secs(60))?;
    let after = t.to_vec();
    child.join()?;
    Ok(report(&values, &after))
}

#[cuda_mp::main]
fn main() {
    let result = if cuda_available() {
        run_gpu()
    } else {
        let why = Device::count().err().map(|e| e.to_string()).unwrap_or_else(|| "no GPU is visible".into());
        println!("notice: no CUDA GPU ({why}); doing the same handoff with host tensors in shared memory");
        run_host()
    };
    match result {
        Ok(true) => println!("PASS: the worker's in-place add is visible here, every element exactly +1"),
        Ok(false) => {
            println!("FAIL: elements did not rise by exactly 1");
            std::process::exit(1);
        }
        Err(e) => {
            println!("FAIL: {e}");
            std::process::exit(1);
        }
    }
}
