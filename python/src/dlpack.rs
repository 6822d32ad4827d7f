//! Received tensors handed to PyTorch and NumPy through DLPack.

use pyo3::prelude::*;

use crate::Any;

/// (device type, device id) of DLPack: CPU 1, CUDA 2.
pub(crate) fn device(t: &Any) -> (i32, i32) {
    match t {
        Any::Gpu(t) => (2, t.device().ordinal() as i32),
        Any::Host(_) => (1, 0),
    }
}

pub(crate) fn export<'py>(
    _py: Python<'py>,
    _t: &Any,
    _stream: Option<Bound<'py, PyAny>>,
    _max_version: Option<Bound<'py, PyAny>>,
    _dl_device: Option<Bound<'py, PyAny>>,
    _copy: Option<Bound<'py, PyAny>>,
) -> PyResult<Py<PyAny>> {
    Err(pyo3::exceptions::PyNotImplementedError::new_err("dlpack"))
}
