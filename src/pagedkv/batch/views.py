"""Attention groups and their per-invocation views of a block-table group's metadata.

An attention group is the layers of ONE model that run ONE kernel configuration. Its view
of an invocation carries that invocation's ``causal`` flag and a decode/prefill split
computed from that invocation's query lengths and this group's own ``decode_threshold``.
Views are built from (metadata, attention group, causal) only: nothing one attention group
asks for can reach another's view, even when both read the same block table.

The split is given as index lists, rows are NOT reordered: ``decode_reqs`` /
``prefill_reqs`` are batch-row indices in ascending order (padding rows are in neither);
token rows of request i stay at query_start_loc[i]..query_start_loc[i + 1].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

from pagedkv.batch.metadata import GroupMetadata
from pagedkv.errors import ConfigError, InvalidArgumentError, UnsupportedCapabilityError
from pagedkv.kvspec import LayerSpec


@dataclass(frozen=True)
class AttentionGroup:
    """Layers of one model sharing one kernel configuration, and what that kernel can do.

    ``decode_threshold``: the longest query its decode kernel takes (rows with a query of
    at most this many tokens are decodes). ``supports_non_causal``: the kernel can run
    bidirectional draft blocks of exactly ``draft_block`` query rows per request.
    """

    name: str
    model: str
    layer_names: tuple[str, ...]
    supports_non_causal: bool = False
    decode_threshold: int = 1
    draft_block: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        if not self.layer_names:
            raise ConfigError(f"attention group {self.name!r} has no layers")
        t = self.decode_threshold
        if not isinstance(t, int) or isinstance(t, bool) or t < 1:
            raise ConfigError(f"attention group {self.name!r}: decode_threshold must be >= 1, got {t!r}")
        b = self.draft_block
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ConfigError(f"attention group {self.name!r}: draft_block must be >= 1, got {b!r}")

    @classmethod
    def from_layers(
        cls,
        name: str,
        layers: Sequence[LayerSpec],
        *,
        supports_non_causal: bool = False,
        decode_threshold: int = 1,
    ) -> AttentionGroup:
        """Group layers of one model; the draft block comes from their Attention."""
        if not layers:
            raise ConfigError(f"attention group {name!r} has no layers")
        models = sorted({layer.model for layer in layers})
        if len(models) > 1:
            raise ConfigError(f"attention group {name!r} mixes models {models}: one model per group")
        missing = [layer.name for layer in layers if layer.attention is None]
        if missing:
            raise ConfigError(f"attention group {name!r}: layers {missing} do not attend")
        blocks = sorted({layer.attention.draft_block or 0 for layer in layers})  # type: ignore[union-attr]
        if len(blocks) > 1:
            raise ConfigError(f"attention group {name!r} mixes draft blocks {blocks}")
        return cls(
            name=name,
            model=models[0],
            layer_names=tuple(layer.name for layer in layers),
            supports_non_causal=supports_non_causal,
            decode_threshold=decode_threshold,
            draft_block=blocks[0] or None,
        )


@dataclass(frozen=True, eq=False)
class AttentionView:
    """What one attention group's kernels need for one invocation, besides the metadata."""

    group: AttentionGroup
    metadata: GroupMetadata
    causal: bool
    decode_reqs_host: tuple[int, ...]
    prefill_reqs_host: tuple[int, ...]
    num_decode_tokens: int
    num_prefill_tokens: int

    @cached_property
    def _rows_device(self) -> torch.Tensor:
        """Decode rows then prefill rows, int32, on the metadata's device. Copied on first use
        only: a step whose kernels take the mixed batch whole (pagedkv.ops.triton) makes no
        copy here, so build_metadata's single copy stays the step's only one."""
        both = torch.tensor(self.decode_reqs_host + self.prefill_reqs_host, dtype=torch.int32)
        device = self.metadata.seq_lens.device
        if device.type == "cuda":
            both = both.pin_memory()
        if device.type != "cpu":
            both = both.to(device, non_blocking=True)
        return both

    @property
    def decode_reqs(self) -> torch.Tensor:
        """int32 [num_decodes] batch rows, ascending (on the metadata's device)."""
        return self._rows_device[: self.num_decodes]

    @property
    def prefill_reqs(self) -> torch.Tensor:
        """int32 [num_prefills] batch rows, ascending (on the metadata's device)."""
        return self._rows_device[self.num_decodes :]

    @property
    def decode_threshold(self) -> int:
        return self.group.decode_threshold

    @property
    def num_decodes(self) -> int:
        return len(self.decode_reqs_host)

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_reqs_host)


def attention_view(meta: GroupMetadata, group: AttentionGroup, *, causal: bool) -> AttentionView:
    """This invocation's view for one attention group (``causal`` is per invocation).

    A non-causal invocation needs the group's ``supports_non_causal`` capability, a declared
    ``draft_block``, and every request's query length equal to it; otherwise
    :class:`UnsupportedCapabilityError` (never a silent causal fallback).
    """
    names = meta.layer_names
    if group.layer_names != names:
        known = frozenset(names)
        foreign = [name for name in group.layer_names if name not in known]
        if foreign:
            raise InvalidArgumentError(
                f"attention group {group.name!r}: layers {foreign} are not in block-table group "
                f"{meta.group_id} ({len(names)} layers)"
            )
    q_lens = meta.query_lens_host
    shortest, longest = meta.min_query_len, meta.max_query_len
    if not causal:
        if not group.supports_non_causal:
            raise UnsupportedCapabilityError(
                f"attention group {group.name!r} ({group.model}) was asked for a non-causal "
                "invocation but its kernel does not declare supports_non_causal"
            )
        if group.draft_block is None:
            raise UnsupportedCapabilityError(
                f"attention group {group.name!r}: a non-causal invocation needs a draft block "
                "size, and the group declares none"
            )
        if shortest != group.draft_block or longest != group.draft_block:
            odd = [(i, q) for i, q in enumerate(q_lens) if q != group.draft_block]
            raise UnsupportedCapabilityError(
                f"attention group {group.name!r}: non-causal invocation needs every query "
                f"length equal to the draft block {group.draft_block}; (row, length) {odd[:8]}"
            )
    threshold = group.decode_threshold
    if shortest > 0 and longest <= threshold:  # all decodes: no per-row Python work
        decodes: tuple[int, ...] = _all_rows(len(q_lens))
        prefills: tuple[int, ...] = ()
        decode_tokens, prefill_tokens = meta.num_tokens, 0
    elif shortest > threshold:  # all prefills
        decodes, prefills = (), _all_rows(len(q_lens))
        decode_tokens, prefill_tokens = 0, meta.num_tokens
    else:
        decodes = tuple(i for i, q in enumerate(q_lens) if 0 < q <= threshold)
        prefills = tuple(i for i, q in enumerate(q_lens) if q > threshold)
        decode_tokens = sum(q_lens[i] for i in decodes)
        prefill_tokens = sum(q_lens[i] for i in prefills)
    # filled through the instance dict: the frozen __init__ costs one object.__setattr__ per
    # field, a few us of a decode step's host time (AttentionView has no __post_init__)
    view = object.__new__(AttentionView)
    view.__dict__.update(
        group=group,
        metadata=meta,
        causal=causal,
        decode_reqs_host=decodes,
        prefill_reqs_host=prefills,
        num_decode_tokens=decode_tokens,
        num_prefill_tokens=prefill_tokens,
    )
    return view


@lru_cache(maxsize=64)
def _all_rows(n: int) -> tuple[int, ...]:
    return tuple(range(n))
