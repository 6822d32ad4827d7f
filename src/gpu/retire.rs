//! Releasing received memory after the work this process queued on it, off the dropping
//! thread: behind a fence ([`Device::own_work`]), on the device's retiring thread (README.md
//! here, "Dropping"). If the thread cannot start or no event can be recorded, the drop waits.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

use super::device::Device;
use cudarc::driver::sys;

use super::handles::Event;
use crate::error::Result;
use crate::storage::{Close, Fence};

/// Events kept for reuse per device, at most (the rest are destroyed after use).
const SPARE_EVENTS: usize = 64;

/// One device's retiring queue (in `Device`).
#[derive(Default)]
pub(crate) struct Retirer {
    queue: Mutex<VecDeque<(Arc<Event>, Close, u64)>>,
    posted: Condvar,
    spare: Mutex<Vec<Event>>,
    /// The latest fence of `own_work` and the count of work queued (`Device::counted_work`)
    /// read before its record: while the count is unchanged, it follows all the work counted.
    latest: Mutex<Option<(u64, Arc<Event>)>>,
    /// Fences `own_work` recorded (a shared one counts once).
    fences_recorded: std::sync::atomic::AtomicU64,
    started: OnceLock<bool>,
    /// The closes queued and not yet run (`finish_retiring` waits for those queued before it
    /// was called, not for ones queued meanwhile).
    counts: Mutex<Counts>,
    finished: Condvar,
}

#[derive(Default)]
struct Counts {
    /// The number the next close queued gets.
    next: u64,
    /// Closes queued and not yet run, by number (they run out of order, see `LOOK_AHEAD`).
    waiting: std::collections::BTreeSet<u64>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Retirer {
    /// Keeps `event` for reuse if this was its last holder (a fence shared by several drops
    /// is recycled by the last: re-recording it earlier would move the others' fence).
    fn recycle(&self, event: Arc<Event>) {
        let Some(event) = Arc::into_inner(event) else { return };
        let mut spare = lock(&self.spare);
        if spare.len() < SPARE_EVENTS {
            spare.push(event);
        }
    }
}

/// The work this process queued on a device's stream up to a point: a [`Fence`].
pub(crate) struct OwnWork {
    device: Arc<Device>,
    event: Arc<Event>,
}

impl Device {
    /// A fence after the work this process queued on the stream so far (not the waits it owes
    /// for received memory: they put no work of ours on it), or None when that work is known
    /// done (nothing counted since the stream was last seen idle): nothing to wait behind.
    /// The latest fence serves again while nothing was counted since its record.
    pub(crate) fn own_work(self: &Arc<Self>) -> Result<Option<OwnWork>> {
        // A forked child inherits the latest fence, but no retiring thread to wait on it.
        super::driver::check_not_forked()?;
        if self.stream_known_idle() {
            return Ok(None);
        }
        let retirer = self.retirer();
        // Held across the record: a count read and the fence recorded after it are stored
        // together, whatever other threads drop meanwhile (they wait one record at most).
        let mut latest = lock(&retirer.latest);
        // Read before the record: the work counted by now was queued before it.
        let counted = self.counted_work();
        if let (Some(counted), Some((at, event))) = (counted, latest.as_ref())
            && *at == counted
        {
            return Ok(Some(OwnWork { device: self.clone(), event: event.clone() }));
        }
        let event = self.spare_event()?;
        event.record(self.unsettled_stream())?;
        retirer.fences_recorded.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let event = Arc::new(event);
        let previous = match counted {
            Some(counted) => latest.replace((counted, event.clone())),
            None => latest.take(),
        };
        drop(latest);
        if let Some((_, previous)) = previous {
            retirer.recycle(previous);
        }
        Ok(Some(OwnWork { device: self.clone(), event }))
    }

    /// Fences [`own_work`](Self::own_work) recorded on this device so far.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn fences_recorded(&self) -> u64 {
        self.retirer().fences_recorded.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// An event kept from an earlier fence, or a new one.
    fn spare_event(&self) -> Result<Event> {
        let spare = lock(&self.retirer().spare).pop();
        spare.map_or_else(|| Event::blocking(self), Ok)
    }

    /// Drops `value` once the work queued on `stream` so far is done, on the device's retiring
    /// thread (in order with the releases waiting there), without blocking this thread: how an
    /// allocator that another library's streams use gives memory back after the work that
    /// still reads it. If no event can be recorded, waits for the stream here; if the thread
    /// cannot start, waits for the event here.
    ///
    /// # Safety
    /// `stream` must be a live stream of this device's primary context, or the legacy (0) or
    /// per-thread (2) default stream.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[4]).unwrap();
    /// // SAFETY: 0 is the legacy default stream.
    /// unsafe { dev.drop_after_stream(std::ptr::null_mut(), t) };
    /// ```
    pub unsafe fn drop_after_stream<T: Send + 'static>(self: &Arc<Self>, stream: sys::CUstream, value: T) {
        // SAFETY: upheld by the caller.
        let recorded = self.spare_event().and_then(|event| unsafe { event.record_raw(stream) }.map(|()| event));
        match recorded {
            Ok(event) => {
                Box::new(OwnWork { device: self.clone(), event: Arc::new(event) }).then(Box::new(move || drop(value)))
            }
            Err(_) => {
                // SAFETY: upheld by the caller. An error leaves the context unusable: nothing
                // queued runs any more, so the value may go.
                let _ = unsafe { super::handles::synchronize_stream(self, stream) };
                drop(value);
            }
        }
    }

    /// Waits until every release and drop queued behind this device's work before this call
    /// has run (not those queued meanwhile)
    /// (received blocks given back, values of [`drop_after_stream`](Self::drop_after_stream)
    /// dropped), at most `timeout`; true if none is left. An allocator that ran out of memory
    /// waits so before it tries again.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// assert!(dev.finish_retiring(std::time::Duration::from_secs(1)));
    /// ```
    pub fn finish_retiring(&self, timeout: std::time::Duration) -> bool {
        let retirer = self.retirer();
        let deadline = crate::os::deadline_after(timeout);
        let mut counts = lock(&retirer.counts);
        let target = counts.next;
        while counts.waiting.first().is_some_and(|&first| first < target) {
            let left =
                deadline.map_or(std::time::Duration::MAX, |d| d.saturating_duration_since(std::time::Instant::now()));
            if left.is_zero() {
                return false;
            }
            counts = retirer.finished.wait_timeout(counts, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        true
    }

    /// The retiring thread of this device, started on first use; false if it cannot start.
    fn retiring_thread(self: &Arc<Self>) -> bool {
        let device = self.clone();
        *self.retirer().started.get_or_init(move || {
            std::thread::Builder::new()
                .name(format!("cuda-mp-retire-{}", device.ordinal()))
                .spawn(move || retire(device))
                .is_ok()
        })
    }
}

impl Fence for OwnWork {
    fn then(self: Box<Self>, close: Close) {
        let OwnWork { device, event } = *self;
        if !device.retiring_thread() {
            let _ = event.wait();
            close();
            return;
        }
        let retirer = device.retirer();
        let number = {
            let mut counts = lock(&retirer.counts);
            let number = counts.next;
            counts.next += 1;
            counts.waiting.insert(number);
            number
        };
        lock(&retirer.queue).push_back((event, close, number));
        retirer.posted.notify_one();
    }
}

/// How far into its queue the retiring thread looks for a fence already passed before it
/// waits for the first: fences of one stream pass in order, but those of several streams
/// (`drop_after_stream` on another library's streams) need not.
const LOOK_AHEAD: usize = 32;

/// The retiring thread: each release after its event, the first passed of the oldest first.
fn retire(device: Arc<Device>) {
    let retirer = device.retirer();
    loop {
        // The first few taken out, to query their events outside the lock (a drop that posts
        // a release takes it), and put back in front, in order, but for the one that goes.
        let mut ahead: VecDeque<_> = {
            let mut queue = lock(&retirer.queue);
            while queue.is_empty() {
                queue = retirer.posted.wait(queue).unwrap_or_else(|p| p.into_inner());
            }
            let n = queue.len().min(LOOK_AHEAD);
            queue.drain(..n).collect()
        };
        let passed = ahead.iter().position(|(e, _, _)| e.is_complete().unwrap_or(true));
        let (event, close, number) = ahead.remove(passed.unwrap_or(0)).expect("an entry at a position found");
        if !ahead.is_empty() {
            let mut queue = lock(&retirer.queue);
            while let Some(entry) = ahead.pop_back() {
                queue.push_front(entry);
            }
        }
        // An error leaves the stream unusable (the context's error is sticky): nothing queued
        // on it runs any more, so the close may go ahead, as a synchronizing drop's would.
        let _ = event.wait();
        // A close that panics (a value of `drop_after_stream` whose drop does) must not end
        // the thread: every later release of the device would wait for ever.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(close));
        retirer.recycle(event);
        lock(&retirer.counts).waiting.remove(&number);
        retirer.finished.notify_all();
    }
}
