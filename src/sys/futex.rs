//! Futex wait and wake on 32-bit words of shared memory, between processes.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

use rustix::thread::futex;

/// Sleeps while `word` holds `expected`, for at most `timeout` (`None`: no limit). Returns on a
/// wake, a timeout, a signal, or at once when the word holds another value: the caller looks at
/// the word again in every case.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
    let timeout = timeout.map(|d| rustix::time::Timespec {
        tv_sec: d.as_secs().min(i32::MAX as u64) as i64,
        tv_nsec: d.subsec_nanos() as _,
    });
    // Not the private variant: the word is shared between processes. A changed word, a wake,
    // a signal and a timeout all just return.
    let _ = futex::wait(word, futex::Flags::empty(), expected, timeout.as_ref());
}

/// Wakes up to `n` processes or threads sleeping in [`futex_wait`] on `word`.
pub(crate) fn futex_wake(word: &AtomicU32, n: u32) {
    let _ = futex::wake(word, futex::Flags::empty(), n.min(i32::MAX as u32));
}

/// Wakes every sleeper on `word`.
pub(crate) fn futex_wake_all(word: &AtomicU32) {
    futex_wake(word, u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_on_a_changed_word_returns_at_once_and_a_timeout_ends_a_wait() {
        let word = AtomicU32::new(0);
        let start = std::time::Instant::now();
        futex_wait(&word, 1, None); // holds 0, not 1
        futex_wait(&word, 0, Some(Duration::from_millis(30)));
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(25) && waited < Duration::from_secs(2), "{waited:?}");
    }
}
