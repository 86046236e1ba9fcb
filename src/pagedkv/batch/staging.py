"""One host staging buffer for every array of a step, moved to the device in one copy.

Arrays are laid out in a single byte buffer (pinned when the device is CUDA), filled in place
through numpy views, copied once, and handed out as typed views of the device buffer.
Arrays of one dtype sit back to back in one region (int64 first, so both regions stay
aligned), so that all of a step's views come from one split per dtype: a step's host cost
must not grow with the number of arrays faster than it has to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

_DTYPES = {"int64": (np.dtype(np.int64), torch.int64), "int32": (np.dtype(np.int32), torch.int32)}


def copy_to_device(buf: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The step's one host-to-device copy (a function of its own so tests can count it)."""
    return buf.to(device, non_blocking=True)


@dataclass
class Staging:
    """Reserve arrays with :meth:`add`, :meth:`allocate`, fill :meth:`host`, :meth:`to`."""

    # name -> (dtype, element offset within the dtype's region, count, shape)
    _slots: dict[str, tuple[str, int, int, tuple[int, ...]]] = field(default_factory=dict)
    _counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_DTYPES, 0))
    _order: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in _DTYPES})
    _buffer: torch.Tensor | None = None
    _arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def add(self, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        count = 1
        for dim in shape:
            count *= dim
        self._slots[name] = (dtype, self._counts[dtype], count, shape)
        self._counts[dtype] += count
        self._order[dtype].append(name)

    def _bytes(self) -> tuple[int, int]:
        n64 = self._counts["int64"] * 8
        n32 = self._counts["int32"] * 4
        return n64, n64 + -(-n32 // 8) * 8

    def allocate(self, device: torch.device) -> None:
        pin = device.type == "cuda" and torch.cuda.is_available()
        n64, total = self._bytes()
        self._buffer = torch.empty(max(total, 8), dtype=torch.uint8, pin_memory=pin)
        raw = self._buffer.numpy()
        self._arrays = {
            "int64": raw[:n64].view(np.int64),
            "int32": raw[n64 : n64 + self._counts["int32"] * 4].view(np.int32),
        }

    def host(self, name: str) -> np.ndarray:
        """Writable numpy view of one array inside the host buffer."""
        dtype, start, count, shape = self._slots[name]
        return self._arrays[dtype][start : start + count].reshape(shape)

    def to(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Copy the buffer once (no copy for a CPU device) and return typed views of it."""
        buf = self._buffer
        if buf is None:
            raise RuntimeError("Staging.to called before allocate")  # programming error
        if buf.device != device:
            buf = copy_to_device(buf, device)
        n64, _ = self._bytes()
        regions = {
            "int64": buf[:n64].view(torch.int64),
            "int32": buf[n64 : n64 + self._counts["int32"] * 4].view(torch.int32),
        }
        out = {}
        for dtype, names in self._order.items():
            if not names:
                continue
            parts = regions[dtype].split_with_sizes([self._slots[n][2] for n in names])
            for name, part in zip(names, parts, strict=True):
                shape = self._slots[name][3]
                out[name] = part if len(shape) == 1 else part.view(shape)
        return out
