//! Kill points (`cuda_mp::testing::KILL_POINTS`): a process is killed with SIGKILL at each
//! named point of a send, a receive, an import, a forward and a queue delivery, run after run;
//! each run then checks that this process's descriptors and /dev/shm are back where they were,
//! that everything it exported is freed (its lifetime counters at zero), that every message
//! that arrived is whole, and that none arrived twice. `CUDA_MP_KILL_RUNS` sets the runs per
//! point: 25 by default, so that `cargo test` stays short; the full count is
//! `CUDA_MP_KILL_RUNS=100 cargo test --test kill_points`.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cuda_mp::testing::{KILL_AT_ENV, KILL_POINTS};
use cuda_mp::{Builder, HostTensor, Queue, QueueConsumer, Receiver, Sender, channel, wait_for_lifetime};

cuda_mp::enable_test_support!();

mod common;

static SERIAL: Mutex<()> = Mutex::new(());
const WAIT: Duration = Duration::from_secs(20);

fn runs() -> usize {
    std::env::var("CUDA_MP_KILL_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(25)
}

/// This process's open descriptors and the files in /dev/shm, and what the descriptors are.
#[derive(Debug)]
struct Resources {
    descriptors: Vec<String>,
    shm: usize,
}

fn resources() -> Resources {
    let fds = std::fs::read_dir("/proc/self/fd").unwrap();
    let descriptors = fds.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok()).map(|p| p.display().to_string());
    Resources { descriptors: descriptors.collect(), shm: std::fs::read_dir("/dev/shm").map_or(0, |d| d.count()) }
}

impl Resources {
    /// What `self` holds beyond `baseline`.
    fn beyond(&self, baseline: &Resources) -> Option<String> {
        let mut extra = self.descriptors.clone();
        for d in &baseline.descriptors {
            if let Some(i) = extra.iter().position(|e| e == d) {
                extra.remove(i);
            }
        }
        // The listing itself is one descriptor; a pipe with both ends here is a spare lease,
        // which the lease machinery keeps a varying number of.
        let both_ends = |d: &String| d.starts_with("pipe:") && self.descriptors.iter().filter(|e| *e == d).count() == 2;
        extra.retain(|d| !d.starts_with("/proc/") && !both_ends(d));
        (!extra.is_empty() || self.shm > baseline.shm)
            .then(|| format!("descriptors {extra:?}, /dev/shm {} (was {})", self.shm, baseline.shm))
    }
}

/// Waits until everything this process exported is freed and its descriptors and /dev/shm are
/// at `baseline` (releases land on lease threads, soon after the death); says what is not.
fn back_at(baseline: Resources, what: &str) {
    wait_for_lifetime(WAIT, |s| s.exported_storages == 0 && s.outstanding_leases == 0 && s.relayed_storages == 0)
        .unwrap_or_else(|e| panic!("{what}: this process's storages are still claimed: {e}"));
    let deadline = Instant::now() + WAIT;
    // Memory that the caching allocator keeps for the next tensors is not left behind: it
    // gives up what no block uses.
    while let Some(beyond) = (cuda_mp::empty_host_cache(), resources()).1.beyond(&baseline) {
        assert!(Instant::now() < deadline, "{what}: left behind: {beyond}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A message: its number, and tensors that hold it in every element.
type Numbered = (u32, Vec<HostTensor<i32>>);

fn numbered(i: u32, tensors: usize) -> Numbered {
    (i, (0..tensors).map(|k| HostTensor::full(&[4 + k], i as i32).unwrap()).collect())
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

/// Runs `round` (with its kill point and run number) `runs()` times at each of `points`, one
/// test at a time, after a warm-up; each run ends with this process back at its baseline.
fn every_run_at(points: &[&str], round: impl Fn(&str, usize)) {
    let _one = common::serial(&SERIAL, WAIT);
    warm_up();
    for &point in points {
        assert!(KILL_POINTS.contains(&point));
        for run in 0..runs() {
            let baseline = resources();
            round(point, run);
            back_at(baseline, &format!("{point}, run {run}"));
        }
    }
}

fn check(message: &Numbered, seen: &mut BTreeSet<u32>, what: &str) {
    assert!(seen.insert(message.0), "{what}: message {} arrived twice", message.0);
    for t in &message.1 {
        assert!(t.to_vec().iter().all(|&x| x == message.0 as i32), "{what}: message {} is not whole", message.0);
    }
}

/// Message 3 carries more descriptors than two packets take (every tensor a memory file of
/// its own), so that its send writes the rest in batches.
const MESSAGES: u32 = 6;
fn tensors_of(i: u32) -> usize {
    if i == 3 { 600 } else { 2 }
}

/// The victim of the sending points: sends numbered messages of host tensors.
fn produce((tx, caching): (Sender<Numbered>, bool)) {
    cuda_mp::set_host_caching(caching);
    for i in 0..MESSAGES {
        tx.send(numbered(i, tensors_of(i))).unwrap();
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

/// Runs of each scenario with nobody killed: they open what this process opens once (the
/// lease machinery's threads and spare pipes, the home for descriptors in flight).
fn warm_up() {
    for run in 0..2 {
        sender_round(None, run);
        receiver_round(None, run);
        queue_round(None, run);
    }
    back_at(resources(), "the first runs");
}

/// A process sends numbered messages, killed at `point` of its sends: every message that
/// arrives is whole, none twice, in order. Returns how many arrived.
fn sender_round(point: Option<&str>, run: usize) -> usize {
    let what = format!("{point:?}, run {run}");
    let (tx, rx) = channel::<Numbered>().unwrap();
    // Every other run with the caching allocator on; a batch of descriptors needs a memory
    // file per tensor.
    let caching = run.is_multiple_of(2) && point != Some("descriptor-batch");
    let child = victim(point, run).spawn((tx, caching), produce).unwrap();
    let (seen, _received) = arrivals(|| rx.recv_timeout(WAIT).ok(), &what);
    assert_eq!(child.join().is_err(), point.is_some(), "{what}: killed or not");
    assert!(seen.iter().copied().eq(0..seen.len() as u32), "{what}: a gap in {seen:?}");
    seen.len()
}

#[test]
fn a_sender_killed_at_each_point_of_a_send_leaves_nothing_behind() {
    every_run_at(&["export", "sent", "descriptor-batch"], |point, run| {
        sender_round(Some(point), run);
    });
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
fn receiver_round(point: Option<&str>, run: usize) -> usize {
    let what = format!("{point:?}, run {run}");
    // Every other run with the caching allocator on (a segment is mapped once: the import
    // point needs a memory file per tensor).
    cuda_mp::set_host_caching(run.is_multiple_of(2) && point != Some("import"));
    let (tx, rx) = channel::<Numbered>().unwrap();
    let (back_tx, back) = channel::<Numbered>().unwrap();
    let child = victim(point, run).spawn((rx, back_tx), echo).unwrap();
    for i in 0..MESSAGES {
        // The victim may be dead already: a send to it fails or is never read.
        let _ = tx.send(numbered(i, 2));
    }
    drop(tx);
    let (seen, _returned) = arrivals(|| back.recv_timeout(WAIT).ok(), &what);
    assert_eq!(child.join().is_err(), point.is_some(), "{what}: killed or not");
    if point.is_some() {
        assert!(seen.len() < MESSAGES as usize, "{what}: every message came back from a killed process");
    } else {
        assert_eq!(seen.len(), MESSAGES as usize, "{what}: messages lost");
    }
    cuda_mp::set_host_caching(true);
    seen.len()
}

#[test]
fn a_receiver_killed_at_each_point_of_a_receive_or_forward_leaves_nothing_behind() {
    every_run_at(&["received", "import", "forward"], |point, run| {
        receiver_round(Some(point), run);
    });
}

/// A consumer of the queue: reports each message it gets, by number.
fn consume((queue, report): (QueueConsumer<Numbered>, Sender<u32>)) {
    while let Ok(message) = queue.get() {
        assert!(message.1.iter().all(|t| t.to_vec().iter().all(|&x| x == message.0 as i32)));
        report.send(message.0).unwrap();
    }
}

/// Two consumers drain a queue, the first killed at `point` (its first, second or third
/// message handed to it and not yet acknowledged) before the second starts: every message is
/// delivered once. Returns how many.
fn queue_round(point: Option<&str>, run: usize) -> usize {
    const PUT: u32 = 40;
    let what = format!("{point:?}, run {run}");
    cuda_mp::set_host_caching(run.is_multiple_of(2));
    let queue = Queue::<Numbered>::new().unwrap();
    let (report_tx, reports) = channel::<u32>().unwrap();
    let first = victim(point, run).spawn((queue.consumer(), report_tx.clone()), consume).unwrap();
    for i in 0..PUT {
        queue.put(numbered(i, 1)).unwrap();
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
    cuda_mp::set_host_caching(true);
    seen.len()
}

#[test]
fn a_queue_consumer_killed_before_its_acknowledgement_loses_and_repeats_nothing() {
    every_run_at(&["queue-delivered"], |point, run| {
        queue_round(Some(point), run);
    });
}

/// The victim of the dispatcher's point: makes a queue, hands its consumer end to the test,
/// puts numbered messages, and waits to be killed (its dispatcher hands the messages out as
/// the test's consumer asks for them).
fn dispatch((consumers, caching): (Sender<QueueConsumer<Numbered>>, bool)) {
    cuda_mp::set_host_caching(caching);
    let queue = Queue::<Numbered>::new().unwrap();
    consumers.send(queue.consumer()).unwrap();
    for i in 0..MESSAGES {
        queue.put(numbered(i, 2)).unwrap();
    }
    std::thread::sleep(WAIT);
}

/// A queue's own process, killed in its dispatcher after handing a message out: what the
/// consumer got is whole and not twice, and the consumer sees the queue end. Returns how many.
fn dispatcher_round(point: &str, run: usize) -> usize {
    let what = format!("{point}, run {run}");
    let (tx, rx) = channel::<QueueConsumer<Numbered>>().unwrap();
    let child = victim(Some(point), run).spawn((tx, run.is_multiple_of(2)), dispatch).unwrap();
    let consumer = rx.recv_timeout(WAIT).unwrap();
    let (seen, _got) = arrivals(|| consumer.get_timeout(WAIT).ok(), &what);
    assert!(child.join().is_err(), "{what}: the dispatcher was not killed");
    assert!(seen.len() < MESSAGES as usize, "{what}: every message came from a killed dispatcher");
    seen.len()
}

#[test]
fn a_queue_killed_in_its_dispatcher_after_a_hand_out_leaves_nothing_behind() {
    every_run_at(&["queue-handed"], |point, run| {
        dispatcher_round(point, run);
    });
}

/// Rounds of the four scenarios in a random order, each with a random kill point (or none),
/// for `CUDA_MP_SOAK_SECS` seconds (120; 3,600 for the hour-long soak); every round ends with
/// this process back at its baseline. Prints one summary line.
#[test]
#[ignore = "a soak of CUDA_MP_SOAK_SECS seconds (120): cargo test --release --test kill_points -- --ignored"]
fn soak_of_random_rounds_and_kills() {
    let _one = common::serial(&SERIAL, WAIT);
    let secs: u64 = std::env::var("CUDA_MP_SOAK_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(120);
    warm_up();
    let start = resources();
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let mut state = seed | 1;
    let mut random = |n: usize| {
        // xorshift64: enough to pick rounds.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    let (mut rounds, mut kills, mut messages) = (0usize, 0usize, 0usize);
    let began = Instant::now();
    while began.elapsed() < Duration::from_secs(secs) {
        let scenario = random(4);
        let points: &[&str] = match scenario {
            0 => &["export", "sent", "descriptor-batch"],
            1 => &["received", "import", "forward"],
            2 => &["queue-delivered"],
            _ => &["queue-handed"],
        };
        // About two rounds in five without a kill.
        let pick = random(points.len() * 4 / 3 + 1);
        let point = points.get(pick).copied();
        let run = random(6);
        let baseline = resources();
        messages += match (scenario, point) {
            (0, _) => sender_round(point, run),
            (1, _) => receiver_round(point, run),
            (2, _) => queue_round(point, run),
            // Without a kill, a queue's own process is the queue round's.
            (_, Some(point)) => dispatcher_round(point, run),
            (_, None) => queue_round(None, run),
        };
        back_at(baseline, &format!("soak round {rounds} (seed {seed}): {point:?}, run {run}"));
        rounds += 1;
        kills += usize::from(point.is_some());
    }
    let end = resources();
    println!(
        "soak: {} s, {rounds} rounds ({kills} with a kill), {messages} messages checked, descriptors {} -> {}, \
         /dev/shm {} -> {}, this process's storages all freed (seed {seed})",
        began.elapsed().as_secs(),
        start.descriptors.len(),
        end.descriptors.len(),
        start.shm,
        end.shm
    );
}
