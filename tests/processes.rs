//! Spawning: results, panics reported with message and location, timeouts, kill, pools.

use std::time::Duration;

use cuda_mp::{spawn, JoinError, Pool};

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
    // A panic ends the pooled worker (procspawn restarts it); the call reports the termination.
    let err = pool.spawn("in pool".to_string(), explode).join().unwrap_err();
    assert!(matches!(err, JoinError::Terminated(_) | JoinError::Panicked(_)), "{err:?}");
    // Either the panic came back, or the worker's death is named as such.
    assert!(err.panic().is_some() || err.to_string().contains("pooled worker"), "{err}");
    assert_eq!(pool.spawn(5, square).join().unwrap(), 25, "the pool keeps working after a panic");
    pool.shutdown();
}
