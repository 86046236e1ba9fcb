"""Retention: which positions of a layer must stay resident, and when a block can go.

Each retention class carries its own arithmetic (``resident_blocks``, ``step_blocks``,
``first_needed``, ``null_blocks``), so callers never branch on the retention's type.

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

    def resident_blocks(self, num_tokens: int, block_size: int) -> int:
        return cdiv(num_tokens, block_size)

    def step_blocks(self, max_batched_tokens: int, block_size: int) -> int:
        return 0  # every token is counted already

    def first_needed(self, position: int) -> int:
        return 0

    @property
    def null_blocks(self) -> int:
        return 0

    def describe(self) -> str:
        return self.kind


@dataclass(frozen=True)
class SlidingWindow:
    """A query at position p sees keys in (p - window, p]; older blocks can be freed."""

    window: int
    kind: Literal["sliding_window"] = field(default="sliding_window", init=False)

    def __post_init__(self) -> None:
        _positive("SlidingWindow", "window", self.window)

    def resident_blocks(self, num_tokens: int, block_size: int) -> int:
        # window - 1 earlier keys plus the current token, unaligned to a block boundary
        return min(cdiv(num_tokens, block_size), cdiv(self.window - 1, block_size) + 1)

    def step_blocks(self, max_batched_tokens: int, block_size: int) -> int:
        return cdiv(max_batched_tokens, block_size)

    def first_needed(self, position: int) -> int:
        w = self.window - 1
        return position - w if position > w else 0

    @property
    def null_blocks(self) -> int:
        return 1  # the placeholder for dropped positions

    def describe(self) -> str:
        return f"window {self.window}"


@dataclass(frozen=True)
class ChunkedLocal:
    """Positions attend only inside their aligned chunk of ``chunk`` tokens (Llama 4)."""

    chunk: int
    kind: Literal["chunked_local"] = field(default="chunked_local", init=False)

    def __post_init__(self) -> None:
        _positive("ChunkedLocal", "chunk", self.chunk)

    def resident_blocks(self, num_tokens: int, block_size: int) -> int:
        aligned = self.chunk % block_size == 0
        return min(cdiv(num_tokens, block_size), cdiv(self.chunk, block_size) + (0 if aligned else 1))

    def step_blocks(self, max_batched_tokens: int, block_size: int) -> int:
        return cdiv(max_batched_tokens, block_size)

    def first_needed(self, position: int) -> int:
        return position - position % self.chunk

    @property
    def null_blocks(self) -> int:
        return 1  # the placeholder for dropped positions

    def describe(self) -> str:
        return f"chunk {self.chunk}"


@dataclass(frozen=True)
class Recurrent:
    """One state per request; with prefix caching, a checkpoint every ``checkpoint_every``
    blocks lets a cached prefix resume there (None: no checkpoints, no prefix hits)."""

    checkpoint_every: int | None = None
    kind: Literal["recurrent"] = field(default="recurrent", init=False)

    def __post_init__(self) -> None:
        if self.checkpoint_every is not None:
            _positive("Recurrent", "checkpoint_every", self.checkpoint_every)

    def resident_blocks(self, num_tokens: int, block_size: int) -> int:
        return 0  # a state slot, not blocks

    def step_blocks(self, max_batched_tokens: int, block_size: int) -> int:
        return 0

    def first_needed(self, position: int) -> int:
        return position  # the state summarises everything before

    @property
    def null_blocks(self) -> int:
        return 0

    def describe(self) -> str:
        if self.checkpoint_every:
            return f"recurrent (checkpoint every {self.checkpoint_every} blocks)"
        return self.kind


@dataclass(frozen=True)
class Cross:
    """Encoder (cross-attention) KV: a fixed number of positions per request."""

    max_encoder_len: int
    kind: Literal["cross"] = field(default="cross", init=False)

    def __post_init__(self) -> None:
        _positive("Cross", "max_encoder_len", self.max_encoder_len)

    def resident_blocks(self, num_tokens: int, block_size: int) -> int:
        return cdiv(self.max_encoder_len, block_size)

    def step_blocks(self, max_batched_tokens: int, block_size: int) -> int:
        return 0

    def first_needed(self, position: int) -> int:
        return 0

    @property
    def null_blocks(self) -> int:
        return 0

    def describe(self) -> str:
        return f"cross {self.max_encoder_len}"


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

    def resident_blocks(self, num_tokens: int, block_size: int) -> int:
        return cdiv(num_tokens // self.ratio, block_size)  # complete windows only

    def step_blocks(self, max_batched_tokens: int, block_size: int) -> int:
        return 0  # every entry is already counted as resident

    def first_needed(self, position: int) -> int:
        return 0

    @property
    def null_blocks(self) -> int:
        return 0

    def describe(self) -> str:
        return f"compressed 1/{self.ratio}"


Retention = Union[Full, SlidingWindow, ChunkedLocal, Recurrent, Cross, Compressed]
RETENTION_KINDS = ("full", "sliding_window", "chunked_local", "recurrent", "cross", "compressed")


def blocks_per_request(retention: Retention, num_tokens: int, block_size: int) -> int:
    """Most blocks one request of ``num_tokens`` tokens holds at once, outside the step's
    new tokens (see :func:`step_blocks`). Recurrent layers hold no blocks (0)."""
    if num_tokens < 0 or block_size <= 0:
        raise InvalidArgumentError(
            f"need num_tokens >= 0 and block_size > 0, got {num_tokens}, {block_size}"
        )
    if not hasattr(retention, "resident_blocks"):
        raise ConfigError(f"unknown retention {retention!r}")
    return retention.resident_blocks(num_tokens, block_size)


def step_blocks(retention: Retention, max_batched_tokens: int, block_size: int) -> int:
    """Blocks the tokens of one step add on top of every request's resident window.

    The step's token budget is shared by the whole batch, so this is counted once per
    step, not once per request. Full, cross and compressed layers already count every
    token (entry) they keep.
    """
    return retention.step_blocks(max_batched_tokens, block_size)


def describe(retention: Retention) -> str:
    """Short human form: ``full``, ``window 4096``, ``chunk 8192``, ``recurrent``, ..."""
    return retention.describe()
