"""A steady decode step's metadata derived on the device from a small delta.

In a steady decode step (the same batch rows in the same order as the previous step, every
row one new token, no block-table entry rewritten) the device already holds the previous
step's block table; what changed is each row's length (+1) and, in ~1/block_size of the
rows, one newly opened block. So the host sends only a delta, in one small copy, and one
kernel writes every array of the step into the same persistent device buffer the full
path fills (block table entries, seq_lens, CSR indptr / page list / last-page lengths,
slots, positions); what only the batch shape decides (query starts, padding rows) is
already there from the previous step of the same shape.

Delta layout (int32; :data:`HEADER` + groups x :data:`DESC` + (1 + 2 x groups) x batch):
``n, batch, groups, 0``; per group its arrays' element offsets in the step buffer (int32
block table, seq_lens, indptr, last-page lengths, page list; int64 slots, positions), the
block-table width, block size and position offset; ``computed[batch]``; per group
``held[batch]``, ``id[batch]``: each row's block count and last block's id, which the
device stores at column held - 1 (a no-op unless it was opened since the previous step;
none for an empty row).

:func:`derive_reference` is the same derivation in numpy: what a CPU device runs (on the
host), tested like the kernel against ``build_metadata``.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from pagedkv.batch.buffers import Layout
from pagedkv.batch.derived import prefix_masks
from pagedkv.errors import InvalidArgumentError
from pagedkv.launch import Launch, raw_stream

HEADER = 4  # n, batch, groups, unused
DESC = 10  # per group: bt, seq, indptr, last, pages, slot, pos, width, block size, offset
_ROWS = 64  # rows per program
_BLOCK_W = 32  # block-table columns per iteration


def delta_ints(batch: int, groups: int) -> int:
    return HEADER + DESC * groups + (1 + 2 * groups) * batch


def descriptor(layout: Layout, block_sizes: tuple[int, ...], offsets: tuple[int, ...]) -> np.ndarray:
    """The header and per-group descriptors of one step shape (all but ``n``)."""
    groups = len(layout.widths)
    out = np.zeros(HEADER + DESC * groups, dtype=np.int32)
    out[1:3] = layout.batch, groups
    for i, width in enumerate(layout.widths):
        at = [layout.slots[(i, name)][0] // 4 for name in
              ("block_table", "seq_lens", "paged_kv_indptr", "paged_kv_last_page_len")]
        at.append(layout.pages_at[i] // 4)
        at += [layout.slots[(i, name)][0] // 8 for name in ("slot_mapping", "positions")]
        out[HEADER + DESC * i : HEADER + DESC * (i + 1)] = at + [width, block_sizes[i], offsets[i]]
    return out


def derive_reference(delta: np.ndarray, buf32: np.ndarray, buf64: np.ndarray) -> None:
    """What the kernel writes, in numpy, into ``buf32`` / ``buf64`` (int32 / int64 views of
    the step buffer): the table entries first, then everything from the table."""
    n, batch, groups = (int(x) for x in delta[:3])
    computed = delta[HEADER + DESC * groups :][:batch][:n].astype(np.int64)
    for g in range(groups):
        bt, seq_at, indptr_at, last_at, pages_at, slot_at, pos_at, width, bs, k = (
            int(x) for x in delta[HEADER + DESC * g : HEADER + DESC * (g + 1)])
        new = delta[HEADER + DESC * groups + batch * (1 + 2 * g):][: 2 * batch]
        cols, ids = new[:n].astype(np.int64) - 1, new[batch : batch + n]
        table = buf32[bt : bt + batch * width].reshape(batch, width)
        hit = np.flatnonzero((cols >= 0) & (cols < width))
        table[hit, cols[hit]] = ids[hit]
        seq = np.maximum(computed + 1 - k, 0)
        pages = (seq + bs - 1) // bs
        indptr = buf32[indptr_at : indptr_at + batch + 1]
        indptr[1 : n + 1] = np.cumsum(pages)
        nnz = int(indptr[n]) if n else 0
        indptr[n + 1 :] = nnz
        buf32[seq_at : seq_at + n] = seq
        buf32[last_at : last_at + n] = np.minimum(seq, seq - pages * bs + bs)
        if nnz:
            mask = prefix_masks(width).take(pages, 0)
            buf32[pages_at : pages_at + nnz] = table[:n][mask]
        pos = computed - k
        has = pos >= 0
        safe = np.where(has, pos, 0)
        block = table[np.arange(n), np.minimum(safe // bs, width - 1)].astype(np.int64)
        buf64[slot_at : slot_at + n] = np.where(has, block * bs + safe % bs, -1)
        buf64[pos_at : pos_at + n] = safe


class DeltaBuffers:
    """The delta's host staging (pinned, two in turn, on CUDA) and its device copy.

    ``emulate``: on a CPU device, lay out the CUDA path (two host buffers in turn, a
    separate "device" buffer, one copy a step), for tests. ``kernel``: "triton" or "numpy"
    (default: triton on CUDA, numpy on a CPU device). ``graphs`` (CUDA, triton): each
    (host buffer, step shape) gets its copy and launch captured in a CUDA graph once, then
    replayed: one host call instead of a ``copy_`` and a launch."""

    def __init__(self, device: torch.device, batch: int, groups: int, *, emulate: bool = False,
                 kernel: str | None = None, graphs: bool = False) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        kernel = kernel or ("triton" if self.cuda else "numpy")
        if graphs and (not self.cuda or kernel != "triton" or emulate):
            raise InvalidArgumentError(
                f"derive graphs replay the delta's copy and the Triton kernel from a CUDA "
                f"graph: they need a CUDA device and the triton kernel, got a {device.type} "
                f"device, kernel {kernel!r}{' (emulated)' if emulate else ''}")
        if device.type not in ("cpu", "cuda") or kernel not in ("triton", "numpy") or (
                self.cuda and kernel != "triton"):
            raise InvalidArgumentError(
                f"derive kernel {kernel!r} on a {device.type} device: use 'triton' (CUDA, or"
                " CPU through TRITON_INTERPRET=1) or 'numpy' (CPU only)")
        if kernel == "triton":
            if not self.cuda and os.environ.get("TRITON_INTERPRET") != "1":
                raise InvalidArgumentError(
                    "the Triton derive kernel on a CPU device runs only in Triton's "
                    "interpreter: set TRITON_INTERPRET=1 before triton is imported")
            try:
                import pagedkv.batch.derive_kernel  # noqa: F401
            except ImportError as e:
                raise InvalidArgumentError(
                    f"derive_on_device on {device.type} needs triton: {e}") from None
        self.kernel = kernel
        self.copies = 0
        self.copy_bytes = 0
        nbytes = 4 * delta_ints(batch, groups)
        separate = self.cuda or emulate
        ring = 2 if separate else 1
        pin = self.cuda and torch.cuda.is_available()
        self.hosts = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(ring)]
        self.raw = [h.numpy().view(np.int32) for h in self.hosts]
        self.dev = (torch.zeros(nbytes, dtype=torch.uint8, device=device) if separate
                    else self.hosts[0])
        self.dev32 = self.dev.view(torch.int32)
        self.index = self.dev.device.index
        self.events = [torch.cuda.Event() for _ in range(ring)] if self.cuda else []
        self.pending = [False] * ring
        self.heads: list[tuple | None] = [None] * ring  # per host buffer: (shape, n, length)
        self.turn = 0
        self._pairs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._stream: tuple[int, torch.cuda.Stream] | None = None
        self._launch: dict[tuple, object] = {}
        # graphs: per (host buffer, ints, launch) the copy + launch captured once, replayed
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] | None = {} if graphs else None
        self._ints = 0
        self._side: torch.cuda.Stream | None = None

    def host(self, shape: object, n: int, head) -> tuple[np.ndarray, int]:
        """This step's int32 staging (waits, if ever, for the copy made from it before)
        with the header and descriptors of ``shape`` (``head(shape)``) and ``n`` rows
        written (only when that buffer last held others), and where the rest begins."""
        turn = self.turn
        if self.pending[turn]:
            self.events[turn].synchronize()
            self.pending[turn] = False
        raw = self.raw[turn]
        written = self.heads[turn]
        if written is None or written[0] is not shape or written[1] != n:
            self.heads[turn] = None
            first = head(shape)
            raw[: first.shape[0]] = first
            raw[0] = n
            self.heads[turn] = (shape, n, first.shape[0])
        return raw, self.heads[turn][2]  # type: ignore[index]

    def _pair(self, turn: int, ints: int) -> tuple[torch.Tensor, torch.Tensor]:
        pair = self._pairs.get((turn, ints))
        if pair is None:
            pair = self._pairs[(turn, ints)] = (self.dev[: 4 * ints], self.hosts[turn][: 4 * ints])
        return pair

    def send(self, ints: int) -> None:
        """Copy the first ``ints`` int32 of this step's staging to the device (one copy).
        With graphs the copy is left to :meth:`derive`, which replays it with the kernel."""
        self.copy_bytes = 4 * ints
        if self._graphs is not None:
            self._ints = ints
            return
        turn = self.turn
        if self.dev is not self.hosts[0]:
            dst, src = self._pair(turn, ints)
            dst.copy_(src, non_blocking=True)
            self._sent(turn)

    def _sent(self, turn: int) -> None:
        """The copy from host buffer ``turn`` is queued: guard the buffer, use the other next."""
        self.copies += 1
        if self.cuda:
            self.events[turn].record(self._current_stream())
            self.pending[turn] = True
        self.turn = turn ^ 1

    def derive(self, device_buffer: torch.Tensor, batch: int, groups: int) -> None:
        """Run the derivation on ``device_buffer`` (the step buffer, uint8) for a step
        shape of ``batch`` rows and ``groups`` groups (the delta was sent)."""
        if self.kernel == "numpy":
            raw = device_buffer.numpy()
            derive_reference(self.dev32.numpy(), raw.view(np.int32), raw[: raw.size // 8 * 8].view(np.int64))
            return
        launch = self._launch.get((device_buffer.data_ptr(), batch))
        if launch is None:
            launch = self._launch[(device_buffer.data_ptr(), batch)] = _Launch(
                self.dev32, device_buffer, batch, groups)
        if self._graphs is None:
            launch()
            return
        turn, ints = self.turn, self._ints
        key = (turn, ints, launch)
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()  # the delta's copy, then the kernel: one host call
        else:  # eagerly this time (the first launch compiles and loads), then captured
            dst, src = self._pair(turn, ints)
            dst.copy_(src, non_blocking=True)
            launch()
            self._graphs[key] = self._capture(dst, src, launch)
        self._sent(turn)

    def _capture(self, dst: torch.Tensor, src: torch.Tensor, launch) -> torch.cuda.CUDAGraph:
        """The copy of ``src`` (pinned host staging) into ``dst`` and the launch, captured
        on a side stream (capture cannot use the default stream) without running them."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                dst.copy_(src, non_blocking=True)
                launch()
            finally:
                graph.capture_end()
        return graph

    def _current_stream(self) -> torch.cuda.Stream:
        index = self.index
        if raw_stream is None:
            return torch.cuda.current_stream(index)
        raw = raw_stream(index)
        if self._stream is None or self._stream[0] != raw:
            self._stream = (raw, torch.cuda.current_stream(index))
        return self._stream[1]


class _Launch:
    """One shape's kernel launch with the shape's fixed buffers, through
    ``pagedkv.launch.Launch``: after the first (compiling) launch, CUDA launches call the
    compiled kernel's launcher directly, skipping Triton's per-call argument binding,
    specialisation and cache lookup (its host time on CUDA is the benchmark's ``derive
    call`` row). ``PAGEDKV_TRITON_DIRECT=0`` turns it off."""

    def __init__(self, delta: torch.Tensor, buf: torch.Tensor, batch: int, groups: int) -> None:
        import triton

        from pagedkv.batch.derive_kernel import derive_decode_kernel

        self.args = (delta, buf.view(torch.int32), buf[: buf.numel() // 8 * 8].view(torch.int64))
        block_b = max(triton.next_power_of_2(batch), _ROWS)
        self.launch = Launch(derive_decode_kernel, (groups, -(-batch // _ROWS)), (),
                             {"BLOCK_B": block_b, "ROWS": _ROWS, "BLOCK_W": _BLOCK_W})

    def __call__(self) -> None:
        self.launch(*self.args)
