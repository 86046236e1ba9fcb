"""The block manager of a whole plan: one manager per block-table group, one pool per
memory pool, and the calls an engine makes every step.

Per request: ``add_request`` -> ``find_cached_prefix`` -> ``allocate`` (False: no room
now; wait or preempt) -> after the forward ``commit`` -> ... -> ``free`` (or ``preempt``).
Hot path: a decode step that crosses no block boundary does a dict lookup and a few
integer comparisons in ``allocate`` and ``commit``; hashing, caching, window frees and
allocations run only when some group reaches its next boundary (``next_event``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

from pagedkv.blocks import admission, checks
from pagedkv.blocks.base import GroupManager
from pagedkv.blocks.cross import CrossManager
from pagedkv.blocks.events import BlockEvent, CopyOp, EventLog, GroupMetrics, Metrics
from pagedkv.blocks.full import FullManager
from pagedkv.blocks.hashing import hash_extender, key_mixer, root_hash
from pagedkv.blocks.pool import BlockPool
from pagedkv.blocks.recurrent import (
    DEFAULT_POLICY,
    NO_CHECKPOINTS,
    CheckpointPolicy,
    RecurrentManager,
)
from pagedkv.blocks.request import INF, RequestState
from pagedkv.blocks.window import WindowManager
from pagedkv.errors import CacheCorruptedError, InvalidArgumentError, UnsupportedCapabilityError
from pagedkv.kvspec.retention import describe
from pagedkv.plan.sizing import reserved_blocks
from pagedkv.plan.types import Group, Plan

_MANAGERS: dict[str, type[GroupManager]] = {
    "full": FullManager,
    "sliding_window": WindowManager,
    "chunked_local": WindowManager,
    "cross": CrossManager,
}  # recurrent groups take one more argument (their checkpoint policy)

# calls the checked mode guards (and refuses once corrupted)
_PUBLIC = ("add_request", "find_cached_prefix", "allocate", "allocate_batch", "commit",
           "commit_batch", "free", "preempt",
           "block_tables", "check_fits", "metrics", "drain_events", "drain_copy_ops",
           "reset_prefix_cache", "num_computed", "num_tokens")


def _null_pages(groups: Iterable[Group]) -> int:
    """Null blocks a pool serving ``groups`` reserves: one if any group needs it."""
    return max((reserved_blocks(g.retention) for g in groups), default=0)


def debug_from_env() -> bool:
    return os.environ.get("PAGEDKV_DEBUG", "").strip() not in ("", "0", "false", "no")


class KVCacheManager:
    """Blocks for every group of a plan.

    ``pools``: pool id -> (group ids, number of blocks); default one pool per group of
    ``group.num_blocks`` blocks. Block 0 of a pool serving a sliding-window or chunked group
    is the null block (:func:`pagedkv.plan.reserved_blocks`); a plan counts it in
    ``Group.num_blocks`` / ``Pool.num_pages`` (``reserved_blocks`` / ``reserved_pages``), so
    the usable blocks equal the plan's. ``checked`` (default: env ``PAGEDKV_DEBUG=1``) sweeps every invariant after
    every call. Recurrent checkpoints (prefix hits for recurrent groups; spare state slots
    only): ``recurrent_checkpoint_every`` None = the default :class:`CheckpointPolicy`
    (branch points, prompt ends, newest decoded block), N > 0 = every N blocks and nowhere
    else, 0 = none; ``checkpoint_policy`` overrides both. A retention's own interval wins.
    """

    def __init__(self, groups: Sequence[Group], *,
                 pools: Mapping[int, tuple[Sequence[int], int]] | None = None,
                 max_model_len: int | None = None, max_batched_tokens: int = 2048,
                 enable_caching: bool = True, hash_algo: str = "fast",
                 checked: bool | None = None, events: bool = False,
                 recurrent_checkpoint_every: int | None = None,
                 checkpoint_policy: CheckpointPolicy | None = None) -> None:
        if not groups:
            raise InvalidArgumentError("a block manager needs at least one group")
        if max_batched_tokens <= 0:
            raise InvalidArgumentError(f"max_batched_tokens must be > 0, got {max_batched_tokens}")
        self.groups = tuple(groups)
        self.max_model_len = max_model_len
        self.max_batched_tokens = max_batched_tokens
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        self._extend = hash_extender(hash_algo)
        self._mixer = key_mixer(hash_algo)
        self.event_log = EventLog(events)
        self.pools = self._make_pools(pools)
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
            args = (i, g, pool_of[g.id], enable_caching, self.event_log)
            if g.retention.kind == "recurrent":
                managers.append(RecurrentManager(*args, policy))
            elif g.retention.kind not in _MANAGERS:
                raise UnsupportedCapabilityError(
                    f"group {i} keeps {describe(g.retention)} retention, which the block "
                    "manager does not manage (pagedkv plan sizes it; simulation and "
                    "allocation do not)"
                )
            else:
                managers.append(_MANAGERS[g.retention.kind](*args))
        self.managers: tuple[GroupManager, ...] = tuple(managers)
        self._token_managers = tuple(m for m in self.managers if m.holds_tokens)
        self._window_managers = tuple(m for m in self.managers if isinstance(m, WindowManager))
        self._recurrent_managers = tuple(m for m in self.managers
                                         if isinstance(m, RecurrentManager))
        self._spare_by_pool: dict[int, tuple[RecurrentManager, ...]] = {}
        for m in self._recurrent_managers:
            pid = m.pool.pool_id
            self._spare_by_pool[pid] = self._spare_by_pool.get(pid, ()) + (m,)
        self._block_sizes = tuple(sorted({m.bs for m in self.managers}))
        self._any_caching = any(m.caching for m in self.managers)
        self._pool_per_group = len({m.pool.pool_id for m in self.managers}) == len(self.managers)
        self._reqs: dict[object, RequestState] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preemptions = 0
        self._corrupted: str | None = None
        self.checked = debug_from_env() if checked is None else checked
        if self.checked:
            for name in _PUBLIC:
                setattr(self, name, self._guard(getattr(self, name)))

    @classmethod
    def from_plan(cls, plan: Plan, **kwargs: object) -> KVCacheManager:
        """Manager for ``plan``: its groups and (rank 0's) pools, its token budget."""
        pools = None
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
        return cls(plan.groups, pools=pools, **kwargs)  # type: ignore[arg-type]

    def _make_pools(self, spec: Mapping[int, tuple[Sequence[int], int]] | None
                    ) -> tuple[BlockPool, ...]:
        ids = [g.id for g in self.groups]
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError(f"group ids repeat: {ids}")
        if spec is None:
            spec = {g.id: ((g.id,), g.num_blocks) for g in self.groups}
        pools = []
        seen: list[int] = []
        by_id = {g.id: g for g in self.groups}
        for pid, (gids, num_blocks) in spec.items():
            pool = BlockPool(num_blocks, pid, self.event_log,
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

    # --- checked mode ------------------------------------------------------------------
    def _guard(self, method):  # noqa: ANN001, ANN202 - wraps bound methods one to one
        def checked_call(*args, **kwargs):
            if self._corrupted is not None:
                raise CacheCorruptedError(f"manager refuses calls after: {self._corrupted}")
            result = method(*args, **kwargs)
            self.check_invariants()
            return result

        checked_call.__name__ = method.__name__
        checked_call.__doc__ = method.__doc__
        return checked_call

    def check_invariants(self) -> None:
        """Full sweep; on a violation the manager is marked corrupted and refuses calls."""
        if self._corrupted is not None:
            raise CacheCorruptedError(f"manager refuses calls after: {self._corrupted}")
        try:
            checks.sweep(self)
        except CacheCorruptedError as exc:
            self._corrupted = str(exc)
            raise

    # --- requests ----------------------------------------------------------------------
    def check_fits(self, num_tokens: int) -> None:
        """Raise RequestTooLargeError when a request of ``num_tokens`` can never fit."""
        admission.check_fits(self.managers, num_tokens, self.max_batched_tokens,
                             self.max_model_len)

    def add_request(self, request_id: object, prompt_tokens: Sequence[int], *,
                    max_new_tokens: int | None = None, extra_keys: Sequence[object] = (),
                    mm_spans: Iterable[tuple[int, int, int]] = ()) -> None:
        """Register a request. ``extra_keys`` (cache salt, LoRA id...) separate its cache
        entries from others'; ``mm_spans`` are (start, end, content hash) of multimodal
        inputs, folded into the hash of every block they touch."""
        if request_id in self._reqs:
            raise InvalidArgumentError(f"request {request_id!r} is already registered")
        if not prompt_tokens:
            raise InvalidArgumentError(f"request {request_id!r} has an empty prompt")
        if max_new_tokens is not None and max_new_tokens < 0:
            raise InvalidArgumentError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        self.check_fits(len(prompt_tokens) + (max_new_tokens or 0))
        spans = tuple(sorted((int(a), int(b), int(h)) for a, b, h in mm_spans))
        for a, b, _ in spans:
            if not 0 <= a < b:
                raise InvalidArgumentError(f"bad multimodal span [{a}, {b})")
        req = RequestState(request_id, list(prompt_tokens), root_hash(tuple(extra_keys)),
                           spans, len(self.managers), max_new_tokens)
        self._hash_full_blocks(req)  # once per prompt; later blocks as they fill
        self._reqs[request_id] = req

    def _req(self, request_id: object) -> RequestState:
        try:
            return self._reqs[request_id]
        except KeyError:
            raise InvalidArgumentError(f"unknown request {request_id!r}") from None

    def _hash_full_blocks(self, req: RequestState) -> None:
        """Extend every block size's hash chain over newly full blocks of known tokens."""
        if not self.enable_caching:
            return
        tokens = req.tokens
        for bs in self._block_sizes:
            hashes = req.hashes.get(bs)
            if hashes is None:
                hashes = req.hashes[bs] = []
            start = len(hashes)
            stop = len(tokens) // bs
            if stop <= start:
                continue
            parent = hashes[-1] if hashes else req.root
            if not req.mm_spans:
                self._extend(tokens, start, stop, bs, parent, hashes)
                continue
            for j in range(start, stop):  # blocks with multimodal content mix its ids in
                self._extend(tokens, j, j + 1, bs, parent, hashes)
                lo, hi = j * bs, (j + 1) * bs
                ids = [h for a, b, h in req.mm_spans if a < hi and b > lo]
                if ids:
                    hashes[-1] = self._mixer(hashes[-1], ids)
                parent = hashes[-1]

    def find_cached_prefix(self, request_id: object) -> int:
        """Tokens of the request already cached in every group (the longest prefix all
        groups agree on, at most all tokens but the last). Kept for the next ``allocate``."""
        req = self._req(request_id)
        if req.num_computed or any(req.tables):
            raise InvalidArgumentError(
                f"request {request_id!r} already holds blocks; look up before allocating"
            )
        return self._lookup(req)

    def _lookup(self, req: RequestState) -> int:
        self.prefix_queries += len(req.tokens)
        if not self._any_caching:
            req.pending = (0, self._epoch(), [[] for _ in self.managers])
            req.fast_limit = req.slot_limit = -1
            return 0
        h = len(req.tokens) - 1
        hits: list[list[int]] = [[] for _ in self.managers]
        answers = [-1] * len(self.managers)
        branch = -1  # what the token groups alone have cached: where requests diverge
        while True:  # fixed point: every group's longest valid hit of at most h equals h
            for m in self.managers:
                if answers[m.index] != h:
                    answers[m.index], hits[m.index] = m.find_hit(req, h)
            if branch < 0 and self._recurrent_managers:
                branch = min((answers[m.index] for m in self._token_managers), default=0)
            lowest = min(answers)
            if lowest == h:
                break
            h = lowest
        for m in self._recurrent_managers:
            m.plan_marks(req, h, branch)
        self.prefix_hits += h
        req.pending = (h, self._epoch(), hits)
        req.fast_limit = req.slot_limit = -1
        return h

    def _epoch(self) -> int:
        return sum(p.epoch for p in self.pools)

    def allocate(self, request_id: object, num_new_tokens: int, num_lookahead: int = 0) -> bool:
        """Slots for ``num_new_tokens`` tokens to compute this step plus ``num_lookahead``
        draft positions, in every group. False (and no change) when a pool is short."""
        try:
            req = self._reqs[request_id]
        except KeyError:
            req = self._req(request_id)
        # fast_limit is -1 while a looked-up hit waits to be adopted
        if (req.num_computed + num_new_tokens + num_lookahead <= req.fast_limit
                and num_new_tokens >= 0 and num_lookahead >= 0):
            return True
        return self._allocate_slow(req, num_new_tokens, num_lookahead)

    def allocate_batch(self, request_ids: Sequence[object], num_new_tokens: int = 1,
                       num_lookahead: int = 0) -> int:
        """``allocate`` for each request in order (a decode step: one token each); stops at
        the first that does not fit and returns how many got their slots."""
        if num_new_tokens < 0 or num_lookahead < 0:
            raise InvalidArgumentError(
                f"token counts must be >= 0, got {num_new_tokens} and {num_lookahead}")
        reqs = self._reqs
        k = num_new_tokens + num_lookahead
        for i, rid in enumerate(request_ids):
            req = reqs.get(rid)
            if req is not None and req.num_computed + k <= req.fast_limit:
                continue
            if not self._allocate_slow(self._req(rid), num_new_tokens, num_lookahead):
                return i
        return len(request_ids)

    def _allocate_slow(self, req: RequestState, n: int, lookahead: int) -> bool:
        if n < 0 or lookahead < 0:
            raise InvalidArgumentError(f"token counts must be >= 0, got {n} and {lookahead}")
        pending = req.pending
        if pending is not None and pending[1] != self._epoch():  # a hit block was evicted
            req.pending = None
            self.prefix_queries -= len(req.tokens)
            self.prefix_hits -= pending[0]
            self._lookup(req)
            pending = req.pending
        start = pending[0] if pending is not None else req.num_computed
        end = start + n + lookahead
        if end > len(req.tokens) + lookahead:
            raise InvalidArgumentError(
                f"request {req.id!r}: {n} new tokens from position {start} run past its "
                f"{len(req.tokens)} known tokens"
            )
        if pending is None:
            for m in self._window_managers:
                m.drop_out_of_window(req)
        hits = pending[2] if pending is not None else None
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
        for m in self.managers:
            m.allocate(req, end, hits[m.index] if hits is not None else None)
        if pending is not None:
            req.num_computed = start
            req.pending = None
        if self.enable_caching and (n > 1 or self._recurrent_managers):
            self._hash_full_blocks(req)
            for m in self._recurrent_managers:
                m.reserve_checkpoints(req, start, end)
            if n > 1:  # a prefill chunk: its known tokens are final
                for m in self._token_managers:
                    m.offer(req, start + n)
        if pending is not None or (self._recurrent_managers and any(req.saves)):
            req.next_event = 0  # the next commit releases copy sources, caches saves
        self._update_limits(req, end)
        return True

    def _spare(self, pool: BlockPool) -> int:
        """Slots of ``pool`` held by saves the engine has not been handed yet."""
        return sum(m.spare() for m in self._spare_by_pool.get(pool.pool_id, ()))

    def _make_room(self, pool: BlockPool, want_free: int) -> None:
        for m in self._spare_by_pool.get(pool.pool_id, ()):
            m.cancel_open(want_free)

    def _raise_if_never(self, req: RequestState, end: int) -> None:
        admission.check_fits(self.managers, end, self.max_batched_tokens, None)

    def _update_limits(self, req: RequestState, end: int) -> None:
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
        tokens = req.tokens
        c = req.num_computed + num_computed
        # slot_limit is -1 while a looked-up hit waits to be adopted
        if c > req.slot_limit or c > len(tokens) + len(new_tokens) or num_computed < 0:
            raise InvalidArgumentError(
                f"request {request_id!r}: cannot commit {num_computed} tokens at "
                f"{req.num_computed} (slots up to {req.slot_limit}, {len(tokens)} tokens + "
                f"{len(new_tokens)} new)"
            )
        if new_tokens:
            tokens += new_tokens
        req.num_computed = c
        if c >= req.next_event or req.last_block_start >= c:
            self._commit_slow(req)

    def commit_batch(self, request_ids: Sequence[object], new_tokens: Sequence[int]) -> None:
        """``commit(rid, 1, [token])`` for each request of a decode step and its sampled
        token."""
        if len(request_ids) != len(new_tokens):
            raise InvalidArgumentError(
                f"{len(request_ids)} requests but {len(new_tokens)} sampled tokens")
        reqs = self._reqs
        for rid, tok in zip(request_ids, new_tokens):
            req = reqs.get(rid)
            if req is None:
                req = self._req(rid)
            c = req.num_computed + 1
            if c > req.slot_limit:
                self.commit(rid, 1, (tok,))  # raises with the details
            req.tokens.append(tok)
            req.num_computed = c
            if c >= req.next_event or req.last_block_start >= c:
                self._commit_slow(req)

    def _commit_slow(self, req: RequestState) -> None:
        if req.last_block_start >= req.num_computed:
            for m in self._token_managers:
                m.trim(req)
            self._update_limits(req, req.num_computed)
        self._hash_full_blocks(req)
        nxt = INF
        for m in self.managers:
            nxt = min(nxt, m.commit(req))
        req.next_event = nxt

    def free(self, request_id: object) -> None:
        """The request finished: give back every block (cached ones stay evictable)."""
        req = self._req(request_id)
        self._release(req)
        del self._reqs[request_id]

    def preempt(self, request_id: object) -> None:
        """Free the request's blocks for recompute; it keeps its tokens and can be looked
        up and allocated again (usually hitting the blocks it just cached)."""
        req = self._req(request_id)
        self._release(req)
        req.reset()
        req.num_preemptions += 1
        self.preemptions += 1

    def _release(self, req: RequestState) -> None:
        for m in self.managers:
            m.free(req)
        req.pending = None

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
        return out

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (new weights, ...). Only while no request holds
        blocks, as a held block's hash is how sharing is checked; False otherwise."""
        if any(p.used[g] for p in self.pools for g in p.used):
            return False
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
