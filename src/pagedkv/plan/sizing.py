"""pagedkv's own sizing: one pool per group, split by the workload ratio.

For a request of ``max_model_len`` tokens, token group g holds ``b_g`` blocks
(:func:`pagedkv.spec.blocks_per_request`) and the step's shared token budget adds ``s_g``
blocks once per step, not once per request (:func:`pagedkv.spec.step_blocks`); a recurrent
group holds one state slot per request. On each rank the largest N with

    budget - alignment >= sum_g (N * b_g + s_g) * page_g + N * state

is N = (budget - alignment - C) / (D + S) with D = sum_g b_g * page_g, C = sum_g s_g * page_g
and S the state bytes of one request. N is the minimum over ranks (block counts are global).
Recurrent groups get an integer number of slots; the bytes left go to the token groups in
the ratio b_g (so every token group holds the same number M of worst-case requests):
num_blocks_g = s_g + ceil(c * b_g), c the largest ratio <= M whose whole blocks fit.
Concurrency at max_model_len is min(slots, c). Slots are ``floor(N)``, or ``floor(N) + 1``
when that fits more (a spare slot is cheap next to a request's KV and lets a last, shorter
request run). All arithmetic is exact (integers and fractions).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from pagedkv.errors import DoesNotFitError
from pagedkv.plan.sizes import format_bytes
from pagedkv.plan.stages import Stage
from pagedkv.spec import bytes_per_request, bytes_per_token

ALIGNMENT = 256  # byte alignment of every tensor view inside a pool


@dataclass(frozen=True)
class GroupDemand:
    """What one request (and one step) asks of a group, in blocks."""

    recurrent: bool
    blocks_per_request: int  # b_g (1 state slot for recurrent groups)
    step_blocks: int  # s_g, once per step


@dataclass(frozen=True)
class StageBytes:
    """One rank's bytes per block (or per slot) of each group, and its alignment reserve."""

    stage: int
    unit: dict[int, int]  # group -> bytes per token (token groups) or per state slot
    reserve: int  # most bytes 256-byte alignment of its views can cost


@dataclass(frozen=True)
class Sizing:
    num_blocks: tuple[int, ...]  # per group; state slots for recurrent groups
    slots: int
    concurrency: Fraction  # requests of max_model_len at once
    token_requests: Fraction | None  # c: requests the token groups alone hold
    binding_stage: int


def _gap(unit: int) -> int:
    """Largest alignment gap after a tensor of ``n * unit`` bytes, whatever n is."""
    return ALIGNMENT - math.gcd(unit, ALIGNMENT)


def stage_bytes(stage: Stage, demands: Sequence[GroupDemand], block_size: int) -> StageBytes:
    unit: dict[int, int] = {}
    reserve = 0
    per_layout: dict[object, tuple[int, int]] = {}  # layout -> (bytes, reserve)
    for member in stage.layers:
        cached = per_layout.get(member.layout)
        if cached is None:
            if demands[member.group].recurrent:
                sizes = [t.nbytes for t in member.layout.request_tensors()]
                cached = (bytes_per_request(member.layout), sum(_gap(n) for n in sizes))
            else:
                sizes = [t.nbytes * block_size for t in member.layout.token_tensors()]
                cached = (bytes_per_token(member.layout), sum(_gap(n) for n in sizes))
            per_layout[member.layout] = cached
        unit[member.group] = unit.get(member.group, 0) + cached[0]
        reserve += cached[1]
    return StageBytes(stage.index, unit, reserve)


@dataclass(frozen=True)
class _StageTotals:
    stage: int
    pages: dict[int, int]  # token group -> bytes of one block on this rank
    avail: int  # budget - alignment reserve - step bytes (C)
    kv: int  # D: token bytes of one request at max_model_len
    state: int  # S: state bytes of one request
    step: int  # C
    reserve: int  # alignment


def _totals(
    sb: StageBytes, demands: Sequence[GroupDemand], block_size: int, budget: int
) -> _StageTotals:
    kv = state = step = 0
    pages: dict[int, int] = {}
    for group, unit in sb.unit.items():
        demand = demands[group]
        if demand.recurrent:
            state += unit
            continue
        page = pages[group] = unit * block_size
        kv += demand.blocks_per_request * page
        step += demand.step_blocks * page
    return _StageTotals(
        sb.stage, pages, budget - sb.reserve - step, kv, state, step, sb.reserve
    )


def solve(
    stages: Sequence[StageBytes],
    demands: Sequence[GroupDemand],
    block_size: int,
    budget: int,
    max_model_len: int,
) -> Sizing:
    """Block counts per group that fit ``budget`` on every rank; see the module docstring."""
    totals = [_totals(sb, demands, block_size, budget) for sb in stages]
    loaded = [t for t in totals if t.kv + t.state > 0]
    for t in loaded:
        if t.avail < t.kv + t.state:
            raise DoesNotFitError(_too_small(t, budget, max_model_len, len(stages) > 1))
    n = min(Fraction(t.avail, t.kv + t.state) for t in loaded)
    has_state = any(d.recurrent for d in demands)
    has_tokens = any(not d.recurrent for d in demands)
    if not has_state:
        candidates = [0]
    elif has_tokens:
        candidates = [math.floor(n), math.floor(n) + 1]
    else:
        candidates = [math.floor(n)]
    best: Sizing | None = None
    for slots in candidates:
        sizing = _size(loaded, demands, slots, has_state)
        if sizing is not None and (best is None or sizing.concurrency > best.concurrency):
            best = sizing
    if best is None:  # pragma: no cover - floor(n) always fits
        raise DoesNotFitError(f"no block split fits a budget of {budget} bytes")
    return best


def _size(
    totals: Sequence[_StageTotals], demands: Sequence[GroupDemand], slots: int, has_state: bool
) -> Sizing | None:
    """Blocks per group for ``slots`` state slots, or None when the slots do not fit."""
    left = {t.stage: t.avail - slots * t.state for t in totals}
    if any(rest < 0 for rest in left.values()):
        return None
    token_stages = [t for t in totals if t.kv > 0]
    if not token_stages:
        binding = min((Fraction(t.avail, t.state), t.stage) for t in totals)[1]
        return Sizing(tuple(slots for _ in demands), slots, Fraction(slots), None, binding)
    m, binding = min((Fraction(left[t.stage], t.kv), t.stage) for t in token_stages)
    ratio = _best_ratio(m, demands, token_stages, left)
    held = {
        g: _ceil(ratio * d.blocks_per_request) for g, d in enumerate(demands) if not d.recurrent
    }
    num_blocks = tuple(
        slots if d.recurrent else d.step_blocks + held[g] for g, d in enumerate(demands)
    )
    concurrency = min(ratio, Fraction(slots)) if has_state else ratio
    return Sizing(num_blocks, slots, concurrency, ratio, binding)


def _ceil(x: Fraction) -> int:
    return -(-x.numerator // x.denominator)


def _best_ratio(
    m: Fraction,
    demands: Sequence[GroupDemand],
    stages: Sequence[_StageTotals],
    left: dict[int, int],
) -> Fraction:
    """Largest c whose whole blocks, ceil(c * b_g) per token group, fit every rank.

    Flooring every group at the continuous optimum m fits but can cost a small window group
    (b_g = 9 blocks) a ninth of a request; c lies on some group's grid k / b_g in
    [that floor, m], and the cost only grows with c, so a bisection per group finds it.
    """
    blocks = {g: d.blocks_per_request for g, d in enumerate(demands) if not d.recurrent}

    def fits(c: Fraction) -> bool:
        return all(
            sum(_ceil(c * blocks[g]) * page for g, page in t.pages.items()) <= left[t.stage]
            for t in stages
        )

    best = min(Fraction(math.floor(m * b), b) for b in blocks.values())
    for b in blocks.values():
        lo, hi = math.floor(best * b) + 1, math.floor(m * b)
        while lo <= hi:
            mid = (lo + hi) // 2
            if fits(Fraction(mid, b)):
                best, lo = Fraction(mid, b), mid + 1
            else:
                hi = mid - 1
    return best


def _too_small(t: _StageTotals, budget: int, max_model_len: int, many: bool) -> str:
    where = f" on pipeline stage {t.stage}" if many else ""
    parts = [f"{format_bytes(t.kv)} of KV"]
    if t.state:
        parts.append(f"{format_bytes(t.state)} of recurrent state")
    need = t.kv + t.state + t.step + t.reserve
    return (
        f"a budget of {budget} bytes ({format_bytes(budget)}) per rank cannot hold one request "
        f"of {max_model_len} tokens{where}: it needs {need} bytes ({format_bytes(need)}): "
        f"{' + '.join(parts)}, {format_bytes(t.step)} for the step's tokens and "
        f"{t.reserve} bytes of alignment; lower --max-model-len or add memory"
    )
