"""Per-request state the block manager keeps: tokens, progress, one block table per group."""

from __future__ import annotations

from typing import NamedTuple

from pagedkv.blocks.ids import BlockId

INF = 1 << 62


class PendingHit(NamedTuple):
    """A looked-up prefix hit waiting for the next ``allocate`` to adopt it."""

    tokens: int  # tokens every group has cached
    epoch: int  # sum of the pools' eviction epochs at lookup: changed = look up again
    blocks: list[list[BlockId]]  # per group index: the blocks to adopt


class Save(NamedTuple):
    """A recurrent checkpoint in flight: the state after ``position`` tokens goes to ``slot``."""

    position: int
    slot: BlockId


class Checkpoint(NamedTuple):
    """A cached recurrent checkpoint: its slot and the hash it is cached under."""

    slot: BlockId
    key: int


class RequestState:
    """Mutable bookkeeping of one request (``__slots__``: touched on every step).

    ``tokens``: every known token (prompt + output so far). ``num_computed``: tokens whose
    KV is final in every layer. ``hashes[bs]``: chained hashes of the full blocks of
    ``tokens`` for block size ``bs`` (grown only as blocks fill). ``tables[g]``: block ids
    of group ``g`` (null block where a window dropped one). ``ncached[g]``: leading blocks
    of group ``g`` already offered to the prefix cache; ``unwritten[g]``: those it cached at
    allocation, before the step that writes them (written once the request commits).
    ``slot_limit``: positions with a slot in every group (``fast_limit``: the most a step may reach with no group having
    work, e.g. a recurrent checkpoint); ``last_block_start``: where the last allocated block of any
    group starts; ``next_event``: the committed-token count at which some group has work.
    """

    __slots__ = ("id", "tokens", "num_prompt", "max_new_tokens", "num_computed", "root",
                 "mm_spans", "hashes", "tables", "ncached", "unwritten", "first_live", "copy_src",
                 "pending", "slot_limit", "fast_limit", "last_block_start", "next_event",
                 "num_preemptions", "saves", "marks", "rolling")

    def __init__(self, request_id: object, tokens: list[int], root: int,
                 mm_spans: tuple[tuple[int, int, int], ...], num_groups: int,
                 max_new_tokens: int | None) -> None:
        self.id = request_id
        self.tokens = tokens
        self.num_prompt = len(tokens)
        self.max_new_tokens = max_new_tokens
        self.num_computed = 0
        self.root = root
        self.mm_spans = mm_spans
        self.hashes: dict[int, list[int]] = {}
        self.tables: list[list[BlockId]] = [[] for _ in range(num_groups)]  # by GroupIndex
        self.ncached = [0] * num_groups
        self.unwritten: list[list[BlockId]] = [[] for _ in range(num_groups)]
        self.first_live = [0] * num_groups
        self.copy_src: list[BlockId | None] = [None] * num_groups
        self.pending: PendingHit | None = None
        self.slot_limit = 0
        self.fast_limit = 0
        self.last_block_start = -1
        self.next_event = 0  # the first commit works out the real one
        self.num_preemptions = 0
        self.saves: list[list[Save]] = [[] for _ in range(num_groups)]
        # recurrent groups: checkpoint positions chosen at lookup; newest decode checkpoint
        self.marks: list[list[int]] = [[] for _ in range(num_groups)]
        self.rolling: list[Checkpoint | None] = [None] * num_groups

    def reset(self) -> None:
        """Back to "nothing computed" (preemption): tokens and hashes stay for recompute."""
        n = len(self.tables)
        self.num_computed = 0
        self.tables = [[] for _ in range(n)]
        self.ncached = [0] * n
        self.unwritten = [[] for _ in range(n)]
        self.first_live = [0] * n
        self.copy_src = [None] * n
        self.pending = None
        self.slot_limit = 0
        self.fast_limit = 0
        self.last_block_start = -1
        self.next_event = 0  # the first commit works out the real one
        self.saves = [[] for _ in range(n)]
        self.marks = [[] for _ in range(n)]
