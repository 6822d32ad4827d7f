//! PyTorch's own CUDA IPC handles: a tensor rebuilt here from the eight values of PyTorch's
//! `storage._share_cuda_()` (what `torch.multiprocessing` pickles), and those eight values for
//! a cuda-mp tensor, for PyTorch's `rebuild_cuda_tensor` in another process.
//! `python/python/cuda_mp/torch_handles.py` converts PyTorch's reductions to and from these.

use cuda_mp::{DynTensor, GpuStorage, Layout, TorchIpcHandle};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyTuple};

use crate::{Any, Tensor, dtype_named, error};

/// `bytes` as a vector; None as an empty one (what PyTorch gives for an empty storage).
fn bytes_or_empty(value: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u8>> {
    if value.is_none() {
        return Ok(Vec::new());
    }
    match value.cast::<PyBytes>() {
        Ok(b) => Ok(b.as_bytes().to_vec()),
        Err(_) => Err(PyTypeError::new_err(format!("{what} must be bytes or None"))),
    }
}

/// An integer field; None as 0.
fn int_or_zero(value: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    if value.is_none() {
        return Ok(0);
    }
    value.extract::<u64>().map_err(|_| PyValueError::new_err(format!("{what} must be a non-negative integer")))
}

/// PyTorch's eight values as a handle.
fn handle_of(fields: &[Bound<'_, PyAny>]) -> PyResult<TorchIpcHandle> {
    let [device, handle, storage_bytes, storage_offset_bytes, ref_counter, slot, event_handle, sync] = fields else {
        return Err(PyValueError::new_err(format!(
            "pytorch's storage._share_cuda_() gives 8 values, not {}",
            fields.len()
        )));
    };
    let handle = bytes_or_empty(handle, "the memory handle")?;
    let event_sync_required = if sync.is_none() {
        false
    } else {
        sync.cast::<PyBool>().map_err(|_| PyTypeError::new_err("event_sync_required must be a bool"))?.is_true()
    };
    Ok(TorchIpcHandle {
        device: device.extract::<usize>().map_err(|_| PyValueError::new_err("the device must be an index"))?,
        // PyTorch's rule: no handle, or no bytes, is an empty storage.
        storage_bytes: if handle.is_empty() { 0 } else { int_or_zero(storage_bytes, "the storage size")? },
        handle,
        storage_offset_bytes: int_or_zero(storage_offset_bytes, "the storage offset")?,
        ref_counter: bytes_or_empty(ref_counter, "the reference counter's name")?,
        ref_counter_slot: int_or_zero(slot, "the reference counter's slot")?,
        event_handle: bytes_or_empty(event_handle, "the event handle")?,
        event_sync_required,
    })
}

/// Rebuilds a tensor from a PyTorch process's share: `fields` are the eight values of its
/// `storage._share_cuda_()` (device, handle, storage size, storage offset in its block,
/// reference counter's name and slot, event handle, event_sync_required), viewed with `shape`,
/// `strides` and `offset` in elements of `dtype` (a cuda-mp name such as "f32"). The memory is
/// ordered after the producer's work on cuda-mp's stream; PyTorch's producer gets it back once
/// the tensor, every array made from it and every cuda-mp receiver it was sent to are gone.
/// Rebuild each share once. On error, nothing is released (the call may be retried).
#[pyfunction]
fn from_torch(
    py: Python<'_>,
    fields: Vec<Bound<'_, PyAny>>,
    dtype: &str,
    shape: Vec<usize>,
    strides: Vec<isize>,
    offset: usize,
) -> PyResult<Tensor> {
    let handle = handle_of(&fields)?;
    let dtype = dtype_named(dtype)?;
    let strides = strides
        .into_iter()
        .map(|s| usize::try_from(s).map_err(|_| PyValueError::new_err("negative strides cannot be shared")))
        .collect::<PyResult<Vec<usize>>>()?;
    // Checked before the import, so that a bad view releases nothing.
    let elems = usize::try_from(handle.storage_bytes / dtype.size() as u64)
        .map_err(|_| PyValueError::new_err("the storage is too large for this platform"))?;
    let layout = Layout::new(shape, strides, offset, elems).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let storage = py.detach(|| GpuStorage::from_torch_ipc(&handle)).map_err(error)?;
    let t = DynTensor::new(storage, layout, dtype).map_err(error)?;
    Ok(Tensor { inner: Any::Gpu(t) })
}

/// The eight values of PyTorch's `storage._share_cuda_()` for a GPU tensor's storage, for
/// `rebuild_cuda_tensor` in a PyTorch process: device, handle (64 bytes), storage size, 0 or
/// the storage's offset in its block, reference counter's name and slot, event handle,
/// event_sync_required. Each call is one share: the storage is kept until the consumer
/// releases it (see `torch_ipc_stats`). An empty storage gives None for the handle, the name
/// and the event, as PyTorch does.
#[pyfunction]
fn to_torch<'py>(py: Python<'py>, tensor: &Tensor) -> PyResult<Bound<'py, PyTuple>> {
    let Any::Gpu(t) = &tensor.inner else {
        return Err(PyTypeError::new_err("a host tensor has no pytorch cuda ipc handle"));
    };
    let storage = t.storage().clone();
    let h = py.detach(|| storage.to_torch_ipc()).map_err(error)?;
    let empty = h.handle.is_empty();
    let bytes = |b: &[u8]| (!empty).then(|| PyBytes::new(py, b));
    (
        h.device,
        bytes(&h.handle),
        h.storage_bytes,
        h.storage_offset_bytes,
        bytes(&h.ref_counter),
        h.ref_counter_slot,
        bytes(&h.event_handle),
        h.event_sync_required,
    )
        .into_pyobject(py)
}

/// The index, in elements, of the tensor's first element in its storage.
#[pyfunction]
fn element_offset(tensor: &Tensor) -> usize {
    match &tensor.inner {
        Any::Gpu(t) => t.offset(),
        Any::Host(t) => t.offset(),
    }
}

/// (shares outstanding, reference-counter files in use, shares released) of this process's
/// memory handed to PyTorch consumers.
#[pyfunction]
fn torch_ipc_stats() -> (usize, usize, u64) {
    let s = cuda_mp::torch_ipc_stats();
    (s.outstanding, s.ref_files, s.released)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(from_torch, m)?)?;
    m.add_function(wrap_pyfunction!(to_torch, m)?)?;
    m.add_function(wrap_pyfunction!(element_offset, m)?)?;
    m.add_function(wrap_pyfunction!(torch_ipc_stats, m)?)?;
    Ok(())
}
