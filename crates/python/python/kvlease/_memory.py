"""How the native module finds the bytes of a Python object it registers.

:func:`describe` returns ``(address, length, device, owner)``: ``device`` is ``None`` for
host memory or the CUDA device ordinal, and ``owner`` is what the registration keeps
alive (the object, or a ``memoryview`` export of it, which also stops a ``bytearray``
from being resized while registered).
"""

from __future__ import annotations

import ctypes
from math import prod
from typing import Any

from .errors import InvalidArgument



def _array_interface_bytes(ai: dict[str, Any], what: str) -> tuple[int, int]:
    data = ai.get("data")
    if not isinstance(data, tuple) or len(data) != 2:
        raise InvalidArgument(f"{what}: 'data' must be an (address, read_only) tuple")
    ptr, read_only = data
    if read_only:
        raise InvalidArgument(f"{what}: read-only memory cannot be registered")
    typestr = ai.get("typestr", "")
    try:
        itemsize = int(typestr[2:])
    except ValueError:
        raise InvalidArgument(f"{what}: unknown typestr {typestr!r}") from None
    shape = tuple(ai.get("shape", ()))
    strides = ai.get("strides")
    if strides is not None:
        expected = []
        step = itemsize
        for dim in reversed(shape):
            expected.append(step)
            step *= dim
        if tuple(reversed(expected)) != tuple(strides):
            raise InvalidArgument(f"{what}: only C-contiguous arrays can be registered")
    return int(ptr), prod(shape) * itemsize


def describe(obj: Any) -> tuple[int, int, int | None, Any]:
    """The memory of ``obj``: a torch tensor, an object with ``__cuda_array_interface__``
    or ``__array_interface__``, or one with the (writable, contiguous) buffer protocol."""
    if (
        hasattr(obj, "data_ptr")
        and hasattr(obj, "element_size")
        and hasattr(obj, "numel")
        and hasattr(obj, "device")
    ):
        if not obj.is_contiguous():
            raise InvalidArgument("only contiguous tensors can be registered")
        device = obj.device
        if device.type == "cpu":
            ordinal = None
        elif device.type == "cuda":
            ordinal = device.index if device.index is not None else 0
        else:
            raise InvalidArgument(f"tensors on {device.type} cannot be registered")
        length = obj.numel() * obj.element_size()
        if length == 0:
            raise InvalidArgument("an empty tensor cannot be registered")
        return obj.data_ptr(), length, ordinal, obj
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        ptr, length = _array_interface_bytes(cai, "__cuda_array_interface__")
        device = getattr(obj, "device", None)
        ordinal = getattr(device, "id", 0) if device is not None else 0
        return ptr, length, int(ordinal), obj
    ai = getattr(obj, "__array_interface__", None)
    if ai is not None:
        ptr, length = _array_interface_bytes(ai, "__array_interface__")
        if length == 0:
            raise InvalidArgument("an empty array cannot be registered")
        return ptr, length, None, obj
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"cannot register a {type(obj).__name__}: it has no buffer protocol, "
            "__array_interface__ or tensor data_ptr()"
        ) from None
    if view.readonly:
        view.release()
        raise InvalidArgument("read-only buffers cannot be registered (peers' reads land in them)")
    if not view.c_contiguous:
        view.release()
        raise InvalidArgument("only C-contiguous buffers can be registered")
    if view.nbytes == 0:
        view.release()
        raise InvalidArgument("an empty buffer cannot be registered")
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    return address, view.nbytes, None, view
