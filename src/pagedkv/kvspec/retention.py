"""Retention: which positions of a layer must stay resident, and when a block can go.

The worst-case block arithmetic lives here, so that the planner (what fits) and the block
manager (can this request be admitted) use the very same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

from pagedkv.errors import ConfigError, InvalidArgumentError


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _positive(owner: str, key: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{owner}: {key} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Full:
    """Every position stays resident for the life of the request."""

    kind: Literal["full"] = field(default="full", init=False)


@dataclass(frozen=True)
class SlidingWindow:
    """A query at position p sees keys in (p - window, p]; older blocks can be freed."""

    window: int
    kind: Literal["sliding_window"] = field(default="sliding_window", init=False)

    def __post_init__(self) -> None:
        _positive("SlidingWindow", "window", self.window)


@dataclass(frozen=True)
class ChunkedLocal:
    """Positions attend only inside their aligned chunk of ``chunk`` tokens (Llama 4)."""

    chunk: int
    kind: Literal["chunked_local"] = field(default="chunked_local", init=False)

    def __post_init__(self) -> None:
        _positive("ChunkedLocal", "chunk", self.chunk)


@dataclass(frozen=True)
class Recurrent:
    """One state per request; with prefix caching, a checkpoint every ``checkpoint_every``
    blocks lets a cached prefix resume there (None: no checkpoints, no prefix hits)."""

    checkpoint_every: int | None = None
    kind: Literal["recurrent"] = field(default="recurrent", init=False)

    def __post_init__(self) -> None:
        if self.checkpoint_every is not None:
            _positive("Recurrent", "checkpoint_every", self.checkpoint_every)


@dataclass(frozen=True)
class Cross:
    """Encoder (cross-attention) KV: a fixed number of positions per request."""

    max_encoder_len: int
    kind: Literal["cross"] = field(default="cross", init=False)

    def __post_init__(self) -> None:
        _positive("Cross", "max_encoder_len", self.max_encoder_len)


@dataclass(frozen=True)
class Compressed:
    """One entry per ``ratio`` tokens, each kept for the life of the request (DeepSeek-V4's
    compressed K/V and indexer keys: every complete window of ``ratio`` tokens is pooled into
    one entry; the tokens of an incomplete window are per-request state, not entries).

    A block of a compressed group holds ``block_size`` entries, i.e. covers
    ``block_size * ratio`` tokens; the layer's layout describes one entry.
    """

    ratio: int
    kind: Literal["compressed"] = field(default="compressed", init=False)

    def __post_init__(self) -> None:
        _positive("Compressed", "ratio", self.ratio)


Retention = Union[Full, SlidingWindow, ChunkedLocal, Recurrent, Cross, Compressed]
RETENTION_KINDS = ("full", "sliding_window", "chunked_local", "recurrent", "cross", "compressed")


def blocks_per_request(retention: Retention, num_tokens: int, block_size: int) -> int:
    """Most blocks one request of ``num_tokens`` tokens holds at once, outside the step's
    new tokens (see :func:`step_blocks`). Recurrent layers hold no blocks (0)."""
    if num_tokens < 0 or block_size <= 0:
        raise InvalidArgumentError(
            f"need num_tokens >= 0 and block_size > 0, got {num_tokens}, {block_size}"
        )
    whole = cdiv(num_tokens, block_size)
    if isinstance(retention, Full):
        return whole
    if isinstance(retention, SlidingWindow):
        # window - 1 earlier keys plus the current token, unaligned to a block boundary
        return min(whole, cdiv(retention.window - 1, block_size) + 1)
    if isinstance(retention, ChunkedLocal):
        aligned = retention.chunk % block_size == 0
        return min(whole, cdiv(retention.chunk, block_size) + (0 if aligned else 1))
    if isinstance(retention, Cross):
        return cdiv(retention.max_encoder_len, block_size)
    if isinstance(retention, Recurrent):
        return 0
    if isinstance(retention, Compressed):
        return cdiv(num_tokens // retention.ratio, block_size)  # complete windows only
    raise ConfigError(f"unknown retention {retention!r}")


def step_blocks(retention: Retention, max_batched_tokens: int, block_size: int) -> int:
    """Blocks the tokens of one step add on top of every request's resident window.

    The step's token budget is shared by the whole batch, so this is counted once per
    step, not once per request. Full, cross and compressed layers already count every
    token (entry) they keep.
    """
    if isinstance(retention, (SlidingWindow, ChunkedLocal)):
        return cdiv(max_batched_tokens, block_size)
    return 0


def describe(retention: Retention) -> str:
    """Short human form: ``full``, ``window 4096``, ``chunk 8192``, ``recurrent``, ..."""
    if isinstance(retention, SlidingWindow):
        return f"window {retention.window}"
    if isinstance(retention, ChunkedLocal):
        return f"chunk {retention.chunk}"
    if isinstance(retention, Cross):
        return f"cross {retention.max_encoder_len}"
    if isinstance(retention, Compressed):
        return f"compressed 1/{retention.ratio}"
    if isinstance(retention, Recurrent) and retention.checkpoint_every:
        return f"recurrent (checkpoint every {retention.checkpoint_every} blocks)"
    return retention.kind
