//! Queue throughput against `torch.multiprocessing.Queue`, in one run, on the CPU.
//!
//!     cargo bench --bench queue                  # ours, then benches/torch_queue.py, one table
//!     cargo bench --bench queue -- --quick       # fewer tensors, one round
//!     cargo bench --bench queue -- --no-torch    # ours only
//!     cargo bench --bench queue -- --prefetch 8  # consumers that prefetch 8 (QUEUE_PREFETCH otherwise)
//!
//! Each row: one producer (this process, which also runs the queue's dispatcher) puts 4 KiB
//! uint8 host tensors on one queue drained by 1 or 4 consumer processes that get and drop
//! them; either *fresh* (a new tensor allocated for every put, allocation timed: a block of
//! the host caching allocator) or *resent* (the same 8 tensors put again and again). Tensors per second from the first put until every
//! consumer has got every tensor; the median of the rounds. The producer stays at most 1,024
//! tensors ahead of the consumers (each returns a credit per 256 tensors it dropped): the queue
//! is unbounded (and with the host caching allocator off every live host tensor, queued or
//! not, is a descriptor in the producer's process). It also pauses (timed) while its process holds more than 4,096 storages and lease
//! channels, which a loaded machine's reaper may free later than the consumers drop them, and
//! each round starts once the previous one's are freed. torch runs the same workloads, with the
//! same credits, with
//! `torch.multiprocessing.Queue` (spawn context, a `None` per consumer to stop); the ratio is
//! ours / torch, higher is better for us. For scale, the same workloads over a plain channel
//! to one consumer (no queue: no dispatcher, no acknowledgement) are printed after the table,
//! and the producer's own cost of allocating and freeing a fresh tensor, with the host caching
//! allocator on (once it holds the segments a batch needs, and for a batch that makes them) and
//! off.
//!
//! Last, the round trip of one message, median in microseconds, torch's in the same run: this
//! process puts on a queue whose consumer is another process, which drops what it got and puts
//! an acknowledgement (an integer) on a second queue of this process's, which this process
//! gets. Rows: an integer, and a resent 4 KiB tensor. It is the latency a worker pool built on
//! two queues sees, and the floor under every message of a `multiprocessing` program.

use std::process::Command;
use std::time::{Duration, Instant};

use cuda_mp::{HostTensor, QUEUE_PREFETCH, Queue, QueueConsumer, Receiver, Sender, channel, spawn, wait_for_lifetime};

const BYTES: usize = 4096;
const POOL: usize = 8;
const WAIT: Duration = Duration::from_secs(120);
/// How far the producer may run ahead of the consumers, in tensors.
const WINDOW: usize = 1024;
/// Tensors per credit a consumer returns.
const CREDIT: u64 = 256;
/// Storages and lease channels this process may hold alive while producing.
const HELD: usize = 4096;

/// The ends a consumer reports on: ready, a credit per [`CREDIT`] tensors, its count at the end.
type Reports = (Sender<()>, Sender<()>, Sender<u64>);

/// Joins the queue, says so, gets and drops until the queue is closed, and reports how many.
fn consume((queue, (ready, credit, done)): (QueueConsumer<HostTensor<u8>>, Reports)) {
    queue.stats().expect("join the queue");
    ready.send(()).expect("report ready");
    let mut n = 0u64;
    loop {
        match queue.get() {
            Ok(t) => drop(t),
            Err(e) if e.is_disconnected() => break,
            Err(e) => panic!("get: {e}"),
        }
        n += 1;
        if n.is_multiple_of(CREDIT) {
            credit.send(()).expect("return a credit");
        }
    }
    done.send(n).expect("report the count");
}

/// Gets until the queue is closed, dropping each message and acknowledging it on `acks`.
fn acknowledge<T: serde::Serialize + serde::de::DeserializeOwned + Send + 'static>(
    queue: QueueConsumer<T>,
    acks: Queue<u64>,
) {
    loop {
        match queue.get() {
            Ok(message) => drop(message),
            Err(e) if e.is_disconnected() => return,
            Err(e) => panic!("get: {e}"),
        }
        acks.put(1).expect("acknowledge");
    }
}

fn acknowledge_ints((queue, acks): (QueueConsumer<u64>, Queue<u64>)) {
    acknowledge(queue, acks);
}

fn acknowledge_tensors((queue, acks): (QueueConsumer<HostTensor<u8>>, Queue<u64>)) {
    acknowledge(queue, acks);
}

/// The median round trip, in microseconds, of `make()` put on a queue whose consumer (another
/// process, running `consumer`) acknowledges each message on a queue of this process's; after
/// 50 rounds not counted.
fn round_trip<T: serde::Serialize + serde::de::DeserializeOwned + Send + 'static>(
    rounds: usize,
    consumer: fn((QueueConsumer<T>, Queue<u64>)),
    make: impl Fn() -> T,
) -> f64 {
    settle();
    let (queue, acks) = (Queue::<T>::new().expect("a queue"), Queue::<u64>::new().expect("a queue"));
    let child = spawn((queue.consumer(), acks.clone()), consumer);
    let times: Vec<f64> = (0..50 + rounds)
        .map(|_| {
            let start = Instant::now();
            queue.put(make()).expect("put");
            acks.get_timeout(WAIT).expect("an acknowledgement");
            start.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    drop(queue);
    child.join().expect("the consumer");
    median(times[50..].to_vec())
}

/// Sends `n` tensors with `send`, at most [`WINDOW`] ahead of the credits returned.
fn produce(mode: Mode, n: usize, credits: &Receiver<()>, mut send: impl FnMut(HostTensor<u8>)) {
    let pool: Vec<HostTensor<u8>> = (0..POOL).map(|_| HostTensor::zeros(&[BYTES]).expect("a tensor")).collect();
    let mut returned = 0usize;
    for i in 0..n {
        while i >= returned * CREDIT as usize + WINDOW {
            credits.recv_timeout(WAIT).expect("a credit");
            returned += 1;
        }
        if i % 64 == 0 {
            wait_for_lifetime(WAIT, |s| s.live_storages + s.outstanding_leases <= HELD).expect("releases");
        }
        send(match mode {
            Mode::Fresh => HostTensor::zeros(&[BYTES]).expect("a tensor"),
            Mode::Resent => pool[i % POOL].clone(),
        });
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Fresh,
    Resent,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Fresh => "fresh",
            Mode::Resent => "resent",
        }
    }
}

/// Waits until everything an earlier round shared is freed.
fn settle() {
    wait_for_lifetime(WAIT, |s| s.exported_storages == 0 && s.outstanding_leases == 0).expect("an earlier round freed");
}

/// One round: tensors per second.
fn round(consumers: usize, mode: Mode, n: usize, prefetch: usize) -> f64 {
    settle();
    let queue = Queue::<HostTensor<u8>>::new().expect("a queue");
    let (ready_tx, ready_rx) = channel().expect("a channel");
    let (credit_tx, credit_rx) = channel().expect("a channel");
    let (done_tx, done_rx) = channel().expect("a channel");
    let children: Vec<_> = (0..consumers)
        .map(|_| {
            spawn(
                (queue.consumer().with_prefetch(prefetch), (ready_tx.clone(), credit_tx.clone(), done_tx.clone())),
                consume,
            )
        })
        .collect();
    for _ in 0..consumers {
        ready_rx.recv_timeout(WAIT).expect("a consumer ready");
    }
    let start = Instant::now();
    produce(mode, n, &credit_rx, |t| queue.put(t).expect("put"));
    drop(queue);
    let got: u64 = (0..consumers).map(|_| done_rx.recv_timeout(WAIT).expect("a consumer's count")).sum();
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(got, n as u64, "every tensor received once");
    for c in children {
        c.join().expect("a consumer");
    }
    n as f64 / secs
}

fn drain((rx, (ready, credit, done)): (Receiver<HostTensor<u8>>, Reports)) {
    ready.send(()).expect("report ready");
    let mut n = 0u64;
    for t in rx.iter() {
        drop(t);
        n += 1;
        if n.is_multiple_of(CREDIT) {
            credit.send(()).expect("return a credit");
        }
    }
    done.send(n).expect("report the count");
}

/// The same workload over a plain channel to one consumer: tensors per second.
fn channel_round(mode: Mode, n: usize) -> f64 {
    settle();
    let (tx, rx) = channel().expect("a channel");
    let (ready_tx, ready_rx) = channel().expect("a channel");
    let (credit_tx, credit_rx) = channel().expect("a channel");
    let (done_tx, done_rx) = channel().expect("a channel");
    let child = spawn((rx, (ready_tx, credit_tx, done_tx)), drain);
    ready_rx.recv_timeout(WAIT).expect("the consumer ready");
    let start = Instant::now();
    produce(mode, n, &credit_rx, |t| tx.send(t).expect("send"));
    drop(tx);
    let got = done_rx.recv_timeout(WAIT).expect("the consumer's count");
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(got, n as u64);
    child.join().expect("the consumer");
    n as f64 / secs
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

const ROWS: [(usize, Mode); 4] = [(1, Mode::Fresh), (1, Mode::Resent), (4, Mode::Fresh), (4, Mode::Resent)];

fn key(consumers: usize, mode: Mode) -> String {
    format!("c{consumers}_{}", mode.name())
}

/// Runs benches/torch_queue.py; its rates by row key, or why there are none.
fn run_torch(quick: bool, n: usize, rounds: usize) -> Result<Vec<(String, f64)>, String> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/torch_queue.py");
    let script =
        if std::path::Path::new(script).exists() { script.to_string() } else { "benches/torch_queue.py".into() };
    let mut cmd = Command::new("python3");
    cmd.arg(&script).arg("--n").arg(n.to_string()).arg("--rounds").arg(rounds.to_string());
    if quick {
        cmd.arg("--quick");
    }
    println!("running the torch.multiprocessing baseline: python3 {script}");
    let out = cmd.output().map_err(|e| format!("python3 could not be started: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut rows = Vec::new();
    for line in stdout.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["row", key, rate] => {
                if let Ok(rate) = rate.parse() {
                    rows.push((key.to_string(), rate));
                }
            }
            ["skip", why @ ..] => return Err(why.join(" ")),
            _ if !line.is_empty() => println!("  torch: {line}"),
            _ => {}
        }
    }
    if !out.status.success() {
        return Err(format!("it failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(rows)
}

#[cuda_mp::main]
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let no_torch = args.iter().any(|a| a == "--no-torch");
    let (n, rounds) = if quick { (5_000, 1) } else { (20_000, 3) };
    let prefetch = match args.iter().position(|a| a == "--prefetch").map(|i| args.get(i + 1).map(|v| v.parse())) {
        None => QUEUE_PREFETCH,
        Some(Some(Ok(p))) => p,
        Some(_) => {
            println!("--prefetch takes a number of messages");
            std::process::exit(2);
        }
    };
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "queue: {n} tensors of {BYTES} bytes per round, median of {rounds} round(s), {cpus} cpus, prefetch {prefetch}"
    );

    let mut ours = Vec::new();
    for (consumers, mode) in ROWS {
        // One untimed warm-up round of a tenth the size.
        round(consumers, mode, n / 10, prefetch);
        let rate = median((0..rounds).map(|_| round(consumers, mode, n, prefetch)).collect());
        println!("  cuda-mp {}: {rate:.0} tensors/s", key(consumers, mode));
        ours.push(rate);
    }

    let torch = if no_torch { Err("--no-torch".to_string()) } else { run_torch(quick, n, rounds) };
    if let Err(why) = &torch {
        println!("the torch baseline was not run: {why}");
    }
    println!();
    println!("| consumers | tensors | cuda-mp tensors/s | torch tensors/s | cuda-mp / torch |");
    println!("|---|---|---|---|---|");
    for ((consumers, mode), rate) in ROWS.into_iter().zip(ours) {
        let theirs = torch.as_ref().ok().and_then(|rows| rows.iter().find(|(k, _)| *k == key(consumers, mode)));
        let (t, ratio) = match theirs {
            Some((_, t)) => (format!("{t:.0}"), format!("{:.1}x", rate / t)),
            None => ("-".into(), "-".into()),
        };
        println!("| {consumers} | {} | {rate:.0} | {t} | {ratio} |", mode.name());
    }
    println!();
    let trips = if quick { 1_000 } else { 5_000 };
    let tensor = HostTensor::<u8>::zeros(&[BYTES]).expect("a tensor");
    let ours = [
        ("rt_int", "an integer", round_trip(trips, acknowledge_ints, || 7u64)),
        ("rt_tensor", "a resent 4 KiB tensor", round_trip(trips, acknowledge_tensors, || tensor.clone())),
    ];
    println!("| round trip, acknowledged on a second queue | cuda-mp | torch | torch / cuda-mp |");
    println!("|---|---|---|---|");
    for (key, what, us) in ours {
        let theirs = torch.as_ref().ok().and_then(|rows| rows.iter().find(|(k, _)| k == key));
        let (t, ratio) = match theirs {
            Some((_, t)) => (format!("{t:.1} us"), format!("{:.1}x", t / us)),
            None => ("-".into(), "-".into()),
        };
        println!("| {what} | {us:.1} us | {t} | {ratio} |");
    }
    println!();
    for mode in [Mode::Fresh, Mode::Resent] {
        channel_round(mode, n / 10);
        let rate = median((0..rounds).map(|_| channel_round(mode, n)).collect());
        println!("for scale, a plain channel to one consumer, {}: {rate:.0} tensors/s", mode.name());
    }
    let (grow, (alloc, free)) = (grow_round(), alloc_round(n));
    println!(
        "for scale, this process alone allocating fresh tensors: {:.2} us each, freeing them: {:.2} us each \
         (a first batch that grew the allocator by segments: {:.2} us each)",
        alloc * 1e6,
        free * 1e6,
        grow * 1e6
    );
    // The same with a memory file per tensor.
    cuda_mp::set_host_caching(false);
    let (alloc, free) = alloc_round(n);
    cuda_mp::set_host_caching(true);
    println!(
        "for scale, the same with the host caching allocator off: {:.2} us each, freeing them: {:.2} us each",
        alloc * 1e6,
        free * 1e6
    );
}

/// Seconds per tensor to allocate a batch of 1,000 fresh tensors from an allocator that gave its
/// free segments up: new memory files whose pages are touched for the first time (untimed before
/// `alloc_round`, which measures the steady state: a producer reuses its blocks).
fn grow_round() -> f64 {
    cuda_mp::empty_host_cache();
    alloc_round(1000).0
}

/// Seconds per tensor to allocate `n` fresh tensors (in batches of 1,000, under the descriptor
/// limit) and to drop them, with no other process involved: the producer's share of a fresh row.
fn alloc_round(n: usize) -> (f64, f64) {
    let (mut alloc, mut free) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..n / 1000 {
        let start = Instant::now();
        let batch: Vec<HostTensor<u8>> = (0..1000).map(|_| HostTensor::zeros(&[BYTES]).expect("a tensor")).collect();
        alloc += start.elapsed();
        let start = Instant::now();
        drop(batch);
        free += start.elapsed();
    }
    let count = (n / 1000 * 1000).max(1) as f64;
    (alloc.as_secs_f64() / count, free.as_secs_f64() / count)
}
