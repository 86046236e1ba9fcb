"""One host staging buffer for every array of a step, moved to the device in one copy.

Arrays are laid out in a single byte buffer (pinned when the device is CUDA), filled in place
through numpy views, copied once, and handed out as typed views of the device buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

_ALIGN = 8  # bytes; every slice starts on an int64 boundary so dtype views are legal
_DTYPES = {"int32": (np.int32, torch.int32), "int64": (np.int64, torch.int64)}


@dataclass
class Staging:
    """Reserve arrays with :meth:`add`, :meth:`allocate`, fill :meth:`host`, :meth:`to`."""

    _slots: dict[str, tuple[int, str, tuple[int, ...]]] = field(default_factory=dict)
    _nbytes: int = 0
    _buffer: torch.Tensor | None = None

    def add(self, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        np_dtype = _DTYPES[dtype][0]
        count = int(np.prod(shape, dtype=np.int64))
        self._slots[name] = (self._nbytes, dtype, shape)
        size = count * np.dtype(np_dtype).itemsize
        self._nbytes += -(-size // _ALIGN) * _ALIGN

    def allocate(self, device: torch.device) -> None:
        pin = device.type == "cuda" and torch.cuda.is_available()
        self._buffer = torch.empty(max(self._nbytes, _ALIGN), dtype=torch.uint8, pin_memory=pin)

    def host(self, name: str) -> np.ndarray:
        """Writable numpy view of one array inside the host buffer."""
        offset, dtype, shape = self._slots[name]
        np_dtype = _DTYPES[dtype][0]
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(np_dtype).itemsize
        raw = self._buffer.numpy()[offset : offset + size]  # type: ignore[union-attr]
        return raw.view(np_dtype).reshape(shape)

    def to(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Copy the buffer once (no copy for a CPU device) and return typed views of it."""
        buf = self._buffer
        if buf is None:
            raise RuntimeError("Staging.to called before allocate")  # programming error
        if buf.device != device:
            buf = buf.to(device, non_blocking=True)
        out = {}
        for name, (offset, dtype, shape) in self._slots.items():
            torch_dtype = _DTYPES[dtype][1]
            count = int(np.prod(shape, dtype=np.int64))
            size = count * torch.empty((), dtype=torch_dtype).element_size()
            out[name] = buf[offset : offset + size].view(torch_dtype).view(shape)
        return out
