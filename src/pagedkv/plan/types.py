"""Data classes of a memory plan: options in, groups / pools / tensor views / capacity out.

These are the contract between the planner, the block manager and the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.kvspec import DType, LayerSpec, Retention


@dataclass(frozen=True)
class PlanOptions:
    """What the planner needs besides the layers.

    ``budget_bytes`` is per rank (every rank has the same budget). ``block_size`` None picks
    64 when any layer is MLA (FlashMLA's page) and 16 otherwise. ``max_batched_tokens`` is
    the step's token budget, shared by the whole batch. ``typical_len`` None sizes the pools
    for requests of ``max_model_len``; a length sizes them for the most requests of that
    many tokens at once, keeping room for one request of ``max_model_len``.
    """

    budget_bytes: int
    max_model_len: int
    block_size: int | None = None
    max_batched_tokens: int = 2048
    tp: int = 1
    pp: int = 1
    strategy: str = "auto"  # "auto" picks the best for the workload; or a strategy name
    typical_len: int | None = None  # tokens of a typical request; None: max_model_len


@dataclass(frozen=True)
class Group:
    """Layers sharing one block table (same retention, block size and positions).

    Bytes are per rank, for the rank that holds the most of this group's bytes. For a
    recurrent group a "block" is one state slot (one request's state in every layer).
    ``num_blocks`` counts every page of the group's pool, including ``reserved_blocks``
    pages no request ever holds (the null block of a sliding-window or chunked group: the
    placeholder for positions the window dropped); ``usable_blocks`` is what requests get.
    Groups whose layers pair up exactly share one pool (``pool``); each of them then reports
    the pool's pages and reserved pages as its ``num_blocks`` / ``reserved_blocks``.
    """

    id: int
    layers: tuple[LayerSpec, ...]
    retention: Retention
    block_size: int
    position_offset: int
    models: tuple[str, ...]
    bytes_per_token: int
    bytes_per_request: int
    num_blocks: int
    blocks_per_request: int  # worst case for one request at max_model_len (recurrent: 1 slot)
    step_blocks: int  # blocks the step's new tokens add once per step (windowed groups)
    reserved_blocks: int = 0  # pages of num_blocks never handed out (the null block)
    pool: int | None = None  # id of its pool on every rank; None: its own (= id)

    @property
    def usable_blocks(self) -> int:
        """Blocks (or slots) requests can hold: ``num_blocks - reserved_blocks``."""
        return self.num_blocks - self.reserved_blocks

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(layer.name for layer in self.layers)

    @property
    def is_recurrent(self) -> bool:
        return self.retention.kind == "recurrent"

    @property
    def page_bytes(self) -> int:
        """Bytes one block (or state slot) takes over all this group's layers on a rank."""
        return self.bytes_per_request if self.is_recurrent else self.bytes_per_token * self.block_size


@dataclass(frozen=True)
class TensorView:
    """One layer tensor inside a pool: ``shape`` starts with the pool's page count."""

    layer: str
    tensor: str
    pool: int
    offset: int  # bytes from the start of the pool
    shape: tuple[int, ...]
    dtype: DType

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Pool:
    """One contiguous allocation on one rank, serving the named groups. ``num_pages``
    includes ``reserved_pages`` (the null block), which no request ever holds."""

    id: int
    group_ids: tuple[int, ...]
    nbytes: int
    num_pages: int
    page_bytes: int
    reserved_pages: int = 0


@dataclass(frozen=True)
class RankPlan:
    """What one (tp, pp) rank allocates."""

    tp_rank: int
    pp_rank: int
    layers: tuple[str, ...]
    pools: tuple[Pool, ...]
    views: tuple[TensorView, ...]
    used_bytes: int


@dataclass(frozen=True)
class TypicalCapacity:
    """What fits of requests of ``PlanOptions.typical_len`` tokens (``len``)."""

    len: int
    max_concurrency: float
    tokens: int  # floor(max_concurrency x len)


@dataclass(frozen=True)
class Capacity:
    """What fits. ``max_concurrency`` counts requests of ``max_model_len`` tokens at once
    (a float, as engines report it); ``tokens`` = max_concurrency x max_model_len.
    ``typical``: the same for requests of ``typical_len`` (None without one)."""

    max_model_len: int
    max_concurrency: float
    tokens: int
    limited_by: str  # one sentence on what limits it
    typical: TypicalCapacity | None = None


@dataclass(frozen=True)
class StrategyReport:
    """What one planning strategy would fit with the same budget, for comparison."""

    name: str
    num_blocks: int
    padding_bytes: int
    capacity: Capacity
    notes: tuple[str, ...] = ()
    block_size: int | None = None  # tokens per block, where the strategy has one block size
    num_groups: int | None = None  # block-table groups it would form


@dataclass(frozen=True)
class Plan:
    options: PlanOptions
    budget_bytes: int
    strategy: str
    groups: tuple[Group, ...]
    ranks: tuple[RankPlan, ...]
    capacity: Capacity
    padding_bytes: int
    alternatives: tuple[StrategyReport, ...] = field(default=())

    @property
    def num_blocks(self) -> int:
        """Total blocks over every pool (state slots for recurrent groups); a pool shared
        by several groups counts once."""
        pools = {g.id if g.pool is None else g.pool: g.num_blocks for g in self.groups}
        return sum(pools.values())
