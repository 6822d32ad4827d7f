//! Watching a spawned child from its start until the spawn returns. procspawn waits without a
//! limit for its child to connect back to a one-shot listener: a child that ends before it
//! does (a preloaded library that kills it, a crash in a static constructor, the OOM killer)
//! would hold the spawn for ever, and a spawn that fails after the child started leaves the
//! child unreaped. The watch finds the listener the spawn made and the child the spawning
//! thread started, and shuts the listener down if the child ends first: procspawn's accept
//! then fails, and the failed spawn's child is reaped here.
//!
//! - **The listener**: the sockets of this process are noted before the spawn; the one new
//!   listening `SOCK_SEQPACKET` socket named `.../socket` after it is the spawn's. A gate keeps
//!   this crate's spawns from overlapping between that note and the find; where another maker
//!   of such listeners (procspawn's restarts of a pool's worker, the user's `ipc-channel`)
//!   leaves two, the spawn goes without one rather than risk shutting down another's.
//! - **The child**: the one new entry of the spawning thread's list of children
//!   (`/proc/self/task/TID/children`): that thread starts nothing else while it spawns. A
//!   hook between fork and exec would name it at once, but would make the standard library
//!   fork the whole process instead of `posix_spawn`, which costs with its memory (60 ms a
//!   spawn with 2 GiB in use, against 2 ms).
//! - Where the kernel has no list of children, the spawn goes unwatched, as without the watch.

use std::collections::HashSet;
use std::os::fd::{AsFd, OwnedFd, RawFd};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::net::{Shutdown, SocketAddrUnix, SocketType, getsockname, shutdown, sockopt};
use rustix::pipe::{PipeFlags, pipe_with};
use rustix::process::{
    Pid, PidfdFlags, PidfdGetfdFlags, Signal, WaitId, WaitIdOptions, getpid, pidfd_getfd, pidfd_open,
    pidfd_send_signal, waitid,
};

use super::Exit;

/// How often the watch looks for the spawn's listener and child until it has found them.
const LOOK: Duration = Duration::from_millis(1);

/// How long a failed spawn waits for its watch to end.
const SETTLE_WAIT: Duration = Duration::from_secs(5);

/// Taken by a spawn from before it notes this process's sockets until its listener is found
/// (or the spawn has returned).
static GATE: (Mutex<bool>, Condvar) = (Mutex::new(false), Condvar::new());

struct GateTicket;

impl GateTicket {
    fn take() -> GateTicket {
        let (busy, freed) = &GATE;
        let mut busy = busy.lock().unwrap_or_else(PoisonError::into_inner);
        while *busy {
            busy = freed.wait(busy).unwrap_or_else(PoisonError::into_inner);
        }
        *busy = true;
        GateTicket
    }
}

impl Drop for GateTicket {
    fn drop(&mut self) {
        let (busy, freed) = &GATE;
        *busy.lock().unwrap_or_else(PoisonError::into_inner) = false;
        freed.notify_one();
    }
}

/// What the watch has seen of the child.
#[derive(Debug, Default)]
struct Seen {
    /// The watch has ended.
    settled: bool,
    /// A pidfd of the child: it names the child alone, also once someone else reaped it.
    pidfd: Option<OwnedFd>,
    /// It ended before the spawn returned.
    ended: Option<Exit>,
}

type Shared = (Mutex<Seen>, Condvar);

/// Watches the child of one spawn of the thread that made it. Dropped once the spawn
/// succeeded, which ends the watch; [`failed`](Self::failed) after a spawn that failed.
#[derive(Debug)]
pub(crate) struct StartWatch {
    seen: Arc<Shared>,
    /// Closed when the spawn has returned: the watch's thread then ends.
    done: Option<OwnedFd>,
}

impl StartWatch {
    /// Starts watching the next spawn of the calling thread; `None` when no watch can start
    /// (the spawn then runs unwatched).
    pub(crate) fn begin() -> Option<StartWatch> {
        let thread = rustix::thread::gettid();
        let children_before = children(thread)?;
        let (until, done) = pipe_with(PipeFlags::CLOEXEC).ok()?;
        let gate = GateTicket::take();
        let sockets_before: HashSet<u64> = sockets().into_iter().map(|(_, inode)| inode).collect();
        let seen = Arc::new(Shared::default());
        let watched = seen.clone();
        let look = Before { thread, children: children_before, sockets: sockets_before };
        std::thread::Builder::new()
            .name("cuda-mp-start".into())
            .spawn(move || {
                let ended = watch(&until, look, gate, &watched);
                let (lock, changed) = &*watched;
                let mut seen = lock.lock().unwrap_or_else(PoisonError::into_inner);
                seen.settled = true;
                seen.ended = seen.ended.or(ended);
                changed.notify_all();
            })
            .ok()?;
        Some(StartWatch { seen, done: Some(done) })
    }

    /// How the child ended, where it ended before it connected back (read once the spawn
    /// returned: the watch records the end before it makes the spawn fail).
    pub(crate) fn ended_first(&self) -> Option<Exit> {
        self.seen.0.lock().unwrap_or_else(PoisonError::into_inner).ended
    }

    /// After a spawn that failed: how its child ended if it ended before the spawn returned;
    /// a child still running is killed. Either is reaped unless its owner did (procspawn drops
    /// a failed spawn's child without waiting for it). `None` when no child was found, or it
    /// was still running.
    pub(crate) fn failed(mut self) -> Option<Exit> {
        self.done = None;
        let (lock, changed) = &*self.seen;
        let seen = lock.lock().unwrap_or_else(PoisonError::into_inner);
        let (mut seen, _) =
            changed.wait_timeout_while(seen, SETTLE_WAIT, |s| !s.settled).unwrap_or_else(PoisonError::into_inner);
        let (pidfd, ended) = (seen.pidfd.take()?, seen.ended);
        drop(seen);
        if ended.is_none() {
            let _ = pidfd_send_signal(&pidfd, Signal::KILL);
        }
        // Through the pidfd: a child its owner reaped already is not mistaken for another
        // process that took its pid since.
        let _ = waitid(WaitId::PidFd(pidfd.as_fd()), WaitIdOptions::EXITED);
        ended
    }
}

/// What was there before the spawn.
struct Before {
    thread: Pid,
    children: HashSet<Pid>,
    sockets: HashSet<u64>,
}

/// The watch's thread: finds the spawn's listener (then lets the next spawn past the gate) and
/// its child, then waits for the child's end or the spawn's return (`until` closed). How the
/// child ended, if it ended first.
fn watch(until: &OwnedFd, before: Before, gate: GateTicket, seen: &Shared) -> Option<Exit> {
    let listener = found(until, || match one_new_listener(&before.sockets) {
        New::None => None,
        New::One(listener) => Some(Some(listener)),
        New::Many => Some(None),
    })?;
    drop(gate);
    let pid = found(until, || {
        let now = children(before.thread)?;
        now.into_iter().find(|pid| !before.children.contains(pid))
    })?;
    // Opened before the spawn returns: until then nobody reaps the child.
    let pidfd = pidfd_open(pid, PidfdFlags::empty()).ok()?;
    seen.0.lock().unwrap_or_else(PoisonError::into_inner).pidfd = pidfd.try_clone().ok();
    if !readable_before(&pidfd, until, None) {
        return None;
    }
    let exit = ended(pid)?;
    // Recorded before the listener is shut: the spawn that fails of it finds it.
    seen.0.lock().unwrap_or_else(PoisonError::into_inner).ended = Some(exit);
    if let Some(listener) = listener {
        let _ = shutdown(&listener, Shutdown::Both);
    }
    Some(exit)
}

/// Looks for something every [`LOOK`] until it is found (`None`: the spawn returned first).
fn found<T>(until: &OwnedFd, mut look: impl FnMut() -> Option<T>) -> Option<T> {
    loop {
        if let Some(found) = look() {
            return Some(found);
        }
        if readable_before(until, until, Some(LOOK)) {
            return None;
        }
    }
}

/// Waits until `fd` is readable (true), `until` is closed, or `timeout` passes (false; also on
/// an error of `poll`).
fn readable_before(fd: &OwnedFd, until: &OwnedFd, timeout: Option<Duration>) -> bool {
    let timeout = timeout.map(|t| Timespec::try_from(t).unwrap_or(Timespec { tv_sec: 0, tv_nsec: 1_000_000 }));
    let mut fds = [PollFd::new(fd, PollFlags::IN), PollFd::new(until, PollFlags::IN)];
    loop {
        match poll(&mut fds, timeout.as_ref()) {
            Ok(_) => return fds[0].revents().intersects(PollFlags::IN | PollFlags::HUP),
            Err(rustix::io::Errno::INTR) => continue,
            Err(_) => return false,
        }
    }
}

/// How the child ended, if it has, leaving it unreaped.
fn ended(pid: Pid) -> Option<Exit> {
    let options = WaitIdOptions::EXITED | WaitIdOptions::NOHANG | WaitIdOptions::NOWAIT;
    let status = waitid(WaitId::Pid(pid), options).ok()??;
    status.terminating_signal().map(Exit::Signal).or_else(|| status.exit_status().map(Exit::Code))
}

/// The children that `thread` (of this process) started and nobody reaped yet; `None` where
/// the kernel keeps no such list.
fn children(thread: Pid) -> Option<HashSet<Pid>> {
    let list = std::fs::read_to_string(format!("/proc/self/task/{}/children", thread.as_raw_nonzero())).ok()?;
    Some(list.split_whitespace().filter_map(|pid| Pid::from_raw(pid.parse().ok()?)).collect())
}

/// This process's open sockets: descriptor and inode.
fn sockets() -> Vec<(RawFd, u64)> {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return Vec::new() };
    dir.flatten()
        .filter_map(|entry| {
            let fd = entry.file_name().to_str()?.parse().ok()?;
            let link = std::fs::read_link(entry.path()).ok()?;
            let inode = link.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()?;
            Some((fd, inode))
        })
        .collect()
}

/// Listeners like procspawn's (ipc-channel's one-shot server) opened since a note.
enum New {
    None,
    /// Exactly one, as a descriptor of its own.
    One(OwnedFd),
    /// More than one: which is whose cannot be told.
    Many,
}

fn one_new_listener(before: &HashSet<u64>) -> New {
    let Ok(me) = pidfd_open(getpid(), PidfdFlags::empty()) else { return New::Many };
    let mut found = New::None;
    for (fd, inode) in sockets().into_iter().filter(|(_, inode)| !before.contains(inode)) {
        // A copy through the pidfd: the number may have been closed, even taken again, since.
        let Ok(copy) = pidfd_getfd(&me, fd, PidfdGetfdFlags::empty()) else { continue };
        if rustix::fs::fstat(&copy).map(|s| s.st_ino) == Ok(inode) && is_one_shot_listener(&copy) {
            if matches!(found, New::One(_)) {
                return New::Many;
            }
            found = New::One(copy);
        }
    }
    found
}

fn is_one_shot_listener(fd: impl AsFd) -> bool {
    let fd = fd.as_fd();
    let named_socket = getsockname(fd)
        .ok()
        .and_then(|addr| SocketAddrUnix::try_from(addr).ok())
        .and_then(|addr| addr.path().map(|p| p.to_bytes().ends_with(b"/socket")))
        .unwrap_or(false);
    named_socket
        && sockopt::socket_acceptconn(fd).unwrap_or(false)
        && sockopt::socket_type(fd).is_ok_and(|t| t == SocketType::SEQPACKET)
}
