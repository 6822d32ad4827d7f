//! Ordering across processes: recording this process's interprocess event at a send, and
//! opening and waiting on a sender's event at a receive.
//!
//! One event per process and device serves every send: a receiver waits for the work queued up
//! to the latest record, which includes everything queued before its own message (never less,
//! sometimes a little more). It lives as long as the process (its device is never dropped), so
//! receivers may keep it open; they do, once per (owner, device, handle), for the life of this
//! process. When the sender's stream is idle nothing is recorded, and when the event has
//! already completed nothing is waited on: neither process then puts a command on the GPU for
//! the handoff (event records and waits force GPU context switches between processes).

use std::collections::HashMap;
use std::sync::Mutex;

use once_cell::sync::Lazy;

use super::device::Device;
use super::driver::{self, IpcHandle};
use super::handles::{InterprocessEvent, OpenedEvent};
use crate::error::Result;

/// Records this process's one interprocess event of `device` after the work queued on its
/// stream, or None when the stream is idle (nothing to wait for).
pub(crate) fn record(device: &Device) -> Result<Option<IpcHandle>> {
    Ok(recorded(device)?.map(|event| *event.handle()))
}

/// The device's interprocess event recorded after the work queued on its stream, or None when
/// the stream is idle.
fn recorded(device: &Device) -> Result<Option<&InterprocessEvent>> {
    if driver::stream_is_idle(device.stream())? {
        return Ok(None);
    }
    let event = device.ipc_event_cell().get_or_try_init(|| InterprocessEvent::create(device))?;
    event.record(device.stream())?;
    Ok(Some(event))
}

/// Opened events of other processes, keyed by (owner token, owner device ordinal, handle).
type OpenedEvents = HashMap<(u128, usize, IpcHandle), OpenedEvent>;
static OPENED_EVENTS: Lazy<Mutex<OpenedEvents>> = Lazy::new(|| Mutex::new(HashMap::new()));

/// Makes `wait_on`'s stream wait for another process's event (opened once per (owner token,
/// owner device ordinal, handle) and kept for the life of this process; skip when already
/// complete). The event is opened on `owner_device`, the GPU it was recorded on; a stream may
/// wait on an event of another device.
pub(crate) fn wait(owner_device: &Device, wait_on: &Device, owner: u128, handle: &IpcHandle) -> Result<()> {
    let mut events = OPENED_EVENTS.lock().unwrap_or_else(|p| p.into_inner());
    let key = (owner, owner_device.ordinal(), *handle);
    let event = match events.entry(key) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => v.insert(OpenedEvent::open(owner_device, handle)?),
    };
    // Already complete: nothing to wait for, no command for the GPU.
    if event.is_complete()? {
        return Ok(());
    }
    event.wait_on(wait_on.stream())
}

/// Makes `device`'s stream wait for another library's event (PyTorch's, recorded for one
/// share), unless it has already completed. The event is opened, waited on and closed again
/// (a queued wait is not affected by the close): PyTorch records a new event per share, so
/// keeping them open would grow without bound.
pub(crate) fn wait_once(device: &Device, handle: &IpcHandle) -> Result<()> {
    let event = OpenedEvent::open(device, handle)?;
    if event.is_complete()? {
        return Ok(());
    }
    event.wait_on(device.stream())
}

/// Makes `stream`, another library's stream of `device`'s context, wait for the work queued on
/// the device's stream (nothing when that is idle).
///
/// # Safety
/// As [`InterprocessEvent::make_wait`].
pub(crate) unsafe fn order_after(device: &Device, stream: cudarc::driver::sys::CUstream) -> Result<()> {
    match recorded(device)? {
        // SAFETY: upheld by the caller.
        Some(event) => unsafe { event.make_wait(stream) },
        None => Ok(()),
    }
}
