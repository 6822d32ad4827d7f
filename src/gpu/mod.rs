//! GPU tensors: device memory shared across processes through CUDA IPC. See README.md here.

mod bundle;
#[cfg(all(test, feature = "remote"))]
pub(crate) use bundle::table_of_tensors;
mod caching;
mod device;
mod driver;
mod events;
mod handles;
mod kernels;
#[cfg(feature = "remote")]
mod nccl;
mod retire;
mod storage;
mod torch;
mod torch_refs;
mod vmm;

use std::sync::Arc;

use cudarc::driver::CudaStream;
use cudarc::driver::sys;
use ndarray::{ArrayBase, ArrayD, Data, Dimension, IxDyn};

use driver::{KernelArgs, KernelView};

pub use bundle::{Bundle, BundleBuilder, BundleEntry, DEFAULT_CHUNK_BYTES};
pub use device::{Device, cuda_available, keeping_current_context};
pub use storage::{GpuMemoryKind, GpuStorage, IpcPayload, VMM_MIN_BYTES};
pub use torch::{TorchIpcHandle, TorchIpcStats, torch_ipc_stats};

/// How many senders' events `device`'s stream owes a wait on (received memory not used yet).
#[cfg(any(test, feature = "testing"))]
pub(crate) fn owed_waits(device: &Device) -> usize {
    events::owed(device)
}

/// Whether this process knows, without asking the driver, that the work on `device`'s stream
/// is done (nothing counted queued since it was last seen idle, and the stream never handed out).
#[cfg(any(test, feature = "testing"))]
pub(crate) fn stream_known_idle(device: &Device) -> bool {
    device.stream_known_idle()
}

/// Fences the drops of received memory recorded on `device` (`testing::fences_recorded`).
#[cfg(any(test, feature = "testing"))]
pub(crate) fn fences_recorded(device: &Device) -> u64 {
    device.fences_recorded()
}

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::lifetime::StorageId;
use crate::tensor::Tensor;

/// A tensor in GPU memory. Sending it through a channel exports its allocation as a CUDA IPC
/// handle; the receiver maps the same memory, after the work queued on it here.
///
/// ```no_run
/// let dev = cuda_mp::Device::get(0).unwrap();
/// let t = cuda_mp::GpuTensor::<f32>::full(&dev, &[2, 3], 1.0).unwrap();
/// t.add_scalar(1.0).unwrap(); // queued on the device's stream
/// assert_eq!(t.to_vec().unwrap(), vec![2.0; 6]);
/// ```
pub type GpuTensor<T> = Tensor<T, GpuStorage>;

impl<T: Element> Tensor<T, GpuStorage> {
    /// A contiguous tensor of zeros on `device`.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<i32>::zeros(&dev, &[2, 3]).unwrap();
    /// assert_eq!(t.to_vec().unwrap(), vec![0; 6]);
    /// ```
    pub fn zeros(device: &Arc<Device>, shape: &[usize]) -> Result<Self> {
        let t = Self::uninit(device, shape)?;
        let range = t.storage.range()?;
        device.enqueue(|s| driver::memset_d8(s, range, 0))?;
        Ok(t)
    }

    /// A contiguous tensor whose contents are whatever its memory held (as `torch.empty`): no
    /// kernel is queued, so sending it right away costs no event. Memory from the caching
    /// allocator may hold an earlier tensor's values of this process; `bool` elements read
    /// back as 0 or 1 whatever the bytes.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::empty(&dev, &[2, 3]).unwrap();
    /// t.fill(1.0).unwrap();
    /// assert_eq!(t.to_vec().unwrap(), vec![1.0; 6]);
    /// ```
    pub fn empty(device: &Arc<Device>, shape: &[usize]) -> Result<Self> {
        Self::uninit(device, shape)
    }

    fn uninit(device: &Arc<Device>, shape: &[usize]) -> Result<Self> {
        let layout = Layout::contiguous(shape)?;
        let bytes =
            layout.numel().checked_mul(T::DTYPE.size()).ok_or_else(|| Error::Layout("tensor size overflows".into()))?;
        Ok(Tensor::from_parts(GpuStorage::alloc(device, bytes)?, layout))
    }

    /// A contiguous tensor with every element `value`.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::full(&dev, &[4], 2.5f32).unwrap();
    /// assert_eq!(t.to_vec().unwrap(), vec![2.5; 4]);
    /// ```
    pub fn full(device: &Arc<Device>, shape: &[usize], value: T) -> Result<Self> {
        let t = Self::uninit(device, shape)?;
        t.fill(value)?;
        Ok(t)
    }

    /// Copies an ndarray array to a new contiguous tensor on `device`.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let a = cuda_mp::ndarray::arr2(&[[1.0f32, 2.0], [3.0, 4.0]]);
    /// let t = cuda_mp::GpuTensor::from_ndarray(&dev, &a).unwrap();
    /// assert_eq!(t.to_ndarray().unwrap(), a.into_dyn());
    /// ```
    pub fn from_ndarray<S: Data<Elem = T>, D: Dimension>(
        device: &Arc<Device>,
        array: &ArrayBase<S, D>,
    ) -> Result<Self> {
        let t = Self::uninit(device, array.shape())?;
        let host: Vec<T> = array.iter().copied().collect();
        // Waits for the copy: `host` is dropped right after.
        let range = t.storage.range()?;
        device.enqueue_synchronized(|s| driver::copy_htod(s, &host, range))?;
        Ok(t)
    }

    /// A contiguous tensor of `shape` holding `data` in row-major order.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::from_vec(&dev, &[2, 2], vec![1i64, 2, 3, 4]).unwrap();
    /// assert_eq!(t.select(0, 1).unwrap().to_vec().unwrap(), vec![3, 4]);
    /// assert!(cuda_mp::GpuTensor::from_vec(&dev, &[2, 2], vec![1i64]).is_err());
    /// ```
    pub fn from_vec(device: &Arc<Device>, shape: &[usize], data: Vec<T>) -> Result<Self> {
        let array = ArrayD::from_shape_vec(IxDyn(shape), data).map_err(|e| Error::Layout(e.to_string()))?;
        Self::from_ndarray(device, &array)
    }

    /// Copies the view to the host, after the work queued on it: a contiguous view straight
    /// into the array's memory; any other view as the range of storage that covers it, then
    /// gathered.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<i32>::from_vec(&dev, &[2, 3], (0..6).collect()).unwrap();
    /// let a = t.transpose(0, 1).unwrap().to_ndarray().unwrap();
    /// assert_eq!(a, cuda_mp::ndarray::arr2(&[[0, 3], [1, 4], [2, 5]]).into_dyn());
    /// ```
    pub fn to_ndarray(&self) -> Result<ArrayD<T>> {
        ArrayD::from_shape_vec(IxDyn(self.shape()), self.to_vec()?).map_err(|e| Error::Layout(e.to_string()))
    }

    /// Copies the view to a host vector in row-major order (a contiguous view with one copy
    /// and no pass over its elements).
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<i32>::from_vec(&dev, &[2, 3], (0..6).collect()).unwrap();
    /// assert_eq!(t.narrow(1, 1, 2).unwrap().to_vec().unwrap(), vec![1, 2, 4, 5]);
    /// ```
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let size = T::DTYPE.size();
        let first = self.offset();
        let covered = self.layout.extent()?.saturating_sub(first);
        if covered == 0 {
            return Ok(Vec::new());
        }
        let range = self.storage.range()?.sub(first * size, covered * size)?;
        let covering: Vec<T> = self.device().enqueue_synchronized(|s| driver::copy_dtoh(s, range))?;
        Ok(if self.is_contiguous() {
            // The covering range is the view, in order.
            covering
        } else {
            // Every index is in first..extent, so inside `covering`.
            self.layout.indices().map(|i| covering[i - first]).collect()
        })
    }

    /// Sets every element of the view to `value` (queued on the device's stream).
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[2, 3]).unwrap();
    /// t.narrow(1, 0, 1).unwrap().fill(9.0).unwrap(); // column 0 of `t`
    /// assert_eq!(t.to_vec().unwrap(), vec![9.0, 0.0, 0.0, 9.0, 0.0, 0.0]);
    /// ```
    pub fn fill(&self, value: T) -> Result<()> {
        kernels::launch(self.device(), KernelArgs::Fill { view: self.kernel_view()?, bits: value.to_bits() })
    }

    /// Sets every element of each tensor to the value beside it, as [`fill`](Self::fill) on
    /// each would, with one kernel launch for each run of up to 64 contiguous tensors in a row
    /// (a tensor that is not contiguous gets a launch of its own, and ends the run). A process
    /// that writes many small tensors (the blocks of a paged KV cache) gives the GPU one
    /// command instead of one a tensor; without MPS the GPU runs one process at a time and may
    /// switch to another process whenever this one's queue runs dry between two launches. All
    /// tensors must be on one GPU; where two views overlap, which of their values an element
    /// ends with is not given.
    ///
    /// ```no_run
    /// use cuda_mp::GpuTensor;
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let (a, b) = (GpuTensor::<f32>::zeros(&dev, &[4]).unwrap(), GpuTensor::<f32>::zeros(&dev, &[2]).unwrap());
    /// GpuTensor::fill_each(&[(&a, 1.0), (&b, 2.0)]).unwrap();
    /// assert_eq!((a.to_vec().unwrap(), b.to_vec().unwrap()), (vec![1.0; 4], vec![2.0; 2]));
    /// ```
    pub fn fill_each(items: &[(&GpuTensor<T>, T)]) -> Result<()> {
        let Some(device) = Self::one_device(items)? else { return Ok(()) };
        kernels::fill_many(device, T::DTYPE, &Self::kernel_views(items)?)
    }

    /// Adds to `counter`'s first element the number of elements of each tensor that are not
    /// the value beside it, as [`count_not_equal`](Self::count_not_equal) on each would, with
    /// one kernel launch for each run of up to 64 contiguous tensors in a row (see
    /// [`fill_each`](Self::fill_each)). All tensors and `counter` must be on one GPU.
    ///
    /// ```no_run
    /// use cuda_mp::GpuTensor;
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let a = GpuTensor::from_vec(&dev, &[3], vec![1.0f32, 2.0, 1.0]).unwrap();
    /// let b = GpuTensor::<f32>::full(&dev, &[2], 5.0).unwrap();
    /// let counter = GpuTensor::<i64>::zeros(&dev, &[1]).unwrap();
    /// GpuTensor::count_not_equal_each(&[(&a, 1.0), (&b, 5.0)], &counter).unwrap();
    /// assert_eq!(counter.to_vec().unwrap(), vec![1]);
    /// ```
    pub fn count_not_equal_each(items: &[(&GpuTensor<T>, T)], counter: &GpuTensor<i64>) -> Result<()> {
        let device = Self::one_device(items)?.unwrap_or(counter.device());
        let count = counter.counter_range(device)?;
        kernels::count_ne_many(device, T::DTYPE, &Self::kernel_views(items)?, count)
    }

    /// The view as the kernels take it, checked against its storage.
    fn kernel_view(&self) -> Result<KernelView> {
        KernelView::new(self.storage.range()?, &self.layout, T::DTYPE)
    }

    /// Each tensor of `items` as the kernels take it: its memory, its layout and its value's bits.
    fn kernel_views<'a>(items: &[(&'a GpuTensor<T>, T)]) -> Result<Vec<kernels::ViewAndValue<'a>>> {
        items.iter().map(|(t, v)| Ok((t.storage.range()?, &t.layout, v.to_bits()))).collect()
    }

    /// The GPU of every tensor of `items` (`None` for none); an error when they are on more
    /// than one.
    fn one_device<'a>(items: &[(&'a GpuTensor<T>, T)]) -> Result<Option<&'a Arc<Device>>> {
        let Some((first, _)) = items.first() else { return Ok(None) };
        if items.iter().any(|(t, _)| !Arc::ptr_eq(t.device(), first.device())) {
            return Err(Error::Unsupported("tensors on more than one gpu in one call".into()));
        }
        Ok(Some(first.device()))
    }

    /// Adds `value` to every element of the view, in place (queued on the device's stream);
    /// not for `bool`. Integer elements are added in double precision and converted back
    /// toward zero: exact while the operands and the result are within 2^53 and the result
    /// fits the element type (past it, a 32- or 64-bit result saturates; an 8- or 16-bit one
    /// is unspecified).
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::from_vec(&dev, &[3], vec![1i32, 2, 3]).unwrap();
    /// t.add_scalar(10.0).unwrap();
    /// assert_eq!(t.to_vec().unwrap(), vec![11, 12, 13]);
    /// let flags = cuda_mp::GpuTensor::<bool>::zeros(&dev, &[3]).unwrap();
    /// assert!(matches!(flags.add_scalar(1.0), Err(cuda_mp::Error::Unsupported(_))));
    /// ```
    pub fn add_scalar(&self, value: f64) -> Result<()> {
        if T::DTYPE == DType::Bool {
            return Err(Error::Unsupported("add_scalar on a bool tensor".into()));
        }
        kernels::launch(self.device(), KernelArgs::Add { view: self.kernel_view()?, value })
    }

    /// Adds to `counter`'s first element the number of elements of this view that are not
    /// `value` (bit for bit: `-0.0` is not `0.0`, a NaN equals the same NaN), queued on the
    /// device's stream: a check of a tensor's contents on the GPU, read back once for any
    /// number of checks. `counter` must be on the same GPU.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::from_vec(&dev, &[4], vec![1.0f32, 2.0, 1.0, 1.0]).unwrap();
    /// let counter = cuda_mp::GpuTensor::<i64>::zeros(&dev, &[1]).unwrap();
    /// t.count_not_equal(1.0, &counter).unwrap();
    /// t.narrow(0, 2, 2).unwrap().count_not_equal(1.0, &counter).unwrap();
    /// assert_eq!(counter.to_vec().unwrap(), vec![1]);
    /// ```
    pub fn count_not_equal(&self, value: T, counter: &GpuTensor<i64>) -> Result<()> {
        let count = counter.counter_range(self.device())?;
        kernels::launch(self.device(), KernelArgs::CountNe { view: self.kernel_view()?, bits: value.to_bits(), count })
    }

    /// Copies `src` (same shape) into this view, element by element. Between two GPUs both
    /// views must be contiguous: the copy is a peer copy by the copy engines, after `src`'s
    /// queued work, and it returns once the copy is done (nothing on `src`'s device orders
    /// later work after a copy queued on this one's, so `src` may be written, dropped or
    /// received into only then).
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let a = cuda_mp::GpuTensor::from_vec(&dev, &[2, 2], vec![1.0f32, 2.0, 3.0, 4.0]).unwrap();
    /// let b = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[2, 2]).unwrap();
    /// b.copy_from(&a.transpose(0, 1).unwrap()).unwrap();
    /// assert_eq!(b.to_vec().unwrap(), vec![1.0, 3.0, 2.0, 4.0]);
    /// ```
    ///
    /// Both tensors have one element type:
    ///
    /// ```compile_fail,E0308
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let a = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[4]).unwrap();
    /// let b = cuda_mp::GpuTensor::<cuda_mp::f16>::zeros(&dev, &[4]).unwrap();
    /// a.copy_from(&b).unwrap();
    /// ```
    pub fn copy_from(&self, src: &Self) -> Result<()> {
        if src.shape() != self.shape() {
            return Err(Error::Layout(format!("shape {:?} does not match {:?}", src.shape(), self.shape())));
        }
        if !Arc::ptr_eq(src.device(), self.device()) {
            if !(self.is_contiguous() && src.is_contiguous()) {
                return Err(Error::Unsupported("copy between gpus of a view that is not contiguous".into()));
            }
            // A direct copy (NVLink or PCIe) needs peer access between the two contexts, both
            // ways, enabled once per pair; without it the driver stages the copy through host
            // memory. GPUs without peer access still copy, staged.
            let peers =
                self.device().enable_peer_access(src.device())? & src.device().enable_peer_access(self.device())?;
            if peers {
                // VMM memory is reached per allocation, not through the contexts.
                self.storage.grant_access(src.device())?;
                src.storage.grant_access(self.device())?;
            }
            src.synchronize()?;
            let size = T::DTYPE.size();
            let bytes = self.numel() * size;
            let dst_range = self.storage.range()?.sub(self.offset() * size, bytes)?;
            let src_range = src.storage.range()?.sub(src.offset() * size, bytes)?;
            self.device().enqueue(|s| driver::copy_peer(s, dst_range, src.device().context(), src_range))?;
            return self.synchronize();
        }
        kernels::launch(self.device(), KernelArgs::Copy { dst: self.kernel_view()?, src: src.kernel_view()? })
    }

    /// The device holding the tensor.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[4]).unwrap();
    /// assert!(std::sync::Arc::ptr_eq(t.device(), &dev));
    /// ```
    pub fn device(&self) -> &Arc<Device> {
        self.storage.device()
    }

    /// The stream this tensor's work is ordered on (the device's cuda-mp stream).
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[4]).unwrap();
    /// assert!(std::sync::Arc::ptr_eq(t.stream(), dev.stream()));
    /// ```
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.storage.device().stream()
    }

    /// Device address of the view's first element, for your own kernels. Order them on
    /// [`stream`](Self::stream).
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[4]).unwrap();
    /// let view = t.narrow(0, 1, 3).unwrap();
    /// assert_eq!(view.device_ptr(), t.device_ptr() + 4); // one f32 further
    /// ```
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.storage.device_ptr() + (self.offset() * T::DTYPE.size()) as u64
    }

    /// Blocks until the work queued on the tensor's stream is done.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[1 << 20]).unwrap();
    /// t.fill(1.0).unwrap(); // queued
    /// t.synchronize().unwrap(); // done: other streams and libraries may read the memory now
    /// assert_eq!(t.to_vec().unwrap()[0], 1.0);
    /// ```
    pub fn synchronize(&self) -> Result<()> {
        self.device().synchronize()
    }

    /// The storage shared by this view.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[4]).unwrap();
    /// let view = t.narrow(0, 2, 2).unwrap();
    /// assert_eq!(view.storage().byte_len(), 16); // the whole storage, not the view
    /// ```
    pub fn storage(&self) -> &GpuStorage {
        &self.storage
    }

    /// The identity of the underlying storage across processes.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[2, 3]).unwrap();
    /// assert_eq!(t.transpose(0, 1).unwrap().storage_id(), t.storage_id());
    /// assert!(t.storage_id().is_local());
    /// ```
    pub fn storage_id(&self) -> StorageId {
        self.storage.id()
    }

    /// Exports the tensor by hand: everything its message would carry. The payload holds a
    /// reference on the memory until it is dropped or imported and dropped.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[2, 3]).unwrap();
    /// let payload = t.ipc_payload().unwrap();
    /// assert_eq!(payload.shape(), &[2, 3]);
    /// assert_eq!(payload.dtype(), Some(cuda_mp::DType::F32));
    /// ```
    pub fn ipc_payload(&self) -> Result<IpcPayload> {
        storage::encode(self)
    }

    /// Rebuilds a tensor from an exported payload (in another process, or this one).
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::full(&dev, &[4], 1.0).unwrap();
    /// let back = cuda_mp::GpuTensor::<f32>::from_ipc_payload(t.ipc_payload().unwrap()).unwrap();
    /// assert_eq!(back.storage_id(), t.storage_id());
    /// assert_eq!(back.to_vec().unwrap(), vec![1.0; 4]);
    /// ```
    pub fn from_ipc_payload(payload: IpcPayload) -> Result<Self> {
        storage::decode(payload, None)
    }

    /// Rebuilds a tensor from another process's payload, mapped on `access`: when that is not
    /// the GPU holding the memory, through peer access (checked first: without it the error
    /// names both GPUs). Work on the returned tensor runs on `access` and reads and writes the
    /// other GPU's memory directly.
    ///
    /// ```no_run
    /// use cuda_mp::{Device, GpuTensor, IpcPayload, Receiver};
    /// // `rx` brings payloads from a process whose tensors live on GPU 0; work here runs on GPU 1.
    /// fn on_gpu1(rx: &Receiver<IpcPayload>) -> cuda_mp::Result<GpuTensor<f32>> {
    ///     let t = GpuTensor::from_ipc_payload_on(rx.recv()?, &Device::get(1)?)?;
    ///     assert_eq!(t.device().ordinal(), 1);
    ///     Ok(t)
    /// }
    /// ```
    pub fn from_ipc_payload_on(payload: IpcPayload, access: &Arc<Device>) -> Result<Self> {
        storage::decode(payload, Some(access))
    }
}

impl Tensor<i64, GpuStorage> {
    /// The 8 bytes of this counter's first element, for a count queued on `device`; an error
    /// when the counter is empty or on another GPU.
    fn counter_range(&self, device: &Arc<Device>) -> Result<driver::DeviceRange> {
        if !Arc::ptr_eq(self.device(), device) {
            return Err(Error::Unsupported("a counter on another gpu".into()));
        }
        if self.numel() == 0 {
            return Err(Error::Layout("an empty counter".into()));
        }
        let range = self.storage.range()?.sub(self.offset() * 8, 8)?;
        // A 64-bit atomic add at a misaligned address faults the whole context.
        if !range.is_aligned_to(8) {
            return Err(Error::Layout("a counter needs memory that starts at a multiple of 8 bytes".into()));
        }
        Ok(range)
    }
}

impl crate::DynTensor<GpuStorage> {
    /// The device holding the memory (for a mapping made through peer access, the device that
    /// maps it).
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t: cuda_mp::DynTensor<_> = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[4]).unwrap().into();
    /// assert_eq!(t.device().ordinal(), 0);
    /// ```
    pub fn device(&self) -> &Arc<Device> {
        self.storage.device()
    }

    /// Device address of the view's first element (what DLPack calls `data` plus
    /// `byte_offset`).
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[4, 4]).unwrap();
    /// let row: cuda_mp::DynTensor<_> = t.narrow(0, 1, 1).unwrap().into();
    /// assert_eq!(row.device_ptr(), t.device_ptr() + 16);
    /// ```
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.storage.device_ptr() + (self.layout.offset() * self.dtype.size()) as u64
    }
}

/// A packed (contiguous) copy of the view `layout` of `dtype` elements over `storage`, queued
/// on its device's stream: how a strided GPU view leaves for another host.
#[cfg(feature = "remote")]
pub(crate) fn pack(storage: &Arc<GpuStorage>, layout: &Layout, dtype: DType) -> Result<Arc<GpuStorage>> {
    let device = storage.device();
    let packed = GpuStorage::alloc(device, (layout.numel() * dtype.size()).max(1))?;
    let dst = KernelView::new(packed.range()?, &Layout::contiguous(layout.shape())?, dtype)?;
    kernels::launch(device, KernelArgs::Copy { dst, src: KernelView::new(storage.range()?, layout, dtype)? })?;
    Ok(packed)
}

#[cfg(feature = "remote")]
pub(crate) use driver::DeviceRange;
#[cfg(feature = "remote")]
pub(crate) use nccl::{Communicator, UniqueId};
#[cfg(any(test, feature = "testing"))]
pub(crate) use torch::torch_mem_handle;

#[cfg(feature = "remote")]
/// The NCCL library this process loads (its file name and version, `22809` for 2.28.9), or
/// why it cannot: the error names every file looked for.
///
/// ```no_run
/// match cuda_mp::nccl_library() {
///     Ok((name, version)) => println!("{name}, version {version}"),
///     Err(e) => println!("{e}"),
/// }
/// ```
pub fn nccl_library() -> Result<(String, i32)> {
    nccl::library()
}
