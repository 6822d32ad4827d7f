//! Watching a child process for its end without reaping it (whoever owns it reaps it): `waitid`
//! with `WNOWAIT`, a pidfd to wait on, and the exit status the kernel keeps for the pidfd once
//! someone else reaped the child.

use std::os::fd::OwnedFd;
use std::time::Duration;

use rustix::event::{PollFd, PollFlags};
use rustix::process::{
    Pid, PidfdFlags, Signal, WaitId, WaitIdOptions, kill_process, pidfd_open, pidfd_send_signal, waitid,
};

/// How a child process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Exit {
    /// It exited with this status.
    Code(i32),
    /// A signal killed it.
    Signal(i32),
}

impl Exit {
    /// Whether a process that ended so may have ended of a panic: procspawn's exit after it
    /// caught one, Rust's exit code for a panic that unwound out of `main`, or the abort of
    /// `panic = "abort"`.
    pub(crate) fn may_be_a_panic(self) -> bool {
        matches!(self, Exit::Code(0 | 101) | Exit::Signal(libc::SIGABRT))
    }
}

/// Watches a child process for its end without reaping it.
#[derive(Debug)]
pub(crate) struct ChildWatch {
    pid: Option<Pid>,
    /// A pidfd, readable once the child has exited (`None` where the kernel has none).
    pidfd: Option<OwnedFd>,
}

impl ChildWatch {
    pub(crate) fn new(pid: u32) -> ChildWatch {
        let pid = i32::try_from(pid).ok().and_then(Pid::from_raw);
        let pidfd = pid.and_then(|pid| pidfd_open(pid, PidfdFlags::empty()).ok());
        ChildWatch { pid, pidfd }
    }

    /// The child's pid.
    #[cfg(feature = "cuda")]
    pub(crate) fn pid(&self) -> Option<u32> {
        self.pid.map(|p| p.as_raw_nonzero().get() as u32)
    }

    /// How the child ended, if it has (waiting up to `wait` for it to end); leaves it to be
    /// reaped by its owner. `None` while it runs, or once someone else reaped it.
    pub(crate) fn exited(&self, wait: Duration) -> Option<Exit> {
        if let Some(exit) = self.peek() {
            return Some(exit);
        }
        if wait.is_zero() {
            return None;
        }
        match &self.pidfd {
            Some(fd) => {
                let mut fds = [PollFd::new(fd, PollFlags::IN)];
                let _ = crate::sys::socket::poll_once(&mut fds, Some(wait));
            }
            None => std::thread::sleep(wait),
        }
        self.peek()
    }

    /// Whether the child has ended, also where someone else reaped it (`SIGCHLD` ignored, a
    /// `waitpid(-1)`), which [`exited`](Self::exited) cannot tell from running: its pidfd is
    /// readable then, and without a pidfd `waitid` finds no such child.
    pub(crate) fn gone(&self) -> bool {
        if self.peek().is_some() {
            return true;
        }
        match (&self.pidfd, self.pid) {
            (Some(fd), _) => {
                let mut fds = [PollFd::new(fd, PollFlags::IN)];
                crate::sys::socket::poll_once(&mut fds, Some(Duration::ZERO)).is_ok_and(|n| n > 0)
            }
            (None, Some(pid)) => {
                let options = WaitIdOptions::EXITED | WaitIdOptions::NOHANG | WaitIdOptions::NOWAIT;
                waitid(WaitId::Pid(pid), options).is_err()
            }
            (None, None) => true,
        }
    }

    /// Sends `signal` to the child unless it has exited (then its pid may belong to someone
    /// else once reaped; an exited child not yet reaped is left alone too). Through the pidfd
    /// where there is one: it names this child alone, even if the child is reaped between the
    /// look and the signal and its pid taken by another process.
    pub(crate) fn signal(&self, signal: Signal) -> bool {
        if self.peek().is_some() {
            return false;
        }
        match (&self.pidfd, self.pid) {
            (Some(pidfd), _) => pidfd_send_signal(pidfd, signal).is_ok(),
            (None, Some(pid)) => kill_process(pid, signal).is_ok(),
            (None, None) => false,
        }
    }

    /// How the child ended, also once someone else has reaped it: then the kernel keeps its
    /// exit status for the pidfd (Linux 6.15 and later; `None` on older kernels). `None` while
    /// it runs.
    pub(crate) fn exit_status(&self) -> Option<Exit> {
        self.peek().or_else(|| self.reaped_status())
    }

    fn reaped_status(&self) -> Option<Exit> {
        use std::os::fd::AsRawFd;
        let fd = self.pidfd.as_ref()?.as_raw_fd();
        // SAFETY: `pidfd_info` is plain integers, for which all zeroes is a valid value.
        let mut info: libc::pidfd_info = unsafe { std::mem::zeroed() };
        info.mask = libc::PIDFD_INFO_EXIT as u64;
        // SAFETY: `PIDFD_GET_INFO` writes at most `size_of::<pidfd_info>()` bytes (the size the
        // request encodes) into `info`, which is valid and writable; `fd` is our open pidfd; a
        // kernel without the request fails it. (rustix has no wrapper for it yet.)
        let r = unsafe { libc::ioctl(fd, libc::PIDFD_GET_INFO, &mut info) };
        if r != 0 || info.mask & libc::PIDFD_INFO_EXIT as u64 == 0 {
            return None;
        }
        let status = info.exit_code;
        if libc::WIFSIGNALED(status) {
            Some(Exit::Signal(libc::WTERMSIG(status)))
        } else if libc::WIFEXITED(status) {
            Some(Exit::Code(libc::WEXITSTATUS(status)))
        } else {
            None
        }
    }

    fn peek(&self) -> Option<Exit> {
        let pid = self.pid?;
        let options = WaitIdOptions::EXITED | WaitIdOptions::NOHANG | WaitIdOptions::NOWAIT;
        let status = waitid(WaitId::Pid(pid), options).ok()??;
        if let Some(signal) = status.terminating_signal() {
            Some(Exit::Signal(signal))
        } else {
            status.exit_status().map(Exit::Code)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_s_end_is_seen_without_reaping_it() {
        let mut child = std::process::Command::new("sh").args(["-c", "exit 3"]).spawn().unwrap();
        let watch = ChildWatch::new(child.id());
        assert_eq!(watch.exited(Duration::from_secs(10)), Some(Exit::Code(3)));
        // Still there to be reaped by its owner.
        assert_eq!(child.wait().unwrap().code(), Some(3));
        let mut sleeper = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let watch = ChildWatch::new(sleeper.id());
        assert_eq!(watch.exited(Duration::ZERO), None);
        assert!(watch.signal(Signal::KILL));
        assert_eq!(watch.exited(Duration::from_secs(10)), Some(Exit::Signal(9)));
        sleeper.wait().unwrap();
    }
}
