"""cuda_mp: PyTorch and NumPy tensors between processes without copies.

A CUDA tensor crosses as the IPC handle of its allocation (or, for cuda-mp's VMM memory, a file
descriptor); the receiver gets a ``torch.Tensor`` on the same device memory, through DLPack, and
the sender's memory lives until every receiver has dropped what it received. Host arrays cross
through shared memory. Messages are wire-compatible with the Rust crate ``cuda-mp``: a Rust
``Receiver<GpuTensor<bf16>>`` receives a bf16 ``torch.Tensor`` sent here, and the other way round.

    import torch, cuda_mp

    listener = cuda_mp.Listener(cuda_mp.GpuTensor)   # in the receiving process
    print(listener.name)                             # give this name to the sender
    rx = listener.accept(timeout=30)
    t = rx.recv(timeout=10)                          # a torch.Tensor on the sender's memory

    tx = cuda_mp.connect(name, cuda_mp.GpuTensor)    # in the sending process
    tx.send(torch.ones(1024, device="cuda"))
"""

from __future__ import annotations

import operator
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

from . import _native
from ._errors import Disconnected, DTypeError, Error, Malformed, Timeout

__all__ = [
    "Bundle",
    "DTypeError",
    "Disconnected",
    "Error",
    "GpuTensor",
    "HostTensor",
    "Listener",
    "Malformed",
    "MultiprocessingQueue",
    "Connection",
    "PackedStateDict",
    "Pipe",
    "Queue",
    "Receiver",
    "Sender",
    "Timeout",
    "allocator_stats",
    "channel",
    "connect",
    "cuda_available",
    "empty_cache",
    "empty_host",
    "flush_sends",
    "holder_stats",
    "pack_state_dict",
    "set_cache_limit",
    "set_caching",
    "set_segment_kind",
]


def __dir__():
    # The package's API, not the names it imports for its own use (typing, threading).
    return sorted(__all__)


def __getattr__(name: str):
    # ``cuda_mp.torch`` (torch.multiprocessing through cuda-mp) without importing it first.
    if name == "torch":
        import importlib

        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class GpuTensor:
    """Channel kind: CUDA ``torch.Tensor``s (Rust: ``GpuTensor<T>``)."""

    kind = "gpu"


class HostTensor:
    """Channel kind: host arrays, ``numpy.ndarray`` or CPU ``torch.Tensor`` (Rust: ``HostTensor<T>``)."""

    kind = "host"


class Bundle:
    """Channel kind: ``dict[str, torch.Tensor]`` of CUDA tensors as one message (Rust: ``Bundle``)."""

    kind = "bundle"


def _kind(kind) -> str:
    if isinstance(kind, str) and kind in ("gpu", "host", "bundle"):
        return kind
    k = getattr(kind, "kind", None)
    if k in ("gpu", "host", "bundle"):
        return k
    raise ValueError(f"unknown channel kind {kind!r}: cuda_mp.GpuTensor, cuda_mp.HostTensor or cuda_mp.Bundle")


# --- element types ---------------------------------------------------------------------------

_NUMPY_TO_NAME = {
    "float32": "f32",
    "float64": "f64",
    "float16": "f16",
    "int8": "i8",
    "uint8": "u8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "bool": "bool",
}


_numpy_names_cache: Dict[Any, str] = {}


def _numpy_name(dtype) -> Optional[str]:
    """cuda-mp's name of a NumPy element type, or None: for types cuda-mp lacks, and for a
    byte order other than this machine's (whose bytes a receiver would read otherwise)."""
    if not _numpy_names_cache:
        import numpy as np

        _numpy_names_cache.update({np.dtype(name): short for name, short in _NUMPY_TO_NAME.items()})
    # Keyed by the dtype itself: a non-native byte order is another dtype, and this is a lookup
    # of tens of nanoseconds where ``dtype.name`` takes microseconds.
    return _numpy_names_cache.get(dtype)


_TORCH_NAMES = None


def _torch_names():
    """cuda-mp's name of each torch element type it carries (made once: it is looked up per tensor)."""
    global _TORCH_NAMES
    if _TORCH_NAMES is not None:
        return _TORCH_NAMES
    import torch

    _TORCH_NAMES = {
        torch.float32: "f32",
        torch.float64: "f64",
        torch.float16: "f16",
        torch.bfloat16: "bf16",
        torch.int8: "i8",
        torch.uint8: "u8",
        torch.int16: "i16",
        torch.int32: "i32",
        torch.int64: "i64",
        torch.bool: "bool",
    }
    return _TORCH_NAMES


def _torch_dtype_name(dtype) -> str:
    name = _torch_names().get(dtype)
    if name is None:
        raise DTypeError(f"cuda-mp cannot send {dtype}: its element types are {', '.join(_native.dtypes())}")
    return name


def _is_torch(obj) -> bool:
    t = type(obj)
    return t.__module__.startswith("torch") and hasattr(obj, "untyped_storage")


# --- conversions to cuda-mp tensors -----------------------------------------------------------


_RAW_STREAM: Any = None  # PyTorch's raw current stream function, or False where it lacks it
_FROM_DLPACK: Any = None  # PyTorch's DLPack import of a capsule, or False where it lacks it
_CUDA_READY = False  # PyTorch's CUDA state initialized in this process


def _raw_stream():
    """``torch._C._cuda_getCurrentRawStream`` (the current stream's pointer, no ``Stream``
    object made), or None where this PyTorch lacks it."""
    global _RAW_STREAM
    if _RAW_STREAM is None:
        import torch

        _RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None) or False
    return _RAW_STREAM or None


def _order_after_torch(device_index: int) -> None:
    """Makes cuda-mp's stream wait for PyTorch's current stream (what the sender queued)."""
    raw = _raw_stream()
    if raw is not None:
        # The stream's pointer and one query in cuda-mp: no Stream object per tensor.
        _native.wait_for_stream(device_index, raw(device_index))
        return
    import torch

    current = torch.cuda.current_stream(device_index)
    if current.query():
        return
    ours = torch.cuda.ExternalStream(_native.stream_ptr(device_index), device=torch.device("cuda", device_index))
    ours.wait_stream(current)


def _gpu(t, order: bool = True, keeper=None) -> "_native.Tensor":
    if isinstance(t, _native.Tensor):
        return t
    if not _is_torch(t) or not t.is_cuda:
        raise TypeError(f"a gpu channel sends CUDA torch.Tensors, not {type(t).__name__}")
    device = t.get_device()
    stream = None
    if order:
        raw = _raw_stream()
        if raw is None:
            _order_after_torch(device)
        else:
            stream = raw(device)  # ordered after by the call below
    storage = t.untyped_storage()
    return _native.gpu_tensor(
        device,
        storage.data_ptr(),
        storage.nbytes(),
        _torch_dtype_name(t.dtype),
        t.shape,
        t.stride(),
        t.storage_offset(),
        t if keeper is None else keeper,
        stream,
    )


def _host(a) -> "_native.Tensor":
    if isinstance(a, _native.Tensor):
        return a
    import numpy as np

    if _is_torch(a):
        if a.is_cuda:
            raise TypeError("a host channel sends numpy arrays or CPU tensors; this tensor is on a GPU")
        dtype = _torch_dtype_name(a.dtype)
        c = a.detach().contiguous()  # (numpy() refuses a tensor that requires grad)
        if dtype == "bf16":
            c = c.view(__import__("torch").int16)
        a = c.numpy()
    else:
        a = np.asarray(a)
        if not a.dtype.isnative:
            # Its bytes in this machine's order: the receiver reads them so.
            a = a.astype(a.dtype.newbyteorder("="))
        dtype = _numpy_name(a.dtype)
        if dtype is None:
            raise DTypeError(f"cuda-mp cannot send numpy {a.dtype}: its element types are {', '.join(_native.dtypes())}")
    shared = _shared_array(a, dtype)
    if shared is not None:
        return shared
    data = np.ascontiguousarray(a).tobytes()
    return _native.host_tensor(dtype, list(a.shape), [], 0, 0, 0, data)


def _shared_array(a, dtype: str) -> Optional["_native.Tensor"]:
    """The NumPy array ``a`` (of cuda-mp's element type ``dtype``) as itself when its memory is
    cuda-mp's (received, or from ``empty_host``), else None."""
    itemsize = a.dtype.itemsize
    if not all(s >= 0 and s % itemsize == 0 for s in a.strides):
        return None
    # A view that does not start on an element's boundary of its memory is copied.
    address = a.__array_interface__["data"][0]  # (a dict made per access: read once)
    if address % itemsize != 0:
        return None
    span = (sum((n - 1) * s for n, s in zip(a.shape, a.strides)) + itemsize) if a.size else 0
    strides = [s // itemsize for s in a.strides]
    return _native.host_tensor(dtype, list(a.shape), strides, 0, address, span)


class PackedStateDict(dict):
    """A state dict whose tensors are views of one cuda-mp allocation (see ``pack_state_dict``):
    sent on a ``Bundle`` channel as that allocation, one handle for all of it; update the
    tensors in place and send again to re-publish (a send refuses a dict whose entries were
    replaced, added or taken out, or pointed at other memory with ``.data =`` or ``set_``: it
    would send the packed memory all the same; a view reshaped in place, ``t_()`` or
    ``resize_``, is not caught, and arrives as packed)."""

    def __init__(self, native_bundle: "_native.Bundle", tensors: Dict[str, Any]):
        super().__init__(tensors)
        self._bundle = native_bundle
        self._views = dict(tensors)
        # Each view's address as packed: `.data = new` or `set_(...)` on the view itself keeps the
        # object but points it elsewhere, and the send would carry the packed memory all the same.
        self._addresses = [t.data_ptr() for t in tensors.values()]

    @property
    def allocations(self) -> int:
        return self._bundle.allocations()

    def _check_unchanged(self) -> None:
        """Raises where an entry was replaced, added or taken out: what is sent is the packed
        allocation, whatever the dict now holds."""
        views = self.__dict__.get("_views")
        if views is None:
            return  # (made by unpickling, without its views)
        addresses = self.__dict__["_addresses"]
        # Every entry still the very tensor packed, under its name, in the same order, at its
        # address: passes in C (the entry-by-entry check below costs about 3 us an entry, 1 ms
        # for 7B weights).
        if (
            len(self) == len(views)
            and all(map(operator.is_, dict.values(self), views.values()))
            and all(map(operator.eq, dict.keys(self), views.keys()))
            and list(map(_data_ptr(), dict.values(self))) == addresses
        ):
            return
        if self.keys() != views.keys():
            raise ValueError(
                "entries were added to or taken out of this packed state dict: it sends the memory it "
                "packed; pack the new state dict (pack_state_dict) to send other entries"
            )
        for (name, view), address in zip(views.items(), addresses):
            t = dict.__getitem__(self, name)
            if t is view and t.data_ptr() != address:
                raise ValueError(
                    f"entry {name!r} of this packed state dict no longer views the packed memory (`.data =` "
                    f"or `set_` pointed it elsewhere): it sends the memory it packed; copy into the packed "
                    f"tensor instead (packed[{name!r}].copy_(new))"
                )
            if t is not view and not (_same_view(t, view) and t.data_ptr() == address):
                raise ValueError(
                    f"entry {name!r} of this packed state dict was replaced: it sends the memory it packed; "
                    f"copy into the packed tensor instead (packed[{name!r}].copy_(new))"
                )


def _data_ptr():
    """``torch.Tensor.data_ptr``, unbound: one C call per tensor in a ``map``."""
    import torch

    return torch.Tensor.data_ptr


def _same_view(t, view) -> bool:
    """Whether the tensor ``t`` is a view of the same memory as ``view``, in the same layout."""
    return (
        _is_torch(t)
        and t.device == view.device
        and t.dtype == view.dtype
        and t.data_ptr() == view.data_ptr()
        and t.shape == view.shape
        and t.stride() == view.stride()
    )


def pack_state_dict(state_dict: Dict[str, Any], device=None, chunk_bytes: Optional[int] = None) -> PackedStateDict:
    """Copies ``state_dict`` (name -> CUDA, CPU or meta tensor) into one cuda-mp allocation on
    ``device`` (default: the first tensor's GPU) and gives back views of it by the same names
    (zeros for meta tensors: pack a model built on the meta device, then load into the views).
    Train on, or copy into, these views; sending the result on a ``Bundle`` channel sends one
    handle, and a receiver of a re-publish opens nothing."""
    import torch

    if not state_dict:
        raise ValueError("an empty state dict")
    first = next(iter(state_dict.values()))
    if device is None:
        device = first.device if first.is_cuda else torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    entries = [(name, _torch_dtype_name(t.dtype), list(t.shape)) for name, t in state_dict.items()]
    native = _native.pack(index, entries, chunk_bytes)
    views = {}
    with torch.cuda.device(index):
        for name, t in state_dict.items():
            view = torch.from_dlpack(native.get(name))
            if t.device.type != "meta":  # meta tensors give shapes only: their views stay zero
                view.copy_(t)
            views[name] = view
    return PackedStateDict(native, views)


def _bundle(d) -> "_native.Bundle":
    if isinstance(d, _native.Bundle):
        return d
    if isinstance(d, PackedStateDict):
        d._check_unchanged()
        index = next(iter(d.values())).device.index or 0
        _order_after_torch(index)
        return d._bundle
    if not isinstance(d, dict):
        raise TypeError(f"a bundle channel sends a dict of CUDA tensors, not {type(d).__name__}")
    ordered = set()
    entries = []
    for name, t in d.items():
        if not isinstance(name, str):
            raise TypeError(f"bundle names are strings, not {type(name).__name__}")
        if _is_torch(t) and t.is_cuda and t.device.index not in ordered:
            _order_after_torch(t.device.index or 0)
            ordered.add(t.device.index)
        entries.append((name, _gpu(t, order=False)))
    return _native.bundle_of(entries)


# --- conversions from cuda-mp tensors ---------------------------------------------------------


def _to_torch(t: "_native.Tensor"):
    import torch

    device = t.device
    if device is None:
        # (torch has no read-only tensors: an in-place operation on a whole tensor whose
        # elements repeat fails there, but a write to one element goes through)
        return torch.from_numpy(_numpy_view(t)) if t.dtype != "bf16" else _host_bf16(t)
    global _FROM_DLPACK, _CUDA_READY
    if _FROM_DLPACK is None:
        _FROM_DLPACK = getattr(torch._C, "_from_dlpack", None) or False
    if not _FROM_DLPACK or _raw_stream() is None:
        with torch.cuda.device(device):
            return torch.from_dlpack(t)
    if not _CUDA_READY:
        torch.cuda._lazy_init()  # (PyTorch's current stream is read in the call below)
        _CUDA_READY = True
    # What torch.from_dlpack does, in one call and without its Stream object per tensor: the
    # capsule orders PyTorch's current stream after cuda-mp's.
    return _FROM_DLPACK(_native.torch_capsule(t))


def _host_bf16(t):
    import torch

    return torch.from_dlpack(t)


def _numpy_view(t: "_native.Tensor"):
    import numpy as np

    if t.dtype == "bf16":
        error = DTypeError("numpy has no bfloat16: receive with as_torch=True (the tensor is the error's `received`)")
        # The message is off the channel already: it goes with the error, not lost.
        error.received = t
        raise error
    return np.from_dlpack(t)


def _to_numpy(t: "_native.Tensor"):
    a = _numpy_view(t)
    if not (a.flags.c_contiguous or a.flags.f_contiguous) and _overlaps(a):
        # Elements that stand in several places (a broadcast view, a sliding window):
        # read-only, as NumPy makes such views itself, so that one write cannot change them all.
        a.flags.writeable = False
    return a


def _overlaps(a) -> bool:
    """Whether two places of the view ``a`` (strides not negative) may be the same memory:
    each stride, smallest first, must pass the span of the dimensions before it. Cautious:
    some interleaved layouts (made with ``as_strided``) whose places all differ fail it too,
    and arrive read-only (a copy of them is writable)."""
    span = a.itemsize
    for stride, n in sorted((s, n) for n, s in zip(a.shape, a.strides) if n > 1):
        if stride < span:
            return True
        span += stride * (n - 1)
    return False


def _host_leaf(t: "_native.Tensor"):
    """A host tensor in a queue's item: a NumPy array; bf16, which NumPy lacks, as a
    ``torch.Tensor`` (or cuda-mp's own tensor where torch is missing)."""
    if t.dtype != "bf16":
        return _to_numpy(t)
    try:
        return _host_bf16(t)
    except ImportError:
        return t


# --- channels ---------------------------------------------------------------------------------


class Receiver:
    """The receiving end of a channel. ``recv`` gives ``torch.Tensor`` (gpu channels),
    ``numpy.ndarray`` (host channels; ``torch.Tensor`` with ``as_torch=True``) or
    ``dict[str, torch.Tensor]`` (bundle channels), all on the sender's memory."""

    def __init__(self, native, kind: str, as_torch: bool = False):
        self._native = native
        self.kind = kind
        self.as_torch = as_torch

    def recv(self, timeout: Optional[float] = None, raw: bool = False):
        """The next message; waits at most ``timeout`` seconds (None: for ever). Raises
        ``Timeout``, ``Disconnected`` (the sender is gone and nothing is left), ``Malformed``,
        ``DTypeError`` (a bf16 host tensor, which NumPy lacks: the tensor is its ``received``).
        ``raw=True`` gives cuda-mp's own objects (``_native.Tensor`` / ``_native.Bundle``)."""
        got = self._native.recv(timeout)
        if raw:
            return got
        if self.kind == "gpu":
            return _to_torch(got)
        if self.kind == "host":
            return _to_torch(got) if self.as_torch else _to_numpy(got)
        return {name: _to_torch(got.get(name)) for name in got.names()}

    def __iter__(self) -> Iterator[Any]:
        """Messages until the sender is gone (other errors are raised)."""
        while True:
            try:
                yield self.recv()
            except Disconnected:
                return

    def __reduce__(self):
        # The end moves: the process that unpickles it (once, within HANDLE_TTL) receives from
        # then on, and this one no more.
        from .queue import HANDLE_TTL

        return (_unpickle_receiver, (self._native.to_bytes(HANDLE_TTL), self.kind, self.as_torch))


def _unpickle_receiver(data: bytes, kind: str, as_torch: bool) -> "Receiver":
    return Receiver(_native.Receiver.from_bytes(kind, data), kind, as_torch)


class Sender:
    """The sending end of a channel."""

    def __init__(self, native, kind: str):
        self._native = native
        self.kind = kind

    def send(self, value) -> None:
        """Sends a CUDA ``torch.Tensor`` (gpu channels), a ``numpy.ndarray`` or CPU tensor
        (host channels: copied into shared memory unless it is cuda-mp's already), or a
        ``dict[str, torch.Tensor]`` (bundle channels; a ``PackedStateDict`` goes as its one
        allocation). The sender's CUDA memory stays alive, and the tensor referenced, until every
        receiver has dropped it. Raises ``Disconnected`` when the receiver is gone."""
        if self.kind == "gpu":
            self._native.send(_gpu(value))
        elif self.kind == "host":
            self._native.send(_host(value))
        else:
            self._native.send(_bundle(value))

    def __reduce__(self):
        # A copy of the end: both send on the same channel (read once, within HANDLE_TTL).
        from .queue import HANDLE_TTL

        return (_unpickle_sender, (self._native.to_bytes(HANDLE_TTL), self.kind))


def _unpickle_sender(data: bytes, kind: str) -> "Sender":
    return Sender(_native.Sender.from_bytes(kind, data), kind)


class Listener:
    """A name one sender connects to; ``accept`` gives the receiving end."""

    def __init__(self, kind=GpuTensor, as_torch: bool = False):
        self.kind = _kind(kind)
        self._native = _native.Listener(self.kind)
        self._as_torch = as_torch

    @property
    def name(self) -> str:
        return self._native.name

    def accept(self, timeout: Optional[float] = None) -> Receiver:
        """Waits at most ``timeout`` seconds for the sender; once per listener."""
        return Receiver(self._native.accept(timeout), self.kind, self._as_torch)


def connect(name: str, kind=GpuTensor) -> Sender:
    """Connects to the listener called ``name`` (in this or another process, Python or Rust)."""
    k = _kind(kind)
    return Sender(_native.Sender.connect(name, k), k)


class _LazySender(Sender):
    """The sending end of ``channel()``: pickles as the listener's name and connects on first
    use, in whichever process uses it (one process only)."""

    def __init__(self, name: str, kind: str):
        self._name = name
        self.kind = kind
        self._native = None
        self._lock = threading.Lock()

    def __reduce__(self):
        return (_LazySender, (self._name, self.kind))

    def send(self, value) -> None:
        with self._lock:
            if self._native is None:
                self._native = _native.Sender.connect(self._name, self.kind)
        super().send(value)


class _LazyReceiver(Receiver):
    def __init__(self, listener: Listener, accept_timeout: float):
        self._listener = listener
        self._accept_timeout = accept_timeout
        self.kind = listener.kind
        self.as_torch = listener._as_torch
        self._native = None
        self._accepting = threading.Lock()

    def recv(self, timeout: Optional[float] = None, raw: bool = False):
        if self._native is None:
            # The sender's connection and its first message share the one limit; a thread that
            # comes while another accepts waits for that accept.
            deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
            if not self._accepting.acquire(timeout=-1 if deadline is None else max(timeout, 0.0)):
                raise Timeout("timed out waiting for the channel's sender to connect")
            try:
                if self._native is None:
                    left = self._accept_timeout if deadline is None else max(0.0, deadline - time.monotonic())
                    self._native = self._listener._native.accept(left)
            finally:
                self._accepting.release()
            if deadline is not None:
                timeout = max(0.0, deadline - time.monotonic())
        return super().recv(timeout, raw)

    def __reduce__(self):
        if self._native is None:
            raise TypeError(
                "the receiver of channel() stays in the process that made it until its sender has connected "
                "(its first recv); to hand a receiving end to a child, use a Listener there, cuda_mp.Queue, "
                "or pickle the receiver after its first recv"
            )
        return super().__reduce__()


def channel(kind=GpuTensor, as_torch: bool = False, accept_timeout: float = 60.0) -> Tuple[Sender, Receiver]:
    """A channel for a process this one starts (``multiprocessing``, ``torch.multiprocessing``):
    pass the sender to the child (it pickles as a name and connects on first use); the receiver
    stays here. The sender must connect within ``accept_timeout`` seconds of the first ``recv``."""
    listener = Listener(kind, as_torch)
    return _LazySender(listener.name, listener.kind), _LazyReceiver(listener, accept_timeout)


def empty_host(shape, dtype="float32"):
    """A zeroed ``numpy.ndarray`` in shared memory: sent on a host channel without a copy, and
    a receiver's writes are seen here."""
    import numpy as np

    dtype = np.dtype(dtype)
    if isinstance(shape, int):
        shape = (shape,)
    count = 1
    for n in shape:
        count *= n
    raw = np.from_dlpack(_native.empty_host(count * dtype.itemsize))
    return raw.view(dtype).reshape(shape)


def cuda_available() -> bool:
    """Whether a CUDA GPU is usable in this process."""
    return _native.cuda_available()


def allocator_stats(device: Optional[int] = None) -> Dict[str, Any]:
    """What cuda-mp's caching allocator holds in this process: GPU ``device``'s, or (``None``)
    the host's, whose segments ``empty_host`` arrays are cut from. Keys: ``segments``,
    ``reserved_bytes``, ``allocated_bytes`` (blocks handed out, here or still held by another
    process), ``blocks``, ``cached_bytes``, ``largest_free_block``, ``segments_allocated``,
    ``segments_released``, ``allocations``, ``limit``. PyTorch's own allocator is not counted:
    ``torch.cuda.memory_stats`` is."""
    return _native.allocator_stats(device)


def holder_stats() -> List[Dict[str, int]]:
    """What other processes hold of this process's tensors (CUDA and host, sent through
    cuda-mp), per lease they hold them through (on a channel or queue, one per connection):
    dicts of ``lease``, ``storages``, ``claims`` and ``bytes``, most bytes first. Who keeps
    this process's memory alive."""
    return _native.holder_stats()


def empty_cache(device: Optional[int] = None) -> int:
    """Gives the caching allocator's wholly free segments up (GPU ``device``'s, or the host's);
    returns their bytes. Each is freed once no other process maps it any more."""
    return _native.empty_cache(device)


def set_segment_kind(kind: str, device: int = 0) -> None:
    """Chooses the memory of GPU ``device``'s new caching-allocator segments in this process:
    ``"auto"`` (the default: VMM memory where the device has it, so a tensor outlives a
    producer that exits before its receivers mapped it), ``"vmm"`` or ``"legacy"`` (what
    PyTorch's own CUDA sharing opens: needed for ``cuda_mp.torch_handles.to_torch_args`` of
    tensors this process allocated)."""
    _native.set_segment_kind(kind, device)


def set_caching(enabled: bool, device: Optional[int] = None) -> None:
    """Turns the caching allocator of GPU ``device`` (or of host memory) on, the default, or off
    (one allocation per tensor) in this process."""
    _native.set_caching(enabled, device)


def set_cache_limit(limit: Optional[int], device: Optional[int] = None) -> None:
    """Limits the bytes the caching allocator's segments hold (``None``: no limit); an
    allocation past it raises ``cuda_mp.Error``."""
    _native.set_cache_limit(limit, device)


def flush_sends(timeout: Optional[float] = None) -> None:
    """Waits until every message this process sent has been handed to its receiver (or the
    receiver is gone), at most ``timeout`` seconds (None: as long as it takes); raises
    ``Timeout``. Sends never wait for the reader, so a process whose reader is behind holds a
    backlog; a process that exits normally waits for it by itself, and so does a
    ``multiprocessing`` child (a child of the ``fork`` start method ends with ``os._exit``,
    which skips that), through the exit finalizer this package registers. As with
    ``torch.multiprocessing`` queues, a parent that joins such a child before reading what it
    sent waits for ever once the child's backlog is more than the socket holds: read first.
    Then it waits, within the same limit, until the releases of what this process received and
    dropped have been sent (``Timeout`` while their owner does not read them: stopped)."""
    _native.flush_sends(timeout)


def _before_exit_of_worker() -> None:
    """In a ``multiprocessing`` worker of the ``fork`` or ``forkserver`` start method, which
    leaves with ``os._exit`` and so skips the exit hooks of the C library: what cuda-mp does at
    a normal exit (``_native.before_exit``), once the worker's other threads have ended (the
    worker joins them after its finalizers, just before ``os._exit``: the call follows that
    join). Elsewhere nothing: the main process and ``spawn`` workers end with a normal exit,
    whose hooks run after every Python one."""
    import multiprocessing
    import threading

    if multiprocessing.parent_process() is None:
        return
    # A `multiprocessing.Process` of the default context (`torch.multiprocessing.Process`, as
    # DataLoader workers are) records no start method of its own: the context's then, and where
    # none was ever set the child was forked (a spawned child is told its parent's).
    method = (
        getattr(multiprocessing.current_process(), "_start_method", None)
        or multiprocessing.get_start_method(allow_none=True)
        or "fork"
    )
    if method not in ("fork", "forkserver"):
        return
    join_threads = getattr(threading, "_shutdown", None)
    if join_threads is None:
        _native.before_exit()
        return

    def join_threads_then_finish():
        join_threads()
        _native.before_exit()

    threading._shutdown = join_threads_then_finish


class _ExitFlush:
    """Registers the ``multiprocessing`` finalizers that finish this process's part when it
    ends: ``multiprocessing`` runs its finalizers as a worker ends, also where the worker then
    leaves with ``os._exit`` and skips every other exit hook. First this process's backlogs are
    handed on; last, after ``multiprocessing``'s queues have flushed their feeders (priority
    -5), what makes the rest of what cuda-mp does at exit (its GPU events' files in
    ``/dev/shm`` among it) follow the join of the worker's threads. A forked child gets its own
    (a fork clears the finalizers it inherited)."""

    def __init__(self):
        import multiprocessing.util as util

        self._util = util
        self._register()
        util.register_after_fork(self, _ExitFlush._register)

    def _register(self):
        # The messages alone: the releases wait (a minute at most) in the exit hooks, which
        # `before_exit` runs too, so that an owner that does not read them (stopped) holds no
        # exit for ever.
        self._util.Finalize(None, _native.flush_backlogs, exitpriority=0)
        self._util.Finalize(None, _before_exit_of_worker, exitpriority=-10)


_EXIT_FLUSH = _ExitFlush()


from .queue import Connection, MultiprocessingQueue, Pipe, Queue  # noqa: E402  (they use the helpers above)
