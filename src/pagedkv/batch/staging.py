"""One host staging buffer for every array of a step, moved to the device in one copy.

Arrays are laid out in a single byte buffer (pinned when the device is CUDA), filled in place
through numpy views, copied once, and handed out as typed views of the device buffer.
The layout is worked out once per array (offset, dtype, shape, bytes), so that a step's
views cost a slice each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

_ALIGN = 8  # bytes; every slice starts on an int64 boundary so dtype views are legal
_DTYPES = {"int32": (np.dtype(np.int32), torch.int32), "int64": (np.dtype(np.int64), torch.int64)}


def copy_to_device(buf: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The step's one host-to-device copy (a function of its own so tests can count it)."""
    return buf.to(device, non_blocking=True)


@dataclass
class Staging:
    """Reserve arrays with :meth:`add`, :meth:`allocate`, fill :meth:`host`, :meth:`to`."""

    _slots: dict[str, tuple[int, int, str, tuple[int, ...]]] = field(default_factory=dict)
    _nbytes: int = 0
    _buffer: torch.Tensor | None = None
    _array: np.ndarray | None = None

    def add(self, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        count = 1
        for dim in shape:
            count *= dim
        size = count * _DTYPES[dtype][0].itemsize
        self._slots[name] = (self._nbytes, size, dtype, shape)
        self._nbytes += -(-size // _ALIGN) * _ALIGN

    def allocate(self, device: torch.device) -> None:
        pin = device.type == "cuda" and torch.cuda.is_available()
        self._buffer = torch.empty(max(self._nbytes, _ALIGN), dtype=torch.uint8, pin_memory=pin)
        self._array = self._buffer.numpy()

    def host(self, name: str) -> np.ndarray:
        """Writable numpy view of one array inside the host buffer."""
        offset, size, dtype, shape = self._slots[name]
        raw = self._array[offset : offset + size]  # type: ignore[index]
        return raw.view(_DTYPES[dtype][0]).reshape(shape)

    def to(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Copy the buffer once (no copy for a CPU device) and return typed views of it."""
        buf = self._buffer
        if buf is None:
            raise RuntimeError("Staging.to called before allocate")  # programming error
        if buf.device != device:
            buf = copy_to_device(buf, device)
        typed = {key: buf.view(torch_dtype) for key, (_, torch_dtype) in _DTYPES.items()}
        out = {}
        for name, (offset, _, dtype, shape) in self._slots.items():
            base = typed[dtype]
            start = base.storage_offset() + offset // _DTYPES[dtype][0].itemsize
            out[name] = base.as_strided(shape, _contiguous_strides(shape), start)
        return out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))
