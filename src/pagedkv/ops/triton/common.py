"""What every Triton op shares: where it may run, dtype mapping, split-KV sizing, host checks.

Under TRITON_INTERPRET=1 kernels run on CPU tensors; there every loaded value is converted
to float32 right after loading (the interpreter computes bf16 arithmetic wrongly) and no
autotuning happens. On a GPU the tensors must be CUDA tensors.
"""

from __future__ import annotations

import os

import torch

from pagedkv.errors import InvalidArgumentError, MetadataError


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(*tensors: torch.Tensor | None) -> None:
    """Kernels run on CUDA tensors (or on CPU tensors under the interpreter), all on one
    device: a kernel handed a pointer into another device's memory (or the host's) fails
    inside Triton's launcher at best. None stands for an optional tensor not given."""
    given = [t for t in tensors if t is not None]
    for t in given[1:]:
        if t.device != given[0].device:
            raise InvalidArgumentError(
                f"the call's tensors must be on one device: {given[0].device} and {t.device}")
    if given and given[0].device.type != "cuda" and not interpreting():
        raise InvalidArgumentError(
            f"the triton backend needs CUDA tensors (or TRITON_INTERPRET=1), got one on "
            f"{given[0].device}")


def capturing() -> bool:
    """True inside CUDA-graph capture, where host reads of device tensors are not allowed."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def num_splits(work_items: int, max_seq_len: int, chunk: int, sms: int | None = None,
               waves: float = 2.0) -> int:
    """KV splits so that about ``waves`` programs per multiprocessor are launched, at least
    ``chunk`` keys per split, at most 64 splits (waves per kernel: benchmarks/attention.py's
    sweep on the H200, docs/kernels-log.md)."""
    if interpreting():
        return min(2, max(1, -(-max_seq_len // 64)))  # exercise the combine, stay fast
    if sms is None:
        sms = torch.cuda.get_device_properties(0).multi_processor_count if (
            torch.cuda.is_available() and not interpreting()) else 4
    want = -(-int(waves * sms) // max(1, work_items))
    most = max(1, -(-max_seq_len // chunk))
    return max(1, min(want, most, 64))


def raise_on_bad_block(flag: torch.Tensor, num_blocks: int) -> None:
    """The kernels record a block id outside the cache in ``flag`` [2]; raise if one was read."""
    if capturing():
        return
    seen, block = (int(x) for x in flag.tolist())
    if seen:
        raise MetadataError(
            f"a position is read through block id {block}, outside the cache's {num_blocks} blocks"
        )


def scale_vector(values, device) -> torch.Tensor:
    """float32 [len(values)] on ``device`` from floats or 1-element tensors, with no
    host-to-device copy (so it may run inside CUDA-graph capture)."""
    parts = []
    for v in values:
        if isinstance(v, torch.Tensor):
            parts.append(v.to(device=device, dtype=torch.float32).reshape(1))
        else:
            parts.append(torch.full((1,), float(v), dtype=torch.float32, device=device))
    return torch.cat(parts)
