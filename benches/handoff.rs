//! Handoff benchmarks against torch.multiprocessing, in one run, on one GPU.
//!
//!     cargo bench --bench handoff                 # ours, then benches/torch_baseline.py, one table
//!     cargo bench --bench handoff -- --no-torch   # ours only
//!     cargo bench --bench handoff -- --quick      # fewer rounds
//!     cargo bench --bench handoff -- --storage vmm  # producer memory: legacy, vmm or auto
//!     cargo bench --bench handoff -- --segments legacy # the caching allocator's segments: auto (default), legacy or vmm
//!     cargo bench --bench handoff -- --only bd   # rows b and d only (p: floor and split)
//!
//! Rows (torch runs the same workloads; the ratio is torch / ours, higher is better for us):
//!   a  round trip, same storage resent; the consumer receives, drops, acknowledges
//!   b  round trip, a fresh allocation every round
//!   c  one-way throughput of 4 KiB tensors to a consumer that keeps up
//!   d  weight publish: 291 bf16 tensors shaped like a 7B transformer (13.5 GB); first publish,
//!      then re-publish after an in-place update; the consumer keeps the latest weights and
//!      reads the step counter published with them
//!   e  fan-out: one 1 MiB tensor to 8 consumers, until all acknowledged
//!   s  fresh 1 MiB tensors per second to one consumer that drops each and acknowledges it, 64
//!      in flight: zeroed (a kernel per tensor) and empty (torch.empty), with the caching
//!      allocator (the default), and zeroed without it; zeroed to a consumer that adds 1 to
//!      each (a kernel) before dropping it, and (ours only) to one that reads a byte of each

use std::collections::HashMap;
use std::process::Command;
use std::time::{Duration, Instant};

use cuda_mp::__private::{Phase, PhaseTimes, set_phase_times};
use cuda_mp::{
    Bundle, BundleBuilder, Device, GpuTensor, HostTensor, IpcPayload, JoinHandle, Receiver, Sender, bf16, channel,
    cuda_available, spawn,
};

#[path = "../examples/common/llama.rs"]
mod llama;
use llama::llama7b_shapes;

const WAIT: Duration = Duration::from_secs(120);
const SIZES: [(&str, usize); 4] = [("4K", 4 << 10), ("1M", 1 << 20), ("64M", 64 << 20), ("1G", 1 << 30)];

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Median and p99 in microseconds.
fn summarize(mut us: Vec<f64>) -> (f64, f64) {
    us.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (percentile(&us, 0.5), percentile(&us, 0.99))
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process on this machine, so the two
/// sides of a round trip can be laid on one timeline.
fn mono_ns() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// The consumer's side of one traced round: when its receive returned, when it had done its
/// work, and the library's phase times (microseconds) within the receive.
#[derive(serde::Serialize, serde::Deserialize, Clone, Copy, Default)]
struct Trace {
    received_ns: u64,
    done_ns: u64,
    decode_us: f64,
    open_us: f64,
    fetch_us: f64,
    wait_us: f64,
    /// Bundle rows: reading the step counter back to the host.
    read_us: f64,
    /// Bundle rows: making a one-element host tensor (fresh shared memory, mapped) after it.
    host_us: f64,
}

fn phase_us(after: &PhaseTimes, before: &PhaseTimes, phase: Phase) -> f64 {
    after.since(before, phase).as_secs_f64() * 1e6
}

fn traced_receive<T: serde::Serialize + serde::de::DeserializeOwned>(rx: &Receiver<T>) -> Option<(T, Trace)> {
    set_phase_times(true);
    let before = PhaseTimes::now();
    let value = rx.recv().ok()?;
    let received_ns = mono_ns();
    let after = PhaseTimes::now();
    let trace = Trace {
        received_ns,
        decode_us: phase_us(&after, &before, Phase::Decode),
        open_us: phase_us(&after, &before, Phase::Open),
        fetch_us: phase_us(&after, &before, Phase::Fetch),
        wait_us: phase_us(&after, &before, Phase::EventWait),
        ..Trace::default()
    };
    Some((value, trace))
}

fn traced_drop_and_ack((rx, ack): (Receiver<GpuTensor<u8>>, Sender<Trace>)) {
    while let Some((t, mut trace)) = traced_receive(&rx) {
        drop(t);
        trace.done_ns = mono_ns();
        if ack.send(trace).is_err() {
            break;
        }
    }
}

fn traced_hold_latest((rx, ack): (Receiver<Bundle>, Sender<(i64, Trace)>)) {
    let mut latest = None;
    while let Some((b, mut trace)) = traced_receive(&rx) {
        let start = Instant::now();
        let step = b.get::<i64>("step").and_then(|s| s.to_vec()).map(|v| v[0]).unwrap_or(-1);
        trace.read_us = start.elapsed().as_secs_f64() * 1e6;
        // A reply made of shared memory, as a consumer answering with a tensor would make.
        let start = Instant::now();
        drop(HostTensor::<i64>::from_vec(&[1], vec![step]));
        trace.host_us = start.elapsed().as_secs_f64() * 1e6;
        latest = Some(b);
        trace.done_ns = mono_ns();
        if ack.send((step, trace)).is_err() {
            break;
        }
    }
    drop(latest);
}

/// Both sides of traced rounds, on one clock: the producer's export and send, the receiver
/// waking up and decoding (open, event wait), its work, and the acknowledgement's way back.
#[derive(Default)]
struct Timeline {
    export: Vec<f64>,
    send: Vec<f64>,
    to_received: Vec<f64>,
    decode: Vec<f64>,
    open: Vec<f64>,
    fetch: Vec<f64>,
    wait: Vec<f64>,
    work: Vec<f64>,
    read: Vec<f64>,
    host: Vec<f64>,
    ack: Vec<f64>,
    total: Vec<f64>,
}

impl Timeline {
    /// `start`, `sent`, `acked`: the producer's clock at the send, after it, at the acknowledgement.
    fn push(&mut self, start: u64, sent: u64, acked: u64, export_us: f64, t: &Trace) {
        let us = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1e3;
        self.export.push(export_us);
        self.send.push(us(start, sent));
        self.to_received.push(us(sent, t.received_ns));
        self.decode.push(t.decode_us);
        self.open.push(t.open_us);
        self.fetch.push(t.fetch_us);
        self.wait.push(t.wait_us);
        self.work.push(us(t.received_ns, t.done_ns));
        self.read.push(t.read_us);
        self.host.push(t.host_us);
        self.ack.push(us(t.done_ns, acked));
        self.total.push(us(start, acked));
    }

    fn print(self, what: &str) {
        let m = |v: Vec<f64>| summarize(v).0;
        println!(
            "timeline, {what} (medians, us): total {:.1} = send {:.1} (export {:.1}) + until received {:.1} \
             (decode {:.1}: open {:.1}, descriptor fetch {:.1}, event wait {:.1}) + consumer's work {:.1} \
             (step read {:.1}, a host tensor made {:.1}) + ack {:.1}",
            m(self.total),
            m(self.send),
            m(self.export),
            m(self.to_received),
            m(self.decode),
            m(self.open),
            m(self.fetch),
            m(self.wait),
            m(self.work),
            m(self.read),
            m(self.host),
            m(self.ack)
        );
    }
}

/// Row e again, traced on one clock: where a round of sends to 8 consumers and their 8
/// acknowledgements goes (medians over rounds; a consumer's parts are medians over all 8).
fn trace_fanout(t: &GpuTensor<u8>, rounds: usize, warm: usize) {
    let cs: Vec<(Sender<GpuTensor<u8>>, Receiver<Trace>, JoinHandle<()>)> = (0..8)
        .map(|_| {
            let (tx, rx) = channel().unwrap();
            let (ack_tx, ack) = channel().unwrap();
            (tx, ack, spawn((rx, ack_tx), traced_drop_and_ack))
        })
        .collect();
    let us = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1e3;
    let (mut total, mut sends, mut one_send, mut woken, mut decode, mut work, mut last_ack) =
        (vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
    for i in 0..rounds + warm {
        let start = mono_ns();
        let mut sent = Vec::with_capacity(8);
        for (tx, _, _) in &cs {
            tx.send(t.clone()).unwrap();
            sent.push(mono_ns());
        }
        let traces: Vec<Trace> = cs.iter().map(|(_, ack, _)| ack.recv_timeout(WAIT).unwrap()).collect();
        let end = mono_ns();
        if i < warm {
            continue;
        }
        total.push(us(start, end));
        sends.push(us(start, sent[7]));
        let mut before = start;
        for (s, tr) in sent.iter().zip(&traces) {
            one_send.push(us(before, *s));
            before = *s;
            woken.push(us(*s, tr.received_ns));
            decode.push(tr.decode_us);
            work.push(us(tr.received_ns, tr.done_ns));
        }
        let last_done = traces.iter().map(|tr| tr.done_ns).max().unwrap();
        last_ack.push(us(last_done, end));
    }
    for (tx, _, child) in cs {
        drop(tx);
        child.join().unwrap();
    }
    let m = |v: Vec<f64>| summarize(v).0;
    println!(
        "timeline, e fan-out to 8 (medians, us): total {:.1}; the 8 sends {:.1} (one {:.2}); a consumer: \
         received {:.1} after its send (decode {:.1}), drop and ack {:.1}; the producer has every ack {:.1} \
         after the last consumer's",
        m(total),
        m(sends),
        m(one_send),
        m(woken),
        m(decode),
        m(work),
        m(last_ack)
    );
}

/// Sends `value`, waits for the consumer's answer and, when `timeline` is given, lays both
/// sides of the round on it (one clock); gives the answer.
fn traced_round<T, A>(
    tx: &Sender<T>,
    ack: &Receiver<A>,
    value: T,
    trace: impl Fn(&A) -> &Trace,
    timeline: Option<&mut Timeline>,
) -> A
where
    T: serde::Serialize + serde::de::DeserializeOwned,
    A: serde::Serialize + serde::de::DeserializeOwned,
{
    let before = PhaseTimes::now();
    let start = mono_ns();
    tx.send(value).unwrap();
    let sent = mono_ns();
    let answer = ack.recv_timeout(WAIT).unwrap();
    let acked = mono_ns();
    if let Some(timeline) = timeline {
        let export_us = phase_us(&PhaseTimes::now(), &before, Phase::Export);
        timeline.push(start, sent, acked, export_us, trace(&answer));
    }
    answer
}

fn drop_and_ack((rx, ack): (Receiver<GpuTensor<u8>>, Sender<()>)) {
    while let Ok(t) = rx.recv() {
        drop(t);
        if ack.send(()).is_err() {
            break;
        }
    }
}

/// Row c's warm-up: tensors the consumer receives (and maps) before the timed part.
const C_WARM: u64 = 8;

/// Receives and drops `n` tensors; says when it has received the first [`C_WARM`] (its CUDA
/// set up, part of the pool mapped), then, at the end, how many in all and where its time went
/// per message after the warm-up: the whole loop, the tensors' decode (when `timed`), and the
/// drops (microseconds).
fn count_then_ack((rx, ack, n, timed): (Receiver<GpuTensor<u8>>, Sender<(u64, f64, f64, f64)>, u64, bool)) {
    set_phase_times(timed);
    let mut seen = 0;
    let (mut start, mut phases) = (Instant::now(), PhaseTimes::now());
    let mut dropping = Duration::ZERO;
    while seen < n {
        match rx.recv() {
            Ok(t) => {
                let dropped = Instant::now();
                drop(t);
                dropping += dropped.elapsed();
                seen += 1;
                if seen == C_WARM {
                    let _ = ack.send((seen, 0.0, 0.0, 0.0));
                    (start, phases, dropping) = (Instant::now(), PhaseTimes::now(), Duration::ZERO);
                }
            }
            Err(_) => break,
        }
    }
    let per = |d: Duration| d.as_secs_f64() * 1e6 / seen.saturating_sub(C_WARM).max(1) as f64;
    let decode = PhaseTimes::now().since(&phases, Phase::Decode);
    let _ = ack.send((seen, per(start.elapsed()), per(decode), per(dropping)));
}

/// Row s's consumer: drops each tensor and acknowledges it.
fn drop_each((rx, ack): (Receiver<GpuTensor<u8>>, Sender<()>)) {
    while let Ok(t) = rx.recv() {
        drop(t);
        if ack.send(()).is_err() {
            break;
        }
    }
}

/// Row s's consumer that reads one byte of each tensor back (a copy after the sender's
/// zeroing, and a wait for it) before dropping it.
fn read_each((rx, ack): (Receiver<GpuTensor<u8>>, Sender<()>)) {
    while let Ok(t) = rx.recv() {
        let byte = t.narrow(0, 0, 1).and_then(|b| b.to_vec());
        drop(t);
        if byte.is_err() || ack.send(()).is_err() {
            break;
        }
    }
}

/// Row s's consumer that uses each tensor on the GPU: it adds 1 to it (a kernel queued after
/// the sender's zeroing, no host wait) before dropping it.
fn add_to_each((rx, ack): (Receiver<GpuTensor<u8>>, Sender<()>)) {
    while let Ok(t) = rx.recv() {
        let added = t.add_scalar(1.0);
        drop(t);
        if added.is_err() || ack.send(()).is_err() {
            break;
        }
    }
}

/// What row s's consumer does with each tensor before it drops it and acknowledges it.
#[derive(Clone, Copy, PartialEq)]
enum Use {
    Nothing,
    ReadByte,
    Kernel,
}

/// Row s: `n` fresh 1 MiB tensors (zeroed by a kernel, or left as allocated), at most `window`
/// unacknowledged, to a consumer that uses each as `using` says and drops it; tensors per
/// second.
fn fresh_rate(dev: &std::sync::Arc<Device>, n: usize, window: usize, zeroed: bool, using: Use) -> f64 {
    let (tx, rx) = channel().unwrap();
    let (ack_tx, ack) = channel().unwrap();
    let child = match using {
        Use::Nothing => spawn((rx, ack_tx), drop_each),
        Use::ReadByte => spawn((rx, ack_tx), read_each),
        Use::Kernel => spawn((rx, ack_tx), add_to_each),
    };
    let send = |k: usize| {
        for _ in 0..k {
            let t =
                if zeroed { GpuTensor::<u8>::zeros(dev, &[1 << 20]) } else { GpuTensor::<u8>::empty(dev, &[1 << 20]) };
            tx.send(t.unwrap()).unwrap();
        }
    };
    // Warm-up: the consumer sets up CUDA (and, with the caching allocator, maps the segments).
    send(window);
    for _ in 0..window {
        ack.recv_timeout(WAIT).unwrap();
    }
    let start = Instant::now();
    send(window);
    for _ in window..n {
        ack.recv_timeout(WAIT).unwrap();
        send(1);
    }
    for _ in 0..window {
        ack.recv_timeout(WAIT).unwrap();
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    drop(tx);
    child.join().unwrap();
    rate
}

/// [`hold_latest`] with receives that spin up to 10 ms before they sleep.
fn hold_latest_spinning((rx, ack): (Receiver<Bundle>, Sender<i64>)) {
    rx.set_spin(Some(SPIN));
    hold_latest((rx, ack))
}

/// How long the receivers of row d's spinning re-publish spin: longer than the update kernels
/// between two publishes.
const SPIN: Duration = Duration::from_millis(10);

fn hold_latest((rx, ack): (Receiver<Bundle>, Sender<i64>)) {
    let mut latest = None;
    while let Ok(b) = rx.recv() {
        let step = b.get::<i64>("step").and_then(|s| s.to_vec()).map(|v| v[0]).unwrap_or(-1);
        latest = Some(b);
        if ack.send(step).is_err() {
            break;
        }
    }
    drop(latest);
}

/// Times the import of an exported payload (opening its handle) and the first read through it.
fn profile_import((rx, ack): (Receiver<IpcPayload>, Sender<(f64, f64, f64)>)) {
    set_phase_times(true);
    while let Ok(p) = rx.recv() {
        let before = PhaseTimes::now();
        let start = Instant::now();
        let t = GpuTensor::<u8>::from_ipc_payload(p).unwrap();
        let imported = start.elapsed().as_secs_f64() * 1e6;
        let fetch = phase_us(&PhaseTimes::now(), &before, Phase::Fetch);
        let start = Instant::now();
        let _ = t.narrow(0, t.numel() - 1, 1).unwrap().to_vec().unwrap();
        let read = start.elapsed().as_secs_f64() * 1e6;
        drop(t);
        if ack.send((imported, read, fetch)).is_err() {
            break;
        }
    }
}

fn ping((rx, ack): (Receiver<()>, Sender<()>)) {
    while rx.recv().is_ok() {
        if ack.send(()).is_err() {
            break;
        }
    }
}

struct Consumer {
    tx: Sender<GpuTensor<u8>>,
    ack: Receiver<()>,
    child: JoinHandle<()>,
}

fn consumer() -> Consumer {
    let (tx, rx) = channel().unwrap();
    let (ack_tx, ack) = channel().unwrap();
    let child = spawn((rx, ack_tx), drop_and_ack);
    Consumer { tx, ack, child }
}

impl Consumer {
    fn round(&self, t: &GpuTensor<u8>) -> f64 {
        let start = Instant::now();
        self.tx.send(t.clone()).unwrap();
        self.ack.recv_timeout(WAIT).unwrap();
        start.elapsed().as_secs_f64() * 1e6
    }

    fn finish(self) {
        drop(self.tx);
        self.child.join().unwrap();
    }
}

#[derive(Default)]
struct Results {
    /// key -> (median, p99) in microseconds, or (rate, 0) for throughput rows.
    ours: HashMap<String, (f64, f64)>,
    torch: HashMap<String, (f64, f64)>,
}

fn run_ours(dev: &std::sync::Arc<Device>, quick: bool, only: Option<&str>, r: &mut Results) {
    // `--only ROWS`: the rows to run (letters a-e; p for the floor, export and first-handoff split).
    let want = |row: &str| only.is_none_or(|o| o.contains(row));
    let rounds = if quick { 200 } else { 1000 };
    let warm = if quick { 20 } else { 100 };

    // Floor: an empty message round trip through the same channels.
    if want("p") {
        let (tx, rx) = channel().unwrap();
        let (ack_tx, ack) = channel().unwrap();
        let child = spawn((rx, ack_tx), ping);
        let mut us = Vec::new();
        for i in 0..rounds + warm {
            let start = Instant::now();
            tx.send(()).unwrap();
            ack.recv_timeout(WAIT).unwrap();
            if i >= warm {
                us.push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
        r.ours.insert("floor".into(), summarize(us));
        // The same after both processes idled 7 ms (as long as row d's update kernels take).
        let mut us = Vec::new();
        for _ in 0..200 {
            std::thread::sleep(Duration::from_millis(7));
            let start = Instant::now();
            tx.send(()).unwrap();
            ack.recv_timeout(WAIT).unwrap();
            us.push(start.elapsed().as_secs_f64() * 1e6);
        }
        r.ours.insert("floor_paused".into(), summarize(us));
        drop(tx);
        child.join().unwrap();
    }
    // Export cost in process: lease, event record, wire form.
    if want("p") {
        let t = GpuTensor::<u8>::zeros(dev, &[1 << 20]).unwrap();
        let mut us = Vec::new();
        for i in 0..rounds + warm {
            let start = Instant::now();
            let p = t.ipc_payload().unwrap();
            drop(p);
            if i >= warm {
                us.push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
        r.ours.insert("export".into(), summarize(us));
    }
    // Where a first handoff's time goes: export (IPC handle, lease) here, handle opening and the
    // first read through the mapping in the consumer. Each size is a fresh allocation.
    if want("p") {
        let (tx, rx) = channel().unwrap();
        let (ack_tx, ack) = channel().unwrap();
        let child = spawn((rx, ack_tx), profile_import);
        let warm = GpuTensor::<u8>::zeros(dev, &[4096]).unwrap();
        tx.send(warm.ipc_payload().unwrap()).unwrap();
        ack.recv_timeout(WAIT).unwrap();
        for (name, bytes) in
            [("4K", 4usize << 10), ("1M", 1 << 20), ("64M", 64 << 20), ("1G", 1 << 30), ("13.5G", 13_476_000_000)]
        {
            let mut export = Vec::new();
            let mut import = Vec::new();
            let mut read = Vec::new();
            let mut fetch = Vec::new();
            let mut alloc = Vec::new();
            for _ in 0..if bytes > 1 << 30 { 3 } else { 20 } {
                let start = Instant::now();
                let t = GpuTensor::<u8>::zeros(dev, &[bytes]).unwrap();
                t.synchronize().unwrap();
                alloc.push(start.elapsed().as_secs_f64() * 1e6);
                let start = Instant::now();
                let p = t.ipc_payload().unwrap();
                export.push(start.elapsed().as_secs_f64() * 1e6);
                tx.send(p).unwrap();
                let (i, r, f) = ack.recv_timeout(WAIT).unwrap();
                import.push(i);
                read.push(r);
                fetch.push(f);
                // Untimed: the consumer unmaps and this process frees before the next one.
                let live = cuda_mp::lifetime_stats().live_storages;
                drop(t);
                cuda_mp::wait_for_lifetime(WAIT, |s| s.live_storages < live).unwrap();
            }
            r.ours.insert(format!("p_export_{name}"), summarize(export));
            r.ours.insert(format!("p_import_{name}"), summarize(import));
            r.ours.insert(format!("p_read_{name}"), summarize(read));
            r.ours.insert(format!("p_fetch_{name}"), summarize(fetch));
            r.ours.insert(format!("p_alloc_{name}"), summarize(alloc));
        }
        drop(tx);
        child.join().unwrap();
    }
    // a: same storage resent.
    for (name, bytes) in SIZES.into_iter().filter(|_| want("a")) {
        let c = consumer();
        let t = GpuTensor::<u8>::zeros(dev, &[bytes]).unwrap();
        let us: Vec<f64> = (0..rounds + warm).map(|_| c.round(&t)).skip(warm).collect();
        c.finish();
        r.ours.insert(format!("a_{name}"), summarize(us));
    }
    // b: fresh allocation every round (allocation and free outside the timed part).
    for (name, bytes) in SIZES.into_iter().filter(|_| want("b")) {
        let c = consumer();
        let mut us = Vec::new();
        let live = cuda_mp::lifetime_stats().live_storages;
        for i in 0..rounds + warm {
            let t = GpuTensor::<u8>::zeros(dev, &[bytes]).unwrap();
            t.synchronize().unwrap();
            let dt = c.round(&t);
            drop(t);
            // Untimed: the consumer unmaps and this process frees before the next round.
            cuda_mp::wait_for_lifetime(WAIT, |s| s.live_storages == live).unwrap();
            if i >= warm {
                us.push(dt);
            }
        }
        c.finish();
        r.ours.insert(format!("b_{name}"), summarize(us));
    }
    // b, traced: the same rounds with both sides' steps on one clock.
    for (name, bytes) in SIZES.into_iter().filter(|_| want("b")) {
        let (tx, rx) = channel().unwrap();
        let (ack_tx, ack) = channel().unwrap();
        let child = spawn((rx, ack_tx), traced_drop_and_ack);
        let live = cuda_mp::lifetime_stats().live_storages;
        let mut timeline = Timeline::default();
        for i in 0..(rounds + warm) / 4 {
            let t = GpuTensor::<u8>::zeros(dev, &[bytes]).unwrap();
            t.synchronize().unwrap();
            let measured = (i >= warm / 4).then_some(&mut timeline);
            traced_round(&tx, &ack, t.clone(), |t: &Trace| t, measured);
            drop(t);
            cuda_mp::wait_for_lifetime(WAIT, |s| s.live_storages == live).unwrap();
        }
        drop(tx);
        child.join().unwrap();
        timeline.print(&format!("b {name}"));
    }
    // c, transport ceiling: one-way empty messages.
    if want("c") {
        let n: u64 = if quick { 20_000 } else { 100_000 };
        let (tx, rx) = channel::<()>().unwrap();
        let (ack_tx, ack) = channel().unwrap();
        let child = spawn((rx, ack_tx, n), |(rx, ack, n): (Receiver<()>, Sender<u64>, u64)| {
            let mut seen = 0;
            while seen < n && rx.recv().is_ok() {
                seen += 1;
            }
            let _ = ack.send(seen);
        });
        let start = Instant::now();
        for _ in 0..n {
            tx.send(()).unwrap();
        }
        assert_eq!(ack.recv_timeout(WAIT).unwrap(), n);
        r.ours.insert("c_empty".into(), (n as f64 / start.elapsed().as_secs_f64(), 0.0));
        drop(tx);
        child.join().unwrap();
    }
    // c: one-way throughput, timed without the phase clocks (a pass of its own gives the
    // split per message, with them).
    for timed in [false, true].into_iter().filter(|_| want("c")) {
        let n: u64 = if quick || timed { 20_000 } else { 100_000 };
        let pool: Vec<GpuTensor<u8>> = (0..64).map(|_| GpuTensor::<u8>::zeros(dev, &[4096]).unwrap()).collect();
        let (tx, rx) = channel().unwrap();
        let (ack_tx, ack) = channel().unwrap();
        set_phase_times(timed);
        let child = spawn((rx, ack_tx, n, timed), count_then_ack);
        for t in pool.iter().take(C_WARM as usize) {
            tx.send(t.clone()).unwrap(); // warm-up: the consumer sets up CUDA and maps part of the pool
        }
        // Timed from when the consumer has received them (torch's row waits the same way).
        assert_eq!(ack.recv_timeout(WAIT).unwrap().0, C_WARM);
        let child_n = n - C_WARM;
        let phases = PhaseTimes::now();
        let start = Instant::now();
        for i in 0..child_n {
            tx.send(pool[i as usize % pool.len()].clone()).unwrap();
        }
        let sending = start.elapsed();
        let (seen, consumer_loop, consumer_decode, consumer_drop) = ack.recv_timeout(WAIT).unwrap();
        let secs = start.elapsed().as_secs_f64();
        assert_eq!(seen, n);
        drop(tx);
        child.join().unwrap();
        set_phase_times(true);
        let per = |d: Duration| d.as_secs_f64() * 1e6 / child_n as f64;
        if !timed {
            r.ours.insert("c_rate".into(), (child_n as f64 / secs, 0.0));
            r.ours.insert("c_split_plain".into(), (per(sending), consumer_loop));
            continue;
        }
        let export = PhaseTimes::now().since(&phases, Phase::Export);
        let record = PhaseTimes::now().since(&phases, Phase::EventRecord);
        r.ours.insert("c_rate_timed".into(), (child_n as f64 / secs, 0.0));
        r.ours.insert("c_split_send".into(), (per(sending), per(export)));
        r.ours.insert("c_split_record".into(), (per(record), 0.0));
        r.ours.insert("c_split_recv".into(), (consumer_loop, consumer_decode));
        r.ours.insert("c_split_drop".into(), (consumer_drop, 0.0));
    }
    // d: weight publish in one allocation (the default), then re-published; and the first
    // publish of the same weights packed into 1 GiB allocations, for comparison.
    for (key, chunk) in [("d", cuda_mp::DEFAULT_CHUNK_BYTES), ("d1", 1 << 30)].into_iter().filter(|_| want("d")) {
        let shapes = llama7b_shapes();
        let mut builder = BundleBuilder::new().chunk_bytes(chunk);
        for (name, shape) in &shapes {
            builder = builder.add::<bf16>(name.clone(), shape);
        }
        let bundle = builder.add::<i64>("step", &[1]).build(dev).unwrap();
        let tensors: Vec<GpuTensor<bf16>> = shapes.iter().map(|(n, _)| bundle.get::<bf16>(n).unwrap()).collect();
        let step = bundle.get::<i64>("step").unwrap();
        bundle.synchronize().unwrap();
        println!(
            "weights: {} tensors, {:.2} GB in {} allocation(s)",
            shapes.len(),
            bundle.byte_len() as f64 / 1e9,
            bundle.allocations()
        );
        let (tx, rx) = channel().unwrap();
        let (ack_tx, ack) = channel().unwrap();
        let child = spawn((rx, ack_tx), hold_latest);
        // Untimed warm-up: the consumer starts CUDA on a small bundle first.
        let small = BundleBuilder::new().add::<i64>("step", &[1]).build(dev).unwrap();
        tx.send(small).unwrap();
        ack.recv_timeout(WAIT).unwrap();
        let publish = |s: i64| {
            step.fill(s).unwrap();
            bundle.synchronize().unwrap();
            let start = Instant::now();
            tx.send(bundle.clone()).unwrap();
            let got = ack.recv_timeout(WAIT).unwrap();
            let us = start.elapsed().as_secs_f64() * 1e6;
            assert_eq!(got, s, "the consumer read this publish's step");
            us
        };
        let first = publish(1);
        r.ours.insert(format!("{key}_first"), (first, first));
        if key == "d" {
            let mut again = Vec::new();
            for s in 2..=11 {
                for t in &tensors {
                    t.add_scalar(1.0).unwrap();
                }
                again.push(publish(s));
            }
            r.ours.insert("d_republish".into(), summarize(again));
            // The same bundle through a channel inside this process: encoding and decoding its
            // 292-entry table and resolving its storage here, with no other process, no GPU
            // work and no acknowledgement.
            let (self_tx, self_rx) = channel::<cuda_mp::Bundle>().unwrap();
            let mut local = Vec::new();
            for _ in 0..20 {
                let start = Instant::now();
                self_tx.send(bundle.clone()).unwrap();
                let back = self_rx.recv().unwrap();
                local.push(start.elapsed().as_secs_f64() * 1e6);
                drop(back);
            }
            let (median, p99) = summarize(local);
            println!("bundle of 292 tensors sent to this process and decoded: median {median:.1} us, p99 {p99:.1} us");
            // What the consumer does after decoding: read the step counter back.
            let mut reads = Vec::new();
            for _ in 0..20 {
                let start = Instant::now();
                let _ = step.to_vec().unwrap();
                reads.push(start.elapsed().as_secs_f64() * 1e6);
            }
            let (median, p99) = summarize(reads);
            println!("reading one i64 back to the host: median {median:.1} us, p99 {p99:.1} us");
        }
        drop(tx);
        child.join().unwrap();
        if key == "d" {
            // The same re-publishes with both receivers (the consumer's of the weights, this
            // process's of the acknowledgements) spinning through the update kernels:
            // `Receiver::set_spin`, a processor busy on each side.
            let (tx, rx) = channel().unwrap();
            let (ack_tx, ack) = channel::<i64>().unwrap();
            ack.set_spin(Some(SPIN));
            let child = spawn((rx, ack_tx), hold_latest_spinning);
            tx.send(BundleBuilder::new().add::<i64>("step", &[1]).build(dev).unwrap()).unwrap();
            ack.recv_timeout(WAIT).unwrap();
            tx.send(bundle.clone()).unwrap();
            ack.recv_timeout(WAIT).unwrap();
            let mut spinning = Vec::new();
            for s in 12..=21 {
                for t in &tensors {
                    t.add_scalar(1.0).unwrap();
                }
                step.fill(s).unwrap();
                bundle.synchronize().unwrap();
                let start = Instant::now();
                tx.send(bundle.clone()).unwrap();
                let got = ack.recv_timeout(WAIT).unwrap();
                spinning.push(start.elapsed().as_secs_f64() * 1e6);
                assert_eq!(got, s, "the consumer read this publish's step");
            }
            let (median, p99) = summarize(spinning);
            println!(
                "d re-publish, both receivers spinning {} ms (Receiver::set_spin): median {median:.1} us, p99 {p99:.1} us",
                SPIN.as_millis()
            );
            r.ours.insert("d_republish_spinning".into(), (median, p99));
            drop(tx);
            child.join().unwrap();
            // Traced: first publish to a fresh consumer, then re-publishes, both sides on one clock.
            let (tx, rx) = channel().unwrap();
            let (ack_tx, ack) = channel().unwrap();
            let child = spawn((rx, ack_tx), traced_hold_latest);
            let small = BundleBuilder::new().add::<i64>("step", &[1]).build(dev).unwrap();
            tx.send(small).unwrap();
            ack.recv_timeout(WAIT).unwrap();
            let mut first = Timeline::default();
            let mut again = Timeline::default();
            let mut idle = Timeline::default();
            for s in 100..=110 {
                if s > 100 {
                    for t in &tensors {
                        t.add_scalar(1.0).unwrap();
                    }
                }
                step.fill(s).unwrap();
                bundle.synchronize().unwrap();
                let timeline = if s == 100 { &mut first } else { &mut again };
                let (got, _) = traced_round(&tx, &ack, bundle.clone(), |a: &(i64, Trace)| &a.1, Some(timeline));
                assert_eq!(got, s);
            }
            // The same re-publish after a pause as long as the update kernels take, without
            // them: both processes idle for that long, neither GPU work nor a context switch.
            let mut paused = Timeline::default();
            for s in 300..=310 {
                std::thread::sleep(Duration::from_millis(7));
                let (got, _) = traced_round(&tx, &ack, bundle.clone(), |a: &(i64, Trace)| &a.1, Some(&mut paused));
                assert_eq!(got, 110, "step {s}: the step counter is unchanged");
            }
            paused.print("d re-publish after a 7 ms pause, no update");
            // The same re-publish without the update kernels: no GPU work of the producer's
            // between two publishes.
            for s in 200..=210 {
                let (got, _) = traced_round(&tx, &ack, bundle.clone(), |a: &(i64, Trace)| &a.1, Some(&mut idle));
                assert_eq!(got, 110, "step {s}: the step counter is unchanged");
            }
            first.print("d first publish");
            again.print("d re-publish after the update kernels");
            idle.print("d re-publish, no update in between");
            drop(tx);
            child.join().unwrap();
        }
    }
    // e: fan-out to 8 consumers.
    if want("e") {
        let t = GpuTensor::<u8>::zeros(dev, &[1 << 20]).unwrap();
        let cs: Vec<Consumer> = (0..8).map(|_| consumer()).collect();
        let mut us = Vec::new();
        for i in 0..rounds + warm {
            let start = Instant::now();
            for c in &cs {
                c.tx.send(t.clone()).unwrap();
            }
            for c in &cs {
                c.ack.recv_timeout(WAIT).unwrap();
            }
            if i >= warm {
                us.push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
        for c in cs {
            c.finish();
        }
        r.ours.insert("e_fanout8".into(), summarize(us));
        trace_fanout(&t, rounds, warm);
    }
    // s: fresh tensors, with and without the caching allocator.
    if want("s") {
        let n = if quick { 5_000 } else { 20_000 };
        let caching = dev.caching();
        r.ours.insert("s_fresh1M".into(), (fresh_rate(dev, n, 64, true, Use::Nothing), 0.0));
        r.ours.insert("s_empty1M".into(), (fresh_rate(dev, n, 64, false, Use::Nothing), 0.0));
        r.ours.insert("s_use".into(), (fresh_rate(dev, n, 64, true, Use::Kernel), 0.0));
        r.ours.insert("s_read".into(), (fresh_rate(dev, n, 64, true, Use::ReadByte), 0.0));
        dev.set_caching(false);
        r.ours.insert("s_nocache".into(), (fresh_rate(dev, n, 64, true, Use::Nothing), 0.0));
        dev.set_caching(caching);
    }
}

fn run_torch(quick: bool, r: &mut Results) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/torch_baseline.py");
    let script =
        if std::path::Path::new(script).exists() { script.to_string() } else { "benches/torch_baseline.py".into() };
    let mut cmd = Command::new("python3");
    cmd.arg(&script);
    if quick {
        cmd.arg("--quick");
    }
    println!("running the torch.multiprocessing baseline: python3 {script}");
    match cmd.output() {
        Ok(out) if out.status.success() => {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                let f: Vec<&str> = line.split_whitespace().collect();
                if f.len() == 4 && f[0] == "row" {
                    if let (Ok(a), Ok(b)) = (f[2].parse(), f[3].parse()) {
                        r.torch.insert(f[1].to_string(), (a, b));
                    }
                } else if !line.is_empty() {
                    println!("  torch: {line}");
                }
            }
        }
        Ok(out) => {
            println!("torch baseline failed ({}):\n{}", out.status, String::from_utf8_lossy(&out.stderr));
        }
        Err(e) => println!("torch baseline not run: {e}"),
    }
}

fn print_table(r: &Results) {
    let rows: Vec<(&str, String)> = std::iter::empty()
        .chain(SIZES.iter().map(|(n, _)| ("a", n.to_string())))
        .chain(SIZES.iter().map(|(n, _)| ("b", n.to_string())))
        .chain([("c", "rate".to_string())])
        .chain([("d", "first".to_string()), ("d", "republish".to_string())])
        .chain([("e", "fanout8".to_string())])
        .chain([("s", "fresh1M".to_string()), ("s", "empty1M".to_string()), ("s", "use".to_string())])
        .collect();
    println!();
    println!("| row | workload | cuda-mp median | cuda-mp p99 | torch median | torch p99 | torch / cuda-mp |");
    println!("|---|---|---|---|---|---|---|");
    for (row, name) in rows {
        let key = format!("{row}_{name}");
        let ours = r.ours.get(&key);
        let torch = r.torch.get(&key);
        let rate = row == "c" || row == "s";
        let fmt = |v: Option<&(f64, f64)>, i: usize| match v {
            Some(v) if rate && i == 0 => format!("{:.0}/s", v.0),
            Some(_) if rate => "-".into(),
            Some(v) => format!("{:.1} us", if i == 0 { v.0 } else { v.1 }),
            None => "n/a".into(),
        };
        let ratio = match (ours, torch) {
            (Some(o), Some(t)) if rate => format!("{:.1}x", o.0 / t.0),
            (Some(o), Some(t)) => format!("{:.1}x", t.0 / o.0),
            _ => "n/a".into(),
        };
        let what = match row {
            "a" => format!("round trip, same storage, {name}"),
            "b" => format!("round trip, fresh allocation, {name}"),
            "c" => "one-way, 4 KiB tensors per second".into(),
            "d" => format!("7B weights (291 bf16 tensors), {name}"),
            "s" if name == "fresh1M" => "fresh 1 MiB tensors per second (zeros), 64 in flight".into(),
            "s" if name == "use" => "fresh 1 MiB (zeros), the consumer adds 1 to each (a kernel)".into(),
            "s" => "fresh 1 MiB tensors per second (empty: no kernel), 64 in flight".into(),
            _ => "1 MiB to 8 consumers, all acknowledged".into(),
        };
        println!(
            "| {row} | {what} | {} | {} | {} | {} | {ratio} |",
            fmt(ours, 0),
            fmt(ours, 1),
            fmt(torch, 0),
            fmt(torch, 1)
        );
    }
    if let Some(s) = r.ours.get("s_read") {
        println!("\ncuda-mp row s (zeros) to a consumer that reads a byte of each before dropping it: {:.0}/s", s.0);
    }
    if let Some(s) = r.ours.get("s_nocache") {
        println!("\ncuda-mp row s without the caching allocator (one allocation per tensor): {:.0}/s", s.0);
    }
    if let Some(d1) = r.ours.get("d1_first") {
        println!("\ncuda-mp first publish of the same weights in 1 GiB allocations: {:.1} us", d1.0);
    }
    if let Some(c) = r.ours.get("c_empty") {
        println!("cuda-mp transport ceiling, one-way empty messages: {:.0}/s", c.0);
    }
    if let (Some(s), Some(rec), Some(v), Some(d)) = (
        r.ours.get("c_split_send"),
        r.ours.get("c_split_record"),
        r.ours.get("c_split_recv"),
        r.ours.get("c_split_drop"),
    ) {
        println!(
            "row c per message: producer {:.2} us a send (export {:.2} us, of which event check and record {:.2} us); \
             consumer {:.2} us a receive loop (decode {:.2} us, drop {:.2} us)",
            s.0, s.1, rec.0, v.0, v.1, d.0
        );
    }
    if let (Some(plain), Some(timed)) = (r.ours.get("c_split_plain"), r.ours.get("c_rate_timed")) {
        println!(
            "row c without the phase clocks: producer {:.2} us a send, consumer {:.2} us a receive loop; \
             with them (the pass above): {:.0}/s",
            plain.0, plain.1, timed.0
        );
    }
    if let Some(f) = r.ours.get("floor") {
        println!("cuda-mp floor, empty message round trip: median {:.1} us, p99 {:.1} us", f.0, f.1);
    }
    if let Some(f) = r.ours.get("floor_paused") {
        println!("cuda-mp floor after both processes idled 7 ms: median {:.1} us, p99 {:.1} us", f.0, f.1);
    }
    if let (Some(hot), Some(paused)) = (r.torch.get("w_hot"), r.torch.get("w_paused")) {
        println!(
            "machine baseline, multiprocessing.Pipe empty round trip (python): back to back {:.1} us, after 7 ms idle {:.1} us (medians)",
            hot.0, paused.0
        );
    }
    if let Some(e) = r.ours.get("export") {
        println!("cuda-mp export in process (lease, event record, wire form): median {:.1} us, p99 {:.1} us", e.0, e.1);
    }
    for name in ["4K", "1M", "64M", "1G", "13.5G"] {
        if let Some(o) = r.torch.get(&format!("p_rawopen_{name}")) {
            println!(
                "driver baseline, cudaIpcOpenMemHandle of a fresh {name} cudaMalloc allocation (cupy): {:.1} us (median)",
                o.0
            );
        }
        if let (Some(e), Some(i), Some(rd)) = (
            r.ours.get(&format!("p_export_{name}")),
            r.ours.get(&format!("p_import_{name}")),
            r.ours.get(&format!("p_read_{name}")),
        ) {
            let fetch = r.ours.get(&format!("p_fetch_{name}")).map_or(0.0, |f| f.0);
            let alloc = r.ours.get(&format!("p_alloc_{name}")).map_or(0.0, |f| f.0);
            println!(
                "first handoff of a fresh {name} allocation: allocate and zero {alloc:.1} us, export {:.1} us, import {:.1} us (of which descriptor fetch {fetch:.1} us), first read {:.1} us (medians)",
                e.0, i.0, rd.0
            );
        }
    }
    if let (Some(e), Some(a)) = (r.ours.get("e_fanout8"), r.ours.get("a_1M")) {
        println!("fan-out to 8 / single-consumer round trip (1 MiB): {:.1}x", e.0 / a.0);
    }
}

#[cuda_mp::main]
fn main() {
    // Phase clocks on for the splits the rows print (row c turns them off for its rate).
    set_phase_times(true);
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let no_torch = args.iter().any(|a| a == "--no-torch");
    if !cuda_available() {
        let why = Device::count().err().map(|e| e.to_string()).unwrap_or_else(|| "no GPU is visible".into());
        println!("the handoff benchmark needs a CUDA GPU: {why}");
        std::process::exit(2);
    }
    let dev = Device::get(0).unwrap();
    // `--storage legacy|vmm|auto`: the GPU memory the producer allocates (default auto);
    // `--segments legacy|vmm|auto`: the memory of the caching allocator's segments (default auto).
    let kind_of = |flag: &str, default: cuda_mp::GpuMemoryKind| {
        let given = args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1));
        given.map_or(Ok(default), |s| s.parse::<cuda_mp::GpuMemoryKind>()).unwrap_or_else(|e| {
            println!("{flag}: {e}");
            std::process::exit(2);
        })
    };
    let kind = kind_of("--storage", cuda_mp::GpuMemoryKind::Auto);
    let segments = kind_of("--segments", cuda_mp::GpuMemoryKind::Auto);
    dev.set_memory_kind(kind);
    if let Err(e) = dev.set_segment_kind(segments) {
        println!("--segments: {e}");
        std::process::exit(2);
    }
    println!("GPU 0: {} (memory: {kind:?}, segments: {segments:?})", dev.uuid_string());
    let mut r = Results::default();
    let only = args.iter().position(|a| a == "--only").and_then(|i| args.get(i + 1));
    run_ours(&dev, quick, only.map(String::as_str), &mut r);
    // Ours as measured, before the baseline runs: a baseline that does not finish leaves them.
    let mut ours: Vec<(&String, &(f64, f64))> = r.ours.iter().collect();
    ours.sort_by(|a, b| a.0.cmp(b.0));
    for (key, (value, p99)) in ours {
        println!("  ours: {key} {value:.1} {p99:.1}");
    }
    if !no_torch {
        run_torch(quick, &mut r);
    }
    print_table(&r);
}
