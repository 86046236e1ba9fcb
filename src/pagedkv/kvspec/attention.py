"""Attention: how a layer's queries see keys. Read by metadata builders and kernels only.

Nothing here influences grouping or memory. A model's layers that run one kernel
configuration form an attention group; causality is decided per invocation.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import ConfigError


@dataclass(frozen=True)
class Attention:
    """Mask and scaling of one attention layer.

    ``draft_block``: queries come in blocks of this size (DSpark/DFlash drafters); a block
    sees the context before its anchor and every position of its own block (non-causal).
    ``window``/``chunk``: mask limits, which must fit inside the layer's Retention.
    """

    causal: bool = True
    draft_block: int | None = None
    window: int | None = None
    chunk: int | None = None
    sinks: bool = False
    soft_cap: float | None = None
    scale: float | None = None

    def __post_init__(self) -> None:
        for key in ("draft_block", "window", "chunk"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ConfigError(f"Attention: {key} must be a positive integer, got {value!r}")
        if self.draft_block is not None and self.causal:
            raise ConfigError(
                f"Attention: a draft block of {self.draft_block} is non-causal inside the "
                "block; set causal=False"
            )
        if self.soft_cap is not None and not self.soft_cap > 0:
            raise ConfigError(f"Attention: soft_cap must be > 0, got {self.soft_cap!r}")
        if self.window is not None and self.chunk is not None:
            raise ConfigError("Attention: window and chunk masks are exclusive")

    def describe(self) -> str:
        parts = ["causal" if self.causal else f"non-causal draft block {self.draft_block}"]
        if self.window:
            parts.append(f"window {self.window}")
        if self.chunk:
            parts.append(f"chunk {self.chunk}")
        if self.sinks:
            parts.append("sinks")
        if self.soft_cap:
            parts.append(f"soft-cap {self.soft_cap:g}")
        return ", ".join(parts)
