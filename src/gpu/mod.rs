//! GPU tensors: device memory shared across processes through CUDA IPC. See README.md here.

mod bundle;
mod device;
mod driver;
mod events;
mod handles;
mod kernels;
mod storage;

use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::CudaStream;
use ndarray::{ArrayBase, ArrayD, Data, Dimension, IxDyn};

pub use bundle::{Bundle, BundleBuilder, BundleEntry, DEFAULT_CHUNK_BYTES};
pub use device::{cuda_available, Device};
pub use storage::{GpuStorage, IpcPayload};

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::lifetime::StorageId;
use crate::tensor::Tensor;
use driver::DeviceRange;

/// A tensor in GPU memory. Sending it through a channel exports its allocation as a CUDA IPC
/// handle; the receiver maps the same memory, after the work queued on it here.
pub type GpuTensor<T> = Tensor<T, GpuStorage>;

/// The device memory of a storage, for the checked copies and kernel launches.
fn memory(storage: &GpuStorage) -> DeviceRange {
    DeviceRange::new(storage.device_ptr(), storage.byte_len())
}

impl<T: Element> Tensor<T, GpuStorage> {
    /// A contiguous tensor of zeros on `device`.
    pub fn zeros(device: &Arc<Device>, shape: &[usize]) -> Result<Self> {
        let t = Self::uninit(device, shape)?;
        driver::memset_d8(device.stream(), memory(&t.storage), 0)?;
        Ok(t)
    }

    fn uninit(device: &Arc<Device>, shape: &[usize]) -> Result<Self> {
        let layout = Layout::contiguous(shape)?;
        let bytes =
            layout.numel().checked_mul(T::DTYPE.size()).ok_or_else(|| Error::Layout("tensor size overflows".into()))?;
        Ok(Tensor::from_parts(GpuStorage::alloc(device, bytes)?, layout))
    }

    /// A contiguous tensor with every element `value`.
    pub fn full(device: &Arc<Device>, shape: &[usize], value: T) -> Result<Self> {
        let t = Self::uninit(device, shape)?;
        t.fill(value)?;
        Ok(t)
    }

    /// Copies an ndarray array to a new contiguous tensor on `device`.
    pub fn from_ndarray<S: Data<Elem = T>, D: Dimension>(
        device: &Arc<Device>,
        array: &ArrayBase<S, D>,
    ) -> Result<Self> {
        let t = Self::uninit(device, array.shape())?;
        let host: Vec<T> = array.iter().copied().collect();
        // Waits for the copy: `host` is dropped right after.
        driver::copy_htod(device.stream(), &host, memory(&t.storage))?;
        Ok(t)
    }

    /// A contiguous tensor of `shape` holding `data` in row-major order.
    pub fn from_vec(device: &Arc<Device>, shape: &[usize], data: Vec<T>) -> Result<Self> {
        let array = ArrayD::from_shape_vec(IxDyn(shape), data).map_err(|e| Error::Layout(e.to_string()))?;
        Self::from_ndarray(device, &array)
    }

    /// Copies the view to the host, after the work queued on it: a contiguous view straight
    /// into the array's memory; any other view as the range of storage that covers it, then
    /// gathered.
    pub fn to_ndarray(&self) -> Result<ArrayD<T>> {
        let size = T::DTYPE.size();
        let first = self.offset();
        let covered = self.layout.extent()?.saturating_sub(first);
        let data = if covered == 0 {
            Vec::new()
        } else {
            let range = memory(&self.storage).sub(first * size, covered * size)?;
            let covering: Vec<T> = driver::copy_dtoh(self.stream(), range)?;
            if self.is_contiguous() {
                // The covering range is the view, in order.
                covering
            } else {
                // Every index is in first..extent, so inside `covering`.
                self.layout.indices().map(|i| covering[i - first]).collect()
            }
        };
        ArrayD::from_shape_vec(IxDyn(self.shape()), data).map_err(|e| Error::Layout(e.to_string()))
    }

    /// Copies the view to a host vector in row-major order.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        Ok(self.to_ndarray()?.into_iter().collect())
    }

    /// Sets every element of the view to `value` (queued on the device's stream).
    pub fn fill(&self, value: T) -> Result<()> {
        kernels::fill(self.device(), memory(&self.storage), &self.layout, T::DTYPE, value.to_bits())
    }

    /// Adds `value` to every element of the view, in place (queued on the device's stream).
    /// Integer results wrap as in C; not for `bool`.
    pub fn add_scalar(&self, value: f64) -> Result<()> {
        if T::DTYPE == DType::Bool {
            return Err(Error::Unsupported("add_scalar on a bool tensor".into()));
        }
        kernels::add_scalar(self.device(), memory(&self.storage), &self.layout, T::DTYPE, value)
    }

    /// Copies `src` (same shape) into this view, element by element. Between two GPUs both
    /// views must be contiguous: the copy is a peer copy by the copy engines, after `src`'s
    /// queued work.
    pub fn copy_from(&self, src: &Self) -> Result<()> {
        if src.shape() != self.shape() {
            return Err(Error::Layout(format!("shape {:?} does not match {:?}", src.shape(), self.shape())));
        }
        if !Arc::ptr_eq(src.device(), self.device()) {
            if !(self.is_contiguous() && src.is_contiguous()) {
                return Err(Error::Unsupported("copy between gpus of a view that is not contiguous".into()));
            }
            src.synchronize()?;
            let size = T::DTYPE.size();
            let bytes = self.numel() * size;
            let dst_range = memory(&self.storage).sub(self.offset() * size, bytes)?;
            let src_range = memory(&src.storage).sub(src.offset() * size, bytes)?;
            return driver::copy_peer(self.stream(), dst_range, src.device().context(), src_range);
        }
        kernels::copy(self.device(), memory(&self.storage), &self.layout, memory(&src.storage), &src.layout, T::DTYPE)
    }

    /// The device holding the tensor.
    pub fn device(&self) -> &Arc<Device> {
        self.storage.device()
    }

    /// The stream this tensor's work is ordered on (the device's cuda-mp stream).
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.storage.device().stream()
    }

    /// Device address of the view's first element, for your own kernels. Order them on
    /// [`stream`](Self::stream).
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.storage.device_ptr() + (self.offset() * T::DTYPE.size()) as u64
    }

    /// Blocks until the work queued on the tensor's stream is done.
    pub fn synchronize(&self) -> Result<()> {
        self.device().synchronize()
    }

    /// The storage shared by this view.
    pub fn storage(&self) -> &GpuStorage {
        &self.storage
    }

    /// The identity of the underlying storage across processes.
    pub fn storage_id(&self) -> StorageId {
        self.storage.id()
    }

    /// Exports the tensor by hand: everything its message would carry. The payload holds a
    /// reference on the memory until it is dropped or imported and dropped.
    pub fn ipc_payload(&self) -> Result<IpcPayload> {
        storage::encode(self)
    }

    /// Rebuilds a tensor from an exported payload (in another process, or this one).
    pub fn from_ipc_payload(payload: IpcPayload) -> Result<Self> {
        storage::decode(payload, None)
    }

    /// Rebuilds a tensor from another process's payload, mapped on `access`: when that is not
    /// the GPU holding the memory, through peer access (checked first: without it the error
    /// names both GPUs). Work on the returned tensor runs on `access` and reads and writes the
    /// other GPU's memory directly.
    pub fn from_ipc_payload_on(payload: IpcPayload, access: &Arc<Device>) -> Result<Self> {
        storage::decode(payload, Some(access))
    }
}
