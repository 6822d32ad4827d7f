//! Tensors handed to PyTorch and NumPy through DLPack (`__dlpack__`, `__dlpack_device__`): the
//! consumer gets the memory itself, and each capsule holds the tensor (so its storage, and the
//! storage's claim on its sender's memory) until the consumer's array is gone.

use std::ffi::c_void;

use cuda_mp::DType;
use dlpark::ffi::{DLDataType, DLDataTypeCode, DLDevice, DLManagedTensor, DLManagedTensorVersioned};
use dlpark::metadata::Dynamic;
use dlpark::python::{CudaStreamRequest, DlpackExporter, ExportRequest, export_dlpack};
use dlpark::{DlpackFlags, Managed};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::{Any, Tensor, error};

/// (device type, device id) of DLPack, as `__dlpack_device__` gives them: CPU 1, CUDA 2.
pub(crate) fn device(t: &Any) -> (i32, i32) {
    let d = dl_device(t);
    (d.device_type.0 as i32, d.device_id)
}

fn dl_device(t: &Any) -> DLDevice {
    match t {
        Any::Gpu(t) => DLDevice::cuda(t.device().ordinal() as i32),
        Any::Host(_) => DLDevice::CPU,
    }
}

fn dl_dtype(d: DType) -> DLDataType {
    let (code, bits) = match d {
        DType::F32 => (DLDataTypeCode::FLOAT, 32),
        DType::F64 => (DLDataTypeCode::FLOAT, 64),
        DType::F16 => (DLDataTypeCode::FLOAT, 16),
        DType::BF16 => (DLDataTypeCode::BFLOAT, 16),
        DType::I8 => (DLDataTypeCode::INT, 8),
        DType::I16 => (DLDataTypeCode::INT, 16),
        DType::I32 => (DLDataTypeCode::INT, 32),
        DType::I64 => (DLDataTypeCode::INT, 64),
        DType::U8 => (DLDataTypeCode::UINT, 8),
        DType::Bool => (DLDataTypeCode::BOOL, 8),
    };
    DLDataType::new(code, bits, 1)
}

/// Address of the first element, element type, shape and strides (in elements) of a view.
fn parts(t: &Any) -> (*mut c_void, DLDataType, Vec<i64>, Vec<i64>) {
    let (ptr, dtype, shape, strides) = match t {
        Any::Gpu(t) => (t.device_ptr() as usize, t.dtype(), t.shape(), t.strides()),
        Any::Host(t) => {
            let first = t.storage().as_ptr() as usize + t.offset() * t.dtype().size();
            (first, t.dtype(), t.shape(), t.strides())
        }
    };
    let shape = shape.iter().map(|&n| n as i64).collect();
    let strides = strides.iter().map(|&s| s as i64).collect();
    (ptr as *mut c_void, dl_dtype(dtype), shape, strides)
}

/// What a capsule keeps alive: the tensor, until the consumer's deleter runs (from whatever
/// thread drops the consumer's array; no Python state is touched there).
struct Held(#[allow(dead_code)] Any);

impl Exporter<'_> {
    fn managed<M: dlpark::ManagedTensorBase>(&self) -> PyResult<Managed<M>> {
        let (data, dtype, shape, strides) = parts(self.0);
        // The first element's address as `data` and a zero byte offset: what every PyTorch
        // version reads the same way.
        let mut init = Dynamic::new(shape, strides)
            .initialize_as::<M>(std::sync::Arc::new(Held(self.0.clone())))
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        init.set_data(data).set_byte_offset(0).set_dtype(dtype).set_device(dl_device(self.0));
        // SAFETY: `data`, shape and strides describe a view that lies inside its storage (views
        // are checked against their storage when made), and the context holds the tensor, so
        // the memory lives until the consumer calls the deleter.
        Ok(unsafe { init.finish() })
    }
}

/// A tensor to export, and whether its consumer's stream was ordered after it already (then the
/// request's stream is not looked at).
struct Exporter<'a>(&'a Any, bool);

impl DlpackExporter for Exporter<'_> {
    fn device(&self) -> DLDevice {
        dl_device(self.0)
    }

    fn flags(&self) -> DlpackFlags {
        DlpackFlags::empty()
    }

    fn prepare_export(&self, py: Python<'_>, request: &ExportRequest<'_>) -> PyResult<()> {
        let Any::Gpu(t) = self.0 else { return Ok(()) };
        if self.1 {
            return Ok(());
        }
        let stream: usize = match request.cuda_stream()? {
            CudaStreamRequest::NoSync => return Ok(()),
            CudaStreamRequest::Omitted | CudaStreamRequest::LegacyDefault => 0,
            CudaStreamRequest::PerThreadDefault => 2,
            CudaStreamRequest::Pointer(p) => p,
        };
        // SAFETY: by the DLPack protocol the consumer passes a stream of the device this tensor
        // reported in `__dlpack_device__`, or a default-stream sentinel.
        unsafe { order_after(py, t.device(), stream) }
    }

    fn export_legacy(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        self.managed()
    }

    fn export_versioned(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        self.managed()
    }
}

/// `__dlpack__` of a tensor.
pub(crate) fn export<'py>(
    py: Python<'py>,
    t: &Tensor,
    stream: Option<Bound<'py, PyAny>>,
    max_version: Option<(u32, u32)>,
    dl_device: Option<(u32, i32)>,
    copy: Option<bool>,
) -> PyResult<Py<PyAny>> {
    let request = ExportRequest::parse(stream.as_ref(), max_version, dl_device, copy)?;
    export_dlpack(&Exporter(&t.inner, false), py, request)
}

/// A GPU tensor's capsule (a legacy `DLManagedTensor`) for PyTorch: `stream`, PyTorch's current
/// stream of the tensor's device (0: the legacy default stream), ordered after the tensor's
/// arrival first, as `__dlpack__(stream=...)` orders it.
///
/// # Safety
/// `stream` must be a live stream of the tensor's device's primary context, or 0 or 2 (the
/// default streams).
pub(crate) unsafe fn export_for_stream(py: Python<'_>, t: &Any, stream: usize) -> PyResult<Py<PyAny>> {
    if let Any::Gpu(gpu) = t {
        // SAFETY: upheld by the caller.
        unsafe { order_after(py, gpu.device(), stream) }?;
    }
    export_dlpack(&Exporter(t, true), py, ExportRequest::parse(None, None, None, None)?)
}

/// Makes `stream` (the consumer's) wait for the work queued on `device`'s stream, with the GIL
/// released; the calling thread's current device stays as it was.
///
/// # Safety
/// `stream` must be a live stream of `device`'s primary context, or 0 or 2 (the default
/// streams).
unsafe fn order_after(py: Python<'_>, device: &cuda_mp::Device, stream: usize) -> PyResult<()> {
    // SAFETY: upheld by the caller.
    py.detach(|| cuda_mp::keeping_current_context(|| unsafe { device.order_stream_after(stream as _) })).map_err(error)
}
