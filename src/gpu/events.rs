//! Ordering across processes: this process's one interprocess event per device, recorded at a
//! send, and a sender's event, waited on at a receive or owed until the stream's next use
//! (`settle`). When each is skipped, so that a handoff puts no command on the GPU where none is
//! needed: README.md here ("Export is serialization", "Import is deserialization").

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use once_cell::sync::Lazy;

use super::device::Device;
use super::driver::{self, IpcHandle};
use super::handles::{Event, InterprocessEvent};
use crate::error::Result;

/// Records this process's one interprocess event of `device` after the work queued on its
/// stream, or None when the stream is idle (nothing to wait for).
pub(crate) fn record(device: &Device) -> Result<Option<IpcHandle>> {
    Ok(recorded(device)?.map(|event| *event.handle()))
}

/// The device's interprocess event recorded after the work queued on its stream, or None when
/// the stream is idle.
fn recorded(device: &Device) -> Result<Option<&InterprocessEvent>> {
    // A forked child inherits the counts too: it is refused here, whatever they say.
    driver::check_not_forked()?;
    // Nothing queued since the latest record (another tensor of the same message, say): that
    // record covers this send too, unless the work is known done.
    if !device.stream_known_idle()
        && device.event_covers_work()
        && !EVENTS_FINISHED.load(Ordering::SeqCst)
        && let Some(event) = device.ipc_event_cell().get()
    {
        return Ok(Some(event));
    }
    // Owed waits are not this process's work: a send records after what it queued itself.
    if device.own_work_done()? {
        return Ok(None);
    }
    if EVENTS_FINISHED.load(Ordering::SeqCst) {
        // The driver's file of this process's events is gone (`before_exit` ran): a receiver
        // could not open the event and would wait for nothing, so the work is waited for here.
        device.finish_own_work()?;
        return Ok(None);
    }
    let event = device.ipc_event_cell().get_or_try_init(|| {
        // The driver keeps a file in /dev/shm for a process's interprocess events, and removes
        // it only when the process's context is destroyed, which no exit does by itself.
        static AT_EXIT: std::sync::Once = std::sync::Once::new();
        AT_EXIT.call_once(|| {
            crate::process::at_exit(finish_events_at_exit);
        });
        InterprocessEvent::create(device)
    })?;
    device.record_after_work(|| event.record(device.unsettled_stream()))?;
    Ok(Some(event))
}

/// Set once the exit hook has removed the driver's file of this process's events.
static EVENTS_FINISHED: AtomicBool = AtomicBool::new(false);

/// At a normal exit (or in `before_exit`): waits for the work queued on every stream this
/// process recorded an interprocess event on (so that no receiver needs the event any more),
/// then removes the driver's file of this process's events. A receiver that then cannot open
/// the event sees the process ended ([`sender_ended`]) and waits for nothing.
extern "C" fn finish_events_at_exit() {
    let _ = crate::os::catch_quietly(|| {
        EVENTS_FINISHED.store(true, Ordering::SeqCst);
        let Some(devices) = super::device::opened_devices() else { return };
        for device in devices.iter().filter(|d| d.ipc_event_cell().get().is_some()) {
            let _ = device.unsettled_stream().synchronize();
        }
        crate::sys::remove_cuda_event_files(std::process::id());
    });
}

/// Whether the process that sent an event it could not open has ended (`owner_alive` says
/// whether it lives): at once, or within a moment, for one that removed its events' file at its
/// exit and has not closed its descriptors yet.
pub(crate) fn sender_ended(owner_alive: impl Fn() -> bool) -> bool {
    const EXITING: std::time::Duration = std::time::Duration::from_millis(200);
    let deadline = std::time::Instant::now() + EXITING;
    loop {
        if !owner_alive() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// An opened event of another process: (owner token, owner device ordinal, handle).
type EventKey = (u128, usize, IpcHandle);
/// Opened events of other processes, kept for reuse: past this many, those complete and owed
/// no wait are closed (a long-lived receiver of many short-lived senders would otherwise keep
/// an event, and the driver's file behind it, of every sender it ever had).
const KEPT_EVENTS: usize = 256;
/// How many events `OPENED_EVENTS` holds (read without its lock).
static OPENED_COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Closes the opened events that are complete and that no stream owes a wait on (their keys
/// name them in `OWED`), in the lock order `OWED`, then `OPENED_EVENTS`.
fn close_completed() {
    let owed = OWED.lock().unwrap_or_else(|p| p.into_inner());
    let mut events = OPENED_EVENTS.lock().unwrap_or_else(|p| p.into_inner());
    events.retain(|key, event| owed.values().any(|keys| keys.contains(key)) || !event.is_complete().unwrap_or(true));
    OPENED_COUNT.store(events.len(), Ordering::Relaxed);
    // Not again before the table has doubled: events still in use are looked at that often.
    PRUNE_AT.store((events.len() * 2).max(KEPT_EVENTS), Ordering::Relaxed);
}

/// The size of `OPENED_EVENTS` at which `close_completed` runs next.
static PRUNE_AT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(KEPT_EVENTS);

/// Opened events of other processes (see `KEPT_EVENTS`).
static OPENED_EVENTS: Lazy<Mutex<HashMap<EventKey, Event>>> = Lazy::new(|| Mutex::new(HashMap::new()));
/// Per device ordinal: the events its stream owes a wait on. Lock order: `OWED`, then
/// `OPENED_EVENTS`; `settle` holds `OWED` until the waits are queued, so that no work queued
/// on another thread meanwhile can pass them.
static OWED: Lazy<Mutex<HashMap<usize, Vec<EventKey>>>> = Lazy::new(|| Mutex::new(HashMap::new()));
/// True while any device owes a wait (spares `settle` the lock on every use of a stream).
static ANY_OWED: AtomicBool = AtomicBool::new(false);

/// How a receiver orders its stream after the sender's event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitWhen {
    /// Queue the wait now.
    Now,
    /// Owe it: queued when the stream is next used through this library.
    NextUse,
}

/// Makes `wait_on`'s stream wait for another process's event, now or when it is next used
/// (`when`); nothing when the event has already completed. The event is opened (once per
/// key, here, so that a bad handle fails the receive) on `owner_device`, the GPU it was
/// recorded on; a stream may wait on an event of another device.
pub(crate) fn wait(
    owner_device: &Device,
    wait_on: &Device,
    owner: u128,
    handle: &IpcHandle,
    when: WaitWhen,
) -> Result<()> {
    let key = (owner, owner_device.ordinal(), *handle);
    {
        if OPENED_COUNT.load(Ordering::Relaxed) >= PRUNE_AT.load(Ordering::Relaxed) {
            close_completed();
        }
        let mut events = OPENED_EVENTS.lock().unwrap_or_else(|p| p.into_inner());
        let event = match events.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let opened = v.insert(Event::open(owner_device, handle)?);
                OPENED_COUNT.fetch_add(1, Ordering::Relaxed);
                opened
            }
        };
        // Already complete: nothing to wait for, no command for the GPU.
        if event.is_complete()? {
            return Ok(());
        }
        if when == WaitWhen::Now {
            return wait_on.enqueue_unsettled(|s| event.wait_on(s));
        }
    }
    let mut owed = OWED.lock().unwrap_or_else(|p| p.into_inner());
    let keys = owed.entry(wait_on.ordinal()).or_default();
    if !keys.contains(&key) {
        keys.push(key);
    }
    ANY_OWED.store(true, Ordering::Release);
    Ok(())
}

/// Queues on `device`'s stream the waits it owes (those not complete yet). Runs before any
/// use of the stream through this library. A wait that fails (its sender's context gone, say)
/// is reported once, by this call, and not owed any more: the stream is not kept failing.
pub(crate) fn settle(device: &Device) -> Result<()> {
    if !ANY_OWED.load(Ordering::Acquire) {
        return Ok(());
    }
    let mut owed = OWED.lock().unwrap_or_else(|p| p.into_inner());
    let Some(keys) = owed.get_mut(&device.ordinal()).filter(|k| !k.is_empty()) else {
        return Ok(());
    };
    let events = OPENED_EVENTS.lock().unwrap_or_else(|p| p.into_inner());
    let mut first_error = None;
    for key in keys.drain(..) {
        if let Some(event) = events.get(&key) {
            let queued = event
                .is_complete()
                .and_then(|done| if done { Ok(()) } else { device.enqueue_unsettled(|s| event.wait_on(s)) });
            if let Err(e) = queued {
                first_error.get_or_insert(e);
            }
        }
    }
    drop(events);
    if owed.values().all(Vec::is_empty) {
        ANY_OWED.store(false, Ordering::Release);
    }
    first_error.map_or(Ok(()), Err)
}

/// How many waits `device`'s stream owes.
#[cfg(any(test, feature = "testing"))]
pub(crate) fn owed(device: &Device) -> usize {
    OWED.lock().unwrap_or_else(|p| p.into_inner()).get(&device.ordinal()).map_or(0, Vec::len)
}

/// Makes `device`'s stream wait for another library's event (PyTorch's, recorded for one
/// share), unless it has already completed. The event is opened, waited on and closed again
/// (a queued wait is not affected by the close): PyTorch records a new event per share, so
/// keeping them open would grow without bound.
pub(crate) fn wait_once(device: &Device, handle: &IpcHandle) -> Result<()> {
    let event = Event::open(device, handle)?;
    if event.is_complete()? {
        return Ok(());
    }
    device.enqueue_unsettled(|s| event.wait_on(s))
}

/// Makes `stream`, another library's stream of `device`'s context, wait for the work queued on
/// the device's stream (nothing when that is idle).
///
/// # Safety
/// As [`InterprocessEvent::make_wait`].
pub(crate) unsafe fn order_after(device: &Device, stream: cudarc::driver::sys::CUstream) -> Result<()> {
    // What was received must be ready for the other stream too.
    settle(device)?;
    match recorded(device)? {
        // SAFETY: upheld by the caller.
        Some(event) => unsafe { event.make_wait(stream) },
        None => Ok(()),
    }
}

/// Per device ordinal: the event that [`wait_for`] records on other libraries' streams. One
/// serves every call: a queued wait keeps the record it was queued after, whatever is recorded
/// later.
static FOREIGN: Lazy<Mutex<HashMap<usize, Event>>> = Lazy::new(|| Mutex::new(HashMap::new()));

/// Makes the device's stream wait for the work queued so far on `stream`, another library's
/// stream of its context (nothing when that is idle): what a send of that library's memory
/// is ordered after.
///
/// # Safety
/// `stream` must be a live stream of `device`'s primary context, or 0 or 2 (the default streams).
pub(crate) unsafe fn wait_for(device: &Device, stream: cudarc::driver::sys::CUstream) -> Result<()> {
    driver::bind(device.context())?;
    // SAFETY: the context is current; the stream is upheld by the caller.
    if unsafe { driver::stream_is_idle_raw(stream) }.map_err(driver::driver_err("cuStreamQuery"))? {
        return Ok(());
    }
    let mut events = FOREIGN.lock().unwrap_or_else(|p| p.into_inner());
    let event = match events.entry(device.ordinal()) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => v.insert(Event::blocking(device)?),
    };
    // SAFETY: upheld by the caller.
    unsafe { event.record_raw(stream) }?;
    // Under the lock: a record by another thread between these two would make this wait for
    // that thread's stream instead.
    device.enqueue_unsettled(|s| event.wait_on(s))
}
