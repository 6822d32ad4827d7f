//! One-way channel throughput on the CPU: a worker process receives and drops as fast as it
//! can while this process sends. No GPU needed.
//!
//!     cargo bench --bench channel_throughput              # 5 rounds of each row
//!     cargo bench --bench channel_throughput -- --quick   # 2 rounds
//!     cargo bench --bench channel_throughput -- --only empty   # one row: empty, tensors, fakes or trips
//!
//! Rows: empty messages (`()`), 4 KiB host tensors from a pool of 64 (each message shares one
//! tensor's memory and counts a claim), and the same with the fake storage of the tests, which
//! runs the GPU protocol (the receiver keeps mappings cached) without a GPU: the CPU cost of a
//! resent GPU tensor, less the driver's. Each round counts the messages per second from the
//! first send until the worker acknowledges the last; the best and the median round are shown.
//! A last row times round trips of empty messages over a pipe (the reader always keeps up).

use std::time::{Duration, Instant};

use cuda_mp::testing::FakeTensor;
use cuda_mp::{Duplex, HostTensor, Receiver, Sender, channel, pipe, spawn};

const WAIT: Duration = Duration::from_secs(120);

fn count_empty((rx, ack, n): (Receiver<()>, Sender<u64>, u64)) {
    let mut seen = 0;
    while seen < n && rx.recv().is_ok() {
        seen += 1;
    }
    let _ = ack.send(seen);
}

fn count_tensors<T: serde::Serialize + serde::de::DeserializeOwned>((rx, ack, n): (Receiver<T>, Sender<u64>, u64)) {
    let mut seen = 0;
    while seen < n {
        match rx.recv() {
            Ok(t) => drop(t),
            Err(_) => break,
        }
        seen += 1;
    }
    let _ = ack.send(seen);
}

/// Messages per second of one round: `n` empty messages.
fn empty_round(n: u64) -> f64 {
    let (tx, rx) = channel::<()>().unwrap();
    let (ack_tx, ack) = channel().unwrap();
    let child = spawn((rx, ack_tx, n), count_empty);
    // Wait for the worker to be up: its first receive.
    tx.send(()).unwrap();
    let start = Instant::now();
    for _ in 1..n {
        tx.send(()).unwrap();
    }
    assert_eq!(ack.recv_timeout(WAIT).unwrap(), n);
    let rate = (n - 1) as f64 / start.elapsed().as_secs_f64();
    drop(tx);
    child.join().unwrap();
    rate
}

/// Messages per second of one round: `n` messages of one tensor each, cycled from `pool`.
fn tensor_round<T: serde::Serialize + serde::de::DeserializeOwned + Clone>(n: u64, pool: Vec<T>) -> f64 {
    let (tx, rx) = channel().unwrap();
    let (ack_tx, ack) = channel().unwrap();
    let child = spawn((rx, ack_tx, n), count_tensors::<T>);
    for t in pool.iter().take(8) {
        tx.send(t.clone()).unwrap(); // warm-up: the worker maps part of the pool
    }
    let start = Instant::now();
    for i in 8..n {
        tx.send(pool[i as usize % pool.len()].clone()).unwrap();
    }
    assert_eq!(ack.recv_timeout(WAIT).unwrap(), n);
    let rate = (n - 8) as f64 / start.elapsed().as_secs_f64();
    drop(tx);
    child.join().unwrap();
    rate
}

fn echo(end: Duplex<(), ()>) {
    while end.recv().is_ok() {
        if end.send(()).is_err() {
            break;
        }
    }
}

/// Round trips per second of one round: `n` empty messages there and back.
fn round_trip_round(n: u64) -> f64 {
    let (here, there) = pipe::<(), ()>().unwrap();
    let child = spawn(there, echo);
    here.send(()).unwrap();
    here.recv_timeout(WAIT).unwrap();
    let start = Instant::now();
    for _ in 0..n {
        here.send(()).unwrap();
        here.recv_timeout(WAIT).unwrap();
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    drop(here);
    child.join().unwrap();
    rate
}

fn report(what: &str, mut rates: Vec<f64>) {
    rates.sort_by(|a, b| b.partial_cmp(a).unwrap());
    let best = rates[0];
    let median = rates[rates.len() / 2];
    println!("{what:<32} best {best:>9.0}/s   median {median:>9.0}/s   ({} rounds)", rates.len());
}

fn main() {
    cuda_mp::init();
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let only = args.iter().position(|a| a == "--only").and_then(|i| args.get(i + 1)).cloned();
    let want = |row: &str| only.as_deref().is_none_or(|o| o == row);
    let rounds = if quick { 2 } else { 5 };
    let (mut empty, mut tensors, mut fakes, mut trips) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // Interleaved, so that a slow moment of a shared machine hits every row alike.
    for _ in 0..rounds {
        if want("empty") {
            empty.push(empty_round(50_000));
        }
        if want("tensors") {
            let pool: Vec<HostTensor<u8>> = (0..64).map(|_| HostTensor::<u8>::zeros(&[4096]).unwrap()).collect();
            tensors.push(tensor_round(20_000, pool));
        }
        if want("fakes") {
            let pool: Vec<FakeTensor<u8>> =
                (0..64).map(|_| FakeTensor::fake(&[4096], Duration::ZERO).unwrap()).collect();
            fakes.push(tensor_round(20_000, pool));
        }
        if want("trips") {
            trips.push(round_trip_round(10_000));
        }
    }
    for (what, rates) in [
        ("one-way, empty messages", empty),
        ("one-way, 4 KiB host tensors", tensors),
        ("one-way, fake tensors (GPU's)", fakes),
        ("round trips, empty messages", trips),
    ] {
        if !rates.is_empty() {
            report(what, rates);
        }
    }
}
