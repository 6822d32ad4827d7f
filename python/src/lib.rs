//! The native half of the `cuda_mp` Python package: channels of cuda-mp tensors, tensors that
//! wrap PyTorch's and NumPy's memory for sending, and received tensors handed to PyTorch and
//! NumPy through DLPack. The Python half (`python/python/cuda_mp/__init__.py`) converts between these and
//! `torch.Tensor` / `numpy.ndarray`.
//!
//! What crosses is exactly what the Rust crate sends: a `Tensor` of this module travels as a
//! `cuda_mp::DynTensor`, which a Rust receiver takes as `GpuTensor<T>` or `HostTensor<T>` of
//! the same element type, and a `Bundle` as `cuda_mp::Bundle`.
#![deny(missing_docs, missing_debug_implementations)]

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, TryLockError, Weak, mpsc};
use std::time::{Duration, Instant};

use cuda_mp::{
    Bundle as RsBundle, BundleBuilder, DType, Device, DynTensor, GpuStorage, HostStorage, Layout,
    Listener as RsListener, Receiver as RsReceiver, RecvTimeoutError, Sender as RsSender, Value,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

mod allocator;
mod dlpack;
mod torch_ipc;

// ---------------------------------------------------------------------------------------------
// Errors: cuda-mp's errors as the exception classes of `cuda_mp._errors`.

fn exception(py: Python<'_>, class: &str, message: String) -> PyErr {
    let made = py.import("cuda_mp._errors").and_then(|m| m.getattr(class)).and_then(|c| c.call1((message.clone(),)));
    match made {
        Ok(value) => PyErr::from_value(value),
        Err(e) => e,
    }
}

/// A cuda-mp error as the matching Python exception.
fn error(e: cuda_mp::Error) -> PyErr {
    Python::attach(|py| {
        let class = match &e {
            cuda_mp::Error::DTypeMismatch { .. } => "DTypeError",
            cuda_mp::Error::Malformed(_) | cuda_mp::Error::Layout(_) => "Malformed",
            cuda_mp::Error::Timeout(_) => "Timeout",
            _ => "Error",
        };
        exception(py, class, e.to_string())
    })
}

fn recv_error(e: RecvTimeoutError) -> PyErr {
    Python::attach(|py| {
        let class = match &e {
            RecvTimeoutError::Timeout => "Timeout",
            RecvTimeoutError::Disconnected => "Disconnected",
            RecvTimeoutError::Malformed(m) if m.contains("dtype mismatch") => "DTypeError",
            RecvTimeoutError::Malformed(_) => "Malformed",
            _ => "Error",
        };
        exception(py, class, e.to_string())
    })
}

fn dtype_named(name: &str) -> PyResult<DType> {
    DType::ALL.iter().copied().find(|d| d.name() == name).ok_or_else(|| {
        Python::attach(|py| exception(py, "DTypeError", format!("cuda-mp has no element type {name:?}")))
    })
}

fn layout(shape: Vec<usize>, strides: Vec<isize>, offset: usize) -> PyResult<Layout> {
    let strides = strides
        .into_iter()
        .map(|s| usize::try_from(s).map_err(|_| PyValueError::new_err("negative strides cannot be shared")))
        .collect::<PyResult<Vec<usize>>>()?;
    // The view's extent, so that `Layout::new` checks only the layout itself here; the storage
    // checks it against its size after.
    let extent = shape
        .iter()
        .zip(&strides)
        .try_fold(offset, |end, (n, s)| n.saturating_sub(1).checked_mul(*s).and_then(|step| end.checked_add(step)))
        .and_then(|last| last.checked_add(1))
        .ok_or_else(|| PyValueError::new_err("the view's shape and strides overflow"))?;
    Layout::new(shape, strides, offset, extent).map_err(|e| PyValueError::new_err(e.to_string()))
}

// ---------------------------------------------------------------------------------------------
// Tensors.

/// Where the memory of a tensor lives.
#[derive(Clone)]
enum Any {
    Gpu(DynTensor<GpuStorage>),
    Host(DynTensor<HostStorage>),
}

/// A cuda-mp tensor: received from another process, or wrapping memory of this one for
/// sending. PyTorch and NumPy take it without a copy through DLPack (`torch.from_dlpack`,
/// `numpy.from_dlpack`); the memory, and its claim on the sender's memory, lives until every
/// array made from it is gone.
#[pyclass(frozen, module = "cuda_mp._native")]
#[derive(Clone)]
pub struct Tensor {
    inner: Any,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            Any::Gpu(t) => t.fmt(f),
            Any::Host(t) => t.fmt(f),
        }
    }
}

#[pymethods]
impl Tensor {
    /// The element type's name (`"f32"`, `"bf16"`, ...).
    #[getter]
    fn dtype(&self) -> &'static str {
        match &self.inner {
            Any::Gpu(t) => t.dtype().name(),
            Any::Host(t) => t.dtype().name(),
        }
    }

    /// The extent of each dimension.
    #[getter]
    fn shape(&self) -> Vec<usize> {
        match &self.inner {
            Any::Gpu(t) => t.shape().to_vec(),
            Any::Host(t) => t.shape().to_vec(),
        }
    }

    /// The step between neighbours along each dimension, in elements.
    #[getter]
    fn strides(&self) -> Vec<usize> {
        match &self.inner {
            Any::Gpu(t) => t.strides().to_vec(),
            Any::Host(t) => t.strides().to_vec(),
        }
    }

    /// The GPU's ordinal in this process, or None for host memory.
    #[getter]
    fn device(&self) -> Option<usize> {
        match &self.inner {
            Any::Gpu(t) => Some(t.device().ordinal()),
            Any::Host(_) => None,
        }
    }

    /// True when the GPU work that produced the memory is done as far as this process can
    /// tell (the receiving stream is idle); otherwise the caller orders its own stream after
    /// `stream_ptr()`.
    fn ready(&self) -> PyResult<bool> {
        match &self.inner {
            Any::Gpu(t) => t.device().is_idle().map_err(error),
            Any::Host(_) => Ok(true),
        }
    }

    /// `cudaStream_t` (as an integer) of the stream cuda-mp ordered the memory on.
    fn stream_ptr(&self) -> usize {
        match &self.inner {
            Any::Gpu(t) => t.device().stream().cu_stream() as usize,
            Any::Host(_) => 0,
        }
    }

    /// The storage's identity across processes, as a string (the same in every process).
    fn storage_id(&self) -> String {
        match &self.inner {
            Any::Gpu(t) => format!("{:?}", t.storage().id()),
            Any::Host(t) => format!("{:?}", t.storage().id()),
        }
    }

    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        remember(&self.inner);
        dlpack::export(py, self, stream, max_version, dl_device, copy)
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        dlpack::device(&self.inner)
    }

    fn __repr__(&self) -> String {
        format!("{self:?}")
    }
}

/// Storages of one kind handed to Python, by (device, address), so that a tensor made from
/// one and sent again travels as that storage (a forward, or a re-send of this process's own
/// memory) instead of as a new wrapper. Held weakly: the book keeps nothing alive. A child
/// forked from this process starts with an empty book: what its parent was handed is the
/// parent's to share, and the child sends copies of it.
struct Handed<S> {
    by_address: Mutex<Book<S>>,
}

struct Book<S> {
    /// The process the entries belong to.
    pid: u32,
    entries: BTreeMap<(usize, u64), (usize, Weak<S>)>,
}

/// The device part of a host storage's key.
const HOST: usize = usize::MAX;

static HANDED_GPU: Handed<GpuStorage> = Handed::new();
static HANDED_HOST: Handed<HostStorage> = Handed::new();

impl<S> Handed<S> {
    const fn new() -> Self {
        Handed { by_address: Mutex::new(Book { pid: 0, entries: BTreeMap::new() }) }
    }

    /// This process's entries.
    fn book(&self) -> std::sync::MutexGuard<'_, Book<S>> {
        let mut book = self.by_address.lock().unwrap_or_else(|p| p.into_inner());
        let pid = std::process::id();
        if book.pid != pid {
            book.pid = pid;
            book.entries.clear();
        }
        book
    }

    fn remember(&self, device: usize, address: u64, storage: &Arc<S>, len: usize) {
        let mut book = self.book();
        if book.entries.len() > 4096 {
            book.entries.retain(|_, (_, w)| w.strong_count() > 0);
        }
        // A freed storage's entry inside this one's memory (reused by it) would hide it from
        // `find`, which looks at the nearest entry below an address: such entries go. Entries
        // do not overlap (live storages do not, and this keeps it so), so those overlapping
        // this one are the run below its end that starts at or after it, and the one before.
        let end = address.saturating_add(len as u64);
        let mut stale = Vec::new();
        for (&(d, base), (l, weak)) in book.entries.range(..(device, end)).rev() {
            let overlaps = d == device && base.saturating_add(*l as u64) > address;
            if overlaps && weak.strong_count() == 0 {
                stale.push((d, base));
            }
            if d != device || base < address {
                break;
            }
        }
        for key in stale {
            book.entries.remove(&key);
        }
        book.entries.insert((device, address), (len, Arc::downgrade(storage)));
    }

    /// The storage holding `[ptr, ptr + bytes)` on `device`, with the offset of `ptr` in it.
    fn find(&self, device: usize, ptr: u64, bytes: usize) -> Option<(Arc<S>, usize)> {
        let book = self.book();
        let (&(d, base), (len, weak)) = book.entries.range(..=(device, ptr)).next_back()?;
        let offset = offset_within(d == device, base, *len, ptr, bytes)?;
        weak.upgrade().map(|s| (s, offset))
    }
}

/// The offset of `[ptr, ptr + bytes)` in the memory of `len` bytes at `base`, when it lies
/// there (and `same_device`): how a storage is found by an address another library hands over.
fn offset_within(same_device: bool, base: u64, len: usize, ptr: u64, bytes: usize) -> Option<usize> {
    let offset = usize::try_from(ptr.checked_sub(base)?).ok()?;
    let within = same_device && offset.checked_add(bytes).is_some_and(|end| end <= len);
    within.then_some(offset)
}

fn remember(t: &Any) {
    match t {
        Any::Gpu(t) => {
            let s = t.storage();
            HANDED_GPU.remember(t.device().ordinal(), s.device_ptr(), s, s.byte_len());
        }
        Any::Host(t) => {
            let s = t.storage();
            HANDED_HOST.remember(HOST, s.as_ptr() as u64, s, s.byte_len());
        }
    }
}

/// A view of `storage` from `byte_offset` on: `shape` and `strides` in elements of `dtype`,
/// starting `offset` elements further.
fn view_of<S: cuda_mp::TensorStorage>(
    storage: Arc<S>,
    byte_offset: usize,
    dtype: DType,
    shape: Vec<usize>,
    strides: Vec<isize>,
    offset: usize,
) -> PyResult<DynTensor<S>> {
    if !byte_offset.is_multiple_of(dtype.size()) {
        return Err(PyValueError::new_err("the view is not aligned to its element size in its storage"));
    }
    let offset = offset
        .checked_add(byte_offset / dtype.size())
        .ok_or_else(|| PyValueError::new_err("the view's offset is past what an address holds"))?;
    let layout = layout(shape, strides, offset)?;
    DynTensor::new(storage, layout, dtype).map_err(error)
}

/// Wraps part of a GPU allocation of this process for sending: `nbytes` bytes at `ptr` on GPU
/// `device` (a PyTorch storage: `data_ptr()`, `nbytes()`), viewed with `shape`, `strides` and
/// `offset` in elements of `dtype`. Memory that cuda-mp handed to Python travels as itself;
/// other memory (PyTorch's caching allocator) as its allocation's IPC handle plus offset, and
/// `keeper` (the PyTorch tensor) is held until every receiver has released it. With `stream`,
/// cuda-mp's stream is also ordered after that stream as `wait_for_stream` orders it (one call
/// for both, where a tensor is sent).
#[pyfunction]
#[pyo3(signature = (device, ptr, nbytes, dtype, shape, strides, offset, keeper, stream=None))]
#[allow(clippy::too_many_arguments)]
fn gpu_tensor(
    py: Python<'_>,
    device: usize,
    ptr: u64,
    nbytes: usize,
    dtype: &str,
    shape: Vec<usize>,
    strides: Vec<isize>,
    offset: usize,
    keeper: Py<PyAny>,
    stream: Option<usize>,
) -> PyResult<Tensor> {
    let dtype = dtype_named(dtype)?;
    let dev = Device::get(device).map_err(error)?;
    let known = allocator::find(device, ptr, nbytes).or_else(|| HANDED_GPU.find(device, ptr, nbytes));
    let (storage, byte_offset) = match known {
        Some(found) => found,
        // An empty tensor's storage has no memory (PyTorch's address is 0): a new empty one.
        None if nbytes == 0 => (GpuStorage::empty(&dev, 0).map_err(error)?, 0),
        None => {
            // SAFETY: `keeper` is the PyTorch tensor whose storage this is; PyTorch keeps the
            // memory allocated while the tensor lives, and the keeper lives as long as the
            // storage made here.
            let keeper = Box::new(Keeper(Some(keeper)));
            // The calling thread's current device stays PyTorch's.
            let storage =
                cuda_mp::keeping_current_context(|| unsafe { GpuStorage::from_foreign(&dev, ptr, nbytes, keeper) })
                    .map_err(error)?;
            // While it lives, the same PyTorch memory sent again travels as this storage: one
            // identity, whose receivers keep their mapping of it.
            HANDED_GPU.remember(device, ptr, &storage, nbytes);
            (storage, 0)
        }
    };
    let t = view_of(storage, byte_offset, dtype, shape, strides, offset)?;
    if let Some(stream) = stream {
        // SAFETY: the caller passes a live stream of this device's primary context or a
        // default stream, as for `wait_for_stream`.
        unsafe { wait_for(py, &dev, stream) }?;
    }
    Ok(Tensor { inner: Any::Gpu(t) })
}

/// The PyTorch tensor that keeps foreign memory allocated. Let go of with the GIL held, on a
/// thread of its own: pyo3 defers a drop without the GIL to the next call into this module, and
/// the memory with it (a SIGKILLed receiver's memory would come back only then); the thread
/// holds none of cuda-mp's locks, which the thread that drops the storage (cuda-mp's reaper)
/// may hold while a thread with the GIL waits on them.
struct Keeper(Option<Py<PyAny>>);

impl Drop for Keeper {
    fn drop(&mut self) {
        static RELEASES: OnceLock<Mutex<mpsc::Sender<Py<PyAny>>>> = OnceLock::new();
        let Some(object) = self.0.take() else { return };
        let releases = RELEASES.get_or_init(|| {
            let (tx, rx) = mpsc::channel::<Py<PyAny>>();
            // Where the thread cannot start (or the interpreter is shutting down), objects
            // sent here go to pyo3's deferred drop instead.
            let _ = std::thread::Builder::new().name("cuda-mp-py-release".into()).spawn(move || {
                for object in rx {
                    let _ = Python::try_attach(move |_| drop(object));
                }
            });
            Mutex::new(tx)
        });
        let _ = releases.lock().unwrap_or_else(|p| p.into_inner()).send(object);
    }
}

/// A host tensor for sending: memory that cuda-mp handed to Python (`ptr`, `nbytes`) travels
/// as itself; anything else is copied from `data` (the array's bytes, C order) into fresh
/// shared memory.
#[pyfunction]
#[pyo3(signature = (dtype, shape, strides, offset, ptr, nbytes, data=None))]
fn host_tensor(
    dtype: &str,
    shape: Vec<usize>,
    strides: Vec<isize>,
    offset: usize,
    ptr: usize,
    nbytes: usize,
    data: Option<&Bound<'_, PyBytes>>,
) -> PyResult<Option<Tensor>> {
    let dtype = dtype_named(dtype)?;
    if let Some((storage, byte_offset)) = HANDED_HOST.find(HOST, ptr as u64, nbytes) {
        let t = view_of(storage, byte_offset, dtype, shape, strides, offset)?;
        return Ok(Some(Tensor { inner: Any::Host(t) }));
    }
    let Some(data) = data else { return Ok(None) };
    let storage = HostStorage::from_bytes(data.as_bytes()).map_err(error)?;
    let layout = Layout::contiguous(&shape).map_err(error)?;
    let t = DynTensor::new(storage, layout, dtype).map_err(error)?;
    Ok(Some(Tensor { inner: Any::Host(t) }))
}

/// `nbytes` zeroed bytes of shared memory as a tensor of bytes: arrays made on it are sent
/// without a copy.
#[pyfunction]
fn empty_host(nbytes: usize) -> PyResult<Tensor> {
    let storage = HostStorage::zeroed(nbytes).map_err(error)?;
    let t = DynTensor::new(storage, Layout::contiguous(&[nbytes]).map_err(error)?, DType::U8).map_err(error)?;
    Ok(Tensor { inner: Any::Host(t) })
}

/// `cudaStream_t` (as an integer) of cuda-mp's stream on GPU `device`: a sender orders it after
/// its own stream before sending.
#[pyfunction]
fn stream_ptr(device: usize) -> PyResult<usize> {
    Ok(Device::get(device).map_err(error)?.stream().cu_stream() as usize)
}

/// Makes cuda-mp's stream on GPU `device` wait for the work queued so far on `stream`, a
/// `cudaStream_t` (as an integer) of that GPU's primary context, or 0 or 2 (the default
/// streams); nothing when it is idle. What a sender of another library's memory calls before
/// sending (as the consumer side of DLPack passes its stream to `__dlpack__`, the caller
/// vouches for the stream).
#[pyfunction]
fn wait_for_stream(py: Python<'_>, device: usize, stream: usize) -> PyResult<()> {
    let device = Device::get(device).map_err(error)?;
    // SAFETY: the caller passes a live stream of this device's primary context or a default
    // stream, as for `__dlpack__(stream=...)`.
    unsafe { wait_for(py, &device, stream) }
}

/// Makes cuda-mp's stream of `device` wait for the work queued so far on `stream` (another
/// library's), with the GIL released; the calling thread's current device stays PyTorch's.
///
/// # Safety
/// `stream` must be a live stream of `device`'s primary context, or 0 or 2 (the default
/// streams).
unsafe fn wait_for(py: Python<'_>, device: &Device, stream: usize) -> PyResult<()> {
    // SAFETY: upheld by the caller.
    py.detach(|| cuda_mp::keeping_current_context(|| unsafe { device.wait_for_stream(stream as _) })).map_err(error)
}

// ---------------------------------------------------------------------------------------------
// Bundles.

/// Named GPU tensors in few allocations, sent as one message (a `cuda_mp::Bundle`).
#[pyclass(frozen, module = "cuda_mp._native")]
#[derive(Clone, Debug)]
pub struct Bundle {
    inner: RsBundle,
}

#[pymethods]
impl Bundle {
    /// The tensors' names, in order.
    fn names(&self) -> Vec<String> {
        self.inner.entries().iter().map(|e| e.name().to_owned()).collect()
    }

    /// The tensor called `name`.
    fn get(&self, name: &str) -> PyResult<Tensor> {
        Ok(Tensor { inner: Any::Gpu(self.inner.get_dyn(name).map_err(error)?) })
    }

    /// Number of allocations (each one IPC handle or descriptor).
    fn allocations(&self) -> usize {
        self.inner.allocations()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.inner)
    }
}

/// Allocates one bundle on GPU `device` for `entries` (name, dtype, shape), zeroed, in at most
/// `chunk_bytes`-byte allocations (default: one).
#[pyfunction]
#[pyo3(signature = (device, entries, chunk_bytes=None))]
fn pack(device: usize, entries: Vec<(String, String, Vec<usize>)>, chunk_bytes: Option<usize>) -> PyResult<Bundle> {
    let dev = Device::get(device).map_err(error)?;
    let mut builder = BundleBuilder::new();
    if let Some(c) = chunk_bytes {
        builder = builder.chunk_bytes(c);
    }
    for (name, dtype, shape) in entries {
        builder = builder.add_dtype(name, dtype_named(&dtype)?, &shape);
    }
    Ok(Bundle { inner: builder.build(&dev).map_err(error)? })
}

/// A bundle of existing GPU tensors (one allocation per distinct storage).
#[pyfunction]
fn bundle_of(entries: Vec<(String, Bound<'_, Tensor>)>) -> PyResult<Bundle> {
    let tensors = entries
        .into_iter()
        .map(|(name, t)| match t.get().inner.clone() {
            Any::Gpu(t) => Ok((name, t)),
            Any::Host(_) => Err(PyTypeError::new_err(format!("bundle entry {name:?} is not on a gpu"))),
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(Bundle { inner: RsBundle::from_tensors(tensors).map_err(error)? })
}

// ---------------------------------------------------------------------------------------------
// Channels.

/// What a channel carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Gpu,
    Host,
    Bundle,
}

fn kind(name: &str) -> PyResult<Kind> {
    match name {
        "gpu" => Ok(Kind::Gpu),
        "host" => Ok(Kind::Host),
        "bundle" => Ok(Kind::Bundle),
        other => Err(PyValueError::new_err(format!("unknown channel kind {other:?}: gpu, host or bundle"))),
    }
}

enum Received {
    Tensor(Any),
    Bundle(RsBundle),
}

enum Rx {
    Gpu(RsReceiver<DynTensor<GpuStorage>>),
    Host(RsReceiver<DynTensor<HostStorage>>),
    Bundle(RsReceiver<RsBundle>),
    /// Pickled to another process, which receives from now on.
    Moved,
}

enum Tx {
    Gpu(RsSender<DynTensor<GpuStorage>>),
    Host(RsSender<DynTensor<HostStorage>>),
    Bundle(RsSender<RsBundle>),
}

enum Bound_ {
    Gpu(RsListener<DynTensor<GpuStorage>>),
    Host(RsListener<DynTensor<HostStorage>>),
    Bundle(RsListener<RsBundle>),
}

/// A timeout in seconds: a negative one is no wait (as `multiprocessing` takes it); NaN and
/// infinity are errors.
fn seconds(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    timeout
        .map(|t| {
            if !t.is_finite() {
                return Err(PyValueError::new_err("timeout must be a finite number of seconds"));
            }
            // Past what a `Duration` holds: no limit in practice.
            Ok(Duration::try_from_secs_f64(t.max(0.0)).unwrap_or(Duration::MAX))
        })
        .transpose()
}

/// When a wait of `timeout` ends: `None` for none, or for one past what the clock holds.
fn deadline(timeout: Option<Duration>) -> Option<Instant> {
    timeout.and_then(|t| Instant::now().checked_add(t))
}

/// The failure of one slice of a wait: a time-out (the wait goes on, if time is left) or an
/// error, raised as its exception.
trait WaitFailure: Send {
    fn is_timeout(&self) -> bool;
    fn raised(self) -> PyErr;
}

impl WaitFailure for RecvTimeoutError {
    fn is_timeout(&self) -> bool {
        RecvTimeoutError::is_timeout(self)
    }

    fn raised(self) -> PyErr {
        recv_error(self)
    }
}

impl WaitFailure for cuda_mp::Error {
    fn is_timeout(&self) -> bool {
        cuda_mp::Error::is_timeout(self)
    }

    fn raised(self) -> PyErr {
        error(self)
    }
}

impl WaitFailure for cuda_mp::GetTimeoutError {
    fn is_timeout(&self) -> bool {
        cuda_mp::GetTimeoutError::is_timeout(self)
    }

    fn raised(self) -> PyErr {
        get_error(self)
    }
}

/// Waits on `step` in slices, without the GIL, checking for KeyboardInterrupt between slices.
fn wait<R: Send, E: WaitFailure>(
    py: Python<'_>,
    timeout: Option<Duration>,
    step: impl FnMut(Duration) -> Result<R, E> + Send,
) -> PyResult<R> {
    try_wait(py, timeout, step)?.map_err(E::raised)
}

/// As `wait`, with the time-out given back (`Ok(Err(_))`) instead of raised.
fn try_wait<R: Send, E: WaitFailure>(
    py: Python<'_>,
    timeout: Option<Duration>,
    mut step: impl FnMut(Duration) -> Result<R, E> + Send,
) -> PyResult<Result<R, E>> {
    const SLICE: Duration = Duration::from_millis(100);
    let deadline = deadline(timeout);
    loop {
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let slice = left.map_or(SLICE, |l| l.min(SLICE));
        match py.detach(|| step(slice)) {
            Err(e) if e.is_timeout() && left.is_none_or(|l| l > slice) => py.check_signals()?,
            Err(e) if e.is_timeout() => return Ok(Err(e)),
            Err(e) => return Err(e.raised()),
            Ok(r) => return Ok(Ok(r)),
        }
    }
}

/// Runs `decode` (of a handle's bytes, which fetches the handle's descriptors from the process
/// that made them: up to 30 s for one that does not answer, stopped, say) on a thread of its
/// own, and waits for it in slices, looking for Ctrl-C between them. Interrupted, the decode
/// runs on to its end there and what it made is dropped: the handle is lost (a receiving end
/// so dropped is closed), and a later decode of the same bytes fails.
fn decode_off_thread<R: Send + 'static>(
    py: Python<'_>,
    decode: impl FnOnce() -> cuda_mp::Result<R> + Send + 'static,
) -> PyResult<R> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("cuda-mp-from-bytes".into())
        .spawn(move || {
            let _ = tx.send(decode());
        })
        .map_err(|e| error(cuda_mp::Error::Io(e)))?;
    let decoded = wait(py, None, move |slice| match rx.recv_timeout(slice) {
        Ok(decoded) => Ok(decoded),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(cuda_mp::Error::Timeout(slice)),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            Err(cuda_mp::Error::Io(std::io::Error::other("the decode ended without an answer")))
        }
    })?;
    decoded.map_err(error)
}

/// A receiving end's lock, waited for `within` at most (`None` then). A receive of another
/// thread holds it for one slice of its wait at a time; in a child forked while a thread of
/// the parent held it, it stays locked for ever, and a blocking lock would hang the child past
/// any timeout and past Ctrl-C.
fn lock_within<T>(end: &Mutex<T>, within: Duration) -> Option<MutexGuard<'_, T>> {
    let until = Instant::now() + within;
    loop {
        match end.try_lock() {
            Ok(guard) => return Some(guard),
            Err(TryLockError::Poisoned(p)) => return Some(p.into_inner()),
            Err(TryLockError::WouldBlock) if Instant::now() >= until => return None,
            Err(TryLockError::WouldBlock) => std::thread::sleep(Duration::from_micros(200)),
        }
    }
}

/// How long pickling an end waits for a receive of another thread to let go of it.
const PICKLE_WAIT: Duration = Duration::from_secs(1);

/// The error of an end whose lock could not be had in time.
fn end_held(what: &str) -> cuda_mp::Error {
    cuda_mp::Error::Unsupported(format!(
        "this {what} is held by a receive of another thread (or was, in the parent, when this process forked: then it cannot be used here)"
    ))
}

/// Waits for the one connection of a bound name; gives the receiving end.
#[pyclass(module = "cuda_mp._native")]
pub struct Listener {
    kind: Kind,
    name: String,
    bound: Mutex<Option<Bound_>>,
}

impl fmt::Debug for Listener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Listener").field("kind", &self.kind).field("name", &self.name).finish()
    }
}

#[pymethods]
impl Listener {
    /// Binds a fresh name for a channel of `kind` ("gpu", "host" or "bundle").
    #[new]
    fn new(kind_name: &str) -> PyResult<Listener> {
        let kind = kind(kind_name)?;
        let bound = match kind {
            Kind::Gpu => Bound_::Gpu(RsListener::bind().map_err(error)?),
            Kind::Host => Bound_::Host(RsListener::bind().map_err(error)?),
            Kind::Bundle => Bound_::Bundle(RsListener::bind().map_err(error)?),
        };
        let name = match &bound {
            Bound_::Gpu(l) => l.name(),
            Bound_::Host(l) => l.name(),
            Bound_::Bundle(l) => l.name(),
        }
        .to_owned();
        Ok(Listener { kind, name, bound: Mutex::new(Some(bound)) })
    }

    /// The name a sender connects to.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Waits (at most `timeout` seconds) for the sender to connect; once only (one that timed
    /// out may be called again). Ctrl-C interrupts the wait.
    #[pyo3(signature = (timeout=None))]
    fn accept(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Receiver> {
        let timeout = seconds(timeout)?;
        // Taken out while this waits (another thread's accept meanwhile is told so), and put
        // back when no sender came in time: a later accept waits again.
        let bound =
            self.bound.lock().unwrap_or_else(|p| p.into_inner()).take().ok_or_else(|| {
                PyValueError::new_err("this listener has already accepted its sender, or is accepting")
            })?;
        // A slice at a time, without the GIL, looking for KeyboardInterrupt between them.
        let got = try_wait(py, timeout, |slice| {
            let accepted = match &bound {
                Bound_::Gpu(l) => l.try_accept_for(slice).map(|r| r.map(Rx::Gpu)),
                Bound_::Host(l) => l.try_accept_for(slice).map(|r| r.map(Rx::Host)),
                Bound_::Bundle(l) => l.try_accept_for(slice).map(|r| r.map(Rx::Bundle)),
            };
            accepted.and_then(|rx| rx.ok_or(cuda_mp::Error::Timeout(slice)))
        });
        let failed = match got {
            Ok(Ok(rx)) => return Ok(Receiver { kind: self.kind, rx: Mutex::new(rx) }),
            Ok(Err(_)) => error(cuda_mp::Error::Timeout(timeout.unwrap_or(Duration::MAX))),
            Err(interrupted_or_failed) => interrupted_or_failed,
        };
        *self.bound.lock().unwrap_or_else(|p| p.into_inner()) = Some(bound);
        Err(failed)
    }
}

/// The receiving end of a channel.
#[pyclass(module = "cuda_mp._native")]
pub struct Receiver {
    kind: Kind,
    rx: Mutex<Rx>,
}

impl fmt::Debug for Receiver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Receiver").field("kind", &self.kind).finish()
    }
}

#[pymethods]
impl Receiver {
    /// The next message (a `Tensor` or a `Bundle`), waiting at most `timeout` seconds (None:
    /// for ever).
    #[pyo3(signature = (timeout=None))]
    fn recv(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        let timeout = seconds(timeout)?;
        // Not waited for with the GIL held: a receive of another thread holds the end (which is
        // there, then) for a slice of its wait at a time.
        if self.rx.try_lock().is_ok_and(|rx| matches!(*rx, Rx::Moved)) {
            return Err(pickled_away("receiver"));
        }
        let got = wait(py, timeout, |d| {
            let Some(rx) = lock_within(&self.rx, d) else { return Err(RecvTimeoutError::Timeout) };
            match &*rx {
                Rx::Gpu(rx) => rx.recv_timeout(d).map(|t| Received::Tensor(Any::Gpu(t))),
                Rx::Host(rx) => rx.recv_timeout(d).map(|t| Received::Tensor(Any::Host(t))),
                Rx::Bundle(rx) => rx.recv_timeout(d).map(Received::Bundle),
                Rx::Moved => Err(RecvTimeoutError::Disconnected),
            }
        })?;
        Ok(match got {
            Received::Tensor(inner) => Tensor { inner }.into_pyobject(py)?.into_any().unbind(),
            Received::Bundle(inner) => Bundle { inner }.into_pyobject(py)?.into_any().unbind(),
        })
    }

    /// This end as bytes that one process turns into it with `from_bytes`, within `ttl`
    /// seconds (what pickling a `cuda_mp.Receiver` writes). This end then receives nothing
    /// more here (its `recv` raises `Disconnected`): the other process receives.
    fn to_bytes<'py>(&self, py: Python<'py>, ttl: f64) -> PyResult<Bound<'py, PyBytes>> {
        let ttl = seconds(Some(ttl))?.unwrap_or(Duration::ZERO);
        let bytes = py.detach(|| {
            let mut rx = lock_within(&self.rx, PICKLE_WAIT).ok_or_else(|| end_held("receiver"))?;
            let bytes = match &*rx {
                Rx::Gpu(rx) => cuda_mp::to_bytes(rx, ttl),
                Rx::Host(rx) => cuda_mp::to_bytes(rx, ttl),
                Rx::Bundle(rx) => cuda_mp::to_bytes(rx, ttl),
                Rx::Moved => Err(cuda_mp::Error::Unsupported("this receiver was pickled already".into())),
            }?;
            *rx = Rx::Moved;
            Ok(bytes)
        });
        Ok(PyBytes::new(py, &bytes.map_err(error)?))
    }

    /// The receiving end that `to_bytes` made `data` of (a channel of `kind_name`); once.
    #[staticmethod]
    fn from_bytes(py: Python<'_>, kind_name: &str, data: &[u8]) -> PyResult<Receiver> {
        let kind = kind(kind_name)?;
        let data = data.to_vec();
        let rx = decode_off_thread(py, move || match kind {
            Kind::Gpu => cuda_mp::from_bytes(&data).map(Rx::Gpu),
            Kind::Host => cuda_mp::from_bytes(&data).map(Rx::Host),
            Kind::Bundle => cuda_mp::from_bytes(&data).map(Rx::Bundle),
        })?;
        Ok(Receiver { kind, rx: Mutex::new(rx) })
    }

    /// "gpu", "host" or "bundle".
    #[getter]
    fn kind(&self) -> &'static str {
        kind_name(self.kind)
    }
}

fn kind_name(k: Kind) -> &'static str {
    match k {
        Kind::Gpu => "gpu",
        Kind::Host => "host",
        Kind::Bundle => "bundle",
    }
}

/// The sending end of a channel. Sends of several threads go at once, each message whole
/// (as the Rust end's do): no lock of ours is held across a send, so a child forked while a
/// thread of its parent sends can send on its copy.
#[pyclass(frozen, module = "cuda_mp._native")]
pub struct Sender {
    kind: Kind,
    tx: Tx,
}

impl fmt::Debug for Sender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sender").field("kind", &self.kind).finish()
    }
}

#[pymethods]
impl Sender {
    /// Connects to the listener called `name`, for a channel of `kind`.
    #[staticmethod]
    fn connect(py: Python<'_>, name: &str, kind_name: &str) -> PyResult<Sender> {
        let kind = kind(kind_name)?;
        let name = name.to_owned();
        let tx = py.detach(move || match kind {
            Kind::Gpu => RsSender::connect(&name).map(Tx::Gpu),
            Kind::Host => RsSender::connect(&name).map(Tx::Host),
            Kind::Bundle => RsSender::connect(&name).map(Tx::Bundle),
        });
        Ok(Sender { kind, tx: tx.map_err(error)? })
    }

    /// A copy of this end as bytes that one process turns into a sender of the same channel
    /// with `from_bytes`, within `ttl` seconds (what pickling a `cuda_mp.Sender` writes); this
    /// end stays usable.
    fn to_bytes<'py>(&self, py: Python<'py>, ttl: f64) -> PyResult<Bound<'py, PyBytes>> {
        let ttl = seconds(Some(ttl))?.unwrap_or(Duration::ZERO);
        let bytes = py.detach(|| match &self.tx {
            Tx::Gpu(tx) => cuda_mp::to_bytes(tx, ttl),
            Tx::Host(tx) => cuda_mp::to_bytes(tx, ttl),
            Tx::Bundle(tx) => cuda_mp::to_bytes(tx, ttl),
        });
        Ok(PyBytes::new(py, &bytes.map_err(error)?))
    }

    /// The sending end that `to_bytes` made `data` of (a channel of `kind_name`); once.
    #[staticmethod]
    fn from_bytes(py: Python<'_>, kind_name: &str, data: &[u8]) -> PyResult<Sender> {
        let kind = kind(kind_name)?;
        let data = data.to_vec();
        let tx = decode_off_thread(py, move || match kind {
            Kind::Gpu => cuda_mp::from_bytes(&data).map(Tx::Gpu),
            Kind::Host => cuda_mp::from_bytes(&data).map(Tx::Host),
            Kind::Bundle => cuda_mp::from_bytes(&data).map(Tx::Bundle),
        })?;
        Ok(Sender { kind, tx })
    }

    /// Sends a `Tensor` (gpu and host channels) or a `Bundle` (bundle channels).
    fn send(&self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let wrong = || {
            let got = value.get_type().name().map(|n| n.to_string()).unwrap_or_default();
            PyTypeError::new_err(format!("a {} channel cannot send a {got}", kind_name(self.kind)))
        };
        let message = match self.kind {
            Kind::Gpu | Kind::Host => match value.cast::<Tensor>() {
                Ok(t) => Received::Tensor(t.get().inner.clone()),
                Err(_) => return Err(wrong()),
            },
            Kind::Bundle => match value.cast::<Bundle>() {
                Ok(b) => Received::Bundle(b.get().inner.clone()),
                Err(_) => return Err(wrong()),
            },
        };
        let sent = py.detach(|| match (&self.tx, message) {
            (Tx::Gpu(tx), Received::Tensor(Any::Gpu(t))) => Ok(tx.send(t).map_err(cuda_mp::Error::from)),
            (Tx::Host(tx), Received::Tensor(Any::Host(t))) => Ok(tx.send(t).map_err(cuda_mp::Error::from)),
            (Tx::Bundle(tx), Received::Bundle(b)) => Ok(tx.send(b).map_err(cuda_mp::Error::from)),
            _ => Err(()),
        });
        let sent = sent.map_err(|()| wrong())?;
        sent.map_err(|e| send_error(py, e))
    }

    /// "gpu", "host" or "bundle".
    #[getter]
    fn kind(&self) -> &'static str {
        kind_name(self.kind)
    }
}

// ---------------------------------------------------------------------------------------------
// Queues of pickled objects whose tensors travel beside the pickle.

/// The deepest nesting of lists, tuples and dicts that an object put as a `Value` may have;
/// a deeper one (or one that holds itself) is pickled.
const VALUE_DEPTH: usize = 64;

/// `obj` as a `Value`, when it is made only of what a `Value` holds: `None`, `bool`, `int` (64
/// bits), `float`, `str`, `bytes`, `list`, `tuple`, `dict` (those exact types, not subclasses)
/// and tensors, which `leaf` turns into tensors of this module (it returns `None` for any
/// other object). `None` when it is not (the caller pickles it).
///
/// An object met twice (a list in two places, the same bytes many times, a tensor: tied
/// weights) makes it `None`: pickle keeps one copy and the references to it, which a value
/// would not (and a value of shared parts, walked once per reference, can grow exponentially
/// with its depth). Small immutable parts are the exception (`small_and_immutable`).
fn to_value(
    obj: &Bound<'_, PyAny>,
    leaf: &Bound<'_, PyAny>,
    depth: usize,
    seen: &mut std::collections::HashSet<usize>,
) -> PyResult<Option<Value>> {
    if depth > VALUE_DEPTH {
        return Ok(None);
    }
    let shared_part = obj.is_exact_instance_of::<PyList>()
        || obj.is_exact_instance_of::<PyTuple>()
        || obj.is_exact_instance_of::<PyDict>()
        || obj.is_exact_instance_of::<PyBytes>();
    if shared_part && !small_and_immutable(obj) && !seen.insert(obj.as_ptr() as usize) {
        return Ok(None);
    }
    let mut all = |items: &mut dyn Iterator<Item = Bound<'_, PyAny>>| -> PyResult<Option<Vec<Value>>> {
        let mut out = Vec::new();
        for item in items {
            match to_value(&item, leaf, depth + 1, seen)? {
                Some(v) => out.push(v),
                None => return Ok(None),
            }
        }
        Ok(Some(out))
    };
    let value = if obj.is_none() {
        Some(Value::None)
    } else if obj.is_exact_instance_of::<PyBool>() {
        Some(Value::Bool(obj.extract()?))
    } else if obj.is_exact_instance_of::<PyInt>() {
        obj.extract::<i64>().ok().map(Value::Int)
    } else if obj.is_exact_instance_of::<PyFloat>() {
        Some(Value::Float(obj.extract()?))
    } else if obj.is_exact_instance_of::<PyString>() {
        // A string with a lone surrogate has no UTF-8: pickled.
        obj.extract::<String>().ok().map(Value::Str)
    } else if let Ok(b) = obj.cast_exact::<PyBytes>() {
        Some(Value::Bytes(b.as_bytes().to_vec()))
    } else if let Ok(list) = obj.cast_exact::<PyList>() {
        all(&mut list.iter())?.map(Value::List)
    } else if let Ok(tuple) = obj.cast_exact::<PyTuple>() {
        all(&mut tuple.iter())?.map(Value::Tuple)
    } else if let Ok(dict) = obj.cast_exact::<PyDict>() {
        let mut items = Vec::with_capacity(dict.len());
        for (k, v) in dict.iter() {
            match (to_value(&k, leaf, depth + 1, seen)?, to_value(&v, leaf, depth + 1, seen)?) {
                (Some(k), Some(v)) => items.push((k, v)),
                _ => return Ok(None),
            }
        }
        Some(Value::Dict(items))
    } else {
        let tensor = leaf.call1((obj,))?;
        match tensor.cast::<Tensor>() {
            Ok(t) if seen.insert(obj.as_ptr() as usize) => Some(tensor_value(&t.get().inner)),
            _ => None,
        }
    };
    Ok(value)
}

/// Whether `obj` is a small immutable part, which CPython itself shares between places that
/// never meant to share it: the empty tuple and bytes, one-byte bytes, a literal's equal
/// constant tuples (`{"a": (1, 2), "b": (1, 2)}`). Met twice, such a part is copied into the
/// value (a few values a reference) rather than making the object a pickle.
fn small_and_immutable(obj: &Bound<'_, PyAny>) -> bool {
    const MOST: usize = 16;
    if let Ok(b) = obj.cast_exact::<PyBytes>() {
        return b.as_bytes().len() <= 4 * MOST;
    }
    let scalar = |item: &Bound<'_, PyAny>| {
        item.is_none()
            || item.is_exact_instance_of::<PyBool>()
            || item.is_exact_instance_of::<PyInt>()
            || item.is_exact_instance_of::<PyFloat>()
            || item.cast_exact::<PyString>().is_ok_and(|s| s.len().is_ok_and(|n| n <= 4 * MOST))
    };
    obj.cast_exact::<PyTuple>().is_ok_and(|t| t.len() <= MOST && t.iter().all(|item| scalar(&item)))
}

fn tensor_value(t: &Any) -> Value {
    match t {
        Any::Gpu(t) => Value::Gpu(t.clone()),
        Any::Host(t) => Value::Host(t.clone()),
    }
}

/// What turns a `Value`'s tensors and pickles back into Python objects: `gpu` and `host` take a
/// tensor of this module (a CUDA tensor, a NumPy array), `pickled` a pickle and the tensors it
/// names.
struct Makers<'a, 'py> {
    gpu: &'a Bound<'py, PyAny>,
    host: &'a Bound<'py, PyAny>,
    pickled: &'a Bound<'py, PyAny>,
}

/// `value` as a Python object.
fn from_value<'py>(py: Python<'py>, value: Value, makers: &Makers<'_, 'py>) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Value::None => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, b).to_owned().into_any(),
        Value::Int(i) => i.into_pyobject(py)?.into_any(),
        Value::Float(x) => PyFloat::new(py, x).into_any(),
        Value::Str(s) => PyString::new(py, &s).into_any(),
        Value::Bytes(b) => PyBytes::new(py, &b).into_any(),
        Value::List(items) => {
            let items: PyResult<Vec<_>> = items.into_iter().map(|v| from_value(py, v, makers)).collect();
            PyList::new(py, items?)?.into_any()
        }
        Value::Tuple(items) => {
            let items: PyResult<Vec<_>> = items.into_iter().map(|v| from_value(py, v, makers)).collect();
            PyTuple::new(py, items?)?.into_any()
        }
        Value::Dict(items) => {
            let dict = PyDict::new(py);
            for (k, v) in items {
                dict.set_item(from_key(py, k, makers)?, from_value(py, v, makers)?)?;
            }
            dict.into_any()
        }
        Value::Host(t) => makers.host.call1((Tensor { inner: Any::Host(t) },))?,
        Value::Gpu(t) => makers.gpu.call1((Tensor { inner: Any::Gpu(t) },))?,
        Value::Pickled { pickle, tensors } => {
            let tensors: PyResult<Vec<Tensor>> = tensors
                .into_iter()
                .map(|v| match v {
                    Value::Gpu(t) => Ok(Tensor { inner: Any::Gpu(t) }),
                    Value::Host(t) => Ok(Tensor { inner: Any::Host(t) }),
                    _ => Err(exception(py, "Malformed", "a pickle's tensor is not a tensor".into())),
                })
                .collect();
            makers.pickled.call1((PyBytes::new(py, &pickle), tensors?))?
        }
        _ => return Err(exception(py, "Malformed", "a value of a kind this package does not know".into())),
    })
}

/// A dict's key `key` as a Python object that can be one: a list (Rust's `Vec`) as a tuple, a
/// dict as a tuple of its pairs, each all the way down, so that a key Python cannot hash does
/// not fail the whole message after it was taken.
fn from_key<'py>(py: Python<'py>, key: Value, makers: &Makers<'_, 'py>) -> PyResult<Bound<'py, PyAny>> {
    Ok(match key {
        Value::List(items) | Value::Tuple(items) => {
            let items: PyResult<Vec<_>> = items.into_iter().map(|v| from_key(py, v, makers)).collect();
            PyTuple::new(py, items?)?.into_any()
        }
        Value::Dict(pairs) => {
            let pairs: PyResult<Vec<_>> = pairs
                .into_iter()
                .map(|(k, v)| PyTuple::new(py, [from_key(py, k, makers)?, from_key(py, v, makers)?]))
                .collect();
            PyTuple::new(py, pairs?)?.into_any()
        }
        // cuda-mp's own tensor, which can be a key where a NumPy array cannot.
        Value::Host(t) => Tensor { inner: Any::Host(t) }.into_pyobject(py)?.into_any(),
        other => from_value(py, other, makers)?,
    })
}

/// Hands `obj` to `deliver` (a queue's put, a channel's send) as a `Value` and returns True;
/// False, delivering nothing, when it is not made only of what a `Value` holds.
fn deliver_value<E: Into<cuda_mp::Error> + Send>(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    leaf: &Bound<'_, PyAny>,
    deliver: impl FnOnce(Value) -> Result<(), E> + Send,
) -> PyResult<bool> {
    let Some(value) = to_value(obj, leaf, 0, &mut Default::default())? else { return Ok(false) };
    deliver_now(py, value, deliver)?;
    Ok(true)
}

/// Hands `value` to `deliver` without the GIL; its failure as the matching exception.
fn deliver_now<E: Into<cuda_mp::Error> + Send>(
    py: Python<'_>,
    value: Value,
    deliver: impl FnOnce(Value) -> Result<(), E> + Send,
) -> PyResult<()> {
    py.detach(|| deliver(value)).map_err(|e| send_error(py, e.into()))
}

/// A pickle and the tensors it names, as a `Value`.
fn pickled(pickle: Vec<u8>, tensors: &[Bound<'_, Tensor>]) -> Value {
    Value::Pickled { pickle, tensors: tensors.iter().map(|t| tensor_value(&t.get().inner)).collect() }
}

/// A queue of many producers and consumers in many processes (a `cuda_mp::Queue`) whose items
/// are pickles and the tensors they name: `cuda_mp.Queue` wraps it.
#[pyclass(frozen, module = "cuda_mp._native")]
pub struct Queue {
    inner: cuda_mp::Queue<Value>,
}

impl fmt::Debug for Queue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Queue").finish_non_exhaustive()
    }
}

/// `queue` with its gets' prefetch set, where one is given.
fn with_prefetch(queue: cuda_mp::Queue<Value>, prefetch: Option<usize>) -> cuda_mp::Queue<Value> {
    match prefetch {
        Some(n) => queue.with_prefetch(n),
        None => queue,
    }
}

/// A send's failure (or a put's) as the matching exception.
fn send_error(py: Python<'_>, e: cuda_mp::Error) -> PyErr {
    let class = match &e {
        cuda_mp::Error::Send(cuda_mp::SendFailure::Disconnected) => "Disconnected",
        _ => "Error",
    };
    exception(py, class, e.to_string())
}

/// A get's failure as the matching exception.
fn get_error(e: cuda_mp::GetTimeoutError) -> PyErr {
    Python::attach(|py| {
        let class = match &e {
            cuda_mp::GetTimeoutError::Timeout => "Timeout",
            cuda_mp::GetTimeoutError::Disconnected => "Disconnected",
            cuda_mp::GetTimeoutError::Malformed(_) => "Malformed",
            _ => "Error",
        };
        exception(py, class, e.to_string())
    })
}

#[pymethods]
impl Queue {
    /// A new queue, served by this process: it must outlive the processes that use it. Gets
    /// through this handle keep `prefetch` items asked for ahead (None: the crate's default).
    #[new]
    #[pyo3(signature = (prefetch=None))]
    fn new(py: Python<'_>, prefetch: Option<usize>) -> PyResult<Queue> {
        let inner = py.detach(cuda_mp::Queue::new).map_err(error)?;
        Ok(Queue { inner: with_prefetch(inner, prefetch) })
    }

    /// Puts `obj` as a `Value` (its tensors: what `leaf` makes of them) and returns True; False,
    /// putting nothing, when it is not made only of what a `Value` holds.
    fn put(&self, py: Python<'_>, obj: &Bound<'_, PyAny>, leaf: &Bound<'_, PyAny>) -> PyResult<bool> {
        deliver_value(py, obj, leaf, |v| self.inner.put(v))
    }

    /// Puts an object that only Python reads: its pickle and the tensors it names.
    fn put_pickled(&self, py: Python<'_>, pickle: Vec<u8>, tensors: Vec<Bound<'_, Tensor>>) -> PyResult<()> {
        deliver_now(py, pickled(pickle, &tensors), |v| self.inner.put(v))
    }

    /// The next item as a Python object (its tensors and pickles made by `gpu`, `host` and
    /// `pickled`), waiting at most `timeout` seconds (None: for ever). Raises `Timeout`,
    /// `Disconnected` (closed and drained, or its process gone), `Malformed`.
    #[pyo3(signature = (timeout, gpu, host, pickled))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
        gpu: &Bound<'py, PyAny>,
        host: &Bound<'py, PyAny>,
        pickled: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let value = wait(py, seconds(timeout)?, |d| self.inner.get_timeout(d))?;
        from_value(py, value, &Makers { gpu, host, pickled })
    }

    /// This handle as bytes that one process turns into a handle of the same queue with
    /// `from_bytes`, within `ttl` seconds (what pickling a `cuda_mp.Queue` writes).
    fn to_bytes<'py>(&self, py: Python<'py>, ttl: f64) -> PyResult<Bound<'py, PyBytes>> {
        let ttl = seconds(Some(ttl))?.unwrap_or(Duration::ZERO);
        let bytes = py.detach(|| cuda_mp::to_bytes(&self.inner, ttl)).map_err(error)?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// The handle that `to_bytes` made `data` of; once. `prefetch` as for a new queue.
    #[staticmethod]
    #[pyo3(signature = (data, prefetch=None))]
    fn from_bytes(py: Python<'_>, data: &[u8], prefetch: Option<usize>) -> PyResult<Queue> {
        let data = data.to_vec();
        let inner = decode_off_thread(py, move || cuda_mp::from_bytes(&data))?;
        Ok(Queue { inner: with_prefetch(inner, prefetch) })
    }

    /// Messages waiting, in flight and delivered so far: (backlog, in flight, delivered).
    /// Waits for a get of another thread on this handle, and for the queue's process to
    /// answer: without limit, or `timeout` seconds at most (then `cuda_mp.Timeout`).
    #[pyo3(signature = (timeout=None))]
    fn stats(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<(usize, usize, u64)> {
        let s = match seconds(timeout)? {
            Some(limit) => py.detach(|| self.inner.stats_timeout(limit)).map_err(get_error)?,
            // Without a limit, in slices that Ctrl-C ends (the queue's process stopped, say),
            // each twice the last, up to 5 s: a slice shorter than the dispatcher takes to
            // answer (busy encoding a large message) ends unanswered and starts the handle's
            // consumer afresh, so the slices grow past what a busy dispatcher takes.
            None => {
                let mut slice = Duration::from_millis(100);
                loop {
                    match py.detach(|| self.inner.stats_timeout(slice)) {
                        Ok(s) => break s,
                        Err(e) if e.is_timeout() => {
                            py.check_signals()?;
                            slice = (slice * 2).min(Duration::from_secs(5));
                        }
                        Err(e) => return Err(get_error(e)),
                    }
                }
            }
        };
        Ok((s.backlog, s.in_flight, s.delivered))
    }
}

/// One end of a two-way pipe of items (`cuda_mp.Pipe`): it sends to the other end and
/// receives what the other end sends.
#[pyclass(frozen, module = "cuda_mp._native")]
pub struct Connection {
    tx: RsSender<Value>,
    /// `None` once pickled to another process, which receives from then on.
    rx: Mutex<Option<RsReceiver<Value>>>,
    /// What `poll` received, for the next `recv`s, and the process that received it.
    polled: Mutex<(u32, VecDeque<Value>)>,
}

impl Connection {
    /// An end of `tx` and `rx` (`None`: a write-only end's copy, which receives nothing).
    fn new(tx: RsSender<Value>, rx: Option<RsReceiver<Value>>) -> Connection {
        Connection { tx, rx: Mutex::new(rx), polled: Mutex::new((std::process::id(), VecDeque::new())) }
    }

    /// What `poll` received in this process: a child forked after its parent polled does not
    /// receive the parent's objects a second time.
    fn polled(&self) -> std::sync::MutexGuard<'_, (u32, VecDeque<Value>)> {
        let mut polled = self.polled.lock().unwrap_or_else(|p| p.into_inner());
        if polled.0 != std::process::id() {
            *polled = (std::process::id(), VecDeque::new());
        }
        polled
    }

    /// The next value: one `poll` received, else one from the channel within `timeout`.
    fn receive_timeout(&self, timeout: Duration) -> Result<Value, RecvTimeoutError> {
        if let Some(value) = self.polled().1.pop_front() {
            return Ok(value);
        }
        self.receive_new(timeout)
    }

    fn receive_new(&self, timeout: Duration) -> Result<Value, RecvTimeoutError> {
        let Some(rx) = lock_within(&self.rx, timeout) else { return Err(RecvTimeoutError::Timeout) };
        match &*rx {
            Some(rx) => rx.recv_timeout(timeout),
            None => Err(RecvTimeoutError::Disconnected),
        }
    }
}

/// `Disconnected`, saying why: an end that was pickled receives nothing here, its messages go
/// to the process that loads the pickle (the plain message would point at the senders).
fn pickled_away(what: &str) -> PyErr {
    Python::attach(|py| {
        let why = format!(
            "this {what} was pickled, to go to another process: its messages are received where the pickle is loaded"
        );
        exception(py, "Disconnected", why)
    })
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection").finish_non_exhaustive()
    }
}

/// The two ends of a new pipe.
#[pyfunction]
fn pipe(py: Python<'_>) -> PyResult<(Connection, Connection)> {
    let made = py.detach(|| -> cuda_mp::Result<_> {
        let (tx_a, rx_a) = cuda_mp::channel::<Value>()?;
        let (tx_b, rx_b) = cuda_mp::channel::<Value>()?;
        Ok((tx_a, rx_a, tx_b, rx_b))
    });
    let (tx_a, rx_a, tx_b, rx_b) = made.map_err(error)?;
    Ok((Connection::new(tx_a, Some(rx_b)), Connection::new(tx_b, Some(rx_a))))
}

#[pymethods]
impl Connection {
    /// Sends `obj` as a `Value` to the other end (as `Queue.put` does) and returns True; False,
    /// sending nothing, when it is not made only of what a `Value` holds. Raises `Disconnected`
    /// when the other end is gone.
    fn send(&self, py: Python<'_>, obj: &Bound<'_, PyAny>, leaf: &Bound<'_, PyAny>) -> PyResult<bool> {
        deliver_value(py, obj, leaf, |v| self.tx.send(v))
    }

    /// Sends an object that only Python reads: its pickle and the tensors it names.
    fn send_pickled(&self, py: Python<'_>, pickle: Vec<u8>, tensors: Vec<Bound<'_, Tensor>>) -> PyResult<()> {
        deliver_now(py, pickled(pickle, &tensors), |v| self.tx.send(v))
    }

    /// The next object from the other end (as `Queue.get` makes it), waiting at most `timeout`
    /// seconds (None: for ever). Raises `Timeout`, `Disconnected` (the other end is gone and
    /// nothing is left, or this end was pickled to another process), `Malformed`.
    #[pyo3(signature = (timeout, gpu, host, pickled))]
    fn recv<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
        gpu: &Bound<'py, PyAny>,
        host: &Bound<'py, PyAny>,
        pickled: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let timeout = seconds(timeout)?;
        // As in `Receiver.recv`: a locked end is being received from, so it is there.
        if self.polled().1.is_empty() && self.rx.try_lock().is_ok_and(|rx| rx.is_none()) {
            return Err(pickled_away("connection"));
        }
        let value = wait(py, timeout, |d| self.receive_timeout(d))?;
        from_value(py, value, &Makers { gpu, host, pickled })
    }

    /// Whether an object is ready to be received, waiting at most `timeout` seconds for one
    /// (0: not at all; None: for ever). What arrived stays for the next `recv`. Raises
    /// `Disconnected` when the other end is gone and nothing is left, or this end was pickled
    /// to another process (where `recv` raises at once too).
    #[pyo3(signature = (timeout=Some(0.0)))]
    fn poll(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        if !self.polled().1.is_empty() {
            return Ok(true);
        }
        // Not waited for with the GIL held: a `recv` of another thread holds the receiver
        // (which is there, then) for a slice of its wait at a time.
        if self.rx.try_lock().is_ok_and(|rx| rx.is_none()) {
            return Err(pickled_away("connection"));
        }
        match try_wait(py, seconds(timeout)?, |d| self.receive_new(d))? {
            Ok(value) => {
                self.polled().1.push_back(value);
                Ok(true)
            }
            Err(_) => Ok(false),
        }
    }

    /// This end as bytes that one process turns into it with `from_bytes`, within `ttl`
    /// seconds (what pickling a `cuda_mp.Connection` writes): a copy of its sending half, and
    /// its receiving half, which receives nothing more here. An end that is not `readable` (a
    /// one-way pipe's writer) gives a copy of its sending half alone, as often as asked.
    #[pyo3(signature = (ttl, readable=true))]
    fn to_bytes<'py>(&self, py: Python<'py>, ttl: f64, readable: bool) -> PyResult<Bound<'py, PyBytes>> {
        let ttl = seconds(Some(ttl))?.unwrap_or(Duration::ZERO);
        if !readable {
            let bytes = py.detach(|| cuda_mp::to_bytes(&self.tx, ttl)).map_err(error)?;
            return Ok(PyBytes::new(py, &bytes));
        }
        let bytes = py.detach(|| {
            let mut rx = lock_within(&self.rx, PICKLE_WAIT).ok_or_else(|| end_held("connection"))?;
            let Some(receiver) = rx.as_ref() else {
                return Err(cuda_mp::Error::Unsupported("this connection was pickled already".into()));
            };
            if !self.polled().1.is_empty() {
                return Err(cuda_mp::Error::Unsupported(
                    "this connection holds objects that poll received: recv them before pickling it".into(),
                ));
            }
            let bytes = cuda_mp::to_bytes(&(&self.tx, receiver), ttl)?;
            *rx = None;
            Ok(bytes)
        });
        Ok(PyBytes::new(py, &bytes.map_err(error)?))
    }

    /// The end that `to_bytes` made `data` of (with the same `readable`); once.
    #[staticmethod]
    #[pyo3(signature = (data, readable=true))]
    fn from_bytes(py: Python<'_>, data: &[u8], readable: bool) -> PyResult<Connection> {
        let data = data.to_vec();
        if !readable {
            let tx: RsSender<Value> = decode_off_thread(py, move || cuda_mp::from_bytes(&data))?;
            return Ok(Connection::new(tx, None));
        }
        let (tx, rx): (RsSender<Value>, RsReceiver<Value>) = decode_off_thread(py, move || cuda_mp::from_bytes(&data))?;
        Ok(Connection::new(tx, Some(rx)))
    }
}

// ---------------------------------------------------------------------------------------------
// Tensors as bytes, for transports that are not cuda-mp channels (pickles: `cuda_mp.torch`).

const AS_GPU: u8 = 0;
const AS_HOST: u8 = 1;

/// `tensor` as bytes that one process of this user on this host turns back into it with
/// `tensor_from_bytes`, while this process lives and within `ttl` seconds (what
/// `cuda_mp.torch.install()`'s reductions pickle). The memory is shared, not copied, and lives
/// until the receiver's last array made from it is gone.
#[pyfunction]
fn tensor_to_bytes<'py>(py: Python<'py>, tensor: &Bound<'py, Tensor>, ttl: f64) -> PyResult<Bound<'py, PyBytes>> {
    let ttl = seconds(Some(ttl))?.unwrap_or(Duration::ZERO);
    tagged_bytes(py, tensor, |t| match t {
        Any::Gpu(t) => cuda_mp::to_bytes(t, ttl),
        Any::Host(t) => cuda_mp::to_bytes(t, ttl),
    })
}

/// `tensor` encoded by `encode` without the GIL, its kind's tag in front.
fn tagged_bytes<'py>(
    py: Python<'py>,
    tensor: &Bound<'py, Tensor>,
    encode: impl FnOnce(&Any) -> cuda_mp::Result<Vec<u8>> + Send,
) -> PyResult<Bound<'py, PyBytes>> {
    let inner = tensor.get().inner.clone();
    let tag = match &inner {
        Any::Gpu(_) => AS_GPU,
        Any::Host(_) => AS_HOST,
    };
    // The calling thread's current device stays the caller's (PyTorch's).
    let bytes = py
        .detach(move || match tag {
            AS_GPU => cuda_mp::keeping_current_context(|| encode(&inner)),
            _ => encode(&inner),
        })
        .map_err(error)?;
    PyBytes::new_with(py, bytes.len() + 1, |out| {
        out[0] = tag;
        out[1..].copy_from_slice(&bytes);
        Ok(())
    })
}

/// Tensors as bytes, like `tensor_to_bytes`, whose descriptors wait in one deposit
/// (`cuda_mp::HandoffBatch`): the tensors of one pickle, which their receiver fetches at once.
/// `finish()` before any of them is read; one not finished is withdrawn when it goes.
#[pyclass(frozen, module = "cuda_mp._native")]
struct HandoffBatch {
    inner: Mutex<Option<cuda_mp::HandoffBatch>>,
}

#[pymethods]
impl HandoffBatch {
    #[new]
    fn new(ttl: f64) -> PyResult<Self> {
        let ttl = seconds(Some(ttl))?.unwrap_or(Duration::ZERO);
        let batch = cuda_mp::HandoffBatch::new(ttl).map_err(error)?;
        Ok(HandoffBatch { inner: Mutex::new(Some(batch)) })
    }

    /// One more tensor of the batch, as bytes for `tensor_from_bytes`.
    fn tensor_to_bytes<'py>(&self, py: Python<'py>, tensor: &Bound<'py, Tensor>) -> PyResult<Bound<'py, PyBytes>> {
        tagged_bytes(py, tensor, |t| {
            let mut batch = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            let batch = batch.as_mut().ok_or_else(|| cuda_mp::Error::Unsupported("this batch has ended".into()))?;
            match t {
                Any::Gpu(t) => batch.to_bytes(t),
                Any::Host(t) => batch.to_bytes(t),
            }
        })
    }

    /// Ends the batch: its tensors may be read from now on.
    fn finish(&self) -> PyResult<()> {
        let batch = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        batch.map_or(Ok(()), |b| b.finish().map_err(error))
    }

    /// Drops the batch unfinished: none of its tensors will be read, and what they held goes now.
    fn withdraw(&self) {
        let batch = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(batch);
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self)
    }
}

impl fmt::Debug for HandoffBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &*self.inner.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(batch) => batch.fmt(f),
            None => f.write_str("HandoffBatch(ended)"),
        }
    }
}

/// The tensor that `tensor_to_bytes` made `data` of, in the process that made it; once.
#[pyfunction]
fn tensor_from_bytes(py: Python<'_>, data: &[u8]) -> PyResult<Tensor> {
    let decoded = py.detach(|| match data.split_first() {
        // The calling thread's current device stays the caller's (PyTorch's).
        Some((&AS_GPU, rest)) => cuda_mp::keeping_current_context(|| cuda_mp::from_bytes(rest).map(Any::Gpu)),
        Some((&AS_HOST, rest)) => cuda_mp::from_bytes(rest).map(Any::Host),
        _ => Err(cuda_mp::Error::Malformed("these bytes are not a tensor of cuda-mp".into())),
    });
    Ok(Tensor { inner: decoded.map_err(error)? })
}

/// A received GPU tensor as the DLPack capsule that `__dlpack__(stream=...)` gives for PyTorch's
/// current stream of the tensor's device, in one call: that stream is read here
/// (`torch._C._cuda_getCurrentRawStream`, so no stream from the caller is trusted) and ordered
/// after the tensor's arrival. PyTorch's CUDA state must be initialized.
#[pyfunction]
fn torch_capsule(py: Python<'_>, tensor: &Bound<'_, Tensor>) -> PyResult<Py<PyAny>> {
    static CURRENT_STREAM: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let tensor = tensor.get();
    let Any::Gpu(t) = &tensor.inner else {
        return Err(PyTypeError::new_err("torch_capsule takes a GPU tensor"));
    };
    let current_stream = CURRENT_STREAM
        .get_or_try_init(py, || PyResult::Ok(py.import("torch._C")?.getattr("_cuda_getCurrentRawStream")?.unbind()))?;
    remember(&tensor.inner);
    let stream: usize = current_stream.call1(py, (t.device().ordinal(),))?.extract(py)?;
    // SAFETY: PyTorch's current stream of that device is a live stream of the device's primary
    // context (which PyTorch and cuda-mp share), or 0, the legacy default stream.
    unsafe { dlpack::export_for_stream(py, &tensor.inner, stream) }
}

/// Lifetime counters of this process (storages alive, exported, leases outstanding), for tests.
#[pyfunction]
fn lifetime_stats(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
    let s = cuda_mp::lifetime_stats();
    PyTuple::new(py, [s.live_storages as u64, s.exported_storages as u64, s.outstanding_leases as u64])
}

/// What other processes hold of this process's storages, per lease (`cuda_mp::holder_stats`):
/// a list of dicts, most bytes first.
#[pyfunction]
fn holder_stats(py: Python<'_>) -> PyResult<Vec<Bound<'_, PyDict>>> {
    cuda_mp::holder_stats()
        .into_iter()
        .map(|h| {
            let d = PyDict::new(py);
            d.set_item("lease", h.lease)?;
            d.set_item("storages", h.storages)?;
            d.set_item("claims", h.claims)?;
            d.set_item("bytes", h.bytes)?;
            Ok(d)
        })
        .collect()
}

/// How many mappings of other processes' storages this process has opened (a storage mapped
/// again from the idle cache counts once), for tests.
#[pyfunction]
fn opened_mappings() -> u64 {
    cuda_mp::lifetime_stats().opened_mappings
}

/// How many segments of other processes' caching allocators this process has mapped (each
/// once, for all the blocks cut from it), for tests.
#[pyfunction]
fn opened_segments() -> u64 {
    cuda_mp::lifetime_stats().opened_segments
}

/// A caching allocator's statistics as a dict (the fields of `cuda_mp::AllocatorStats`).
fn stats_dict(py: Python<'_>, s: cuda_mp::AllocatorStats) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("segments", s.segments)?;
    d.set_item("reserved_bytes", s.reserved_bytes)?;
    d.set_item("allocated_bytes", s.allocated_bytes)?;
    d.set_item("blocks", s.blocks)?;
    d.set_item("cached_bytes", s.cached_bytes)?;
    d.set_item("largest_free_block", s.largest_free_block)?;
    d.set_item("segments_allocated", s.segments_allocated)?;
    d.set_item("segments_released", s.segments_released)?;
    d.set_item("allocations", s.allocations)?;
    d.set_item("limit", s.limit)?;
    Ok(d)
}

/// The caching allocator of GPU `device` (`None`) or of host memory.
fn allocator_device(device: Option<usize>) -> PyResult<Option<Arc<Device>>> {
    device.map(|d| Device::get(d).map_err(error)).transpose()
}

/// What a caching allocator holds in this process: GPU `device`'s, or the host's (`None`).
#[pyfunction]
#[pyo3(signature = (device=None))]
fn allocator_stats(py: Python<'_>, device: Option<usize>) -> PyResult<Bound<'_, PyDict>> {
    let stats = match allocator_device(device)? {
        Some(dev) => dev.allocator_stats(),
        None => cuda_mp::host_allocator_stats(),
    };
    stats_dict(py, stats)
}

/// The bytes and the number of allocations that PyTorch holds on GPU `device` through
/// cuda-mp's allocator (`cuda_mp.torch.install(allocator=True)`).
#[pyfunction]
fn torch_allocations(device: usize) -> (usize, usize) {
    allocator::held(device)
}

/// `Tensor.record_stream` for PyTorch memory of cuda-mp's allocator at `ptr` on GPU `device`:
/// its free waits for the work queued on `stream` (a `cudaStream_t`) too. False for other memory.
#[pyfunction]
fn allocator_record_stream(device: usize, ptr: u64, stream: usize) -> bool {
    allocator::record_stream(device, ptr, stream)
}

/// Gives a caching allocator's wholly free segments up; the bytes given up.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn empty_cache(device: Option<usize>) -> PyResult<usize> {
    Ok(match allocator_device(device)? {
        Some(dev) => dev.empty_cache(),
        None => cuda_mp::empty_host_cache(),
    })
}

/// Turns a caching allocator on or off in this process.
#[pyfunction]
#[pyo3(signature = (enabled, device=None))]
fn set_caching(enabled: bool, device: Option<usize>) -> PyResult<()> {
    match allocator_device(device)? {
        Some(dev) => dev.set_caching(enabled),
        None => cuda_mp::set_host_caching(enabled),
    }
    Ok(())
}

/// Chooses the memory of GPU `device`'s new caching-allocator segments in this process:
/// "auto" (the default: VMM where the device has it), "vmm" or "legacy".
#[pyfunction]
fn set_segment_kind(kind: &str, device: usize) -> PyResult<()> {
    let kind: cuda_mp::GpuMemoryKind = kind.parse().map_err(error)?;
    Device::get(device).and_then(|dev| dev.set_segment_kind(kind)).map_err(error)
}

/// Limits the bytes a caching allocator's segments hold (`None`: no limit).
#[pyfunction]
#[pyo3(signature = (limit, device=None))]
fn set_cache_limit(limit: Option<usize>, device: Option<usize>) -> PyResult<()> {
    match allocator_device(device)? {
        Some(dev) => dev.set_cache_limit(limit),
        None => cuda_mp::set_host_cache_limit(limit),
    }
    Ok(())
}

/// The names of the element types cuda-mp knows.
#[pyfunction]
fn dtypes(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    PyList::new(py, DType::ALL.iter().map(|d| d.name()))
}

/// Whether a CUDA GPU is usable in this process.
#[pyfunction]
fn cuda_available() -> bool {
    cuda_mp::cuda_available()
}

/// Waits until every message this process sent has been handed to its receiver's socket (or
/// the receiver is gone), and the releases of what it received have been sent, at most
/// `timeout` seconds (None: as long as it takes), without the GIL, checking for
/// KeyboardInterrupt between slices.
#[pyfunction]
#[pyo3(signature = (timeout=None))]
fn flush_sends(py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
    flush_in_slices(py, timeout, cuda_mp::flush_sends)
}

/// As `flush_sends`, for the messages alone (not the releases): what an exit waits for
/// without limit.
#[pyfunction]
#[pyo3(signature = (timeout=None))]
fn flush_backlogs(py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
    flush_in_slices(py, timeout, cuda_mp::flush_backlogs)
}

fn flush_in_slices(
    py: Python<'_>,
    timeout: Option<f64>,
    flush: impl Fn(Duration) -> cuda_mp::Result<()> + Send + Sync,
) -> PyResult<()> {
    const SLICE: Duration = Duration::from_millis(100);
    let deadline = deadline(seconds(timeout)?);
    loop {
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let slice = left.map_or(SLICE, |l| l.min(SLICE));
        match py.detach(|| flush(slice)) {
            Ok(()) => return Ok(()),
            Err(cuda_mp::Error::Timeout(_)) if left.is_none_or(|l| l > slice) => py.check_signals()?,
            Err(e) => return Err(error(e)),
        }
    }
}

/// Does now what cuda-mp does at a normal exit (`cuda_mp::before_exit`), without the GIL: for
/// a `multiprocessing` worker, which leaves with `os._exit`.
#[pyfunction]
fn before_exit(py: Python<'_>) {
    py.detach(cuda_mp::before_exit);
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Tensor>()?;
    m.add_class::<HandoffBatch>()?;
    m.add_class::<Queue>()?;
    m.add_class::<Connection>()?;
    m.add_function(wrap_pyfunction!(pipe, m)?)?;
    m.add_class::<Bundle>()?;
    m.add_class::<Listener>()?;
    m.add_class::<Receiver>()?;
    m.add_class::<Sender>()?;
    m.add_function(wrap_pyfunction!(gpu_tensor, m)?)?;
    m.add_function(wrap_pyfunction!(host_tensor, m)?)?;
    m.add_function(wrap_pyfunction!(empty_host, m)?)?;
    m.add_function(wrap_pyfunction!(stream_ptr, m)?)?;
    m.add_function(wrap_pyfunction!(wait_for_stream, m)?)?;
    m.add_function(wrap_pyfunction!(pack, m)?)?;
    m.add_function(wrap_pyfunction!(bundle_of, m)?)?;
    m.add_function(wrap_pyfunction!(lifetime_stats, m)?)?;
    m.add_function(wrap_pyfunction!(opened_mappings, m)?)?;
    m.add_function(wrap_pyfunction!(holder_stats, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_to_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_from_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(torch_capsule, m)?)?;
    m.add_function(wrap_pyfunction!(dtypes, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(flush_sends, m)?)?;
    m.add_function(wrap_pyfunction!(flush_backlogs, m)?)?;
    m.add_function(wrap_pyfunction!(before_exit, m)?)?;
    m.add_function(wrap_pyfunction!(allocator_stats, m)?)?;
    m.add_function(wrap_pyfunction!(empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(torch_allocations, m)?)?;
    m.add_function(wrap_pyfunction!(allocator_record_stream, m)?)?;
    m.add_function(wrap_pyfunction!(opened_segments, m)?)?;
    m.add_function(wrap_pyfunction!(set_caching, m)?)?;
    m.add_function(wrap_pyfunction!(set_segment_kind, m)?)?;
    m.add_function(wrap_pyfunction!(set_cache_limit, m)?)?;
    torch_ipc::register(m)?;
    Ok(())
}
