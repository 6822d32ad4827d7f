//! The pool: map, imap, imap_unordered and apply_async results; panics with message and
//! location; workers killed by a signal, replaced by an initializer-run fresh process or after
//! their job limit; tensors as job arguments and results; shutdown, terminate and timeouts.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use cuda_mp::{HostTensor, JoinError, Pool, Sender, channel};

cuda_mp::enable_test_support!();

const WAIT: Duration = Duration::from_secs(30);

fn square(x: u64) -> u64 {
    x * x
}

fn pid(_: ()) -> u32 {
    std::process::id()
}

fn nap(ms: u64) -> u64 {
    std::thread::sleep(Duration::from_millis(ms));
    ms
}

const EXPLODE_LINE: u32 = line!() + 3;
fn explode(what: String) -> u64 {
    // The panic is on EXPLODE_LINE.
    panic!("job failed: {what}");
}

fn explode_on_three(x: u64) -> u64 {
    if x == 3 {
        explode("three".into());
    }
    x
}

#[test]
fn map_imap_and_imap_unordered_return_every_result() {
    let pool = Pool::new(2).unwrap();
    assert_eq!(pool.size(), 2);
    let expected: Vec<u64> = (0..8).map(|x| x * x).collect();
    assert_eq!(pool.map(square, 0..8).unwrap(), expected);
    assert_eq!(pool.map(square, Vec::new()).unwrap(), Vec::<u64>::new());

    let in_order: Vec<u64> = pool.imap(square, 0..8).map(Result::unwrap).collect();
    assert_eq!(in_order, expected);

    // Finishing order: the long job comes last although it is first.
    let finished: Vec<(usize, u64)> = pool.imap_unordered(nap, [400, 1, 1, 1]).map(Result::unwrap).collect();
    assert_eq!(finished.len(), 4);
    assert_eq!(finished.last(), Some(&(0, 400)), "{finished:?}");
    let indices: BTreeSet<usize> = finished.iter().map(|(i, _)| *i).collect();
    assert_eq!(indices, (0..4).collect());

    let mut results = pool.imap(nap, [300, 1]);
    assert!(matches!(results.next_timeout(Duration::from_millis(10)), Some(Err(JoinError::Timeout))));
    assert_eq!(results.next_timeout(WAIT).unwrap().unwrap(), 300);
    assert_eq!(results.next().unwrap().unwrap(), 1);
    assert!(results.next().is_none());

    let mut unordered = pool.imap_unordered(nap, [300]);
    assert!(matches!(unordered.next_timeout(Duration::from_millis(10)), Some(Err(JoinError::Timeout))));
    assert_eq!(unordered.next_timeout(WAIT).unwrap().unwrap(), (0, 300));
    assert!(unordered.next_timeout(Duration::from_millis(10)).is_none());
    pool.shutdown();
}

#[test]
fn apply_async_get_and_get_timeout() {
    let pool = Pool::new(2).unwrap();
    let mut slow = pool.apply_async(300, nap);
    let quick = pool.apply_async(12, square);
    assert_eq!(quick.get().unwrap(), 144);
    assert!(!slow.is_ready());
    assert!(matches!(slow.get_timeout(Duration::from_millis(10)), Err(JoinError::Timeout)));
    assert_eq!(slow.get_timeout(WAIT).unwrap(), 300);
    assert!(slow.is_ready());
    assert!(matches!(slow.get_timeout(WAIT), Err(JoinError::Failed(_))), "the result was taken");

    // The JoinHandle of a pooled call.
    let mut handle = pool.spawn(300, nap);
    assert!(matches!(handle.join_timeout(Duration::from_millis(10)), Err(JoinError::Timeout)));
    assert_eq!(handle.join().unwrap(), 300);

    let err = pool.map_timeout(nap, [1, 10_000], Duration::from_millis(500)).unwrap_err();
    assert!(matches!(err, JoinError::Timeout), "{err:?}");
    pool.terminate();
}

/// A value whose `Serialize` panics for 13 (in the process that sends it) and whose
/// `Deserialize` panics for 14 (in the process that receives it).
#[derive(Debug)]
struct Touchy(u64);

impl serde::Serialize for Touchy {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        assert!(self.0 != 13, "refuses to encode 13");
        self.0.serialize(s)
    }
}

impl<'de> serde::Deserialize<'de> for Touchy {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = u64::deserialize(d)?;
        assert!(v != 14, "refuses to decode 14");
        Ok(Touchy(v))
    }
}

fn touchy(x: u64) -> Touchy {
    Touchy(x)
}

fn untouchy(x: Touchy) -> u64 {
    x.0
}

/// A call whose arguments panic as they are encoded (on the pool's thread), or whose result
/// panics as it is decoded, fails; the pool goes on, and shuts down.
#[test]
fn a_call_whose_values_panic_as_they_are_encoded_or_decoded_fails_alone() {
    let pool = Pool::new(1).unwrap();
    let err = pool.apply_async(Touchy(13), untouchy).get_timeout(WAIT).unwrap_err();
    assert!(matches!(&err, JoinError::Failed(m) if m.contains("refuses to encode 13")), "{err:?}");
    assert!(pool.apply_async(14, touchy).get_timeout(WAIT).is_err());
    assert_eq!(pool.apply_async(12, touchy).get_timeout(WAIT).unwrap().0, 12);
    assert_eq!(pool.apply_async(Touchy(11), untouchy).get_timeout(WAIT).unwrap(), 11);
    let (done_tx, done) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        pool.shutdown();
        let _ = done_tx.send(());
    });
    done.recv_timeout(WAIT).expect("the pool shut down");
}

#[test]
fn a_ready_result_is_there_to_take_at_once() {
    let pool = Pool::new(2).unwrap();
    for x in 0..200u64 {
        let mut pending = pool.apply_async(x, square);
        let start = std::time::Instant::now();
        while !pending.is_ready() {
            assert!(start.elapsed() < WAIT, "job {x} never became ready");
            std::hint::spin_loop();
        }
        assert_eq!(pending.get_timeout(Duration::ZERO).unwrap(), x * x, "ready, yet not there");
    }
    pool.shutdown();
}

#[test]
fn a_panicking_job_reports_its_message_and_location() {
    let pool = Pool::new(2).unwrap();
    let err = pool.apply_async("bad input".to_string(), explode).get().unwrap_err();
    let panic = err.panic().unwrap_or_else(|| panic!("a panic report: {err:?}"));
    assert_eq!(panic.message, "job failed: bad input");
    assert_eq!(panic.location.as_deref(), Some(format!("tests/pool.rs:{EXPLODE_LINE}:5").as_str()));
    assert!(err.to_string().starts_with("child process panicked: job failed: bad input at tests/pool.rs:"), "{err}");

    // In a map: the failed item's index, and the panic.
    match pool.map(explode_on_three, 0..6).unwrap_err() {
        JoinError::Job { index: 3, error } => {
            assert_eq!(error.panic().unwrap().message, "job failed: three");
        }
        other => panic!("{other:?}"),
    }
    // In imap_unordered: the same, as that item's result.
    let failures: Vec<JoinError> = pool.imap_unordered(explode_on_three, 2..5).filter_map(Result::err).collect();
    assert!(matches!(failures.as_slice(), [JoinError::Job { index: 1, .. }]), "{failures:?}");

    // Through a JoinHandle, and the pool keeps working with fresh workers.
    let err = pool.spawn("again".to_string(), explode).join().unwrap_err();
    assert_eq!(err.panic().unwrap().message, "job failed: again");
    assert_eq!(pool.map(square, 0..4).unwrap(), vec![0, 1, 4, 9]);
    pool.shutdown();
}

/// Linux 6.15 and later keep a reaped process's exit status for its pidfd, where the pool reads
/// how a worker died.
fn kernel_keeps_exit_status() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut numbers = release.split(|c: char| !c.is_ascii_digit()).map(|n| n.parse::<u32>().unwrap_or(0));
    (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0)) >= (6, 15)
}

fn leave(code: i32) -> u8 {
    std::process::exit(code)
}

fn report_pid_then_sleep(tx: Sender<u32>) -> u64 {
    tx.send(std::process::id()).unwrap();
    std::thread::sleep(Duration::from_secs(30));
    0
}

#[test]
fn a_sigkilled_worker_is_replaced_its_job_fails_and_the_queued_jobs_run() {
    let pool = Pool::new(1).unwrap();
    let (tx, rx) = channel().unwrap();
    let doomed = pool.apply_async(tx, report_pid_then_sleep);
    // Queued behind the job whose worker dies.
    let queued: Vec<_> = (0..4).map(|x| pool.apply_async(x, square)).collect();
    let victim = rx.recv_timeout(WAIT).unwrap();
    let t = Instant::now();
    // SAFETY: sends a signal to a worker of ours, which is alive (it just answered).
    assert_eq!(unsafe { libc::kill(victim as libc::pid_t, libc::SIGKILL) }, 0);

    let err = doomed.get().unwrap_err();
    if kernel_keeps_exit_status() {
        assert!(matches!(err, JoinError::Signaled { signal: 9, name: "SIGKILL" }), "{err:?}");
        assert_eq!(err.to_string(), "child process was killed by signal 9 (SIGKILL)");
    } else {
        // The worker's status went with procspawn's reaping of it.
        assert!(matches!(err, JoinError::Signaled { signal: 9, .. } | JoinError::Terminated(_)), "{err:?}");
    }
    let results: Vec<u64> = queued.into_iter().map(|r| r.get().unwrap()).collect();
    assert_eq!(results, vec![0, 1, 4, 9]);
    assert!(t.elapsed() < Duration::from_secs(20), "the queued jobs did not wait for the dead job");
    let now = pool.map(pid, vec![(); 2]).unwrap();
    assert!(now.iter().all(|&p| p != victim), "a fresh worker runs the jobs");
    assert_eq!(pool.size(), 1);

    // A job that ends its worker's process.
    let err = pool.apply_async(3, leave).get().unwrap_err();
    assert!(
        matches!(err, JoinError::Exited { code: 3 })
            || (!kernel_keeps_exit_status() && matches!(err, JoinError::Terminated(_))),
        "{err:?}"
    );

    // Killing a pooled call through its handle: queued, it is cancelled; running, its worker
    // is killed.
    let mut running = pool.spawn(10_000, nap);
    let mut queued = pool.spawn(1, nap);
    queued.kill().unwrap();
    assert!(matches!(queued.join(), Err(JoinError::Cancelled)));
    while running.pid().is_none() {
        std::thread::sleep(Duration::from_millis(10));
    }
    running.kill().unwrap();
    let err = running.join().unwrap_err();
    assert!(
        matches!(err, JoinError::Signaled { name: "SIGKILL", .. })
            || (!kernel_keeps_exit_status() && matches!(err, JoinError::Terminated(_))),
        "{err:?}"
    );
    assert_eq!(pool.map(square, [5]).unwrap(), vec![25]);
    pool.shutdown();
}

/// Catches a panic of its own (as a library may), then ends its process with `code`.
fn catch_then_leave(code: i32) -> u8 {
    let _ = std::panic::catch_unwind(|| panic!("caught and handled"));
    std::process::exit(code)
}

/// Catches a panic, forks a child that lives `secs` seconds (holding every descriptor of the
/// worker, its connection to the pool included), then is killed.
fn fork_then_die(secs: u32) -> u8 {
    let _ = std::panic::catch_unwind(|| panic!("caught and handled"));
    // SAFETY: the child only sleeps and `_exit`s, which a forked child of a threaded process may.
    if unsafe { libc::fork() } == 0 {
        unsafe {
            libc::sleep(secs);
            libc::_exit(0);
        }
    }
    // SAFETY: ends this process, as the OOM killer would.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    0
}

#[test]
fn a_workers_end_is_reported_as_it_ended_not_as_a_panic_its_job_caught() {
    let pool = Pool::new(1).unwrap();
    let err = pool.apply_async(7, catch_then_leave).get_timeout(WAIT).unwrap_err();
    assert!(
        matches!(err, JoinError::Exited { code: 7 })
            || (!kernel_keeps_exit_status() && matches!(err, JoinError::Panicked(_) | JoinError::Terminated(_))),
        "{err:?}"
    );
    // Killed while a child it forked holds its connection: the job fails at once all the same.
    let t = Instant::now();
    let err = pool.apply_async(10, fork_then_die).get_timeout(Duration::from_secs(15)).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(5), "the job failed only after {:?}", t.elapsed());
    assert!(
        matches!(err, JoinError::Signaled { signal: 9, .. })
            || (!kernel_keeps_exit_status() && matches!(err, JoinError::Panicked(_) | JoinError::Terminated(_))),
        "{err:?}"
    );
    assert_eq!(pool.map(square, [6]).unwrap(), vec![36]);
    pool.terminate();
}

/// A result whose decoding takes a while (on procspawn's thread, in the calling process).
#[derive(Debug, PartialEq, serde::Serialize)]
struct SlowToDecode(u32);

impl<'de> serde::Deserialize<'de> for SlowToDecode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = <u32 as serde::Deserialize>::deserialize(d)?;
        std::thread::sleep(Duration::from_millis(600));
        Ok(SlowToDecode(n))
    }
}

/// Returns its result, and is killed 200 ms later.
fn answer_then_die(n: u32) -> SlowToDecode {
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_millis(200));
        // SAFETY: ends this process, as the OOM killer would.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    });
    SlowToDecode(n)
}

#[test]
fn a_result_sent_before_the_worker_died_is_returned() {
    let pool = Pool::new(1).unwrap();
    let got = pool.apply_async(5, answer_then_die).get_timeout(WAIT).map_err(|e| format!("{e:?}"));
    assert_eq!(got, Ok(SlowToDecode(5)));
    pool.terminate();
}

/// How many times the initializer ran in this process.
static INITIALIZED: AtomicU32 = AtomicU32::new(0);

fn initialize(path: String) {
    INITIALIZED.fetch_add(1, Ordering::SeqCst);
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new().create(true).append(true).open(path).unwrap();
    // One write, so that the lines of workers starting together do not interleave.
    file.write_all(format!("{}\n", std::process::id()).as_bytes()).unwrap();
}

fn pid_and_initialized(_: ()) -> (u32, u32) {
    (std::process::id(), INITIALIZED.load(Ordering::SeqCst))
}

fn fail_to_initialize(_: ()) {
    panic!("no model here");
}

fn hang(_: ()) {
    std::thread::sleep(Duration::from_secs(60));
}

fn initialized_pids(path: &std::path::Path) -> Vec<u32> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| l.parse().unwrap()).collect()
}

#[test]
fn the_initializer_runs_once_in_each_worker_before_its_jobs() {
    let path = std::env::temp_dir().join(format!("cuda-mp-pool-init-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let arg = path.to_string_lossy().into_owned();
    let pool = Pool::builder().size(2).initializer(arg.clone(), initialize).build().unwrap();
    let seen = pool.map(pid_and_initialized, vec![(); 8]).unwrap();
    assert!(seen.iter().all(|&(_, count)| count == 1), "{seen:?}");
    pool.shutdown();
    let pids = initialized_pids(&path);
    assert_eq!(pids.len(), 2, "once per worker: {pids:?}");
    assert_eq!(pids.iter().collect::<BTreeSet<_>>().len(), 2);
    assert!(seen.iter().all(|(pid, _)| pids.contains(pid)));

    // A replacement worker runs it too.
    let _ = std::fs::remove_file(&path);
    let pool = Pool::builder().size(1).initializer(arg, initialize).max_tasks_per_child(1).build().unwrap();
    let seen = pool.map(pid_and_initialized, vec![(); 3]).unwrap();
    pool.shutdown();
    assert!(seen.iter().all(|&(_, count)| count == 1), "{seen:?}");
    let pids = initialized_pids(&path);
    assert!(seen.iter().all(|(pid, _)| pids.contains(pid)), "{seen:?} {pids:?}");
    let _ = std::fs::remove_file(&path);

    // A failing initializer fails the build, with its panic.
    let err = Pool::builder().size(1).initializer((), fail_to_initialize).build().unwrap_err();
    match &err {
        JoinError::Initializer(error) => assert_eq!(error.panic().unwrap().message, "no model here"),
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().starts_with("the pool worker's initializer failed: child process panicked"), "{err}");
    // One that hangs, after the build's timeout.
    let t = Instant::now();
    let err = Pool::builder().size(1).initializer((), hang).build_timeout(Duration::from_millis(500)).unwrap_err();
    assert!(matches!(err, JoinError::Timeout), "{err:?}");
    assert!(t.elapsed() < Duration::from_secs(10));
}

#[test]
fn max_tasks_per_child_replaces_workers_after_their_limit() {
    let pool = Pool::builder().size(1).max_tasks_per_child(2).build().unwrap();
    let pids = pool.map(pid, vec![(); 6]).unwrap();
    pool.shutdown();
    assert_eq!(pids[0], pids[1]);
    assert_eq!(pids[2], pids[3]);
    assert_eq!(pids[4], pids[5]);
    assert_eq!(pids.iter().collect::<BTreeSet<_>>().len(), 3, "{pids:?}");
}

/// Doubles a block in place and returns its sum and a new tensor made in the worker.
fn double_block(block: HostTensor<f32>) -> (f32, HostTensor<f32>) {
    block.map_inplace(|x| x * 2.0);
    let sum = block.to_vec().iter().sum();
    (sum, HostTensor::full(&[2], sum).unwrap())
}

/// Makes `n` host tensors in the worker, each its own memory file (the caching allocator off
/// there), so that the result carries `n` descriptors.
fn fresh_files(n: usize) -> Vec<HostTensor<i32>> {
    cuda_mp::set_host_caching(false);
    (0..n).map(|i| HostTensor::full(&[16], i as i32).unwrap()).collect()
}

#[test]
fn a_result_with_more_descriptors_than_one_socket_message_takes_arrives_whole() {
    let pool = Pool::new(1).unwrap();
    let mapped_files = || std::fs::read_to_string("/proc/self/maps").unwrap().matches("memfd:").count();
    let before = mapped_files();
    // 300 memory files: more than the 253 descriptors one socket message carries.
    let tensors = pool.apply_async(300, fresh_files).get_timeout(WAIT).unwrap();
    assert_eq!(tensors.len(), 300);
    assert!(mapped_files() >= before + 300, "each tensor maps a memory file of its own");
    for (i, t) in tensors.iter().enumerate() {
        assert_eq!(t.to_vec(), vec![i as i32; 16]);
    }
    pool.shutdown();
}

#[test]
fn host_tensors_travel_as_job_arguments_and_results() {
    let pool = Pool::new(2).unwrap();
    let t = HostTensor::<f32>::from_vec(&[4, 2], (0..8).map(|x| x as f32).collect()).unwrap();
    let blocks: Vec<HostTensor<f32>> = (0..4).map(|row| t.narrow(0, row, 1).unwrap()).collect();
    let results = pool.map(double_block, blocks.clone()).unwrap();
    // The workers wrote this process's memory: same storage, not copies.
    assert_eq!(t.to_vec(), (0..8).map(|x| 2.0 * x as f32).collect::<Vec<_>>());
    for (row, (sum, made)) in results.iter().enumerate() {
        let expected = 2.0 * (4 * row + 1) as f32;
        assert_eq!(*sum, expected);
        assert_eq!(made.to_vec(), vec![expected; 2]);
    }
    let (sum, _) = pool.apply_async(t.clone(), double_block).get().unwrap();
    assert_eq!(sum, 112.0);
    pool.shutdown();
}

#[test]
fn shutdown_waits_terminate_fails_pending_jobs_and_bad_settings_are_refused() {
    fn shared_between_threads<T: Send + Sync>() {}
    shared_between_threads::<Pool>();

    let pool = Pool::new(1).unwrap();
    let pending = pool.apply_async(200, nap);
    pool.shutdown();
    assert_eq!(pending.get().unwrap(), 200, "shutdown waited for the job");

    let pool = Pool::new(1).unwrap();
    let running = pool.apply_async(10_000, nap);
    let queued = pool.apply_async(1, nap);
    let t = Instant::now();
    assert!(matches!(pool.shutdown_timeout(Duration::from_millis(300)), Err(JoinError::Timeout)));
    assert!(matches!(running.get(), Err(JoinError::PoolClosed)));
    assert!(matches!(queued.get(), Err(JoinError::PoolClosed)));
    assert!(t.elapsed() < Duration::from_secs(5));

    let pool = Pool::new(1).unwrap();
    let running = pool.spawn(10_000, nap);
    drop(pool);
    let joined = running.join();
    assert!(matches!(joined, Err(JoinError::PoolClosed)), "{joined:?}");

    assert!(matches!(Pool::new(0), Err(JoinError::InvalidPool(_))));
    assert!(matches!(Pool::builder().size(1).max_tasks_per_child(0).build(), Err(JoinError::InvalidPool(_))));
    assert!(
        matches!(Pool::builder().size(usize::MAX / 4).build(), Err(JoinError::InvalidPool(_))),
        "no panic, no huge allocation"
    );
}

fn set_then_answer(event: cuda_mp::Event) -> u32 {
    event.set();
    1
}

/// Killing a pooled call as its result comes back kills its worker (or nothing): the next
/// caller's job runs on a worker that lives (it was handed to the dying one, and failed with
/// its SIGKILL, 3 rounds in 4).
#[test]
fn killing_a_call_as_it_finishes_does_not_fail_the_next_callers_job() {
    let pool = Pool::new(1).unwrap();
    for round in 0..40 {
        let event = cuda_mp::Event::new().unwrap();
        let mut a = pool.spawn(event.clone(), set_then_answer);
        let b = pool.apply_async(7u64, square);
        assert!(event.wait_timeout(WAIT));
        a.kill().unwrap();
        let _ = a.join();
        let got = b.get();
        assert!(matches!(got, Ok(49)), "round {round}: the next caller's job failed: {got:?}");
    }
    pool.terminate();
}

/// `Duration::MAX` as a limit is no limit: no call panics on it (adding it to the clock
/// overflowed).
#[test]
fn a_limit_past_what_the_clock_holds_is_no_limit() {
    let pool = Pool::new(1).unwrap();
    assert_eq!(pool.apply_async(3u64, square).get_timeout(Duration::MAX).unwrap(), 9);
    assert_eq!(pool.map_timeout(square, [1u64, 2], Duration::MAX).unwrap(), vec![1, 4]);
    assert_eq!(pool.imap(square, [2u64]).next_timeout(Duration::MAX).unwrap().unwrap(), 4);
    assert_eq!(cuda_mp::spawn(4u64, square).join_timeout(Duration::MAX).unwrap(), 16);
    Pool::builder().size(1).build_timeout(Duration::MAX).unwrap().terminate();
    pool.shutdown_timeout(Duration::MAX).unwrap();
    cuda_mp::wait_for_lifetime(Duration::MAX, |_| true).unwrap();
    let bytes = cuda_mp::to_bytes(&HostTensor::<f32>::zeros(&[4]).unwrap(), Duration::MAX).unwrap();
    assert_eq!(cuda_mp::from_bytes::<HostTensor<f32>>(&bytes).unwrap().to_vec(), vec![0.0; 4]);
}

fn hang_if_marked(path: String) {
    if std::path::Path::new(&path).exists() {
        std::thread::sleep(Duration::from_secs(60));
    }
}

/// A shutdown does not wait for a replacement worker whose initializer hangs once every job
/// is done (it would never get a job): `shutdown_timeout` returned neither in time nor at all.
#[test]
fn a_shutdown_does_not_wait_for_a_replacement_that_would_never_run_a_job() {
    let path = std::env::temp_dir().join(format!("cuda-mp-hang-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let pool =
        Pool::builder().size(2).initializer(path.to_string_lossy().into_owned(), hang_if_marked).build().unwrap();
    std::fs::write(&path, b"").unwrap();
    // One worker leaves: its replacement's initializer hangs from now on.
    assert!(pool.apply_async(3, leave).get().is_err());
    assert_eq!(pool.map(square, 0..4).unwrap(), vec![0, 1, 4, 9]);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(pool.shutdown_timeout(Duration::from_secs(5)).map_err(|e| e.to_string()));
    });
    let done = rx.recv_timeout(Duration::from_secs(20));
    let _ = std::fs::remove_file(&path);
    assert_eq!(done, Ok(Ok(())), "the shutdown of a pool with nothing left to run");
}

/// Fails while the file named exists.
fn fail_while_marked(marker: String) {
    assert!(!std::path::Path::new(&marker).exists(), "marked: initializer fails");
}

fn end_worker(_: ()) {
    std::process::exit(3);
}

fn twice(x: u64) -> u64 {
    2 * x
}

/// A replacement that could not start for no job in particular fails no later job: the job
/// that comes starts a worker of its own.
#[test]
fn a_replacement_that_failed_to_start_fails_no_later_job() {
    let marker = std::env::temp_dir().join(format!("cuda-mp-pool-marker-{}", std::process::id()));
    let _ = std::fs::remove_file(&marker);
    let path = marker.to_string_lossy().into_owned();
    let pool = Pool::builder().size(1).initializer(path, fail_while_marked).build().unwrap();
    std::fs::write(&marker, b"").unwrap();
    // The worker ends; its replacement's initializer fails (the file is there).
    assert!(pool.apply_async((), end_worker).get_timeout(Duration::from_secs(20)).is_err());
    std::thread::sleep(Duration::from_millis(500));
    std::fs::remove_file(&marker).unwrap();
    // Fixed: the next job starts a worker that initializes.
    let got = pool.apply_async(4u64, twice).get_timeout(Duration::from_secs(20));
    assert_eq!(got.ok(), Some(8), "the job after the fix ran");
    pool.shutdown();
}
