"""Step buffers reused across steps: a packed host staging buffer (pinned, two used in turn,
when the device is CUDA) and one device buffer, every array at an offset fixed by the step's
shape.

A fresh buffer and fresh tensor views every step cost more host time than filling the
arrays. Here a step whose shape (batch rows, token rows, block-table width per group) was
seen before reuses that shape's numpy and torch views; only each group's CSR page list,
whose length changes every few steps, is sliced per step. The device buffer does not move
unless it must grow (never, when sized up front for CUDA graphs), so a graph captured for a
shape replays with the data of any later step of that shape. A step's tensors are valid
until the next step that uses the same buffers.

Layout of one shape, in bytes: int64 arrays (slots, positions of every group), then int32
arrays (query_start_loc, then per group block table, seq_lens, indptr, last-page lengths),
then each group's CSR page list at its capacity (batch x width). The one host-to-device copy
covers bytes 0 to the end of the last group's used pages, rounded up to 4 KiB, so that the
slices it copies between are made once per shape and length, not per step: on CUDA every
torch call on the step path costs several us of host time, so a step makes one ``copy_``,
one event record (and, rarely, a wait), and a page-list view per group whose length changed.

Two host buffers in turn on CUDA: the copy is asynchronous, so a step may be filled while
the previous step's copy is still queued behind the device's work; before a host buffer is
refilled, the copy made from it two steps earlier is waited for (an event, normally long
done).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.errors import InvalidArgumentError

# every group's fixed-shape arrays, by dtype (its CSR page list comes last, see the layout)
_INT64 = ("slot_mapping", "positions")
_INT32 = ("block_table", "seq_lens", "paged_kv_indptr", "paged_kv_last_page_len")
_MAX_SHAPES = 256  # cached shapes before the cache is dropped (a long run of odd batch sizes)
# a copy's length is rounded up to a multiple of this, so that a shape has few distinct copy
# lengths and the (device, host) slice pair of each is made once, not every step (a few us
# of dispatcher time per slice on CUDA); the extra bytes are unused page-list capacity
_GRANULE = 4 << 10
_MAX_COPIES = 64  # cached copy slice pairs per shape before they are dropped
# the current stream's raw handle (a cheap C call): a Stream object is built only when it
# changes (torch.cuda.current_stream() builds one each call, several us)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _count(name: str, batch: int, tokens: int, width: int) -> tuple[int, tuple[int, ...]]:
    if name in _INT64:
        return tokens, (tokens,)
    if name == "block_table":
        return batch * width, (batch, width)
    if name == "paged_kv_indptr":
        return batch + 1, (batch + 1,)
    return batch, (batch,)


@dataclass(frozen=True)
class Layout:
    """Byte offsets of one step shape's arrays in the packed buffer."""

    batch: int
    tokens: int
    widths: tuple[int, ...]
    # (group index, name) -> (byte offset, count, shape, numpy dtype, torch dtype)
    slots: dict[tuple[int, str], tuple[int, int, tuple[int, ...], np.dtype, torch.dtype]]
    qsl_at: int
    pages_at: tuple[int, ...]  # byte offset of each group's CSR page list
    nbytes: int

    @classmethod
    def of(cls, batch: int, tokens: int, widths: tuple[int, ...]) -> Layout:
        slots = {}
        at = 0
        for i, width in enumerate(widths):
            for name in _INT64:
                count, shape = _count(name, batch, tokens, width)
                slots[(i, name)] = (at, count, shape, np.dtype(np.int64), torch.int64)
                at += 8 * count
        qsl_at = at
        at += 4 * (batch + 1)
        for i, width in enumerate(widths):
            for name in _INT32:
                count, shape = _count(name, batch, tokens, width)
                slots[(i, name)] = (at, count, shape, np.dtype(np.int32), torch.int32)
                at += 4 * count
        pages_at = []
        for width in widths:
            pages_at.append(at)
            at += 4 * batch * width
        return cls(batch, tokens, widths, slots, qsl_at, tuple(pages_at), -(-at // 8) * 8)

    def copy_end(self, nnz: list[int]) -> int:
        """Bytes the step's copy must cover (up to the last group's used pages), rounded up
        to the copy granule (within the layout)."""
        end = self.pages_at[-1] + 4 * nnz[-1] if nnz else self.qsl_at + 4 * (self.batch + 1)
        return min(-(-end // _GRANULE) * _GRANULE, self.nbytes)

    def numpy_views(self, raw: np.ndarray) -> tuple[np.ndarray, list[dict[str, np.ndarray]]]:
        qsl = raw[self.qsl_at : self.qsl_at + 4 * (self.batch + 1)].view(np.int32)
        groups: list[dict[str, np.ndarray]] = [{} for _ in self.widths]
        for (i, name), (at, count, shape, np_dtype, _) in self.slots.items():
            groups[i][name] = raw[at : at + count * np_dtype.itemsize].view(np_dtype).reshape(shape)
        for i, width in enumerate(self.widths):
            at = self.pages_at[i]
            groups[i]["paged_kv_indices"] = raw[at : at + 4 * self.batch * width].view(np.int32)
        return qsl, groups

    def torch_views(self, buf: torch.Tensor) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        qsl = buf[self.qsl_at : self.qsl_at + 4 * (self.batch + 1)].view(torch.int32)
        groups: list[dict[str, torch.Tensor]] = [{} for _ in self.widths]
        for (i, name), (at, count, shape, np_dtype, dtype) in self.slots.items():
            part = buf[at : at + count * np_dtype.itemsize].view(dtype)
            groups[i][name] = part.view(shape) if len(shape) > 1 else part
        for i, width in enumerate(self.widths):
            at = self.pages_at[i]
            groups[i]["paged_kv_indices"] = buf[at : at + 4 * self.batch * width].view(torch.int32)
        return qsl, groups


class _Shape:
    """One cached shape: its layout, numpy views per host buffer, torch views of the device,
    and the slice pairs its copies used."""

    __slots__ = ("copies", "device", "full_pages", "host", "layout", "pages")

    def __init__(self, layout: Layout, hosts: list[np.ndarray], device: torch.Tensor) -> None:
        self.layout = layout
        self.host = [layout.numpy_views(raw) for raw in hosts]
        self.device = layout.torch_views(device)
        self.full_pages = [g["paged_kv_indices"] for g in self.device[1]]
        # each group's last page-list view and its length: nnz often repeats between steps
        self.pages: list[tuple[int, torch.Tensor] | None] = [None] * len(layout.widths)
        # (host buffer, copy end) -> (device slice, host slice)
        self.copies: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


class StepBuffers:
    """Host staging + device buffer for steps of any shape (grown on demand), or of shapes
    up to ``capacity`` bytes when given (then never reallocated: fixed device addresses)."""

    def __init__(self, device: torch.device, capacity: int | None = None, *,
                 emulate_device: bool = False) -> None:
        self.device = device
        self.fixed = capacity is not None
        self.copies = 0  # host-to-device copies issued
        self._cuda = device.type == "cuda"
        # tests: on a CPU device, lay out the CUDA path (two host buffers in turn, a separate
        # "device" buffer filled by one partial copy per step), less the events
        self._emulate = emulate_device and device.type == "cpu"
        self._nbytes = 0
        self._hosts: list[torch.Tensor] = []
        self._raw: list[np.ndarray] = []
        self._dev: torch.Tensor | None = None
        self._events: list[torch.cuda.Event] = []
        self._pending: list[bool] = []
        self._turn = 0
        self._shapes: dict[tuple[int, int, tuple[int, ...]], _Shape] = {}
        self._filled: list[object] = []
        self._stream_raw: int | None = None
        self._stream: torch.cuda.Stream | None = None
        self._last: tuple[_Shape, list[int]] | None = None  # the last step's shape and nnz
        self._allocate(max(capacity or 0, 64))

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def device_buffer(self) -> torch.Tensor:
        """The uint8 buffer every step's device views point into (on a CPU device without
        emulation: the one host buffer)."""
        return self._dev if self._dev is not None else self._hosts[0]

    @property
    def copy_bytes(self) -> int:
        """Bytes the last step's host-to-device copy covered (on a CPU device, where no copy
        is made: what a CUDA step of the same shape would copy); 0 before any step."""
        if self._last is None:
            return 0
        entry, nnz = self._last
        return entry.layout.copy_end(nnz)

    def _allocate(self, nbytes: int) -> None:
        ring = 2 if self._cuda or self._emulate else 1
        pin = self._cuda and torch.cuda.is_available()
        self._hosts = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(ring)]
        self._raw = [h.numpy() for h in self._hosts]
        # a CPU step needs no copy: its tensors are views of the (only) host buffer
        self._dev = None if self.device.type == "cpu" and not self._emulate else torch.full(
            (nbytes,), 0xAB if self._emulate else 0, dtype=torch.uint8, device=self.device
        )  # (emulated: garbage where a copy did not reach)
        self._events = [torch.cuda.Event() for _ in range(ring)] if self._cuda else []
        self._pending = [False] * ring
        self._filled = [None] * ring  # per host buffer: the key of its last complete fill
        self._turn = 0
        self._nbytes = nbytes
        self._shapes = {}

    def shape(self, batch: int, tokens: int, widths: tuple[int, ...]) -> _Shape:
        """The cached views of this step shape (buffers grown first if they must be)."""
        key = (batch, tokens, widths)
        entry = self._shapes.get(key)
        if entry is None:
            layout = Layout.of(batch, tokens, widths)
            if layout.nbytes > self._nbytes:
                if self.fixed:
                    raise InvalidArgumentError(
                        f"a step of {batch} rows, {tokens} tokens, block-table widths "
                        f"{list(widths)} needs {layout.nbytes} bytes; the fixed buffers hold "
                        f"{self._nbytes}"
                    )
                self._allocate(max(layout.nbytes, 2 * self._nbytes))
            if len(self._shapes) >= _MAX_SHAPES:
                self._shapes = {}
            dev = self._dev if self._dev is not None else self._hosts[0]
            entry = _Shape(layout, self._raw, dev)
            self._shapes[key] = entry
        return entry

    def host(self, entry: _Shape) -> tuple[np.ndarray, list[dict[str, np.ndarray]]]:
        """Numpy views to fill for this step (waits, if ever, for the copy last made from
        the same host buffer)."""
        if self._pending[self._turn]:
            self._events[self._turn].synchronize()
            self._pending[self._turn] = False
        return entry.host[self._turn]

    def previous(self, entry: _Shape) -> list[dict[str, np.ndarray]]:
        """Numpy views of this shape in the host buffer the previous step filled (the same
        buffer as :meth:`host` when there is one; on CUDA the other one, whose copy may still
        be queued: read it only). Its contents are that step's only if it had this shape."""
        return entry.host[self._turn ^ 1 if len(self._raw) > 1 else self._turn][1]

    def refill(self, key: object) -> bool:
        """Whether this step's host buffer was last completely filled under ``key`` (then
        whatever that fill wrote that depends on the key alone, e.g. padding rows, is still
        there). Forgets the key until :meth:`filled` is called, so a step that fails half
        way leaves nothing to trust."""
        same = key is not None and self._filled[self._turn] == key
        self._filled[self._turn] = None
        return same

    def filled(self, key: object) -> None:
        """This step's host buffer now holds a complete fill under ``key``."""
        self._filled[self._turn] = key

    def send(
        self, entry: _Shape, nnz: list[int]
    ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]], list[torch.Tensor]]:
        """Copy the filled host buffer (one copy) and return the device views of the step
        shape (cached: do not modify the dicts) and each group's page list cut to its
        ``nnz`` entries."""
        dev = self._dev
        if dev is not None:
            turn = self._turn
            end = entry.layout.copy_end(nnz)
            pair = entry.copies.get((turn, end))
            if pair is None:
                if len(entry.copies) >= _MAX_COPIES:
                    entry.copies.clear()
                pair = entry.copies[(turn, end)] = (dev[:end], self._hosts[turn][:end])
            pair[0].copy_(pair[1], non_blocking=True)
            self.copies += 1
            if self._cuda:
                self._events[turn].record(self._current_stream())
                self._pending[turn] = True
            if len(self._raw) > 1:
                self._turn = turn ^ 1
        return self.views(entry, nnz)

    def views(
        self, entry: _Shape, nnz: list[int]
    ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]], list[torch.Tensor]]:
        """The device views of the step shape (cached: do not modify the dicts) and each
        group's page list cut to its ``nnz`` entries, without a copy (:meth:`send` copies
        first; a step derived on the device calls this alone)."""
        self._last = (entry, nnz)
        qsl, groups = entry.device
        cache = entry.pages
        pages = []
        for i, count in enumerate(nnz):
            last = cache[i]
            if last is None or last[0] != count:
                # as_strided keeps the view's offset and is the cheapest view call
                last = cache[i] = (count, entry.full_pages[i].as_strided((count,), (1,)))
            pages.append(last[1])
        return qsl, groups, pages

    def _current_stream(self) -> torch.cuda.Stream:
        """The current CUDA stream of the buffer's device (the copy went there), rebuilt as
        a Stream object only when its raw handle changes."""
        index = self._dev.device.index  # type: ignore[union-attr]
        if _raw_stream is None:
            return torch.cuda.current_stream(index)
        raw = _raw_stream(index)
        if raw != self._stream_raw or self._stream is None:
            self._stream = torch.cuda.current_stream(index)
            self._stream_raw = raw
        return self._stream
