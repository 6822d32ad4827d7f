//! The courier: one thread per process that sends what drop paths owe other processes
//! (revocations to subscribers; `Release`, `Forget` and relays' `Retain` records on lease
//! pipes), never waiting for a peer, so that no `drop` does (README.md, "Drops never wait for
//! a peer"). What a peer has no room for waits here, coalesced, while every other peer is
//! served. No release
//! overtakes the message that brought its claim (posted after it was received). If the thread
//! cannot be started, posts are sent on the caller's thread.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use super::lease::{self, Control, Revocation};
use super::table::{SubscriberEnd, owner};
use crate::fork::ForkLocal;
use crate::sys::Wait;

/// How often revocations that a subscriber's full socket refused are tried again.
const RETRY: Duration = Duration::from_millis(10);

/// How long a release that woke the courier waits for the ones after it: far below what a
/// block's reuse waits for anyway (the consumer's drop, its fence), far above the gap between
/// two drops of a consumer that keeps up with a stream.
const GATHER: Duration = Duration::from_micros(20);

/// Indices owed to one subscriber at most, in one message: past them, one
/// `Revocation::Recheck` stands for them all (the subscriber checks what it keeps of this
/// owner against the liveness table, whose slots were cleared before the indices were
/// posted). So a subscriber that stops reading costs its owner a few KiB, however many
/// storages the owner drops meanwhile.
const OWED_AT_MOST: usize = 512;

struct Courier {
    queue: Mutex<Queue>,
    posted: Condvar,
    /// Notified when the thread has sent what it took.
    sent: Condvar,
    started: OnceLock<bool>,
}

#[derive(Default)]
struct Queue {
    /// Per subscriber (by its number in the owner's list): its socket and what it has not
    /// been told of yet.
    revocations: BTreeMap<u64, (SubscriberEnd, Unsent)>,
    /// Records to send, in order, each with its lease: releases (the storage's index and how
    /// many claims), relays' retains, and requests to introduce a segment again.
    releases: Vec<(Arc<OwnedFd>, Control)>,
    /// Records that found their lease's pipe full, by lease (its owner stopped, or behind).
    parked: Vec<Owed>,
    /// True when some revocations or records wait for room in a peer's socket or pipe.
    blocked: bool,
    /// True while the thread sends what it took from the queue.
    sending: bool,
}

static COURIER: ForkLocal<Courier> = ForkLocal::new(|| Courier {
    queue: Mutex::new(Queue::default()),
    posted: Condvar::new(),
    sent: Condvar::new(),
    started: OnceLock::new(),
});

/// How long an exiting process waits for its releases: those behind fences (a stream that
/// never finishes) and those an owner does not read (stopped). Past it, it exits anyway; the
/// kernel then closes its leases, as at a kill.
const RELEASES_AT_EXIT: Duration = Duration::from_secs(if cfg!(test) { 3 } else { 60 });

/// Makes this process, when it exits (and in `before_exit`), wait for its releases: registered
/// once per generation when the courier starts, so that no process with a release in flight
/// leaves without it. (The exit hooks registered later, which run first, wait for them too
/// where they must: after a backlog's flush, and before the CUDA driver's own exit handlers
/// for releases behind fences.)
fn wait_for_releases_when_exiting() {
    static INSTALLED: ForkLocal<OnceLock<bool>> = ForkLocal::new(OnceLock::new);
    INSTALLED.get().get_or_init(|| crate::process::at_exit(releases_at_exit));
}

extern "C" fn releases_at_exit() {
    let _ = crate::os::catch_quietly(wait_for_releases_at_exit);
}

/// Waits for the releases at exit, for what is left of [`RELEASES_AT_EXIT`]: the waits of one
/// generation (every exit hook, a normal exit after `before_exit`, a forked child's copy of
/// its parent's hook) share the one minute, counted as they wait.
pub(crate) fn wait_for_releases_at_exit() -> bool {
    static WAITED: ForkLocal<Mutex<Duration>> = ForkLocal::new(Default::default);
    let waited = *WAITED.get().lock().unwrap_or_else(|p| p.into_inner());
    let started = std::time::Instant::now();
    let sent = wait_for_releases(Some(started + RELEASES_AT_EXIT.saturating_sub(waited)));
    *WAITED.get().lock().unwrap_or_else(|p| p.into_inner()) += started.elapsed();
    sent
}

/// Waits until every release that waits behind a fence is posted and every release posted so
/// far has been sent, until `deadline` at most; false when it passed first. (Revocations to a
/// subscriber that does not read may wait for ever: they only let it close cached mappings
/// sooner, so nothing waits for them.)
pub(crate) fn wait_for_releases(deadline: Option<std::time::Instant>) -> bool {
    let mut s = super::state();
    while s.deferred_releases > 0 {
        let Some(wait) = crate::os::wait_slice(deadline, RETRY) else { return false };
        s = super::wait(s, Some(wait));
    }
    drop(s);
    let courier = COURIER.get();
    let mut queue = lock(courier);
    while !queue.releases.is_empty() || !queue.parked.is_empty() || queue.sending {
        let Some(wait) = crate::os::wait_slice(deadline, RETRY) else { return false };
        queue = courier.sent.wait_timeout(queue, wait).unwrap_or_else(|p| p.into_inner()).0;
    }
    true
}

fn lock(courier: &Courier) -> MutexGuard<'_, Queue> {
    courier.queue.lock().unwrap_or_else(|p| p.into_inner())
}

/// The courier of this process, its thread started on first use; `None` if it cannot start.
fn courier() -> Option<&'static Courier> {
    let courier = COURIER.get();
    let started = *courier.started.get_or_init(|| {
        let started = std::thread::Builder::new().name("cuda-mp-courier".into()).spawn(move || run(courier)).is_ok();
        if started {
            wait_for_releases_when_exiting();
        }
        started
    });
    started.then_some(courier)
}

/// Tells `subscribers` that the owner dropped storage `index`, without waiting for any of them.
pub(super) fn revoke(subscribers: Vec<(u64, SubscriberEnd)>, index: u64) {
    if subscribers.is_empty() {
        return;
    }
    let Some(courier) = courier() else {
        let mut gone = Vec::new();
        for (n, tx) in &subscribers {
            if lease::send(tx, &Revocation::Storages(vec![index]), &[], Wait::Not).is_err() {
                gone.push(*n);
            }
        }
        forget(&gone);
        return;
    };
    let mut queue = lock(courier);
    for (n, tx) in subscribers {
        queue.revocations.entry(n).or_insert_with(|| (tx, Unsent::default())).1.add(index);
    }
    drop(queue);
    courier.posted.notify_one();
}

/// What one subscriber has not been told of yet: the storages dropped, oldest first, or,
/// past [`OWED_AT_MOST`] of them, to check everything against the table.
#[derive(Default)]
struct Unsent {
    indices: Vec<u64>,
    recheck: bool,
}

impl Unsent {
    fn add(&mut self, index: u64) {
        if !self.recheck {
            self.indices.push(index);
            self.bound();
        }
    }

    /// `newer` (posted while this waited for room) after this.
    fn append(&mut self, newer: Unsent) {
        self.recheck |= newer.recheck;
        if !self.recheck {
            self.indices.extend(newer.indices);
        }
        self.bound();
    }

    fn bound(&mut self) {
        if self.recheck || self.indices.len() > OWED_AT_MOST {
            self.indices = Vec::new();
            self.recheck = true;
        }
    }

    fn message(&self) -> Revocation {
        if self.recheck { Revocation::Recheck } else { Revocation::Storages(self.indices.clone()) }
    }
}

/// Sends `record` (a `Release`, a forwarder's `Retain` for its relay, or a `Forget` on a
/// connection lease) on the lease `tx`, without waiting for its owner.
pub(super) fn post(tx: Arc<OwnedFd>, record: Control) {
    let Some(courier) = courier() else {
        let _ = record.send(&*tx);
        return;
    };
    let mut queue = lock(courier);
    // Only the first release of a batch wakes the thread (a wake is a system call here and a
    // context switch there); the ones posted before it takes the batch go with it.
    let wake = queue.releases.is_empty() && !queue.sending;
    queue.releases.push((tx, record));
    drop(queue);
    if wake {
        courier.posted.notify_one();
    }
}

/// What this process owes one lease: per storage, the claims it released less those it
/// retained, summed (a holder that drops on while its owner does not read owes one record
/// per storage, however many drops), and the segments to introduce again. Order within a
/// lease does not matter here: every claim these release was counted before it was posted
/// (the owner counts a message's claims before it sends it), and a `Retain` (a forwarder's
/// claim for its relay) is posted while the claim it was made from is held, whose release
/// comes later through the same `Owed`: it is written first, or the two cancel out. So
/// writing a record later, or beside others of its lease, frees nothing early.
struct Owed {
    tx: Arc<OwnedFd>,
    /// Per storage, claims retained less claims released.
    claims: BTreeMap<u64, i128>,
    others: Vec<Control>,
}

impl Owed {
    fn new(tx: Arc<OwnedFd>) -> Owed {
        Owed { tx, claims: BTreeMap::new(), others: Vec::new() }
    }

    fn add(&mut self, control: Control) {
        match control {
            Control::Release(index, claims) => *self.claims.entry(index).or_default() -= i128::from(claims),
            Control::Retain(index) => *self.claims.entry(index).or_default() += 1,
            // A `Forget` asked again is asked once.
            other if self.others.contains(&other) => {}
            other => self.others.push(other),
        }
    }

    /// Writes what the pipe has room for, in writes of at most `PIPE_BUF` bytes (each whole,
    /// so records of other holders never cut in); true when nothing is left (or the owner is
    /// gone, and is owed nothing: its lease went with it). A try that finds no room costs one
    /// batch, however many storages wait.
    fn send(&mut self) -> bool {
        loop {
            let (mut batch, mut taken) = (Vec::new(), Vec::new());
            while let Some(next) = self.pop() {
                let Ok(record) = next.record() else { continue };
                if batch.len() + record.len() > crate::sys::RECORD_MAX {
                    if !batch.is_empty() {
                        self.add(next);
                        break;
                    }
                    // A record no write can carry (none of ours is): dropped.
                    continue;
                }
                batch.extend(record);
                taken.push(next);
            }
            if taken.is_empty() {
                return true;
            }
            match crate::sys::try_write_record(self.tx.as_fd(), &batch) {
                Ok(true) => {}
                Ok(false) => {
                    taken.into_iter().for_each(|c| self.add(c));
                    return false;
                }
                // The owner is gone, and its lease with it.
                Err(e) if e.kind() == io::ErrorKind::BrokenPipe => return true,
                // Short of kernel memory for now: tried again, as a full pipe is.
                Err(e) if e.kind() == io::ErrorKind::OutOfMemory => {
                    taken.into_iter().for_each(|c| self.add(c));
                    return false;
                }
                // A lease no write can reach (none of ours is): what it is owed goes with it.
                Err(_) => return true,
            }
        }
    }

    fn pop(&mut self) -> Option<Control> {
        while let Some((index, change)) = self.claims.pop_first() {
            match change {
                0 => continue,
                // One `Retain` a record: the rest wait for the next pop.
                1.. => {
                    if change > 1 {
                        self.claims.insert(index, change - 1);
                    }
                    return Some(Control::Retain(index));
                }
                _ => return Some(Control::Release(index, u64::try_from(-change).unwrap_or(u64::MAX))),
            }
        }
        self.others.pop()
    }
}

/// Writes `releases`, gathered by lease, and, when `retry`, what waits in `parked`. A lease
/// whose pipe is full keeps what it is owed in `parked`; later records of a parked lease join
/// it without a try of their own.
fn send_releases(parked: &mut Vec<Owed>, releases: Vec<(Arc<OwnedFd>, Control)>, retry: bool) {
    let waiting = parked.len();
    let mut by_lease: HashMap<*const OwnedFd, usize> =
        parked.iter().enumerate().map(|(at, owed)| (Arc::as_ptr(&owed.tx), at)).collect();
    for (tx, control) in releases {
        let at = *by_lease.entry(Arc::as_ptr(&tx)).or_insert_with(|| {
            parked.push(Owed::new(tx));
            parked.len() - 1
        });
        parked[at].add(control);
    }
    let mut at = 0;
    parked.retain_mut(|owed| {
        let due = retry || at >= waiting;
        at += 1;
        !(due && owed.send())
    });
}

/// Subscribers that are gone leave the owner's list.
fn forget(gone: &[u64]) {
    if !gone.is_empty() {
        owner().subscribers.retain(|(n, _)| !gone.contains(n));
    }
}

fn run(courier: &'static Courier) {
    // When parked records are tried again: every `RETRY`, however often posts wake the thread.
    let mut retry_parked = std::time::Instant::now();
    loop {
        let taken = {
            let mut queue = lock(courier);
            while queue.releases.is_empty() && queue.revocations.is_empty() && queue.parked.is_empty() {
                queue = courier.posted.wait(queue).unwrap_or_else(|p| p.into_inner());
            }
            if queue.releases.len() == 1 && queue.revocations.is_empty() {
                // A lone release that woke the thread: the next drops of a stream of them
                // (a consumer dropping each tensor it receives) come within microseconds, and
                // one write then carries them all, so the owner's reaper also wakes once.
                drop(queue);
                std::thread::sleep(GATHER);
                queue = lock(courier);
            }
            if queue.releases.is_empty() && queue.blocked {
                // Only what found no room last time: give the readers a moment (a new post
                // ends the wait early).
                queue = courier.posted.wait_timeout(queue, RETRY).unwrap_or_else(|p| p.into_inner()).0;
            }
            queue.blocked = false;
            queue.sending = true;
            (
                std::mem::take(&mut queue.parked),
                std::mem::take(&mut queue.releases),
                std::mem::take(&mut queue.revocations),
            )
        };
        let (mut parked, releases, revocations) = taken;
        let retry = std::time::Instant::now() >= retry_parked;
        send_releases(&mut parked, releases, retry);
        if retry && !parked.is_empty() {
            retry_parked = std::time::Instant::now() + RETRY;
        }
        let mut gone = Vec::new();
        let mut waiting = Vec::new();
        for (n, (tx, unsent)) in revocations {
            match lease::send(&tx, &unsent.message(), &[], Wait::Not) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => waiting.push((n, tx, unsent)),
                Err(_) => gone.push(n),
            }
        }
        let mut queue = lock(courier);
        queue.blocked = !parked.is_empty();
        queue.parked = parked;
        if !waiting.is_empty() {
            for (n, tx, mut older) in waiting {
                // Older indices first; posts that came meanwhile after them.
                let entry = queue.revocations.entry(n).or_insert_with(|| (tx, Unsent::default()));
                older.append(std::mem::take(&mut entry.1));
                entry.1 = older;
            }
            queue.blocked = true;
        }
        queue.sending = false;
        drop(queue);
        forget(&gone);
        courier.sent.notify_all();
    }
}

/// Work that must not run on the reaper thread: frees and unmaps (a GPU free first waits for
/// the device's stream). One more thread, so that a free waits neither for the reaper nor for
/// a send of the courier's, and the reaper keeps reading leases meanwhile.
#[derive(Default)]
struct Disposer {
    jobs: Mutex<Vec<Job>>,
    posted: Condvar,
    started: OnceLock<bool>,
}

type Job = Box<dyn FnOnce() + Send>;

static DISPOSER: ForkLocal<Disposer> = ForkLocal::new(Default::default);

/// The fetches of subscriptions holders ask for (`Link`): a thread of their own, so that a
/// home that does not answer holds up no free.
static LINKER: ForkLocal<Disposer> = ForkLocal::new(Default::default);

/// The `Link`s waiting for the linker, by lease: a lease's holders (a storage shared with many
/// processes shares its lease) subscribe at once, but one lease queues at most
/// [`LINKS_PER_LEASE`].
static LINKING: ForkLocal<Mutex<std::collections::HashMap<u64, usize>>> = ForkLocal::new(Default::default);

/// `Link`s of one lease waiting for the linker at most; past them, a lease's `Link`s are dropped.
const LINKS_PER_LEASE: usize = 64;

std::thread_local! {
    /// True on the reaper's thread.
    static ON_REAPER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the calling thread as the reaper's.
pub(super) fn this_is_the_reaper() {
    ON_REAPER.with(|r| r.set(true));
}

/// Runs `job` (a free, an unmap) now, or on the disposer's thread when called on the reaper's.
pub(super) fn dispose(job: impl FnOnce() + Send + 'static) {
    if !ON_REAPER.with(|r| r.get()) {
        return job();
    }
    if let Err(job) = queue_job(DISPOSER.get(), "cuda-mp-disposer", Box::new(job)) {
        job();
    }
}

/// Runs `fetch`, the fetch of a subscription that a holder asked for on lease `key` (a `Link`),
/// on the linker's thread (on the disposer's if it cannot start); a lease queues at most
/// [`LINKS_PER_LEASE`] (README.md, "States of a storage").
pub(super) fn link(key: u64, fetch: impl FnOnce() + Send + 'static) {
    let linking = || LINKING.get().lock().unwrap_or_else(|p| p.into_inner());
    {
        let mut waiting = linking();
        let queued = waiting.entry(key).or_default();
        if *queued >= LINKS_PER_LEASE {
            return;
        }
        *queued += 1;
    }
    /// Counts the fetch out however it ends (a panic in it included).
    struct Linked(u64);
    impl Drop for Linked {
        fn drop(&mut self) {
            let mut waiting = LINKING.get().lock().unwrap_or_else(|p| p.into_inner());
            if let Some(queued) = waiting.get_mut(&self.0) {
                *queued -= 1;
                if *queued == 0 {
                    waiting.remove(&self.0);
                }
            }
        }
    }
    let linked = Linked(key);
    let job: Job = Box::new(move || {
        let _linked = linked;
        fetch();
    });
    if let Err(job) = queue_job(LINKER.get(), "cuda-mp-linker", job) {
        dispose(job);
    }
}

/// Queues `job` for `worker`'s thread (started on first use); the job back if it cannot start.
fn queue_job(worker: &'static Disposer, name: &str, job: Job) -> Result<(), Job> {
    let started = *worker
        .started
        .get_or_init(|| std::thread::Builder::new().name(name.into()).spawn(move || run_jobs(worker)).is_ok());
    if !started {
        return Err(job);
    }
    worker.jobs.lock().unwrap_or_else(|p| p.into_inner()).push(job);
    worker.posted.notify_one();
    Ok(())
}

fn run_jobs(disposer: &'static Disposer) {
    loop {
        let jobs = {
            let mut jobs = disposer.jobs.lock().unwrap_or_else(|p| p.into_inner());
            while jobs.is_empty() {
                jobs = disposer.posted.wait(jobs).unwrap_or_else(|p| p.into_inner());
            }
            std::mem::take(&mut *jobs)
        };
        for job in jobs {
            // A panic in one free (a storage kind's bug) must not end the thread that runs
            // every later one.
            let _ = crate::os::catch_quietly(job);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::{lease_pipe, read_available, try_write_record};
    use std::time::Instant;

    /// Reads `rx` until `want` records of claims on storages below `u64::MAX` (the filler's
    /// index) have come, or 10 s have passed.
    fn read_releases(rx: &OwnedFd, want: usize) -> Vec<Control> {
        let (mut got, mut pending, mut buf) = (Vec::new(), Vec::new(), vec![0u8; 1 << 16]);
        let until = Instant::now() + Duration::from_secs(10);
        while got.len() < want && Instant::now() < until {
            match read_available(rx, &mut buf).unwrap() {
                Some(0) => std::thread::sleep(Duration::from_millis(1)),
                Some(n) => {
                    pending.extend_from_slice(&buf[..n]);
                    let (records, used, stray) = Control::parse(&pending);
                    assert!(!stray);
                    pending.drain(..used);
                    got.extend(records.into_iter().filter(|c| !matches!(c, Control::Release(u64::MAX, _))));
                }
                None => break,
            }
        }
        got
    }

    /// A lease pipe whose owner has not read what other holders wrote: full (the filler's
    /// records name storage `u64::MAX`, which `read_releases` skips).
    fn full_lease_pipe() -> (OwnedFd, Arc<OwnedFd>) {
        let (rx, tx) = lease_pipe().unwrap();
        let filler = Control::Release(u64::MAX, 1).record().unwrap();
        while try_write_record(tx.as_fd(), &filler).unwrap() {}
        (rx, Arc::new(tx))
    }

    /// An owner that does not read (stopped) has a full lease pipe: the releases it is owed
    /// (20,000 storages) wait in the courier, one record per storage however many drops, while
    /// another owner's go out at once; once it reads again, it gets them all.
    #[test]
    fn releases_to_an_owner_that_does_not_read_wait_without_holding_up_the_others() {
        let (stopped_rx, stopped_tx) = full_lease_pipe();
        let (other_rx, other_tx) = lease_pipe().unwrap();
        let other_tx = Arc::new(other_tx);
        for _ in 0..3 {
            for index in 1..=1000 {
                post(stopped_tx.clone(), Control::Release(index, 1));
            }
        }
        for index in 1001..=20_000 {
            post(stopped_tx.clone(), Control::Release(index, 1));
        }
        post(stopped_tx.clone(), Control::Forget(5));
        let posted = Instant::now();
        post(other_tx.clone(), Control::Release(7, 2));
        assert_eq!(read_releases(&other_rx, 1), [Control::Release(7, 2)]);
        assert!(posted.elapsed() < Duration::from_secs(5), "the other owner waited {:?}", posted.elapsed());
        assert!(!wait_for_releases(Some(Instant::now() + Duration::from_millis(100))), "the stopped owner's are owed");
        // The owner reads again.
        let got = read_releases(&stopped_rx, 20_001);
        let mut want: Vec<Control> = (1..=20_000).map(|i| Control::Release(i, if i <= 1000 { 3 } else { 1 })).collect();
        want.push(Control::Forget(5));
        assert!(got == want, "each storage's releases in one record, then the forget: {} records", got.len());
        assert!(wait_for_releases(Some(Instant::now() + Duration::from_secs(10))));
    }

    /// A process that only received and dropped (no backlog of its own, no release behind a
    /// fence: a Python worker that leaves with `os._exit` after its finalizers) still sends
    /// what it owes a slow owner in `before_exit`, before it leaves.
    #[test]
    fn before_exit_waits_for_releases_an_owner_reads_late() {
        let sent = crate::sys::fork_and_run(|| {
            let (rx, tx) = full_lease_pipe();
            post(tx.clone(), Control::Release(1, 1));
            // The owner reads from 100 ms on.
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                let mut buf = vec![0u8; 1 << 16];
                while read_available(&rx, &mut buf).is_ok() {
                    std::thread::sleep(Duration::from_millis(1));
                }
            });
            crate::process::before_exit();
            wait_for_releases(Some(Instant::now()))
        })
        .unwrap();
        assert!(sent, "before_exit returned with the release still owed");
    }

    /// The waits of one exit share their minute: once one ran out (an owner that never reads),
    /// the other exit hooks, and a normal exit after `before_exit`, do not wait again.
    #[test]
    fn once_a_wait_at_exit_ran_out_the_next_ones_do_not_wait() {
        let ok = crate::sys::fork_and_run(|| {
            let (_unread, tx) = full_lease_pipe();
            post(tx, Control::Release(1, 1));
            let started = Instant::now();
            let first = wait_for_releases_at_exit();
            let first_took = started.elapsed();
            let started = Instant::now();
            crate::process::before_exit();
            !first && first_took >= RELEASES_AT_EXIT && started.elapsed() < Duration::from_millis(300)
        })
        .unwrap();
        assert!(ok, "a wait at exit waited again after one ran out, or the first did not wait");
    }

    /// A forwarder's `Retain` waits like a release when its owner does not read, and cancels
    /// against a release of the same storage owed meanwhile: the owner gets the difference.
    #[test]
    fn retains_and_releases_owed_on_one_lease_are_written_as_their_difference() {
        let (rx, tx) = full_lease_pipe();
        for record in [
            Control::Retain(5),
            Control::Release(5, 1),
            Control::Retain(6),
            Control::Retain(6),
            Control::Release(7, 1),
            Control::Retain(7),
            Control::Release(7, 3),
        ] {
            post(tx.clone(), record);
        }
        assert!(!wait_for_releases(Some(Instant::now() + Duration::from_millis(50))), "the pipe is full");
        let got = read_releases(&rx, 3);
        assert_eq!(got, [Control::Retain(6), Control::Retain(6), Control::Release(7, 3)]);
        assert!(wait_for_releases(Some(Instant::now() + Duration::from_secs(10))));
    }

    /// A subscriber that does not read is owed at most one message: past [`OWED_AT_MOST`]
    /// storages dropped, one `Recheck` stands for them all. Once it reads again it gets that,
    /// and the storages dropped after it one by one again.
    #[test]
    fn revocations_owed_to_a_subscriber_that_does_not_read_stay_bounded() {
        use crate::sys::Socket;
        const N: u64 = u64::MAX - 7;
        let (ours, theirs) = Socket::pair().unwrap();
        let filler = Revocation::Storages(vec![0]);
        let mut fillers = 0;
        while lease::send(&ours, &filler, &[], Wait::Not).is_ok() {
            fillers += 1;
        }
        let ours: SubscriberEnd = Arc::new(crate::fork::NotInherited::new(ours));
        for index in 1..=20_000 {
            revoke(vec![(N, ours.clone())], index);
        }
        let owed = || lock(COURIER.get()).revocations.get(&N).map(|(_, unsent)| (unsent.recheck, unsent.indices.len()));
        let deadline = Instant::now() + Duration::from_secs(10);
        while owed() != Some((true, 0)) {
            assert!(Instant::now() < deadline, "never collapsed into a recheck: {:?}", owed());
            std::thread::sleep(Duration::from_millis(1));
        }
        // The subscriber reads again: `want` messages (10 s at most), then whatever follows
        // within 100 ms.
        let read = |want: usize| {
            let mut got = Vec::new();
            let mut until = Instant::now() + Duration::from_secs(10);
            while let Ok(Some(message)) = theirs.recv(lease::MESSAGE_BYTES, Wait::Until(until)) {
                got.push(postcard::from_bytes::<Revocation>(&message.bytes).unwrap());
                if got.len() == want {
                    until = Instant::now() + Duration::from_millis(100);
                }
            }
            got
        };
        let got = read(fillers + 1);
        assert_eq!(got.len(), fillers + 1, "the fillers, then what it is owed, in one message");
        assert!(matches!(got.last(), Some(Revocation::Recheck)), "{:?}", got.last());
        revoke(vec![(N, ours.clone())], 20_001);
        let got = read(1);
        assert!(matches!(&got[..], [Revocation::Storages(i)] if i == &[20_001]), "{got:?}");
    }

    /// A lease whose owner is gone takes nothing, and holds up nothing.
    #[test]
    fn releases_to_an_owner_that_is_gone_are_dropped() {
        let (rx, tx) = lease_pipe().unwrap();
        drop(rx);
        post(Arc::new(tx), Control::Release(1, 1));
        assert!(wait_for_releases(Some(Instant::now() + Duration::from_secs(10))));
    }
}
