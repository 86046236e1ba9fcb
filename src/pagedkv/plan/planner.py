"""make_plan: layers (target + drafter) and a budget -> groups, pools, views, capacity.

Steps, each in its own module: group layers by block table (grouping), place them on
pipeline stages with tensor-parallel shards (stages), let groups whose layers pair up share
one pool (sharing), size each pool by the workload ratio (sizing), lay the tensors out in the pools (views), and model what vLLM's
planner would fit with the same budget (vllm_model). Linear in the number of layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

from pagedkv.errors import InvalidArgumentError
from pagedkv.kvspec import LayerSpec, blocks_per_request, cdiv, step_blocks
from pagedkv.plan.explain import describe_group, limit_sentence
from pagedkv.plan.grouping import LayerGroup, default_block_size, group_layers
from pagedkv.plan.sharing import PoolMap, pool_sets
from pagedkv.plan.sizing import (
    GroupDemand,
    Sizing,
    StageBytes,
    held_requests,
    reserved_blocks,
    solve,
    solve_typical,
    stage_bytes,
)
from pagedkv.plan.stages import Stage, split_stages
from pagedkv.plan.types import (
    Capacity,
    Group,
    Plan,
    PlanOptions,
    Pool,
    RankPlan,
    StrategyReport,
    TensorView,
    TypicalCapacity,
)
from pagedkv.plan.views import stage_pools
from pagedkv.plan.vllm_model import vllm_report

STRATEGY = "pagedkv"
STRATEGIES = ("auto", STRATEGY)  # strategies make_plan can build; "vllm" is reported only
MAX_LEN_STRATEGY = "pagedkv-max-len"  # reported next to a plan sized for typical_len


MAX_RANKS = 1 << 16  # far beyond any deployment; the plan holds one entry per rank


def _check_options(options: PlanOptions) -> None:
    for key in ("budget_bytes", "max_model_len", "max_batched_tokens", "tp", "pp"):
        value = getattr(options, key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidArgumentError(f"{key} must be a positive integer, got {value!r}")
    if options.tp * options.pp > MAX_RANKS:  # (a plan lists every rank)
        raise InvalidArgumentError(
            f"tp {options.tp} x pp {options.pp} = {options.tp * options.pp} ranks; at most "
            f"{MAX_RANKS:,} are planned")
    bs = options.block_size
    if bs is not None and (not isinstance(bs, int) or isinstance(bs, bool) or bs <= 0):
        raise InvalidArgumentError(f"block_size must be a positive integer, got {bs!r}")
    typical = options.typical_len
    if typical is not None and (
        not isinstance(typical, int) or isinstance(typical, bool) or typical <= 0
    ):
        raise InvalidArgumentError(f"typical_len must be a positive integer, got {typical!r}")
    if typical is not None and typical > options.max_model_len:
        raise InvalidArgumentError(
            f"typical_len {typical} exceeds max_model_len {options.max_model_len}"
        )
    if options.strategy not in STRATEGIES:
        raise InvalidArgumentError(
            f"unknown strategy {options.strategy!r}; make_plan builds {STRATEGIES} "
            "(the vLLM-style plan is reported in Plan.alternatives)"
        )


def make_plan(layers: Sequence[LayerSpec], options: PlanOptions) -> Plan:
    """Plan the KV cache of ``layers`` (every rank's, target and drafters) in ``options``.

    With ``options.typical_len`` the pools are sized for the most requests of that length
    (one of ``max_model_len`` still fits); the plan sized for ``max_model_len`` is then
    reported in ``alternatives`` as ``pagedkv-max-len``.
    Raises InvalidArgumentError for a bad option or no layers, ConfigError for duplicate
    layer names, DoesNotFitError when one request of ``max_model_len`` does not fit.
    """
    _check_options(options)
    layers = tuple(layers)
    if not layers:
        raise InvalidArgumentError("make_plan needs at least one layer")
    block_size = options.block_size or default_block_size(layers)
    layer_groups, group_of = group_layers(layers)
    stages = split_stages(layers, group_of, options.tp, options.pp)
    demands = [_demand(g, block_size, options.max_model_len, options) for g in layer_groups]
    per_stage = [stage_bytes(stage, demands, block_size) for stage in stages]
    pools = PoolMap.of(pool_sets(stages, demands))
    layout = _Layout(options, layer_groups, stages, per_stage, demands, block_size, pools)
    pool_demands, per_pool = layout.pool_demands, layout.per_pool
    sizing = solve(per_pool, pool_demands, block_size, options.budget_bytes, options.max_model_len)
    alternatives = [
        vllm_report(
            stages,
            options.budget_bytes,
            block_size,
            options.max_model_len,
            options.max_batched_tokens,
            options.pp,
        ),
    ]
    if options.typical_len is None:
        built = sizing
        capacity = layout.capacity(sizing, sizing.concurrency, None)
    else:
        typical = pools.demands(
            [_demand(g, block_size, options.typical_len, options) for g in layer_groups]
        )
        floors = [d.blocks_per_request + d.step_blocks for d in pool_demands]
        built = solve_typical(per_pool, typical, floors, block_size, options.budget_bytes)
        capacity = layout.capacity(
            built, held_requests(built.num_blocks, pool_demands), built.concurrency
        )
        longest = layout.capacity(
            sizing, sizing.concurrency, held_requests(sizing.num_blocks, typical)
        )
        alternatives.append(layout.report(sizing, longest))
    groups, ranks, data_bytes = layout.build(built.num_blocks)
    return Plan(
        options=options,
        budget_bytes=options.budget_bytes,
        strategy=STRATEGY,
        groups=groups,
        ranks=ranks,
        capacity=capacity,
        padding_bytes=options.budget_bytes - data_bytes[built.binding_stage],
        alternatives=tuple(alternatives),
    )


def _demand(
    group: LayerGroup, block_size: int, length: int, options: PlanOptions
) -> GroupDemand:
    """A group's worst case per request of ``length`` tokens and per step. A window or
    chunk that frees nothing within that length holds every block of the request already:
    the step's new tokens are among them, so they cost no extra blocks."""
    if group.retention.kind == "recurrent":
        return GroupDemand(True, 1, 0)
    held = blocks_per_request(group.retention, length, block_size)
    if group.retention.kind == "compressed" and held == 0:
        held = 1  # shorter than one window: no entry yet, but the sizing divides by b_g
    step = step_blocks(group.retention, options.max_batched_tokens, block_size)
    if held >= cdiv(length, block_size):
        step = 0
    return GroupDemand(False, held, step, reserved_blocks(group.retention))


class _Layout:
    """Turns a sizing (pages per pool index) into groups, rank pools and views, a capacity
    and a report."""

    def __init__(
        self,
        options: PlanOptions,
        layer_groups: Sequence[LayerGroup],
        stages: Sequence[Stage],
        per_stage: Sequence[StageBytes],
        demands: Sequence[GroupDemand],
        block_size: int,
        pools: PoolMap,
    ) -> None:
        self.options = options
        self.layer_groups = layer_groups
        self.stages = stages
        self.per_stage = per_stage  # per group
        self.demands = demands  # per group
        self.block_size = block_size
        self.pool_map = pools
        self.pool_demands = pools.demands(demands)
        if len(pools.sets) == len(demands):  # no pool shared: pool index = group index
            self.per_pool = list(per_stage)
        else:
            self.per_pool = [stage_bytes(pools.lead_stage(s), self.pool_demands, block_size)
                             for s in stages]

    def groups(self, num_pages: Sequence[int]) -> tuple[Group, ...]:
        """Groups; one in a shared pool reports the pool's pages and reserved pages."""
        pm = self.pool_map
        return tuple(
            _group(
                i, g, self.demands[i], self.block_size, num_pages[pm.pool_of[i]],
                self.per_stage, self.pool_demands[pm.pool_of[i]].reserved, pm.pool_id(i),
            )
            for i, g in enumerate(self.layer_groups)
        )

    def pools(
        self, stage: Stage, num_blocks: Sequence[int]
    ) -> tuple[tuple[Pool, ...], tuple[TensorView, ...]]:
        return stage_pools(
            stage,
            self.pool_map,
            self.per_pool[stage.index],
            [d.recurrent for d in self.pool_demands],
            [d.reserved for d in self.pool_demands],
            num_blocks,
            self.block_size,
        )

    def build(
        self, num_blocks: Sequence[int]
    ) -> tuple[tuple[Group, ...], tuple[RankPlan, ...], dict[int, int]]:
        """Groups, every rank's pools and views, and the data bytes of each stage."""
        ranks: list[RankPlan] = []
        data_bytes: dict[int, int] = {}
        for stage in self.stages:
            pools, views = self.pools(stage, num_blocks)
            data_bytes[stage.index] = _data_bytes(stage, views)
            names = tuple(member.layer.name for member in stage.layers)
            used = sum(p.nbytes for p in pools)
            ranks.extend(
                RankPlan(tp_rank, stage.index, names, pools, views, used)
                for tp_rank in range(self.options.tp)
            )
        return self.groups(num_blocks), tuple(ranks), data_bytes

    def capacity(
        self, sizing: Sizing, at_max_len: Fraction, at_typical: Fraction | None
    ) -> Capacity:
        """Capacity of ``sizing``'s pools: ``at_max_len`` requests of max_model_len, and
        ``at_typical`` of typical_len (None without one)."""
        opts = self.options
        typical = None
        if at_typical is not None and opts.typical_len is not None:
            typical = TypicalCapacity(
                opts.typical_len,
                float(at_typical),
                math.floor(at_typical * opts.typical_len),
            )
        token = [
            held_requests([n], [d])
            for n, d in zip(sizing.num_blocks, self.pool_demands)
            if not d.recurrent
        ]
        slots_bind = sizing.slots > 0 and (not token or sizing.slots <= min(token))
        share = {
            g: Fraction(self.demands[g].blocks_per_request, self.pool_demands[p].blocks_per_request)
            for p, groups in enumerate(self.pool_map.sets) if len(groups) > 1 for g in groups
        }
        limited_by = _limited_by(
            opts, self.groups(sizing.num_blocks), self.stages, self.per_stage, sizing,
            self.block_size, at_max_len, slots_bind, typical, share,
        )
        return Capacity(
            opts.max_model_len,
            float(at_max_len),
            math.floor(at_max_len * opts.max_model_len),
            limited_by,
            typical,
        )

    def report(self, sizing: Sizing, capacity: Capacity) -> StrategyReport:
        """``sizing`` (pools for requests of max_model_len) as a comparison row."""
        stage = self.stages[sizing.binding_stage]
        _, views = self.pools(stage, sizing.num_blocks)
        return StrategyReport(
            name=MAX_LEN_STRATEGY,
            num_blocks=sum(sizing.num_blocks),
            padding_bytes=self.options.budget_bytes - _data_bytes(stage, views),
            capacity=capacity,
            notes=("pools sized for requests of max_model_len (no typical_len)",),
            block_size=self.block_size,
            num_groups=len(self.layer_groups),
        )


def _data_bytes(stage: Stage, views: Sequence[TensorView]) -> int:
    """Bytes of a rank's views, each shared-pool alias counted once (its first group's)."""
    group_of = {m.layer.name: m.group for m in stage.layers}
    return sum(v.nbytes for v in views if group_of[v.layer] == v.pool)


def _group(
    gid: int,
    group: LayerGroup,
    demand: GroupDemand,
    block_size: int,
    num_blocks: int,
    per_stage: Sequence[StageBytes],
    reserved: int,
    pool: int,
) -> Group:
    unit = max(sb.unit.get(gid, 0) for sb in per_stage)  # the rank with the most bytes
    return Group(
        id=gid,
        layers=group.layers,
        retention=group.retention,
        block_size=block_size,
        position_offset=group.position_offset,
        models=group.models,
        bytes_per_token=0 if demand.recurrent else unit,
        bytes_per_request=unit if demand.recurrent else 0,
        num_blocks=num_blocks,
        blocks_per_request=demand.blocks_per_request,
        step_blocks=demand.step_blocks,
        reserved_blocks=reserved,
        pool=pool,
    )


def _limited_by(
    options: PlanOptions,
    groups: Sequence[Group],
    stages: Sequence[Stage],
    per_stage: Sequence[StageBytes],
    sizing: Sizing,
    block_size: int,
    concurrency: Fraction,
    slots_bind: bool,
    typical: TypicalCapacity | None,
    share: dict[int, Fraction],
) -> str:
    """``share[g]``: the part of a shared pool group g's requests take (b_g / sum b)."""
    stage = stages[sizing.binding_stage]
    units = per_stage[sizing.binding_stage].unit
    layouts: dict[int, list] = {}
    for member in stage.layers:
        layouts.setdefault(member.group, []).append(member.layout)

    def held(g: Group) -> int:
        unit = units[g.id]
        held = g.num_blocks * (unit if g.is_recurrent else unit * block_size)
        return held * share.get(g.id, 1)

    largest = max((g for g in groups if g.id in units), key=held)
    state = [g for g in groups if g.is_recurrent and g.id in units]
    state_text = None
    if state:
        biggest = max(state, key=lambda g: units[g.id])
        state_text = describe_group(biggest, layouts[biggest.id], units[biggest.id])
    return limit_sentence(
        budget=options.budget_bytes,
        many_ranks=options.tp * options.pp > 1,
        binding_stage=sizing.binding_stage if options.pp > 1 else None,
        max_model_len=options.max_model_len,
        concurrency=concurrency,
        slots_bind=slots_bind and bool(state),
        state_text=state_text,
        largest=describe_group(largest, layouts[largest.id], units[largest.id]),
        largest_share=float(held(largest)) / options.budget_bytes,
        typical=typical,
    )
