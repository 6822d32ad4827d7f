//! PyTorch's CUDA memory from cuda-mp's caching allocator: the two C functions that
//! `torch.cuda.memory.CUDAPluggableAllocator` loads from this module's library
//! (`cuda_mp.torch.install(allocator=True)` registers them).
//!
//! Each PyTorch allocation is a cuda-mp storage (a block of a segment exported once, below
//! `VMM_MIN_BYTES`), kept here by its address until PyTorch frees it, and found by that address
//! when the program sends a tensor of it ([`find`]): it travels as its block, so a receiver
//! maps each segment once and a fresh tensor cut from a mapped segment opens nothing. When
//! PyTorch frees it, the storage is dropped after the work queued on its stream, and on every
//! stream `Tensor.record_stream` named for it ([`record_stream`]; PyTorch's pluggable
//! allocator drops that call itself), by `Device::drop_after_stream`; the block returns to the
//! free lists once every receiver has released it too. A new block is handed out only after
//! the work cuda-mp's own stream has queued (a block it dropped may still be in use there).
//!
//! Both functions leave the thread's current CUDA context as they found it: PyTorch frees on
//! whatever device its thread is on, and cuda-mp's calls make the memory's device current.
//!
//! A pluggable allocator cannot raise: PyTorch takes whatever pointer it returns (null only
//! for 0 bytes, whose pointer PyTorch never frees). An allocation that fails is tried again
//! after the frees queued before it have run and the free segments are given back; if it
//! still fails, the process ends with a message (a null pointer would make PyTorch queue
//! kernels on address 0, which breaks the whole context).

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cuda_mp::{Device, GpuStorage, keeping_current_context};

/// How long a failed allocation waits for the frees queued before it.
const RETRY_AFTER_FREES: Duration = Duration::from_secs(10);

/// What PyTorch holds.
struct Allocation {
    storage: Arc<GpuStorage>,
    /// Streams other than its own that `record_stream` named: its free waits for them too.
    streams: Vec<usize>,
}

/// PyTorch's allocations by (device, address), and the process they belong to: a forked
/// child inherits them and must not touch them (its CUDA is unusable; they are its parent's).
struct Live {
    pid: u32,
    allocations: BTreeMap<(usize, u64), Allocation>,
}

static LIVE: Mutex<Live> = Mutex::new(Live { pid: 0, allocations: BTreeMap::new() });

/// This process's allocations; `None` in a forked child (which gets none).
fn live() -> Option<MutexGuard<'static, Live>> {
    let live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
    (live.pid == 0 || live.pid == std::process::id()).then_some(live)
}

/// Bytes PyTorch holds through this allocator on `device`, and how many allocations.
pub(crate) fn held(device: usize) -> (usize, usize) {
    let Some(live) = live() else { return (0, 0) };
    let on_device = live.allocations.range((device, 0)..=(device, u64::MAX));
    on_device.fold((0, 0), |(bytes, count), (_, a)| (bytes + a.storage.byte_len(), count + 1))
}

/// The allocation holding `[ptr, ptr + bytes)` on `device`, in place.
fn containing(live: &mut Live, device: usize, ptr: u64, bytes: usize) -> Option<(&mut Allocation, usize)> {
    let (&(d, base), allocation) = live.allocations.range_mut(..=(device, ptr)).next_back()?;
    let offset = crate::offset_within(d == device, base, allocation.storage.byte_len(), ptr, bytes)?;
    Some((allocation, offset))
}

/// The storage this allocator gave PyTorch that holds `[ptr, ptr + bytes)` on `device`, with
/// the offset of `ptr` in it.
pub(crate) fn find(device: usize, ptr: u64, bytes: usize) -> Option<(Arc<GpuStorage>, usize)> {
    let mut live = live()?;
    containing(&mut live, device, ptr, bytes).map(|(a, offset)| (a.storage.clone(), offset))
}

/// `Tensor.record_stream(stream)` for a tensor of this allocator at `ptr` on `device`: its
/// memory is freed only after the work queued on `stream` by then too. False when the
/// memory is not this allocator's.
pub(crate) fn record_stream(device: usize, ptr: u64, stream: usize) -> bool {
    let Some(mut live) = live() else { return false };
    let Some((allocation, _)) = containing(&mut live, device, ptr, 0) else { return false };
    if !allocation.streams.contains(&stream) {
        allocation.streams.push(stream);
    }
    true
}

fn allocate(size: usize, device: c_int, stream: *mut c_void) -> Result<*mut c_void, String> {
    let ordinal = usize::try_from(device).map_err(|_| format!("device {device} does not exist"))?;
    let dev = Device::get(ordinal).map_err(|e| e.to_string())?;
    let storage = match GpuStorage::empty(&dev, size) {
        Ok(storage) => storage,
        Err(e) if e.is_out_of_memory() => {
            // Frees waiting behind the GPU's work give blocks back; then the allocator gives
            // its wholly free segments up before a new one is made.
            dev.finish_retiring(RETRY_AFTER_FREES);
            dev.empty_cache();
            GpuStorage::empty(&dev, size).map_err(|e| e.to_string())?
        }
        Err(e) => return Err(e.to_string()),
    };
    // A block that cuda-mp's own stream used (a tensor of cuda-mp's, dropped with work still
    // queued) is PyTorch's only after that work.
    // SAFETY: PyTorch passes its current stream of `device`, live while it allocates on it.
    unsafe { dev.order_stream_after(stream.cast()) }.map_err(|e| e.to_string())?;
    let ptr = storage.device_ptr();
    let mut live = live().ok_or("a forked child cannot allocate CUDA memory")?;
    live.pid = std::process::id();
    live.allocations.insert((ordinal, ptr), Allocation { storage, streams: Vec::new() });
    Ok(ptr as *mut c_void)
}

/// PyTorch's allocation of `size` bytes on `device` for work on `stream`.
///
/// # Safety
/// Called by PyTorch's pluggable allocator only, with its arguments.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuda_mp_torch_malloc(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void {
    if size == 0 {
        // PyTorch's own allocator gives no memory for 0 bytes either, and frees no null pointer.
        return std::ptr::null_mut();
    }
    match std::panic::catch_unwind(|| keeping_current_context(|| allocate(size, device, stream))) {
        Ok(Ok(ptr)) => ptr,
        Ok(Err(why)) => {
            eprintln!("cuda-mp: PyTorch's allocation of {size} bytes on GPU {device} failed: {why}");
            std::process::abort();
        }
        Err(_) => {
            eprintln!("cuda-mp: PyTorch's allocation of {size} bytes on GPU {device} panicked");
            std::process::abort();
        }
    }
}

/// A storage dropped once every stream it still waits for is past its work: one stream at a
/// time, from the end, each fence recorded when the one before it is passed (later than the
/// free, so covering at least what was queued by then). The allocation's stream is recorded
/// at the free itself; a per-thread default stream (handle 2) named by `record_stream` would be
/// recorded on the retiring thread, and name that thread's: not covered.
struct AfterStreams {
    storage: Arc<GpuStorage>,
    streams: Vec<usize>,
}

impl Drop for AfterStreams {
    fn drop(&mut self) {
        let Some(stream) = self.streams.pop() else { return };
        let rest = AfterStreams { storage: self.storage.clone(), streams: std::mem::take(&mut self.streams) };
        let dev = self.storage.device().clone();
        // SAFETY: a stream PyTorch named in `record_stream` (or allocated on), live for as long
        // as tensors recorded on it live: PyTorch's own streams are kept for the life of the
        // process; a `torch.cuda.ExternalStream` must outlive the tensors used on it, as with
        // PyTorch's own allocator.
        unsafe { dev.drop_after_stream(stream as *mut c_void as _, rest) };
    }
}

/// PyTorch's free of `ptr` (of `size` bytes on `device`, allocated for work on `stream`).
///
/// # Safety
/// Called by PyTorch's pluggable allocator only: `ptr` came from [`cuda_mp_torch_malloc`] and
/// `stream` is the stream it was allocated for (see [`AfterStreams`] for how long it lives).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuda_mp_torch_free(ptr: *mut c_void, _size: usize, device: c_int, stream: *mut c_void) {
    let _ = std::panic::catch_unwind(|| {
        let Ok(ordinal) = usize::try_from(device) else { return };
        // A forked child leaves its parent's memory alone.
        let Some(allocation) = live().and_then(|mut live| live.allocations.remove(&(ordinal, ptr as u64))) else {
            return;
        };
        let mut streams = allocation.streams;
        streams.retain(|&s| s != stream as usize);
        // The allocation stream's fence is recorded now (taken first, from the end), the
        // others' after it.
        streams.push(stream as usize);
        // The thread's current context as PyTorch left it (the later links of the chain run
        // on cuda-mp's retiring thread, whose context matters to nobody).
        keeping_current_context(|| drop(AfterStreams { storage: allocation.storage, streams }));
    });
}
