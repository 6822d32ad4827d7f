//! The only place that calls raw CUDA driver entry points (`cudarc::driver::sys`): each is
//! wrapped once here and returns `Result<_, DriverError>`; everything above uses these wrappers
//! or cudarc's own `result` layer.

use std::ffi::{c_uint, c_void};
use std::mem::MaybeUninit;

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;

/// Size of an IPC memory or event handle.
pub(crate) const IPC_HANDLE_BYTES: usize = 64;

/// An IPC handle as plain bytes.
pub(crate) type IpcHandle = [u8; IPC_HANDLE_BYTES];

/// True when libcuda can be loaded. Every other call needs it: cudarc panics without it.
pub(crate) fn driver_library_present() -> bool {
    // SAFETY: only tries to open the library; no other precondition.
    unsafe { sys::is_culib_present() }
}

fn to_bytes(reserved: [std::ffi::c_char; IPC_HANDLE_BYTES]) -> IpcHandle {
    reserved.map(|c| c as u8)
}

fn from_bytes(bytes: &IpcHandle) -> [std::ffi::c_char; IPC_HANDLE_BYTES] {
    bytes.map(|b| b as std::ffi::c_char)
}

/// `cuIpcGetMemHandle`: the IPC handle of the allocation containing `ptr`.
///
/// # Safety
/// A context must be current on this thread and `ptr` must be a live `cuMemAlloc` pointer.
pub(crate) unsafe fn ipc_get_mem_handle(ptr: sys::CUdeviceptr) -> Result<IpcHandle, DriverError> {
    let mut handle = MaybeUninit::<sys::CUipcMemHandle>::uninit();
    // SAFETY: the caller upholds the driver's preconditions; `handle` is writable.
    unsafe {
        sys::cuIpcGetMemHandle(handle.as_mut_ptr(), ptr).result()?;
        Ok(to_bytes(handle.assume_init().reserved))
    }
}

/// `cuIpcOpenMemHandle_v2` with lazy peer access: maps another process's allocation.
///
/// # Safety
/// A context must be current on this thread.
pub(crate) unsafe fn ipc_open_mem_handle(handle: &IpcHandle) -> Result<sys::CUdeviceptr, DriverError> {
    let mut ptr = MaybeUninit::uninit();
    let handle = sys::CUipcMemHandle { reserved: from_bytes(handle) };
    let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint;
    // SAFETY: the caller made a context current; the driver validates the handle.
    unsafe {
        sys::cuIpcOpenMemHandle_v2(ptr.as_mut_ptr(), handle, flags).result()?;
        Ok(ptr.assume_init())
    }
}

/// `cuIpcCloseMemHandle`: unmaps an allocation opened with [`ipc_open_mem_handle`].
///
/// # Safety
/// `ptr` must come from `ipc_open_mem_handle` in the current context and not be used after.
pub(crate) unsafe fn ipc_close_mem_handle(ptr: sys::CUdeviceptr) -> Result<(), DriverError> {
    // SAFETY: upheld by the caller.
    unsafe { sys::cuIpcCloseMemHandle(ptr).result() }
}

/// `cuIpcGetEventHandle` of an event created with the interprocess flag.
///
/// # Safety
/// A context must be current and `event` a live interprocess event.
pub(crate) unsafe fn ipc_get_event_handle(event: sys::CUevent) -> Result<IpcHandle, DriverError> {
    let mut handle = MaybeUninit::<sys::CUipcEventHandle>::uninit();
    // SAFETY: upheld by the caller; `handle` is writable.
    unsafe {
        sys::cuIpcGetEventHandle(handle.as_mut_ptr(), event).result()?;
        Ok(to_bytes(handle.assume_init().reserved))
    }
}

/// `cuIpcOpenEventHandle`: opens another process's interprocess event.
///
/// # Safety
/// A context must be current on this thread.
pub(crate) unsafe fn ipc_open_event_handle(handle: &IpcHandle) -> Result<sys::CUevent, DriverError> {
    let mut event = MaybeUninit::uninit();
    let handle = sys::CUipcEventHandle { reserved: from_bytes(handle) };
    // SAFETY: the caller made a context current; the driver validates the handle.
    unsafe {
        sys::cuIpcOpenEventHandle(event.as_mut_ptr(), handle).result()?;
        Ok(event.assume_init())
    }
}

/// `cuMemGetAddressRange_v2`: base and size of the allocation containing `ptr`.
///
/// # Safety
/// A context must be current on this thread.
pub(crate) unsafe fn mem_address_range(ptr: sys::CUdeviceptr) -> Result<(sys::CUdeviceptr, usize), DriverError> {
    let mut base = MaybeUninit::uninit();
    let mut size = MaybeUninit::uninit();
    // SAFETY: upheld by the caller; outputs are writable.
    unsafe {
        sys::cuMemGetAddressRange_v2(base.as_mut_ptr(), size.as_mut_ptr(), ptr).result()?;
        Ok((base.assume_init(), size.assume_init()))
    }
}

/// `cuStreamWaitEvent`: work queued later on `stream` waits for `event` (no host block).
///
/// # Safety
/// A context must be current; `stream` and `event` must be live.
pub(crate) unsafe fn stream_wait_event(stream: sys::CUstream, event: sys::CUevent) -> Result<(), DriverError> {
    // SAFETY: upheld by the caller.
    unsafe { sys::cuStreamWaitEvent(stream, event, 0).result() }
}

/// `cuMemsetD8Async`: sets `bytes` bytes at `ptr` to `value`, ordered on `stream`.
///
/// # Safety
/// A context must be current and `ptr..ptr + bytes` device memory owned by the caller.
pub(crate) unsafe fn memset_d8_async(
    ptr: sys::CUdeviceptr,
    value: u8,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<(), DriverError> {
    // SAFETY: upheld by the caller.
    unsafe { sys::cuMemsetD8Async(ptr, value, bytes, stream).result() }
}

/// `cuDeviceCanAccessPeer`.
pub(crate) fn can_access_peer(dev: sys::CUdevice, peer: sys::CUdevice) -> Result<bool, DriverError> {
    let mut can = 0;
    // SAFETY: `can` is writable; the driver validates the device handles.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, dev, peer).result()? };
    Ok(can != 0)
}

/// A kernel parameter list as the driver wants it.
pub(crate) type KernelParams<'a> = &'a mut [*mut c_void];

/// `cuEventCreate` with `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`: an event whose
/// handle another process can open.
///
/// # Safety
/// A context must be current on this thread.
pub(crate) unsafe fn event_create_interprocess() -> Result<sys::CUevent, DriverError> {
    let flags =
        sys::CUevent_flags::CU_EVENT_INTERPROCESS as c_uint | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
    let mut event = MaybeUninit::uninit();
    // SAFETY: the caller made a context current; `event` is writable.
    unsafe {
        sys::cuEventCreate(event.as_mut_ptr(), flags).result()?;
        Ok(event.assume_init())
    }
}

/// `cuStreamQuery`: true when every piece of work queued on `stream` is done.
///
/// # Safety
/// A context must be current and `stream` live.
pub(crate) unsafe fn stream_is_idle(stream: sys::CUstream) -> Result<bool, DriverError> {
    // SAFETY: upheld by the caller.
    match unsafe { sys::cuStreamQuery(stream) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        e => Err(DriverError(e)),
    }
}

/// `cuEventQuery`: true when the work before the event's latest record is done.
///
/// # Safety
/// A context must be current and `event` live.
pub(crate) unsafe fn event_is_complete(event: sys::CUevent) -> Result<bool, DriverError> {
    // SAFETY: upheld by the caller.
    match unsafe { sys::cuEventQuery(event) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        e => Err(DriverError(e)),
    }
}
