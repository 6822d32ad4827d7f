"""torch.multiprocessing programs share CUDA tensors through cuda-mp, unchanged but for one call.

    import torch.multiprocessing as mp
    import cuda_mp.torch

    cuda_mp.torch.install()        # in the parent, before tensors are put on queues
    q = mp.get_context("spawn").Queue()
    q.put(torch.ones(1 << 20, device="cuda"))

``install()`` registers reductions with ``multiprocessing.reduction.ForkingPickler``, the hook that
``torch.multiprocessing`` itself uses, so that every ``multiprocessing`` / ``torch.multiprocessing``
Queue, SimpleQueue, Pipe, Pool argument and result, and ``Process`` argument (spawn and forkserver)
carries:

- CUDA tensors and CUDA storages as cuda-mp records: the receiver maps the same device memory
  (one open per allocation per process, kept while any tensor of it lives there), ordered after
  the work that the sending thread queued on its current stream;
- CPU tensors whose memory cuda-mp made (``cuda_mp.empty_host``, or received from cuda-mp) as
  that shared memory, without a copy.

Every other object (CPU tensors in ordinary memory, sparse tensors, tensor subclasses other than
``nn.Parameter``, element types cuda-mp lacks, empty storages) keeps torch's own reduction.

What changes for the program, against torch's own CUDA sharing:

- The sender's memory lives until the last receiver dropped it, counted by cuda-mp: the sender may
  drop its tensor right after ``put``, and a receiver that is SIGKILLed gives its references back
  at once (torch keeps such memory until the sender exits).
- The bytes on the queue name the memory for ``ttl`` seconds (``install(ttl=...)``, 600 by
  default) and for one receiver: an item still unread after that time, or read twice (a pickle
  loaded two times), fails to load with ``cuda_mp.Malformed`` and its memory is released. The
  sender must be alive when the item is read, as with torch.
- The tensors of one pickle (one item put on a queue, one message on a pipe, a state dict) go
  to one receiver together: it fetches what keeps their memory alive once, at the first tensor
  it loads, and the rest as it loads them. Pickling them into several pickles that go to
  several processes needs one ``ForkingPickler`` dump each, as ``multiprocessing`` does.
- A CUDA storage that was sent keeps its cuda-mp identity for as long as the program holds it,
  so that sending it again (a republish of the same weights) costs its receivers no new
  mapping: the receivers keep theirs while this process holds the storage. cuda-mp's own
  reference on it goes within about a second of the program's last one.
- A process started with spawn or forkserver registers the same reductions when it first loads a
  tensor that came this way (so that what it sends back goes the same way); one that only sends
  calls ``install()`` itself.

``install(allocator=True)`` (in the producer, before its first CUDA tensor) also makes
cuda-mp's caching allocator PyTorch's CUDA allocator in that process
(``torch.cuda.memory.change_current_allocator`` with a ``CUDAPluggableAllocator`` whose two
functions are in cuda-mp's extension). Every CUDA tensor the process makes is then a block of
a segment that cuda-mp exports once (VMM memory where the GPU has it), so that:

- a receiver maps each segment once, for all its blocks: a fresh tensor cut from a segment it
  maps already opens nothing, and a model's weights arrive in a few segments (segments of large
  tensors grow with the pool, up to 1 GiB) instead of one driver open per tensor;
- a tensor's memory stays the sender's until every receiver dropped it, without the book of
  sent storages and the keeper tensors described above: PyTorch's free gives the block back once
  the work queued on its stream is done and no receiver holds it.

What it costs: PyTorch's own caching allocator is not used in that process, so
``torch.cuda.memory_allocated``, ``memory_stats``, ``memory_snapshot`` and the other statistics
of PyTorch's allocator raise (``cuda_mp.allocator_stats(device)`` has cuda-mp's), CUDA graphs
cannot capture allocations, and ``torch.cuda.empty_cache()`` does nothing
(``cuda_mp.empty_cache(device)`` gives the free segments back; cuBLAS keeps its workspace, an
allocation like any other, until ``torch._C._cuda_clearCublasWorkspaces()``). A pluggable allocator cannot
raise: an allocation the device cannot hold, even after the frees waiting for the GPU have run
and the free segments were given back, ends the process with a message on stderr, where
PyTorch's allocator would raise ``torch.cuda.OutOfMemoryError`` (and where PyTorch itself
catches it, as cuDNN's choice of an algorithm by workspace does). Processes started from it with
spawn or forkserver keep PyTorch's allocator unless they call ``install(allocator=True)``
themselves. ``Tensor.record_stream`` is honoured for calls from Python (the allocator frees
the memory after the named streams' work too); PyTorch's C++ callers of it (NCCL process
groups) are not seen, so a tensor used on another stream from there must be kept until that
work is done. A CUDA tensor that cuda-mp cannot carry (an element type it lacks, a tensor
subclass) cannot go through PyTorch's own sharing either in that process: pickling it raises.

The program's queues stay ``multiprocessing``'s own: a feeder thread and a pipe each way, whose
round trip (about 70 us for an int on an H200 host) bounds how much faster a re-sent tensor can
go. ``install(queues=True)`` also makes ``Queue()`` of every ``multiprocessing`` context (so
``torch.multiprocessing.Queue()``, ``mp.get_context("spawn").Queue()``, and a ``DataLoader``'s
worker queues) a ``cuda_mp.MultiprocessingQueue``: cuda-mp's own queue (``cuda_mp.Queue``) with
the rest of ``multiprocessing.Queue``'s methods. What differs then:

- The queue lives in the process that created it (a ``multiprocessing`` queue lives in a pipe).
  When that process is gone, the others' puts drop their items and their gets wait out their
  timeout and raise ``queue.Empty``, as ``multiprocessing``'s do on a pipe nobody fills or
  reads any more; a get without a timeout raises ``cuda_mp.Disconnected`` where
  ``multiprocessing``'s would wait for ever.
- An item is pickled when ``put`` returns, not later by a feeder thread, and an item handed to a
  consumer that died before taking it goes to another consumer.
- Puts of different processes are not ordered with respect to each other: an item put by a
  producer that has since been joined may come after an item the queue's own process puts
  later (``multiprocessing``'s one pipe keeps that order). A program that joins its producers
  and then puts a sentinel per consumer should have each producer put its own sentinel.
- A bounded queue (``Queue(maxsize)``), ``SimpleQueue`` and ``JoinableQueue`` stay
  ``multiprocessing``'s own (``multiprocessing.Pool`` and ``concurrent.futures`` read their
  pipes directly). A name bound before ``install`` (``from multiprocessing import Queue``), and a
  child that makes queues of its own without calling ``install(queues=True)``, keep
  ``multiprocessing``'s queue.
- The queue's handle pickles anywhere, not only to a child being started. It is not an
  instance of ``multiprocessing.queues.Queue``, and its ``join_thread`` waits for every send
  of the process (there is no feeder thread of the queue's own).
"""

from __future__ import annotations

import math
import pickle
import threading
import time
from collections import OrderedDict
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, Optional

from . import _gpu, _native, _to_torch, _torch_names

__all__ = ["DEFAULT_TTL", "allocator_in_use", "install", "installed", "uninstall"]

DEFAULT_TTL = 600.0
"""Seconds that a pickled tensor names its memory for, by default."""

_lock = threading.Lock()
# The batch that the tensors of the pickle being dumped on this thread share (None until its
# first tensor), one per nested dump.
_dumping = threading.local()
# CUDA storages sent, by (device, address, bytes): the cuda-mp tensor that holds the storage's
# wrapper (so that it is found again, with its identity), the storage's address in PyTorch
# (``_cdata``) to read its use count, and a tensor of the entry's own over the storage, which
# keeps that address valid while the entry lives (the wrapper holds the same tensor, unless
# cuda-mp knew the memory already: memory it handed to PyTorch, which the wrapper holds
# instead). A use count of ``_alone`` (what a storage held by one tensor reads) means the
# program holds it no more.
_book: "OrderedDict[tuple, tuple]" = OrderedDict()  # oldest first (see ``_sweep``)
_book_lock = threading.Lock()
_pruner: Optional[threading.Thread] = None
_alone: Optional[int] = None
PRUNE_EVERY = 1.0
"""Seconds between two looks at which sent storages the program still holds."""
# The reductions in place before install(), by class, to restore and to fall back on.
_previous: Dict[type, Optional[Callable]] = {}
_ttl = DEFAULT_TTL


def installed() -> bool:
    """Whether this process's pickles carry CUDA tensors through cuda-mp."""
    return bool(_previous)


def install(ttl: float = DEFAULT_TTL, queues: bool = False, allocator: bool = False) -> None:
    """Registers cuda-mp's reductions for torch tensors and storages with ``ForkingPickler``.
    ``ttl``: seconds that a pickled tensor waits for its receiver. ``queues``: also make every
    ``multiprocessing`` context's ``Queue()`` a ``cuda_mp.MultiprocessingQueue`` (see the module's
    text). ``allocator``: also make cuda-mp's caching allocator PyTorch's CUDA allocator in this
    process (see the module's text); only before this process's first CUDA tensor. Calling it
    again changes ``ttl`` and ``queues``."""
    import torch
    import torch.multiprocessing  # noqa: F401  (torch's reductions first, so that ours replace them)

    from .queue import _replace_multiprocessing_queues

    if not (ttl > 0 and math.isfinite(ttl)):
        raise ValueError("ttl must be a positive, finite number of seconds")
    global _ttl
    with _lock:
        if allocator:
            _use_allocator(torch)
        _ttl = float(ttl)
        _replace_multiprocessing_queues(bool(queues))
        if _previous:
            return
        ours = {
            torch.Tensor: _reduce_tensor,
            torch.nn.Parameter: _reduce_tensor,
            torch.UntypedStorage: _reduce_untyped_storage,
            torch.storage.TypedStorage: _reduce_typed_storage,
        }
        for cls, reduce in ours.items():
            _previous[cls] = ForkingPickler._extra_reducers.get(cls)
            ForkingPickler.register(cls, reduce)
        ForkingPickler.dump = _dump


_allocator_in_use = False


def _use_allocator(torch) -> None:
    """Makes cuda-mp's caching allocator PyTorch's CUDA allocator in this process (under the lock)."""
    global _allocator_in_use
    if _allocator_in_use:
        return
    if not _native.cuda_available():
        raise RuntimeError("install(allocator=True) needs a CUDA GPU and its driver")
    pluggable = torch.cuda.memory.CUDAPluggableAllocator(_native.__file__, "cuda_mp_torch_malloc", "cuda_mp_torch_free")
    try:
        torch.cuda.memory.change_current_allocator(pluggable)
    except RuntimeError as e:
        raise RuntimeError(
            "install(allocator=True) must come before this process's first CUDA tensor: "
            f"PyTorch's own allocator is in use already ({e})"
        ) from None
    # PyTorch's pluggable allocator drops `record_stream` (its hook cannot be set from Python):
    # the allocator is told here, so that a tensor used on another stream is freed after that
    # stream's work too. C++ callers of recordStream (NCCL process groups) are not seen.
    original = torch.Tensor.record_stream

    def record_stream(self, stream):
        pointer = getattr(stream, "cuda_stream", None)
        if self.is_cuda and pointer is not None and self.layout == torch.strided:
            _native.allocator_record_stream(self.device.index or 0, self.untyped_storage().data_ptr(), pointer)
        return original(self, stream)

    record_stream.__doc__ = original.__doc__
    torch.Tensor.record_stream = record_stream
    _allocator_in_use = True


def allocator_in_use() -> bool:
    """Whether PyTorch's CUDA tensors in this process come from cuda-mp's allocator."""
    return _allocator_in_use


def uninstall() -> None:
    """Gives torch's reductions and ``multiprocessing``'s queues back (objects pickled and
    queues made before keep working)."""
    from .queue import _replace_multiprocessing_queues

    with _lock:
        _replace_multiprocessing_queues(False)
        if ForkingPickler.__dict__.get("dump") is _dump:
            del ForkingPickler.dump
        for cls, reduce in _previous.items():
            if reduce is None:
                ForkingPickler._extra_reducers.pop(cls, None)
            else:
                ForkingPickler.register(cls, reduce)
        _previous.clear()
    with _book_lock:
        gone = list(_book.values())
        _book.clear()
    del gone


def _torch_reduction(obj, cls: type):
    """torch's own reduction of ``obj``, registered for ``cls`` before install()."""
    reduce = _previous.get(cls)
    return reduce(obj) if reduce is not None else obj.__reduce_ex__(pickle.DEFAULT_PROTOCOL)


# --- what travels through cuda-mp --------------------------------------------------------------


def _dump(pickler, obj):
    """``ForkingPickler.dump`` (which ``ForkingPickler.dumps`` calls too): the CUDA tensors of one
    pickle share one batch, finished once the pickle is whole (withdrawn if it fails)."""
    stack = _dumping.__dict__.setdefault("stack", [])
    stack.append(None)
    try:
        pickle.Pickler.dump(pickler, obj)
    except BaseException:
        batch = stack.pop()
        if batch is not None:
            batch.withdraw()
        raise
    batch = stack.pop()
    if batch is not None:
        batch.finish()


def _to_bytes(native) -> bytes:
    """``native`` as bytes: in the batch of the pickle being dumped on this thread, if any."""
    stack = getattr(_dumping, "stack", None)
    if not stack:
        return _native.tensor_to_bytes(native, _ttl)
    if stack[-1] is None:
        stack[-1] = _native.HandoffBatch(_ttl)
    return stack[-1].tensor_to_bytes(native)


def _ours(t, order: bool = True) -> Optional["_native.Tensor"]:
    """``t`` as a cuda-mp tensor when it travels through cuda-mp, else None (torch's way).
    ``order``: a CUDA tensor orders cuda-mp's stream after PyTorch's current stream."""
    import torch

    if t.layout != torch.strided or t.dtype not in _torch_names() or t.untyped_storage().nbytes() == 0:
        return None
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return None
    if t.is_cuda:
        return _sent(t, order)
    if t.device.type != "cpu":
        return None
    # CPU memory that cuda-mp made travels as itself; any other keeps torch's sharing, which
    # moves the storage to shared memory in place (what a program that shares a CPU model relies on).
    span = (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size() if t.numel() else 0
    return _native.host_tensor(_torch_names()[t.dtype], list(t.shape), list(t.stride()), 0, t.data_ptr(), span)


def _sent(t, order: bool = True) -> "_native.Tensor":
    """A CUDA tensor as a cuda-mp tensor whose storage keeps one identity while the program
    holds it (see ``_book``); ``order`` as for ``_ours``."""
    import torch

    if _allocator_in_use:
        # Memory of cuda-mp's allocator is a cuda-mp storage already, found by its address.
        return _gpu(t, order)
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    storage = t.untyped_storage()
    key = (t.device.index or 0, storage.data_ptr(), storage.nbytes())
    with _book_lock:
        known = key in _book
    if known or use_count is None:
        return _gpu(t, order)  # the wrapper is found by its address while the book holds it
    keeper = torch.empty((0,), dtype=torch.uint8, device=t.device).set_(storage)
    native = _gpu(t, order, keeper=keeper)
    with _book_lock:
        let_go = _sweep(use_count)
        _book.setdefault(key, (native, storage._cdata, keeper))
        _start_pruner()
    del let_go  # outside the lock, as the pruner does
    return native


SWEEP = 2
"""Oldest entries of the book that each new entry looks at (see ``_sweep``)."""


def _sweep(use_count) -> list:
    """Takes out of the book (under the lock) those of its ``SWEEP`` oldest entries whose storage
    the program holds no more, and moves the others to the back: a program that sends fresh
    tensors lets go of them as fast as it sends them, instead of holding each until the
    pruner's next look (a second's worth of tensors, which PyTorch's allocator could not reuse
    meanwhile). Gives what it took out, to let go of outside the lock."""
    taken = []
    for _ in range(min(SWEEP, len(_book))):
        key, entry = _book.popitem(last=False)  # O(1), where a dict's first key is not
        if _held_no_more(use_count, entry[1]):
            taken.append(entry)
        else:
            _book[key] = entry
    return taken


def _start_pruner() -> None:
    """Starts the thread that lets go of the storages the program holds no more (under the lock)."""
    global _pruner
    if _pruner is None:
        _pruner = threading.Thread(target=_prune_while_any, name="cuda-mp-torch-book", daemon=True)
        _pruner.start()


def _alone_count(use_count) -> int:
    """The use count of a storage that one tensor alone holds, its Python object made: torch
    2.11 counts one reference more than the tensor's for a storage whose Python object exists."""
    import torch

    probe = torch.empty((1,))
    return use_count(probe.untyped_storage()._cdata)


def _held_no_more(use_count, cdata) -> bool:
    """Whether the program holds the booked storage at ``cdata`` no more (under the lock): the
    entry's own tensor holds it, so its address stays valid, and a use count of ``_alone``
    is that tensor's alone."""
    global _alone
    if _alone is None:
        _alone = _alone_count(use_count)
    return use_count(cdata) <= _alone


def _prune_while_any() -> None:
    """Every ``PRUNE_EVERY`` seconds, lets go of the wrappers of storages the program holds no
    more; ends (and says so under the lock) once none is left."""
    global _pruner
    import torch

    use_count = torch._C._storage_Use_Count
    while True:
        time.sleep(PRUNE_EVERY)
        with _book_lock:
            gone = [key for key, entry in _book.items() if _held_no_more(use_count, entry[1])]
            dropped = [_book.pop(key) for key in gone]
            done = not _book
            if done:
                _pruner = None
        del dropped  # outside the lock: letting go of a wrapper may release its memory
        if done:
            return


def _reduce_tensor(t):
    import torch

    cls = torch.nn.Parameter if isinstance(t, torch.nn.Parameter) else torch.Tensor
    native = _ours(t)
    if native is None:
        if t.is_cuda and t.layout == torch.strided and t.untyped_storage().nbytes() > 0:
            _refuse_torch_sharing(f"a CUDA tensor of {t.dtype} ({type(t).__name__})")
        return _torch_reduction(t, cls)
    if t.requires_grad and not t.is_leaf:
        raise RuntimeError(
            "Cowardly refusing to serialize non-leaf tensor which requires_grad, since autograd does not "
            "support crossing process boundaries.  If you just want to transfer the data, call detach() on "
            "the tensor before serializing (e.g., putting it on the queue)."
        )
    data = _to_bytes(native)
    return (_rebuild_tensor, (data, cls is torch.nn.Parameter, t.requires_grad, _ttl))


def _refuse_torch_sharing(what: str) -> None:
    """Raises where PyTorch's own CUDA sharing would be used on cuda-mp's allocator's memory,
    which it cannot share (it would take the handle of the whole segment)."""
    if _allocator_in_use:
        raise RuntimeError(
            f"{what} cannot be shared by PyTorch's own CUDA sharing in a process whose CUDA memory "
            "comes from cuda-mp's allocator (install(allocator=True)); send a tensor of one of "
            "cuda-mp's element types (a plain torch.Tensor or nn.Parameter), or view its bytes "
            "(tensor.view(torch.uint8))"
        )


def _bytes_view(storage):
    """A uint8 tensor over the whole of an untyped storage."""
    import torch

    return torch.empty((0,), dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _reduce_untyped_storage(storage):
    import torch

    if storage.device.type != "cuda" or storage.nbytes() == 0:
        return _torch_reduction(storage, torch.UntypedStorage)
    data = _to_bytes(_sent(_bytes_view(storage)))
    return (_rebuild_untyped_storage, (data, _ttl))


def _reduce_typed_storage(storage):
    import torch

    # Read through the untyped storage, as torch's own reductions do: a TypedStorage's
    # ``device`` and ``nbytes()`` warn of its deprecation, which would then seem to come from
    # the first CPU tensor the program puts on a queue.
    untyped = storage._untyped_storage
    if untyped.device.type != "cuda" or untyped.nbytes() == 0 or type(storage) is not torch.storage.TypedStorage:
        if untyped.device.type == "cuda" and untyped.nbytes() > 0:
            _refuse_torch_sharing(f"a CUDA storage of class {type(storage).__name__}")
        return _torch_reduction(storage, torch.storage.TypedStorage)
    data = _to_bytes(_sent(_bytes_view(untyped)))
    return (_rebuild_typed_storage, (data, storage.dtype, _ttl))


# --- what the receiver runs ---------------------------------------------------------------------


def _joined(ttl: float) -> None:
    """A receiver sends back the way it received."""
    if not installed():
        install(ttl)


def _rebuild_tensor(data: bytes, parameter: bool, requires_grad: bool, ttl: float) -> Any:
    import torch

    _joined(ttl)
    t = _to_torch(_native.tensor_from_bytes(data))
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad) if requires_grad else t


def _rebuild_untyped_storage(data: bytes, ttl: float):
    _joined(ttl)
    return _to_torch(_native.tensor_from_bytes(data)).untyped_storage()


def _rebuild_typed_storage(data: bytes, dtype, ttl: float):
    import torch

    _joined(ttl)
    untyped = _to_torch(_native.tensor_from_bytes(data)).untyped_storage()
    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
