//! GPU tensors: device memory shared across processes through CUDA IPC. See README.md here.

mod bundle;
mod device;
mod driver;
mod storage;

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use cudarc::driver::CudaStream;
use ndarray::{ArrayBase, ArrayD, Data, Dimension, IxDyn};

pub use bundle::{Bundle, BundleBuilder, BundleEntry, DEFAULT_CHUNK_BYTES};
pub use device::{cuda_available, Device};
pub use storage::{GpuStorage, IpcPayload};

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::layout::{Layout, MAX_DIMS};
use crate::lifetime::StorageId;
use crate::tensor::Tensor;
use device::driver_err;

/// A tensor in GPU memory. Sending it through a channel exports its allocation as a CUDA IPC
/// handle; the receiver maps the same memory, after the work queued on it here.
pub type GpuTensor<T> = Tensor<T, GpuStorage>;

/// A view's layout as the shipped kernels take it (`struct Layout` in kernels.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct KernelLayout {
    numel: i64,
    ndim: i64,
    offset: i64,
    shape: [i64; MAX_DIMS],
    strides: [i64; MAX_DIMS],
}

impl KernelLayout {
    fn of(layout: &Layout) -> KernelLayout {
        let mut k = KernelLayout {
            numel: layout.numel() as i64,
            ndim: layout.shape().len() as i64,
            offset: layout.offset() as i64,
            shape: [1; MAX_DIMS],
            strides: [0; MAX_DIMS],
        };
        for (d, (&n, &s)) in layout.shape().iter().zip(layout.strides()).enumerate() {
            k.shape[d] = n as i64;
            k.strides[d] = s as i64;
        }
        k
    }
}

fn arg<V>(v: &mut V) -> *mut c_void {
    v as *mut V as *mut c_void
}

impl<T: Element> Tensor<T, GpuStorage> {
    /// A contiguous tensor of zeros on `device`.
    pub fn zeros(device: &Arc<Device>, shape: &[usize]) -> Result<Self> {
        let t = Self::uninit(device, shape)?;
        // SAFETY: the context is current (alloc bound it) and the range is the new storage.
        unsafe { driver::memset_d8_async(t.storage.device_ptr(), 0, t.storage.byte_len(), device.cu_stream()) }
            .map_err(driver_err("cuMemsetD8Async"))?;
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
        if !host.is_empty() {
            // SAFETY: the destination holds exactly `host.len()` elements; the copy is
            // complete before `host` is dropped (the stream is synchronized below).
            unsafe { cu::memcpy_htod_async(t.storage.device_ptr(), &host, device.cu_stream()) }
                .map_err(driver_err("cuMemcpyHtoDAsync"))?;
            device.synchronize()?;
        }
        Ok(t)
    }

    /// A contiguous tensor of `shape` holding `data` in row-major order.
    pub fn from_vec(device: &Arc<Device>, shape: &[usize], data: Vec<T>) -> Result<Self> {
        let array = ArrayD::from_shape_vec(IxDyn(shape), data).map_err(|e| Error::Layout(e.to_string()))?;
        Self::from_ndarray(device, &array)
    }

    /// Copies the view to the host, after the work queued on it.
    pub fn to_ndarray(&self) -> Result<ArrayD<T>> {
        let size = T::DTYPE.size();
        let first = self.offset();
        let extent = self.layout.extent()?;
        let mut bytes = vec![0u8; (extent.saturating_sub(first)) * size];
        if !bytes.is_empty() {
            self.device().bind()?;
            // SAFETY: the source range lies inside the storage (the layout was checked); the
            // stream is synchronized before `bytes` is read.
            unsafe {
                cu::memcpy_dtoh_async(
                    &mut bytes,
                    self.storage.device_ptr() + (first * size) as u64,
                    self.device().cu_stream(),
                )
            }
            .map_err(driver_err("cuMemcpyDtoHAsync"))?;
            self.device().synchronize()?;
        }
        let data: Vec<T> = self
            .layout
            .indices()
            // SAFETY: every index is in first..extent, so inside `bytes`.
            .map(|i| unsafe { T::load(bytes.as_ptr().add((i - first) * size) as *const T) })
            .collect();
        ArrayD::from_shape_vec(IxDyn(self.shape()), data).map_err(|e| Error::Layout(e.to_string()))
    }

    /// Copies the view to a host vector in row-major order.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        Ok(self.to_ndarray()?.into_iter().collect())
    }

    fn kernel(&self, op: &str) -> String {
        format!("{op}_{}", T::DTYPE.name())
    }

    /// Sets every element of the view to `value` (queued on the device's stream).
    pub fn fill(&self, value: T) -> Result<()> {
        let mut ptr = self.storage.device_ptr();
        let mut layout = KernelLayout::of(&self.layout);
        let mut bits = value.to_bits();
        self.device().launch(&self.kernel("fill"), self.numel(), &mut [arg(&mut ptr), arg(&mut layout), arg(&mut bits)])
    }

    /// Adds `value` to every element of the view, in place (queued on the device's stream).
    /// Integer results wrap as in C; not for `bool`.
    pub fn add_scalar(&self, value: f64) -> Result<()> {
        if T::DTYPE == DType::Bool {
            return Err(Error::Unsupported("add_scalar on a bool tensor".into()));
        }
        let mut ptr = self.storage.device_ptr();
        let mut layout = KernelLayout::of(&self.layout);
        let mut v = value;
        self.device().launch(&self.kernel("add"), self.numel(), &mut [arg(&mut ptr), arg(&mut layout), arg(&mut v)])
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
            self.device().bind()?;
            let bytes = self.numel() * T::DTYPE.size();
            // SAFETY: both ranges lie inside their storages (checked layouts, contiguous views);
            // `src` has no queued work left; the copy is ordered on this tensor's stream.
            return unsafe {
                cu::memcpy_peer_async(
                    self.device().context().cu_ctx(),
                    self.device_ptr(),
                    src.device().context().cu_ctx(),
                    src.device_ptr(),
                    bytes,
                    self.device().cu_stream(),
                )
            }
            .map_err(driver_err("cuMemcpyPeerAsync"));
        }
        let mut dst = self.storage.device_ptr();
        let mut dst_layout = KernelLayout::of(&self.layout);
        let mut src_ptr = src.storage.device_ptr();
        let mut src_layout = KernelLayout::of(&src.layout);
        let params = &mut [arg(&mut dst), arg(&mut dst_layout), arg(&mut src_ptr), arg(&mut src_layout)];
        self.device().launch(&self.kernel("copy"), self.numel(), params)
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
