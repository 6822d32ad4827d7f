//! Kill points (`cuda_mp::testing::KILL_POINTS`): a process is killed with SIGKILL at each
//! named point of a send, a receive, an import, a forward and a queue delivery, run after run;
//! each run then checks that this process's descriptors and /dev/shm are back where they were,
//! that everything it exported is freed (its lifetime counters at zero), that every message
//! that arrived is whole, and that none arrived twice. The same scenarios run with host tensors
//! and, on a GPU, with GPU tensors (legacy and VMM memory, the caching allocator on and off),
//! where the device's free memory must come back too. `CUDA_MP_KILL_RUNS` sets the runs per
//! point: 25 by default, so that `cargo test` stays short; the full count is
//! `CUDA_MP_KILL_RUNS=100 cargo test --test kill_points` (`-- --include-ignored` on a GPU).

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cuda_mp::testing::{KILL_AT_ENV, KILL_POINTS};
use cuda_mp::{Builder, HostTensor, Queue, QueueConsumer, Receiver, Sender, channel, wait_for_lifetime};
#[cfg(feature = "cuda")]
use cuda_mp::{GpuMemoryKind, GpuTensor};
use serde::{Deserialize, Serialize};

cuda_mp::enable_test_support!();

mod common;

static SERIAL: Mutex<()> = Mutex::new(());
const WAIT: Duration = Duration::from_secs(20);

fn runs() -> usize {
    std::env::var("CUDA_MP_KILL_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(25)
}

/// This process's open descriptors and the files in /dev/shm, and what the descriptors are;
/// with GPU tensors, the device's free memory.
#[derive(Debug)]
struct Resources {
    descriptors: Vec<String>,
    shm: Vec<String>,
    device_free: Option<usize>,
}

fn resources(memory: Memory) -> Resources {
    Resources { descriptors: common::descriptor_names(), shm: common::shm_entries(), device_free: memory.device_free() }
}

impl Resources {
    /// What `self` holds beyond `baseline`.
    fn beyond(&self, baseline: &Resources) -> Option<String> {
        let mut extra = common::descriptors_beyond(&self.descriptors, &baseline.descriptors);
        // The listing itself is one descriptor; a pipe with both ends here is a spare lease,
        // which the lease machinery keeps a varying number of.
        let both_ends = |d: &String| d.starts_with("pipe:") && self.descriptors.iter().filter(|e| *e == d).count() == 2;
        extra.retain(|d| !d.starts_with("/proc/") && !both_ends(d));
        // A little slack for the device: the driver's own bookkeeping moves by a page or so.
        let device_short = match (self.device_free, baseline.device_free) {
            (Some(now), Some(was)) => now + (2 << 20) < was,
            _ => false,
        };
        let shm: Vec<&String> = self.shm.iter().filter(|n| !baseline.shm.contains(n)).collect();
        (!extra.is_empty() || !shm.is_empty() || device_short).then(|| {
            format!(
                "descriptors {extra:?}, /dev/shm {shm:?}, device free {:?} (was {:?})",
                self.device_free, baseline.device_free
            )
        })
    }
}

/// Waits until everything this process exported is freed and its descriptors, /dev/shm (and
/// device memory) are at `baseline` (releases land on lease threads, soon after the death);
/// says what is not.
fn back_at(baseline: Resources, memory: Memory, what: &str) {
    wait_for_lifetime(WAIT, |s| s.exported_storages == 0 && s.outstanding_leases == 0 && s.relayed_storages == 0)
        .unwrap_or_else(|e| panic!("{what}: this process's storages are still claimed: {e}"));
    let deadline = Instant::now() + WAIT;
    // Memory that the caching allocator keeps for the next tensors is not left behind: it
    // gives up what no block uses.
    while let Some(beyond) = (memory.empty_cache(), resources(memory)).1.beyond(&baseline) {
        assert!(Instant::now() < deadline, "{what}: left behind: {beyond}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Where the tensors of a round live: host memory (through the caching allocator or a memory
/// file each), or GPU memory (legacy or VMM, through the caching allocator or an allocation
/// each).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
enum Memory {
    Host { caching: bool },
    Gpu { vmm: bool, caching: bool },
}

impl Memory {
    /// The memory of run `run` at `point`: every other run with the caching allocator on, GPU
    /// runs legacy and VMM in turn; a batch of descriptors needs a descriptor per tensor (a
    /// memory file, a VMM allocation), an import a mapping per tensor.
    fn of_run(gpu: bool, point: Option<&str>, run: usize) -> Memory {
        let caching = run.is_multiple_of(2) && !matches!(point, Some("descriptor-batch" | "import"));
        if gpu {
            Memory::Gpu { vmm: point == Some("descriptor-batch") || run % 4 >= 2, caching }
        } else {
            Memory::Host { caching }
        }
    }

    /// Makes this process allocate new tensors of this memory.
    fn apply(self) {
        match self {
            Memory::Host { caching } => cuda_mp::set_host_caching(caching),
            #[cfg(feature = "cuda")]
            Memory::Gpu { vmm, caching } => {
                let dev = common::gpu();
                dev.set_caching(caching);
                dev.set_memory_kind(if vmm { GpuMemoryKind::Vmm } else { GpuMemoryKind::Legacy });
            }
            #[cfg(not(feature = "cuda"))]
            Memory::Gpu { .. } => panic!("GPU tensors need the cuda feature"),
        }
    }

    /// Back to the defaults (after a round that changed this process's own allocation).
    fn restore(self) {
        cuda_mp::set_host_caching(true);
        #[cfg(feature = "cuda")]
        if let Memory::Gpu { .. } = self {
            let dev = common::gpu();
            dev.set_caching(true);
            dev.set_memory_kind(GpuMemoryKind::Auto);
        }
    }

    /// Gives up what the caching allocators keep for the next tensors (no block uses it).
    fn empty_cache(self) {
        cuda_mp::empty_host_cache();
        #[cfg(feature = "cuda")]
        if let Memory::Gpu { .. } = self {
            common::gpu().empty_cache();
        }
    }

    fn device_free(self) -> Option<usize> {
        match self {
            Memory::Host { .. } => None,
            #[cfg(feature = "cuda")]
            Memory::Gpu { .. } => Some(common::free_memory(&common::gpu())),
            #[cfg(not(feature = "cuda"))]
            Memory::Gpu { .. } => None,
        }
    }
}

/// Tensors of a message, each holding its number in every element.
#[derive(Serialize, Deserialize)]
enum Tensors {
    Host(Vec<HostTensor<i32>>),
    #[cfg(feature = "cuda")]
    Gpu(Vec<GpuTensor<i32>>),
}

/// A message: its number, and tensors that hold it in every element.
type Numbered = (u32, Tensors);

fn numbered(i: u32, tensors: usize, memory: Memory) -> Numbered {
    let shapes = (0..tensors).map(|k| [4 + k]);
    let tensors = match memory {
        Memory::Host { .. } => Tensors::Host(shapes.map(|s| HostTensor::full(&s, i as i32).unwrap()).collect()),
        #[cfg(feature = "cuda")]
        Memory::Gpu { .. } => {
            let dev = common::gpu();
            Tensors::Gpu(shapes.map(|s| GpuTensor::full(&dev, &s, i as i32).unwrap()).collect())
        }
        #[cfg(not(feature = "cuda"))]
        Memory::Gpu { .. } => panic!("GPU tensors need the cuda feature"),
    };
    (i, tensors)
}

/// Whether every element of every tensor of `message` holds its number.
fn whole(message: &Numbered) -> bool {
    let n = message.0 as i32;
    match &message.1 {
        Tensors::Host(ts) => ts.iter().all(|t| t.to_vec().iter().all(|&x| x == n)),
        #[cfg(feature = "cuda")]
        Tensors::Gpu(ts) => ts.iter().all(|t| t.to_vec().is_ok_and(|v| v.iter().all(|&x| x == n))),
    }
}

/// Takes messages from `next` until it has none, each checked: their numbers, and the
/// messages (held until the caller drops them).
fn arrivals(mut next: impl FnMut() -> Option<Numbered>, what: &str) -> (BTreeSet<u32>, Vec<Numbered>) {
    let (mut seen, mut kept) = (BTreeSet::new(), Vec::new());
    while let Some(message) = next() {
        check(&message, &mut seen, what);
        kept.push(message);
    }
    (seen, kept)
}

/// A scenario: a round with a kill point (or none), in a memory, its run number; returns how
/// many messages it checked.
type Round = fn(Option<&str>, Memory, usize) -> usize;

/// The scenarios and their kill points.
const SCENARIOS: [(&[&str], Round); 4] = [
    (&["export", "sent", "descriptor-batch"], sender_round),
    (&["received", "import", "forward"], receiver_round),
    (&["queue-delivered"], queue_round),
    (&["queue-handed"], dispatcher_round),
];

/// Runs each of `scenarios`' rounds `runs()` times at each of its points, one test at a time,
/// after a warm-up; each run ends with this process back at its baseline.
fn every_run_at(gpu: bool, scenarios: &[(&[&str], Round)]) {
    let _one = common::serial(&SERIAL, WAIT);
    warm_up(gpu);
    for (points, round) in scenarios {
        for &point in *points {
            assert!(KILL_POINTS.contains(&point));
            for run in 0..runs() {
                let memory = Memory::of_run(gpu, Some(point), run);
                let baseline = resources(memory);
                round(Some(point), memory, run);
                back_at(baseline, memory, &format!("{point}, {memory:?}, run {run}"));
            }
        }
    }
}

fn check(message: &Numbered, seen: &mut BTreeSet<u32>, what: &str) {
    assert!(seen.insert(message.0), "{what}: message {} arrived twice", message.0);
    assert!(whole(message), "{what}: message {} is not whole", message.0);
}

/// Message 3 carries more descriptors than two packets take (every tensor a memory file of
/// its own), so that its send writes the rest in batches.
const MESSAGES: u32 = 6;
fn tensors_of(i: u32) -> usize {
    if i == 3 { 600 } else { 2 }
}

/// The victim of the sending points: sends numbered messages of tensors in `memory`.
fn produce((tx, memory): (Sender<Numbered>, Memory)) {
    memory.apply();
    for i in 0..MESSAGES {
        tx.send(numbered(i, tensors_of(i), memory)).unwrap();
    }
}

/// A process to be killed at `point` (`None`: a process nobody kills): the first, second or
/// third time it passes it (the first for a point that the runs pass once).
fn victim(point: Option<&str>, run: usize) -> Builder {
    match point {
        None => Builder::new(),
        Some(point) => {
            let nth = if point == "descriptor-batch" { 1 } else { 1 + run % 3 };
            Builder::new().env(KILL_AT_ENV, format!("{point}:{nth}"))
        }
    }
}

/// Runs of each scenario with nobody killed, in every memory: they open what this process
/// opens once (the lease machinery's threads and spare pipes, the home for descriptors in
/// flight, a GPU context and its first allocations).
fn warm_up(gpu: bool) {
    for run in 0..4 {
        let memory = Memory::of_run(gpu, None, run);
        sender_round(None, memory, run);
        receiver_round(None, memory, run);
        queue_round(None, memory, run);
    }
    let memory = Memory::of_run(gpu, None, 0);
    back_at(resources(memory), memory, "the first runs");
}

/// A process sends numbered messages, killed at `point` of its sends: every message that
/// arrives is whole, none twice, in order. Returns how many arrived.
fn sender_round(point: Option<&str>, memory: Memory, run: usize) -> usize {
    let what = format!("{point:?}, {memory:?}, run {run}");
    let (tx, rx) = channel::<Numbered>().unwrap();
    let child = victim(point, run).spawn((tx, memory), produce).unwrap();
    // Legacy GPU memory of a sender that died cannot be mapped: its messages still in flight
    // are errors (the receive says so), and the arrivals end there.
    let (seen, _received) = arrivals(|| rx.recv_timeout(WAIT).ok(), &what);
    assert_eq!(child.join().is_err(), point.is_some(), "{what}: killed or not");
    assert!(seen.iter().copied().eq(0..seen.len() as u32), "{what}: a gap in {seen:?}");
    seen.len()
}

#[test]
fn a_sender_killed_at_each_point_of_a_send_leaves_nothing_behind() {
    every_run_at(false, &SCENARIOS[0..1]);
}

/// The victim of the receiving points: receives numbered messages and sends each back (a
/// forward of storages it holds through this process's claims).
fn echo((rx, back): (Receiver<Numbered>, Sender<Numbered>)) {
    for message in rx.iter() {
        back.send(message).unwrap();
    }
}

/// A process receives numbered messages of this process's tensors and sends them back,
/// killed at `point`: what comes back is whole, none twice. Returns how many came back.
fn receiver_round(point: Option<&str>, memory: Memory, run: usize) -> usize {
    let what = format!("{point:?}, {memory:?}, run {run}");
    memory.apply();
    let (tx, rx) = channel::<Numbered>().unwrap();
    let (back_tx, back) = channel::<Numbered>().unwrap();
    let child = victim(point, run).spawn((rx, back_tx), echo).unwrap();
    for i in 0..MESSAGES {
        // The victim may be dead already: a send to it fails or is never read.
        let _ = tx.send(numbered(i, 2, memory));
    }
    drop(tx);
    let (seen, _returned) = arrivals(|| back.recv_timeout(WAIT).ok(), &what);
    assert_eq!(child.join().is_err(), point.is_some(), "{what}: killed or not");
    if point.is_some() {
        assert!(seen.len() < MESSAGES as usize, "{what}: every message came back from a killed process");
    } else {
        assert_eq!(seen.len(), MESSAGES as usize, "{what}: messages lost");
    }
    memory.restore();
    seen.len()
}

#[test]
fn a_receiver_killed_at_each_point_of_a_receive_or_forward_leaves_nothing_behind() {
    every_run_at(false, &SCENARIOS[1..2]);
}

/// A consumer of the queue: reports each message it gets, by number.
fn consume((queue, report): (QueueConsumer<Numbered>, Sender<u32>)) {
    while let Ok(message) = queue.get() {
        assert!(whole(&message));
        report.send(message.0).unwrap();
    }
}

/// Two consumers drain a queue, the first killed at `point` (its first, second or third
/// message handed to it and not yet acknowledged) before the second starts: every message is
/// delivered once. Returns how many.
fn queue_round(point: Option<&str>, memory: Memory, run: usize) -> usize {
    const PUT: u32 = 40;
    let what = format!("{point:?}, {memory:?}, run {run}");
    memory.apply();
    let queue = Queue::<Numbered>::new().unwrap();
    let (report_tx, reports) = channel::<u32>().unwrap();
    let first = victim(point, run).spawn((queue.consumer(), report_tx.clone()), consume).unwrap();
    for i in 0..PUT {
        queue.put(numbered(i, 1, memory)).unwrap();
    }
    // With every message waiting, the first consumer reaches its kill point for sure; what it
    // had been handed, and had not acknowledged, goes to the second.
    let (killed, first) = match point {
        Some(_) => (Some(first.join().is_err()), None),
        None => (None, Some(first)),
    };
    let second = Builder::new().spawn((queue.consumer(), report_tx), consume).unwrap();
    drop(queue);
    let mut seen = BTreeSet::new();
    while let Ok(i) = reports.recv_timeout(WAIT) {
        assert!(seen.insert(i), "{what}: message {i} was delivered twice");
    }
    second.join().unwrap();
    if let Some(first) = first {
        first.join().unwrap();
    }
    assert!(killed.is_none_or(|killed| killed), "{what}: the consumer was not killed");
    assert_eq!(seen, (0..PUT).collect::<BTreeSet<_>>(), "{what}: messages lost");
    memory.restore();
    seen.len()
}

#[test]
fn a_queue_consumer_killed_before_its_acknowledgement_loses_and_repeats_nothing() {
    every_run_at(false, &SCENARIOS[2..3]);
}

/// The victim of the dispatcher's point: makes a queue, hands its consumer end to the test,
/// puts numbered messages, and waits to be killed (its dispatcher hands the messages out as
/// the test's consumer asks for them).
fn dispatch((consumers, memory): (Sender<QueueConsumer<Numbered>>, Memory)) {
    memory.apply();
    let queue = Queue::<Numbered>::new().unwrap();
    consumers.send(queue.consumer()).unwrap();
    for i in 0..MESSAGES {
        queue.put(numbered(i, 2, memory)).unwrap();
    }
    std::thread::sleep(WAIT);
}

/// A queue's own process, killed in its dispatcher after handing a message out: what the
/// consumer got is whole and not twice, and the consumer sees the queue end. Returns how many.
fn dispatcher_round(point: Option<&str>, memory: Memory, run: usize) -> usize {
    // Without a kill, a queue's own process is the queue round's.
    let Some(point) = point else { return queue_round(None, memory, run) };
    let what = format!("{point}, {memory:?}, run {run}");
    let (tx, rx) = channel::<QueueConsumer<Numbered>>().unwrap();
    let child = victim(Some(point), run).spawn((tx, memory), dispatch).unwrap();
    let consumer = rx.recv_timeout(WAIT).unwrap();
    let (seen, _got) = arrivals(|| consumer.get_timeout(WAIT).ok(), &what);
    assert!(child.join().is_err(), "{what}: the dispatcher was not killed");
    assert!(seen.len() < MESSAGES as usize, "{what}: every message came from a killed dispatcher");
    seen.len()
}

#[test]
fn a_queue_killed_in_its_dispatcher_after_a_hand_out_leaves_nothing_behind() {
    every_run_at(false, &SCENARIOS[3..4]);
}

/// Every kill point above, with GPU tensors: legacy and VMM memory, the caching allocator on
/// and off; the device's free memory comes back too.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_tensors_at_every_kill_point_leave_nothing_behind() {
    common::gpu();
    every_run_at(true, &SCENARIOS);
}

/// Rounds of the four scenarios in a random order, each with a random kill point (or none)
/// and, with `gpu`, host or GPU tensors at random, for `CUDA_MP_SOAK_SECS` seconds (30; 3,600
/// for the hour-long soak); every round ends with this process back at its baseline. Prints
/// one summary line.
fn soak(gpu: bool) {
    let _one = common::serial(&SERIAL, WAIT);
    let secs: u64 = std::env::var("CUDA_MP_SOAK_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(30);
    warm_up(false);
    if gpu {
        warm_up(true);
    }
    let start = resources(Memory::of_run(gpu, None, 0));
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let mut state = seed | 1;
    let mut random = |n: usize| {
        // xorshift64: enough to pick rounds.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    let (mut rounds, mut kills, mut on_gpu, mut messages) = (0usize, 0usize, 0usize, 0usize);
    let began = Instant::now();
    while began.elapsed() < Duration::from_secs(secs) {
        let (points, round) = SCENARIOS[random(SCENARIOS.len())];
        // About two rounds in five without a kill.
        let point = points.get(random(points.len() * 4 / 3 + 1)).copied();
        let run = random(8);
        let memory = Memory::of_run(gpu && random(2) == 1, point, run);
        let baseline = resources(memory);
        messages += round(point, memory, run);
        back_at(baseline, memory, &format!("soak round {rounds} (seed {seed}): {point:?}, {memory:?}, run {run}"));
        rounds += 1;
        kills += usize::from(point.is_some());
        on_gpu += usize::from(matches!(memory, Memory::Gpu { .. }));
    }
    let end = resources(Memory::of_run(gpu, None, 0));
    println!(
        "soak: {} s, {rounds} rounds ({kills} with a kill, {on_gpu} with GPU tensors), {messages} messages checked, \
         descriptors {} -> {}, /dev/shm {} -> {}, device free {:?} -> {:?}, this process's storages all freed \
         (seed {seed})",
        began.elapsed().as_secs(),
        start.descriptors.len(),
        end.descriptors.len(),
        start.shm.len(),
        end.shm.len(),
        start.device_free,
        end.device_free,
    );
}

#[test]
#[ignore = "a soak of CUDA_MP_SOAK_SECS seconds (30): cargo test --release --test kill_points -- --ignored soak_of_random"]
fn soak_of_random_rounds_and_kills() {
    soak(false);
}

/// The soak with GPU tensors in about half of its rounds.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_soak_of_random_rounds_and_kills() {
    common::gpu();
    soak(true);
}
