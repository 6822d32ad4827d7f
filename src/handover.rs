//! How the descriptors of spawn arguments and results, and of values as bytes
//! ([`crate::to_bytes`], [`crate::HandoffBatch`]), cross: procspawn and the caller's own byte
//! pipes carry only bytes, so the process that encodes them deposits them here, under a fresh
//! 128-bit secret, and the process that decodes them fetches them from this process's **home**:
//! a listener socket with an abstract name (no file; it goes with the process), served by one
//! thread, started on first use. The place of each descriptor in the bytes says where it waits
//! ([`SpawnTicket`]: the home's name and the secret). Who deposits what and when it goes
//! (arguments at [`withdraw`] or after [`ARGUMENT_TTL`], results waited for at exit while the
//! parent lives, batches handed out once sealed): `docs/architecture.md`.
//!
//! Each side checks the other's credentials (`SO_PEERCRED`: a process of another user gets
//! nothing) when they connect. A fetcher keeps its connection to a home for its next fetch
//! there (one exchange, about 9 us on a 2-cpu machine, against 50 for a connection) until it
//! has gone unused for a second or that home closed it (its own home's thread watches those
//! connections and closes them then); a home answers at most 256 kept connections, the oldest
//! closed beyond. A fetch whose kept connection the home closed asks again on a fresh one: a
//! home answers before it closes, so a request on a closed connection was not taken.
//!
//! The serving thread wakes for the first deposit (or kept batch) to expire (one that expires
//! earlier wakes it, by its bell), and one that expired is never handed out. After serving a
//! connection it keeps a timer for a second even with nothing to expire, so that a stream of
//! handoffs costs no wake per deposit (that was 26 us of an encode's 28 on a 2-cpu machine).
//! Lock order: the deposits, then what is kept, then the wake time; the kept connections' lock
//! is taken alone.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::fork::{ForkLocal, NotInherited};
use crate::sys::{Listening, Socket, Wait};

use crate::sys::{Held, borrow_all};
use serde::{Deserialize, Serialize};

/// How long a deposit of spawn arguments waits for its child.
pub(crate) const ARGUMENT_TTL: Duration = Duration::from_secs(120);

/// How long a revocation subscription waits at its subscriber's home for the owner's fetch:
/// an owner that is there fetches it within milliseconds; one that died first never will,
/// and its subscriber learns so when the deposit is dropped.
pub(crate) const SUBSCRIPTION_TTL: Duration = Duration::from_secs(1);

/// How long the serving thread keeps a timer after a connection when nothing waits to expire,
/// so that the deposits of a stream of handoffs need not wake it one by one (see `serve`).
const LINGER: Duration = Duration::from_secs(1);

/// Connections of fetchers a home keeps open at most (beyond, the oldest is closed: its
/// fetcher connects again).
const MAX_PEERS: usize = 256;

/// Connections to homes a process keeps at most (beyond, it closes them all and starts over).
const MAX_LINKS: usize = 64;

/// How long a process keeps a connection to another home unused.
const LINK_IDLE: Duration = Duration::from_secs(1);

/// How long a fetch waits for the home's answer.
const FETCH_WAIT: Duration = Duration::from_secs(30);
/// Connections the serving thread takes in at most per turn (the listener's backlog).
const ACCEPTS_PER_TURN: usize = 64;

/// How often a process at exit looks whether its results were fetched (or its parent died).
const EXIT_SLICE: Duration = Duration::from_millis(50);

/// Where the decoder of a spawn's values (or of a subscription) fetches their descriptors: the
/// abstract socket name of the encoding process's home, and the secret that names them there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SpawnTicket {
    pub(crate) home: String,
    pub(crate) token: u128,
    /// For a batch of values: the seconds its decoder keeps the descriptors that the values it
    /// has not decoded yet will take (the encoder's time).
    pub(crate) batch: Option<u32>,
}

struct Deposit {
    fds: Vec<Held>,
    /// `Some(deadline)` for arguments; results wait for ever.
    expires: Option<Instant>,
    /// False while a batch is still being filled: not handed out yet.
    sealed: bool,
}

/// What this process fetched of a batch and its values not yet decoded will take (each index
/// once: `None` once taken), until the batch's time is up.
struct Kept {
    fds: Vec<Option<OwnedFd>>,
    /// How many of `fds` are not taken yet.
    left: usize,
    until: Instant,
}

struct Home {
    /// The home's abstract socket name.
    name: String,
    deposits: Mutex<HashMap<u128, Deposit>>,
    /// Batches fetched from other homes (or this one), by their home's name and token.
    kept: Mutex<HashMap<(String, u128), Kept>>,
    fetched: Condvar,
    /// When the serving thread wakes next to drop expired deposits (`None`: only for a fetch).
    wakes: Mutex<Option<Instant>>,
    /// Rung when this process keeps a new connection to another home, so that the serving
    /// thread watches it too (and closes it as soon as that home is gone).
    bell: NotInherited<OwnedFd>,
    /// Fetches under way on this process's threads: each has taken its kept connection out of
    /// the map, and puts it back without ringing, so the serving thread must look again.
    fetching: AtomicUsize,
}

/// This process's home (a forked child makes its own), once one started.
static HOME: ForkLocal<OnceLock<Home>> = ForkLocal::new(OnceLock::new);

/// Held while a home starts: one at a time, so that a process never runs two.
static STARTING: ForkLocal<Mutex<()>> = ForkLocal::new(|| Mutex::new(()));

/// This process's home, started at the first call. A start that fails (out of descriptors or
/// threads for a moment) is tried again at the next call: it used to fail every later one.
fn home() -> Result<&'static Home> {
    let cell = HOME.get();
    if let Some(home) = cell.get() {
        return Ok(home);
    }
    let _starting = STARTING.get().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(home) = cell.get() {
        return Ok(home);
    }
    let home =
        start().map_err(|e| Error::Io(io::Error::new(e.kind(), format!("cannot serve spawn descriptors: {e}"))))?;
    Ok(cell.get_or_init(|| home))
}

fn start() -> io::Result<Home> {
    // An abstract name: nothing is left behind when the process ends, however it ends.
    let name = format!("cuda-mp-home-{:032x}", crate::sys::random_u128());
    // Neither the listener nor the connections it takes stay open in a forked child: they
    // would keep this process's peers waiting on the child after this process is gone.
    let listening = NotInherited::new(Listening::bind_abstract(&name)?);
    let bell = NotInherited::new(crate::sys::bell()?);
    std::thread::Builder::new().name("cuda-mp-handover".into()).spawn(move || serve(listening))?;
    crate::process::at_exit(wait_at_exit_hook);
    Ok(Home {
        name,
        deposits: Mutex::new(HashMap::new()),
        kept: Mutex::new(HashMap::new()),
        fetched: Condvar::new(),
        wakes: Mutex::new(None),
        bell,
        fetching: AtomicUsize::new(0),
    })
}

fn lock(home: &Home) -> MutexGuard<'_, HashMap<u128, Deposit>> {
    home.deposits.lock().unwrap_or_else(|p| p.into_inner())
}

/// Drops what waits at this process's home under `ticket`, unfetched: the child it was for
/// ended (killed, say) before it fetched its arguments, and the claims they hold go now rather
/// than after [`ARGUMENT_TTL`]. Nothing happens when they were fetched.
pub(crate) fn withdraw(ticket: &SpawnTicket) {
    let Ok(home) = home() else { return };
    if home.name != ticket.home {
        return;
    }
    let deposit = lock(home).remove(&ticket.token);
    // Dropped outside the lock: closing them may release claims.
    drop(deposit);
}

/// A fresh ticket at this process's home.
pub(crate) fn ticket() -> Result<SpawnTicket> {
    let home = home()?;
    Ok(SpawnTicket { home: home.name.clone(), token: crate::sys::random_u128(), batch: None })
}

/// A fresh ticket for a batch of values, whose deposit waits (empty, not handed out) until it
/// is sealed ([`seal`]) or `ttl` is up.
pub(crate) fn batch_ticket(ttl: Duration) -> Result<SpawnTicket> {
    let home = home()?;
    let seconds = u32::try_from(ttl.as_secs().max(1)).unwrap_or(u32::MAX);
    let ticket = SpawnTicket { home: home.name.clone(), token: crate::sys::random_u128(), batch: Some(seconds) };
    let expires =
        Instant::now().checked_add(ttl).unwrap_or_else(|| Instant::now() + Duration::from_secs(u32::MAX.into()));
    let mut deposits = lock(home);
    deposits.insert(ticket.token, Deposit { fds: Vec::new(), expires: Some(expires), sealed: false });
    let wake = wakes_later(home, expires);
    drop(deposits);
    if wake {
        crate::sys::ring(&home.bell);
    }
    Ok(ticket)
}

/// Seals the batch deposit of `ticket`: from now on its decoder may fetch it. False when it is
/// gone (its time was up).
pub(crate) fn seal(ticket: &SpawnTicket) -> bool {
    let Ok(home) = home() else { return false };
    let mut deposits = lock(home);
    match deposits.get_mut(&ticket.token) {
        // Not one whose time is up that the serving thread has not dropped yet: its fetch
        // would be refused.
        Some(d) if d.expires.is_none_or(|e| e > Instant::now()) => {
            d.sealed = true;
            true
        }
        Some(_) => {
            let expired = deposits.remove(&ticket.token);
            drop(deposits);
            drop(expired);
            false
        }
        None => false,
    }
}

/// Adds `fd` to what waits at this process's home under `ticket` (made by [`ticket`]) until it
/// is fetched or `ttl` is up, and returns its index there. `first`: the ticket's first
/// descriptor. A later one whose deposit's time is up already fails: it would
/// start a new deposit, numbered from 0 again, that the value's earlier indices do not match.
pub(crate) fn append_expiring(ticket: &SpawnTicket, fd: Held, ttl: Duration, first: bool) -> Result<u32> {
    deposit(ticket, fd, Some(ttl), first)
}

fn lock_kept(home: &Home) -> MutexGuard<'_, HashMap<(String, u128), Kept>> {
    home.kept.lock().unwrap_or_else(|p| p.into_inner())
}

/// Drops every deposit whose time is up, and what was kept of batches whose time is up: their
/// descriptors close now, not at the next deposit.
pub(crate) fn expire() {
    let Ok(home) = home() else { return };
    let now = Instant::now();
    let expired: (Vec<_>, Vec<_>) = {
        let mut deposits = lock(home);
        let kept = lock_kept(home).extract_if(|_, k| k.until <= now).collect();
        (deposits.extract_if(|_, d| d.expires.is_some_and(|e| e <= now)).collect(), kept)
    };
    // Closed outside the locks.
    drop(expired);
}

/// Keeps what this process fetched of the batch of `ticket` and did not take yet (`None`:
/// taken), for the values of the batch it has not decoded yet, until the batch's time is up.
pub(crate) fn keep(ticket: &SpawnTicket, fds: Vec<Option<OwnedFd>>, left: usize, until: Instant) {
    if ticket.batch.is_none() || left == 0 || until <= Instant::now() {
        return;
    }
    let Ok(home) = home() else { return };
    let deposits = lock(home);
    let replaced = lock_kept(home).insert((ticket.home.clone(), ticket.token), Kept { fds, left, until });
    let wake = wakes_later(home, until);
    drop(deposits);
    drop(replaced);
    if wake {
        crate::sys::ring(&home.bell);
    }
}

/// What this process keeps of the batch of `ticket` and until when (taken out: [`keep`] puts
/// back what is left), if it fetched the batch before and its time is not up.
pub(crate) fn kept(ticket: &SpawnTicket) -> Option<(Vec<Option<OwnedFd>>, usize, Instant)> {
    let home = home().ok()?;
    let kept = lock_kept(home).remove(&(ticket.home.clone(), ticket.token))?;
    (kept.until > Instant::now()).then_some((kept.fds, kept.left, kept.until))
}

/// Until when a decoder keeps what it fetched of the batch of `ticket` for the values it has
/// not decoded yet: the batch's time as the ticket says it, but never past the time the
/// deposit had left at its home (`left`, from the home's answer), so that bytes whose ticket
/// was edited to ask for years keep nothing longer than the encoder meant.
pub(crate) fn keep_until(ticket: &SpawnTicket, left: Option<Duration>) -> Instant {
    let said = Duration::from_secs(ticket.batch.unwrap_or(0).into());
    let now = Instant::now();
    now.checked_add(left.map_or(said, |left| left.min(said))).unwrap_or(now)
}

fn deposit(ticket: &SpawnTicket, fd: Held, ttl: Option<Duration>, first: bool) -> Result<u32> {
    let home = home()?;
    let mut deposits = lock(home);
    let now = Instant::now();
    deposits.retain(|_, d| d.expires.is_none_or(|e| e > now));
    let expires = ttl.map(|ttl| now.checked_add(ttl).unwrap_or_else(|| crate::os::instant_after(ttl)));
    let deposit = match deposits.entry(ticket.token) {
        Entry::Occupied(batch) if ticket.batch.is_some() && batch.get().sealed => {
            return Err(Error::Unsupported("a value was added to a batch after it was sealed".into()));
        }
        Entry::Occupied(deposit) => deposit.into_mut(),
        Entry::Vacant(_) if ticket.batch.is_some() => {
            return Err(Error::Unsupported("a value was added to a batch whose time was up".into()));
        }
        Entry::Vacant(_) if !first => {
            return Err(Error::Unsupported(format!(
                "the value's time ({:?}) was up before it was encoded whole",
                ttl.unwrap_or_default()
            )));
        }
        Entry::Vacant(v) => v.insert(Deposit { fds: Vec::new(), expires, sealed: true }),
    };
    deposit.fds.push(fd);
    let index = deposit.fds.len() as u32 - 1;
    let wake = deposit.expires.is_some_and(|e| wakes_later(home, e));
    drop(deposits);
    if wake {
        crate::sys::ring(&home.bell);
    }
    Ok(index)
}

/// Whether the serving thread next wakes after `expires` (or only for a fetch): then the
/// caller wakes it (its bell), so that a deposit's claims go when its
/// time is up, not at the next deposit. Called under the deposits' lock, under which the thread
/// sets its wake.
fn wakes_later(home: &Home, expires: Instant) -> bool {
    home.wakes.lock().unwrap_or_else(|p| p.into_inner()).is_none_or(|w| expires < w)
}

/// How many deposits wait for a fetch that may never come (those that expire).
pub(crate) fn expiring_deposits() -> usize {
    home().map_or(0, |home| {
        let now = Instant::now();
        let mut deposits = lock(home);
        deposits.retain(|_, d| d.expires.is_none_or(|e| e > now));
        deposits.values().filter(|d| d.expires.is_some()).count()
    })
}

fn serve(listening: NotInherited<Listening>) {
    // Connections of fetchers, kept for their next requests, oldest first.
    let mut peers: VecDeque<NotInherited<Socket>> = VecDeque::new();
    // Whether the last wake was the timer's rather than a connection's.
    let mut timed_out = false;
    loop {
        let Ok(home) = home() else { return };
        // Until a request or `next_wake` (a millisecond after, so that what expires has).
        let next = next_wake(home, timed_out);
        let wait = next.map_or(Wait::Forever, |e| Wait::Until(e + Duration::from_millis(1)));
        // This process's kept connections to other homes are watched too, for their home's
        // close (not for answers: those are read by their fetch).
        let watched: Vec<Arc<Link>> = links().values().map(|(link, _)| link.clone()).collect();
        let (served, closed) = {
            let fds: Vec<BorrowedFd<'_>> =
                [listening.as_fd(), home.bell.as_fd()].into_iter().chain(peers.iter().map(|p| p.as_fd())).collect();
            let links: Vec<BorrowedFd<'_>> = watched.iter().map(|l| l.as_fd()).collect();
            match crate::sys::wait_readable_or_closed(&fds, &links, wait) {
                Ok(ready) => ready,
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            }
        };
        for (link, _) in watched.iter().zip(&closed).filter(|(_, c)| **c) {
            close_link(link);
        }
        if served[1] {
            crate::sys::silence(&home.bell);
        }
        if !served.contains(&true) && !closed.contains(&true) {
            timed_out = true;
            expire();
            continue;
        }
        timed_out = false;
        // From the last, so that a peer dropped leaves the others' places as `served` has them.
        for at in (0..peers.len()).rev() {
            if served[at + 2] && !answer(home, &peers[at]) {
                peers.remove(at);
            }
        }
        // Every connection waiting, up to a turn's worth: peers of another user that fill the
        // backlog are refused all at once, not one a turn while this user's fetches wait.
        for _ in 0..ACCEPTS_PER_TURN {
            if !served[0] {
                break;
            }
            match listening.accept(Wait::Not) {
                Ok(socket) => {
                    // Its request is answered at the next turn.
                    if peers.len() >= MAX_PEERS {
                        peers.pop_front();
                    }
                    peers.push_back(NotInherited::new(socket));
                }
                // A peer of another user, refused (and closed) at once.
                Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {}
                // Nothing more.
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                // Out of descriptors, say: the listener stays readable, so do not poll it
                // again at once.
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(10));
                    break;
                }
            }
        }
        home.fetched.notify_all();
    }
}

/// When the serving thread wakes next (`None`: only for a connection or the bell), and so that
/// a deposit made meanwhile need not wake it, it says so in `home.wakes`: the first deposit's
/// or kept batch's expiry, the first kept connection's idleness (those idle are closed now), a
/// second from now while a fetch has its connection out of the map (it puts it back without
/// ringing), else `LINGER` from now unless the last wake was this timer's.
fn next_wake(home: &Home, timed_out: bool) -> Option<Instant> {
    let link = close_idle_links(Instant::now());
    let deposits = lock(home);
    let kept = lock_kept(home).values().map(|k| k.until).min();
    let fetching = (home.fetching.load(Ordering::SeqCst) > 0).then(|| Instant::now() + LINK_IDLE);
    let next = deposits.values().filter_map(|d| d.expires).chain(kept).chain(link).chain(fetching).min();
    let next = next.or_else(|| (!timed_out).then(|| Instant::now() + LINGER));
    *home.wakes.lock().unwrap_or_else(|p| p.into_inner()) = next;
    next
}

/// Answers the request waiting on `socket`, if any; false when the connection is to be dropped
/// (its fetcher closed it, or sent what is not a request).
fn answer(home: &Home, socket: &Socket) -> bool {
    let request = match socket.recv(16, Wait::Not) {
        Ok(Some(request)) => request,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
        Ok(None) | Err(_) => return false,
    };
    let Ok(token) = <[u8; 16]>::try_from(&request.bytes[..]).map(u128::from_le_bytes) else { return false };
    let now = Instant::now();
    // An expired deposit is not handed out, even before it is dropped; a batch still being
    // filled is not handed out yet, and stays.
    let deposit = {
        let mut deposits = lock(home);
        deposits.get(&token).is_some_and(|d| d.sealed).then(|| deposits.remove(&token)).flatten()
    }
    .filter(|d| d.expires.is_none_or(|e| e > now));
    let sent = match &deposit {
        Some(d) => {
            // With the time the deposit had left (milliseconds; all ones: no limit).
            let left = d
                .expires
                .map_or(u64::MAX, |e| u64::try_from(e.saturating_duration_since(now).as_millis()).unwrap_or(u64::MAX));
            let answer: [&[u8]; 2] = [b"ok", &left.to_le_bytes()];
            #[cfg(test)]
            if REFUSE_ANSWERS.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
                return answer_failed(home, token, deposit, &io::Error::from(io::ErrorKind::OutOfMemory));
            }
            socket.send(&answer, &borrow_all(&d.fds), Wait::Until(Instant::now() + FETCH_WAIT))
        }
        None => socket.send(&[b"no"], &[], Wait::Not),
    };
    if let Err(e) = sent {
        return answer_failed(home, token, deposit, &e);
    }
    // Dropped only now: the descriptors are in flight.
    drop(deposit);
    true
}

/// An answer that could not be sent (its descriptors past what may be in flight, the fetcher
/// not reading): nothing of it arrived (a packet arrives whole or not at all), so the deposit
/// waits again for the fetcher's request on a fresh connection (it asks again once when the
/// home closes one unanswered), [`FETCH_WAIT`] at most. It was lost, and the retry told
/// "taken before". A fetcher that is gone asks nothing more: its deposit goes. False: the
/// connection is closed.
fn answer_failed(home: &Home, token: u128, deposit: Option<Deposit>, e: &io::Error) -> bool {
    if let Some(mut deposit) = deposit
        && !crate::sys::is_disconnect(e)
    {
        let retry_until = crate::os::instant_after(FETCH_WAIT);
        deposit.expires = Some(deposit.expires.map_or(retry_until, |e| e.min(retry_until)));
        let mut deposits = lock(home);
        deposits.insert(token, deposit);
        let wake = wakes_later(home, retry_until);
        drop(deposits);
        if wake {
            crate::sys::ring(&home.bell);
        }
    }
    false
}

/// For a test: how many answers with a deposit to fail as if they could not be sent.
#[cfg(test)]
static REFUSE_ANSWERS: AtomicUsize = AtomicUsize::new(0);

/// A connection this process keeps to another home (a forked child does not keep it open:
/// that home's thread would keep answering the child's copy).
type Link = NotInherited<Socket>;

/// Connections to the homes this process fetched from, by name, with their last use, kept for
/// the next fetch: a connection costs more than the exchange on it (about 50 against 9 us on a
/// 2-cpu machine). This process's serving thread closes those unused for [`LINK_IDLE`] (a
/// home that is gone among them). A forked child starts with none.
fn links() -> MutexGuard<'static, HashMap<String, (Arc<Link>, Instant)>> {
    static LINKS: ForkLocal<Mutex<HashMap<String, (Arc<Link>, Instant)>>> = ForkLocal::new(Default::default);
    LINKS.get().lock().unwrap_or_else(|p| p.into_inner())
}

/// Closes the kept connection `link` (if it is still kept): its home closed it.
fn close_link(link: &Arc<Link>) {
    let closed: Vec<_> = links().extract_if(|_, (kept, _)| Arc::ptr_eq(kept, link)).collect();
    drop(closed);
}

/// When the first kept connection falls idle (`None`: none is kept); those idle already are
/// closed (outside the lock).
fn close_idle_links(now: Instant) -> Option<Instant> {
    let (idle, next) = {
        let mut links = links();
        let idle: Vec<_> = links.extract_if(|_, (_, used)| *used + LINK_IDLE <= now).collect();
        (idle, links.values().map(|(_, used)| *used + LINK_IDLE).min())
    };
    drop(idle);
    next
}

/// Keeps `socket`, this process's connection to the home `name`, for the next fetch there;
/// this process's serving thread watches it (a new one: rung for) and closes it once idle or
/// its home is gone.
fn keep_link(name: &str, socket: Arc<Link>, new: bool) {
    let Ok(home) = home() else { return };
    let replaced = {
        let mut links = links();
        let cleared = if links.len() >= MAX_LINKS { std::mem::take(&mut *links) } else { HashMap::new() };
        (cleared, links.insert(name.to_owned(), (socket, Instant::now())))
    };
    drop(replaced);
    if new {
        crate::sys::ring(&home.bell);
    }
}

/// Asks `socket`'s home for the deposit of `ticket`, waiting `wait` at most for its answer.
/// `None` when the connection was closed before an answer: the request was not taken (a home
/// answers before it closes), so it may be asked again on a fresh one.
fn exchange(socket: &Socket, ticket: &SpawnTicket, wait: Duration) -> io::Result<Option<crate::sys::Message>> {
    match socket.send(&[&ticket.token.to_le_bytes()], &[], Wait::Forever) {
        Ok(()) => socket.recv(16, Wait::Until(crate::os::instant_after(wait))),
        Err(e) if matches!(e.kind(), io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Fetches the descriptors deposited under `ticket`, from the home it names, with the time the
/// deposit had left there (`None`: the home did not say). On this process's kept connection to
/// that home when it has one, else (or when the home closed it) on a fresh one, kept after.
pub(crate) fn fetch(ticket: &SpawnTicket) -> Result<(Vec<OwnedFd>, Option<Duration>)> {
    fetch_within(ticket, FETCH_WAIT)
}

/// [`fetch`], waiting `wait` at most for the home's answer.
pub(crate) fn fetch_within(ticket: &SpawnTicket, wait: Duration) -> Result<(Vec<OwnedFd>, Option<Duration>)> {
    // While the kept connection is out of the map, this process's serving thread keeps a timer,
    // so that it watches the connection again once it is back (see `serve`).
    let home = home().ok();
    if let Some(home) = home {
        home.fetching.fetch_add(1, Ordering::SeqCst);
    }
    let kept = links().remove(&ticket.home).map(|(socket, _)| socket);
    let answered = fetch_on(kept, ticket, wait);
    if let Some(home) = home {
        home.fetching.fetch_sub(1, Ordering::SeqCst);
    }
    answered
}

/// [`fetch`] on `kept`, this process's connection to the ticket's home if it has one.
fn fetch_on(kept: Option<Arc<Link>>, ticket: &SpawnTicket, wait: Duration) -> Result<(Vec<OwnedFd>, Option<Duration>)> {
    let refused = |why: String| Error::Malformed(format!("the descriptors of a value from another process: {why}"));
    let exchange = |socket: &Socket| {
        exchange(socket, ticket, wait).map_err(|e| match e.kind() {
            // A home that does not answer (its process stopped, say). What it answers later
            // finds this connection closed, and the deposit is gone with that answer.
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Error::Timeout(wait),
            _ => refused(e.to_string()),
        })
    };
    // Asked again on a fresh connection only when the home closed this one unanswered (it
    // closes a kept connection it does not keep, and one whose answer it could not send, whose
    // deposit then waits for this request again): a request it answered (late, say, or with an
    // answer this process could not take in) is not asked twice.
    let mut answered = match kept {
        Some(socket) => exchange(&socket)?.map(|answer| (answer, socket, false)),
        None => None,
    };
    let fresh = || -> Result<Option<(crate::sys::Message, Arc<Link>, bool)>> {
        // Nobody listens under the home's name: the home's process has ended (or lives in
        // another network namespace, where abstract names do not reach).
        let deadline = crate::os::instant_after(wait);
        let socket = crate::sys::connect_abstract_within(&ticket.home, deadline).map_err(|e| match e.kind() {
            io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound => refused(format!(
                "the process that sent them has exited before this process took them, or cannot be reached from here ({e})"
            )),
            _ => refused(e.to_string()),
        })?;
        Ok(exchange(&socket)?.map(|answer| (answer, Arc::new(NotInherited::new(socket)), true)))
    };
    // Two fresh connections at most: the second for a request whose answer could not be sent.
    for _ in 0..2 {
        if answered.is_some() {
            break;
        }
        answered = fresh()?;
    }
    let (answer, socket, new) =
        answered.ok_or_else(|| refused("the process that sent them closed the connection".into()))?;
    keep_link(&ticket.home, socket, new);
    if answer.bytes.starts_with(b"ok") {
        let left = <[u8; 8]>::try_from(&answer.bytes[2..]).ok().map(|ms| Duration::from_millis(u64::from_le_bytes(ms)));
        Ok((answer.fds, left))
    } else {
        Err(refused(
            "the process that sent them holds none under that ticket (taken before, their time up, or their batch not finished)".into(),
        ))
    }
}

extern "C" fn wait_at_exit_hook() {
    let _ = crate::os::catch_quietly(wait_at_exit);
}

/// This process and its parent, as this process started (`cuda_mp::init`).
static STARTED_UNDER: OnceLock<(rustix::process::Pid, Option<rustix::process::Pid>)> = OnceLock::new();

/// Notes this process's parent as it starts: at exit, a parent gone meanwhile is seen as gone
/// (asked only then, the parent would be whoever adopted this process).
pub(crate) fn note_parent() {
    let _ = STARTED_UNDER.set((rustix::process::getpid(), rustix::process::getppid()));
}

/// At exit: waits until every result this process deposited has been fetched, for as long as
/// its parent lives (arguments it deposited are its children's to fetch, not waited for).
fn wait_at_exit() {
    let Some(home) = HOME.get().get() else { return };
    let parent = match STARTED_UNDER.get() {
        Some(&(this, parent)) if this == rustix::process::getpid() => parent,
        // A forked child: its parent is the process that forked it.
        _ => rustix::process::getppid(),
    };
    let mut deposits = lock(home);
    loop {
        let now = Instant::now();
        deposits.retain(|_, d| d.expires.is_none_or(|e| e > now));
        if deposits.values().all(|d| d.expires.is_some()) || rustix::process::getppid() != parent {
            return;
        }
        deposits = home.fetched.wait_timeout(deposits, EXIT_SLICE).unwrap_or_else(|p| p.into_inner()).0;
    }
}

/// Deposits one descriptor that a value carries while procspawn encodes it outside any
/// context of ours (a spawned function's result), under a ticket of its own.
pub(crate) fn deposit_one(fd: Held) -> Result<SpawnTicket> {
    let ticket = ticket()?;
    deposit(&ticket, fd, None, true)?;
    Ok(ticket)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// The tests here fetch from this process's home, whose kept connection they share.
    static SERIAL: Mutex<()> = Mutex::new(());

    /// A fresh ticket with one socket deposited under it.
    fn deposit() -> SpawnTicket {
        let t = ticket().unwrap();
        let (a, _b) = Socket::pair().unwrap();
        append_expiring(&t, Arc::new(a), ARGUMENT_TTL, true).unwrap();
        t
    }

    /// An answer the home could not send leaves its deposit waiting: the fetcher's request
    /// again, on a fresh connection, gets it (it was told "taken before").
    #[test]
    fn an_answer_that_could_not_be_sent_is_sent_again() {
        let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        // On a kept connection, and on a fresh one (the first fetch from a home): the home
        // closes it as its answer fails, and the request is asked again.
        for kept in [true, false] {
            if kept {
                assert_eq!(fetch(&deposit()).unwrap().0.len(), 1);
            } else {
                links().clear();
            }
            let t = deposit();
            REFUSE_ANSWERS.store(1, Ordering::SeqCst);
            let fetched = fetch(&t);
            assert_eq!(REFUSE_ANSWERS.load(Ordering::SeqCst), 0, "an answer failed");
            assert_eq!(fetched.unwrap().0.len(), 1, "then came whole (kept: {kept})");
            assert!(fetch(&t).is_err(), "once");
        }
    }

    /// A home that does not answer in time (its process stopped, say) is a time-out, not a
    /// malformed value. (Here the request never reached the home, whose deposit is then still
    /// there for a fresh connection.)
    #[test]
    fn a_home_that_does_not_answer_is_a_time_out() {
        let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let t = deposit();
        // The kept connection to the home: its other end takes requests and never answers.
        let (silent, _never_answers) = Socket::pair().unwrap();
        links().insert(t.home.clone(), (Arc::new(NotInherited::new(silent)), Instant::now()));
        let wait = Duration::from_millis(100);
        match fetch_within(&t, wait) {
            Err(Error::Timeout(after)) => assert_eq!(after, wait),
            other => panic!("a home that does not answer: {:?}", other.map(|(fds, _)| fds.len())),
        }
        assert_eq!(fetch(&t).unwrap().0.len(), 1, "the home's deposit, on a fresh connection");
    }

    /// A batch whose time is up is not sealed, even before the serving thread drops it: its
    /// fetch would be refused, and `finish` said Ok.
    #[test]
    fn a_batch_whose_time_is_up_is_not_sealed() {
        let ticket = batch_ticket(Duration::from_secs(60)).unwrap();
        let home = home().unwrap();
        lock(home).get_mut(&ticket.token).unwrap().expires = Some(Instant::now() - Duration::from_millis(1));
        assert!(!seal(&ticket));
        assert!(!lock(home).contains_key(&ticket.token), "and it goes");
        let ticket = batch_ticket(Duration::from_secs(60)).unwrap();
        assert!(seal(&ticket));
        withdraw(&ticket);
    }

    /// A home that could not start (this process out of descriptors) starts at the next call
    /// once descriptors are free again: the first failure used to stay for the process's life.
    #[test]
    fn a_home_that_could_not_start_starts_later() {
        use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
        let child = crate::sys::fork_and_run(|| {
            // A forked child has no home yet: it starts its own at the first call.
            let open = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count()) as u64;
            let hard = getrlimit(Resource::Nofile).maximum;
            if setrlimit(Resource::Nofile, Rlimit { current: Some(open + 16), maximum: hard }).is_err() {
                return false;
            }
            let mut filler = Vec::new();
            while let Ok(f) = std::fs::File::open("/dev/null") {
                filler.push(f);
            }
            let at_the_limit = ticket().is_err();
            drop(filler);
            at_the_limit && ticket().is_ok_and(|t| !t.home.is_empty())
        });
        assert_eq!(child.ok(), Some(true), "the home failed at the limit, then started");
    }

    /// A fetch keeps its connection for the next one; a kept connection the home closed is
    /// replaced by a fresh one for the same fetch (the request was not taken: nothing lost);
    /// connections unused for `LINK_IDLE` are closed.
    #[test]
    fn fetches_reuse_their_connection_and_reconnect_when_it_was_closed() {
        let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let first = deposit();
        assert_eq!(fetch(&first).unwrap().0.len(), 1);
        let kept = links().get(&first.home).map(|(s, _)| s.identity());
        assert!(kept.is_some_and(|identity| identity.is_some()), "the connection is kept");
        let second = deposit();
        assert_eq!(fetch(&second).unwrap().0.len(), 1);
        assert_eq!(links().get(&first.home).map(|(s, _)| s.identity()), kept, "and used again");
        // The home closed it (it keeps at most MAX_PEERS): a socket whose peer is gone.
        let (dead, peer) = Socket::pair().unwrap();
        drop(peer);
        links().insert(first.home.clone(), (Arc::new(NotInherited::new(dead)), Instant::now()));
        let third = deposit();
        assert_eq!(fetch(&third).unwrap().0.len(), 1, "fetched on a fresh connection");
        assert!(fetch(&third).is_err(), "once");
        assert!(links().contains_key(&first.home));
        assert_eq!(close_idle_links(Instant::now() + LINK_IDLE), None, "closed once idle");
        assert!(!links().contains_key(&first.home));
        // A kept connection whose home closes it is closed by this process's serving thread.
        let (dead, peer) = Socket::pair().unwrap();
        keep_link("a home that goes", Arc::new(NotInherited::new(dead)), true);
        assert!(links().contains_key("a home that goes"));
        drop(peer);
        // Before it would have gone idle.
        let deadline = Instant::now() + LINK_IDLE / 2;
        while links().contains_key("a home that goes") {
            assert!(Instant::now() < deadline, "a connection whose home closed it is still kept");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A fetch takes its kept connection out of the map and puts it back without ringing: the
    /// serving thread, woken by its timer meanwhile with nothing else to wait for, must not
    /// then wait for ever, or the connection goes unwatched (neither closed when idle nor when
    /// its home goes).
    #[test]
    fn the_serving_thread_keeps_a_timer_while_a_fetch_has_its_connection_out() {
        let home = home().unwrap();
        let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        home.fetching.fetch_add(1, Ordering::SeqCst);
        let next = next_wake(home, true);
        home.fetching.fetch_sub(1, Ordering::SeqCst);
        assert!(next.is_some_and(|t| t <= Instant::now() + LINK_IDLE), "no timer while a fetch is under way");
    }

    #[test]
    fn deposited_descriptors_are_fetched_once_by_their_secret() {
        let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let (a, b) = Socket::pair().unwrap();
        let t = ticket().unwrap();
        let held: Held = Arc::new(b);
        assert_eq!(append_expiring(&t, held, ARGUMENT_TTL, true).unwrap(), 0);
        let (fds, left) = fetch(&t).unwrap();
        assert_eq!(fds.len(), 1);
        // The home says how long the deposit had left.
        assert!(left.is_some_and(|left| left <= ARGUMENT_TTL && left > ARGUMENT_TTL / 2), "{left:?}");
        let b = Socket::from_fd(fds.into_iter().next().unwrap()).unwrap();
        a.send(&[b"x"], &[], Wait::Not).unwrap();
        assert_eq!(b.recv(4, Wait::Not).unwrap().unwrap().bytes, b"x");
        // Once only; a wrong secret gets nothing.
        assert!(fetch(&t).is_err());
        assert!(fetch(&SpawnTicket { token: t.token ^ 1, ..t.clone() }).is_err());
        // The home is no file: nothing is left behind by a process that used one.
        let dir = crate::sys::private_dir().unwrap();
        let files: Vec<String> =
            std::fs::read_dir(dir).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        assert!(!files.iter().any(|f| t.home.contains(f.as_str()) || f.contains(&t.home)), "{files:?}");
    }
}
