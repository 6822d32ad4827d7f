//! Owners of driver objects, one type each, holding their typed driver handle: a device
//! allocation, a mapping of another process's allocation, this process's interprocess event,
//! an opened event of another process, the shipped kernel module and its functions. Each is
//! released once, by its `Drop`; each method makes the owner's context current itself. With
//! `driver.rs`, the only file of `src/gpu/` with `unsafe`: the `Send`/`Sync` impls of types
//! holding raw handles are here too.

use std::ffi::CString;
use std::fmt;
use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaStream};

use super::device::Device;
use super::driver::{self, driver_err, DeviceRange, IpcHandle, KernelArgs, KernelOp};
use super::kernels;
use crate::dtype::DType;
use crate::error::{Error, Result};

fn bind(ctx: &CudaContext) -> Result<()> {
    ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))
}

/// Device memory from `cuMemAlloc`, which legacy CUDA IPC can export (the stream-ordered pool
/// behind cudarc's `CudaSlice` cannot). Dropping it waits for the work queued on the device's
/// stream, then frees it.
pub(crate) struct DeviceAllocation {
    device: Arc<Device>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl DeviceAllocation {
    /// Allocates `bytes` bytes (uninitialized) on `device`; a zero-byte request gets one byte.
    pub(crate) fn new(device: &Arc<Device>, bytes: usize) -> Result<DeviceAllocation> {
        device.bind()?;
        // SAFETY: the context is current; the pointer is owned by the value built here, whose
        // drop frees it once.
        let ptr = unsafe { driver::mem_alloc(bytes.max(1)) }.map_err(driver_err("cuMemAlloc"))?;
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

impl fmt::Debug for DeviceAllocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceAllocation")
            .field("device", &self.device.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for DeviceAllocation {
    fn drop(&mut self) {
        // Errors cannot be returned from drop; the driver reports them again on the next call.
        if self.device.bind().is_err() {
            return;
        }
        // Work queued on the memory must finish before it is freed.
        let _ = self.device.synchronize();
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

impl fmt::Debug for IpcMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcMapping")
            .field("device", &self.device.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("size", &self.size)
            .finish()
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // Errors cannot be returned from drop; the driver reports them again on the next call.
        if self.device.bind().is_err() {
            return;
        }
        // Our work on the memory must finish before the owner may free it.
        let _ = self.device.synchronize();
        // SAFETY: `ptr` came from cuIpcOpenMemHandle in this (current) context, our stream has
        // no work left on it, and nothing uses it any more.
        let _ = unsafe { driver::ipc_close_mem_handle(self.ptr) };
    }
}

/// An event created with `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`, with the IPC
/// handle other processes open it by. Dropping it destroys it.
pub(crate) struct InterprocessEvent {
    ctx: Arc<CudaContext>,
    raw: sys::CUevent,
    handle: IpcHandle,
}

// SAFETY: a CUevent is a driver handle, usable from any thread once its context is current,
// which every method (and drop) makes sure of; the driver synchronizes concurrent use.
unsafe impl Send for InterprocessEvent {}
// SAFETY: as above; nothing in the value is mutated after construction.
unsafe impl Sync for InterprocessEvent {}

impl InterprocessEvent {
    /// Creates an interprocess event on `device`.
    pub(crate) fn create(device: &Device) -> Result<InterprocessEvent> {
        let ctx = device.context().clone();
        bind(&ctx)?;
        // SAFETY: the context is current; the event is destroyed once, by the value built here.
        let raw = unsafe { driver::event_create_interprocess() }.map_err(driver_err("cuEventCreate"))?;
        let mut event = InterprocessEvent { ctx, raw, handle: [0; driver::IPC_HANDLE_BYTES] };
        // SAFETY: the context is current and `raw` a live interprocess event (on error, `event`
        // destroys it).
        event.handle = unsafe { driver::ipc_get_event_handle(raw) }.map_err(driver_err("cuIpcGetEventHandle"))?;
        Ok(event)
    }

    /// The handle another process opens with [`OpenedEvent::open`].
    pub(crate) fn handle(&self) -> &IpcHandle {
        &self.handle
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
}

impl fmt::Debug for InterprocessEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InterprocessEvent").field("event", &self.raw).finish_non_exhaustive()
    }
}

impl Drop for InterprocessEvent {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: created in this (current) context; nothing uses it after.
            let _ = unsafe { driver::event_destroy(self.raw) };
        }
    }
}

/// Another process's interprocess event, opened with `cuIpcOpenEventHandle`. Dropping it
/// destroys this process's reference; waits already queued are not affected.
pub(crate) struct OpenedEvent {
    ctx: Arc<CudaContext>,
    raw: sys::CUevent,
}

// SAFETY: a CUevent is a driver handle, usable from any thread once its context is current,
// which every method (and drop) makes sure of; the driver synchronizes concurrent use.
unsafe impl Send for OpenedEvent {}
// SAFETY: as above; nothing in the value is mutated after construction.
unsafe impl Sync for OpenedEvent {}

impl OpenedEvent {
    /// Opens the event of `handle` on `device`, the GPU it was recorded on.
    pub(crate) fn open(device: &Device, handle: &IpcHandle) -> Result<OpenedEvent> {
        let ctx = device.context().clone();
        bind(&ctx)?;
        // SAFETY: the context is current; the event is destroyed once, by the value built here.
        let raw = unsafe { driver::ipc_open_event_handle(handle) }.map_err(driver_err("cuIpcOpenEventHandle"))?;
        Ok(OpenedEvent { ctx, raw })
    }

    /// True when the work before the event's latest record is done (`cuEventQuery`).
    pub(crate) fn is_complete(&self) -> Result<bool> {
        bind(&self.ctx)?;
        // SAFETY: the context is current and the event live.
        unsafe { driver::event_is_complete(self.raw) }.map_err(driver_err("cuEventQuery"))
    }

    /// Makes work queued later on `stream` (of any device) wait for the event, without
    /// blocking the host (`cuStreamWaitEvent`).
    pub(crate) fn wait_on(&self, stream: &CudaStream) -> Result<()> {
        bind(stream.context())?;
        // SAFETY: the stream's context is current; the stream and the event are live (an event
        // of another context may be waited on).
        unsafe { driver::stream_wait_event(stream.cu_stream(), self.raw) }.map_err(driver_err("cuStreamWaitEvent"))
    }
}

impl fmt::Debug for OpenedEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenedEvent").field("event", &self.raw).finish_non_exhaustive()
    }
}

impl Drop for OpenedEvent {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: opened in this (current) context; nothing uses it after.
            let _ = unsafe { driver::event_destroy(self.raw) };
        }
    }
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

impl fmt::Debug for Module {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Module").field("module", &self.raw).finish_non_exhaustive()
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

impl fmt::Debug for KernelFunction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KernelFunction({}_{})", self.op.name(), self.dtype.name())
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
        send_sync::<OpenedEvent>();
        send_sync::<Module>();
        send_sync::<KernelFunction>();
        send_sync::<Device>();
    }
}
