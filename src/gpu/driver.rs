//! The one layer that calls CUDA driver entry points Rust cannot check (all of
//! `cudarc::driver::sys`, and the `unsafe` functions of `cudarc::driver::result`), each wrapped
//! once here with the reason the call is sound. The `unsafe fn`s over driver objects leave their
//! preconditions to the owners in `handles.rs`; the memset, the copies and the kernel arguments
//! check theirs ([`DeviceRange`], [`KernelView::new`]). Raw wrappers return cudarc's
//! `DriverError`, named by the caller with [`driver_err`]. See README.md here.

use std::any::TypeId;
use std::ffi::{CStr, c_int, c_uint, c_void};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaStream};
use half::{bf16, f16};

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::layout::{Layout, MAX_DIMS};

/// What a raw wrapper returns: the driver's own error, named by the caller.
pub(crate) type DriverResult<T> = std::result::Result<T, DriverError>;

/// Size of an IPC memory or event handle.
pub(crate) const IPC_HANDLE_BYTES: usize = 64;

/// An IPC handle as plain bytes.
pub(crate) type IpcHandle = [u8; IPC_HANDLE_BYTES];

/// Maps a driver error to the crate's error, naming the call and keeping its `CUresult`.
pub(crate) fn driver_err(call: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| {
        let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{e:?}"));
        let text = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        Error::Driver { call, code: e.0, message: format!("{name}: {text}") }
    }
}

/// True when libcuda can be loaded. Every other call needs it: cudarc panics without it.
pub(crate) fn driver_library_present() -> bool {
    // SAFETY: only tries to open the library; no other precondition.
    unsafe { sys::is_culib_present() }
}

/// The process generation (`crate::fork`) in which this process initialized the driver;
/// `u64::MAX` until it does.
static CUDA_GENERATION: AtomicU64 = AtomicU64::new(u64::MAX);

/// Records that this process initialized the driver.
pub(crate) fn mark_initialized() {
    CUDA_GENERATION.store(crate::fork::generation(), Ordering::SeqCst);
}

/// True once this process (or the parent it was forked from) initialized the driver.
pub(crate) fn initialized() -> bool {
    CUDA_GENERATION.load(Ordering::SeqCst) != u64::MAX
}

/// Refuses every CUDA call in a child forked after its parent initialized the driver: CUDA's
/// state does not survive `fork`, and its objects (contexts, memory, events) are the
/// parent's. Such a child drops what it inherited without calling the driver.
pub(crate) fn check_not_forked() -> Result<()> {
    match CUDA_GENERATION.load(Ordering::SeqCst) {
        u64::MAX => Ok(()),
        g if g == crate::fork::generation() => Ok(()),
        _ => Err(Error::CudaUnavailable(FORKED_AFTER_CUDA.into())),
    }
}

/// Why CUDA is refused in a forked child, and what to do instead.
pub(crate) const FORKED_AFTER_CUDA: &str = "this process was forked after its parent initialized CUDA, and CUDA \
     cannot be used in a forked child: start processes with spawn or forkserver (cuda-mp's own spawn, or \
     multiprocessing's 'spawn' or 'forkserver' start method)";

/// Makes `ctx` current on the calling thread (what every driver call needs first).
pub(crate) fn bind(ctx: &CudaContext) -> Result<()> {
    check_not_forked()?;
    ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))
}

fn to_bytes(reserved: [std::ffi::c_char; IPC_HANDLE_BYTES]) -> IpcHandle {
    reserved.map(|c| c as u8)
}

fn from_bytes(bytes: &IpcHandle) -> [std::ffi::c_char; IPC_HANDLE_BYTES] {
    bytes.map(|b| b as std::ffi::c_char)
}

// ---------------------------------------------------------------------------------------------
// Allocations and IPC mappings (owned by `handles::DeviceAllocation` and `handles::IpcMapping`).

/// `cuMemAlloc`: `bytes` bytes (not zero) of device memory that legacy IPC can export.
///
/// # Safety
/// A context must be current on this thread. The pointer must be freed once, with [`mem_free`].
pub(crate) unsafe fn mem_alloc(bytes: usize) -> DriverResult<sys::CUdeviceptr> {
    let mut ptr = MaybeUninit::uninit();
    // SAFETY: the caller made a context current; `ptr` is writable and set on success.
    unsafe {
        sys::cuMemAlloc_v2(ptr.as_mut_ptr(), bytes).result()?;
        Ok(ptr.assume_init())
    }
}

/// `cuMemFree`.
///
/// # Safety
/// `ptr` must come from [`mem_alloc`] in the current context, with no work queued on it, and
/// not be used after.
pub(crate) unsafe fn mem_free(ptr: sys::CUdeviceptr) -> DriverResult<()> {
    // SAFETY: upheld by the caller.
    unsafe { sys::cuMemFree_v2(ptr).result() }
}

/// `cuIpcGetMemHandle`: the IPC handle of the allocation containing `ptr`.
///
/// # Safety
/// A context must be current on this thread and `ptr` must be a live `cuMemAlloc` pointer.
pub(crate) unsafe fn ipc_get_mem_handle(ptr: sys::CUdeviceptr) -> DriverResult<IpcHandle> {
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
/// A context must be current on this thread. The mapping must be closed once, with
/// [`ipc_close_mem_handle`].
pub(crate) unsafe fn ipc_open_mem_handle(handle: &IpcHandle) -> DriverResult<sys::CUdeviceptr> {
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
pub(crate) unsafe fn ipc_close_mem_handle(ptr: sys::CUdeviceptr) -> DriverResult<()> {
    // SAFETY: upheld by the caller.
    unsafe { sys::cuIpcCloseMemHandle(ptr).result() }
}

/// `cuMemGetAddressRange_v2`: base and size of the allocation containing `ptr`.
///
/// # Safety
/// A context must be current on this thread.
pub(crate) unsafe fn mem_address_range(ptr: sys::CUdeviceptr) -> DriverResult<(sys::CUdeviceptr, usize)> {
    let mut base = MaybeUninit::uninit();
    let mut size = MaybeUninit::uninit();
    // SAFETY: upheld by the caller; outputs are writable.
    unsafe {
        sys::cuMemGetAddressRange_v2(base.as_mut_ptr(), size.as_mut_ptr(), ptr).result()?;
        Ok((base.assume_init(), size.assume_init()))
    }
}

// ---------------------------------------------------------------------------------------------
// Virtual memory management (owned by `handles::VmmRegion`).

/// The shareable handle type of cuda-mp's VMM memory: a POSIX file descriptor (an `int`).
const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

/// A generic allocation handle (`CUmemGenericAllocationHandle`) of physical memory, made with
/// [`mem_create`] or imported with [`mem_import_fd`]. The value never leaves this file. Not
/// `Clone`: it is released once, by value, with [`mem_release`], so a borrowed handle is live
/// (one dropped without release leaks the memory, nothing worse).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct AllocationHandle(sys::CUmemGenericAllocationHandle);

/// `CUmemLocation` of device `dev`.
fn device_location(dev: sys::CUdevice) -> sys::CUmemLocation {
    sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: dev }
}

/// The properties of the VMM memory cuda-mp makes: pinned memory on `dev`, exportable as a
/// POSIX file descriptor.
fn fd_exportable_props(dev: sys::CUdevice) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: POSIX_FD,
        location: device_location(dev),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// `cuMemGetAllocationGranularity` (`CU_MEM_ALLOC_GRANULARITY_MINIMUM`) of the memory
/// [`mem_create`] makes on `dev`: sizes, offsets and addresses of mappings are multiples of it.
pub(crate) fn vmm_granularity(dev: sys::CUdevice) -> DriverResult<usize> {
    let prop = fd_exportable_props(dev);
    let mut granularity = 0usize;
    let option = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
    // SAFETY: `granularity` is writable; `prop` is a complete property struct (valid enum
    // values, null Windows metadata) that outlives the call; the driver validates the device.
    unsafe { sys::cuMemGetAllocationGranularity(&mut granularity, &prop, option).result()? };
    Ok(granularity)
}

/// `cuMemCreate`: `bytes` bytes (a nonzero multiple of [`vmm_granularity`]) of pinned memory
/// on `dev`, exportable as a POSIX file descriptor, mapped nowhere yet.
pub(crate) fn mem_create(dev: sys::CUdevice, bytes: usize) -> DriverResult<AllocationHandle> {
    let prop = fd_exportable_props(dev);
    let mut handle = MaybeUninit::uninit();
    // SAFETY: `handle` is writable and set on success; `prop` is a complete property struct
    // that outlives the call; flags must be 0. The driver validates the device and the size.
    unsafe {
        sys::cuMemCreate(handle.as_mut_ptr(), bytes, &prop, 0).result()?;
        Ok(AllocationHandle(handle.assume_init()))
    }
}

/// `cuMemImportFromShareableHandle` of a POSIX file descriptor exported by
/// [`mem_export_fd`] (in this process or another). The descriptor is only read: the caller
/// still owns it and may close it as soon as this returns (the handle holds the memory).
pub(crate) fn mem_import_fd(fd: BorrowedFd<'_>) -> DriverResult<AllocationHandle> {
    let mut handle = MaybeUninit::uninit();
    // For this handle type `osHandle` is the descriptor's value itself in the pointer's place
    // (`(void *)(uintptr_t)fd` in C), not the address of an `int`. A `BorrowedFd` is never
    // negative, so the widening keeps the value.
    let os_handle = std::ptr::without_provenance_mut::<c_void>(fd.as_raw_fd() as usize);
    // SAFETY: `handle` is writable and set on success; the driver never dereferences
    // `os_handle` for this handle type, and validates the descriptor (one that is not a CUDA
    // export is an error); `fd` stays open for the call (it is borrowed) and is not closed by it.
    unsafe {
        sys::cuMemImportFromShareableHandle(handle.as_mut_ptr(), os_handle, POSIX_FD).result()?;
        Ok(AllocationHandle(handle.assume_init()))
    }
}

/// `cuMemExportToShareableHandle` as a POSIX file descriptor: a new descriptor, owned by the
/// caller, that another process imports with [`mem_import_fd`]. The memory lives while any
/// descriptor or handle of it is open.
pub(crate) fn mem_export_fd(handle: &AllocationHandle) -> DriverResult<OwnedFd> {
    let mut fd: c_int = -1;
    // SAFETY: for this handle type the driver writes one `int` through `shareableHandle`,
    // which points at `fd`; the handle is live (handles are released only by value); flags
    // must be 0.
    unsafe {
        sys::cuMemExportToShareableHandle(&mut fd as *mut c_int as *mut c_void, handle.0, POSIX_FD, 0).result()?;
    }
    if fd < 0 {
        return Err(DriverError(sys::CUresult::CUDA_ERROR_UNKNOWN));
    }
    // SAFETY: the driver has just opened `fd` for the caller, who now owns it; nothing else
    // refers to it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `cuMemRelease`: gives back this handle's reference on the memory, which is freed when no
/// handle, descriptor or mapping of it is left (mappings made with the handle stay valid).
pub(crate) fn mem_release(handle: AllocationHandle) -> DriverResult<()> {
    // SAFETY: the handle is live (handles are released only by value, here) and not used after.
    unsafe { sys::cuMemRelease(handle.0).result() }
}

/// `CUmemAllocationProp` as the driver may write it: every enum as a plain `u32`, since a
/// newer driver may write values that the bindings' Rust enums do not have (reading those as
/// the enums would be undefined behavior).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct AllocationProps {
    type_: u32,
    requested_handle_types: u32,
    location_type: u32,
    location_id: c_int,
    win32_handle_meta_data: *mut c_void,
    alloc_flags: [u8; 8],
}

const _: () = {
    assert!(std::mem::size_of::<AllocationProps>() == std::mem::size_of::<sys::CUmemAllocationProp>());
    assert!(std::mem::align_of::<AllocationProps>() == std::mem::align_of::<sys::CUmemAllocationProp>());
};

impl AllocationProps {
    /// The device holding memory of these properties, when it is pinned device memory that can
    /// be shared as a POSIX file descriptor; otherwise what is wrong with it.
    pub(crate) fn fd_shareable_device(&self) -> std::result::Result<sys::CUdevice, String> {
        if self.type_ != sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED as u32 {
            return Err(format!("the imported memory is not pinned memory (allocation type {})", self.type_));
        }
        if self.location_type != sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as u32 {
            return Err(format!("the imported memory is not on a gpu (location type {})", self.location_type));
        }
        // The handle types are not checked: the driver reports none for an imported handle
        // (seen on driver 580), although the memory was exported as a descriptor.
        Ok(self.location_id)
    }
}

/// `cuMemGetAllocationPropertiesFromHandle`.
pub(crate) fn mem_allocation_props(handle: &AllocationHandle) -> DriverResult<AllocationProps> {
    let mut prop = MaybeUninit::<AllocationProps>::zeroed();
    // SAFETY: `prop` is writable, with the size and alignment of `CUmemAllocationProp` (checked
    // above) and plain integer fields (any value is valid); the handle is live.
    unsafe {
        sys::cuMemGetAllocationPropertiesFromHandle(prop.as_mut_ptr() as *mut sys::CUmemAllocationProp, handle.0)
            .result()?;
        Ok(prop.assume_init())
    }
}

/// `cuMemAddressReserve`: `size` bytes of this process's device address space (a multiple of
/// the granularity), aligned to `alignment` (a power of two, or 0 for the default), backed by
/// nothing yet. Must be given back once with [`mem_address_free`].
pub(crate) fn mem_address_reserve(size: usize, alignment: usize) -> DriverResult<sys::CUdeviceptr> {
    let mut ptr = MaybeUninit::uninit();
    // SAFETY: `ptr` is writable and set on success; no address hint, flags must be 0; the
    // driver validates size and alignment. Reserving addresses touches no memory.
    unsafe {
        sys::cuMemAddressReserve(ptr.as_mut_ptr(), size, alignment, 0, 0).result()?;
        Ok(ptr.assume_init())
    }
}

/// `cuMemAddressFree`.
///
/// # Safety
/// `ptr` and `size` must be exactly a reservation from [`mem_address_reserve`], with nothing
/// mapped in it any more, and not used after.
pub(crate) unsafe fn mem_address_free(ptr: sys::CUdeviceptr, size: usize) -> DriverResult<()> {
    // SAFETY: upheld by the caller.
    unsafe { sys::cuMemAddressFree(ptr, size).result() }
}

/// `cuMemMap`: maps the first `size` bytes of `handle`'s memory at `ptr`. The memory is not
/// accessible until [`mem_set_access`].
///
/// # Safety
/// `ptr` and `size` must be exactly a reservation from [`mem_address_reserve`] that the caller
/// owns, with nothing mapped in it. The mapping must be undone once with [`mem_unmap`].
pub(crate) unsafe fn mem_map(ptr: sys::CUdeviceptr, size: usize, handle: &AllocationHandle) -> DriverResult<()> {
    // SAFETY: upheld by the caller; the handle is live; offset and flags must be 0. The driver
    // checks `size` against the memory.
    unsafe { sys::cuMemMap(ptr, size, 0, handle.0, 0).result() }
}

/// `cuMemSetAccess`: makes the `size` bytes mapped at `ptr` readable and writable by device
/// `dev` (the GPU holding the memory, or a peer of it).
///
/// # Safety
/// `ptr` and `size` must be exactly a mapping made with [`mem_map`] that the caller owns.
pub(crate) unsafe fn mem_set_access(ptr: sys::CUdeviceptr, size: usize, dev: sys::CUdevice) -> DriverResult<()> {
    let desc = sys::CUmemAccessDesc {
        location: device_location(dev),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: upheld by the caller; `desc` is one complete access descriptor that outlives the
    // call. The driver validates the device.
    unsafe { sys::cuMemSetAccess(ptr, size, &desc, 1).result() }
}

/// `cuMemUnmap`.
///
/// # Safety
/// `ptr` and `size` must be exactly a mapping made with [`mem_map`] that the caller owns, with
/// no work queued on it, and not used after.
pub(crate) unsafe fn mem_unmap(ptr: sys::CUdeviceptr, size: usize) -> DriverResult<()> {
    // SAFETY: upheld by the caller.
    unsafe { sys::cuMemUnmap(ptr, size).result() }
}

// ---------------------------------------------------------------------------------------------
// Events (owned by `handles::Event`).

/// `cuEventCreate` with `flag | CU_EVENT_DISABLE_TIMING`: with `CU_EVENT_INTERPROCESS`, an
/// event whose handle another process can open; with `CU_EVENT_BLOCKING_SYNC`, one of this
/// process that a thread waits on asleep, not spinning.
///
/// # Safety
/// A context must be current on this thread. The event must be destroyed once, with
/// [`event_destroy`].
pub(crate) unsafe fn event_create(flag: sys::CUevent_flags) -> DriverResult<sys::CUevent> {
    let flags = flag as c_uint | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
    let mut event = MaybeUninit::uninit();
    // SAFETY: the caller made a context current; `event` is writable.
    unsafe {
        sys::cuEventCreate(event.as_mut_ptr(), flags).result()?;
        Ok(event.assume_init())
    }
}

/// `cuEventSynchronize`: blocks until the work before the event's latest record is done.
///
/// # Safety
/// A context must be current and `event` live.
pub(crate) unsafe fn event_synchronize(event: sys::CUevent) -> DriverResult<()> {
    // SAFETY: upheld by the caller.
    unsafe { sys::cuEventSynchronize(event).result() }
}

/// `cuIpcGetEventHandle` of an event created with the interprocess flag.
///
/// # Safety
/// A context must be current and `event` a live interprocess event.
pub(crate) unsafe fn ipc_get_event_handle(event: sys::CUevent) -> DriverResult<IpcHandle> {
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
/// A context must be current on this thread. The event must be destroyed once, with
/// [`event_destroy`].
pub(crate) unsafe fn ipc_open_event_handle(handle: &IpcHandle) -> DriverResult<sys::CUevent> {
    let mut event = MaybeUninit::uninit();
    let handle = sys::CUipcEventHandle { reserved: from_bytes(handle) };
    // SAFETY: the caller made a context current; the driver validates the handle.
    unsafe {
        sys::cuIpcOpenEventHandle(event.as_mut_ptr(), handle).result()?;
        Ok(event.assume_init())
    }
}

/// `cuEventRecord`: the event completes when the work queued on `stream` so far is done.
///
/// # Safety
/// The event's context must be current; `event` and `stream` must be live and of that context.
pub(crate) unsafe fn event_record(event: sys::CUevent, stream: sys::CUstream) -> DriverResult<()> {
    // SAFETY: upheld by the caller.
    unsafe { sys::cuEventRecord(event, stream).result() }
}

/// `cuEventQuery`: true when the work before the event's latest record is done.
///
/// # Safety
/// A context must be current and `event` live.
pub(crate) unsafe fn event_is_complete(event: sys::CUevent) -> DriverResult<bool> {
    // SAFETY: upheld by the caller.
    match unsafe { sys::cuEventQuery(event) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        e => Err(DriverError(e)),
    }
}

/// `cuStreamWaitEvent`: work queued later on `stream` waits for `event` (no host block).
///
/// # Safety
/// A context must be current; `stream` and `event` must be live (the event may belong to
/// another context or device).
pub(crate) unsafe fn stream_wait_event(stream: sys::CUstream, event: sys::CUevent) -> DriverResult<()> {
    // SAFETY: upheld by the caller.
    unsafe { sys::cuStreamWaitEvent(stream, event, 0).result() }
}

/// `cuEventDestroy`. Work already waiting on the event is not affected.
///
/// # Safety
/// `event` must be live, created or opened in the current context, and not used after.
pub(crate) unsafe fn event_destroy(event: sys::CUevent) -> DriverResult<()> {
    // SAFETY: upheld by the caller.
    unsafe { sys::cuEventDestroy_v2(event).result() }
}

/// `cuCtxGetCurrent`: the calling thread's current context (null when none).
///
/// # Safety
/// The driver must be initialized.
pub(crate) unsafe fn ctx_get_current() -> DriverResult<sys::CUcontext> {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: upheld by the caller; the driver writes one handle into `ctx`.
    unsafe { sys::cuCtxGetCurrent(&mut ctx).result()? };
    Ok(ctx)
}

/// `cuCtxSetCurrent`: makes `ctx` (or none, for null) the calling thread's current context.
///
/// # Safety
/// The driver must be initialized; `ctx` must be null or a live context.
pub(crate) unsafe fn ctx_set_current(ctx: sys::CUcontext) -> DriverResult<()> {
    // SAFETY: upheld by the caller.
    unsafe { sys::cuCtxSetCurrent(ctx).result() }
}

/// `cuStreamSynchronize` on another library's stream: blocks until its queued work is done.
///
/// # Safety
/// The stream's context must be current and `stream` live (or 0 or 2, the default streams).
pub(crate) unsafe fn stream_synchronize_raw(stream: sys::CUstream) -> DriverResult<()> {
    // SAFETY: upheld by the caller.
    unsafe { sys::cuStreamSynchronize(stream).result() }
}

/// `cuStreamQuery` on another library's stream: true when every piece of work queued on it is
/// done.
///
/// # Safety
/// The stream's context must be current and `stream` live (or 0 or 2, the default streams).
pub(crate) unsafe fn stream_is_idle_raw(stream: sys::CUstream) -> DriverResult<bool> {
    // SAFETY: upheld by the caller.
    match unsafe { sys::cuStreamQuery(stream) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        e => Err(DriverError(e)),
    }
}

/// `cuStreamQuery`: true when every piece of work queued on `stream` is done.
pub(crate) fn stream_is_idle(stream: &CudaStream) -> Result<bool> {
    bind(stream.context())?;
    // SAFETY: the stream is live (cudarc owns it) and its context is current.
    unsafe { stream_is_idle_raw(stream.cu_stream()) }.map_err(driver_err("cuStreamQuery"))
}

/// `cuDeviceCanAccessPeer`.
pub(crate) fn can_access_peer(dev: sys::CUdevice, peer: sys::CUdevice) -> DriverResult<bool> {
    let mut can = 0;
    // SAFETY: `can` is writable; the driver validates the device handles.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, dev, peer).result()? };
    Ok(can != 0)
}

/// `cuCtxEnablePeerAccess`: lets `ctx` (made current here) reach the memory of `peer`'s context
/// directly (NVLink or PCIe), for copies and kernels. Already enabled is success.
pub(crate) fn enable_peer_access(ctx: &CudaContext, peer: &CudaContext) -> Result<()> {
    bind(ctx)?;
    // SAFETY: `ctx` is current; `peer` is a live context (cudarc owns both); flags must be 0.
    match unsafe { sys::cuCtxEnablePeerAccess(peer.cu_ctx(), 0) } {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
        e => Err(driver_err("cuCtxEnablePeerAccess")(DriverError(e))),
    }
}

// ---------------------------------------------------------------------------------------------
// Memset and copies: safe, bounds-checked.

/// Device memory that an operation may touch: `len` bytes from `ptr`.
///
/// Only the owners in `handles.rs` make one, over the memory they hold (an allocation or a
/// mapping); narrower ranges come from [`DeviceRange::sub`]. That memory stays alive until the
/// device's stream has finished the work queued on it: the owners synchronize before they free
/// or unmap. The operations below never touch a byte outside the range they are given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeviceRange {
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl DeviceRange {
    /// The `len` bytes from `ptr` of memory the caller holds (for the owners in `handles.rs`).
    pub(super) fn new(ptr: sys::CUdeviceptr, len: usize) -> DeviceRange {
        DeviceRange { ptr, len }
    }

    /// Whether the range starts at a multiple of `bytes`.
    pub(crate) fn is_aligned_to(&self, bytes: usize) -> bool {
        self.ptr.is_multiple_of(bytes as u64)
    }

    /// True when the range holds no byte.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its length in bytes.
    #[cfg(feature = "remote")]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Its first byte's device address, for the NCCL calls (`nccl.rs`).
    #[cfg(feature = "remote")]
    pub(super) fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// The `len` bytes from byte `offset` of this range; an error when they do not lie inside.
    pub(crate) fn sub(&self, offset: usize, len: usize) -> Result<DeviceRange> {
        let end = offset.checked_add(len).filter(|&end| end <= self.len).ok_or_else(|| {
            Error::Layout(format!(
                "bytes {offset}..{} lie outside the {}-byte device memory",
                offset.saturating_add(len),
                self.len
            ))
        })?;
        let ptr = self.ptr.checked_add(offset as u64).filter(|p| p.checked_add((end - offset) as u64).is_some());
        let ptr = ptr.ok_or_else(|| Error::Layout("device address overflows".into()))?;
        Ok(DeviceRange { ptr, len })
    }
}

fn check_same_len(what: &str, have: usize, want: &DeviceRange) -> Result<()> {
    if have != want.len {
        return Err(Error::Layout(format!("{what} of {have} bytes into {} bytes of device memory", want.len)));
    }
    Ok(())
}

/// `cuMemsetD8Async`: sets every byte of `dst` to `value`, ordered on `stream`.
pub(crate) fn memset_d8(stream: &CudaStream, dst: DeviceRange, value: u8) -> Result<()> {
    bind(stream.context())?;
    // SAFETY: the context is current and the stream live; `dst` is memory the caller holds
    // (see `DeviceRange`) and the write stays inside it.
    unsafe { sys::cuMemsetD8Async(dst.ptr, value, dst.len, stream.cu_stream()) }
        .result()
        .map_err(driver_err("cuMemsetD8Async"))
}

/// Copies `src` into `dst` (exactly its length) after the work queued on `stream`, and waits
/// for the copy: for the stream, even when there is nothing to copy (a caller takes a return
/// as the stream's work done, `Device::enqueue_synchronized`).
pub(crate) fn copy_htod<T: Element>(stream: &CudaStream, src: &[T], dst: DeviceRange) -> Result<()> {
    let bytes = std::mem::size_of_val(src);
    check_same_len("a copy", bytes, &dst)?;
    bind(stream.context())?;
    if bytes == 0 {
        return stream.synchronize().map_err(driver_err("cuStreamSynchronize"));
    }
    // SAFETY: the context is current and the stream live; `src` is `bytes` readable bytes (every
    // element type is plain data without padding) and stays borrowed until the stream is
    // synchronized below; `dst` is memory the caller holds, exactly `bytes` long.
    unsafe { sys::cuMemcpyHtoDAsync_v2(dst.ptr, src.as_ptr() as *const c_void, bytes, stream.cu_stream()) }
        .result()
        .map_err(driver_err("cuMemcpyHtoDAsync"))?;
    stream.synchronize().map_err(driver_err("cuStreamSynchronize"))
}

/// How the bytes of an element type may be written by the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HostRepr {
    /// Every bit pattern is a value: the device's bytes are the elements.
    Plain,
    /// `bool`: a byte another process wrote may be neither 0 nor 1; normalized after the copy.
    Bool,
}

/// The representation of `T`, by its exact type (not by the element trait's word for it).
fn host_repr<T: 'static>() -> Option<HostRepr> {
    let t = TypeId::of::<T>();
    let plain = [
        TypeId::of::<f32>(),
        TypeId::of::<f64>(),
        TypeId::of::<f16>(),
        TypeId::of::<bf16>(),
        TypeId::of::<i8>(),
        TypeId::of::<u8>(),
        TypeId::of::<i16>(),
        TypeId::of::<i32>(),
        TypeId::of::<i64>(),
    ];
    if plain.contains(&t) {
        Some(HostRepr::Plain)
    } else if t == TypeId::of::<bool>() {
        Some(HostRepr::Bool)
    } else {
        None
    }
}

/// Turns bytes of any value into valid `bool` bytes: non-zero reads as true.
fn normalize_bools(bytes: &mut [u8]) {
    for b in bytes {
        *b = (*b != 0) as u8;
    }
}

/// The number of `T` elements in `bytes` bytes, or an error when they do not divide.
fn element_count<T>(bytes: usize) -> Result<usize> {
    let size = std::mem::size_of::<T>();
    if size == 0 || !bytes.is_multiple_of(size) {
        return Err(Error::Layout(format!("{bytes} bytes are not a whole number of {size}-byte elements")));
    }
    Ok(bytes / size)
}

/// Copies `src` to a new host vector after the work queued on `stream`, straight into the
/// vector's memory (one copy), and waits for it (for the stream, even when there is nothing
/// to copy, as `copy_htod`). `bool` bytes are normalized to 0 or 1.
pub(crate) fn copy_dtoh<T: Element>(stream: &CudaStream, src: DeviceRange) -> Result<Vec<T>> {
    let repr =
        host_repr::<T>().ok_or_else(|| Error::Unsupported(format!("copying {} elements to the host", T::DTYPE)))?;
    let n = element_count::<T>(src.len)?;
    let mut out: Vec<T> = Vec::with_capacity(n);
    bind(stream.context())?;
    if n == 0 {
        stream.synchronize().map_err(driver_err("cuStreamSynchronize"))?;
        return Ok(out);
    }
    let dst = out.as_mut_ptr() as *mut c_void;
    // SAFETY: the context is current and the stream live; `dst` is the vector's buffer, with
    // room for `n` elements = `src.len` bytes, and it is not freed or moved before the copy
    // ends (the stream is synchronized below; on failure the buffer is leaked). `src` is
    // memory the caller holds.
    unsafe { sys::cuMemcpyDtoHAsync_v2(dst, src.ptr, src.len, stream.cu_stream()) }
        .result()
        .map_err(driver_err("cuMemcpyDtoHAsync"))?;
    if let Err(e) = stream.synchronize() {
        // The copy may still be under way: never hand the buffer back to the allocator.
        std::mem::forget(out);
        return Err(driver_err("cuStreamSynchronize")(e));
    }
    if repr == HostRepr::Bool {
        // SAFETY: the copy is complete, so the first `src.len` bytes of the buffer are
        // initialized; they are viewed as bytes only, and no other reference to them exists.
        normalize_bools(unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, src.len) });
    }
    // SAFETY: the first `n` elements are initialized by the completed copy, and every byte
    // pattern is a valid `T` (plain types) or was normalized to 0 or 1 (`bool`).
    unsafe { out.set_len(n) };
    Ok(out)
}

/// `cuMemcpyPeerAsync`: copies `src` (in `src_ctx`'s device memory) into `dst` (same length),
/// ordered on `dst_stream`, whose context is the destination's.
pub(crate) fn copy_peer(
    dst_stream: &CudaStream,
    dst: DeviceRange,
    src_ctx: &CudaContext,
    src: DeviceRange,
) -> Result<()> {
    check_same_len("a peer copy", src.len, &dst)?;
    if dst.is_empty() {
        return Ok(());
    }
    let dst_ctx = dst_stream.context();
    bind(dst_ctx)?;
    // SAFETY: the context is current, the stream and both contexts live (cudarc owns them);
    // both ranges are memory the caller holds, of the same length.
    unsafe {
        sys::cuMemcpyPeerAsync(dst.ptr, dst_ctx.cu_ctx(), src.ptr, src_ctx.cu_ctx(), dst.len, dst_stream.cu_stream())
    }
    .result()
    .map_err(driver_err("cuMemcpyPeerAsync"))
}

// ---------------------------------------------------------------------------------------------
// Modules and kernels (owned by `handles::Module` and `handles::KernelFunction`).

/// `cuModuleLoadData` of a NUL-terminated PTX image.
///
/// # Safety
/// A context must be current on this thread. The module must be unloaded once, with
/// [`module_unload`], after its functions' last use.
pub(crate) unsafe fn module_load_data(image: &CStr) -> DriverResult<sys::CUmodule> {
    let mut module = MaybeUninit::uninit();
    // SAFETY: the caller made a context current; `image` is NUL-terminated and outlives the
    // call (the driver copies it).
    unsafe {
        sys::cuModuleLoadData(module.as_mut_ptr(), image.as_ptr() as *const c_void).result()?;
        Ok(module.assume_init())
    }
}

/// `cuModuleUnload`.
///
/// # Safety
/// `module` must be loaded in the current context; none of its functions may be used after.
pub(crate) unsafe fn module_unload(module: sys::CUmodule) -> DriverResult<()> {
    // SAFETY: upheld by the caller.
    unsafe { sys::cuModuleUnload(module).result() }
}

/// `cuModuleGetFunction`: the kernel called `name` in `module`.
///
/// # Safety
/// `module` must be loaded in the current context. The function is valid while it stays loaded.
pub(crate) unsafe fn module_get_function(module: sys::CUmodule, name: &CStr) -> DriverResult<sys::CUfunction> {
    let mut function = MaybeUninit::uninit();
    // SAFETY: upheld by the caller; `function` is writable and `name` NUL-terminated.
    unsafe {
        sys::cuModuleGetFunction(function.as_mut_ptr(), module, name.as_ptr()).result()?;
        Ok(function.assume_init())
    }
}

/// A view's layout as the shipped kernels take it: `struct Layout` in kernels.cu, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KernelLayout {
    numel: i64,
    ndim: i64,
    offset: i64,
    shape: [i64; MAX_DIMS],
    strides: [i64; MAX_DIMS],
}

impl KernelLayout {
    /// The kernel form of `layout`; an error when a number does not fit the kernel's `long long`.
    ///
    /// Dimensions of one element are dropped and neighbours that the view walks in one stride
    /// are merged (a contiguous view becomes one dimension): the kernels find an element's
    /// offset by a division per dimension, and by none for one dimension. The offset of every
    /// element in row-major order is unchanged.
    pub(crate) fn of(layout: &Layout) -> Result<KernelLayout> {
        let (shape, strides) = (layout.shape(), layout.strides());
        if shape.len() > MAX_DIMS || shape.len() != strides.len() {
            return Err(Error::Layout(format!(
                "a kernel takes at most {MAX_DIMS} dimensions with one stride each, not {} and {}",
                shape.len(),
                strides.len()
            )));
        }
        let big = || Error::Layout("view too large for a kernel".into());
        let int = |v: usize| i64::try_from(v).map_err(|_| big());
        // The kernels index up to the extent: it must fit too.
        int(layout.extent()?)?;
        let mut k = KernelLayout {
            numel: int(layout.numel())?,
            ndim: shape.len() as i64,
            offset: int(layout.offset())?,
            shape: [1; MAX_DIMS],
            strides: [0; MAX_DIMS],
        };
        let mut ndim = 0;
        for (&n, &s) in shape.iter().zip(strides) {
            let (n, s) = (int(n)?, int(s)?);
            if n == 1 && k.numel != 0 {
                continue;
            }
            // Outer (n0, s0) then inner (n, s) walk as one dimension of n0 * n in steps of s
            // when s0 = n * s (n0 * n fits: it is at most the element count).
            if ndim > 0 && k.numel != 0 && Some(k.strides[ndim - 1]) == n.checked_mul(s) {
                k.shape[ndim - 1] *= n;
                k.strides[ndim - 1] = s;
                continue;
            }
            k.shape[ndim] = n;
            k.strides[ndim] = s;
            ndim += 1;
        }
        k.ndim = ndim as i64;
        Ok(k)
    }

    /// Whether the kernels walk this view 16 bytes at a time (`split_contiguous` in
    /// kernels.cu): at most one dimension, of stride 1.
    fn is_contiguous(&self) -> bool {
        self.ndim == 0 || (self.ndim == 1 && self.strides[0] == 1)
    }
}

/// A strided view as a shipped kernel takes it: the base of its allocation and its layout,
/// checked to lie inside the allocation.
#[derive(Clone, Copy)]
pub(crate) struct KernelView {
    base: sys::CUdeviceptr,
    layout: KernelLayout,
    dtype: DType,
    numel: usize,
}

impl KernelView {
    /// The view `layout` of `dtype` elements over `alloc` (the storage the layout's offsets
    /// count from); an error when any element would lie outside `alloc`, or when `alloc`
    /// does not start at a multiple of the element's size (a kernel's load of a misaligned
    /// element faults the whole context; an imported storage may start anywhere).
    pub(crate) fn new(alloc: DeviceRange, layout: &Layout, dtype: DType) -> Result<KernelView> {
        if !alloc.is_aligned_to(dtype.size()) {
            return Err(Error::Layout(format!(
                "a kernel on {dtype} elements needs memory that starts at a multiple of {} bytes; this starts at {:#x}",
                dtype.size(),
                alloc.ptr
            )));
        }
        let kernel_layout = KernelLayout::of(layout)?;
        let extent = layout.extent()?;
        let fits = extent.checked_mul(dtype.size()).is_some_and(|end| end <= alloc.len);
        if !fits {
            return Err(Error::Layout(format!(
                "view reaches element {extent} of {} elements but its memory holds {} bytes",
                dtype, alloc.len
            )));
        }
        Ok(KernelView { base: alloc.ptr, layout: kernel_layout, dtype, numel: layout.numel() })
    }
}

/// The most views one launch of a `_many` kernel takes (`MANY` in kernels.cu).
pub(crate) const MANY: usize = 64;

/// Contiguous views of one element type, each with a value, as a `_many` kernel takes them:
/// `struct Many` in kernels.cu, field for field.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct KernelMany {
    count: i64,
    base: [u64; MANY],
    numel: [i64; MANY],
    bits: [u64; MANY],
}

// `struct Many` of kernels.cu: a count and three arrays of `MANY` 8-byte values, no padding.
const _: () = assert!(std::mem::size_of::<KernelMany>() == 8 + 3 * 8 * MANY);

/// Views for one launch of a `_many` kernel: at most [`MANY`], of one element type, each
/// contiguous and checked to lie inside its memory.
#[derive(Clone, Copy)]
pub(crate) struct ManyViews {
    many: KernelMany,
    dtype: DType,
    /// The largest view's element count: the launch's size.
    largest: usize,
}

impl ManyViews {
    /// No views yet, of `dtype` elements.
    pub(crate) fn new(dtype: DType) -> ManyViews {
        let many = KernelMany { count: 0, base: [0; MANY], numel: [0; MANY], bits: [0; MANY] };
        ManyViews { many, dtype, largest: 0 }
    }

    /// Whether no view is in.
    pub(crate) fn is_empty(&self) -> bool {
        self.many.count == 0
    }

    /// How many views are in.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.many.count as usize
    }

    /// Adds `view` with the value whose bits are `bits`; false (nothing added) where it does
    /// not fit a `_many` launch (contiguous, of this element type) or no room is left.
    pub(crate) fn push(&mut self, view: &KernelView, bits: u64) -> bool {
        if self.many.count as usize == MANY || view.dtype != self.dtype || !view.layout.is_contiguous() {
            return false;
        }
        let offset = view.layout.offset as u64 * view.dtype.size() as u64;
        let i = self.many.count as usize;
        // Inside the allocation (checked by `KernelView::new`), so no overflow.
        self.many.base[i] = view.base + offset;
        self.many.numel[i] = view.numel as i64;
        self.many.bits[i] = bits;
        self.many.count += 1;
        self.largest = self.largest.max(view.numel);
        true
    }
}

/// The shipped kernels' operations (kernels.cu): the kernel of `op` for `dtype` is named
/// `{op}_{dtype}` and takes the parameters of the matching [`KernelArgs`] variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum KernelOp {
    /// `fill_T(T* base, Layout l, unsigned long long bits)`.
    Fill,
    /// `add_T(T* base, Layout l, double v)`.
    Add,
    /// `copy_T(T* dst, Layout ld, const T* src, Layout ls)`.
    Copy,
    /// `count_ne_T(const T* base, Layout l, unsigned long long bits, unsigned long long* count)`.
    CountNe,
    /// `fill_many_T(Many m)`: a fill of each of up to [`MANY`] contiguous views.
    FillMany,
    /// `count_ne_many_T(Many m, unsigned long long* count)`: a count of each of up to [`MANY`]
    /// contiguous views.
    CountNeMany,
}

impl KernelOp {
    /// The name prefix in kernels.cu.
    pub(crate) fn name(self) -> &'static str {
        match self {
            KernelOp::Fill => "fill",
            KernelOp::Add => "add",
            KernelOp::Copy => "copy",
            KernelOp::CountNe => "count_ne",
            KernelOp::FillMany => "fill_many",
            KernelOp::CountNeMany => "count_ne_many",
        }
    }
}

/// The arguments of one launch of a shipped kernel.
#[derive(Clone, Copy)]
pub(crate) enum KernelArgs {
    /// Sets every element of `view` to the element whose bits are `bits` (zero-extended).
    Fill { view: KernelView, bits: u64 },
    /// Adds `value` to every element of `view`.
    Add { view: KernelView, value: f64 },
    /// Copies the view `src` into the view `dst`, element by element.
    Copy { dst: KernelView, src: KernelView },
    /// Adds to the 8-byte counter at `count` (checked to be 8 bytes of device memory) the
    /// number of elements of `view` whose bits differ from `bits`.
    CountNe { view: KernelView, bits: u64, count: DeviceRange },
    /// Sets every element of each view to its value's bits.
    FillMany { views: ManyViews },
    /// Adds to the 8-byte counter at `count` (checked as for `CountNe`) the number of elements
    /// of each view whose bits differ from its value's.
    CountNeMany { views: ManyViews, count: DeviceRange },
}

impl KernelArgs {
    /// How many elements a thread of the launch takes: fills, adds and counts walk a
    /// contiguous view a vector of 16 bytes at a time, anything else an element at a time.
    /// Only the launch's size depends on it: every kernel loops over what its grid does not
    /// cover.
    pub(crate) fn elements_per_thread(&self) -> usize {
        match self {
            KernelArgs::Fill { view, .. } | KernelArgs::Add { view, .. } | KernelArgs::CountNe { view, .. }
                if view.layout.is_contiguous() =>
            {
                16 / view.dtype.size()
            }
            KernelArgs::FillMany { views } | KernelArgs::CountNeMany { views, .. } => 16 / views.dtype.size(),
            _ => 1,
        }
    }

    /// Rows of the launch's grid: one a view for the `_many` kernels, else one.
    fn rows(&self) -> u32 {
        match self {
            KernelArgs::FillMany { views } | KernelArgs::CountNeMany { views, .. } => views.many.count.max(1) as u32,
            _ => 1,
        }
    }

    /// The operation, element type and element count these arguments are for; an error when a
    /// copy's two views differ in element type or count.
    pub(crate) fn signature(&self) -> Result<(KernelOp, DType, usize)> {
        match self {
            KernelArgs::CountNe { count, .. } | KernelArgs::CountNeMany { count, .. } if count.len != 8 => {
                Err(Error::Layout(format!("a counter of {} bytes, not 8", count.len)))
            }
            KernelArgs::Fill { view, .. } => Ok((KernelOp::Fill, view.dtype, view.numel)),
            KernelArgs::Add { view, .. } => Ok((KernelOp::Add, view.dtype, view.numel)),
            KernelArgs::CountNe { view, .. } => Ok((KernelOp::CountNe, view.dtype, view.numel)),
            KernelArgs::FillMany { views } => Ok((KernelOp::FillMany, views.dtype, views.largest)),
            KernelArgs::CountNeMany { views, .. } => Ok((KernelOp::CountNeMany, views.dtype, views.largest)),
            KernelArgs::Copy { dst, src } => {
                if dst.dtype != src.dtype || dst.numel != src.numel {
                    return Err(Error::Layout(format!(
                        "copy of {} {} elements into {} {} elements",
                        src.numel, src.dtype, dst.numel, dst.dtype
                    )));
                }
                Ok((KernelOp::Copy, dst.dtype, dst.numel))
            }
        }
    }
}

fn param<V>(v: &mut V) -> *mut c_void {
    v as *mut V as *mut c_void
}

/// `cuLaunchKernel` of `function` over `blocks` blocks of `threads` threads on `stream`, with
/// `args` as its parameters.
///
/// # Safety
/// `function` must be live (its module loaded) in the current context, and take exactly the
/// parameters of `args`' variant for `args`' element type (see [`KernelOp`]); `stream` must be
/// live in that context. The views' memory must be reachable from the device and stay alive
/// until the stream has run the kernel.
pub(crate) unsafe fn launch_kernel(
    function: sys::CUfunction,
    blocks: u32,
    threads: u32,
    stream: sys::CUstream,
    args: &KernelArgs,
) -> DriverResult<()> {
    // The driver copies the parameter values at launch: locals are enough.
    let rows = args.rows();
    let launch = |params: &mut [*mut c_void]| {
        // SAFETY: upheld by the caller; `params` points at one value per kernel parameter.
        unsafe {
            sys::cuLaunchKernel(
                function,
                blocks,
                rows,
                1,
                threads,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()
        }
    };
    match *args {
        KernelArgs::Fill { view, bits } => {
            let (mut base, mut layout, mut bits) = (view.base, view.layout, bits);
            launch(&mut [param(&mut base), param(&mut layout), param(&mut bits)])
        }
        KernelArgs::Add { view, value } => {
            let (mut base, mut layout, mut value) = (view.base, view.layout, value);
            launch(&mut [param(&mut base), param(&mut layout), param(&mut value)])
        }
        KernelArgs::CountNe { view, bits, count } => {
            let (mut base, mut layout, mut bits, mut count) = (view.base, view.layout, bits, count.ptr);
            launch(&mut [param(&mut base), param(&mut layout), param(&mut bits), param(&mut count)])
        }
        KernelArgs::Copy { dst, src } => {
            let (mut dst_base, mut dst_layout, mut src_base, mut src_layout) =
                (dst.base, dst.layout, src.base, src.layout);
            launch(&mut [param(&mut dst_base), param(&mut dst_layout), param(&mut src_base), param(&mut src_layout)])
        }
        KernelArgs::FillMany { views } => {
            let mut many = views.many;
            launch(&mut [param(&mut many)])
        }
        KernelArgs::CountNeMany { views, count } => {
            let (mut many, mut count) = (views.many, count.ptr);
            launch(&mut [param(&mut many), param(&mut count)])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_narrow_only_inside() {
        let r = DeviceRange::new(0x1000, 100);
        assert_eq!(r.sub(10, 90).unwrap(), DeviceRange::new(0x100a, 90));
        assert_eq!(r.sub(100, 0).unwrap(), DeviceRange::new(0x1064, 0));
        assert!(r.sub(10, 91).is_err());
        assert!(r.sub(101, 0).is_err());
        assert!(r.sub(usize::MAX, 2).is_err());
        assert!(DeviceRange::new(u64::MAX - 4, 100).sub(8, 1).is_err());
        assert!(r.sub(0, 0).unwrap().is_empty());
    }

    #[test]
    fn imported_vmm_memory_must_be_pinned_gpu_memory_shareable_as_a_descriptor() {
        let made = fd_exportable_props(3);
        // SAFETY: `AllocationProps` has the size and alignment of `CUmemAllocationProp` (checked
        // at compile time) and plain fields, so any bytes of one are a valid other.
        let props: AllocationProps = unsafe { std::mem::transmute_copy(&made) };
        assert_eq!((props.type_, props.requested_handle_types, props.location_type), (1, 1, 1));
        assert_eq!(props.fd_shareable_device(), Ok(3));
        let with = |f: &dyn Fn(&mut AllocationProps)| {
            let mut p = props;
            f(&mut p);
            p.fd_shareable_device()
        };
        // Several handle types, one of them a descriptor: fine.
        assert_eq!(with(&|p| p.requested_handle_types = 0x9), Ok(3));
        // Values the bindings' enums lack (a newer driver) are errors, not undefined behavior.
        assert!(with(&|p| p.type_ = 2).unwrap_err().contains("not pinned"));
        assert!(with(&|p| p.type_ = 0x7fff_ffff).unwrap_err().contains("not pinned"));
        assert!(with(&|p| p.location_type = 2).unwrap_err().contains("not on a gpu"));
        assert!(with(&|p| p.location_type = 6).unwrap_err().contains("not on a gpu"));
        // An imported handle reports no handle types.
        assert_eq!(with(&|p| p.requested_handle_types = 0), Ok(3));
    }

    #[test]
    fn copies_need_exact_lengths_and_whole_elements() {
        let r = DeviceRange::new(0x1000, 16);
        assert!(check_same_len("a copy", 16, &r).is_ok());
        assert!(check_same_len("a copy", 15, &r).is_err());
        assert!(check_same_len("a copy", 17, &r).is_err());
        assert_eq!(element_count::<f32>(16).unwrap(), 4);
        assert_eq!(element_count::<f64>(0).unwrap(), 0);
        assert!(element_count::<f64>(12).is_err());
        assert!(element_count::<()>(0).is_err());
    }

    #[test]
    fn host_copies_know_which_types_take_any_bytes() {
        assert_eq!(host_repr::<f32>(), Some(HostRepr::Plain));
        assert_eq!(host_repr::<bf16>(), Some(HostRepr::Plain));
        assert_eq!(host_repr::<i64>(), Some(HostRepr::Plain));
        assert_eq!(host_repr::<bool>(), Some(HostRepr::Bool));
        assert_eq!(host_repr::<char>(), None);
        assert_eq!(host_repr::<u32>(), None);
        let mut bytes = [0u8, 1, 2, 255];
        normalize_bools(&mut bytes);
        assert_eq!(bytes, [0, 1, 1, 1]);
    }

    #[test]
    fn contiguous_fills_adds_and_counts_take_a_vector_a_thread() {
        let mem = DeviceRange::new(0x1000, 16 << 20);
        let view = |l: &Layout, dtype| KernelView::new(mem, l, dtype).unwrap();
        let block = Layout::contiguous(&[32, 2, 16, 8, 128]).unwrap();
        let fill = |l: &Layout, dtype| KernelArgs::Fill { view: view(l, dtype), bits: 0 }.elements_per_thread();
        assert_eq!(fill(&block, DType::BF16), 8);
        assert_eq!(fill(&block, DType::U8), 16);
        assert_eq!(fill(&block, DType::F64), 2);
        let add = KernelArgs::Add { view: view(&block, DType::F32), value: 1.0 };
        assert_eq!(add.elements_per_thread(), 4);
        let count = KernelArgs::CountNe { view: view(&block, DType::I16), bits: 0, count: mem };
        assert_eq!(count.elements_per_thread(), 8);
        // A contiguous slice at any offset (the kernel splits off what lies before the first
        // 16-byte boundary), and a single element.
        let slice = Layout::new(vec![5, 7], vec![7, 1], 3, 100).unwrap();
        assert_eq!(fill(&slice, DType::F16), 8);
        assert_eq!(fill(&Layout::contiguous(&[1]).unwrap(), DType::F16), 8);
        // Strided views, and copies, an element a thread.
        assert_eq!(fill(&block.transpose(0, 4).unwrap(), DType::BF16), 1);
        assert_eq!(fill(&Layout::new(vec![4], vec![2], 0, 8).unwrap(), DType::BF16), 1);
        let copy = KernelArgs::Copy { dst: view(&block, DType::BF16), src: view(&block, DType::BF16) };
        assert_eq!(copy.elements_per_thread(), 1);
    }

    #[test]
    fn kernel_layouts_mirror_the_cuda_struct() {
        assert_eq!(std::mem::size_of::<KernelLayout>(), 8 * (3 + 2 * MAX_DIMS));
        let l = Layout::new(vec![3, 4], vec![1, 3], 2, 14).unwrap();
        let k = KernelLayout::of(&l).unwrap();
        assert_eq!((k.numel, k.ndim, k.offset), (12, 2, 2));
        assert_eq!(&k.shape[..3], &[3, 4, 1]);
        assert_eq!(&k.strides[..3], &[1, 3, 0]);
        // A stride past i64 is refused before any kernel sees it.
        assert!(Layout::new(vec![2], vec![1 << 63], 0, usize::MAX).is_err());
    }

    /// `element_offset` of kernels.cu in Rust: its path for one dimension, and its division
    /// loop in 64 bits (the 32-bit loop computes the same where the element count fits).
    fn kernel_offset(k: &KernelLayout, linear: i64) -> i64 {
        if k.ndim <= 1 {
            return k.offset + linear * k.strides[0];
        }
        let (mut off, mut rest) = (k.offset, linear);
        for d in (0..k.ndim as usize).rev() {
            off += rest % k.shape[d] * k.strides[d];
            rest /= k.shape[d];
        }
        off
    }

    #[test]
    fn kernel_layouts_merge_what_walks_in_one_stride() {
        let of = |shape: &[usize], strides: &[usize]| {
            let l = Layout::new(shape.to_vec(), strides.to_vec(), 3, usize::MAX).unwrap();
            let k = KernelLayout::of(&l).unwrap();
            (k.ndim, k.shape[..k.ndim as usize].to_vec(), k.strides[..k.ndim as usize].to_vec())
        };
        // A contiguous block of the KV example: one dimension.
        assert_eq!(of(&[32, 2, 16, 8, 128], &[32768, 16384, 1024, 128, 1]), (1, vec![1 << 20], vec![1]));
        // A transpose stays two; a column slice keeps its row stride; ones go.
        assert_eq!(of(&[3, 4], &[1, 3]), (2, vec![3, 4], vec![1, 3]));
        assert_eq!(of(&[4, 1, 2], &[10, 7, 1]), (2, vec![4, 2], vec![10, 1]));
        assert_eq!(of(&[1, 1], &[5, 9]), (0, vec![], vec![]));
        // Broadcast dimensions merge with each other, not with a real one.
        assert_eq!(of(&[2, 3, 4], &[0, 0, 1]), (2, vec![6, 4], vec![0, 1]));
        // An empty view is left as it is (no kernel runs for it).
        assert_eq!(of(&[0, 1, 5], &[5, 5, 1]).0, 3);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 2000, ..Default::default() })]
        #[test]
        fn merged_kernel_layouts_reach_every_element_where_the_view_does(
            dims in proptest::collection::vec((1usize..5, 0usize..4), 0..6),
            contiguous_from in 0usize..7,
            offset in 0usize..9,
        ) {
            // Strides either arbitrary or, from some dimension in, those of a contiguous tail
            // (the case merging is for).
            let shape: Vec<usize> = dims.iter().map(|d| d.0).collect();
            let mut strides: Vec<usize> = dims.iter().map(|d| d.1).collect();
            let mut run = 1;
            for d in (contiguous_from.min(shape.len())..shape.len()).rev() {
                strides[d] = run;
                run *= shape[d];
            }
            let l = Layout::new(shape, strides, offset, usize::MAX).unwrap();
            let k = KernelLayout::of(&l).unwrap();
            proptest::prop_assert!(k.ndim as usize <= l.shape().len());
            proptest::prop_assert_eq!(k.numel as usize, l.numel());
            let merged: Vec<usize> = (0..k.numel).map(|i| kernel_offset(&k, i) as usize).collect();
            proptest::prop_assert_eq!(merged, l.indices().collect::<Vec<_>>());
        }
    }

    #[test]
    fn kernel_views_stay_inside_their_allocation() {
        let l = Layout::new(vec![3, 4], vec![4, 1], 2, 14).unwrap();
        // Reaches element 14: 56 bytes of f32.
        assert!(KernelView::new(DeviceRange::new(0x1000, 56), &l, DType::F32).is_ok());
        assert!(KernelView::new(DeviceRange::new(0x1000, 55), &l, DType::F32).is_err());
        assert!(KernelView::new(DeviceRange::new(0x1000, 14), &l, DType::U8).is_ok());
        assert!(KernelView::new(DeviceRange::new(0x1000, 56), &l, DType::F64).is_err());
        let empty = Layout::new(vec![0, 5], vec![5, 1], 1000, 0).unwrap();
        let v = KernelView::new(DeviceRange::new(0x1000, 0), &empty, DType::I64).unwrap();
        assert_eq!(KernelArgs::Fill { view: v, bits: 0 }.signature().unwrap().2, 0);
        let big = Layout::new(vec![usize::MAX / 4], vec![1], 0, usize::MAX).unwrap();
        assert!(KernelView::new(DeviceRange::new(0x1000, usize::MAX), &big, DType::F64).is_err());
        // Memory that starts off its elements' alignment (an imported storage may): refused,
        // where a kernel's loads would fault the context.
        assert!(KernelView::new(DeviceRange::new(0x1002, 56), &l, DType::F32).is_err());
        assert!(KernelView::new(DeviceRange::new(0x1004, 56), &l, DType::F32).is_ok());
        assert!(KernelView::new(DeviceRange::new(0x1004, 112), &l, DType::F64).is_err());
        assert!(KernelView::new(DeviceRange::new(0x1001, 14), &l, DType::U8).is_ok());
    }

    #[test]
    fn kernel_arguments_name_their_signature() {
        let alloc = DeviceRange::new(0x1000, 64);
        let a = KernelView::new(alloc, &Layout::contiguous(&[4]).unwrap(), DType::F32).unwrap();
        let b = KernelView::new(alloc, &Layout::contiguous(&[2, 2]).unwrap(), DType::F32).unwrap();
        let c = KernelView::new(alloc, &Layout::contiguous(&[3]).unwrap(), DType::F32).unwrap();
        let d = KernelView::new(alloc, &Layout::contiguous(&[4]).unwrap(), DType::I32).unwrap();
        assert_eq!(KernelArgs::Fill { view: a, bits: 1 }.signature().unwrap(), (KernelOp::Fill, DType::F32, 4));
        assert_eq!(KernelArgs::Add { view: d, value: 1.0 }.signature().unwrap(), (KernelOp::Add, DType::I32, 4));
        assert_eq!(KernelArgs::Copy { dst: a, src: b }.signature().unwrap(), (KernelOp::Copy, DType::F32, 4));
        assert!(KernelArgs::Copy { dst: a, src: c }.signature().is_err());
        assert!(KernelArgs::Copy { dst: a, src: d }.signature().is_err());
        assert_eq!(format!("{}_{}", KernelOp::Add.name(), DType::BF16.name()), "add_bf16");
    }
}
