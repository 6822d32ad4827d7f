//! Owners of driver objects, one type each, holding its typed driver handle; each is released
//! once, by its `Drop`, and each method makes the owner's context current itself. With
//! `driver.rs`, the only file of `src/gpu/` with `unsafe` (see README.md here).

use std::ffi::CString;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex};

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaStream};

use super::device::Device;
use super::driver::{
    self, AllocationHandle, DeviceRange, DriverResult, IpcHandle, KernelArgs, KernelOp, bind, driver_err,
};
use super::kernels;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Device memory from `cuMemAlloc`, which legacy CUDA IPC can export (the stream-ordered pool
/// behind cudarc's `CudaSlice` cannot). Dropping it waits for the work queued on the device's
/// stream, then frees it.
pub(crate) struct DeviceAllocation {
    device: Arc<Device>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl DeviceAllocation {
    /// Allocates `bytes` bytes (uninitialized) on `device`, in a whole number of 2 MiB: NVIDIA's
    /// guide says the driver may cut smaller allocations from one block, and that an IPC handle
    /// to one of them then maps the whole block in the receiver, its neighbours included
    /// (CUDA Programming Guide, "Interprocess Communication"; `benches/ipc_neighbours.py` asks
    /// the driver alone whether it does). Every allocation here may be exported. A zero-byte
    /// request gets one byte: it stands for an empty storage (one received from PyTorch, say),
    /// which holds nothing to share, and a receiver of many of them must not hold 2 MiB each.
    pub(crate) fn new(device: &Arc<Device>, bytes: usize) -> Result<DeviceAllocation> {
        const IPC_BLOCK: usize = 2 << 20;
        let request = match bytes {
            0 => 1,
            _ => bytes.checked_next_multiple_of(IPC_BLOCK).ok_or_else(|| {
                Error::Layout(format!("an allocation of {bytes} bytes is larger than an address holds"))
            })?,
        };
        device.bind()?;
        // SAFETY: the context is current; the pointer is owned by the value built here, whose
        // drop frees it once.
        let ptr = unsafe { driver::mem_alloc(request) }.map_err(driver_err("cuMemAlloc"))?;
        Ok(DeviceAllocation { device: device.clone(), ptr, len: bytes })
    }

    /// The device holding the memory.
    pub(crate) fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Device address of the first byte.
    pub(crate) fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// The allocation's memory, for checked copies and launches.
    pub(crate) fn range(&self) -> DeviceRange {
        DeviceRange::new(self.ptr, self.len)
    }

    /// `cuIpcGetMemHandle`: the handle another process opens to map this memory. The same for
    /// the allocation's whole life; callers cache it.
    pub(crate) fn ipc_handle(&self) -> Result<IpcHandle> {
        self.device.bind()?;
        // SAFETY: the context is current and `ptr` is this live allocation.
        unsafe { driver::ipc_get_mem_handle(self.ptr) }.map_err(driver_err("cuIpcGetMemHandle"))
    }
}

impl Drop for DeviceAllocation {
    fn drop(&mut self) {
        // Errors cannot be returned from drop; the driver reports them again on the next call.
        if self.device.bind().is_err() {
            return;
        }
        // Work queued on the memory must finish before it is freed.
        let _ = self.device.finish_own_work();
        // SAFETY: `ptr` came from cuMemAlloc in this (current) context, the device's stream has
        // no work left on it, and nothing refers to it any more.
        let _ = unsafe { driver::mem_free(self.ptr) };
    }
}

/// Another process's allocation, mapped here with `cuIpcOpenMemHandle` (lazy peer access) on
/// `device`, which may be a peer of the GPU holding it. Dropping it waits for the work queued
/// on the device's stream, then unmaps it; the memory itself stays its owner's.
pub(crate) struct IpcMapping {
    device: Arc<Device>,
    ptr: sys::CUdeviceptr,
    size: usize,
}

/// One mapping per (device, handle) in this process, shared by every storage of the
/// allocation: the driver maps a handle once per context, and another library's allocator
/// (PyTorch's) sends several storages cut from one allocation. The first user opens it (others
/// of the same handle wait for that open, not for opens of other handles); the last one to
/// drop it closes it.
type MappingSlot = once_cell::sync::OnceCell<IpcMapping>;
type OpenMappings = std::collections::HashMap<(usize, IpcHandle), std::sync::Weak<MappingSlot>>;
static OPEN_MAPPINGS: once_cell::sync::Lazy<Mutex<OpenMappings>> = once_cell::sync::Lazy::new(Default::default);

/// A mapping shared by the storages of one allocation.
#[derive(Clone)]
pub(crate) struct SharedMapping(Arc<MappingSlot>);

impl SharedMapping {
    /// This process's mapping of `handle` on `device`, opened now if no storage holds it.
    pub(crate) fn open(device: &Arc<Device>, handle: &IpcHandle) -> Result<SharedMapping> {
        let slot = {
            let mut open = OPEN_MAPPINGS.lock().unwrap_or_else(|p| p.into_inner());
            let key = (device.ordinal(), *handle);
            match open.get(&key).and_then(std::sync::Weak::upgrade) {
                Some(slot) => slot,
                None => {
                    // Entries of closed mappings go when the table has grown.
                    if open.len() >= 64 {
                        open.retain(|_, slot| slot.strong_count() > 0);
                    }
                    let slot = Arc::new(MappingSlot::new());
                    open.insert(key, Arc::downgrade(&slot));
                    slot
                }
            }
        };
        slot.get_or_try_init(|| IpcMapping::open(device, handle))?;
        Ok(SharedMapping(slot))
    }
}

impl std::ops::Deref for SharedMapping {
    type Target = IpcMapping;

    fn deref(&self) -> &IpcMapping {
        self.0.get().expect("a shared mapping is made only once opened")
    }
}

/// Part of an allocation that another library made in this process with `cuMemAlloc` (or
/// `cudaMalloc`): `len` bytes at `offset` into the allocation at `base`. The owner's reference
/// is kept in `keeper` and dropped with this value; the memory is never freed here.
pub(crate) struct ForeignBlock {
    device: Arc<Device>,
    base: sys::CUdeviceptr,
    size: usize,
    offset: usize,
    _keeper: Box<dyn std::any::Any + Send + Sync>,
}

impl ForeignBlock {
    /// Describes `len` bytes at `ptr` on `device`; `Error::Unsupported` unless they lie inside
    /// one allocation of the device's context.
    ///
    /// # Safety
    /// The allocation must stay allocated while `keeper` lives.
    pub(crate) unsafe fn new(
        device: &Arc<Device>,
        ptr: sys::CUdeviceptr,
        len: usize,
        keeper: Box<dyn std::any::Any + Send + Sync>,
    ) -> Result<ForeignBlock> {
        device.bind()?;
        // SAFETY: the context is current; the driver looks the pointer up and fails for one it
        // did not allocate.
        let (base, size) = unsafe { driver::mem_address_range(ptr) }.map_err(|e| {
            Error::Unsupported(format!(
                "{ptr:#x} is not memory allocated in gpu {}'s context ({})",
                device.ordinal(),
                driver_err("cuMemGetAddressRange")(e)
            ))
        })?;
        let offset = (ptr - base) as usize;
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::Layout(format!(
                "{len} bytes at {ptr:#x} run past the end of their {size}-byte allocation"
            )));
        }
        Ok(ForeignBlock { device: device.clone(), base, size, offset, _keeper: keeper })
    }

    /// The IPC handle of the whole allocation; `Error::Unsupported` naming the likely cause
    /// when the driver cannot export it.
    pub(crate) fn ipc_handle(&self) -> Result<IpcHandle> {
        self.device.bind()?;
        // SAFETY: the context is current and `base` is a live allocation (kept by the keeper).
        unsafe { driver::ipc_get_mem_handle(self.base) }.map_err(|e| {
            Error::Unsupported(format!(
                "the allocation cannot be exported with legacy CUDA IPC ({}); memory from PyTorch's \
                 expandable_segments allocator cannot: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False \
                 or copy the tensor into cuda-mp memory",
                driver_err("cuIpcGetMemHandle")(e)
            ))
        })
    }

    /// The device the memory is on.
    pub(crate) fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Where the storage starts in the allocation.
    pub(crate) fn offset(&self) -> usize {
        self.offset
    }

    /// Device address of the storage's first byte.
    pub(crate) fn ptr(&self) -> sys::CUdeviceptr {
        self.base + self.offset as u64
    }

    /// The whole allocation, for checked copies and launches.
    pub(crate) fn range(&self) -> DeviceRange {
        DeviceRange::new(self.base, self.size)
    }
}

impl Drop for ForeignBlock {
    fn drop(&mut self) {
        // Our work on the memory must finish before the owner may reuse it (the keeper goes
        // right after this).
        if self.device.bind().is_ok() {
            let _ = self.device.finish_own_work();
        }
    }
}

impl IpcMapping {
    /// Maps the allocation of `handle` on `device`.
    pub(crate) fn open(device: &Arc<Device>, handle: &IpcHandle) -> Result<IpcMapping> {
        device.bind()?;
        // SAFETY: the context is current; the mapping is closed once, by the value built below
        // or on the error path right after.
        let ptr = unsafe { driver::ipc_open_mem_handle(handle) }.map_err(driver_err("cuIpcOpenMemHandle"))?;
        // SAFETY: the context is current and `ptr` is mapped.
        match unsafe { driver::mem_address_range(ptr) } {
            Ok((_, size)) => Ok(IpcMapping { device: device.clone(), ptr, size }),
            Err(e) => {
                // SAFETY: opened just above, in the current context; not handed out.
                let _ = unsafe { driver::ipc_close_mem_handle(ptr) };
                Err(driver_err("cuMemGetAddressRange")(e))
            }
        }
    }

    /// The device the memory is mapped on (where work on it runs).
    pub(crate) fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Base of the mapping (the first byte of the owner's allocation).
    pub(crate) fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Size of the mapped allocation (`cuMemGetAddressRange`).
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// The mapping's memory, for checked copies and launches.
    pub(crate) fn range(&self) -> DeviceRange {
        DeviceRange::new(self.ptr, self.size)
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // Errors cannot be returned from drop; the driver reports them again on the next call.
        if self.device.bind().is_err() {
            return;
        }
        // Our work on the memory must finish before the owner may free it.
        let _ = self.device.finish_own_work();
        // SAFETY: `ptr` came from cuIpcOpenMemHandle in this (current) context, our stream has
        // no work left on it, and nothing uses it any more.
        let _ = unsafe { driver::ipc_close_mem_handle(self.ptr) };
    }
}

/// `bytes` rounded up to a whole number of `granularity`-byte granules, at least one.
fn round_to_granularity(bytes: usize, granularity: usize) -> Result<usize> {
    if granularity == 0 {
        return Err(Error::Unsupported("the driver reports a virtual memory granularity of 0 bytes".into()));
    }
    bytes.max(1).div_ceil(granularity).checked_mul(granularity).ok_or_else(|| {
        Error::Layout(format!("an allocation of {bytes} bytes overflows when rounded to {granularity}-byte granules"))
    })
}

/// A mapping size that another process claims: a nonzero whole number of granules.
fn check_mapping_size(size: usize, granularity: usize) -> Result<()> {
    if size == 0 || granularity == 0 || !size.is_multiple_of(granularity) {
        return Err(Error::Malformed(format!(
            "a virtual memory mapping of {size} bytes is not a nonzero multiple of the {granularity}-byte granularity"
        )));
    }
    Ok(())
}

/// The alignment to reserve addresses with: the granularity when it is a power of two (mappings
/// start on a granule), else the driver's default.
fn reserve_alignment(granularity: usize) -> usize {
    if granularity.is_power_of_two() { granularity } else { 0 }
}

/// Physical VMM memory mapped at one range of this process's addresses, readable and writable
/// by one device (and by the peers it was granted to): memory made here with `cuMemCreate`
/// ([`alloc`](Self::alloc)), or another process's imported from a POSIX file descriptor
/// ([`import`](Self::import)). Unlike `cuMemAlloc` memory, it outlives its allocating process
/// while another process holds a descriptor or a mapping of it. Built step by step; dropping it
/// undoes the steps done: after synchronizing the streams of the devices with access it unmaps,
/// gives the addresses back and releases the handle (errors ignored).
pub(crate) struct VmmRegion {
    /// The device with access: bound for every step, its stream synchronized before unmapping.
    device: Arc<Device>,
    /// The GPU holding the physical memory.
    owner: sys::CUdevice,
    /// Other devices granted access ([`VmmRegion::grant_access`]): their streams are
    /// synchronized before unmapping too.
    peers: Mutex<Vec<Arc<Device>>>,
    /// Taken by the drop, to release it.
    handle: Option<AllocationHandle>,
    /// The reserved range (0 until reserved) and its size.
    ptr: sys::CUdeviceptr,
    size: usize,
    /// True once `handle` is mapped over the whole range.
    mapped: bool,
}

impl VmmRegion {
    /// Allocates `bytes` bytes (uninitialized; rounded up to the granularity, a zero-byte
    /// request gets one granule) of pinned memory on `device`, exportable as a POSIX file
    /// descriptor, and maps it for `device`.
    pub(crate) fn alloc(device: &Arc<Device>, bytes: usize) -> Result<VmmRegion> {
        device.require_vmm()?;
        let granularity = device.vmm_granularity()?;
        let size = round_to_granularity(bytes, granularity)?;
        device.bind()?;
        let handle = driver::mem_create(device.cu_device(), size).map_err(driver_err("cuMemCreate"))?;
        let mut region = VmmRegion::hold(device, device.cu_device(), handle);
        region.map(size, granularity, driver_err("cuMemMap"))?;
        Ok(region)
    }

    /// Imports the memory of `fd` (closed as soon as the import holds the memory) and maps
    /// `size` bytes of it (the sender's rounded size) for `access` (the GPU holding it, or a
    /// peer: VMM needs no peer context). The memory must be pinned GPU memory shareable as a
    /// descriptor; a size it does not have is `Error::Malformed`; a GPU `access` cannot reach
    /// is `Error::NoPeerAccess`. This process's handle keeps the memory alive even after its
    /// owner exits.
    pub(crate) fn import(fd: BorrowedFd<'_>, size: usize, access: &Arc<Device>) -> Result<VmmRegion> {
        access.bind()?;
        // The handle holds the memory from here on, whatever becomes of the descriptor.
        let handle = driver::mem_import_fd(fd).map_err(driver_err("cuMemImportFromShareableHandle"))?;
        let props = match driver::mem_allocation_props(&handle) {
            Ok(props) => props,
            Err(e) => {
                let _ = driver::mem_release(handle);
                return Err(driver_err("cuMemGetAllocationPropertiesFromHandle")(e));
            }
        };
        let owner = match props.fd_shareable_device() {
            Ok(owner) => owner,
            Err(why) => {
                let _ = driver::mem_release(handle);
                return Err(Error::Malformed(why));
            }
        };
        // Released on every error path below.
        let mut region = VmmRegion::hold(access, owner, handle);
        access.require_access_to(owner)?;
        let granularity = driver::vmm_granularity(owner).map_err(driver_err("cuMemGetAllocationGranularity"))?;
        check_mapping_size(size, granularity)?;
        region.map(size, granularity, |e| {
            let e = driver_err("cuMemMap")(e);
            if e.is_out_of_memory() {
                return e;
            }
            Error::Malformed(format!("the imported memory cannot be mapped at {size} bytes ({e})"))
        })?;
        Ok(region)
    }

    /// Holds `handle` (released on drop), memory on GPU `owner`; maps nothing yet.
    fn hold(device: &Arc<Device>, owner: sys::CUdevice, handle: AllocationHandle) -> VmmRegion {
        VmmRegion {
            device: device.clone(),
            owner,
            peers: Mutex::new(Vec::new()),
            handle: Some(handle),
            ptr: 0,
            size: 0,
            mapped: false,
        }
    }

    /// Reserves `size` bytes of addresses, maps the held memory over them (a failure of
    /// `cuMemMap` becomes `map_err`'s error) and makes them readable and writable by the device.
    fn map(&mut self, size: usize, granularity: usize, map_err: impl FnOnce(DriverError) -> Error) -> Result<()> {
        let handle = self.handle.as_ref().ok_or_else(|| Error::Unsupported("mapping released memory".into()))?;
        if self.ptr != 0 {
            return Err(Error::Unsupported("mapping memory twice".into()));
        }
        self.device.bind()?;
        self.ptr = driver::mem_address_reserve(size, reserve_alignment(granularity))
            .map_err(driver_err("cuMemAddressReserve"))?;
        self.size = size;
        // SAFETY: `ptr`/`size` is the reservation just made, owned by this value and not mapped
        // yet; the drop unmaps it once (`mapped` is set right after).
        unsafe { driver::mem_map(self.ptr, size, handle) }.map_err(map_err)?;
        self.mapped = true;
        // SAFETY: `ptr`/`size` is exactly the mapping just made, owned by this value.
        unsafe { driver::mem_set_access(self.ptr, size, self.device.cu_device()) }.map_err(driver_err("cuMemSetAccess"))
    }

    /// Makes the mapping readable and writable by `peer` too (`cuMemSetAccess`, once per
    /// device; dropping waits for `peer`'s stream too). Other GPUs reach VMM memory only through
    /// access granted to them: context peer access (`cuCtxEnablePeerAccess`) does not cover it.
    /// `Error::NoPeerAccess`, naming both GPUs, when `peer` cannot reach the GPU holding it.
    pub(crate) fn grant_access(&self, peer: &Arc<Device>) -> Result<()> {
        if !self.mapped {
            return Err(Error::Unsupported("granting access to unmapped memory".into()));
        }
        if Arc::ptr_eq(peer, &self.device) {
            return Ok(());
        }
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if peers.iter().any(|d| Arc::ptr_eq(d, peer)) {
            return Ok(());
        }
        peer.require_access_to(self.owner)?;
        self.device.bind()?;
        // SAFETY: `ptr`/`size` is exactly the mapping this value made and still holds; the drop
        // synchronizes `peer`'s stream (recorded below) before unmapping it.
        unsafe { driver::mem_set_access(self.ptr, self.size, peer.cu_device()) }
            .map_err(driver_err("cuMemSetAccess"))?;
        peers.push(peer.clone());
        Ok(())
    }

    /// `cuMemExportToShareableHandle`: a new file descriptor for the physical memory, which
    /// another process imports with [`VmmRegion::import`]. A new one per call: callers cache it.
    pub(crate) fn export_fd(&self) -> Result<OwnedFd> {
        let handle = self.handle.as_ref().ok_or_else(|| Error::Unsupported("exporting released memory".into()))?;
        self.device.bind()?;
        driver::mem_export_fd(handle).map_err(driver_err("cuMemExportToShareableHandle"))
    }

    /// The device the memory is mapped for (where work on it runs).
    pub(crate) fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Base of the mapping.
    pub(crate) fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// The rounded size: what is mapped here, and what a receiver maps.
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// The whole mapping, for checked copies and launches.
    pub(crate) fn range(&self) -> DeviceRange {
        DeviceRange::new(self.ptr, self.size)
    }
}

impl Drop for VmmRegion {
    fn drop(&mut self) {
        // Errors cannot be returned from drop; the driver reports them again on the next call.
        if self.device.bind().is_err() {
            // Nothing may be unmapped before the stream is known idle: leak rather than risk it.
            return;
        }
        if self.mapped {
            // Work queued on the memory must finish before it is unmapped, on every device
            // with access.
            for peer in self.peers.get_mut().unwrap_or_else(|p| p.into_inner()).iter() {
                let _ = peer.finish_own_work();
            }
            let _ = self.device.finish_own_work();
            // SAFETY: `ptr`/`size` is the mapping this value made, the streams of the devices
            // with access have no work left on it, and nothing uses it any more.
            let _ = unsafe { driver::mem_unmap(self.ptr, self.size) };
        }
        if self.ptr != 0 {
            // SAFETY: `ptr`/`size` is the reservation this value made, with nothing mapped in it
            // any more (unmapped just above, or never mapped).
            let _ = unsafe { driver::mem_address_free(self.ptr, self.size) };
        }
        if let Some(handle) = self.handle.take() {
            let _ = driver::mem_release(handle);
        }
    }
}

/// A driver event of one context, destroyed in that context when dropped: one of this process
/// that a thread waits on asleep ([`Event::blocking`]: how a drop learns, off its own thread,
/// that the work queued before it is done), another process's interprocess event
/// ([`Event::open`]: dropping it destroys this process's reference, and waits already queued
/// are not affected), or the one an [`InterprocessEvent`] holds.
pub(crate) struct Event {
    ctx: Arc<CudaContext>,
    raw: sys::CUevent,
}

// SAFETY: a CUevent is a driver handle, usable from any thread once its context is current,
// which every method (and drop) makes sure of; the driver synchronizes concurrent use.
unsafe impl Send for Event {}
// SAFETY: as above; nothing in the value is mutated after construction.
unsafe impl Sync for Event {}

impl Event {
    /// An event that `make` creates or opens, called with `device`'s context current; `call`
    /// names it in errors.
    fn new(device: &Device, call: &'static str, make: impl FnOnce() -> DriverResult<sys::CUevent>) -> Result<Event> {
        let ctx = device.context().clone();
        bind(&ctx)?;
        let raw = make().map_err(driver_err(call))?;
        Ok(Event { ctx, raw })
    }

    /// Creates an event on `device` that a thread waits on asleep (`CU_EVENT_BLOCKING_SYNC`).
    pub(crate) fn blocking(device: &Device) -> Result<Event> {
        // SAFETY: `Event::new` calls this with the context current; the event is destroyed
        // once, by the value built here.
        Event::new(device, "cuEventCreate", || unsafe {
            driver::event_create(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC)
        })
    }

    /// Opens another process's interprocess event of `handle` on `device`, the GPU it was
    /// recorded on (`cuIpcOpenEventHandle`).
    pub(crate) fn open(device: &Device, handle: &IpcHandle) -> Result<Event> {
        // SAFETY: `Event::new` calls this with the context current; the event is destroyed
        // once, by the value built here.
        Event::new(device, "cuIpcOpenEventHandle", || unsafe { driver::ipc_open_event_handle(handle) })
    }

    /// Records the event after the work queued on `stream` so far (a stream of the event's
    /// device).
    pub(crate) fn record(&self, stream: &CudaStream) -> Result<()> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(Error::Unsupported("recording an event on another device's stream".into()));
        }
        bind(&self.ctx)?;
        // SAFETY: the context is current; the event and the stream are live and of it.
        unsafe { driver::event_record(self.raw, stream.cu_stream()) }.map_err(driver_err("cuEventRecord"))
    }

    /// Records the event after the work queued on another library's `stream`.
    ///
    /// # Safety
    /// `stream` must be a live stream of this event's context (or 0, the legacy default stream,
    /// or 2, the per-thread default stream).
    pub(crate) unsafe fn record_raw(&self, stream: sys::CUstream) -> Result<()> {
        bind(&self.ctx)?;
        // SAFETY: the context is current and the event live; the stream is upheld by the caller.
        unsafe { driver::event_record(self.raw, stream) }.map_err(driver_err("cuEventRecord"))
    }

    /// Makes work queued later on `stream` (of any device) wait for the latest record, without
    /// blocking the host (`cuStreamWaitEvent`).
    pub(crate) fn wait_on(&self, stream: &CudaStream) -> Result<()> {
        bind(stream.context())?;
        // SAFETY: the stream's context is current; the stream and the event are live (an event
        // of another context may be waited on).
        unsafe { driver::stream_wait_event(stream.cu_stream(), self.raw) }.map_err(driver_err("cuStreamWaitEvent"))
    }

    /// True when the work before the latest record is done (`cuEventQuery`).
    pub(crate) fn is_complete(&self) -> Result<bool> {
        bind(&self.ctx)?;
        // SAFETY: the context is current and the event live.
        unsafe { driver::event_is_complete(self.raw) }.map_err(driver_err("cuEventQuery"))
    }

    /// Blocks, asleep for a blocking event, until the work before the latest record is done.
    pub(crate) fn wait(&self) -> Result<()> {
        bind(&self.ctx)?;
        // SAFETY: the context is current and the event live.
        unsafe { driver::event_synchronize(self.raw) }.map_err(driver_err("cuEventSynchronize"))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: created or opened in this (current) context; nothing uses it after.
            let _ = unsafe { driver::event_destroy(self.raw) };
        }
    }
}

/// An event created with `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`, with the IPC
/// handle other processes open it by. Dropping it destroys it.
pub(crate) struct InterprocessEvent {
    event: Event,
    handle: IpcHandle,
}

impl InterprocessEvent {
    /// Creates an interprocess event on `device`.
    pub(crate) fn create(device: &Device) -> Result<InterprocessEvent> {
        // SAFETY: `Event::new` calls this with the context current; the event is destroyed
        // once, by the value built here.
        let event = Event::new(device, "cuEventCreate", || unsafe {
            driver::event_create(sys::CUevent_flags::CU_EVENT_INTERPROCESS)
        })?;
        // SAFETY: the context is current (made so above, on this thread) and `event` a live
        // interprocess event (on error, `event` destroys it).
        let handle = unsafe { driver::ipc_get_event_handle(event.raw) }.map_err(driver_err("cuIpcGetEventHandle"))?;
        Ok(InterprocessEvent { event, handle })
    }

    /// The handle another process opens with [`Event::open`].
    pub(crate) fn handle(&self) -> &IpcHandle {
        &self.handle
    }

    /// Records the event after the work queued on `stream` so far (a stream of the event's
    /// device).
    pub(crate) fn record(&self, stream: &CudaStream) -> Result<()> {
        self.event.record(stream)
    }

    /// Makes `stream`, another library's stream of this event's context, wait for the latest
    /// record.
    ///
    /// # Safety
    /// `stream` must be a live stream of this event's context (or 0, the legacy default stream,
    /// or 2, the per-thread default stream).
    pub(crate) unsafe fn make_wait(&self, stream: sys::CUstream) -> Result<()> {
        bind(&self.event.ctx)?;
        // SAFETY: the context is current and the event live; the stream is upheld by the caller.
        unsafe { driver::stream_wait_event(stream, self.event.raw) }.map_err(driver_err("cuStreamWaitEvent"))
    }
}

/// The calling thread's current context as it was when saved, made current again when dropped:
/// cuda-mp makes a device's context current for its calls, which would change another
/// library's current device (the CUDA runtime's) on that thread.
pub(crate) struct SavedContext(Option<sys::CUcontext>);

impl SavedContext {
    /// Saves the current context; nothing is saved (or put back) in a forked child or where
    /// the driver was never initialized in this process.
    pub(crate) fn save() -> SavedContext {
        if driver::check_not_forked().is_err() || !driver::initialized() {
            return SavedContext(None);
        }
        // SAFETY: the driver is initialized (checked above).
        SavedContext(unsafe { driver::ctx_get_current() }.ok())
    }
}

impl Drop for SavedContext {
    fn drop(&mut self) {
        if let Some(ctx) = self.0 {
            // SAFETY: the driver is initialized (it was when saved); `ctx` was current on this
            // thread when saved, and is null or a context that lives on: primary contexts (what
            // cuda-mp and the CUDA runtime use) stay while retained, for the life of the process.
            let _ = unsafe { driver::ctx_set_current(ctx) };
        }
    }
}

/// Blocks until the work queued on another library's `stream` of `device` is done.
///
/// # Safety
/// `stream` must be a live stream of `device`'s primary context (or 0 or 2, the default
/// streams).
pub(crate) unsafe fn synchronize_stream(device: &Device, stream: sys::CUstream) -> Result<()> {
    bind(device.context())?;
    // SAFETY: the context is current; the stream is upheld by the caller.
    unsafe { driver::stream_synchronize_raw(stream) }.map_err(driver_err("cuStreamSynchronize"))
}

/// The shipped kernel module ([`kernels::PTX`]) loaded in one context. Only that image is ever
/// loaded, so its kernels take the parameters kernels.cu gives them. Unloaded when the last
/// of its functions is dropped.
pub(crate) struct Module {
    ctx: Arc<CudaContext>,
    raw: sys::CUmodule,
}

// SAFETY: a CUmodule is a driver handle, usable from any thread once its context is current,
// which every method (and drop) makes sure of; lookups are synchronized by the driver.
unsafe impl Send for Module {}
// SAFETY: as above; nothing in the value is mutated after construction.
unsafe impl Sync for Module {}

impl Module {
    /// Loads the shipped kernels in `ctx`.
    pub(crate) fn load_shipped(ctx: &Arc<CudaContext>) -> Result<Arc<Module>> {
        let image =
            CString::new(kernels::PTX).map_err(|_| Error::Unsupported("kernel image contains a NUL byte".into()))?;
        bind(ctx)?;
        // SAFETY: the context is current; the module is unloaded once, by the value built here.
        let raw = unsafe { driver::module_load_data(&image) }.map_err(driver_err("cuModuleLoadData"))?;
        Ok(Arc::new(Module { ctx: ctx.clone(), raw }))
    }

    /// The kernel of `op` for `dtype` (`{op}_{dtype}` in kernels.cu).
    pub(crate) fn function(self: &Arc<Self>, op: KernelOp, dtype: DType) -> Result<KernelFunction> {
        let name = format!("{}_{}", op.name(), dtype.name());
        let cname = CString::new(name.as_str()).map_err(|_| Error::Unsupported(format!("kernel name {name:?}")))?;
        bind(&self.ctx)?;
        // SAFETY: the context is current and the module loaded; the function keeps the module
        // (and so itself) alive.
        let raw = unsafe { driver::module_get_function(self.raw, &cname) }
            .map_err(|_| Error::Unsupported(format!("no shipped kernel {name}")))?;
        Ok(KernelFunction { module: self.clone(), raw, op, dtype })
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: loaded in this (current) context; every function holds the module, so
            // none is left.
            let _ = unsafe { driver::module_unload(self.raw) };
        }
    }
}

/// One shipped kernel: `{op}_{dtype}` of the shipped module, which it keeps loaded.
#[derive(Clone)]
pub(crate) struct KernelFunction {
    module: Arc<Module>,
    raw: sys::CUfunction,
    op: KernelOp,
    dtype: DType,
}

// SAFETY: a CUfunction is a driver handle, usable from any thread once its context is current,
// which `launch` makes sure of; the module it belongs to is kept loaded by `module`.
unsafe impl Send for KernelFunction {}
// SAFETY: as above; nothing in the value is mutated after construction.
unsafe impl Sync for KernelFunction {}

impl KernelFunction {
    /// Queues the kernel on `stream` (of the module's device) over `blocks` blocks of
    /// `threads` threads. The arguments must be this kernel's operation and element type; their
    /// views were checked against their memory when built. Nothing is queued for zero elements.
    pub(crate) fn launch(&self, stream: &CudaStream, blocks: u32, threads: u32, args: &KernelArgs) -> Result<()> {
        let (op, dtype, numel) = args.signature()?;
        if (op, dtype) != (self.op, self.dtype) {
            return Err(Error::Unsupported(format!(
                "{}_{} launched with the arguments of {}_{}",
                self.op.name(),
                self.dtype.name(),
                op.name(),
                dtype.name()
            )));
        }
        if stream.context().cu_ctx() != self.module.ctx.cu_ctx() {
            return Err(Error::Unsupported("launching a kernel on another device's stream".into()));
        }
        if numel == 0 {
            return Ok(());
        }
        bind(&self.module.ctx)?;
        // SAFETY: the context is current and the function live in it (the module is held);
        // the shipped `{op}_{dtype}` kernel takes exactly the parameters of `args`' variant for
        // `dtype` (checked above); the stream is of this context; every view lies inside memory
        // that its holder keeps alive until the stream is done with it (owners synchronize the
        // stream before they free or unmap).
        unsafe { driver::launch_kernel(self.raw, blocks, threads, stream.cu_stream(), args) }
            .map_err(driver_err("cuLaunchKernel"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send_sync<T: Send + Sync>() {}

    #[test]
    fn owners_and_devices_cross_threads() {
        send_sync::<DeviceAllocation>();
        send_sync::<IpcMapping>();
        send_sync::<InterprocessEvent>();
        send_sync::<Event>();
        send_sync::<Module>();
        send_sync::<KernelFunction>();
        send_sync::<Device>();
        send_sync::<VmmRegion>();
    }

    #[test]
    fn vmm_sizes_round_up_to_whole_granules() {
        let g = 2 << 20;
        assert_eq!(round_to_granularity(0, g).unwrap(), g);
        assert_eq!(round_to_granularity(1, g).unwrap(), g);
        assert_eq!(round_to_granularity(g, g).unwrap(), g);
        assert_eq!(round_to_granularity(g + 1, g).unwrap(), 2 * g);
        assert_eq!(round_to_granularity(5 * g - 7, g).unwrap(), 5 * g);
        assert_eq!(round_to_granularity(3, 3).unwrap(), 3);
        assert!(round_to_granularity(usize::MAX, g).is_err());
        assert!(round_to_granularity(usize::MAX - g + 2, g).is_err());
        assert_eq!(round_to_granularity(usize::MAX - g + 1, g).unwrap(), usize::MAX - g + 1);
        assert_eq!(round_to_granularity(usize::MAX - 2 * g + 2, g).unwrap(), usize::MAX - g + 1);
        assert!(round_to_granularity(10, 0).is_err());
    }

    #[test]
    fn claimed_vmm_sizes_are_whole_granules() {
        let g = 2 << 20;
        assert!(check_mapping_size(g, g).is_ok());
        assert!(check_mapping_size(7 * g, g).is_ok());
        for bad in [0, 1, g - 1, g + 1, usize::MAX] {
            let e = check_mapping_size(bad, g).unwrap_err();
            assert!(matches!(&e, Error::Malformed(m) if m.contains(&format!("{bad} bytes"))), "{e}");
        }
        assert!(check_mapping_size(g, 0).is_err());
        assert_eq!(reserve_alignment(g), g);
        assert_eq!(reserve_alignment(3 << 20), 0);
        assert_eq!(reserve_alignment(0), 0);
    }
}
