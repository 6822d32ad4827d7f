//! Spawning: results, panics reported with message and location, timeouts, kill, pools.

use std::time::Duration;

use cuda_mp::{JoinError, Pool, spawn};

cuda_mp::enable_test_support!();

fn square(x: u64) -> u64 {
    x * x
}

fn explode(msg: String) -> u32 {
    panic!("worker failed: {msg}");
}

fn sleep_long(_: ()) {
    std::thread::sleep(Duration::from_secs(30));
}

#[test]
fn a_child_returns_its_result() {
    assert_eq!(spawn(12, square).join().unwrap(), 144);
}

#[test]
fn a_child_panic_comes_back_with_message_and_location() {
    let err = spawn("bad input".to_string(), explode).join().unwrap_err();
    let panic = err.panic().expect("a panic report");
    assert_eq!(panic.message, "worker failed: bad input");
    let location = panic.location.as_deref().expect("a location");
    assert!(location.contains("processes.rs"), "{location}");
    assert!(err.to_string().starts_with("child process panicked: worker failed: bad input at "), "{err}");
}

/// Writes a file named as the CUDA driver names a process's file of interprocess events (which
/// a process killed by a signal leaves in /dev/shm), then waits to be killed.
#[cfg(feature = "cuda")]
fn leave_a_driver_file_and_sleep(tag: u32) {
    let name = format!("/dev/shm/cuda.shm.0.{:x}.{tag}", std::process::id());
    std::fs::write(name, b"").unwrap();
    std::thread::sleep(Duration::from_secs(30));
}

#[cfg(feature = "cuda")]
fn driver_file_of(pid: u32, tag: u32) -> std::path::PathBuf {
    format!("/dev/shm/cuda.shm.0.{pid:x}.{tag}").into()
}

/// What a killed child leaves in /dev/shm goes whether its handle is joined, killed, dropped or
/// terminated, and in `spawn_n` for the ranks it terminates after one failed: only a join
/// removed it before.
#[test]
#[cfg(feature = "cuda")]
fn a_killed_childs_driver_file_goes_however_its_handle_ends() {
    let wait_for = |path: &std::path::Path| {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !path.exists() {
            assert!(std::time::Instant::now() < deadline, "the child made no file");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    for (tag, end) in [(1u32, "kill"), (2, "drop"), (3, "terminate")] {
        let mut child = spawn(tag, leave_a_driver_file_and_sleep);
        let file = driver_file_of(child.pid().unwrap(), tag);
        wait_for(&file);
        match end {
            "kill" => child.kill().unwrap(),
            "drop" => drop(child),
            _ => child.terminate(Duration::from_secs(5)).unwrap(),
        }
        assert!(!file.exists(), "{end}: {} is left", file.display());
    }
}

#[cfg(feature = "cuda")]
fn fail_first_rank_or_leave_a_file((rank, tag): (usize, u32)) {
    if rank == 0 {
        std::thread::sleep(Duration::from_millis(500));
        panic!("rank 0 fails");
    }
    let name = format!("/dev/shm/cuda.shm.0.{:x}.{tag}", std::process::id());
    std::fs::write(&name, b"").unwrap();
    std::fs::write(format!("/dev/shm/cuda-mp-test-rank-{tag}-{rank}"), std::process::id().to_string()).unwrap();
    std::thread::sleep(Duration::from_secs(30));
}

#[test]
#[cfg(feature = "cuda")]
fn spawn_n_removes_the_driver_files_of_the_ranks_it_ends() {
    let tag = std::process::id() & 0xffff;
    let err = cuda_mp::spawn_n(3, tag, fail_first_rank_or_leave_a_file).unwrap_err();
    assert!(err.to_string().contains("rank 0"), "{err}");
    for rank in 1..3 {
        let pid_file = format!("/dev/shm/cuda-mp-test-rank-{tag}-{rank}");
        let pid: u32 = std::fs::read_to_string(&pid_file).expect("the rank wrote its pid").parse().unwrap();
        let _ = std::fs::remove_file(&pid_file);
        assert!(!driver_file_of(pid, tag).exists(), "rank {rank} left its driver file");
    }
}

#[test]
fn join_timeout_then_kill() {
    let mut child = spawn((), sleep_long);
    assert!(child.pid().is_some());
    assert!(matches!(child.join_timeout(Duration::from_millis(100)), Err(JoinError::Timeout)));
    child.kill().unwrap();
    let err = child.join().unwrap_err();
    assert!(matches!(err, JoinError::Signaled { signal: 9, name: "SIGKILL" }), "{err:?}");
    assert_eq!(err.to_string(), "child process was killed by signal 9 (SIGKILL)");
}

fn exit_early(code: i32) {
    std::process::exit(code);
}

fn abort(_: ()) {
    std::process::abort();
}

fn report_pid_then_sleep(tx: cuda_mp::Sender<u32>) {
    tx.send(std::process::id()).unwrap();
    std::thread::sleep(Duration::from_secs(30));
}

#[test]
fn join_errors_name_the_exit_status_or_the_signal() {
    let err = spawn(3, exit_early).join().unwrap_err();
    assert!(matches!(err, JoinError::Exited { code: 3 }), "{err:?}");
    assert_eq!(err.to_string(), "child process exited with status 3 without a result");
    let err = spawn((), abort).join().unwrap_err();
    assert!(matches!(err, JoinError::Signaled { name: "SIGABRT", .. }), "{err:?}");
    // Killed by someone else.
    let (tx, rx) = cuda_mp::channel().unwrap();
    let child = spawn(tx, report_pid_then_sleep);
    let pid = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    // SAFETY: sends a signal to our own child, which is alive (it just answered).
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) }, 0);
    let err = child.join().unwrap_err();
    assert!(matches!(err, JoinError::Signaled { signal: 15, name: "SIGTERM" }), "{err:?}");
}

#[test]
fn a_pool_runs_calls_on_its_workers() {
    let pool = Pool::new(3).unwrap();
    assert_eq!(pool.size(), 3);
    let handles: Vec<_> = (0..6u64).map(|i| pool.spawn(i, square)).collect();
    let results: Vec<u64> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(results, vec![0, 1, 4, 9, 16, 25]);
    // A panic ends the pooled worker (the pool replaces it); the call reports the panic.
    let err = pool.spawn("in pool".to_string(), explode).join().unwrap_err();
    assert_eq!(err.panic().expect("a panic report").message, "worker failed: in pool");
    assert_eq!(pool.spawn(5, square).join().unwrap(), 25, "the pool keeps working after a panic");
    pool.shutdown();
}

fn rank_times_ten((rank, base): (usize, u64)) -> u64 {
    base + rank as u64 * 10
}

fn rank_two_fails((rank, _): (usize, ())) -> usize {
    if rank == 2 {
        panic!("rank two gives up");
    }
    std::thread::sleep(Duration::from_secs(30));
    rank
}

#[test]
fn spawn_n_runs_every_rank_and_reports_the_first_failure_with_its_rank() {
    assert_eq!(cuda_mp::spawn_n(4, 1, rank_times_ten).unwrap(), vec![1, 11, 21, 31]);
    let t = std::time::Instant::now();
    let err = cuda_mp::spawn_n(4, (), rank_two_fails).unwrap_err();
    match &err {
        JoinError::Rank { rank: 2, error } => assert_eq!(error.panic().unwrap().message, "rank two gives up"),
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().starts_with("rank 2 failed: child process panicked: rank two gives up"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(20), "the other ranks were terminated, not waited for");
}

fn ignore_sigterm(_: ()) {
    // SAFETY: sets this process's SIGTERM disposition to ignore; no handler code runs.
    unsafe { libc::signal(libc::SIGTERM, libc::SIG_IGN) };
    std::thread::sleep(Duration::from_secs(30));
}

#[test]
fn terminate_asks_first_then_kills_after_the_grace_period() {
    let mut child = spawn((), sleep_long);
    std::thread::sleep(Duration::from_millis(200));
    assert!(child.is_alive());
    child.terminate(Duration::from_secs(5)).unwrap();
    assert!(!child.is_alive());
    assert!(matches!(child.join(), Err(JoinError::Signaled { name: "SIGTERM", .. })));

    let mut stubborn = spawn((), ignore_sigterm);
    std::thread::sleep(Duration::from_millis(300));
    let t = std::time::Instant::now();
    stubborn.terminate(Duration::from_millis(300)).unwrap();
    assert!(t.elapsed() >= Duration::from_millis(300), "it waited out the grace period");
    assert!(!stubborn.is_alive(), "killed (and reaped) after the grace period");
    assert!(matches!(stubborn.join(), Err(JoinError::Signaled { name: "SIGKILL", .. })));
}

#[test]
fn a_killed_child_is_not_alive_and_one_that_exited_first_keeps_its_exit_status() {
    let mut child = spawn((), sleep_long);
    std::thread::sleep(Duration::from_millis(200));
    child.kill().unwrap();
    assert!(!child.is_alive(), "the kill reaped it: no process is left");
    assert!(matches!(child.join(), Err(JoinError::Signaled { name: "SIGKILL", .. })));

    let mut exited = spawn(4, exit_early);
    let t = std::time::Instant::now();
    while exited.exit_code().is_none() {
        assert!(t.elapsed() < Duration::from_secs(10), "the child never exited");
        std::thread::sleep(Duration::from_millis(10));
    }
    exited.kill().unwrap(); // nothing left to kill, but the kill reaps it
    assert_eq!(exited.exit_code(), Some(4));
    assert!(!exited.is_alive());
    assert!(matches!(exited.join(), Err(JoinError::Exited { code: 4 })));
}

fn rank_zero_fails_the_others_ignore_sigterm((rank, _): (usize, ())) -> usize {
    if rank == 0 {
        std::thread::sleep(Duration::from_millis(500));
        panic!("rank zero gives up");
    }
    // SAFETY: sets this process's SIGTERM disposition to ignore; no handler code runs.
    unsafe { libc::signal(libc::SIGTERM, libc::SIG_IGN) };
    std::thread::sleep(Duration::from_secs(60));
    rank
}

#[test]
fn spawn_n_gives_the_other_ranks_one_grace_period_together() {
    let t = std::time::Instant::now();
    let err = cuda_mp::spawn_n(4, (), rank_zero_fails_the_others_ignore_sigterm).unwrap_err();
    assert!(matches!(err, JoinError::Rank { rank: 0, .. }), "{err:?}");
    // 0.5 s, then one grace of 5 s for the three that ignore SIGTERM (one after another: 15 s).
    assert!(t.elapsed() < Duration::from_secs(11), "took {:?}", t.elapsed());
}

#[test]
fn exit_code_is_known_once_the_child_exited() {
    let child = spawn(4, exit_early);
    let t = std::time::Instant::now();
    while child.exit_code().is_none() {
        assert!(t.elapsed() < Duration::from_secs(10), "the child never exited");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(child.exit_code(), Some(4));
    assert!(!child.is_alive());
}

fn touch_later(path: String) {
    std::thread::sleep(Duration::from_millis(300));
    std::fs::write(path, b"done").unwrap();
}

fn returns_a_channel_end(_: ()) -> cuda_mp::Sender<u8> {
    cuda_mp::channel::<u8>().unwrap().0
}

/// Alive and not a zombie.
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| stat.rsplit(')').next().is_some_and(|rest| !rest.trim_start().starts_with('Z')))
}

#[test]
fn a_detached_child_whose_result_carries_a_descriptor_exits() {
    let child = spawn((), returns_a_channel_end);
    let pid = child.pid().expect("the child runs");
    child.detach();
    let t = std::time::Instant::now();
    while running(pid) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the detached child is still there 10 s after its function returned"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_detached_child_runs_on() {
    let path = std::env::temp_dir().join(format!("cuda-mp-detached-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    spawn(path.to_string_lossy().into_owned(), touch_later).detach();
    let t = std::time::Instant::now();
    while !path.exists() {
        assert!(t.elapsed() < Duration::from_secs(10), "the detached child was killed");
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = std::fs::remove_file(&path);
}

fn return_a_channel_end_later(_: ()) -> cuda_mp::Sender<u8> {
    std::thread::sleep(Duration::from_secs(2));
    cuda_mp::channel::<u8>().unwrap().0
}

fn spawn_then_wait(tx: cuda_mp::Sender<u32>) {
    let grandchild = cuda_mp::spawn((), return_a_channel_end_later);
    tx.send(grandchild.pid().unwrap()).unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

/// A child whose parent was killed while it ran, and whose result carries a descriptor (which
/// waits at its home for the parent to fetch), exits all the same: it waited for ever, taking
/// the process that adopted it for its parent.
#[test]
fn an_orphan_whose_result_carries_a_descriptor_exits() {
    let (tx, rx) = cuda_mp::channel::<u32>().unwrap();
    let mut parent = cuda_mp::spawn(tx, spawn_then_wait);
    let grandchild = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    parent.kill().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while running(grandchild) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let still = running(grandchild);
    if still {
        // SAFETY: a signal to the process this test made.
        unsafe { libc::kill(grandchild as i32, libc::SIGKILL) };
    }
    assert!(!still, "the orphan was still running 20 s after its parent was killed");
}

/// What `worker` returned, waiting a minute at most: past it the worker is killed and the test
/// fails with `expected` (a worker's hang fails its test rather than hold the run).
fn returned_within_a_minute<R: serde::Serialize + serde::de::DeserializeOwned>(
    mut worker: cuda_mp::JoinHandle<R>,
    expected: &str,
) -> R {
    let joined = worker.join_timeout(Duration::from_secs(60));
    if joined.is_err() {
        let _ = worker.kill();
    }
    joined.expect(expected)
}

/// The pids of this process's children, zombies included.
fn children() -> Vec<u32> {
    let me = std::process::id();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            let ppid: u32 = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()?;
            (ppid == me).then_some(pid)
        })
        .collect()
}

/// Whose children a library built by [`library_that_stops_children`] spares.
const SPARE_CHILDREN_OF: &str = "CUDA_MP_TEST_SPARE_CHILDREN_OF";

/// Options for a worker whose children load `library` (built by
/// [`library_that_stops_children`]), the worker itself spared.
fn preloading(library: &std::path::Path) -> cuda_mp::Builder {
    cuda_mp::Builder::new()
        .env("LD_PRELOAD", library.to_string_lossy())
        .env(SPARE_CHILDREN_OF, std::process::id().to_string())
}

/// A shared library whose constructor runs `stop` (C statements) in the process that loads
/// it, before its `main`, unless its parent's pid is in [`SPARE_CHILDREN_OF`].
fn library_that_stops_children(name: &str, stop: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("cuda-mp-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let source = dir.join("stop.c");
    std::fs::write(
        &source,
        format!(
            "#include <signal.h>\n#include <stdlib.h>\n#include <sys/prctl.h>\n#include <unistd.h>\n\
             __attribute__((constructor)) static void stop(void) {{\n\
             const char *spare = getenv(\"{SPARE_CHILDREN_OF}\");\n\
             if (spare && atoi(spare) == (int)getppid()) return;\n\
             {stop}\n}}\n"
        ),
    )
    .unwrap();
    let library = dir.join("libstop.so");
    let built = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&library)
        .arg(&source)
        .status()
        .expect("this test builds a small library with the C compiler `cc`");
    assert!(built.success(), "cc could not build {}", source.display());
    library
}

fn one(_: ()) -> u8 {
    1
}

/// In a process whose children the preloaded library kills as they load: what a spawn and a
/// pool's build said, and the children left behind.
fn start_children_that_die_at_load(_: ()) -> (String, String, Vec<u32>) {
    let spawned = cuda_mp::Builder::new().spawn((), one).map(|_| ()).unwrap_err();
    let built = Pool::builder().size(1).build_timeout(Duration::from_secs(20)).map(|_| ()).unwrap_err();
    (spawned.to_string(), built.to_string(), children())
}

/// A child that ends before it connects back (here a preloaded library kills it as it loads)
/// fails its spawn, or its pool's build, with how it ended, and leaves no zombie: the spawn
/// (and a build without a limit) waited for it for ever.
#[test]
fn a_child_that_dies_before_it_starts_fails_its_spawn_and_its_pools_build() {
    let library = library_that_stops_children("kill-at-load", "kill(getpid(), SIGKILL);");
    let worker = preloading(&library).spawn((), start_children_that_die_at_load).unwrap();
    let (spawned, built, left) = returned_within_a_minute(worker, "the worker returned within 60 s");
    for said in [&spawned, &built] {
        assert!(said.contains("ended before it started") && said.contains("SIGKILL"), "{said}");
    }
    assert!(left.is_empty(), "children left behind (zombies): {left:?}");
    let _ = std::fs::remove_dir_all(library.parent().unwrap());
}

/// Where a library built by [`library_that_hangs_children`] holds a child only once this file
/// exists (without the variable, always).
const HANG_ONCE_EXISTS: &str = "CUDA_MP_TEST_HANG_ONCE_EXISTS";

/// A shared library that holds the children it loads in before their `main` for ever (see
/// [`HANG_ONCE_EXISTS`]); each is killed with its parent, so that a spawn that waits for ever
/// leaves nothing behind once the test kills it.
fn library_that_hangs_children(name: &str) -> std::path::PathBuf {
    library_that_stops_children(
        name,
        &format!(
            "const char *f = getenv(\"{HANG_ONCE_EXISTS}\");\n\
             if (f && access(f, F_OK) != 0) return;\n\
             prctl(PR_SET_PDEATHSIG, SIGKILL);\n\
             for (;;) pause();"
        ),
    )
}

/// In a process whose children the preloaded library holds before their `main`: what a spawn
/// with a start timeout and a pool's build with a timeout said, how long each took, and the
/// children left behind.
fn start_children_that_hang_at_load(_: ()) -> (String, Duration, String, Duration, Vec<u32>) {
    let started = std::time::Instant::now();
    let spawned = cuda_mp::Builder::new().start_timeout(Duration::from_secs(2)).spawn((), one).map(|_| ()).unwrap_err();
    let spawn_took = started.elapsed();
    let started = std::time::Instant::now();
    let built = Pool::builder().size(1).build_timeout(Duration::from_secs(2)).map(|_| ()).unwrap_err();
    let build_took = started.elapsed();
    (format!("{spawned:?}"), spawn_took, format!("{built:?}"), build_took, children())
}

/// A child that lives but never starts (stuck in a static constructor) fails a spawn that
/// has a start timeout, and a pool's build that has a timeout, when the time is up; it is
/// killed and reaped. Both waited for ever.
#[test]
fn a_child_that_never_starts_fails_a_spawn_or_build_with_a_timeout() {
    let library = library_that_hangs_children("hang-at-load");
    let worker = preloading(&library).spawn((), start_children_that_hang_at_load).unwrap();
    let (spawned, spawn_took, built, build_took, left) =
        returned_within_a_minute(worker, "the worker returned within 60 s");
    assert_eq!(spawned, "Timeout");
    assert_eq!(built, "Timeout");
    for took in [spawn_took, build_took] {
        assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(20), "gave up after {took:?}");
    }
    assert!(left.is_empty(), "children left behind: {left:?}");
    let _ = std::fs::remove_dir_all(library.parent().unwrap());
}

/// A start timeout too long for a clock to hold is no limit: the spawn ran, where it failed
/// (an overflow) and left its child a zombie.
#[test]
fn a_start_timeout_past_any_clock_is_no_limit() {
    let child = cuda_mp::Builder::new().start_timeout(Duration::MAX).spawn((), one).unwrap();
    assert_eq!(child.join().unwrap(), 1);
}

/// In a process whose children start until `hang_once` exists: a pool whose worker is
/// replaced by one that never starts (its first worker died, or retired after its one task),
/// then stopped (terminated, or shut down with a limit). What the first call returned, what
/// the stop said and how long it took, and the children left.
fn stop_while_a_replacement_never_starts(
    (hang_once, shut_down): (String, bool),
) -> (String, String, Duration, Vec<u32>) {
    let pool = Pool::builder().size(1).max_tasks_per_child(1).build().unwrap();
    std::fs::write(&hang_once, b"").unwrap();
    let first = if shut_down { pool.spawn(3, square).join() } else { pool.spawn(3, exit_early).join().map(|()| 0) };
    // The dispatcher starts the replacement as soon as the worker is gone or retired.
    std::thread::sleep(Duration::from_millis(500));
    let started = std::time::Instant::now();
    let stopped = if shut_down {
        pool.shutdown_timeout(Duration::from_secs(30))
    } else {
        pool.terminate();
        Ok(())
    };
    (format!("{first:?}"), format!("{stopped:?}"), started.elapsed(), children())
}

/// A pool stopped while it replaces a worker with one that never starts (stuck in a static
/// constructor) stops at once, and leaves no child: it waited for that start for ever (a
/// shutdown with a limit too, past its limit).
#[test]
fn a_pool_stopped_while_its_replacement_worker_never_starts_stops() {
    for shut_down in [false, true] {
        let library = library_that_hangs_children(&format!("hang-replacement-{shut_down}"));
        let hang_once = library.parent().unwrap().join("hang-now");
        let worker = preloading(&library)
            .env(HANG_ONCE_EXISTS, hang_once.to_string_lossy())
            .spawn((hang_once.to_string_lossy().into_owned(), shut_down), stop_while_a_replacement_never_starts)
            .unwrap();
        let (first, stopped, took, left) = returned_within_a_minute(worker, "the worker returned within 60 s");
        assert_eq!(first, if shut_down { "Ok(9)" } else { "Err(Exited { code: 3 })" });
        assert_eq!(stopped, "Ok(())");
        assert!(took < Duration::from_secs(10), "the stop took {took:?} (shut down: {shut_down})");
        assert!(left.is_empty(), "children left behind: {left:?}");
        let _ = std::fs::remove_dir_all(library.parent().unwrap());
    }
}

/// A value whose encoding fails.
#[derive(serde::Deserialize)]
struct Unencodable;

impl serde::Serialize for Unencodable {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom("this value cannot be encoded"))
    }
}

fn never_runs(_: Unencodable) {}

/// Five spawns whose arguments fail to encode: what the last said, and the children left.
fn spawn_unencodable_arguments(_: ()) -> (String, Vec<u32>) {
    let mut said = String::new();
    for _ in 0..5 {
        said = cuda_mp::Builder::new().spawn(Unencodable, never_runs).map(|_| ()).unwrap_err().to_string();
    }
    (said, children())
}

/// A spawn whose arguments fail to encode (after its child started) fails, and leaves no
/// zombie child behind.
#[test]
fn a_spawn_whose_arguments_fail_to_encode_leaves_no_child() {
    let worker = spawn((), spawn_unencodable_arguments);
    let (said, left) = returned_within_a_minute(worker, "the spawns returned within 60 s");
    assert!(said.contains("serialization error"), "{said}");
    assert!(left.is_empty(), "children left behind (zombies): {left:?}");
}

extern "C" fn stop_self() {
    // SAFETY: raising a signal in this process.
    unsafe { libc::raise(libc::SIGSTOP) };
}

/// Returns 7, and stops (SIGSTOP) at its exit, after its result was sent.
fn stop_at_exit(_: ()) -> u8 {
    // SAFETY: registers a handler that only raises a signal.
    unsafe { libc::atexit(stop_self) };
    7
}

/// Joins a child that stops at its exit: whether a join with a limit gave up in time (and
/// how long it took), then the result once the child is let go on.
fn join_a_child_stopped_at_exit(_: ()) -> (String, Duration, u8) {
    let mut child = spawn((), stop_at_exit);
    // The child returns, sends its result and stops.
    let stat = format!("/proc/{}/stat", child.pid().unwrap());
    let stopped = || {
        std::fs::read_to_string(&stat)
            .is_ok_and(|s| s.rsplit_once(')').is_some_and(|(_, r)| r.trim_start().starts_with('T')))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !stopped() {
        assert!(std::time::Instant::now() < deadline, "the child did not stop at its exit");
        std::thread::sleep(Duration::from_millis(10));
    }
    let started = std::time::Instant::now();
    let first = child.join_timeout(Duration::from_millis(500));
    let took = started.elapsed();
    // SAFETY: a signal to the child this function made (stopped, not reaped).
    unsafe { libc::kill(child.pid().unwrap() as i32, libc::SIGCONT) };
    let result = child.join_timeout(Duration::from_secs(30)).unwrap();
    (format!("{:?}", first.map(|_| ())), took, result)
}

/// A join with a limit gives up in time on a child that sent its result but has not exited
/// (stopped here; or waiting at its exit for this process to read what it sent), and the next
/// join returns the result: the join waited for the exit without limit once the result had
/// arrived.
#[test]
fn a_join_with_a_limit_gives_up_on_a_child_that_returned_but_has_not_exited() {
    let worker = spawn((), join_a_child_stopped_at_exit);
    let (first, took, result) = returned_within_a_minute(worker, "the joins returned within 60 s");
    assert_eq!(first, "Err(Timeout)");
    assert!(took < Duration::from_secs(5), "the join gave up after {took:?}");
    assert_eq!(result, 7);
}

/// Rank 1 sleeps for a minute; rank 0 returns at once.
fn rank_one_sleeps((rank, _): (usize, ())) -> usize {
    if rank == 1 {
        std::thread::sleep(Duration::from_secs(60));
    }
    rank
}

/// What `spawn_n_timeout` said of a rank that outlives its limit, how long it took, and the
/// children left.
fn spawn_n_past_its_limit(_: ()) -> (String, Duration, Vec<u32>) {
    let started = std::time::Instant::now();
    let said = cuda_mp::spawn_n_timeout(2, (), rank_one_sleeps, Duration::from_secs(1));
    (format!("{said:?}"), started.elapsed(), children())
}

/// `spawn_n_timeout` gives up on a rank that runs past its limit, terminates it and leaves no
/// child.
#[test]
fn spawn_n_timeout_gives_up_and_terminates_the_ranks_left() {
    let worker = spawn((), spawn_n_past_its_limit);
    let (said, took, left) = returned_within_a_minute(worker, "the worker returned within 60 s");
    assert_eq!(said, "Err(Timeout)");
    assert!(took >= Duration::from_secs(1) && took < Duration::from_secs(10), "gave up after {took:?}");
    assert!(left.is_empty(), "children left behind: {left:?}");
    assert_eq!(
        cuda_mp::spawn_n_timeout(2, (), |(rank, ()): (usize, ())| rank * 2, Duration::from_secs(30)).unwrap(),
        vec![0, 2]
    );
}

/// In a process that ignores `SIGCHLD` (its children are reaped by the kernel as they exit):
/// what a join with a limit returned and how long it took; then, of another child that
/// returned, whether it still looked alive 10 s on and what a kill said.
fn join_with_sigchld_ignored(_: ()) -> (String, Duration, bool, String) {
    // SAFETY: sets the disposition of one signal, in this process of the test alone.
    unsafe { libc::signal(libc::SIGCHLD, libc::SIG_IGN) };
    let mut child = spawn(6, square);
    let started = std::time::Instant::now();
    let joined = child.join_timeout(Duration::from_secs(20));
    let took = started.elapsed();
    let mut other = spawn(1, square);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while other.is_alive() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    (format!("{joined:?}"), took, other.is_alive(), format!("{:?}", other.kill()))
}

/// A child reaped by someone else (here the kernel, `SIGCHLD` ignored) is joined all the
/// same, is seen ended, and a kill of it signals nothing (its pid may be another process's by
/// then): the join waited for an exit it could no longer see, and the kill signalled the pid.
#[test]
fn a_child_reaped_by_someone_else_is_joined_and_not_signalled() {
    let worker = spawn((), join_with_sigchld_ignored);
    let (joined, took, alive, killed) = returned_within_a_minute(worker, "the joins returned within 60 s");
    assert_eq!(joined, "Ok(36)");
    assert!(took < Duration::from_secs(10), "the join took {took:?}");
    assert!(!alive, "a child reaped by the kernel still looked alive");
    assert_eq!(killed, "Ok(())");
}
