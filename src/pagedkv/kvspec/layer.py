"""LayerSpec (identity + the three concerns) and the block-table compatibility rule."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import ConfigError, IncompatibleLayersError
from pagedkv.kvspec.attention import Attention
from pagedkv.kvspec.layout import Layout, RecurrentState, bytes_per_request, bytes_per_token
from pagedkv.kvspec.retention import (
    ChunkedLocal,
    Recurrent,
    Retention,
    SlidingWindow,
    describe,
)

TARGET = "target"


@dataclass(frozen=True)
class LayerSpec:
    """What one layer of one model keeps.

    ``model`` is ``"target"`` or a drafter's name. ``position_offset`` is how far ahead of
    its position a layer's KV is computed (EAGLE drafters: KV at position i uses token i+1,
    offset 1). ``index`` orders layers inside their model (pipeline splits follow it).
    ``attention`` is None for layers that do not attend (recurrent state).
    """

    name: str
    layout: Layout
    retention: Retention
    attention: Attention | None = None
    model: str = TARGET
    position_offset: int = 0
    index: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("LayerSpec needs a name")
        recurrent_layout = isinstance(self.layout, RecurrentState)
        if recurrent_layout != isinstance(self.retention, Recurrent):
            raise ConfigError(
                f"layer {self.name!r}: a recurrent-state layout needs recurrent retention and "
                f"vice versa (layout {self.layout.kind}, retention {self.retention.kind})"
            )
        if self.position_offset < 0:
            raise ConfigError(f"layer {self.name!r}: position_offset must be >= 0")
        att = self.attention
        if att is not None:
            ret = self.retention
            if att.window is not None and ret.kind not in ("full", "sliding_window"):
                raise ConfigError(
                    f"layer {self.name!r}: an attention window does not fit retention "
                    f"{describe(ret)}"
                )
            if isinstance(ret, SlidingWindow) and (att.window is None or att.window > ret.window):
                raise ConfigError(
                    f"layer {self.name!r}: retention keeps a window of {ret.window} but attention "
                    f"would read {att.window or 'every'} earlier positions"
                )
            if isinstance(ret, ChunkedLocal) and att.chunk != ret.chunk:
                raise ConfigError(
                    f"layer {self.name!r}: chunked retention {ret.chunk} needs an attention "
                    f"chunk mask of the same size, got {att.chunk}"
                )

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(self.layout)

    @property
    def bytes_per_request(self) -> int:
        return bytes_per_request(self.layout)


@dataclass(frozen=True)
class Compatibility:
    """Answer to "can these layers share a block table?"; falsy when they cannot."""

    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


def block_table_compatibility(
    a: LayerSpec, b: LayerSpec, block_size_a: int, block_size_b: int
) -> Compatibility:
    """Layers share a block table when retention, block size and positions line up.

    Layout and attention never matter: each layer keeps its own tensor, and masks are
    decided per invocation.
    """
    if a.retention != b.retention:
        return Compatibility(
            False,
            f"{a.name} keeps {describe(a.retention)} but {b.name} keeps {describe(b.retention)}",
        )
    if block_size_a != block_size_b:
        return Compatibility(
            False, f"block sizes differ: {a.name} {block_size_a}, {b.name} {block_size_b}"
        )
    if a.position_offset != b.position_offset:
        return Compatibility(
            False,
            f"positions do not line up: {a.name} offset {a.position_offset}, "
            f"{b.name} offset {b.position_offset}",
        )
    return Compatibility(True, "same retention, block size and positions")


def require_block_table_compatible(
    a: LayerSpec, b: LayerSpec, block_size_a: int, block_size_b: int
) -> None:
    """Raise :class:`IncompatibleLayersError` with the reason when layers cannot share."""
    verdict = block_table_compatibility(a, b, block_size_a, block_size_b)
    if not verdict:
        raise IncompatibleLayersError(verdict.reason)
