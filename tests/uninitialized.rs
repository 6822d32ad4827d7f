//! A program that forgot `cuda_mp::init()` (or `#[cuda_mp::main]`): its first spawn fails at
//! once with the message that says what to do, and nothing is started. This test binary has no
//! `enable_test_support!`, so it is such a program.

use std::time::Duration;

use cuda_mp::{Builder, JoinError, Pool};

fn child(x: u32) -> u32 {
    x + 1
}

const MESSAGE: &str = "process spawning is not initialized: call cuda_mp::init() first in main or use #[cuda_mp::main]";

#[test]
fn spawn_panics_with_what_to_do() {
    let panic = std::panic::catch_unwind(|| cuda_mp::spawn(1, child)).unwrap_err();
    let message = panic.downcast_ref::<String>().expect("a formatted message");
    assert_eq!(message, MESSAGE);
}

#[test]
fn the_builder_and_the_pool_report_it_as_an_error() {
    let err = Builder::new().env("X", "1").spawn(1, child).unwrap_err();
    assert!(matches!(err, JoinError::NotInitialized), "{err:?}");
    assert_eq!(err.to_string(), MESSAGE);
    let err = Pool::builder().size(1).build_timeout(Duration::from_secs(5)).unwrap_err();
    assert!(matches!(err, JoinError::NotInitialized), "{err:?}");
}
