//! What every fuzz target checks besides "no panic": the process's descriptors do not grow.
//! Claims are released by cuda-mp's lease threads soon after a decode, not always before it
//! returns, so the count is compared every few thousand runs against the count after the
//! first ones (which open what a process opens once), with room for releases still on their way.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Runs between two counts.
const EVERY: usize = 4096;
/// Descriptors a count may find above the first, before it waits for releases.
const SLACK: usize = 32;

fn open_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// Call after each run: panics (a finding) when descriptors stay above the baseline.
pub fn check_descriptors() {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    static BASELINE: AtomicUsize = AtomicUsize::new(0);
    let runs = RUNS.fetch_add(1, Ordering::Relaxed) + 1;
    if runs % EVERY != 0 {
        return;
    }
    if runs == EVERY {
        BASELINE.store(open_descriptors(), Ordering::Relaxed);
        return;
    }
    let baseline = BASELINE.load(Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(5);
    while open_descriptors() > baseline + SLACK {
        assert!(Instant::now() < deadline, "{} descriptors open after {runs} runs; {baseline} after the first {EVERY}", open_descriptors());
        std::thread::sleep(Duration::from_millis(1));
    }
}
