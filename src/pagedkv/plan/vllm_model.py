"""What vLLM's planner (v1, as of 0.34) would fit with the same layers and budget.

A model of its arithmetic, written from reading it and checked against the real planner
(``/work/shared/peers``; docs/plan.md lists the comparisons), for the report only:

- layers whose specs are equal form one type: same retention and per-layer page bytes
  (position offsets and attention flags are invisible to it); when all layers keep the
  same non-recurrent retention they form one group whatever their pages (uniform type);
- hybrids with recurrent state raise the attention block size to the smallest multiple of
  the base size (16; 64 with MLA) whose per-layer page holds one state, and pad the state
  pages to it; other smaller pages grow their block size when they divide the largest page,
  are padded when they do not (non-MLA), and MLA pages that do not divide are refused;
- group size = the smallest type's layer count, or the largest when max < 1.5 x min; each
  type is split into ceil(count / group size) groups padded to the group size with empty
  layer slots; all groups draw from one block-id space: num_blocks = budget //
  (page x group size);
- per request at max_model_len: full ``cdiv(len, bs)``; sliding ``cdiv(min(window - 1 +
  in_flight, len), bs) + 1``; chunked ``cdiv(min(chunk + in_flight, len), bs)``; recurrent
  2 blocks (``mamba_cache_mode="align"``, which prefix caching selects); in_flight =
  (pp + 1) x max_batched_tokens (async scheduling keeps one more batch in flight);
  concurrency = num_blocks / blocks per request (a float, as vLLM logs it);
- padding = budget bytes that hold no KV when the pool is full of requests at max_model_len
  (the budget's remainder, empty layer slots, padded state pages), blocks shared between
  groups in the ratio one request draws them.

With pipeline parallelism every stage is modelled alone and the smallest concurrency kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from pagedkv.errors import ConfigError, InvalidArgumentError
from pagedkv.kvspec import (
    ChunkedLocal,
    Cross,
    Full,
    MLALatent,
    Recurrent,
    Retention,
    SlidingWindow,
    bytes_per_request,
    bytes_per_token,
    cdiv,
)
from pagedkv.plan.stages import Stage
from pagedkv.plan.types import Capacity, StrategyReport

NAME = "vllm"
GROUP_SIZE_SLACK = 1.5  # vLLM 0.34: use the largest type's count when max < 1.5 x min
RECURRENT_BLOCKS = 2  # mamba_cache_mode="align": what vLLM selects with prefix caching


def vllm_blocks(retention: Retention, block_size: int, max_model_len: int, in_flight: int) -> int:
    """Blocks vLLM charges one request of ``max_model_len`` tokens in one group."""
    if isinstance(retention, SlidingWindow):
        return cdiv(min(retention.window - 1 + in_flight, max_model_len), block_size) + 1
    if isinstance(retention, ChunkedLocal):
        return cdiv(min(retention.chunk + in_flight, max_model_len), block_size)
    if isinstance(retention, Cross):
        return cdiv(retention.max_encoder_len, block_size)
    if isinstance(retention, Recurrent):
        return RECURRENT_BLOCKS
    if isinstance(retention, Full):
        return cdiv(max_model_len, block_size)
    raise ConfigError(f"unknown retention {retention!r}")


@dataclass(frozen=True)
class _StagePlan:
    num_blocks: int
    blocks_per_request: int
    block_size: int
    num_groups: int
    group_size: int
    padding_layers: int
    padding_bytes: int


@dataclass
class _Type:
    retention: Retention
    nbytes: int  # per token (attention) or per request (state), per layer
    count: int
    mla: bool

    @property
    def recurrent(self) -> bool:
        return isinstance(self.retention, Recurrent)


def _stage_plan(
    stage: Stage, budget: int, base_block_size: int, max_model_len: int, in_flight: int
) -> _StagePlan | str:
    types: dict[tuple[Retention, int], _Type] = {}
    for member in stage.layers:
        if member.layer.retention.kind == "compressed":
            return (
                "not modelled: compressed layers (DeepSeek-V4) are outside this model of "
                "vLLM's planner"
            )
        recurrent = isinstance(member.layer.retention, Recurrent)
        nbytes = bytes_per_request(member.layout) if recurrent else bytes_per_token(member.layout)
        key = (member.layer.retention, nbytes)
        entry = types.get(key)
        if entry is None:
            mla = isinstance(member.layout, MLALatent)
            entry = types[key] = _Type(member.layer.retention, nbytes, 0, mla)
        entry.count += 1
    kinds = list(types.values())
    retentions = {t.retention for t in kinds}
    if len(retentions) == 1 and not kinds[0].recurrent:
        page = base_block_size * sum(t.nbytes * t.count for t in kinds)
        num_blocks = budget // page
        per_request = vllm_blocks(kinds[0].retention, base_block_size, max_model_len, in_flight)
        count = sum(t.count for t in kinds)
        return _StagePlan(
            num_blocks, per_request, base_block_size, 1, count, 0, budget - num_blocks * page
        )
    state = [t for t in kinds if t.recurrent]
    tokens = [t for t in kinds if not t.recurrent]
    block_size = base_block_size
    if state and tokens:
        per_token = max(t.nbytes for t in tokens)
        most_state = max(t.nbytes for t in state)
        block_size = max(block_size, base_block_size * cdiv(most_state, base_block_size * per_token))
    pages = [t.nbytes if t.recurrent else t.nbytes * block_size for t in kinds]
    max_page = max(pages)
    sizes: list[int] = []  # block size of each type after page unification
    data: list[int] = []  # bytes of real data in each type's page
    for t, page in zip(kinds, pages):
        if t.recurrent or page == max_page:
            sizes.append(block_size)
            data.append(page)
        elif max_page % page == 0:
            sizes.append(block_size * (max_page // page))
            data.append(max_page)
        elif not t.mla:
            sizes.append(block_size)
            data.append(page)
        else:
            return (
                f"vLLM refuses these layers: an MLA page of {page} bytes does not divide the "
                f"largest page of {max_page} bytes"
            )
    counts = [t.count for t in kinds]
    group_size = min(counts)
    if max(counts) < min(counts) * GROUP_SIZE_SLACK:
        group_size = max(counts)
    num_groups = padding_layers = per_request = 0
    data_per_request = 0  # bytes of real data in the blocks one request holds
    for t, size, page_data in zip(kinds, sizes, data):
        groups = cdiv(t.count, group_size)
        blocks = vllm_blocks(t.retention, size, max_model_len, in_flight)
        num_groups += groups
        padding_layers += groups * group_size - t.count
        per_request += groups * blocks
        data_per_request += blocks * t.count * page_data  # layers[i::groups] split the type
    num_blocks = budget // (max_page * group_size)
    used = num_blocks * data_per_request // per_request
    return _StagePlan(
        num_blocks, per_request, block_size, num_groups, group_size, padding_layers, budget - used
    )


def vllm_report(
    stages: Sequence[Stage],
    budget: int,
    base_block_size: int,
    max_model_len: int,
    max_batched_tokens: int,
    pp: int,
) -> StrategyReport:
    """The vLLM-style plan's block count, padding and capacity (see the module docstring)."""
    in_flight = (pp + 1) * max_batched_tokens
    best: tuple[Fraction, _StagePlan] | None = None
    for stage in stages:
        if not stage.layers:
            continue
        plan = _stage_plan(stage, budget, base_block_size, max_model_len, in_flight)
        if isinstance(plan, str):
            return StrategyReport(NAME, 0, budget, Capacity(max_model_len, 0.0, 0, plan), (plan,))
        concurrency = Fraction(plan.num_blocks, plan.blocks_per_request)
        if best is None or concurrency < best[0]:
            best = (concurrency, plan)
    if best is None:  # pragma: no cover - make_plan refuses empty layer lists
        raise InvalidArgumentError("the vLLM-style model needs at least one layer")
    concurrency, plan = best
    limited_by = (
        f"vLLM-style: {plan.num_blocks} shared blocks of {plan.block_size} tokens hold "
        f"{float(concurrency):.2f} requests of {max_model_len} tokens at "
        f"{plan.blocks_per_request} blocks each"
    )
    notes = (
        f"block size {plan.block_size}",
        f"{_count(plan.num_groups, 'group')} of {plan.group_size} layer slots, "
        f"{_count(plan.padding_layers, 'padding layer')}",
        f"{plan.blocks_per_request} blocks per request of {max_model_len} tokens",
    )
    tokens = plan.num_blocks * max_model_len // plan.blocks_per_request
    capacity = Capacity(max_model_len, float(concurrency), tokens, limited_by)
    return StrategyReport(
        NAME, plan.num_blocks, plan.padding_bytes, capacity, notes, plan.block_size,
        plan.num_groups,
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
