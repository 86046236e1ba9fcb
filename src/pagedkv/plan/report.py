"""A plan as the ``--json`` object (documented key by key in docs/plan.md) and as text."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from pagedkv.errors import DoesNotFitError
from pagedkv.kvspec import Retention
from pagedkv.plan.elastic import PHYSICAL_PAGE_BYTES, PoolBounds, group_floor, plan_bounds
from pagedkv.plan.explain import layer_mix, retention_label
from pagedkv.plan.sizes import format_bytes
from pagedkv.plan.types import (
    Capacity,
    Group,
    Plan,
    Pool,
    StrategyReport,
    TensorView,
    TypicalCapacity,
)


def _retention(ret: Retention) -> dict[str, Any]:
    fields = dataclasses.asdict(ret)
    kind = fields.pop("kind")
    return {"kind": kind, **fields}


def _capacity(cap: Capacity) -> dict[str, Any]:
    return {
        "max_model_len": cap.max_model_len,
        "max_concurrency": cap.max_concurrency,
        "tokens": cap.tokens,
        "limited_by": cap.limited_by,
        "typical": None if cap.typical is None else {
            "len": cap.typical.len,
            "max_concurrency": cap.typical.max_concurrency,
            "tokens": cap.typical.tokens,
        },
    }


def _bounds(plan: Plan) -> dict[int, PoolBounds]:
    """Elastic floor and ceiling of each group's pool (empty when the floors, rounded up to
    whole physical pages, overflow a tight plan: the block manager then keeps fixed pools)."""
    try:
        bounds = plan_bounds(plan)
    except DoesNotFitError:
        return {}
    return {gid: b for b in bounds for gid in b.group_ids}


def _group(g: Group, bounds: dict[int, PoolBounds]) -> dict[str, Any]:
    b = bounds.get(g.id)
    return {
        "id": g.id,
        "layers": list(g.layer_names),
        "models": list(g.models),
        "retention": _retention(g.retention),
        "block_size": g.block_size,
        "position_offset": g.position_offset,
        "bytes_per_token": g.bytes_per_token,
        "bytes_per_request": g.bytes_per_request,
        "page_bytes": g.page_bytes,
        "num_blocks": g.num_blocks,
        "blocks_per_request": g.blocks_per_request,
        "step_blocks": g.step_blocks,
        "reserved_blocks": g.reserved_blocks,
        "pool": g.id if g.pool is None else g.pool,
        # elastic pools: always kept / most the group's pool can hold of the shared budget
        "floor_blocks": group_floor(g) if b else None,
        "ceiling_blocks": b.usable_ceiling if b else None,
    }


def _pool(p: Pool) -> dict[str, Any]:
    return {
        "id": p.id,
        "group_ids": list(p.group_ids),
        "nbytes": p.nbytes,
        "num_pages": p.num_pages,
        "page_bytes": p.page_bytes,
        "reserved_pages": p.reserved_pages,
    }


def _view(v: TensorView) -> dict[str, Any]:
    return {
        "layer": v.layer,
        "tensor": v.tensor,
        "pool": v.pool,
        "offset": v.offset,
        "shape": list(v.shape),
        "dtype": v.dtype.value,
        "nbytes": v.nbytes,
    }


def _alternative(r: StrategyReport) -> dict[str, Any]:
    return {
        "name": r.name,
        "num_blocks": r.num_blocks,
        "padding_bytes": r.padding_bytes,
        "capacity": _capacity(r.capacity),
        "block_size": r.block_size,
        "num_groups": r.num_groups,
        "notes": list(r.notes),
    }


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The ``pagedkv plan --json`` object: plain JSON types only."""
    first = plan.ranks[0]
    bounds = _bounds(plan)
    return {
        "strategy": plan.strategy,
        "budget_bytes": plan.budget_bytes,
        "num_blocks": plan.num_blocks,
        "padding_bytes": plan.padding_bytes,
        "block_size": plan.groups[0].block_size,
        "max_batched_tokens": plan.options.max_batched_tokens,
        "tp": plan.options.tp,
        "pp": plan.options.pp,
        "capacity": _capacity(plan.capacity),
        "groups": [_group(g, bounds) for g in plan.groups],
        "elastic": None if not bounds else {
            "page_bytes": PHYSICAL_PAGE_BYTES,
            "pools": [{"id": b.pool_id, "group_ids": list(b.group_ids),
                       "block_bytes": b.block_bytes, "floor_blocks": b.floor_blocks,
                       "ceiling_blocks": b.ceiling_blocks}
                      for b in dict.fromkeys(bounds.values())],
        },
        "ranks": len(plan.ranks),
        "rank_usage": [
            {
                "tp_rank": r.tp_rank,
                "pp_rank": r.pp_rank,
                "num_layers": len(r.layers),
                "used_bytes": r.used_bytes,
            }
            for r in plan.ranks
        ],
        "pools": [_pool(p) for p in first.pools],
        "views": [_view(v) for v in first.views],
        "alternatives": [_alternative(a) for a in plan.alternatives],
    }


_NUMBER = re.compile(r"\d+")


def compress_names(names: tuple[str, ...], limit: int = 160) -> str:
    """``model.layers.{3,7,11}.self_attn; draft.layers.{0-4}.attn``: first number folded."""
    runs: list[tuple[str, str, list[int]]] = []
    for name in names:
        match = _NUMBER.search(name)
        if match is None:
            runs.append((name, "", []))
            continue
        head, tail, number = name[: match.start()], name[match.end():], int(match.group())
        if runs and runs[-1][0] == head and runs[-1][1] == tail and runs[-1][2]:
            runs[-1][2].append(number)
        else:
            runs.append((head, tail, [number]))
    parts = []
    for head, tail, numbers in runs:
        if not numbers:
            parts.append(head)
        elif len(numbers) == 1:
            parts.append(f"{head}{numbers[0]}{tail}")
        else:
            parts.append(f"{head}{{{_ranges(numbers)}}}{tail}")
    text = "; ".join(parts)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _ranges(numbers: list[int]) -> str:
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.2f}%"


def _typical_text(t: TypicalCapacity) -> str:
    return f"{t.max_concurrency:.2f} requests of {t.len} tokens at once = {t.tokens} tokens"


def _typical_line(cap: Capacity) -> list[str]:
    return [] if cap.typical is None else [f"typical: {_typical_text(cap.typical)}"]


def format_plan(plan: Plan) -> str:
    """Human output: a row per group, capacity, padding, the limit, the comparison."""
    opts = plan.options
    header = (
        "group", "retention", "layers", "models", "block", "B/token", "fixed B/req", "blocks",
        "pool", "floor", "ceiling",
    )
    rows = [header]
    bounds = _bounds(plan)
    for g in plan.groups:
        b = bounds.get(g.id)
        rows.append((
            str(g.id),
            retention_label(g),
            layer_mix([layer.layout for layer in g.layers]),
            ",".join(g.models),
            "-" if g.is_recurrent else str(g.block_size),
            str(g.bytes_per_token),
            str(g.bytes_per_request),
            f"{g.num_blocks} slots" if g.is_recurrent else str(g.num_blocks),
            str(g.id if g.pool is None else g.pool),
            str(group_floor(g)) if b else "-",
            str(b.usable_ceiling) if b else "-",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    per_rank = " per rank" if len(plan.ranks) > 1 else ""
    lines = [
        f"pagedkv plan: {sum(len(g.layers) for g in plan.groups)} layers in {len(plan.groups)} "
        f"block-table groups; budget {format_bytes(plan.budget_bytes)}{per_rank} "
        f"(tp={opts.tp}, pp={opts.pp}); max_model_len {opts.max_model_len}; "
        f"step budget {opts.max_batched_tokens} tokens",
        "",
    ]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    if per_rank:
        lines.append("(bytes per rank: the rank that holds the most of each group)")
    if bounds:
        lines.append("(blocks: the fixed plan; floor / ceiling: what each group always keeps / "
                     "can grow to when the pools share the budget by demand, the default)")
    lines.append("")
    for g in plan.groups:
        lines.append(f"group {g.id} layers: {compress_names(g.layer_names)}")
    cap = plan.capacity
    lines += [
        "",
        f"capacity ({plan.strategy}): {cap.max_concurrency:.2f} requests of {cap.max_model_len} "
        f"tokens at once = {cap.tokens} tokens",
        *_typical_line(cap),
        f"padding: {format_bytes(plan.padding_bytes)} "
        f"({_percent(plan.padding_bytes, plan.budget_bytes)} of the budget)",
        f"limited by: {cap.limited_by}",
    ]
    for alt in plan.alternatives:
        lines.append(
            f"compare {alt.name}: {alt.capacity.max_concurrency:.2f} requests "
            f"({alt.capacity.tokens} tokens), {alt.num_blocks} blocks, padding "
            f"{format_bytes(alt.padding_bytes)} ({_percent(alt.padding_bytes, plan.budget_bytes)})"
            + (f"; {_typical_text(alt.capacity.typical)}" if alt.capacity.typical else "")
            + (f"; {'; '.join(alt.notes)}" if alt.notes else "")
        )
    return "\n".join(lines)
