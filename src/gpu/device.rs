//! GPUs of this process: one primary context, one stream, the shipped kernels and the
//! interprocess event per device.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaStream};
use once_cell::sync::{Lazy, OnceCell};

use super::caching::Allocator;
use super::driver;
use super::handles::InterprocessEvent;
use super::kernels::Kernels;
use super::retire::Retirer;
use super::storage::GpuMemoryKind;
use crate::error::{Error, Result};

pub(crate) use super::driver::driver_err;

/// True when a CUDA driver and at least one GPU are usable by this process.
///
/// ```
/// if cuda_mp::cuda_available() {
///     assert!(cuda_mp::Device::count().unwrap() > 0);
/// }
/// ```
pub fn cuda_available() -> bool {
    Device::count().map(|n| n > 0).unwrap_or(false)
}

/// Runs `f`, then makes the thread's current CUDA context the one that was current before.
/// cuda-mp makes a device's context current for the driver calls it makes, and the CUDA
/// runtime (PyTorch's, say) takes the current context for its current device: code that
/// another library calls on its own threads (an allocator's hooks) wraps itself in this so
/// that the library's current device stays what it was.
///
/// ```no_run
/// let dev = cuda_mp::Device::get(1).unwrap();
/// cuda_mp::keeping_current_context(|| dev.synchronize()).unwrap();
/// ```
pub fn keeping_current_context<R>(f: impl FnOnce() -> R) -> R {
    // The driver first (once per process): the context current before this library's first
    // call is saved too. Where it cannot start, `f` makes no driver call either.
    let _ = init_driver();
    let _saved = super::handles::SavedContext::save();
    f()
}

fn init_driver() -> Result<()> {
    driver::check_not_forked()?;
    static INIT: OnceCell<std::result::Result<(), String>> = OnceCell::new();
    INIT.get_or_init(|| {
        if !driver::driver_library_present() {
            return Err("the CUDA driver library (libcuda.so) could not be loaded".into());
        }
        cu::init().map_err(|e| {
            if crate::fork::generation() > 0 {
                // Another library (PyTorch, say) initialized CUDA before the fork.
                format!("cuInit failed: {e} (perhaps {})", driver::FORKED_AFTER_CUDA)
            } else {
                format!("cuInit failed: {e}")
            }
        })?;
        driver::mark_initialized();
        Ok(())
    })
    .clone()
    .map_err(Error::CudaUnavailable)
}

/// The memory of new GPU memory on a device, in this process.
#[derive(Clone, Copy)]
pub(crate) struct Kinds {
    /// Of a storage allocated on its own (`Device::set_memory_kind`).
    pub(crate) storages: GpuMemoryKind,
    /// Of a new segment of the caching allocator (`Device::set_segment_kind`).
    pub(crate) segments: GpuMemoryKind,
}

/// A GPU as this process sees it, with the stream that cuda-mp orders its work on.
///
/// ```no_run
/// let dev = cuda_mp::Device::get(0).unwrap();
/// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[4]).unwrap();
/// assert_eq!(t.device().ordinal(), 0);
/// println!("{dev:?}"); // Device { ordinal: 0, uuid: "GPU-..." }
/// ```
pub struct Device {
    ordinal: usize,
    uuid: [u8; 16],
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// What this process knows of the work queued on `stream`.
    work: StreamWork,
    kernels: OnceCell<Kernels>,
    /// This process's interprocess event on the device (see `events.rs`); never destroyed,
    /// since devices live as long as the process.
    ipc_event: OnceCell<InterprocessEvent>,
    /// Whether the GPU makes VMM memory shareable as file descriptors (asked once).
    vmm_supported: OnceCell<bool>,
    /// The minimum VMM allocation granularity (asked once).
    vmm_granularity: OnceCell<usize>,
    /// Per peer GPU ordinal: true once this context has peer access to the peer's context,
    /// false when the hardware cannot reach it (asked once per pair).
    peers: Mutex<HashMap<usize, bool>>,
    /// The caching allocator of this process's tensors on the device.
    allocator: Arc<Allocator>,
    /// The memory this process's new storages and new allocator segments use here.
    kinds: Mutex<Kinds>,
    /// Releases of received memory waiting for the work queued on it (see `retire.rs`).
    retirer: Retirer,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device").field("ordinal", &self.ordinal).field("uuid", &self.uuid_string()).finish()
    }
}

/// What this process knows of the work on a device's stream, so that a send can tell the
/// stream idle without asking the driver (`cuStreamQuery` costs about 1.5 us). `queued` counts
/// each piece of work this library queues, right after it is queued; `done` is the highest
/// count known done (an idle answer covers what was counted before the question); `recorded`
/// is one more than the count read before the event's latest record. Once the stream is `lent`
/// out, only the driver can tell. See README.md here.
#[derive(Default)]
struct StreamWork {
    queued: AtomicU64,
    done: AtomicU64,
    recorded: AtomicU64,
    lent: AtomicBool,
}

impl StreamWork {
    /// True when everything queued on the stream is known to be done.
    fn known_idle(&self) -> bool {
        !self.lent.load(Ordering::SeqCst) && self.done.load(Ordering::SeqCst) == self.queued.load(Ordering::SeqCst)
    }

    /// True when the event's latest record is known to follow every piece of work counted.
    fn known_recorded(&self) -> bool {
        !self.lent.load(Ordering::SeqCst)
            && self.recorded.load(Ordering::SeqCst) == self.queued.load(Ordering::SeqCst).wrapping_add(1)
    }

    /// Runs `record` (a record of the event after the stream's work) and remembers what it
    /// covers: at least every piece counted before it.
    fn record(&self, record: impl FnOnce() -> Result<()>) -> Result<()> {
        let counted = self.queued.load(Ordering::SeqCst);
        record()?;
        self.recorded.fetch_max(counted.wrapping_add(1), Ordering::SeqCst);
        Ok(())
    }

    /// Runs `queue_and_wait` (work queued on the stream, then waited for) and counts it; once
    /// it succeeded, that work and every piece counted before it (queued before it) are done.
    fn synchronized<R>(&self, queue_and_wait: impl FnOnce() -> Result<R>) -> Result<R> {
        let counted = self.queued.load(Ordering::SeqCst);
        let result = queue_and_wait();
        self.queued.fetch_add(1, Ordering::SeqCst);
        let result = result?;
        self.done.fetch_max(counted.wrapping_add(1), Ordering::SeqCst);
        Ok(result)
    }

    /// Asks `is_idle` (the driver) unless the answer is known; remembers an idle answer.
    fn idle(&self, is_idle: impl FnOnce() -> Result<bool>) -> Result<bool> {
        if self.known_idle() {
            return Ok(true);
        }
        // Read before asking: what was counted by now was queued before the question.
        let counted = self.queued.load(Ordering::SeqCst);
        let idle = is_idle()?;
        if idle {
            self.done.fetch_max(counted, Ordering::SeqCst);
        }
        Ok(idle)
    }
}

static DEVICES: Lazy<Mutex<HashMap<usize, Arc<Device>>>> = Lazy::new(|| Mutex::new(HashMap::new()));

/// The devices this process opened; `None` while another thread holds the list (at exit, say).
pub(crate) fn opened_devices() -> Option<Vec<Arc<Device>>> {
    DEVICES.try_lock().ok().map(|d| d.values().cloned().collect())
}

/// Formats a GPU UUID the way `nvidia-smi -L` and `CUDA_VISIBLE_DEVICES` write it.
pub(crate) fn format_uuid(u: &[u8; 16]) -> String {
    let h = |r: std::ops::Range<usize>| super::storage::hex(&u[r]);
    format!("GPU-{}-{}-{}-{}-{}", h(0..4), h(4..6), h(6..8), h(8..10), h(10..16))
}

/// The error for a GPU (`access`) that cannot reach memory on another (`owner`).
pub(crate) fn no_peer_access(access: (usize, &[u8; 16]), owner: (usize, &[u8; 16])) -> Error {
    Error::NoPeerAccess {
        device: format!("{} ({})", access.0, format_uuid(access.1)),
        owner: format!("{} ({})", owner.0, format_uuid(owner.1)),
    }
}

fn device_uuid(dev: sys::CUdevice) -> Result<[u8; 16]> {
    let u = cu::device::get_uuid(dev).map_err(driver_err("cuDeviceGetUuid"))?;
    Ok(u.bytes.map(|b| b as u8))
}

impl Device {
    /// Number of GPUs visible to this process.
    ///
    /// ```no_run
    /// let n = cuda_mp::Device::count().unwrap();
    /// assert!(cuda_mp::Device::get(n).is_err()); // ordinals are 0..n
    /// ```
    pub fn count() -> Result<usize> {
        init_driver()?;
        Ok(cu::device::get_count().map_err(driver_err("cuDeviceGetCount"))? as usize)
    }

    /// The GPU with this ordinal (as numbered under this process's `CUDA_VISIBLE_DEVICES`).
    ///
    /// ```no_run
    /// use cuda_mp::Device;
    /// let dev = Device::get(0).unwrap();
    /// assert!(std::sync::Arc::ptr_eq(&dev, &Device::get(0).unwrap())); // one Device per GPU
    /// ```
    pub fn get(ordinal: usize) -> Result<Arc<Device>> {
        init_driver()?;
        if let Some(d) = DEVICES.lock().unwrap_or_else(|p| p.into_inner()).get(&ordinal) {
            return Ok(d.clone());
        }
        let count = Device::count()?;
        if ordinal >= count {
            return Err(Error::CudaUnavailable(format!("no gpu with ordinal {ordinal}: {count} visible")));
        }
        let mut devices = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = devices.get(&ordinal) {
            return Ok(d.clone());
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_err("cuDevicePrimaryCtxRetain"))?;
        let uuid = device_uuid(ctx.cu_device())?;
        let stream = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
        let device = Arc::new(Device {
            ordinal,
            uuid,
            ctx,
            stream,
            work: StreamWork::default(),
            kernels: OnceCell::new(),
            ipc_event: OnceCell::new(),
            vmm_supported: OnceCell::new(),
            vmm_granularity: OnceCell::new(),
            peers: Mutex::new(HashMap::new()),
            allocator: Arc::new(Allocator::new(true)),
            kinds: Mutex::new(Kinds { storages: GpuMemoryKind::Auto, segments: GpuMemoryKind::Auto }),
            retirer: Retirer::default(),
        });
        devices.insert(ordinal, device.clone());
        Ok(device)
    }

    /// The GPU with this UUID, whatever its ordinal in this process.
    ///
    /// ```no_run
    /// use cuda_mp::Device;
    /// let dev = Device::get(0).unwrap();
    /// assert!(std::sync::Arc::ptr_eq(&Device::by_uuid(&dev.uuid()).unwrap(), &dev));
    /// assert!(Device::by_uuid(&[0; 16]).is_err());
    /// ```
    pub fn by_uuid(uuid: &[u8; 16]) -> Result<Arc<Device>> {
        static BY_UUID: Lazy<Mutex<HashMap<[u8; 16], usize>>> = Lazy::new(|| Mutex::new(HashMap::new()));
        if let Some(&ordinal) = BY_UUID.lock().unwrap_or_else(|p| p.into_inner()).get(uuid) {
            return Device::get(ordinal);
        }
        for ordinal in 0..Device::count()? {
            let dev = cu::device::get(ordinal as i32).map_err(driver_err("cuDeviceGet"))?;
            if &device_uuid(dev)? == uuid {
                BY_UUID.lock().unwrap_or_else(|p| p.into_inner()).insert(*uuid, ordinal);
                return Device::get(ordinal);
            }
        }
        Err(Error::DeviceNotVisible { uuid: format_uuid(uuid) })
    }

    /// This process's caching allocator on the device.
    pub(crate) fn allocator(&self) -> &Arc<Allocator> {
        &self.allocator
    }

    /// Ordinal in this process.
    ///
    /// ```no_run
    /// assert_eq!(cuda_mp::Device::get(0).unwrap().ordinal(), 0);
    /// ```
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The GPU's UUID (the same in every process).
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// assert_eq!(cuda_mp::Device::by_uuid(&dev.uuid()).unwrap().ordinal(), dev.ordinal());
    /// ```
    pub fn uuid(&self) -> [u8; 16] {
        self.uuid
    }

    /// The UUID as `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let uuid = dev.uuid_string();
    /// assert!(uuid.starts_with("GPU-"));
    /// assert_eq!(uuid.len(), 40);
    /// ```
    pub fn uuid_string(&self) -> String {
        format_uuid(&self.uuid)
    }

    /// The primary context, as a cudarc context.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// assert_eq!(dev.context().ordinal(), dev.ordinal());
    /// ```
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream all of cuda-mp's work on this device is ordered on. Launch your own kernels
    /// on it, or make your stream wait for it, to stay ordered with received tensors: when this
    /// returns it has waited for the senders of every tensor received so far (waits for memory
    /// not used yet are queued here, at its first use, rather than at the receive).
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[4]).unwrap();
    /// assert!(std::sync::Arc::ptr_eq(t.stream(), dev.stream()));
    /// ```
    ///
    /// Work queued on it outside cuda-mp is invisible to this library's own account of the
    /// stream, so once it has been handed out, every send asks the driver whether the stream
    /// is idle (about 1.5 us a tensor) instead of knowing it.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.work.lent.store(true, Ordering::SeqCst);
        // A wait that fails here is not queued and its error is lost (this accessor cannot fail);
        // a broken context fails the next driver call anyway.
        let _ = super::events::settle(self);
        &self.stream
    }

    /// Runs `queue`, which queues work on the stream, after the waits the stream owes, and
    /// counts that work (see `StreamWork`): how this library queues on its own stream.
    pub(crate) fn enqueue<R>(&self, queue: impl FnOnce(&CudaStream) -> R) -> R {
        // As `stream()`: a wait that fails is reported by the next driver call.
        let _ = super::events::settle(self);
        self.enqueue_unsettled(queue)
    }

    /// As [`enqueue`](Self::enqueue) for `queue` that also waits for the stream (a synchronous
    /// copy): once it succeeds, its work and the work counted before it are known done, so
    /// that the next send need not ask the driver. Every `Ok` of `queue` must follow a wait for
    /// the stream, an empty copy's too.
    pub(crate) fn enqueue_synchronized<R>(&self, queue: impl FnOnce(&CudaStream) -> Result<R>) -> Result<R> {
        // As `enqueue`: a wait that fails is reported by the next driver call.
        let _ = super::events::settle(self);
        self.work.synchronized(|| queue(&self.stream))
    }

    /// As [`enqueue`](Self::enqueue), without first queuing the owed waits: for those waits.
    pub(crate) fn enqueue_unsettled<R>(&self, queue: impl FnOnce(&CudaStream) -> R) -> R {
        let result = queue(&self.stream);
        self.queued_work();
        result
    }

    /// Counts work just queued on the stream by hand (a raw stream handed to another library
    /// for one call): before anything asks whether the stream is idle.
    pub(crate) fn queued_work(&self) {
        self.work.queued.fetch_add(1, Ordering::SeqCst);
    }

    /// The count of work queued on the stream so far, or None once the stream was handed out
    /// (work queued outside this library is not counted): a record after reading it follows
    /// every piece of work counted up to it.
    pub(crate) fn counted_work(&self) -> Option<u64> {
        (!self.work.lent.load(Ordering::SeqCst)).then(|| self.work.queued.load(Ordering::SeqCst))
    }

    /// True when the stream's work is known done without asking the driver.
    pub(crate) fn stream_known_idle(&self) -> bool {
        self.work.known_idle()
    }

    /// True when the latest record of this process's interprocess event is known to follow
    /// all the work queued on the stream (nothing counted since, the stream never handed out).
    pub(crate) fn event_covers_work(&self) -> bool {
        self.work.known_recorded()
    }

    /// Records the interprocess event by `record`, remembering the work it covers.
    pub(crate) fn record_after_work(&self, record: impl FnOnce() -> Result<()>) -> Result<()> {
        self.work.record(record)
    }

    /// True when the work queued on the stream is done, the owed waits not counted: known
    /// when nothing counted was queued since the stream was last seen idle, else asked.
    pub(crate) fn own_work_done(&self) -> Result<bool> {
        // A forked child makes no driver call, and gets the same error whether known or asked.
        driver::check_not_forked()?;
        self.work.idle(|| driver::stream_is_idle(&self.stream))
    }

    /// The stream, without first queuing the waits it owes for received memory (see
    /// `events.rs`): for the event records and waits themselves, and for drops.
    pub(crate) fn unsettled_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Blocks until the work this process queued on the stream is done, the waits it owes not
    /// queued: what a drop needs before memory is freed, unmapped or handed back (an owed wait
    /// puts no work of ours on the memory, and queuing it would wait for the sender).
    pub(crate) fn finish_own_work(&self) -> Result<()> {
        // A forked child makes no driver call: what it inherited is dropped without one.
        super::driver::check_not_forked()?;
        // A synchronize that returns is an idle answer: known idle, it is not needed.
        self.work.idle(|| self.stream.synchronize().map(|()| true).map_err(driver_err("cuStreamSynchronize"))).map(drop)
    }

    /// Blocks until the stream's queued work is done.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[1 << 20]).unwrap();
    /// t.fill(1.0).unwrap(); // queued
    /// dev.synchronize().unwrap(); // done
    /// assert_eq!(t.to_vec().unwrap()[0], 1.0);
    /// ```
    pub fn synchronize(&self) -> Result<()> {
        super::events::settle(self)?;
        self.finish_own_work()
    }

    /// True when the stream has no queued work left: another library that shares the memory
    /// need not wait for this one. Known without a driver call while nothing was queued
    /// through cuda-mp since the stream was last seen idle (and it was never handed out by
    /// [`stream`](Self::stream)); asked of the driver (`cuStreamQuery`) otherwise.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// dev.synchronize().unwrap();
    /// assert!(dev.is_idle().unwrap());
    /// ```
    pub fn is_idle(&self) -> Result<bool> {
        super::events::settle(self)?;
        self.own_work_done()
    }

    /// Makes `stream`, a stream of another library in this device's context (a PyTorch stream,
    /// say), wait for the work queued on this device's stream, without blocking the host;
    /// nothing when that is idle. This is how memory received here is handed to another
    /// library: a received tensor's stream has waited for its sender's work.
    ///
    /// # Safety
    /// `stream` must be a live stream of this device's primary context, or the legacy (0) or
    /// per-thread (2) default stream.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// // SAFETY: 0 is the legacy default stream.
    /// unsafe { dev.order_stream_after(std::ptr::null_mut()) }.unwrap();
    /// ```
    pub unsafe fn order_stream_after(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: upheld by the caller.
        unsafe { super::events::order_after(self, stream) }
    }

    /// Makes this device's stream wait for the work queued so far on `stream`, a stream of
    /// another library in this device's context (a PyTorch stream, say), without blocking the
    /// host; nothing when that is idle. This is how another library's memory is handed to
    /// cuda-mp: a send is ordered after what the device's stream waits for.
    ///
    /// # Safety
    /// `stream` must be a live stream of this device's primary context, or the legacy (0) or
    /// per-thread (2) default stream.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// // SAFETY: 0 is the legacy default stream.
    /// unsafe { dev.wait_for_stream(std::ptr::null_mut()) }.unwrap();
    /// ```
    pub unsafe fn wait_for_stream(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: upheld by the caller.
        unsafe { super::events::wait_for(self, stream) }
    }

    /// Free and total device memory in bytes (`cuMemGetInfo`).
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let (free, total) = dev.memory_info().unwrap();
    /// assert!(free <= total);
    /// ```
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        cu::mem_get_info().map_err(driver_err("cuMemGetInfo"))
    }

    /// True when kernels on this device can read and write memory of `peer` directly.
    ///
    /// ```no_run
    /// use cuda_mp::Device;
    /// let (a, b) = (Device::get(0).unwrap(), Device::get(1).unwrap());
    /// assert_eq!(a.can_access_peer(&b).unwrap(), a.require_peer_access(&b).is_ok());
    /// ```
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool> {
        driver::can_access_peer(self.ctx.cu_device(), peer.ctx.cu_device()).map_err(driver_err("cuDeviceCanAccessPeer"))
    }

    /// Succeeds when kernels on this GPU can read and write memory of `owner` (the same GPU, or
    /// a peer); otherwise the error names both GPUs.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// dev.require_peer_access(&dev).unwrap(); // a GPU always reaches its own memory
    /// ```
    pub fn require_peer_access(&self, owner: &Device) -> Result<()> {
        if self.uuid == owner.uuid || self.can_access_peer(owner)? {
            return Ok(());
        }
        Err(no_peer_access((self.ordinal, &self.uuid), (owner.ordinal, &owner.uuid)))
    }

    /// The driver's handle of the GPU.
    pub(crate) fn cu_device(&self) -> sys::CUdevice {
        self.ctx.cu_device()
    }

    /// Succeeds when kernels on this GPU can read and write memory on GPU `owner` (a device of
    /// this process, the same GPU or a peer); otherwise the error names both GPUs. Unlike
    /// [`require_peer_access`](Self::require_peer_access) it needs no `Device` for `owner`, so
    /// no context is made on it.
    pub(crate) fn require_access_to(&self, owner: sys::CUdevice) -> Result<()> {
        let here = self.cu_device();
        if owner == here || driver::can_access_peer(here, owner).map_err(driver_err("cuDeviceCanAccessPeer"))? {
            return Ok(());
        }
        // A device handle is its ordinal in this process.
        let owner_ordinal = usize::try_from(owner).unwrap_or(usize::MAX);
        Err(no_peer_access((self.ordinal, &self.uuid), (owner_ordinal, &device_uuid(owner)?)))
    }

    /// Gives this device's context direct access to `peer`'s (`cuCtxEnablePeerAccess`), once
    /// per pair, when the hardware allows it (`cuDeviceCanAccessPeer`): copies between the two
    /// then go over NVLink or PCIe instead of through host memory. True when this context can
    /// reach `peer`'s memory directly (always for the same GPU); false when the GPUs have no
    /// peer access, which is not an error.
    pub(crate) fn enable_peer_access(&self, peer: &Device) -> Result<bool> {
        if self.uuid == peer.uuid {
            return Ok(true);
        }
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&enabled) = peers.get(&peer.ordinal) {
            return Ok(enabled);
        }
        let can = self.can_access_peer(peer)?;
        if can {
            driver::enable_peer_access(&self.ctx, &peer.ctx)?;
        }
        peers.insert(peer.ordinal, can);
        Ok(can)
    }

    /// True when this GPU supports virtual memory management with memory shareable as POSIX
    /// file descriptors (`CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED` and
    /// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`); asked once.
    pub(crate) fn vmm_supported(&self) -> Result<bool> {
        self.vmm_supported
            .get_or_try_init(|| {
                use sys::CUdevice_attribute as A;
                let has = |a| self.ctx.attribute(a).map(|v| v != 0).map_err(driver_err("cuDeviceGetAttribute"));
                Ok(has(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)?
                    && has(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)?)
            })
            .copied()
    }

    /// An error unless this GPU makes VMM memory shareable as file descriptors.
    pub(crate) fn require_vmm(&self) -> Result<()> {
        if self.vmm_supported()? {
            return Ok(());
        }
        Err(Error::Unsupported(format!(
            "gpu {} has no virtual memory management with file-descriptor export",
            self.uuid_string()
        )))
    }

    /// The memory kinds this process uses for new memory on this GPU.
    pub(crate) fn kinds(&self) -> MutexGuard<'_, Kinds> {
        self.kinds.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The minimum allocation granularity of such memory on this GPU
    /// (`cuMemGetAllocationGranularity`, `CU_MEM_ALLOC_GRANULARITY_MINIMUM`): VMM sizes are
    /// multiples of it. Asked once (a granularity of 0 is refused where sizes are rounded).
    pub(crate) fn vmm_granularity(&self) -> Result<usize> {
        let ask = || driver::vmm_granularity(self.cu_device()).map_err(driver_err("cuMemGetAllocationGranularity"));
        self.vmm_granularity.get_or_try_init(ask).copied()
    }

    /// Makes the device's context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<()> {
        driver::bind(&self.ctx)
    }

    /// The shipped kernels, loaded in the device's context on first use.
    pub(crate) fn kernels(&self) -> Result<&Kernels> {
        self.kernels.get_or_try_init(|| Kernels::load(&self.ctx))
    }

    /// The queue of releases that wait for the work queued on the stream.
    pub(crate) fn retirer(&self) -> &Retirer {
        &self.retirer
    }

    /// The cell of this process's interprocess event on the device (created by `events.rs` on
    /// the first send with queued work).
    pub(crate) fn ipc_event_cell(&self) -> &OnceCell<InterprocessEvent> {
        &self.ipc_event
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_print_like_nvidia_smi_and_peer_errors_name_both_gpus() {
        let a: [u8; 16] =
            [0xab, 0x7e, 0x11, 0xa6, 0x41, 0x88, 0xe5, 0xf8, 0xb2, 0xb8, 0x94, 0xf2, 0xf1, 0x2d, 0x20, 0x51];
        assert_eq!(format_uuid(&a), "GPU-ab7e11a6-4188-e5f8-b2b8-94f2f12d2051");
        let b = [0u8; 16];
        let e = no_peer_access((1, &a), (0, &b)).to_string();
        assert_eq!(
            e,
            "gpu 1 (GPU-ab7e11a6-4188-e5f8-b2b8-94f2f12d2051) cannot access memory on gpu 0 \
             (GPU-00000000-0000-0000-0000-000000000000): the two gpus have no peer access"
        );
    }

    /// `StreamWork::idle` with a driver that answers `answer` and counts its questions.
    fn ask(work: &StreamWork, answer: bool, asked: &mut u32) -> bool {
        work.idle(|| {
            *asked += 1;
            Ok(answer)
        })
        .unwrap()
    }

    #[test]
    fn a_stream_is_known_idle_only_when_everything_counted_was_seen_done() {
        let work = StreamWork::default();
        let mut asked = 0;
        assert!(ask(&work, false, &mut asked), "nothing queued: idle without asking");
        assert_eq!(asked, 0);
        work.queued.fetch_add(1, Ordering::SeqCst);
        assert!(!work.known_idle());
        assert!(!ask(&work, false, &mut asked), "busy as the driver says");
        assert!(!work.known_idle(), "a busy answer proves nothing done");
        assert!(ask(&work, true, &mut asked));
        assert_eq!(asked, 2);
        assert!(work.known_idle());
        assert!(ask(&work, false, &mut asked), "known: the driver is not asked again");
        assert_eq!(asked, 2);
    }

    #[test]
    fn work_counted_during_the_question_is_not_taken_as_done() {
        let work = StreamWork::default();
        work.queued.fetch_add(1, Ordering::SeqCst);
        // Another thread queues and counts work while the driver is asked: the idle answer
        // may predate it.
        let idle = work
            .idle(|| {
                work.queued.fetch_add(1, Ordering::SeqCst);
                Ok(true)
            })
            .unwrap();
        assert!(idle);
        assert!(!work.known_idle(), "the work counted during the question may still run");
        assert_eq!(work.done.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_synchronous_copy_leaves_the_stream_known_idle_unless_more_work_was_counted_meanwhile() {
        let work = StreamWork::default();
        work.queued.fetch_add(2, Ordering::SeqCst);
        work.synchronized(|| Ok(())).unwrap();
        assert!(work.known_idle(), "the copy waited for the two pieces before it, and for itself");
        work.queued.fetch_add(1, Ordering::SeqCst);
        let failed = work.synchronized(|| Err::<(), _>(Error::Unsupported("a failed copy".into())));
        assert!(failed.is_err());
        assert!(!work.known_idle(), "a failed copy proves nothing done");
        // Another thread counts work while the copy runs: the copy need not have waited for it.
        work.synchronized(|| {
            work.queued.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .unwrap();
        assert!(!work.known_idle(), "work counted during the copy may still run");
        assert_eq!(work.done.load(Ordering::SeqCst), 6, "the five pieces before the copy, and the copy");
        assert_eq!(work.queued.load(Ordering::SeqCst), 7);
    }

    #[test]
    fn a_lent_stream_is_always_asked() {
        let work = StreamWork::default();
        work.lent.store(true, Ordering::SeqCst);
        let mut asked = 0;
        assert!(!ask(&work, false, &mut asked), "work queued by others is only the driver's to tell");
        assert!(ask(&work, true, &mut asked));
        assert!(ask(&work, true, &mut asked));
        assert_eq!(asked, 3);
    }

    #[test]
    fn a_record_covers_the_sends_that_follow_until_more_work_is_counted() {
        let work = StreamWork::default();
        assert!(!work.known_recorded(), "never recorded");
        work.queued.fetch_add(1, Ordering::SeqCst);
        work.record(|| Ok(())).unwrap();
        assert!(work.known_recorded(), "the record follows the one piece counted");
        work.queued.fetch_add(1, Ordering::SeqCst);
        assert!(!work.known_recorded(), "work counted after the record");
        // Work counted while the record is made: the record may precede it.
        work.record(|| {
            work.queued.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .unwrap();
        assert!(!work.known_recorded());
        assert!(work.record(|| Err(Error::CudaUnavailable("gone".into()))).is_err());
        assert!(!work.known_recorded(), "a failed record covers nothing");
        work.record(|| Ok(())).unwrap();
        assert!(work.known_recorded());
        work.lent.store(true, Ordering::SeqCst);
        assert!(!work.known_recorded(), "others' work on a lent stream is not counted");
    }

    #[test]
    fn a_failed_question_changes_nothing() {
        let work = StreamWork::default();
        work.queued.fetch_add(1, Ordering::SeqCst);
        assert!(work.idle(|| Err(Error::CudaUnavailable("gone".into()))).is_err());
        assert!(!work.known_idle());
    }
}
