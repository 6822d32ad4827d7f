"""``cuda_mp.Queue`` and ``cuda_mp.Pipe``: a queue and a two-way pipe of any picklable objects
between processes, whose tensors travel as shared memory instead of inside the pickle.

    import multiprocessing as mp
    import cuda_mp

    q = cuda_mp.Queue()                      # served by this process: it outlives the workers
    p = mp.get_context("spawn").Process(target=work, args=(q,))
    q.put({"step": 3, "weights": model_weights})   # CUDA tensors: no copy
    item = q.get(timeout=10)

It is the Rust crate's ``Queue`` of ``cuda_mp::Value``: many producers and consumers in many
processes (handles pickle to children of every start method), each item delivered to exactly one
consumer, an item whose consumer died before taking it delivered to another, no feeder thread.
Tensors are never copied: CUDA ``torch.Tensor`` s (and ``nn.Parameter`` s) and CPU tensors and
NumPy arrays in cuda-mp memory (``cuda_mp.empty_host``, or received) travel as cuda-mp records,
so the consumer gets the same memory. An object made only of ``None``, ``bool``, ``int`` (64
bits), ``float``, ``str``, ``bytes``, ``list``, ``tuple``, ``dict``, CUDA tensors and cuda-mp
NumPy arrays travels as a ``Value`` tree that Rust processes read too (a Rust process takes a
handle from ``Queue.to_bytes()`` with ``cuda_mp::from_bytes``); any other object is pickled as
``multiprocessing.Queue`` pickles it, its shareable tensors left out of the pickle and carried
beside it (ordinary NumPy arrays are copied into the pickle).

What differs from ``multiprocessing.Queue``: the queue lives in the process that created it (its
exit ends the queue: gets then raise ``cuda_mp.Disconnected``, puts too); a pickled handle waits
for its one reader at most ``HANDLE_TTL`` seconds; ``get`` raises ``queue.Empty`` when nothing
came in time, as ``multiprocessing`` does.

``Pipe()`` gives two ``Connection`` s, each sending to the other, as ``multiprocessing.Pipe()``
does, with the same pickling of their objects; an end pickled to a child moves there (the
pickling process receives no more on it, and may still send: its copy of the sending half). A
write-only end (``Pipe(duplex=False)``'s writer) pickles as a copy of its sending half alone,
so it may go to many children.
"""

from __future__ import annotations

import io
import multiprocessing as _mp
import multiprocessing.context as _mpc
import pickle
import sys
import queue as _queue
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any, List, Optional

from . import _native, _host_leaf, _is_torch, _to_numpy, _to_torch
from ._errors import Disconnected, Timeout

__all__ = ["HANDLE_TTL", "Connection", "MultiprocessingQueue", "Pipe", "Queue"]

HANDLE_TTL = 600.0
"""Seconds that a pickled queue handle waits for the process that unpickles it."""


class _TensorsOut(ForkingPickler):
    """Pickles an item as ``multiprocessing`` does (its reductions of connections, sockets and
    the like included), leaving the tensors that cuda-mp carries out (``persistent_id``). A
    tensor met twice travels once and arrives as one object (pickle asks ``persistent_id``
    before its memo): tied weights stay tied."""

    def __init__(self, file):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.tensors: List[Any] = []
        # By id(): the name given to each object left out, and the object (alive, so that its
        # id is not another's while the item is pickled).
        self._left_out = {}

    def persistent_id(self, obj):
        known = self._left_out.get(id(obj))
        if known is not None:
            return known[0]
        if _is_torch(obj):
            pid = self._torch(obj)
        elif isinstance(obj, _native.Tensor):  # (as a bf16 host tensor arrives where torch is missing)
            self.tensors.append(obj)
            pid = ("native", len(self.tensors) - 1)
        elif type(obj).__name__ == "ndarray" and type(obj).__module__ == "numpy":
            pid = self._numpy(obj)
        else:
            return None
        if pid is not None:
            self._left_out[id(obj)] = (pid, obj)
        return pid

    def _torch(self, t):
        import torch

        from .torch import _ours

        if not isinstance(t, torch.Tensor) or (t.requires_grad and not t.is_leaf):
            return None  # pickled by torch (which refuses a non-leaf that requires grad)
        native = _ours(t)
        if native is None:
            return None
        self.tensors.append(native)
        return ("torch", len(self.tensors) - 1, isinstance(t, torch.nn.Parameter), t.requires_grad)

    def _numpy(self, a):
        from . import _numpy_name, _shared_array

        dtype = _numpy_name(a.dtype)
        native = _shared_array(a, dtype) if dtype is not None and a.size else None
        if native is None:
            return None  # not cuda-mp memory: copied into the pickle
        self.tensors.append(native)
        return ("numpy", len(self.tensors) - 1)


class _TensorsIn(pickle.Unpickler):
    """Unpickles an item, putting back the tensors that travelled beside it."""

    def __init__(self, data: bytes, tensors: List[Any]):
        super().__init__(io.BytesIO(data))
        self.tensors = tensors
        self._made = {}

    def persistent_load(self, pid):
        made = self._made.get(pid)
        if made is None:
            made = self._made[pid] = self._make(pid)
        return made

    def _make(self, pid):
        if pid[0] == "native":
            t = self.tensors[pid[1]]
            return _host_leaf(t) if t.device is None else _gpu_leaf(t)
        if pid[0] == "numpy":
            return _to_numpy(self.tensors[pid[1]])
        _, index, parameter, requires_grad = pid
        import torch

        t = _to_torch(self.tensors[index])
        if parameter:
            return torch.nn.Parameter(t, requires_grad=requires_grad)
        return t.requires_grad_(requires_grad) if requires_grad else t


def _dumps(obj: Any):
    """``obj`` pickled with its tensors left out, and those tensors."""
    out = io.BytesIO()
    pickler = _TensorsOut(out)
    pickler.dump(obj)
    return out.getvalue(), pickler.tensors


def _leaf(obj, ordered: Optional[set] = None):
    """The cuda-mp tensor that ``obj`` travels as inside a value (see ``cuda_mp::Value``): a CUDA
    ``torch.Tensor`` (not a subclass, no gradient), a NumPy array in cuda-mp memory, or cuda-mp's
    own tensor (as a bf16 host tensor arrives where torch is missing); None for anything else
    (the object is then pickled). ``ordered``: the devices whose current PyTorch stream
    cuda-mp's stream was ordered after for this value (see ``_Leaves``)."""
    if isinstance(obj, _native.Tensor):
        return obj
    if _is_torch(obj):
        import torch

        from .torch import _ours

        if type(obj) is not torch.Tensor or obj.requires_grad or not obj.is_cuda:
            return None
        if ordered is None:
            return _ours(obj)
        device = obj.get_device()
        first = device not in ordered
        native = _ours(obj, order=first)
        if native is not None and first:
            ordered.add(device)
        return native
    if type(obj).__name__ == "ndarray" and type(obj).__module__ == "numpy":
        from . import _numpy_name, _shared_array

        dtype = _numpy_name(obj.dtype)
        return _shared_array(obj, dtype) if dtype is not None and obj.size else None
    return None


class _Leaves:
    """``_leaf`` for the leaves of one value: its CUDA tensors order cuda-mp's stream after
    PyTorch's current stream once per device, at the first. Nothing else runs between them:
    the walk of a value (exact lists, tuples, dicts and plain types) calls no code of the
    program, so no work can be queued in between."""

    __slots__ = ("ordered",)

    def __init__(self):
        self.ordered: set = set()

    def __call__(self, obj):
        return _leaf(obj, self.ordered)


def _gpu_leaf(t):
    """A GPU tensor of a value: a CUDA ``torch.Tensor`` where torch is installed."""
    try:
        return _to_torch(t)
    except ImportError:
        return t


def _unpickle(data: bytes, tensors):
    return _TensorsIn(data, tensors).load()


_MAKERS = (_gpu_leaf, _host_leaf, _unpickle)


class Queue:
    """A queue of picklable objects for many producers and consumers in many processes; see the
    module's text. Create it in the process that outlives the others.

    As with ``multiprocessing``, an item goes to a consumer only in its ``get``. ``prefetch=n``
    lets each consumer's gets keep ``n`` items asked for ahead (fewer round trips to the
    queue's process, for many small items): those go to that consumer even if it stops
    getting, so leave it 0 where a consumer may stop or be slow. A pickled handle keeps it."""

    def __init__(self, prefetch: int = 0, _native_queue: Optional["_native.Queue"] = None):
        self._native = _native_queue if _native_queue is not None else _native.Queue(prefetch)
        self._closed = False

    def put(self, obj: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        """Puts ``obj`` (never waits: the queue has no bound; ``block`` and ``timeout`` are
        accepted as ``multiprocessing.Queue`` takes them). Raises ``ValueError`` once this
        handle is closed."""
        self._check_open()
        if not self._native.put(obj, _Leaves()):
            self._native.put_pickled(*_dumps(obj))

    def put_nowait(self, obj: Any) -> None:
        self.put(obj)

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        """The next item; waits at most ``timeout`` seconds (None: for ever; ``block=False``: not
        at all), then raises ``queue.Empty``. Raises ``cuda_mp.Disconnected`` once the queue's
        process is gone and nothing is left, ``ValueError`` once this handle is closed."""
        self._check_open()
        try:
            return self._native.get(timeout if block else 0.0, *_MAKERS)
        except Timeout as e:
            raise _queue.Empty from e

    def get_nowait(self) -> Any:
        return self.get(block=False)

    def full(self) -> bool:
        """False: the queue has no bound."""
        return False

    def close(self) -> None:
        """This process puts and gets no more through this handle. What it put is handed on
        when it exits, as ``multiprocessing``'s feeder thread does."""
        self._closed = True

    def join_thread(self) -> None:
        """Waits until everything this process sent has reached its reader (there is no feeder
        thread; this waits for the process's messages, as ``cuda_mp.flush_sends`` does, but
        not for its releases). Only after ``close``, as in ``multiprocessing``."""
        if not self._closed:
            raise AssertionError(f"Queue {object.__repr__(self)} not closed")
        _native.flush_backlogs(None)

    def cancel_join_thread(self) -> None:
        """Nothing to cancel: there is no feeder thread (what this process sent is handed on at
        exit unless its reader is gone)."""

    def _check_open(self) -> None:
        if self._closed:
            # Not ``repr(self)``, which asks the queue's process for its counts.
            raise ValueError(f"Queue {object.__repr__(self)} is closed")

    def qsize(self, timeout: Optional[float] = None) -> int:
        """Items not yet taken by a get: waiting, or on their way to a consumer that asked
        for them (ahead of its gets, with ``prefetch``). Raises ``cuda_mp.Disconnected`` once
        the queue's process is gone. It asks the queue's process, after a get of another
        thread on this handle lets go of it: ``timeout`` (seconds, None: no limit) bounds both
        waits, then ``cuda_mp.Timeout`` (a stopped process does not answer); Ctrl-C ends a
        wait without limit."""
        backlog, in_flight, _ = self._native.stats(timeout)
        return backlog + in_flight

    def empty(self, timeout: Optional[float] = None) -> bool:
        """Whether ``qsize`` is 0 (``timeout`` as for ``qsize``)."""
        return self.qsize(timeout) == 0

    def to_bytes(self, ttl: float = HANDLE_TTL) -> bytes:
        """This handle as bytes that one process turns into a handle of the same queue within
        ``ttl`` seconds: a Python one with ``Queue.from_bytes``, a Rust one with
        ``cuda_mp::from_bytes::<cuda_mp::Queue<cuda_mp::Value>>`` (what pickling writes)."""
        return self._native.to_bytes(ttl)

    @staticmethod
    def from_bytes(data: bytes) -> "Queue":
        """The handle that ``to_bytes`` made ``data`` of (in Python or Rust); once. Its
        descriptors come from the process that made the bytes, which has 30 s to answer
        (``cuda_mp.Timeout`` then: stopped, say); Ctrl-C ends the wait. Either way the handle
        is lost: a late answer is not taken, and the same bytes do not decode again."""
        return Queue(_native_queue=_native.Queue.from_bytes(data))

    def __reduce__(self):
        return (Queue.from_bytes, (self.to_bytes(),))

    def __repr__(self) -> str:
        # Never waits long: a get of another thread on this handle holds it meanwhile.
        try:
            backlog, in_flight, delivered = self._native.stats(1.0)
        except Disconnected:
            return "cuda_mp.Queue(disconnected)"
        except Timeout:
            return "cuda_mp.Queue(busy)"
        return f"cuda_mp.Queue(waiting={backlog}, in_flight={in_flight}, delivered={delivered})"


class MultiprocessingQueue(Queue):
    """What ``multiprocessing`` makes of ``Queue()`` (of any context, and so of
    ``torch.multiprocessing.Queue()``) after ``cuda_mp.torch.install(queues=True)``: a ``Queue``
    whose puts and gets fail as ``multiprocessing.Queue``'s do once the queue's process is gone
    (below), and that stays one when pickled (never with ``prefetch``)."""

    def __init__(self, _native_queue: Optional["_native.Queue"] = None):
        super().__init__(0, _native_queue)

    @classmethod
    def _from_bytes(cls, data: bytes) -> "MultiprocessingQueue":
        return cls(_native.Queue.from_bytes(data, 0))

    def put(self, obj: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        """As ``Queue.put``; raises ``ValueError`` once this handle is closed. Once the
        queue's process is gone, ``obj`` is dropped: ``multiprocessing``'s put never fails
        for want of a reader (its items wait in a pipe that nobody may ever read), and
        programs written for it, such as a ``DataLoader`` worker whose parent died, find
        out by other means (a watchdog on the parent) rather than from the put."""
        try:
            super().put(obj)
        except Disconnected:
            pass

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        """As ``Queue.get`` (a negative ``timeout`` as 0, as ``multiprocessing`` takes it);
        raises ``ValueError`` once this handle is closed. Once the queue's process is gone
        (or every handle that could put is), a get that may wait ``timeout`` seconds waits
        them all and raises ``queue.Empty``, as ``multiprocessing``'s queue, which nobody fills
        any more, does; one without a timeout raises ``cuda_mp.Disconnected`` where
        ``multiprocessing``'s would wait for ever."""
        if timeout is not None and timeout < 0:
            timeout = 0.0
        start = time.monotonic()
        try:
            return super().get(block, timeout)
        except Disconnected:
            if block and timeout is None:
                raise
            if block:
                time.sleep(max(0.0, timeout - (time.monotonic() - start)))
            raise _queue.Empty from None

    def __reduce__(self):
        return (MultiprocessingQueue._from_bytes, (self.to_bytes(),))


# multiprocessing's own, whatever replaces it later.
_CONTEXT_QUEUE = _mpc.BaseContext.Queue


def _context_queue(ctx, maxsize: int = 0):
    """``BaseContext.Queue`` while queues are replaced: a bounded queue stays
    ``multiprocessing``'s own, since a ``Queue`` has no bound."""
    if maxsize > 0:
        return _CONTEXT_QUEUE(ctx, maxsize)
    return MultiprocessingQueue()


def _replace_multiprocessing_queues(replace: bool) -> None:
    """Makes every ``multiprocessing`` context's ``Queue()`` a ``MultiprocessingQueue`` (or
    ``multiprocessing``'s own again): the contexts' method, and the names that the
    ``multiprocessing`` and ``torch.multiprocessing`` modules bound to the default context's
    method at their import. A name bound elsewhere before (``from multiprocessing import
    Queue``) keeps ``multiprocessing``'s queue. Undoing touches nothing unless ours is in
    place (another library may have set its own since)."""
    if not replace and _mpc.BaseContext.__dict__.get("Queue") is not _context_queue:
        return
    _mpc.BaseContext.Queue = _context_queue if replace else _CONTEXT_QUEUE
    method = _mpc._default_context.Queue
    for name in ("multiprocessing", "torch.multiprocessing"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "Queue", None) is not None:
            module.Queue = method


class Connection:
    """One end of a ``Pipe``: ``send`` to the other end, ``recv`` what it sent. As
    ``multiprocessing``'s, but for ``fileno`` (it has no one descriptor to wait on)."""

    def __init__(self, native: "_native.Connection", readable: bool = True, writable: bool = True):
        self._native = native
        self.readable = readable
        self.writable = writable

    def send(self, obj: Any) -> None:
        """Sends ``obj`` (pickled as a ``Queue`` pickles). Raises ``cuda_mp.Disconnected`` when
        the other end is gone."""
        native = self._open(writing=True)
        if not native.send(obj, _Leaves()):
            native.send_pickled(*_dumps(obj))

    def recv(self, timeout: Optional[float] = None) -> Any:
        """The next object from the other end; waits at most ``timeout`` seconds (None: for
        ever), then raises ``cuda_mp.Timeout``; ``cuda_mp.Disconnected`` (an ``EOFError``)
        once the other end is gone and nothing is left."""
        return self._open(reading=True).recv(timeout, *_MAKERS)

    def send_bytes(self, buf, offset: int = 0, size: Optional[int] = None) -> None:
        """Sends ``size`` bytes of the bytes-like ``buf`` from ``offset`` (all the rest: None)
        as one ``bytes`` object."""
        view = memoryview(buf).cast("B")
        if offset < 0 or offset > len(view):
            raise ValueError("offset is out of bounds")
        end = len(view) if size is None else offset + size
        if size is not None and (size < 0 or end > len(view)):
            raise ValueError("size is out of bounds" if size >= 0 else "size is negative")
        self.send(bytes(view[offset:end]))

    def recv_bytes(self, maxlength: Optional[int] = None) -> bytes:
        """The next object, which ``send_bytes`` (or ``send`` of ``bytes``) sent. Raises
        ``OSError`` for a longer message than ``maxlength``, and ``TypeError`` for one of another
        type; either carries what came as its ``received``: nothing is lost. A negative
        ``maxlength`` raises ``ValueError`` before anything is received, as ``multiprocessing``
        does."""
        if maxlength is not None and maxlength < 0:
            raise ValueError("negative maxlength")
        got = self.recv()
        error = None
        if not isinstance(got, bytes):
            error = TypeError(f"recv_bytes got a {type(got).__name__}, not bytes (the object is the error's `received`)")
        elif maxlength is not None and len(got) > maxlength:
            error = OSError(f"a message of {len(got)} bytes is longer than maxlength (it is the error's `received`)")
        if error is not None:
            error.received = got
            raise error
        return got

    def recv_bytes_into(self, buf, offset: int = 0) -> int:
        """Receives as ``recv_bytes`` into the writable bytes-like ``buf`` from ``offset``, and
        returns how many bytes it wrote. Raises ``multiprocessing.BufferTooShort`` carrying the
        whole message (``args[0]``) when it does not fit, as ``multiprocessing`` does."""
        view = memoryview(buf).cast("B")
        if offset < 0 or offset > len(view):
            raise ValueError("offset is out of bounds")
        got = self.recv_bytes()
        if len(got) > len(view) - offset:
            raise _mp.BufferTooShort(got)
        view[offset : offset + len(got)] = got
        return len(got)

    def poll(self, timeout: Optional[float] = 0.0) -> bool:
        """Whether a ``recv`` would return at once, waiting at most ``timeout`` seconds for an
        object (0: not at all, as ``multiprocessing``'s default; None: for ever). True at the
        end too (the other end gone and nothing left, or this end pickled away), where
        ``recv`` raises at once, as ``multiprocessing``'s ``poll`` says of its ``EOFError``."""
        native = self._open(reading=True)
        try:
            return native.poll(timeout)
        except Disconnected:
            return True

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Lets go of this end here: once every copy of it is closed or gone, the other end's
        ``recv`` raises ``cuda_mp.Disconnected`` after the last object."""
        self._native = None

    @property
    def closed(self) -> bool:
        return self._native is None

    def _open(self, reading: bool = False, writing: bool = False) -> "_native.Connection":
        if self._native is None:
            raise OSError("handle is closed")
        if reading and not self.readable:
            raise OSError("connection is write-only")
        if writing and not self.writable:
            raise OSError("connection is read-only")
        return self._native

    def __reduce__(self):
        return (Connection.from_bytes, (self.to_bytes(), self.readable, self.writable))

    def to_bytes(self, ttl: float = HANDLE_TTL) -> bytes:
        """This end as bytes that one process turns into it within ``ttl`` seconds: a Python one
        with ``Connection.from_bytes``, a Rust one with ``cuda_mp::from_bytes::<(Sender<Value>,
        Receiver<Value>)>`` (what pickling writes). The end moves: this one receives no more.
        A write-only end (``Pipe(duplex=False)``'s writer) is its sending half alone
        (``cuda_mp::from_bytes::<Sender<Value>>``), and may go to many processes."""
        return self._open().to_bytes(ttl, self.readable)

    @staticmethod
    def from_bytes(data: bytes, readable: bool = True, writable: bool = True) -> "Connection":
        """The end that ``to_bytes`` made ``data`` of (in Python or Rust); once."""
        return Connection(_native.Connection.from_bytes(data, readable), readable, writable)


def Pipe(duplex: bool = True):  # noqa: N802  (named as multiprocessing.Pipe)
    """Two ``Connection`` s, each sending to the other; with ``duplex=False``, as
    ``multiprocessing.Pipe(False)``, ``(reader, writer)``: the first only receives, the
    second only sends."""
    a, b = _native.pipe()
    return Connection(a, writable=duplex), Connection(b, readable=duplex)

