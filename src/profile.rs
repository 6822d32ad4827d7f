//! Time spent in each phase of a handoff, summed per process: what a benchmark reads to split
//! a round trip between the two processes' steps. Each phase costs two clock reads, and only
//! where timing is on (`CUDA_MP_PHASE_TIMES=1`, or `__private::set_phase_times`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A step of sending or receiving a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Sender: a storage's whole export (the kind's record, its lease, its event).
    Export,
    /// Sender: the kind's record (IPC handle, or descriptor export and offer).
    ExportRecord,
    /// Sender: recording the interprocess event.
    EventRecord,
    /// Receiver: a tensor's whole decode (checks, import, event wait).
    Decode,
    /// Receiver: opening a mapping that was neither in use nor cached.
    Open,
    /// Receiver: taking a VMM descriptor out of the message (inside `Decode`).
    Fetch,
    /// Receiver: waiting on the sender's event.
    EventWait,
    /// Remote sender: writing a message's frame and host bytes on its TCP connection.
    RemoteWrite,
    /// Remote receiver: allocating a message's fresh memory (inside its decode).
    RemoteAlloc,
    /// Either remote end: a message's NCCL transfers, from the first call until its bytes moved.
    RemoteNccl,
    /// Remote sender: waiting for the receiver's acknowledgement after the NCCL transfers.
    RemoteAck,
}

/// How many phases there are (the last is `RemoteAck`).
const PHASES: usize = Phase::RemoteAck as usize + 1;

static NANOS: [AtomicU64; PHASES] = [const { AtomicU64::new(0) }; PHASES];
static COUNTS: [AtomicU64; PHASES] = [const { AtomicU64::new(0) }; PHASES];

/// Whether phases are timed in this process: off unless `CUDA_MP_PHASE_TIMES=1` or
/// [`set_enabled`], so that a handoff pays no clock reads for a benchmark's statistics.
static ENABLED: std::sync::LazyLock<AtomicBool> =
    std::sync::LazyLock::new(|| AtomicBool::new(std::env::var_os("CUDA_MP_PHASE_TIMES").is_some_and(|v| v == "1")));

/// Turns the timing of phases on or off in this process.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Runs `f`, adding its time to `phase` when phases are timed.
pub(crate) fn timed<R>(phase: Phase, f: impl FnOnce() -> R) -> R {
    if !ENABLED.load(Ordering::Relaxed) {
        return f();
    }
    let start = Instant::now();
    let result = f();
    let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
    NANOS[phase as usize].fetch_add(nanos, Ordering::Relaxed);
    COUNTS[phase as usize].fetch_add(1, Ordering::Relaxed);
    result
}

/// Totals per phase since this process started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PhaseTimes {
    nanos: [u64; PHASES],
    counts: [u64; PHASES],
}

impl PhaseTimes {
    /// The totals now.
    pub fn now() -> PhaseTimes {
        let mut t = PhaseTimes::default();
        for i in 0..PHASES {
            t.nanos[i] = NANOS[i].load(Ordering::Relaxed);
            t.counts[i] = COUNTS[i].load(Ordering::Relaxed);
        }
        t
    }

    /// Time spent in `phase` since `earlier`.
    pub fn since(&self, earlier: &PhaseTimes, phase: Phase) -> Duration {
        Duration::from_nanos(self.nanos[phase as usize].saturating_sub(earlier.nanos[phase as usize]))
    }

    /// How often `phase` ran since `earlier`.
    pub fn count_since(&self, earlier: &PhaseTimes, phase: Phase) -> u64 {
        self.counts[phase as usize].saturating_sub(earlier.counts[phase as usize])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timed_phase_adds_its_time_and_count() {
        set_enabled(true);
        let before = PhaseTimes::now();
        timed(Phase::EventWait, || std::thread::sleep(Duration::from_millis(2)));
        let after = PhaseTimes::now();
        assert!(after.since(&before, Phase::EventWait) >= Duration::from_millis(2));
        assert!(after.count_since(&before, Phase::EventWait) >= 1);
    }
}
