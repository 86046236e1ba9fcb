"""The invariants of checked mode (``checked=True`` or ``PAGEDKV_DEBUG=1``).

:func:`sweep` walks everything, O(blocks + table entries): the periodic full check.
:func:`pool_counters`, :func:`block_state` and :func:`request_tail` check only what one
call touched, in O(1) per block or table entry. Each violation raises
:class:`CacheCorruptedError` naming the invariant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.errors import CacheCorruptedError

if TYPE_CHECKING:
    from pagedkv.blocks.manager import KVCacheManager
    from pagedkv.blocks.pool import BlockPool
    from pagedkv.blocks.request import RequestState


def _require(ok: bool, invariant: str, detail: str) -> None:
    if not ok:
        raise CacheCorruptedError(f"invariant '{invariant}' violated: {detail}")


def sweep(mgr: KVCacheManager) -> None:
    owners = {p.pool_id: [0] * p.num_blocks for p in mgr.pools}
    for req in mgr.requests.values():
        _require(0 <= req.num_computed <= len(req.tokens), "progress within tokens",
                 f"request {req.id!r}: {req.num_computed} computed of {len(req.tokens)}")
        for m in mgr.managers:
            table = req.tables[m.index]
            count = owners[m.pool.pool_id]
            null = m.pool.null
            live = [b for b in table if b != null]
            _require(len(set(live)) == len(live), "a table holds a block once",
                     f"request {req.id!r} group {m.gid}: {table}")
            for b in live:
                _require(m.pool.first <= b < m.pool.num_blocks and m.pool.block_group[b] == m.gid,
                         "blocks belong to their group",
                         f"request {req.id!r} group {m.gid} holds block {b} of group "
                         f"{m.pool.block_group[b] if m.pool.first <= b < m.pool.num_blocks else '?'}")
                count[b] += 1
            src = req.copy_src[m.index]
            if src is not None:
                count[src] += 1
            for save in req.saves[m.index]:
                count[save.slot] += 1
            if m.holds_tokens:
                _require(len(table) * m.bs >= req.num_computed or not table and not req.num_computed,
                         "computed tokens have slots",
                         f"request {req.id!r} group {m.gid}: {len(table)} blocks of {m.bs} for "
                         f"{req.num_computed} computed tokens")
                hashes = req.hashes.get(m.bs, [])
                for j in range(min(req.ncached[m.index], len(table), len(hashes))):
                    b = table[j]
                    h = m.pool.block_hash[b] if b != null else None
                    if h is not None:
                        _require(h == m.key(req, j), "hash map consistent with block contents",
                                 f"request {req.id!r} group {m.gid} block {j} (id {b}) is "
                                 "cached under a hash of other tokens")
            elif table and m.caching and m.group.retention.kind == "recurrent":
                _require(m.pool.block_hash[table[0]] is None, "working state is never cached",
                         f"request {req.id!r} group {m.gid}: slot {table[0]} is cached")
    for m in mgr.managers:
        listed = [b for req in mgr.requests.values() for b in req.unwritten[m.index]]
        _require(len(listed) == len(set(listed)) and set(listed) == m.unwritten,
                 "unwritten blocks are those live requests cached at allocation",
                 f"group {m.gid}: manager {sorted(m.unwritten)[:8]}, requests {sorted(listed)[:8]}")
        _require(all(m.pool.block_hash[b] is not None and m.pool.ref[b] > 0 for b in m.unwritten),
                 "unwritten blocks are cached and held", f"group {m.gid}")
    for pool in mgr.pools:
        _sweep_pool(pool, owners[pool.pool_id])


def _sweep_pool(pool, owners: list[int]) -> None:  # noqa: ANN001
    pid = pool.pool_id
    free = pool.free_blocks()
    evictable = list(pool.evictable)
    free_set = set(free)
    _require(len(free_set) == len(free), "free list without repeats", f"pool {pid}")
    _require(not free_set & set(evictable), "a free block is plain or cached, not both",
             f"pool {pid}: {sorted(free_set & set(evictable))[:8]}")
    _require(pool.null not in free_set and pool.null not in pool.evictable
             and (pool.null < 0 or pool.ref[pool.null] == 0),
             "null block never allocated", f"pool {pid}")
    # ids an elastic pool never handed out (>= its watermark) hold nothing by construction
    top = getattr(pool, "fresh", pool.num_blocks)
    _require(all(pool.ref[b] == 0 and pool.block_hash[b] is None for b in (top, pool.num_blocks - 1)
                 if top < pool.num_blocks), "ids never handed out hold nothing", f"pool {pid}")
    used = [b for b in range(pool.first, top) if pool.ref[b] > 0]
    _require(len(free) + len(evictable) + len(used) == pool.usable, "free + used = total",
             f"pool {pid}: {len(free)} free + {len(evictable)} evictable + {len(used)} used "
             f"!= {pool.usable}")
    for b in range(pool.first, top):
        _require(pool.ref[b] == owners[b], "reference counts equal owners",
                 f"pool {pid} block {b}: ref {pool.ref[b]}, {owners[b]} owners")
        if owners[b] > 1:
            _require(pool.block_hash[b] is not None, "only cached blocks are shared",
                     f"pool {pid} block {b} has {owners[b]} owners and no hash")
    for b in free:
        _require(pool.block_hash[b] is None, "plain free blocks carry no hash",
                 f"pool {pid} block {b}")
    for b in evictable:
        _require(pool.ref[b] == 0 and pool.block_hash[b] is not None,
                 "evictable blocks are cached and unreferenced", f"pool {pid} block {b}")
    per_group = dict.fromkeys(pool.used, 0)
    for b in used:
        per_group[pool.block_group[b]] = per_group.get(pool.block_group[b], 0) + 1
    _require(per_group == pool.used, "used counters match", f"pool {pid}: {pool.used} vs {per_group}")
    hashed = 0
    for g, cache in pool.caches.items():
        for h, b in cache.items():
            _require(pool.block_hash[b] == h and pool.block_group[b] == g,
                     "hash map consistent with block hashes",
                     f"pool {pid} group {g}: hash maps to block {b} holding "
                     f"{pool.block_hash[b]!r} of group {pool.block_group[b]}")
        hashed += len(cache)
    _require(hashed == sum(1 for h in pool.block_hash if h is not None),
             "every hashed block is in its group's map", f"pool {pid}")
    ledger = getattr(pool, "ledger", None)
    if ledger is not None:
        for b in range(pool.first, top):
            data = pool.ref[b] > 0 or pool.block_hash[b] is not None
            _require(ledger.holds_data(pid, b) == data, "the page ledger knows which blocks hold data",
                     f"pool {pid} block {b}: ledger {ledger.holds_data(pid, b)}, pool {data}")
            _require(ledger.is_idle(pid, b) == (pool.report_idle and b in pool.evictable),
                     "the page ledger knows which blocks are cached free (idle)",
                     f"pool {pid} block {b}: ledger {ledger.is_idle(pid, b)}, pool "
                     f"{b in pool.evictable} (reported: {pool.report_idle})")
            if data:
                _require(ledger.is_mapped(pid, b), "blocks holding data lie on mapped pages",
                         f"pool {pid} block {b} (ref {pool.ref[b]}) is on an unmapped page")
        _require(ledger.mapped_bytes() <= ledger.budget_bytes, "mapped bytes within the budget",
                 f"{ledger.mapped_bytes()} > {ledger.budget_bytes}")
        _require(ledger.finished <= ledger.launched, "steps finish after they launch",
                 f"finished {ledger.finished}, launched {ledger.launched}")
        ledger.check()  # floors mapped, page counts, no pending page holds data


# --- incremental checks --------------------------------------------------------------
# Each test is a plain comparison; the message is built only on a violation (these run
# after every call of checked mode).

def pool_counters(pool: BlockPool) -> None:
    """O(groups): every usable block is free, cached-free or used, exactly once in total."""
    used = sum(pool.used.values())
    plain = pool.num_plain_free()
    if plain + len(pool.evictable) + used != pool.usable:
        _require(False, "free + used = total",
                 f"pool {pool.pool_id}: {plain} free + {len(pool.evictable)} evictable + "
                 f"{used} used != {pool.usable}")
    ledger = getattr(pool, "ledger", None)
    if ledger is not None and ledger.mapped_bytes() > ledger.budget_bytes:
        _require(False, "mapped bytes within the budget",
                 f"{ledger.mapped_bytes()} > {ledger.budget_bytes}")


def block_state(pool: BlockPool, b: int) -> None:
    """O(1): block ``b``'s reference count, hash, LRU membership and map entry agree."""
    pid = pool.pool_id
    if b == pool.null:
        if pool.ref[b] != 0 or b in pool.evictable:
            _require(False, "null block never allocated", f"pool {pid}")
        return
    if not pool.first <= b < pool.num_blocks:
        _require(False, "blocks belong to their pool", f"pool {pid}: block id {b}")
    ref = pool.ref[b]
    h = pool.block_hash[b]
    if ref < 0:
        _require(False, "reference counts equal owners", f"pool {pid} block {b}: ref {ref}")
    if ref == 0:
        if (b in pool.evictable) != (h is not None):
            _require(False, "evictable blocks are cached and unreferenced" if h is not None
                     else "plain free blocks carry no hash", f"pool {pid} block {b}")
    else:
        if b in pool.evictable:
            _require(False, "evictable blocks are cached and unreferenced",
                     f"pool {pid} block {b} has ref {ref} and sits in the LRU")
        if ref > 1 and h is None:
            _require(False, "only cached blocks are shared",
                     f"pool {pid} block {b} has {ref} owners and no hash")
    if h is not None:
        g = pool.block_group[b]
        if pool.caches.get(g, {}).get(h) != b:
            _require(False, "hash map consistent with block hashes",
                     f"pool {pid} group {g}: block {b} holds a hash that maps elsewhere")
    ledger = getattr(pool, "ledger", None)
    if ledger is not None:
        data = ref > 0 or h is not None
        if ledger.holds_data(pid, b) != data:
            _require(False, "the page ledger knows which blocks hold data",
                     f"pool {pid} block {b}: ledger {ledger.holds_data(pid, b)}, pool {data}")
        if ledger.is_idle(pid, b) != (pool.report_idle and b in pool.evictable):
            _require(False, "the page ledger knows which blocks are cached free (idle)",
                     f"pool {pid} block {b}: ledger {ledger.is_idle(pid, b)}, pool "
                     f"{b in pool.evictable} (reported: {pool.report_idle})")
        if data and not ledger.is_mapped(pid, b):
            _require(False, "blocks holding data lie on mapped pages",
                     f"pool {pid} block {b} (ref {ref}) is on an unmapped page")


def progress(req: RequestState) -> None:
    """O(1): a request's computed tokens lie within its known tokens."""
    if not 0 <= req.num_computed <= len(req.tokens):
        _require(False, "progress within tokens",
                 f"request {req.id!r}: {req.num_computed} computed of {len(req.tokens)}")


def request_tail(mgr: KVCacheManager, req: RequestState,
                 seen: list[tuple[int, int]] | None) -> None:
    """What a call can have changed in one request: progress, the table entries past the
    length seen at the last check (and the last one), the newly cached prefix's hashes."""
    if not 0 <= req.num_computed <= len(req.tokens):
        _require(False, "progress within tokens",
                 f"request {req.id!r}: {req.num_computed} computed of {len(req.tokens)}")
    for m in mgr.managers:
        i = m.index
        table = req.tables[i]
        pool = m.pool
        old_len, old_cached = seen[i] if seen is not None else (0, 0)
        start = max(0, min(old_len, len(table)) - 1)
        null = pool.null
        first, top, group, ref = pool.first, pool.num_blocks, pool.block_group, pool.ref
        gid = m.gid
        for b in table[start:]:
            if b != null and not (first <= b < top and group[b] == gid and ref[b] > 0):
                ok = first <= b < top
                _require(False, "blocks belong to their group",
                         f"request {req.id!r} group {gid} holds block {b} "
                         f"(group {group[b] if ok else '?'}, ref {ref[b] if ok else '?'})")
        if m.holds_tokens:
            if len(table) * m.bs < req.num_computed and (table or req.num_computed):
                _require(False, "computed tokens have slots",
                         f"request {req.id!r} group {gid}: {len(table)} blocks of {m.bs} for "
                         f"{req.num_computed} computed tokens")
            stop = req.ncached[i]
            lo = min(old_cached, stop)
            if lo < stop:
                hashes = req.hashes.get(m.bs, [])
                block_hash = pool.block_hash
                for j in range(lo, min(stop, len(table), len(hashes))):
                    b = table[j]
                    h = block_hash[b] if b != null else None
                    if h is not None and h != m.key(req, j):
                        _require(False, "hash map consistent with block contents",
                                 f"request {req.id!r} group {gid} block {j} (id {b}) is "
                                 "cached under a hash of other tokens")
