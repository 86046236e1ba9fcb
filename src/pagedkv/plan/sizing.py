"""pagedkv's own sizing: one pool per group, split by the workload ratio.

For a request of ``max_model_len`` tokens, token group g holds ``b_g`` blocks
(:func:`pagedkv.kvspec.blocks_per_request`) and the step's shared token budget adds ``s_g``
blocks once per step, not once per request (:func:`pagedkv.kvspec.step_blocks`); a recurrent
group holds one state slot per request. On each rank the largest N with

    budget - alignment >= sum_g (N * b_g + s_g) * page_g + N * state

is N = (budget - alignment - C) / (D + S) with D = sum_g b_g * page_g, C = sum_g s_g * page_g
and S the state bytes of one request. N is the minimum over ranks (block counts are global).
Recurrent groups get an integer number of slots; the bytes left go to the token groups in
the ratio b_g (so every token group holds the same number M of worst-case requests):
num_blocks_g = s_g + ceil(c * b_g), c the largest ratio <= M whose whole blocks fit.
Concurrency at max_model_len is min(slots, c). Slots are ``floor(N)``, or ``floor(N) + 1``
when that fits more (a spare slot is cheap next to a request's KV and lets a last, shorter
request run). A sliding-window or chunked group also keeps ``reserved`` pages no request
holds (the block manager's null block): they are budgeted like the step's blocks and
counted in num_blocks. All arithmetic is exact (integers and fractions).

With a typical request length (:func:`solve_typical`) the same arithmetic runs with b_g
and s_g at that length, for the most requests x of it at once, while every token group
keeps at least the blocks one request of max_model_len needs alone (its floor).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from pagedkv.errors import DoesNotFitError
from pagedkv.kvspec import Retention, bytes_per_request, bytes_per_token
from pagedkv.plan.sizes import format_bytes
from pagedkv.plan.stages import Stage

ALIGNMENT = 256  # byte alignment of every tensor view inside a pool


def reserved_blocks(retention: Retention) -> int:
    """Pages of a group's pool that no request ever holds: one null block for a
    sliding-window or chunked group (block tables hold it for positions the window
    dropped), none otherwise. The planner and the block manager both follow this."""
    return retention.null_blocks


@dataclass(frozen=True)
class GroupDemand:
    """What one request (and one step) asks of a group, in blocks."""

    recurrent: bool
    blocks_per_request: int  # b_g (1 state slot for recurrent groups)
    step_blocks: int  # s_g, once per step
    reserved: int = 0  # pages no request holds (the null block)


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
    room: int  # budget - alignment reserve - reserved (null) pages
    avail: int  # room - step bytes (C)
    kv: int  # D: token bytes of one request at max_model_len
    state: int  # S: state bytes of one request
    step: int  # C
    reserve: int  # alignment
    null: int  # bytes of the reserved pages


def _totals(
    sb: StageBytes, demands: Sequence[GroupDemand], block_size: int, budget: int
) -> _StageTotals:
    kv = state = step = null = 0
    pages: dict[int, int] = {}
    for group, unit in sb.unit.items():
        demand = demands[group]
        if demand.recurrent:
            state += unit
            continue
        page = pages[group] = unit * block_size
        kv += demand.blocks_per_request * page
        step += demand.step_blocks * page
        null += demand.reserved * page
    room = budget - sb.reserve - null
    return _StageTotals(sb.stage, pages, room, room - step, kv, state, step, sb.reserve, null)


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
        slots if d.recurrent else d.reserved + d.step_blocks + held[g]
        for g, d in enumerate(demands)
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
    return _largest_on_grids(best, m, blocks.values(), fits)


def _largest_on_grids(
    lo: Fraction, hi: Fraction, grids: Iterable[int], fits: Callable[[Fraction], bool]
) -> Fraction:
    """Largest x in [lo, hi] on some grid k / b (b in ``grids``) with ``fits(x)``.

    ``fits`` must hold at ``lo`` and be monotone (true up to some point, then false):
    a bisection per grid, each starting above the best found so far.
    """
    best = lo
    for b in grids:
        low, high = math.floor(best * b) + 1, math.floor(hi * b)
        while low <= high:
            mid = (low + high) // 2
            if fits(Fraction(mid, b)):
                best, low = Fraction(mid, b), mid + 1
            else:
                high = mid - 1
    return best


def solve_typical(
    stages: Sequence[StageBytes],
    demands: Sequence[GroupDemand],
    floors: Sequence[int],
    block_size: int,
    budget: int,
) -> Sizing:
    """Block counts for the most requests x of the typical length at once.

    ``demands`` are at the typical length; ``floors[g]`` is the least a token group may
    hold besides its reserved pages (b_g + s_g of one request of max_model_len: the caller
    has checked with :func:`solve` that one fits). Token group g holds
    max(s_g + ceil(x * b_g), floor_g) blocks, a recurrent group ceil(x) slots (at least 1).
    That cost only grows with x and is flat between grid points k / b_g (and integers for
    slots), so the best x is found exactly on those grids; x >= 1 always fits (a request
    of typical length needs no more than one of max_model_len). With the slots fixed, the
    bytes left go to the token groups as in :func:`solve`.
    """
    totals = [_totals(sb, demands, block_size, budget) for sb in stages]
    loaded = [t for t in totals if t.kv + t.state > 0]
    has_state = any(d.recurrent for d in demands)
    grid = sorted({d.blocks_per_request for d in demands if not d.recurrent})

    def token_bytes(t: _StageTotals, c: Fraction) -> int:
        return sum(
            max(demands[g].step_blocks + _ceil(c * demands[g].blocks_per_request), floors[g])
            * page
            for g, page in t.pages.items()
        )

    def slots_for(x: Fraction) -> int:
        return max(_ceil(x), 1) if has_state else 0

    def fits(x: Fraction) -> bool:
        k = slots_for(x)
        return all(token_bytes(t, x) + k * t.state <= t.room for t in loaded)

    hi = min(Fraction(t.avail, t.kv + t.state) for t in loaded)  # no ceilings, no floors
    x = _largest_on_grids(Fraction(1), hi, grid + ([1] if has_state else []), fits)
    slots = slots_for(x)
    c: Fraction | None = None
    if grid:
        token_stages = [t for t in loaded if t.kv > 0]
        c_hi = min(Fraction(t.avail - slots * t.state, t.kv) for t in token_stages)
        c = _largest_on_grids(
            x,
            c_hi,
            grid,
            lambda r: all(token_bytes(t, r) + slots * t.state <= t.room for t in loaded),
        )
    num_blocks = tuple(
        slots
        if d.recurrent
        else d.reserved + max(d.step_blocks + _ceil(c * d.blocks_per_request), floors[g])
        for g, d in enumerate(demands)
    )
    if c is None:
        concurrency = Fraction(slots)
    else:
        concurrency = min(c, Fraction(slots)) if has_state else c
    used = {t.stage: token_bytes(t, c) if c is not None else 0 for t in loaded}
    binding = min((t.room - used[t.stage] - slots * t.state, t.stage) for t in loaded)[1]
    return Sizing(num_blocks, slots, concurrency, c, binding)


def held_requests(num_blocks: Sequence[int], demands: Sequence[GroupDemand]) -> Fraction:
    """Requests of the length ``demands`` describe that pools of ``num_blocks`` hold at once:
    min over token groups of (blocks - reserved - s_g) / b_g, and the state slots."""
    return min(
        Fraction(n) if d.recurrent
        else Fraction(n - d.reserved - d.step_blocks, d.blocks_per_request)
        for n, d in zip(num_blocks, demands)
    )


def _too_small(t: _StageTotals, budget: int, max_model_len: int, many: bool) -> str:
    where = f" on pipeline stage {t.stage}" if many else ""
    parts = [f"{format_bytes(t.kv)} of KV"]
    if t.state:
        parts.append(f"{format_bytes(t.state)} of recurrent state")
    need = t.kv + t.state + t.step + t.null + t.reserve
    null = f", {format_bytes(t.null)} for null blocks" if t.null else ""
    return (
        f"a budget of {budget} bytes ({format_bytes(budget)}) per rank cannot hold one request "
        f"of {max_model_len} tokens{where}: it needs {need} bytes ({format_bytes(need)}): "
        f"{' + '.join(parts)}, {format_bytes(t.step)} for the step's tokens{null} and "
        f"{t.reserve} bytes of alignment; lower --max-model-len or add memory"
    )
