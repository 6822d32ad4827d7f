//! 14: a Rust process serving a Python process: it receives tensors sent by the `cuda_mp`
//! Python package, adds 1 to them in place and sends them back (the same memory, both ways).
//! The Python tests start it; by hand:
//!
//!     cargo run --example 14_python_peer -- --kind host --reply-to <name of a Python listener>
//!
//! It prints `LISTEN <name>`: the Python side connects a sender of that kind there. `--kind
//! gpu` serves f32 GPU tensors (needs a GPU); `--kind bundle` answers each bundle with its
//! `step` tensor's value (a host tensor of one i64), as a weight consumer would.
//!
//! `--kind queue --queue <hex> --reply-to <hex>` is a consumer of a Python `cuda_mp.Queue`
//! (both arguments are the hex of a queue's `to_bytes()`): it takes `{"step": int, "note": str,
//! "x": float32 NumPy array or CUDA tensor}` items, adds 1 to `x` in place and puts
//! `(step, note, len(x))` on the
//! second queue; any object only Python reads is answered `("pickled", its tensors)`; `None`
//! ends it.

mod common;

use common::{Outcome, TIMEOUT};
use std::time::Instant;

use cuda_mp::__private::{Phase, PhaseTimes};
use cuda_mp::{Bundle, GpuTensor, HostTensor, Listener, Queue, Sender, Value};

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

/// The bytes that `hex` spells.
fn unhex(hex: &str) -> Outcome<Vec<u8>> {
    let digits = hex.as_bytes();
    if !digits.len().is_multiple_of(2) {
        return Err("hex of an odd length".into());
    }
    let pair = |p: &[u8]| u8::from_str_radix(std::str::from_utf8(p).ok()?, 16).ok();
    digits.chunks(2).map(|p| pair(p).ok_or_else(|| "not hex".into())).collect()
}

fn serve_queue(queue: &str, reply_to: &str) -> Outcome<usize> {
    let work: Queue<Value> = cuda_mp::from_bytes(&unhex(queue)?)?;
    let answers: Queue<Value> = cuda_mp::from_bytes(&unhex(reply_to)?)?;
    let mut served = 0;
    loop {
        let answer = match work.get_timeout(TIMEOUT)? {
            Value::None => break,
            Value::Pickled { tensors, .. } => Value::Tuple(vec!["pickled".into(), Value::Int(tensors.len() as i64)]),
            item => {
                let step = item.get("step").and_then(Value::as_int).ok_or("an item without an int step")?;
                let note = item.get("note").and_then(Value::as_str).ok_or("an item without a str note")?;
                let len = match item.get("x") {
                    Some(Value::Host(x)) => {
                        let x = x.typed::<f32>()?;
                        x.map_inplace(|v| v + 1.0);
                        x.numel()
                    }
                    Some(Value::Gpu(x)) => {
                        let x = x.typed::<f32>()?;
                        x.add_scalar(1.0)?;
                        // The answer does not carry `x`: the write is done before it is sent.
                        x.synchronize()?;
                        x.numel()
                    }
                    _ => return Err("an item without a float32 tensor x".into()),
                };
                Value::Tuple(vec![Value::Int(step), note.into(), Value::Int(len as i64)])
            }
        };
        answers.put(answer)?;
        served += 1;
    }
    Ok(served)
}

/// CLOCK_MONOTONIC in nanoseconds: the clock Python's `time.monotonic_ns()` reads too.
fn monotonic_ns() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

fn serve_bundles(reply_to: &str) -> Outcome<usize> {
    common::require_gpu()?;
    let listener = Listener::<Bundle>::bind()?;
    println!("LISTEN {}", listener.name());
    let reply = Sender::<HostTensor<i64>>::connect(reply_to)?;
    let rx = listener.accept_timeout(TIMEOUT)?;
    // Its replies carry where each receive's time went (for benches/python_publish.py).
    cuda_mp::__private::set_phase_times(true);
    let mut served = 0;
    // Keeps the latest weights, as a rollout engine does.
    let mut _latest = None;
    loop {
        let before = PhaseTimes::now();
        let waiting_ns = monotonic_ns();
        let Ok(b) = rx.recv() else { break };
        let got = PhaseTimes::now();
        let received_ns = monotonic_ns();
        let read = Instant::now();
        let step = b.get::<i64>("step")?.to_vec()?;
        let us = |p| got.since(&before, p).as_secs_f64() * 1e6;
        // Where the receive went, for benches/python_publish.py.
        let read_us = read.elapsed().as_secs_f64() * 1e6;
        let (decode, open, fetch) = (us(Phase::Decode), us(Phase::Open), us(Phase::Fetch));
        let first = step[0];
        _latest = Some(b);
        let dropped_ns = monotonic_ns();
        let answer = HostTensor::from_vec(&[1], step)?;
        let made_ns = monotonic_ns();
        reply.send(answer)?;
        println!(
            "TRACE step {first} waiting_ns {waiting_ns} received_ns {received_ns} dropped_ns {dropped_ns} \
             made_ns {made_ns} replied_ns {} decode {decode:.1} us (open {open:.1}, descriptor fetch {fetch:.1}), \
             step read {read_us:.1} us",
            monotonic_ns()
        );
        served += 1;
    }
    Ok(served)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let kind: String = common::arg("--kind", "host".to_string())?;
    let reply_to: String = common::arg("--reply-to", String::new())?;
    let queue: String = common::arg("--queue", String::new())?;
    let outcome = match kind.as_str() {
        _ if reply_to.is_empty() => Err("--reply-to <name> is needed".into()),
        "queue" => serve_queue(&queue, &reply_to).map(|n| println!("answered {n} items of a Python queue")),
        "host" => serve_host(&reply_to).map(|n| println!("served {n} host tensors")),
        "gpu" => serve_gpu(&reply_to).map(|n| println!("served {n} gpu tensors")),
        "bundle" => serve_bundles(&reply_to).map(|n| println!("served {n} bundles")),
        other => Err(format!("--kind {other}: host, gpu, bundle or queue").into()),
    };
    let pass = if kind == "bundle" {
        "every bundle from Python was read and answered with its step"
    } else if kind == "queue" {
        "every item of the Python queue was read and answered"
    } else {
        "every tensor from Python came back with 1 added in place"
    };
    common::verdict(outcome, pass)
}
