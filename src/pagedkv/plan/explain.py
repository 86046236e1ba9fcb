"""Words for people: how a group is described, and the one sentence on what limits a plan."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from pagedkv.kvspec import AttentionKV, IndexerKV, Layout, MLALatent, RecurrentState, SharedKV
from pagedkv.plan.sizes import format_bytes
from pagedkv.plan.types import Group, TypicalCapacity


def layout_label(layout: Layout) -> str:
    if isinstance(layout, MLALatent):
        return "MLA"
    if isinstance(layout, AttentionKV):
        return "attention"
    if isinstance(layout, IndexerKV):
        return "indexer"
    if isinstance(layout, SharedKV):
        return "K=V"
    if isinstance(layout, RecurrentState):
        return layout.family
    return getattr(layout, "kind", "cache")  # pragma: no cover


def layer_mix(layouts: Sequence[Layout]) -> str:
    """``29 MLA`` or ``61 MLA + 61 indexer``: layer counts by layout kind."""
    counts: dict[str, int] = {}
    for layout in layouts:
        label = layout_label(layout)
        counts[label] = counts.get(label, 0) + 1
    return " + ".join(f"{n} {label}" for label, n in counts.items())


def retention_label(group: Group) -> str:
    ret = group.retention
    if ret.kind == "sliding_window":
        return f"sliding-window ({ret.window})"  # type: ignore[union-attr]
    if ret.kind == "chunked_local":
        return f"chunked-local ({ret.chunk})"  # type: ignore[union-attr]
    if ret.kind == "compressed":
        return f"compressed (1 per {ret.ratio})"  # type: ignore[union-attr]
    if ret.kind == "cross":
        return f"cross-attention ({ret.max_encoder_len})"  # type: ignore[union-attr]
    return {"full": "full-attention", "recurrent": "recurrent"}.get(ret.kind, ret.kind)


def describe_group(group: Group, layouts: Sequence[Layout], unit: int) -> str:
    """``full-attention group (29 MLA layers, 33408 B/token)``; bytes for one rank."""
    if group.is_recurrent:
        cost = f"{format_bytes(unit)} per request"
    elif group.retention.kind == "compressed":
        cost = f"{unit} B per entry of {group.retention.ratio} tokens"  # type: ignore[union-attr]
    else:
        cost = f"{unit} B/token"
    return f"{retention_label(group)} group ({layer_mix(layouts)} layers, {cost})"


def requests_text(concurrency: Fraction) -> str:
    if concurrency.denominator == 1:
        return f"{concurrency.numerator}"
    return f"{float(concurrency):.2f}"


def limit_sentence(
    *,
    budget: int,
    many_ranks: bool,
    binding_stage: int | None,
    max_model_len: int,
    concurrency: Fraction,
    slots_bind: bool,
    state_text: str | None,
    largest: str,
    largest_share: float,
    typical: TypicalCapacity | None = None,
) -> str:
    """The one sentence of ``capacity.limited_by``."""
    where = " per rank" if many_ranks else ""
    text = (
        f"KV memory: {format_bytes(budget)}{where} holds {requests_text(concurrency)} requests "
        f"of {max_model_len} tokens"
    )
    if typical is not None:
        text += (
            f" (pools sized for {requests_text(Fraction(typical.max_concurrency))} requests "
            f"of {typical.len} tokens)"
        )
    if slots_bind and state_text:
        text += f", one state slot each in the {state_text}"
    text += f"; the {largest} takes {largest_share:.0%} of it"
    if binding_stage is not None:
        text += f" on pipeline stage {binding_stage}"
    return text + "."
