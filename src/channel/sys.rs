//! The one system call of the channels that `rustix` does not cover: the exit hook that lets
//! backlogs drain.

/// Runs `hook` when this process exits through `exit` (returning from `main` included), before
/// it ends. The hook must not unwind.
pub(super) fn at_exit(hook: extern "C" fn()) -> bool {
    // SAFETY: registers a function pointer with the C library; `hook` is a plain `extern "C"`
    // function that lives as long as the program.
    unsafe { libc::atexit(hook) == 0 }
}
