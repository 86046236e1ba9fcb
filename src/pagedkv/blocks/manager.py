"""The block manager of a whole plan: one manager per block-table group, one pool per
memory pool, and the calls an engine makes every step. Prefix lookup lives in
:mod:`pagedkv.blocks.lookup`, checked mode in :mod:`pagedkv.blocks.checked`.

Per request: ``add_request`` -> ``find_cached_prefix`` -> ``allocate`` (False: no room
now; wait or preempt) -> after the forward ``commit`` -> ... -> ``free`` (or ``preempt``).
Hot path: a decode step that crosses no block boundary does a dict lookup and a few
integer comparisons in ``allocate`` and ``commit``; hashing, caching, window frees and
allocations run only when some group reaches its next boundary (``next_event``). At a
boundary, when every group is full attention in a pool of its own and no hit is pending,
``_grow`` takes the next blocks directly (the general path's checks and choices, without
its per-pool bookkeeping; tests/blocks/test_blocks_elastic.py drives both side by side).
``allocate_batch`` calls it directly; ``commit_batch`` commits a step's plain decodes first
and hashes and caches the blocks its boundary ones filled after, in one loop
(``_commit_edges``; tests/blocks/test_blocks_batched_edges.py against per-request calls).
"""

from __future__ import annotations

import dataclasses
import operator
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import islice

from pagedkv.blocks import admission, checks
from pagedkv.blocks.base import NOWHERE, GroupManager
from pagedkv.blocks.cross import CrossManager
from pagedkv.blocks.elastic import ElasticPool
from pagedkv.blocks.events import BlockEvent, CopyOp, EventLog, GroupMetrics, Metrics
from pagedkv.blocks.full import FullManager
from pagedkv.blocks.hashing import DEFAULT_HASH, root_hash
from pagedkv.blocks.ids import BlockId, GroupIndex, PoolId
from pagedkv.blocks.lookup import PrefixLookup
from pagedkv.blocks.pages import NO_STEP, PageLedger, PageOp, PoolRange
from pagedkv.blocks.pool import BlockPool
from pagedkv.blocks.recurrent import (
    DEFAULT_POLICY,
    NO_CHECKPOINTS,
    CheckpointPolicy,
    RecurrentManager,
)
from pagedkv.blocks.request import INF, PendingHit, RequestState
from pagedkv.blocks.window import WindowManager
from pagedkv.errors import DoesNotFitError, InvalidArgumentError, UnsupportedCapabilityError
from pagedkv.plan.elastic import PHYSICAL_PAGE_BYTES, PoolBounds, plan_bounds, pool_bounds
from pagedkv.plan.sizing import reserved_blocks
from pagedkv.plan.types import Group, Plan

_MANAGERS: dict[str, type[GroupManager]] = {
    "full": FullManager,
    "sliding_window": WindowManager,
    "chunked_local": WindowManager,
    "cross": CrossManager,
}  # recurrent groups take one more argument (their checkpoint policy)


def _null_pages(groups: Iterable[Group]) -> int:
    """Null blocks a pool serving ``groups`` reserves: one if any group needs it."""
    return max((reserved_blocks(g.retention) for g in groups), default=0)



_INT = frozenset((int,))  # (a C-level type check of a token list: _INT.issuperset(map(type, ...)))


def _index(what: str, value: object) -> int:
    """An integer argument (numpy's too) as int; InvalidArgumentError for a float, a string,
    None: a fractional or NaN count would pass the range checks and corrupt a request."""
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(f"{what} must be an integer, got {value!r}") from None


def _token_ids(what: str, tokens: object) -> list[int]:
    """Token ids as a list of ints (the hot paths take lists of ints as they are)."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
        raise InvalidArgumentError(f"{what} must be a sequence of token ids, got {tokens!r}")
    return [_index(what, t) for t in tokens]

class _Revived(dict):
    """Pool id -> hit blocks an admission takes back out of the pool's LRU. A plain
    group's new-block count does not need them, so its are listed only when the fit
    check asks (the usual admission, whose pool fits whatever they are, never does)."""

    def __init__(self) -> None:
        super().__init__()
        self.lazy: dict[int, list[tuple[GroupManager, list[BlockId]]]] = {}
        self.bound: dict[int, int] = {}  # pool id -> hit blocks listed or not

    def add(self, pid: int, m: GroupManager, hit: list[BlockId],
            back: list[BlockId] | None) -> None:
        """``m``'s hit blocks in pool ``pid``: ``back`` the revived ones, None if unlisted."""
        self.bound[pid] = self.bound.get(pid, 0) + (len(hit) if back is None else len(back))
        if back is None:
            self.lazy.setdefault(pid, []).append((m, hit))
        elif back:
            self.setdefault(pid, []).extend(back)

    def most(self, pid: int) -> int:
        """An upper bound on ``len(self.get(pid))``, without listing anything."""
        return self.bound.get(pid, 0)

    def get(self, pid: int, default: object = ()) -> object:  # type: ignore[override]
        todo = self.lazy.pop(pid, None)
        if todo:
            out = self.setdefault(pid, [])
            for m, hit in todo:
                out += m.revived(hit)
        return dict.get(self, pid, default)


class _Tee:
    """Several watchers' lists (``watch_tables``) fed as one."""

    __slots__ = ("logs",)

    def __init__(self, logs: tuple[list[RequestState], ...]) -> None:
        self.logs = logs

    def append(self, req: RequestState) -> None:
        for log in self.logs:
            log.append(req)


def debug_from_env() -> bool:
    return os.environ.get("PAGEDKV_DEBUG", "").strip() not in ("", "0", "false", "no")


class KVCacheManager:
    """Blocks for every group of a plan.

    ``pools``: pool id -> (group ids, number of blocks); default one pool per group of
    ``group.num_blocks`` blocks. Block 0 of a pool serving a sliding-window or chunked group
    is the null block (:func:`pagedkv.plan.reserved_blocks`); a plan counts it in
    ``Group.num_blocks`` / ``Pool.num_pages`` (``reserved_blocks`` / ``reserved_pages``), so
    the usable blocks equal the plan's. ``checked`` (default: env ``PAGEDKV_DEBUG=1``) builds a
    :class:`~pagedkv.blocks.checked.CheckedKVCacheManager` instead, which verifies the
    invariants each call touched after every call and sweeps everything every
    ``sweep_every`` calls (default: about once per two block ids of all pools, at least
    every 1,024 calls; 1: after every call, as the tests do). Recurrent checkpoints (prefix hits for recurrent groups; spare state slots
    only): ``recurrent_checkpoint_every`` None = the default :class:`CheckpointPolicy`
    (branch points, prompt ends, newest decoded block), N > 0 = every N blocks and nowhere
    else, 0 = none; ``checkpoint_policy`` overrides both. A retention's own interval wins.
    Elastic pools (``budget_bytes``; ``from_plan`` by default): see docs/blocks.md. Steps:
    ``own_steps`` (default) -- ``drain_copy_ops`` launches a step, and with ``sync_steps`` the
    next call means it finished (else the engine calls ``step_finished``); ``own_steps=False``
    when :class:`pagedkv.memory.PhysicalMemory` reports steps to the ledger itself.
    ``stock_pages``: spare physical pages the backing keeps created.
    ``hash_algo``: block keys (:mod:`pagedkv.blocks.hashing`; the default is safe for a
    multi-tenant cache, ``"fast-single-tenant"`` is not); ``hash_secret``: a per-deployment
    key folded into every chain, so keys cannot be computed without it.
    """

    checked = False
    changed = NOWHERE  # see watch_tables
    pool_class: type[BlockPool] = BlockPool
    elastic_pool_class: type[ElasticPool] = ElasticPool

    def __new__(cls, *args: object, checked: bool | None = None, **kwargs: object
                ) -> KVCacheManager:
        if cls is KVCacheManager and (debug_from_env() if checked is None else checked):
            from pagedkv.blocks.checked import CheckedKVCacheManager

            cls = CheckedKVCacheManager
        return super().__new__(cls)

    def __init__(self, groups: Sequence[Group], *,
                 pools: Mapping[int, tuple[Sequence[int], int]] | None = None,
                 max_model_len: int | None = None, max_batched_tokens: int = 2048,
                 enable_caching: bool = True, hash_algo: str = DEFAULT_HASH,
                 hash_secret: bytes = b"",
                 checked: bool | None = None, events: bool = False,
                 recurrent_checkpoint_every: int | None = None,
                 checkpoint_policy: CheckpointPolicy | None = None,
                 sweep_every: int | None = None, budget_bytes: int | None = None,
                 pool_bytes: Mapping[int, int] | None = None,
                 ceilings: Mapping[int, int] | None = None,
                 page_bytes: int = PHYSICAL_PAGE_BYTES, sync_steps: bool = True,
                 own_steps: bool = True, stock_pages: int = 4) -> None:
        if not groups:
            raise InvalidArgumentError("a block manager needs at least one group")
        if max_batched_tokens <= 0:
            raise InvalidArgumentError(f"max_batched_tokens must be > 0, got {max_batched_tokens}")
        self.groups = tuple(groups)
        self.max_model_len = max_model_len
        self.max_batched_tokens = max_batched_tokens
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        if sweep_every is not None and (not isinstance(sweep_every, int) or sweep_every <= 0):
            raise InvalidArgumentError(f"sweep_every must be a positive integer, got {sweep_every!r}")
        if not isinstance(hash_secret, bytes):
            raise InvalidArgumentError(f"hash_secret must be bytes, got {type(hash_secret).__name__}")
        self.hash_secret = hash_secret
        self._root = root_hash((), hash_secret)  # a request without extra keys: derived once
        self.event_log = EventLog(events)
        self.ledger: PageLedger | None = None
        self.bounds: tuple[PoolBounds, ...] = ()
        self.sync_steps = sync_steps and own_steps
        self.own_steps = own_steps
        self.stock_pages = stock_pages
        self._step = NO_STEP
        if budget_bytes is None:
            self.pools = self._make_pools(pools)
        else:
            self.pools = self._make_elastic_pools(pools, budget_bytes, pool_bytes, ceilings,
                                                  page_bytes)
        pool_of = {gid: pool for pool in self.pools for gid in pool.caches}
        if recurrent_checkpoint_every is not None and (
                not isinstance(recurrent_checkpoint_every, int) or recurrent_checkpoint_every < 0):
            raise InvalidArgumentError(
                f"recurrent_checkpoint_every must be >= 0, got {recurrent_checkpoint_every!r}")
        policy = checkpoint_policy
        if policy is None:
            policy = (DEFAULT_POLICY if recurrent_checkpoint_every is None
                      else CheckpointPolicy.interval(recurrent_checkpoint_every)
                      if recurrent_checkpoint_every else NO_CHECKPOINTS)
        managers: list[GroupManager] = []
        for i, g in enumerate(self.groups):
            args = (GroupIndex(i), g, pool_of[g.id], enable_caching, self.event_log)
            if g.retention.kind == "recurrent":
                managers.append(RecurrentManager(*args, policy))
            elif g.retention.kind not in _MANAGERS:
                raise UnsupportedCapabilityError(
                    f"group {i} keeps {g.retention.describe()} retention, which the block "
                    "manager does not manage (pagedkv plan sizes it; simulation and "
                    "allocation do not)"
                )
            else:
                managers.append(_MANAGERS[g.retention.kind](*args))
        self.managers: tuple[GroupManager, ...] = tuple(managers)
        self.prefix = PrefixLookup(self.managers, self.pools, hash_algo, enable_caching)
        self._token_managers = self.prefix.token_managers
        self._window_managers = tuple(m for m in self.managers if isinstance(m, WindowManager))
        self._recurrent_managers = self.prefix.recurrent_managers
        self._spare_by_pool: dict[PoolId, tuple[RecurrentManager, ...]] = {}
        for m in self._recurrent_managers:
            pid = m.pool.pool_id
            self._spare_by_pool[pid] = self._spare_by_pool.get(pid, ()) + (m,)
        self._pool_per_group = len({m.pool.pool_id for m in self.managers}) == len(self.managers)
        # every group full attention, one pool each: a request with nothing pending grows
        # its tables without the general admission bookkeeping (``_grow``)
        self._full_only = self._pool_per_group and all(type(m) is FullManager
                                                       for m in self.managers)
        self._pool_by_id = {p.pool_id: p for p in self.pools}
        # one full-attention group that caches: a step's boundary commits on a short path
        self._edge_manager = (self.managers[0] if len(self.managers) == 1
                              and type(self.managers[0]) is FullManager
                              and self.managers[0].caching else None)
        # the full sweep walks every block id: by default it runs about once per that many
        # calls (at least every 1,024), so its cost per call stays a small constant
        self.sweep_every = sweep_every or max(1024, sum(p.num_blocks for p in self.pools) // 2)
        self._reqs: dict[object, RequestState] = {}
        self._fits: set[int] = set()  # request lengths check_fits has accepted
        self.preemptions = 0

    @property
    def prefix_queries(self) -> int:
        """Prompt tokens looked up (a lookup redone after an eviction counts once)."""
        return self.prefix.queries

    @property
    def prefix_hits(self) -> int:
        """Of those, tokens served from the cache."""
        return self.prefix.hits

    def check_invariants(self) -> None:
        """Full sweep of every invariant (:mod:`pagedkv.blocks.checks`); raises
        :class:`CacheCorruptedError` naming the first violated one."""
        checks.sweep(self)

    @classmethod
    def from_plan(cls, plan: Plan, *, elastic: bool = True, **kwargs: object) -> KVCacheManager:
        """Manager for ``plan``: its groups and (rank 0's) pools, its token budget. With
        ``elastic`` (default) the pools share the plan's per-rank byte budget by demand
        (:mod:`pagedkv.plan.elastic`); otherwise, or when the floors rounded up to whole
        physical pages do not fit the budget, each keeps the plan's fixed size."""
        pools: dict[int, tuple[Sequence[int], int]] | None = None
        if plan.ranks and plan.ranks[0].pools:
            by_id = {g.id: g for g in plan.groups}
            for p in plan.ranks[0].pools:
                need = _null_pages(by_id[g] for g in p.group_ids if g in by_id)
                if p.reserved_pages != need:
                    raise InvalidArgumentError(
                        f"pool {p.id} of the plan reserves {p.reserved_pages} pages but its "
                        f"groups {list(p.group_ids)} need {need} (the null block of a window): "
                        "plan it again with this version"
                    )
            pools = {p.id: (p.group_ids, p.num_pages) for p in plan.ranks[0].pools}
            held = sorted(g for gids, _ in pools.values() for g in gids)
            if held != sorted(g.id for g in plan.groups):  # a rank that holds some groups only
                pools = None
        kwargs.setdefault("max_model_len", plan.options.max_model_len)
        kwargs.setdefault("max_batched_tokens", plan.options.max_batched_tokens)
        if elastic:
            try:
                plan_bounds(plan)
            except DoesNotFitError:  # floors rounded up to whole pages overflow a tight plan
                elastic = False
        if elastic:
            kwargs.setdefault("budget_bytes", plan.budget_bytes)
            if pools is not None:
                kwargs.setdefault("pool_bytes", {p.id: p.page_bytes for p in plan.ranks[0].pools})
        return cls(plan.groups, pools=pools, **kwargs)  # type: ignore[arg-type]

    def _make_elastic_pools(self, spec: Mapping[int, tuple[Sequence[int], int]] | None,
                            budget: int, pool_bytes: Mapping[int, int] | None,
                            ceilings: Mapping[int, int] | None, page_bytes: int
                            ) -> tuple[BlockPool, ...]:
        """Pools over one :class:`PageLedger`: floors mapped, ceilings from the budget."""
        if not isinstance(budget, int) or budget <= 0:
            raise InvalidArgumentError(f"budget_bytes must be a positive integer, got {budget!r}")
        if self.max_model_len is None:
            raise InvalidArgumentError("an elastic budget needs max_model_len (the floors)")
        by_id = {g.id: g for g in self.groups}
        if spec is None:
            spec = {g.id: ((g.id,), g.num_blocks) for g in self.groups}
        shapes = {}
        for pid, (gids, _) in spec.items():
            groups = tuple(by_id[g] for g in gids if g in by_id)
            bb = (pool_bytes or {}).get(pid) or max(g.page_bytes for g in groups)
            shapes[pid] = (groups, bb, _null_pages(groups))
        self.bounds = pool_bounds(shapes, budget, page_bytes)
        if ceilings:
            self.bounds = tuple(
                dataclasses.replace(b, ceiling_blocks=max(b.floor_blocks, ceilings[b.pool_id]))
                if b.pool_id in ceilings else b for b in self.bounds)
        self.ledger = PageLedger(
            [PoolRange(PoolId(b.pool_id), b.block_bytes, b.ceiling_blocks, b.floor_blocks)
             for b in self.bounds], budget, page_bytes, stock_pages=self.stock_pages)
        sized = {b.pool_id: (spec[b.pool_id][0], b.ceiling_blocks) for b in self.bounds}
        floors = {b.pool_id: b.floor_blocks for b in self.bounds}
        pools = self._make_pools(sized, lambda num, pid, events, reserve_null: self.elastic_pool_class(
            num, pid, events, reserve_null, self.ledger, floors[pid]))
        for pool in pools:
            pool.peers = pools  # type: ignore[attr-defined]
        return pools

    def _make_pools(self, spec: Mapping[int, tuple[Sequence[int], int]] | None,
                    make: Callable[..., BlockPool] | None = None) -> tuple[BlockPool, ...]:
        ids = [g.id for g in self.groups]
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError(f"group ids repeat: {ids}")
        if spec is None:
            spec = {g.id: ((g.id,), g.num_blocks) for g in self.groups}
        pools = []
        seen: list[int] = []
        by_id = {g.id: g for g in self.groups}
        for pid, (gids, num_blocks) in spec.items():
            pool = (make or self.pool_class)(
                num_blocks, PoolId(pid), self.event_log,
                reserve_null=_null_pages(by_id[g] for g in gids if g in by_id) > 0)
            for gid in gids:
                pool.cache_for(gid)
                seen.append(gid)
            pools.append(pool)
        if sorted(seen) != sorted(ids):
            raise InvalidArgumentError(
                f"every group must be in exactly one pool: groups {sorted(ids)}, pools hold {sorted(seen)}"
            )
        return tuple(pools)

    # --- requests ----------------------------------------------------------------------
    def check_fits(self, num_tokens: int) -> None:
        """Raise RequestTooLargeError when a request of ``num_tokens`` can never fit."""
        fits = self._fits
        if num_tokens in fits:  # the answer depends on the length alone
            return
        admission.check_fits(self.managers, num_tokens, self.max_batched_tokens,
                             self.max_model_len)
        if len(fits) >= 4096:
            fits.clear()
        fits.add(num_tokens)

    def add_request(self, request_id: object, prompt_tokens: Sequence[int], *,
                    max_new_tokens: int | None = None, extra_keys: Sequence[object] = (),
                    mm_spans: Iterable[tuple[int, int, int]] = ()) -> None:
        """Register a request. ``extra_keys`` (cache salt, LoRA id...) separate its cache
        entries from others'; ``mm_spans`` are (start, end, content hash) of multimodal
        inputs, folded into the hash of every block they touch."""
        if request_id in self._reqs:
            raise InvalidArgumentError(f"request {request_id!r} is already registered")
        if (type(prompt_tokens) not in (list, tuple)
                or not _INT.issuperset(map(type, prompt_tokens))):
            prompt_tokens = _token_ids("prompt_tokens", prompt_tokens)
        if not prompt_tokens:
            raise InvalidArgumentError(f"request {request_id!r} has an empty prompt")
        if max_new_tokens is not None:
            max_new_tokens = _index("max_new_tokens", max_new_tokens)
        if max_new_tokens is not None and max_new_tokens < 0:
            raise InvalidArgumentError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        self.check_fits(len(prompt_tokens) + (max_new_tokens or 0))
        spans: tuple[tuple[int, int, int], ...] = ()
        if mm_spans:
            spans = tuple(sorted((int(a), int(b), int(h)) for a, b, h in mm_spans))
            for a, b, _ in spans:
                if not 0 <= a < b:
                    raise InvalidArgumentError(f"bad multimodal span [{a}, {b})")
        root = root_hash(tuple(extra_keys), self.hash_secret) if extra_keys else self._root
        req = RequestState(request_id, list(prompt_tokens), root, spans, len(self.managers),
                           max_new_tokens, recurrent=bool(self._recurrent_managers),
                           windowed=bool(self._window_managers))
        self.prefix.hash_full_blocks(req)  # once per prompt; later blocks as they fill
        self._reqs[request_id] = req

    def _req(self, request_id: object) -> RequestState:
        try:
            return self._reqs[request_id]
        except KeyError:
            raise InvalidArgumentError(f"unknown request {request_id!r}") from None

    def find_cached_prefix(self, request_id: object) -> int:
        """Tokens of the request already cached in every group (the longest prefix all
        groups agree on, at most all tokens but the last). Kept for the next ``allocate``."""
        req = self._req(request_id)
        if req.num_computed or any(req.tables):
            raise InvalidArgumentError(
                f"request {request_id!r} already holds blocks; look up before allocating"
            )
        return self.prefix.lookup(req)

    def allocate(self, request_id: object, num_new_tokens: int, num_lookahead: int = 0) -> bool:
        """Slots for ``num_new_tokens`` tokens to compute this step plus ``num_lookahead``
        draft positions, in every group. False (and no change) when a pool is short."""
        try:
            req = self._reqs[request_id]
        except KeyError:
            req = self._req(request_id)
        # fast_limit is -1 while a looked-up hit waits to be adopted
        if (type(num_new_tokens) is int and type(num_lookahead) is int
                and req.num_computed + num_new_tokens + num_lookahead <= req.fast_limit
                and num_new_tokens >= 0 and num_lookahead >= 0):
            return True
        return self._allocate_slow(req, num_new_tokens, num_lookahead)

    def allocate_batch(self, request_ids: Sequence[object], num_new_tokens: int = 1,
                       num_lookahead: int = 0) -> int:
        """``allocate`` for each request in order (a decode step: one token each); stops at
        the first that does not fit and returns how many got their slots."""
        num_new_tokens = _index("num_new_tokens", num_new_tokens)
        num_lookahead = _index("num_lookahead", num_lookahead)
        if num_new_tokens < 0 or num_lookahead < 0:
            raise InvalidArgumentError(
                f"token counts must be >= 0, got {num_new_tokens} and {num_lookahead}")
        reqs = self._reqs
        k = num_new_tokens + num_lookahead
        # a decode step's new block, nothing pending: _grow directly (what _allocate_slow
        # would call first), the general path only when it says no. With one group the
        # step's growing requests are gathered and served by one pool call (_grow_all),
        # before any general-path call and at the end, so blocks go out in request order
        grow = self._grow if self._full_only and num_new_tokens <= 1 else None
        todo: list[tuple[int, RequestState, int]] | None = (
            [] if grow is not None and len(self.managers) == 1 else None)
        for i, rid in enumerate(request_ids):
            try:
                req = reqs[rid]  # a subscript: cheaper than dict.get on every request
            except KeyError:
                if todo:  # the requests before it get their slots first, as one by one
                    short = self._grow_all(todo, num_new_tokens, num_lookahead)
                    if short >= 0:
                        return short
                req = self._req(rid)  # raises, naming it
            end = req.num_computed + k
            if end > req.fast_limit:
                if (grow is not None and req.pending is None
                        and end <= len(req.tokens) + num_lookahead):
                    if todo is not None:
                        todo.append((i, req, end))
                        continue
                    if grow(req, end):
                        continue
                if todo:
                    short = self._grow_all(todo, num_new_tokens, num_lookahead)
                    todo.clear()
                    if short >= 0:
                        return short
                if not self._allocate_slow(req, num_new_tokens, num_lookahead):
                    return i
        if todo:
            short = self._grow_all(todo, num_new_tokens, num_lookahead)
            if short >= 0:
                return short
        return len(request_ids)

    def _grow_all(self, todo: list[tuple[int, RequestState, int]], n: int,
                  lookahead: int) -> int:
        """:meth:`_grow` for each (index, request, end) of a step, in order, with one group:
        when the pool surely holds them all -- its plain free blocks and the budget (the
        pages they would newly map), or, with no plain block left, its LRU of cached ones
        -- one pool call hands out the blocks each would take in turn (the lowest plain
        ids, the free stack's top, or the LRU's oldest). Else one by one, as
        ``allocate_batch`` would: the index of the first that gets no slots (nothing
        changed for it or those after), or -1."""
        m = self.managers[0]
        pool = m.pool
        ledger = self.ledger
        bs = m.bs
        i = m.index
        need = [-(-end // bs) - len(req.tables[i]) for _, req, end in todo]
        total = sum(need)
        if ledger is None:
            fits = total <= pool.num_free()
        else:
            if self.sync_steps and ledger.launched > ledger.finished:
                ledger.step_finished(ledger.launched)
            plain = pool.num_plain_free()
            if total <= plain:  # the lowest plain ids: the worst case, else their pages counted
                free = ledger.free_bytes()
                fits = (total * pool.worst_bytes <= free  # type: ignore[attr-defined]
                        or pool.cost_of(total) <= free)  # type: ignore[attr-defined]
            else:  # no plain block left: the LRU's oldest, on mapped pages (no new bytes)
                fits = not plain and total <= len(pool.evictable)
        if not fits or min(need) <= 0 or len({id(req) for _, req, _ in todo}) < len(todo):
            # (a request listed twice grows once, by its first entry: one by one then)
            for j, req, end in todo:
                if not self._grow(req, end) and not self._allocate_slow(req, n, lookahead):
                    return j
            return -1
        blocks = pool.allocate(total, m.gid)
        at = 0
        for (_, req, _), k in zip(todo, need):
            table = req.tables[i]
            if k == 1:
                table.append(blocks[at])
            else:
                table += blocks[at:at + k]
            at += k
            last = len(table) * bs
            req.fast_limit = req.slot_limit = last
            req.last_block_start = last - bs
        return -1

    def _allocate_slow(self, req: RequestState, n: int, lookahead: int) -> bool:
        n, lookahead = _index("num_new_tokens", n), _index("num_lookahead", lookahead)
        if n < 0 or lookahead < 0:
            raise InvalidArgumentError(f"token counts must be >= 0, got {n} and {lookahead}")
        pending = req.pending
        if pending is not None:  # a hit block may have been evicted since
            pending = self.prefix.revalidate(req)
        start = pending.tokens if pending is not None else req.num_computed
        end = start + n + lookahead
        if end > len(req.tokens) + lookahead:
            raise InvalidArgumentError(
                f"request {req.id!r}: {n} new tokens from position {start} run past its "
                f"{len(req.tokens)} known tokens"
            )
        if pending is None:
            if self._full_only and n <= 1 and self._grow(req, end):
                return True
            for m in self._window_managers:
                m.drop_out_of_window(req)
        hits = pending.blocks if pending is not None else None
        if self.ledger is not None:
            return self._allocate_elastic(req, pending, start, n, end, hits)
        short: list[tuple[BlockPool, int]] = []  # pools whose unsent saves must give way
        if self._pool_per_group:
            for m in self.managers:
                k = m.blocks_needed(req, end, hits[m.index] if hits is not None else None)
                if k and k > m.pool.num_free():
                    if k > m.pool.num_free() + self._spare(m.pool):
                        self._raise_if_never(req, end)
                        return False
                    short.append((m.pool, k))
        else:
            need: dict[int, int] = {}
            for m in self.managers:
                k = m.blocks_needed(req, end, hits[m.index] if hits is not None else None)
                if k:
                    need[m.pool.pool_id] = need.get(m.pool.pool_id, 0) + k
            for pool in self.pools:
                k = need.get(pool.pool_id, 0)
                if k > pool.num_free() and k > pool.num_free() + self._spare(pool):
                    self._raise_if_never(req, end)
                    return False
                if k > pool.num_free():
                    short.append((pool, k))
        for pool, k in short:
            self._make_room(pool, k)  # checkpoints never block an allocation
        self._allocate_groups(req, end, hits, self.managers)
        self._after_allocate(req, pending, start, n, end)
        return True

    def _allocate_groups(self, req: RequestState, end: int, hits: list[list[BlockId]] | None,
                         order: Sequence[GroupManager]) -> None:
        """Every group adopts its hit blocks first, then each in ``order`` allocates: a
        group's new blocks may evict cached blocks of a pool it shares, never another
        group's hit (the fit checks counted those as taken)."""
        if hits is None:
            for m in order:
                m.allocate(req, end, None)
            return
        for m in self.managers:
            m.adopt(req, hits[m.index])
        for m in order:
            m.allocate(req, end, hits[m.index])

    def _grow(self, req: RequestState, end: int) -> bool:
        """A decode step's next blocks when every group is full attention in a pool of its
        own and nothing is pending: each group takes its pool's next blocks where they
        surely fit (elastic: the lowest plain ids, every one on pages of its own within the
        free budget; fixed: free blocks). The same blocks and checks as the general path,
        which it leaves the rest to: False (nothing changed) when any pool is short."""
        ledger = self.ledger
        tables = req.tables
        if ledger is not None and self.sync_steps and ledger.launched > ledger.finished:
            ledger.step_finished(ledger.launched)
        if len(self.managers) == 1:  # one group: its next block, on the plainest path
            m = self.managers[0]
            table = tables[m.index]
            bs = m.bs
            k = -(-end // bs) - len(table)
            if k > 0:
                pool = m.pool
                if ledger is None:
                    if k > pool.num_free():
                        return False
                else:
                    plain = pool.num_plain_free()
                    if k > plain:
                        # no plain id at all: the pool's own LRU, on mapped pages (no new
                        # bytes: what _grow_exact decides then); else count exactly
                        if plain or k > len(pool.evictable):
                            return self._grow_exact(req, end, ledger)
                    elif k * pool.worst_bytes > ledger.free_bytes():  # type: ignore[attr-defined]
                        return self._grow_exact(req, end, ledger)
                table += pool.allocate(k, m.gid)
            n = len(table) * bs
            req.fast_limit = req.slot_limit = n
            req.last_block_start = n - bs
            return True
        return self._grow_exact(req, end, ledger)

    def _grow_exact(self, req: RequestState, end: int, ledger: PageLedger | None) -> bool:
        """:meth:`_grow` for several groups, or a pool that needs its pages counted."""
        tables = req.tables
        worst = 0
        exact = False  # some pool evicts its own cached blocks: count pages exactly
        grow = []
        for m in self.managers:
            k = -(-end // m.bs) - len(tables[m.index])
            if k > 0:
                pool = m.pool
                if ledger is not None:
                    plain = pool.num_plain_free()
                    if k > plain:
                        if k > plain + len(pool.evictable):
                            return False
                        exact = True
                        k_plain = plain
                    else:
                        k_plain = k
                    worst += k_plain * pool.worst_bytes  # type: ignore[attr-defined]
                elif k > pool.num_free():
                    return False
                grow.append((m, k))
        if ledger is not None and (exact or worst > ledger.free_bytes()):
            # the pages the lowest plain ids would newly map, as _elastic_fits counts them
            # (a pool short of plain ids evicts its own LRU for the rest, on mapped pages);
            # pools that map none take their blocks first, as the general path orders them
            costs = [m.pool.cost_of(min(k, m.pool.num_plain_free()))  # type: ignore[attr-defined]
                     for m, k in grow]
            if sum(costs) > ledger.free_bytes():
                return False
            grow = ([g for g, c in zip(grow, costs) if not c]
                    + [g for g, c in zip(grow, costs) if c])
        for m, k in grow:
            tables[m.index] += m.pool.allocate(k, m.gid)
        limit = INF
        last = -1
        for m in self.managers:
            nb = len(tables[m.index])
            if nb * m.bs < limit:
                limit = nb * m.bs
            if (nb - 1) * m.bs > last:
                last = (nb - 1) * m.bs
        req.fast_limit = req.slot_limit = limit
        req.last_block_start = last
        return True

    def _allocate_elastic(self, req: RequestState, pending: PendingHit | None, start: int,
                          n: int, end: int, hits: list[list[BlockId]] | None) -> bool:
        """Admission on bytes: every pool's new blocks must fit the shared budget (after
        pools reuse their own cached blocks and others give back cached-only pages)."""
        self._sync_ledger()
        need, revived = self._elastic_need(req, end, hits)
        ok, lean, costly = self._elastic_fits(need, revived)
        if not ok and self._spare_by_pool:
            for pool in self.pools:  # checkpoints never block an allocation
                if need.get(pool.pool_id) or revived.get(pool.pool_id):
                    self._make_room(pool, pool.num_blocks)
            need, revived = self._elastic_need(req, end, hits)
            ok, lean, costly = self._elastic_fits(need, revived)
        if not ok:
            self._raise_if_never(req, end)
            return False
        if not costly and not lean:  # the common case: every pool's blocks fit as they are
            self._allocate_groups(req, end, hits, self.managers)
            self._after_allocate(req, pending, start, n, end)
            return True
        # pools that map new pages go last, protected from each other's reclaim; the
        # others take their blocks first, after which their remaining cached pages may go
        late = [m for m in self.managers if m.pool in costly]
        for pool in costly:
            pool.protected = True  # type: ignore[attr-defined]
        for pool in lean:
            pool.lean = True  # type: ignore[attr-defined]
        try:
            self._allocate_groups(
                req, end, hits, [m for m in self.managers if m.pool not in costly] + late)
        finally:
            for pool in self.pools:
                pool.protected = pool.lean = False  # type: ignore[attr-defined]
        self._after_allocate(req, pending, start, n, end)
        return True

    def _elastic_need(self, req: RequestState, end: int, hits: list[list[BlockId]] | None
                      ) -> tuple[dict[int, int], _Revived]:
        """Per pool: blocks to hand out anew, and hit blocks taken back out of its LRU."""
        need: dict[int, int] = {}
        revived = _Revived()
        for m in self.managers:
            hit = hits[m.index] if hits is not None else None
            k, back = m.new_and_revived(req, end, hit)
            pid = m.pool.pool_id
            if k:
                need[pid] = need.get(pid, 0) + k
            if hit:  # None: counted without them, listed if the fit check asks
                revived.add(pid, m, hit, back)
        return need, revived

    def _elastic_fits(self, need: Mapping[int, int], revived: _Revived
                      ) -> tuple[bool, list[BlockPool], list[BlockPool]]:
        """Whether ``need`` (pool id -> new blocks) fits; which pools must reuse their own
        cached blocks rather than map new pages (the budget is short); which map pages.
        ``revived`` (pool id -> hit blocks leaving the LRU) are neither new bytes nor
        blocks the pool, or another pool's reclaim, can evict. Never optimistic: when
        this says yes, every pool's allocation below succeeds."""
        ledger = self.ledger
        free = ledger.free_bytes()  # type: ignore[union-attr]
        worst = 0  # every new block on pages of its own: enough budget then, no more to ask
        for pid, k in need.items():
            pool = self._pool_by_id[pid]
            if k > pool.num_plain_free():
                break
            worst += k * pool.worst_bytes  # type: ignore[attr-defined]
        else:
            if worst <= free:
                return True, [], []
        costs: list[tuple[BlockPool, int]] = []
        cached: dict[int, int] = {}  # pool id -> cached blocks it may evict for itself

        def own_cached(pool: BlockPool) -> int:
            pid = pool.pool_id
            if pid not in cached:
                cached[pid] = len(pool.evictable) - len(revived.get(pid, ()))
            return cached[pid]

        total = 0
        for pool in self.pools:
            k = need.get(pool.pool_id, 0)
            if not k:
                continue
            plain = pool.num_plain_free()
            # enough even if every hit block left the LRU: no need to list them
            if (k > plain + len(pool.evictable) - revived.most(pool.pool_id)
                    and k > plain + own_cached(pool)):
                return False, [], []
            c = pool.cost_of(min(k, plain))  # type: ignore[attr-defined]
            costs.append((pool, c))
            total += c
        if total <= free:
            return True, [], [p for p, c in costs if c] if total else []
        # the budget is short: every pool that would map pages reuses its own cached
        # blocks first, so it maps exactly the pages of its lowest plain ids beyond them
        lean = [p for p, c in costs if c]
        total = 0
        costly = []
        for p in lean:
            beyond = need[p.pool_id] - own_cached(p)
            c = p.cost_of(beyond) if beyond > 0 else 0  # type: ignore[attr-defined]
            if c:
                costly.append(p)
                total += c
        if total <= free:
            return True, lean, costly
        spare = 0
        for q in self.pools:
            if q in costly or not q.evictable:
                continue
            spare += self._spare_bytes(q, need.get(q.pool_id, 0), revived.get(q.pool_id, ()))
            if total <= free + spare:
                return True, lean, costly
        return False, lean, costly

    def _spare_bytes(self, q: BlockPool, k: int, revived: Sequence[BlockId]) -> int:
        """Bytes a costly pool's reclaim can surely get from ``q`` once ``q`` took its
        ``k`` new blocks: q's cached blocks, less the hits leaving its LRU and its ``k``
        oldest (a lean pool reuses them), and less any on the pages where its ``k`` lowest
        plain ids land (a block placed there keeps the page). The ledger counts q's cached
        blocks per page (idle), so this costs O(pages + k + hits), not a walk over q's LRU
        on every allocation (quadratic with small blocks and long contexts: fuzz seed
        723762)."""
        kept = list(revived)
        landing: Sequence[BlockId] = ()
        if k:
            gone = set(revived)
            kept += islice((b for b in q.evictable if b not in gone) if gone else q.evictable, k)
            landing = q._lowest_ids(k)  # type: ignore[attr-defined]
        return self.ledger.idle_bytes_freed(q.pool_id, kept, landing)  # type: ignore[union-attr]

    def _sync_ledger(self) -> None:
        """Synchronous engines: a call after a step's launch means that step finished."""
        ledger = self.ledger
        if ledger is not None and self.sync_steps and ledger.launched > ledger.finished:
            ledger.step_finished(ledger.launched)

    def _after_allocate(self, req: RequestState, pending: PendingHit | None, start: int,
                        n: int, end: int) -> None:
        if pending is not None:
            req.num_computed = start
            req.pending = None
        unwritten = False
        if self.enable_caching and (n > 1 or self._recurrent_managers):
            self.prefix.hash_full_blocks(req)
            for m in self._recurrent_managers:
                m.reserve_checkpoints(req, start, end)
            if n > 1:  # a prefill chunk: its known tokens are final, written by this step
                for m in self._token_managers:
                    m.offer(req, start + n, unwritten=True)
                unwritten = any(req.unwritten)
        if pending is not None or unwritten or (self._recurrent_managers and any(req.saves)):
            # the next commit releases copy sources, marks blocks written, caches saves
            req.next_event = 0
        self._update_limits(req, end)

    def _spare(self, pool: BlockPool) -> int:
        """Slots of ``pool`` held by saves the engine has not been handed yet."""
        return sum(m.spare() for m in self._spare_by_pool.get(pool.pool_id, ()))

    def _make_room(self, pool: BlockPool, want_free: int) -> None:
        for m in self._spare_by_pool.get(pool.pool_id, ()):
            m.cancel_open(want_free)

    def _raise_if_never(self, req: RequestState, end: int) -> None:
        admission.check_fits(self.managers, end, self.max_batched_tokens, None)

    def _update_limits(self, req: RequestState, end: int) -> None:
        if self._edge_manager is not None:  # one full-attention group: its table alone
            bs = self._edge_manager.bs
            req.fast_limit = req.slot_limit = n = len(req.tables[0]) * bs
            req.last_block_start = n - bs
            return
        limit = INF
        last = -1
        for m in self._token_managers:
            n = len(req.tables[m.index])
            limit = min(limit, n * m.bs)
            last = max(last, (n - 1) * m.bs)
        req.slot_limit = limit
        req.last_block_start = last
        fast = limit
        for m in self._recurrent_managers:
            fast = min(fast, m.fast_limit(req, end))
        req.fast_limit = fast

    def commit(self, request_id: object, num_computed: int,
               new_tokens: Sequence[int] = ()) -> None:
        """After the forward: ``num_computed`` more tokens have final KV (for speculative
        steps: the last token plus the accepted drafts); ``new_tokens`` (accepted drafts
        and the sampled token) join the sequence. Blocks only rejected drafts used go back."""
        try:
            req = self._reqs[request_id]
        except KeyError:
            req = self._req(request_id)
        if type(num_computed) is not int:
            num_computed = _index("num_computed", num_computed)
        if new_tokens and (type(new_tokens) not in (list, tuple)
                           or not _INT.issuperset(map(type, new_tokens))):
            new_tokens = _token_ids("new_tokens", new_tokens)
        c = req.num_computed + num_computed
        tokens = req.tokens
        # slot_limit is -1 while a looked-up hit waits to be adopted
        if (num_computed < 0 or c > req.slot_limit
                or c > len(tokens) + (len(new_tokens) if new_tokens else 0)):
            raise InvalidArgumentError(
                f"request {request_id!r}: cannot commit {num_computed} tokens at "
                f"{req.num_computed} (slots up to {req.slot_limit}, {len(tokens)} tokens + "
                f"{len(new_tokens) if new_tokens else 0} new)"
            )
        if new_tokens:
            tokens += new_tokens
        req.num_computed = c
        if not req.last_block_start < c < req.next_event:
            self._commit_slow(req)

    def commit_batch(self, request_ids: Sequence[object], new_tokens: Sequence[int]) -> None:
        """``commit(rid, 1, [token])`` for each request of a decode step and its sampled
        token. Each request at most once: a request listed twice is not detected (a check
        would cost every step), and since the lookahead blocks a boundary commit gives back
        are given back after the step's plain commits, a later entry of it may commit into
        them, which per-request ``commit`` calls refuse."""
        if type(new_tokens) is not list or not _INT.issuperset(map(type, new_tokens)):
            new_tokens = _token_ids("new_tokens", new_tokens)
        if len(request_ids) != len(new_tokens):
            raise InvalidArgumentError(
                f"{len(request_ids)} requests but {len(new_tokens)} sampled tokens")
        reqs = self._reqs
        edges: list[RequestState] = []  # requests whose step has work: after the plain ones
        try:
            for rid, tok in zip(request_ids, new_tokens):
                try:
                    req = reqs[rid]
                except KeyError:
                    req = self._req(rid)  # raises, naming it
                c = req.num_computed + 1
                if c > req.slot_limit:
                    self.commit(rid, 1, (tok,))  # raises with the details
                req.tokens.append(tok)
                req.num_computed = c
                if not req.last_block_start < c < req.next_event:
                    edges.append(req)
        finally:  # a plain commit touches only its own request: the order among edges holds
            if edges:
                self._commit_edges(edges)

    def _commit_edges(self, edges: list[RequestState]) -> None:
        """:meth:`_commit_slow` for each of a step's requests that reached work. With one
        full-attention group that caches, a block filled while decoding is hashed and
        cached here, in one loop with the lookups hoisted (what ``hash_full_blocks`` and
        ``offer`` do for one block); any other case takes the general path."""
        m = self._edge_manager
        if m is None or self.event_log.enabled:
            for req in edges:
                self._commit_slow(req)
            return
        self._sync_ledger()  # what the first _commit_slow would do
        bs = m.bs
        k = m.offset
        cache = m.cache
        block_hash = m.pool.block_hash
        null = m.pool.null
        hash_one = self.prefix.hash_one
        for req in edges:
            c = req.num_computed
            hashes = req.hashes.get(bs)
            if (not hashes or req.last_block_start >= c or req.copy_src[0] is not None
                    or req.unwritten[0] or req.mm_spans):
                self._commit_slow(req)
                continue
            tokens = req.tokens
            n = len(hashes)
            full = len(tokens) // bs
            if full == n + 1:  # one block filled while decoding
                hashes.append(hash_one(hashes[-1], tokens[n * bs:full * bs]))
            elif full != n:
                self._commit_slow(req)
                continue
            start = req.ncached[0]
            limit = min((c - k) // bs, len(req.tables[0]), len(hashes))
            if limit != start + 1:
                req.next_event = m.commit(req)
                continue
            b = req.tables[0][start]
            h = hashes[start]
            if b != null and block_hash[b] is None and h not in cache:
                cache[h] = b
                block_hash[b] = h
            req.ncached[0] = limit
            req.next_event = (limit + 1) * bs + k

    def _commit_slow(self, req: RequestState) -> None:
        ledger = self.ledger
        if ledger is not None and self.sync_steps and ledger.launched > ledger.finished:
            ledger.step_finished(ledger.launched)  # _sync_ledger, inlined: every boundary
        if req.last_block_start >= req.num_computed:
            for m in self._token_managers:
                m.trim(req)
            self._update_limits(req, req.num_computed)
        self.prefix.hash_full_blocks(req)
        nxt = INF
        for m in self.managers:
            k = m.commit(req)
            if k < nxt:
                nxt = k
        req.next_event = nxt

    def free(self, request_id: object) -> None:
        """The request finished: give back every block (cached ones stay evictable)."""
        req = self._req(request_id)
        self._sync_ledger()
        self._release(req)
        del self._reqs[request_id]

    def preempt(self, request_id: object) -> None:
        """Free the request's blocks for recompute; it keeps its tokens and can be looked
        up and allocated again (usually hitting the blocks it just cached)."""
        req = self._req(request_id)
        self._sync_ledger()
        self._release(req)
        req.reset()
        req.num_preemptions += 1
        self.preemptions += 1

    def _release(self, req: RequestState) -> None:
        self.changed.append(req)
        for m in self.managers:
            m.free(req)
        req.pending = None

    def watch_tables(self) -> list[RequestState]:
        """A list of its own to which every later change of a request's block tables other
        than blocks appended at a table's end adds the request's state: a prefix hit
        adopted (new lists), blocks leaving a window (nulled, ``first_live`` moved),
        lookahead blocks given back at commit, free and preemption (every table emptied,
        new lists), cross-attention and recurrent slots taken. So a table whose request is
        not listed since some moment holds the blocks it held then, at the same columns,
        and perhaps more after them. The watcher empties the list as it reads it (one
        never read keeps growing); engine/stepmeta.py reads it to skip unchanged rows."""
        log: list[RequestState] = []
        held = self.changed
        sink = log if held is NOWHERE else _Tee(
            (*(held.logs if isinstance(held, _Tee) else (held,)), log))
        self.changed = sink
        for m in self.managers:
            m.changed = sink
        return log

    # --- queries -----------------------------------------------------------------------
    def block_tables(self, request_id: object) -> tuple[list[int], ...]:
        """The request's block table per group (live lists: read, do not modify)."""
        return tuple(self._req(request_id).tables)

    def num_computed(self, request_id: object) -> int:
        return self._req(request_id).num_computed

    def num_tokens(self, request_id: object) -> int:
        return len(self._req(request_id).tokens)

    @property
    def requests(self) -> Mapping[object, RequestState]:
        return self._reqs

    def drain_events(self) -> list[BlockEvent]:
        return self.event_log.drain()

    def drain_copy_ops(self) -> list[CopyOp]:
        """Copies (partial hit blocks, recurrent checkpoints) the engine must run before
        the next forward."""
        out: list[CopyOp] = []
        for m in self.managers:
            if m.ops:
                out += m.ops
                m.ops = []
        for m in self._recurrent_managers:
            m.handed_out()  # the engine will write these saves: no longer cancellable
        if self.ledger is not None and self.own_steps:  # launched: emptied pages wait for it
            self._sync_ledger()
            self._step += 1
            self.ledger.step_launched(self._step)
        return out

    def drain_page_ops(self) -> list[PageOp]:
        """Physical pages to map and unmap (elastic pools), to apply before this step's
        copy ops and forward: unmaps first (their last step has finished), then maps."""
        return self.ledger.drain() if self.ledger is not None else []

    def step_finished(self, step: int) -> None:
        """Asynchronous engines (``sync_steps=False``): every step up to ``step`` (the
        count of ``drain_copy_ops`` calls, from 0) has finished on the device."""
        if self.ledger is not None:
            self.ledger.step_finished(step)

    def mapped_bytes(self) -> int:
        """Bytes of physical pages the pools hold (the whole budget for fixed pools)."""
        if self.ledger is None:
            return sum(p.num_blocks * m.group.page_bytes for p, m in
                       {m.pool.pool_id: (m.pool, m) for m in self.managers}.values())
        return self.ledger.mapped_bytes()

    def floor_bytes(self) -> int:
        """Bytes the elastic pools' floors keep mapped (0 for fixed pools)."""
        return self.ledger.floor_bytes() if self.ledger is not None else 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (new weights, ...). Only while no request holds
        blocks, as a held block's hash is how sharing is checked; False otherwise."""
        if any(p.used[g] for p in self.pools for g in p.used):
            return False
        self._sync_ledger()
        for pool in self.pools:
            pool.clear_cache()
        for req in self._reqs.values():
            req.pending = None
        return True

    def blocks_used(self) -> list[int]:
        """Blocks held by live requests, per group (evictable cached blocks excluded)."""
        return [m.pool.used[m.gid] for m in self.managers]

    def metrics(self) -> Metrics:
        groups = tuple(
            GroupMetrics(m.gid, m.group.retention.kind, m.pool.usable, m.pool.used[m.gid],
                         len(m.pool.evictable), len(m.cache))
            for m in self.managers
        )
        return Metrics(groups, len(self._reqs), self.prefix_queries, self.prefix_hits,
                       sum(p.evictions for p in self.pools), self.preemptions)
