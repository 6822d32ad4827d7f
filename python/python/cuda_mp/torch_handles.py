"""PyTorch's own CUDA IPC handles, both ways, without going through a cuda-mp channel.

``torch.multiprocessing`` shares a CUDA tensor as ``reduce_tensor(t)``: the pair
``(rebuild_cuda_tensor, args)``, where ``args`` holds the view and the eight values of the
storage's ``_share_cuda_()`` (the memory's IPC handle, its reference-counter slot and an
event). This module turns such a reduction, made by a PyTorch process, into a cuda-mp tensor
of this process (:func:`from_torch_reduction`), and a cuda-mp GPU tensor of this process into
the ``args`` that a PyTorch process passes to ``rebuild_cuda_tensor`` (:func:`to_torch_args`,
:func:`rebuild`).

Both sides keep PyTorch's reference counting: a tensor made from a reduction gives its slot
back to PyTorch's producer when it, the arrays made from it and every cuda-mp receiver it was
sent to are gone; memory handed to a PyTorch consumer is kept until that consumer frees it
(``cuda_mp._native.torch_ipc_stats()`` counts what is kept).

PyTorch is imported only when a function needs it.
"""

from . import _native

# cuda-mp's element type names and PyTorch's.
_TORCH_DTYPES = {
    "f32": "float32",
    "f64": "float64",
    "f16": "float16",
    "bf16": "bfloat16",
    "i8": "int8",
    "i16": "int16",
    "i32": "int32",
    "i64": "int64",
    "u8": "uint8",
    "bool": "bool",
}


def _torch_dtype(name):
    """The PyTorch dtype of cuda-mp's element type ``name``."""
    import torch

    from ._errors import DTypeError

    try:
        return getattr(torch, _TORCH_DTYPES[name])
    except KeyError:
        raise DTypeError(f"pytorch has no element type for cuda-mp's {name!r}") from None


def from_torch_reduction(reduced):
    """A cuda-mp tensor of this process from a PyTorch process's CUDA tensor reduction.

    ``reduced`` is what ``torch.multiprocessing.reductions.reduce_tensor(t)`` returned in the
    producer: ``(rebuild_cuda_tensor, args)`` with the 15 ``args`` of ``rebuild_cuda_tensor``.
    The memory is mapped (zero-copy) and ordered after the producer's work; hand it to PyTorch
    with ``torch.from_dlpack``. Rebuild each reduction once: the producer's slot is given back
    once, when the tensor and everything made from it are gone.

    Memory of PyTorch's ``expandable_segments`` allocator cannot be opened: the error says
    so (set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False`` in the producer, or send the
    tensor with cuda-mp).
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        rebuild_fn, args = reduced
    except (TypeError, ValueError):
        raise TypeError("expected the (rebuild_cuda_tensor, args) pair of reduce_tensor") from None
    if rebuild_fn is not rebuild_cuda_tensor:
        name = getattr(rebuild_fn, "__name__", repr(rebuild_fn))
        raise TypeError(f"not the reduction of a CUDA tensor (it is rebuilt by {name})")
    if len(args) != 15:
        raise ValueError(f"rebuild_cuda_tensor takes 15 arguments, the reduction has {len(args)}")
    (
        _tensor_cls,
        tensor_size,
        tensor_stride,
        tensor_offset,
        _storage_cls,
        dtype,
        storage_device,
        storage_handle,
        storage_size_bytes,
        storage_offset_bytes,
        _requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args
    fields = (
        storage_device,
        storage_handle,
        storage_size_bytes,
        storage_offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    )
    from . import _torch_dtype_name

    return _native.from_torch(
        fields,
        _torch_dtype_name(dtype),
        [int(n) for n in tensor_size],
        [int(s) for s in tensor_stride],
        int(tensor_offset),
    )


def to_torch_args(tensor):
    """The 15 arguments of ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` for a GPU
    tensor of this process: a cuda-mp tensor, or a CUDA ``torch.Tensor`` (of PyTorch's caching
    allocator, or a view of cuda-mp memory). Pickle them to a PyTorch process, which calls
    :func:`rebuild` or ``rebuild_cuda_tensor(*args)``.

    Each call is one share: the memory is kept until the PyTorch consumer frees its tensor,
    and then released (or until this process exits, when the consumer dies first). What
    PyTorch's current stream here has queued is waited for, as well as cuda-mp's stream.
    Memory received from another process, and VMM memory, cannot be handed to PyTorch this way
    (an error says so); allocate legacy memory or copy.
    """
    import torch

    from . import _gpu, _order_after_torch

    if not isinstance(tensor, _native.Tensor):
        tensor = _gpu(tensor)  # waits for PyTorch's current stream itself
    elif tensor.device is None:
        raise TypeError("a host tensor has no pytorch cuda ipc handle")
    elif torch.cuda.is_initialized():
        _order_after_torch(tensor.device)
    (
        storage_device,
        storage_handle,
        storage_size_bytes,
        storage_offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = _native.to_torch(tensor)
    return (
        torch.Tensor,
        torch.Size(tensor.shape),
        tuple(tensor.strides),
        _native.element_offset(tensor),
        torch.storage.TypedStorage,
        _torch_dtype(tensor.dtype),
        storage_device,
        storage_handle,
        storage_size_bytes,
        storage_offset_bytes,
        False,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    )


def rebuild(args):
    """Rebuilds, in a PyTorch process, the tensor of :func:`to_torch_args`' ``args`` (the
    memory of the cuda-mp process, no copy)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(*args)


__all__ = ["from_torch_reduction", "to_torch_args", "rebuild"]
