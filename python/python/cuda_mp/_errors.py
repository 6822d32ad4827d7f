"""Exceptions of cuda_mp (each also a subclass of the matching built-in exception)."""


class Error(RuntimeError):
    """An error of cuda-mp."""


class Timeout(Error, TimeoutError):
    """Nothing arrived (or nobody connected) within the timeout."""


class Disconnected(Error, ConnectionError, EOFError):
    """The other end of the channel is gone (an ``EOFError`` too, as ``multiprocessing``'s
    connections raise at their end)."""


class Malformed(Error, ValueError):
    """A message, record or handle that is not what it claims to be, or a view (shape, strides,
    offset) that does not fit its memory."""


class DTypeError(Error, TypeError):
    """An element type that cuda-mp does not have, or not the one expected."""
