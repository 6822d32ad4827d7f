//! 14: a Rust process serving a Python process: it receives tensors sent by the `cuda_mp`
//! Python package, adds 1 to them in place and sends them back (the same memory, both ways).
//! The Python tests start it; by hand:
//!
//!     cargo run --example 14_python_peer -- --kind host --reply-to <name of a Python listener>
//!
//! It prints `LISTEN <name>`: the Python side connects a sender of that kind there. `--kind
//! gpu` serves f32 GPU tensors (needs a GPU).

mod common;

use common::{Outcome, TIMEOUT};
use cuda_mp::{GpuTensor, HostTensor, Listener, Sender};

fn serve_host(reply_to: &str) -> Outcome<usize> {
    let listener = Listener::<HostTensor<f32>>::bind()?;
    println!("LISTEN {}", listener.name());
    let reply = Sender::<HostTensor<f32>>::connect(reply_to)?;
    let rx = listener.accept_timeout(TIMEOUT)?;
    let mut served = 0;
    // Until the Python side closes its sender.
    while let Ok(t) = rx.recv() {
        t.map_inplace(|x| x + 1.0);
        reply.send(t)?;
        served += 1;
    }
    Ok(served)
}

fn serve_gpu(reply_to: &str) -> Outcome<usize> {
    common::require_gpu()?;
    let listener = Listener::<GpuTensor<f32>>::bind()?;
    println!("LISTEN {}", listener.name());
    let reply = Sender::<GpuTensor<f32>>::connect(reply_to)?;
    let rx = listener.accept_timeout(TIMEOUT)?;
    let mut served = 0;
    while let Ok(t) = rx.recv() {
        t.add_scalar(1.0)?;
        reply.send(t)?;
        served += 1;
    }
    Ok(served)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let kind: String = common::arg("--kind", "host".to_string())?;
    let reply_to: String = common::arg("--reply-to", String::new())?;
    let outcome = match kind.as_str() {
        _ if reply_to.is_empty() => Err("--reply-to <name> is needed".into()),
        "host" => serve_host(&reply_to).map(|n| println!("served {n} host tensors")),
        "gpu" => serve_gpu(&reply_to).map(|n| println!("served {n} gpu tensors")),
        other => Err(format!("--kind {other}: host or gpu").into()),
    };
    common::verdict(outcome, "every tensor from Python came back with 1 added in place")
}
