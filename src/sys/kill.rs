//! Kill points: named places where a test has a process killed mid-operation, to check that
//! what the operation had started (claims, mappings, descriptors, a message in flight) comes
//! back (`tests/kill_points.rs`). Only with the `testing` feature; without it every point is an
//! empty function.
//!
//! `CUDA_MP_KILL_AT=point` kills the process with `SIGKILL` (no exit hook, no unwinding, as
//! `kill -9`) the first time it passes `point`; `point:n` the `n`-th time.

/// The points, in the order an operation passes them.
#[cfg(any(test, feature = "testing"))]
pub const POINTS: [&str; 8] = [
    // A storage's claim is made for a message being encoded; nothing is sent yet.
    "export",
    // A message's frame has been written to the channel's socket.
    "sent",
    // Between two batches of a message's descriptors, past the kernel's per-message limit.
    "descriptor-batch",
    // A frame has been read off the socket; its message is not decoded yet.
    "received",
    // A storage is mapped; its mapping is not yet this process's.
    "import",
    // A received storage is being sent on: its relay's claim is made.
    "forward",
    // A queue's dispatcher has handed a message to a consumer, not yet acknowledged.
    "queue-handed",
    // A queue's consumer holds a message the dispatcher handed it, not yet acknowledged.
    "queue-delivered",
];

/// The variable that names the point.
#[cfg(any(test, feature = "testing"))]
pub const KILL_AT_ENV: &str = "CUDA_MP_KILL_AT";

#[cfg(feature = "testing")]
pub(crate) fn point(name: &'static str) {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};

    static TARGET: OnceLock<Option<(String, u64)>> = OnceLock::new();
    static PASSED: AtomicU64 = AtomicU64::new(0);
    let target = TARGET.get_or_init(|| {
        let value = std::env::var(KILL_AT_ENV).ok()?;
        let (point, n) = value.split_once(':').unwrap_or((&value, "1"));
        Some((point.to_string(), n.parse().unwrap_or(1)))
    });
    if let Some((point, n)) = target
        && point == name
        && PASSED.fetch_add(1, Ordering::Relaxed) + 1 == *n
    {
        // As `kill -9`: no exit hook, no unwinding.
        let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
        std::process::abort();
    }
}

#[cfg(not(feature = "testing"))]
#[inline(always)]
pub(crate) fn point(_: &'static str) {}
