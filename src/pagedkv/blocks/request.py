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
                 "num_preemptions", "saves", "marks", "rolling", "_groups")

    def __init__(self, request_id: object, tokens: list[int], root: int,
                 mm_spans: tuple[tuple[int, int, int], ...], num_groups: int,
                 max_new_tokens: int | None, *, recurrent: bool = True,
                 windowed: bool = True) -> None:
        self.id = request_id
        self.tokens = tokens
        self.num_prompt = len(tokens)
        self.max_new_tokens = max_new_tokens
        self.root = root
        self.mm_spans = mm_spans
        self.hashes: dict[int, list[int]] = {}
        self.num_preemptions = 0
        self._groups = (num_groups, recurrent, windowed)  # what _fresh builds, for reset
        self._fresh(num_groups, recurrent, windowed)
        # recurrent groups: the newest decode checkpoint (kept across a preemption)
        self.rolling: list[Checkpoint | None] | tuple[None, ...] = (
            [None] * num_groups if recurrent else _NONES[num_groups])

    def _fresh(self, n: int, recurrent: bool, windowed: bool) -> None:
        """Nothing computed, no blocks. Without recurrent (windowed) groups the per-group
        state only those groups write is one shared tuple of empty values: every request
        allocates fewer containers for the cyclic GC to track and scan."""
        self.num_computed = 0
        self.tables: list[list[BlockId]] = [[] for _ in range(n)]  # by GroupIndex
        self.ncached = [0] * n
        # () until a group caches blocks at allocation (most groups of most requests never
        # hold one past their first commit): no list to allocate and track until then
        self.unwritten: list[list[BlockId] | tuple[()]] = [()] * n
        self.first_live: list[int] | tuple[int, ...] = [0] * n if windowed else _ZEROS[n]
        # a shared tuple of Nones until a hit ends inside a block (``set_copy_src``)
        self.copy_src: list[BlockId | None] | tuple[None, ...] = _NONES[n]
        self.pending: PendingHit | None = None
        self.slot_limit = 0
        self.fast_limit = 0
        self.last_block_start = -1
        self.next_event = 0  # the first commit works out the real one
        if recurrent:
            self.saves: list[list[Save]] | tuple[tuple[()], ...] = [[] for _ in range(n)]
            # recurrent groups: checkpoint positions chosen at lookup
            self.marks: list[list[int]] | tuple[tuple[()], ...] = [[] for _ in range(n)]
        else:
            self.saves = self.marks = _EMPTIES[n]

    def set_copy_src(self, i: int, block: BlockId) -> None:
        """Group ``i`` copies ``block`` (a hit's partly cached last block) before the step."""
        if type(self.copy_src) is tuple:
            self.copy_src = list(self.copy_src)
        self.copy_src[i] = block  # type: ignore[index]

    def reset(self) -> None:
        """Back to "nothing computed" (preemption): tokens and hashes stay for recompute."""
        self._fresh(*self._groups)


class _Shared(dict):
    """n -> an immutable per-group value shared by every request (built on first use)."""

    def __init__(self, item: object) -> None:
        super().__init__()
        self.item = item

    def __missing__(self, n: int) -> tuple:
        self[n] = value = (self.item,) * n
        return value


_ZEROS = _Shared(0)
_EMPTIES = _Shared(())
_NONES = _Shared(None)
