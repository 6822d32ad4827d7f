//! PyTorch's CUDA memory from cuda-mp's caching allocator: the two C functions that
//! `torch.cuda.memory.CUDAPluggableAllocator` loads from this module's library
//! (`cuda_mp.torch.install(allocator=True)` registers them).
//!
//! Each PyTorch allocation is a cuda-mp storage (a block of a segment exported once, below
//! `VMM_MIN_BYTES`), kept here by its address until PyTorch frees it, and found by that address
//! when the program sends a tensor of it ([`find`]): it travels as its block, so a receiver
//! maps each segment once and a fresh tensor cut from a mapped segment opens nothing. When
//! PyTorch frees it, the storage is dropped after the work queued on its stream
//! (`Device::drop_after_stream`); the block returns to the free lists once every receiver has
//! released it too.
//!
//! A pluggable allocator cannot raise: PyTorch takes whatever pointer it returns. An allocation
//! that fails is tried again after the frees still waiting for the GPU have run; if it still
//! fails, the process ends with a message (a null pointer would make PyTorch queue kernels on
//! address 0, which breaks the whole context).

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cuda_mp::{Device, GpuStorage};

/// How long a failed allocation waits for pending frees before it tries again.
const RETRY_AFTER_FREES: Duration = Duration::from_secs(10);

/// What PyTorch holds: storage by (device, address).
type Live = BTreeMap<(usize, u64), Arc<GpuStorage>>;

static LIVE: Mutex<Live> = Mutex::new(BTreeMap::new());

fn live() -> MutexGuard<'static, Live> {
    LIVE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Bytes PyTorch holds through this allocator on `device`, and how many allocations.
pub(crate) fn held(device: usize) -> (usize, usize) {
    let live = live();
    let on_device = live.range((device, 0)..=(device, u64::MAX));
    on_device.fold((0, 0), |(bytes, count), (_, s)| (bytes + s.byte_len(), count + 1))
}

/// The storage this allocator gave PyTorch that holds `[ptr, ptr + bytes)` on `device`, with
/// the offset of `ptr` in it.
pub(crate) fn find(device: usize, ptr: u64, bytes: usize) -> Option<(Arc<GpuStorage>, usize)> {
    let live = live();
    let (&(d, base), storage) = live.range(..=(device, ptr)).next_back()?;
    let offset = usize::try_from(ptr.checked_sub(base)?).ok()?;
    let within = d == device && offset.checked_add(bytes).is_some_and(|end| end <= storage.byte_len());
    within.then(|| (storage.clone(), offset))
}

fn allocate(size: usize, device: c_int) -> Result<*mut c_void, String> {
    let ordinal = usize::try_from(device).map_err(|_| format!("device {device} does not exist"))?;
    let dev = Device::get(ordinal).map_err(|e| e.to_string())?;
    // PyTorch asks for 0 bytes too, and wants a pointer of its own for each allocation.
    let bytes = size.max(1);
    let storage = match GpuStorage::empty(&dev, bytes) {
        Ok(storage) => storage,
        Err(e) if e.is_out_of_memory() => {
            // Frees waiting behind the GPU's work give blocks back; then the allocator gives
            // its wholly free segments up before a new one is made.
            dev.finish_retiring(RETRY_AFTER_FREES);
            dev.empty_cache();
            GpuStorage::empty(&dev, bytes).map_err(|e| e.to_string())?
        }
        Err(e) => return Err(e.to_string()),
    };
    let ptr = storage.device_ptr();
    live().insert((ordinal, ptr), storage);
    Ok(ptr as *mut c_void)
}

/// PyTorch's allocation of `size` bytes on `device` for work on `stream`.
///
/// # Safety
/// Called by PyTorch's pluggable allocator only, with its arguments.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuda_mp_torch_malloc(size: usize, device: c_int, _stream: *mut c_void) -> *mut c_void {
    match std::panic::catch_unwind(|| allocate(size, device)) {
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

/// PyTorch's free of `ptr` (of `size` bytes on `device`, allocated for work on `stream`).
///
/// # Safety
/// Called by PyTorch's pluggable allocator only: `ptr` came from [`cuda_mp_torch_malloc`] and
/// `stream` is the live stream it was allocated for (PyTorch keeps its streams for the life of
/// the process).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuda_mp_torch_free(ptr: *mut c_void, _size: usize, device: c_int, stream: *mut c_void) {
    let _ = std::panic::catch_unwind(|| {
        let Ok(ordinal) = usize::try_from(device) else { return };
        let Some(storage) = live().remove(&(ordinal, ptr as u64)) else { return };
        let dev = storage.device().clone();
        // SAFETY: PyTorch passes the stream the memory was allocated for, a live stream of the
        // device's primary context (or a default stream), as its caller guarantees.
        unsafe { dev.drop_after_stream(stream.cast(), storage) };
    });
}
