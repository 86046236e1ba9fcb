"""make_plan: layers (target + drafter) and a budget -> groups, pools, views, capacity.

Steps, each in its own module: group layers by block table (grouping), place them on
pipeline stages with tensor-parallel shards (stages), size each group's pool by the
workload ratio (sizing), lay the tensors out in the pools (views), and model what vLLM's
planner would fit with the same budget (vllm_model). Linear in the number of layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pagedkv.errors import InvalidArgumentError
from pagedkv.plan.explain import describe_group, limit_sentence
from pagedkv.plan.grouping import LayerGroup, default_block_size, group_layers
from pagedkv.plan.sizing import GroupDemand, Sizing, StageBytes, solve, stage_bytes
from pagedkv.plan.stages import Stage, split_stages
from pagedkv.plan.types import Capacity, Group, Plan, PlanOptions, RankPlan
from pagedkv.plan.views import stage_pools
from pagedkv.plan.vllm_model import vllm_report
from pagedkv.spec import LayerSpec, blocks_per_request, cdiv, step_blocks

STRATEGY = "pagedkv"
STRATEGIES = ("auto", STRATEGY)  # strategies make_plan can build; "vllm" is reported only


def _check_options(options: PlanOptions) -> None:
    for key in ("budget_bytes", "max_model_len", "max_batched_tokens", "tp", "pp"):
        value = getattr(options, key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidArgumentError(f"{key} must be a positive integer, got {value!r}")
    bs = options.block_size
    if bs is not None and (not isinstance(bs, int) or isinstance(bs, bool) or bs <= 0):
        raise InvalidArgumentError(f"block_size must be a positive integer, got {bs!r}")
    if options.strategy not in STRATEGIES:
        raise InvalidArgumentError(
            f"unknown strategy {options.strategy!r}; make_plan builds {STRATEGIES} "
            "(the vLLM-style plan is reported in Plan.alternatives)"
        )


def make_plan(layers: Sequence[LayerSpec], options: PlanOptions) -> Plan:
    """Plan the KV cache of ``layers`` (every rank's, target and drafters) in ``options``.

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
    demands = [_demand(g, block_size, options) for g in layer_groups]
    per_stage = [stage_bytes(stage, demands, block_size) for stage in stages]
    sizing = solve(per_stage, demands, block_size, options.budget_bytes, options.max_model_len)
    groups = tuple(
        _group(i, g, demands[i], block_size, sizing.num_blocks[i], per_stage)
        for i, g in enumerate(layer_groups)
    )
    recurrent = [d.recurrent for d in demands]
    ranks: list[RankPlan] = []
    data_bytes: dict[int, int] = {}
    for stage in stages:
        pools, views = stage_pools(
            stage, per_stage[stage.index], recurrent, sizing.num_blocks, block_size
        )
        data_bytes[stage.index] = sum(v.nbytes for v in views)
        names = tuple(member.layer.name for member in stage.layers)
        used = sum(p.nbytes for p in pools)
        ranks.extend(
            RankPlan(tp_rank, stage.index, names, pools, views, used)
            for tp_rank in range(options.tp)
        )
    tokens = math.floor(sizing.concurrency * options.max_model_len)
    limited_by = _limited_by(options, groups, stages, per_stage, sizing, block_size)
    capacity = Capacity(options.max_model_len, float(sizing.concurrency), tokens, limited_by)
    alternatives = (
        vllm_report(
            stages,
            options.budget_bytes,
            block_size,
            options.max_model_len,
            options.max_batched_tokens,
            options.pp,
        ),
    )
    return Plan(
        options=options,
        budget_bytes=options.budget_bytes,
        strategy=STRATEGY,
        groups=groups,
        ranks=tuple(ranks),
        capacity=capacity,
        padding_bytes=options.budget_bytes - data_bytes[sizing.binding_stage],
        alternatives=alternatives,
    )


def _demand(group: LayerGroup, block_size: int, options: PlanOptions) -> GroupDemand:
    """A group's worst case per request and per step. A window or chunk that frees nothing
    within max_model_len holds every block of the request already: the step's new tokens
    are among them, so they cost no extra blocks."""
    if group.retention.kind == "recurrent":
        return GroupDemand(True, 1, 0)
    held = blocks_per_request(group.retention, options.max_model_len, block_size)
    step = step_blocks(group.retention, options.max_batched_tokens, block_size)
    if held >= cdiv(options.max_model_len, block_size):
        step = 0
    return GroupDemand(False, held, step)


def _group(
    gid: int,
    group: LayerGroup,
    demand: GroupDemand,
    block_size: int,
    num_blocks: int,
    per_stage: Sequence[StageBytes],
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
    )


def _limited_by(
    options: PlanOptions,
    groups: Sequence[Group],
    stages: Sequence[Stage],
    per_stage: Sequence[StageBytes],
    sizing: Sizing,
    block_size: int,
) -> str:
    stage = stages[sizing.binding_stage]
    units = per_stage[sizing.binding_stage].unit
    layouts: dict[int, list] = {}
    for member in stage.layers:
        layouts.setdefault(member.group, []).append(member.layout)

    def held(g: Group) -> int:
        unit = units[g.id]
        return g.num_blocks * (unit if g.is_recurrent else unit * block_size)

    largest = max((g for g in groups if g.id in units), key=held)
    state = [g for g in groups if g.is_recurrent and g.id in units]
    slots_bind = bool(state) and (
        sizing.token_requests is None or sizing.slots <= sizing.token_requests
    )
    state_text = None
    if state:
        biggest = max(state, key=lambda g: units[g.id])
        state_text = describe_group(biggest, layouts[biggest.id], units[biggest.id])
    return limit_sentence(
        budget=options.budget_bytes,
        many_ranks=options.tp * options.pp > 1,
        binding_stage=sizing.binding_stage if options.pp > 1 else None,
        max_model_len=options.max_model_len,
        concurrency=sizing.concurrency,
        slots_bind=slots_bind,
        state_text=state_text,
        largest=describe_group(largest, layouts[largest.id], units[largest.id]),
        largest_share=held(largest) / options.budget_bytes,
    )
