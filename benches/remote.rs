//! One-way transfer between two processes on two GPUs through a remote channel on the network
//! route (the message on TCP, the GPU bytes by NCCL), against torch.distributed send/recv on
//! NCCL (`benches/torch_nccl.py`), in one run.
//!
//!     cargo bench --bench remote                          # both transports: ours, then torch
//!     cargo bench --bench remote -- --transport net       # or nvlink
//!     cargo bench --bench remote -- --quick               # a fifth of the messages
//!     cargo bench --bench remote -- --no-torch            # ours only
//!     cargo bench --bench remote -- --python python3.12   # the interpreter that has torch
//!
//! Needs GPUs 0 and 1. Ours: a process sends from GPU 0 through a remote `Sender` with
//! `network_only(true)`; the process it spawns receives on GPU 1 and drops each message, so
//! the next one is received into its memory (`RemoteOptions::reuse_memory`, on by default;
//! the first message of each size allocates). Torch: rank 0 on cuda:0 sends, rank 1 on cuda:1
//! receives into tensors allocated once.
//!
//! Transports. NCCL reads its environment once per process, so for each transport this program
//! starts a copy of itself (`--run TRANSPORT`: ours) and then the torch script, both with that
//! environment, and prints one table from what they print:
//!   net     NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1: NCCL's network transport over loopback,
//!           standing in for two hosts
//!   nvlink  P2P on (both variables removed): NCCL copies GPU to GPU over NVLink
//! Both get NCCL_NVLS_ENABLE=0. NCCL_DEBUG=INFO in the caller's environment shows which
//! transport NCCL picked. Unless CUDA_MP_NCCL_LIBRARY is set, ours loads the NCCL library torch
//! loads, so both sides run the same NCCL.
//!
//! Payloads: 1 MiB, 64 MiB, 1 GiB (one `GpuTensor<u8>` each), 64 tensors of 1 MiB in one
//! message (a `Vec`: how small tensors travel at NVLink's rate) and 7B-shaped weights (a `Bundle`
//! of 291 bf16 tensors, 13.5 GB in one allocation; torch sends them one `dist.send` each and,
//! as its best case, as one flat buffer).
//!
//! Timing, on the receiver. The very first message (1 MiB) is timed on its own, from `accept`
//! to its `recv` returning: it includes NCCL's communicator set-up, not the CUDA context (both
//! sides make theirs before). Then per payload, the
//! warm-up messages are received and dropped uncounted; the clock starts when the last warm-up
//! `recv` returned and stops when the last counted `recv` returned (its memory dropped), so it
//! covers the counted messages back to back, the sender's per-message work included.
//! GB/s = counted bytes / that time / 1e9; per message = that time / counted messages.
//!
//! Both sides print `first <secs>` and `result <payload> <bytes> <messages> <secs>` as they go,
//! so a side that stops early still reports what it finished. A send of ours that does not
//! return within `STALL` ends our side: its receiver is killed and the table marks the rest.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cuda_mp::__private::{Phase, PhaseTimes};
use cuda_mp::{
    Bundle, BundleBuilder, Device, GpuTensor, RemoteListener, RemoteOptions, Route, Sender, bf16, channel, spawn,
};

#[path = "../examples/common/llama.rs"]
mod llama;
use llama::llama7b_shapes;

/// Each end's transfer timeout (NCCL's set-up included).
const TIMEOUT: Duration = Duration::from_secs(60);

/// How long our sender may go without a send returning before our side is given up. A 13.5 GB
/// message takes seconds over loopback; this only catches a transfer that never ends.
const STALL: Duration = Duration::from_secs(90);

/// What a message holds.
#[derive(Clone, Copy)]
enum Shape {
    /// One tensor of this many bytes.
    Bytes(usize),
    /// This many tensors of 1 MiB in one message (torch: a send each).
    Batch(usize),
    /// The 7B bundle.
    Weights,
}

/// Name, what a message holds, warm-up messages, counted messages (a fifth with `--quick`).
/// `benches/torch_nccl.py` has the same.
const PAYLOADS: [(&str, Shape, usize, usize); 5] = [
    ("1MiB", Shape::Bytes(1 << 20), 2, 200),
    ("64x1MiB", Shape::Batch(64), 2, 20),
    ("64MiB", Shape::Bytes(64 << 20), 2, 50),
    ("1GiB", Shape::Bytes(1 << 30), 2, 10),
    ("7B", Shape::Weights, 1, 3),
];

fn counted(n: usize, quick: bool) -> usize {
    if quick { (n / 5).max(1) } else { n }
}

/// The channel's message: one type for every payload, so that one connection (and one NCCL
/// communicator) carries them all.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
enum Payload {
    Tensor(GpuTensor<u8>),
    Batch(Vec<GpuTensor<u8>>),
    Weights(Bundle),
}

/// Our receiving process, on GPU 1: sends its address, accepts one sender, receives every
/// payload's messages and prints `first` and `result` lines as it goes.
fn receive((addr_tx, quick): (Sender<String>, bool)) -> Result<(), String> {
    cuda_mp::__private::set_phase_times(true);
    // The GPU's context made before the clock starts, as torch's script makes its own.
    Device::get(1).map_err(|e| e.to_string())?;
    let options = RemoteOptions::default().device(1).network_only(true).transfer_timeout(TIMEOUT);
    let listener = RemoteListener::<Payload>::bind_with("127.0.0.1:0", options).map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    addr_tx.send(addr.to_string()).map_err(|e| e.to_string())?;
    let rx = listener.accept_timeout(TIMEOUT).map_err(|e| e.to_string())?;
    if rx.route() != Route::Network {
        return Err(format!("the channel took the {:?} route, not the network", rx.route()));
    }
    // Receives one message and drops it; gives its bytes. The drop (freeing memory, if any)
    // is timed apart, for the per-message breakdown.
    let dropping = std::cell::Cell::new(Duration::ZERO);
    let recv = || -> Result<u64, String> {
        let payload = rx.recv().map_err(|e| format!("receive: {e}"))?;
        let bytes = match &payload {
            Payload::Tensor(t) => t.numel() as u64,
            Payload::Batch(ts) => ts.iter().map(|t| t.numel() as u64).sum(),
            Payload::Weights(b) => b.byte_len() as u64,
        };
        let start = Instant::now();
        drop(payload);
        dropping.set(dropping.get() + start.elapsed());
        Ok(bytes)
    };
    let start = Instant::now();
    recv()?;
    println!("first {:.6}", start.elapsed().as_secs_f64());
    for &(name, _, warm, n) in &PAYLOADS {
        for _ in 0..warm {
            recv()?;
        }
        let messages = counted(n, quick);
        let (phases, dropped) = (PhaseTimes::now(), dropping.get());
        let start = Instant::now();
        let mut bytes = 0;
        for _ in 0..messages {
            bytes += recv()?;
        }
        println!("result {name} {bytes} {messages} {:.6}", start.elapsed().as_secs_f64());
        let now = PhaseTimes::now();
        let per = |d: Duration| duration(d.as_secs_f64() / messages as f64);
        println!(
            "per message on the receiver ({name}): allocating {}, NCCL {}, dropping {}",
            per(now.since(&phases, Phase::RemoteAlloc)),
            per(now.since(&phases, Phase::RemoteNccl)),
            per(dropping.get() - dropped)
        );
    }
    Ok(())
}

/// Our side of one transport, in this process (the sender, GPU 0) and a spawned receiver
/// (GPU 1); the NCCL environment was set by the parent. Whether it went through.
fn run_ours(quick: bool) -> Result<(), String> {
    cuda_mp::__private::set_phase_times(true);
    let visible = Device::count().map_err(|e| format!("needs two CUDA GPUs: {e}"))?;
    if visible < 2 {
        return Err(format!("needs GPUs 0 and 1; {visible} visible"));
    }
    let (name, v) = cuda_mp::nccl_library().map_err(|e| e.to_string())?;
    println!("NCCL {}.{}.{} ({name})", v / 10000, v % 10000 / 100, v % 100);
    let dev = Device::get(0).map_err(|e| e.to_string())?;
    // Everything is allocated before the receiver starts: its clock never sees our allocations.
    let payloads = PAYLOADS
        .iter()
        .map(|&(_, shape, ..)| match shape {
            Shape::Bytes(n) => GpuTensor::<u8>::zeros(&dev, &[n]).map(Payload::Tensor),
            Shape::Batch(n) => {
                (0..n).map(|_| GpuTensor::<u8>::zeros(&dev, &[1 << 20])).collect::<Result<_, _>>().map(Payload::Batch)
            }
            Shape::Weights => llama7b_shapes()
                .iter()
                .fold(BundleBuilder::new(), |b, (name, shape)| b.add::<bf16>(name.clone(), shape))
                .build(&dev)
                .map(Payload::Weights),
        })
        .collect::<cuda_mp::Result<Vec<_>>>()
        .map_err(|e| e.to_string())?;
    dev.synchronize().map_err(|e| e.to_string())?;

    let (addr_tx, addr_rx) = channel().map_err(|e| e.to_string())?;
    let mut child = spawn((addr_tx, quick), receive);
    let addr = addr_rx.recv_timeout(TIMEOUT).map_err(|e| format!("the receiver's address: {e}"))?;
    let options = RemoteOptions::default().network_only(true).transfer_timeout(TIMEOUT);
    let tx = Sender::<Payload>::connect_remote_with(addr.as_str(), options).map_err(|e| e.to_string())?;
    // The sends run on a thread that names the payload after each one returns; a send that
    // never returns cannot hold up this one.
    let (progress, watch) = mpsc::channel::<&'static str>();
    let sender = std::thread::spawn(move || -> Result<(), String> {
        // The first message: the first payload once more.
        let sends = std::iter::once((&payloads[0], "first")).chain(
            payloads
                .iter()
                .zip(&PAYLOADS)
                .flat_map(|(p, &(name, _, warm, n))| std::iter::repeat_n((p, name), warm + counted(n, quick))),
        );
        // Per payload, the sender's side of each message (warm-up ones included).
        let mut current = ("", PhaseTimes::now(), 0u32);
        let report = |(name, since, sent): (&str, PhaseTimes, u32)| {
            if sent > 0 {
                let now = PhaseTimes::now();
                let per = |p| duration(now.since(&since, p).as_secs_f64() / f64::from(sent));
                println!(
                    "per message on the sender ({name}): writing the frame {}, NCCL {}, awaiting the acknowledgement {}",
                    per(Phase::RemoteWrite),
                    per(Phase::RemoteNccl),
                    per(Phase::RemoteAck)
                );
            }
        };
        for (payload, name) in sends {
            if name != current.0 {
                report(std::mem::replace(&mut current, (name, PhaseTimes::now(), 0)));
            }
            tx.send(payload.clone()).map_err(|e| format!("send ({name}): {e}"))?;
            current.2 += 1;
            let _ = progress.send(name);
        }
        report(current);
        Ok(())
    });
    let mut last = "none yet";
    loop {
        match watch.recv_timeout(STALL) {
            Ok(name) => last = name,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                return Err(format!("stalled: no send returned for {STALL:?} (the last that did: {last})"));
            }
        }
    }
    let sent = sender.join().map_err(|_| "the sending thread panicked".to_string())?;
    // The receiver's error explains a failed send better than the send's own.
    match child.join() {
        Ok(Ok(())) => sent,
        Ok(Err(e)) => Err(format!("receiver: {e}; sender: {sent:?}")),
        Err(e) => Err(format!("receiver process: {e}; sender: {sent:?}")),
    }
}

/// The torch script, found from the repository root (or this crate's directory when built here).
fn script() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/torch_nccl.py");
    if Path::new(path).exists() { path.into() } else { "benches/torch_nccl.py".into() }
}

/// What one side printed.
#[derive(Default)]
struct Side {
    first: Option<f64>,
    /// Payload name, counted bytes, messages, seconds.
    results: Vec<(String, u64, usize, f64)>,
    /// Why it stopped early, if it did.
    failed: Option<String>,
}

impl Side {
    /// GB/s and seconds per message of a payload.
    fn get(&self, name: &str) -> Option<(f64, f64)> {
        self.results
            .iter()
            .find(|r| r.0 == name)
            .map(|&(_, bytes, messages, secs)| (bytes as f64 / secs / 1e9, secs / messages as f64))
    }
}

/// Runs one side, echoing its lines as they come under `label`, and parses `first <secs>` and
/// `result <name> <bytes> <messages> <secs>`.
fn run_side(label: &str, mut cmd: Command) -> Side {
    let mut side = Side::default();
    let mut child = match cmd.stdout(Stdio::piped()).spawn() {
        Ok(child) => child,
        Err(e) => {
            side.failed = Some(format!("{:?}: {e}", cmd.get_program()));
            return side;
        }
    };
    for line in BufReader::new(child.stdout.take().expect("piped")).lines().map_while(|l| l.ok()) {
        println!("  {label}: {line}");
        let f: Vec<&str> = line.split_whitespace().collect();
        match f[..] {
            ["first", secs] => side.first = secs.parse().ok(),
            ["result", name, bytes, messages, secs] => {
                if let (Ok(bytes), Ok(messages), Ok(secs)) = (bytes.parse(), messages.parse(), secs.parse()) {
                    side.results.push((name.into(), bytes, messages, secs));
                }
            }
            _ => {}
        }
    }
    match child.wait() {
        Ok(status) if status.success() => {}
        Ok(status) => side.failed = Some(format!("{status}; its messages are above")),
        Err(e) => side.failed = Some(e.to_string()),
    }
    side
}

/// Seconds in a readable unit.
fn duration(secs: f64) -> String {
    if secs < 1e-3 {
        format!("{:.1} us", secs * 1e6)
    } else if secs < 1.0 {
        format!("{:.2} ms", secs * 1e3)
    } else {
        format!("{secs:.2} s")
    }
}

fn print_table(transport: &str, ours: &Side, torch: Option<&Side>, quick: bool) {
    let missing = |side: Option<&Side>| match side {
        None => "not run",
        Some(s) if s.failed.is_some() => "failed",
        Some(_) => "n/a",
    };
    let cells = |side: Option<&Side>, name: &str| match side.and_then(|s| s.get(name)) {
        Some((gbps, per)) => (format!("{gbps:.2}"), duration(per)),
        None => (missing(side).into(), missing(side).into()),
    };
    let ratio = |a: Option<(f64, f64)>, b: Option<(f64, f64)>| match (a, b) {
        (Some(a), Some(b)) => format!("{:.2}x", a.0 / b.0),
        _ => "n/a".into(),
    };
    println!("\n### {transport}\n");
    println!("| payload | cuda-mp GB/s | cuda-mp per message | torch GB/s | torch per message | cuda-mp / torch |");
    println!("|---|---|---|---|---|---|");
    for &(name, _, _, n) in &PAYLOADS {
        let what = match name {
            "7B" => "7B weights, 291 bf16 tensors (torch: a send each)",
            "64x1MiB" => "64 tensors of 1 MiB in one message (torch: a send each)",
            _ => name,
        };
        let ((og, om), (tg, tm)) = (cells(Some(ours), name), cells(torch, name));
        let r = ratio(ours.get(name), torch.and_then(|t| t.get(name)));
        println!("| {what}, x {} | {og} | {om} | {tg} | {tm} | {r} |", counted(n, quick));
    }
    let flat = torch.and_then(|t| t.get("7B-flat"));
    if flat.is_some() {
        let (tg, tm) = cells(torch, "7B-flat");
        let r = ratio(ours.get("7B"), flat);
        println!("| 7B weights, torch as one flat uint8 buffer (its best case) | - | - | {tg} | {tm} | {r} |");
    }
    let first = |side: Option<&Side>| side.and_then(|s| s.first).map_or(missing(side).into(), duration);
    println!(
        "\nfirst message (1 MiB, NCCL's communicator set-up included), on the receiver: cuda-mp {}, torch {}",
        first(Some(ours)),
        first(torch)
    );
    println!(
        "cuda-mp receives into the memory of the message dropped before (RemoteOptions::reuse_memory); \
         torch receives into buffers allocated once"
    );
    for (label, side) in [("cuda-mp", Some(ours)), ("torch", torch)] {
        if let Some(why) = side.and_then(|s| s.failed.as_ref()) {
            println!("{label} stopped early: {why}");
        }
    }
}

/// The NCCL library torch loads, as the torch script finds it.
fn torch_nccl(python: &str) -> Option<String> {
    let out = Command::new(python).arg(script()).arg("--nccl-path").output().ok()?;
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && Path::new(&path).exists()).then_some(path)
}

/// The NCCL environment of a transport.
fn nccl_env(cmd: &mut Command, transport: &str) {
    cmd.env("NCCL_NVLS_ENABLE", "0");
    for var in ["NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"] {
        if transport == "net" {
            cmd.env(var, "1");
        } else {
            cmd.env_remove(var);
        }
    }
}

#[cuda_mp::main]
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let quick = args.iter().any(|a| a == "--quick");
    let no_torch = args.iter().any(|a| a == "--no-torch");
    let python = value("--python").unwrap_or_else(|| "python3".into());
    // `--run TRANSPORT`: the copy that runs our side of one transport.
    if value("--run").is_some() {
        if let Err(e) = run_ours(quick) {
            println!("{e}");
            std::process::exit(1);
        }
        return;
    }
    let transports = match value("--transport").as_deref().unwrap_or("both") {
        "both" => vec!["net", "nvlink"],
        "net" => vec!["net"],
        "nvlink" => vec!["nvlink"],
        other => {
            println!("--transport takes net, nvlink or both, not {other}");
            std::process::exit(2);
        }
    };
    let nccl_library = std::env::var("CUDA_MP_NCCL_LIBRARY").ok().or_else(|| torch_nccl(&python));
    if let Some(path) = &nccl_library {
        println!("NCCL library for cuda-mp: {path}");
    }
    let exe = std::env::current_exe().expect("this program's path");
    let mut failed = false;
    for transport in transports {
        println!("\n== transport {transport}");
        let mut cmd = Command::new(&exe);
        cmd.args(["--run", transport]).args(quick.then_some("--quick"));
        if let Some(path) = &nccl_library {
            cmd.env("CUDA_MP_NCCL_LIBRARY", path);
        }
        nccl_env(&mut cmd, transport);
        let ours = run_side("cuda-mp", cmd);
        let torch = (!no_torch).then(|| {
            let mut cmd = Command::new(&python);
            cmd.arg(script()).args(["--transport", transport]).args(quick.then_some("--quick"));
            nccl_env(&mut cmd, transport);
            run_side("torch", cmd)
        });
        failed |= ours.failed.is_some() || torch.as_ref().is_some_and(|t| t.failed.is_some());
        print_table(transport, &ours, torch.as_ref(), quick);
    }
    std::process::exit(i32::from(failed));
}
