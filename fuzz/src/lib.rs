//! What every fuzz target checks besides "no panic": the process's descriptors do not grow.
//! Claims are released by cuda-mp's lease threads soon after a decode, not always before it
//! returns, so the count is compared every few thousand runs against the count after the
//! first ones (which open what a process opens once), waiting for releases still on their way:
//! a count that stays above it for a minute is a finding. Left out of every count: the spare
//! lease pipes the lease machinery keeps (it tops them up on its own thread at any time), and
//! the host caching allocator's wholly free segments (memory kept for the next tensors, given
//! up before each count).

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Runs between two counts.
const EVERY: usize = 4096;
/// Descriptors a count may find above the first without a finding.
const SLACK: usize = 8;
/// How long a count above that may take to come down (releases of a loaded machine).
const SETTLE: Duration = Duration::from_secs(60);

/// The descriptors' names (their links in /proc/self/fd).
fn names() -> Vec<String> {
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else { return Vec::new() };
    let mut names: Vec<String> =
        fds.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok()).map(|p| p.display().to_string()).collect();
    names.sort();
    names
}

/// The names of `now` beyond those of `baseline`, counting repeats (two ends of one pipe).
fn beyond(mut now: Vec<String>, baseline: &[String]) -> Vec<String> {
    for name in baseline {
        if let Some(i) = now.iter().position(|n| n == name) {
            now.remove(i);
        }
    }
    now
}

fn open_descriptors() -> usize {
    cuda_mp::empty_host_cache();
    cuda_mp::testing::open_descriptors()
}

/// Call after each run: panics (a finding) when descriptors stay above the baseline.
pub fn check_descriptors() {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    static BASELINE: AtomicUsize = AtomicUsize::new(0);
    static BASELINE_NAMES: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let runs = RUNS.fetch_add(1, Ordering::Relaxed) + 1;
    if runs % EVERY != 0 {
        return;
    }
    if runs == EVERY {
        BASELINE.store(open_descriptors(), Ordering::Relaxed);
        *BASELINE_NAMES.lock().unwrap_or_else(|p| p.into_inner()) = names();
        return;
    }
    let baseline = BASELINE.load(Ordering::Relaxed);
    let deadline = Instant::now() + SETTLE;
    while open_descriptors() > baseline + SLACK {
        assert!(
            Instant::now() < deadline,
            "{} descriptors open after {runs} runs; {baseline} after the first {EVERY} (spare lease pipes and free \
             host segments left out of both); beyond the first's: {:?}; {:?}; {:?}",
            open_descriptors(),
            beyond(names(), &BASELINE_NAMES.lock().unwrap_or_else(|p| p.into_inner())),
            cuda_mp::lifetime_stats(),
            cuda_mp::host_allocator_stats(),
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
