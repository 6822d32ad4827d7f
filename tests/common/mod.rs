//! Helpers shared by the integration tests.

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use cuda_mp::wait_for_lifetime;

/// The lifetime counters are per process: tests that read them run one at a time, each
/// starting once everything an earlier test shared is freed, so that the counters each test
/// reads are its own. Fails if an earlier test left shared storage behind for `wait`.
pub fn serial(lock: &'static Mutex<()>, wait: Duration) -> MutexGuard<'static, ()> {
    let guard = lock.lock().unwrap_or_else(|p| p.into_inner());
    wait_for_lifetime(wait, |s| s.outstanding_leases == 0 && s.exported_storages == 0)
        .expect("an earlier test left shared storage behind");
    guard
}
