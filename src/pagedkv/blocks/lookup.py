"""Prefix lookup: the hash chains of a request and the longest prefix every group agrees on.

Each group answers "my longest valid hit of at most h tokens"; the lookup lowers h until
every group answers h (a fixed point: a group's answer never exceeds the h it was asked).
Recurrent groups also learn where the token groups' cached prefix ends (the branch point,
where they save a checkpoint).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.blocks.base import GroupManager
from pagedkv.blocks.hashing import block_hasher, hash_extender, key_mixer
from pagedkv.blocks.pool import BlockPool
from pagedkv.blocks.recurrent import RecurrentManager
from pagedkv.blocks.request import PendingHit, RequestState


class PrefixLookup:
    """Hashes requests' full blocks and finds their cached prefix; counts queries and hits
    (prompt tokens looked up, tokens served from the cache)."""

    def __init__(self, managers: Sequence[GroupManager], pools: Sequence[BlockPool],
                 hash_algo: str, enabled: bool) -> None:
        self.managers = tuple(managers)
        self.pools = tuple(pools)
        self.enabled = enabled
        self.token_managers = tuple(m for m in self.managers if m.holds_tokens)
        self.recurrent_managers = tuple(m for m in self.managers
                                        if isinstance(m, RecurrentManager))
        self.any_caching = any(m.caching for m in self.managers)
        self.block_sizes = tuple(sorted({m.bs for m in self.managers}))
        self._extend = hash_extender(hash_algo)
        self.hash_one = block_hasher(hash_algo)
        # one block size: a decode step's newly full block is hashed on a short path
        self._only_bs = self.block_sizes[0] if len(self.block_sizes) == 1 else 0
        self._mixer = key_mixer(hash_algo)
        # per block size, from the last prompt hashed whole (_hash_prompt): its root, the
        # tokens and keys of the blocks it shared with the one before, all its keys
        self._last: dict[int, tuple[int, list[int], list[int], list[int]]] = {}
        self.queries = 0
        self.hits = 0

    def epoch(self) -> int:
        """Changes whenever any cached block loses its hash (a pending hit may be stale)."""
        pools = self.pools
        return pools[0].epoch if len(pools) == 1 else sum(p.epoch for p in pools)

    def hash_full_blocks(self, req: RequestState) -> None:
        """Extend every block size's hash chain over newly full blocks of known tokens."""
        if not self.enabled:
            return
        tokens = req.tokens
        bs = self._only_bs
        if bs and not req.mm_spans:
            hashes = req.hashes.get(bs)
            if hashes:
                n = len(hashes)
                full = len(tokens) // bs
                if full == n + 1:  # one block filled while decoding
                    hashes.append(self.hash_one(hashes[-1], tokens[n * bs:full * bs]))
                    return
                if full == n:  # nothing new (a prefill's allocation and commit)
                    return
        for bs in self.block_sizes:
            hashes = req.hashes.get(bs)
            if hashes is None:
                hashes = req.hashes[bs] = []
            start = len(hashes)
            stop = len(tokens) // bs
            if stop <= start:
                continue
            if not req.mm_spans:
                if start:
                    self._extend(tokens, start, stop, bs, hashes[-1], hashes)
                else:
                    self._hash_prompt(req, bs, stop, hashes)
                continue
            parent = hashes[-1] if hashes else req.root
            for j in range(start, stop):  # blocks with multimodal content mix its ids in
                self._extend(tokens, j, j + 1, bs, parent, hashes)
                lo, hi = j * bs, (j + 1) * bs
                ids = [h for a, b, h in req.mm_spans if a < hi and b > lo]
                if ids:
                    hashes[-1] = self._mixer(hashes[-1], ids)
                parent = hashes[-1]

    def _hash_prompt(self, req: RequestState, bs: int, stop: int, hashes: list[int]) -> None:
        """A new prompt's keys (no multimodal spans). The leading blocks the last two
        prompts hashed here shared (the head: a system prompt, a conversation so far) are
        copied, not hashed again, when this prompt starts with them too and has the same
        root. Exact: the tokens are compared (one C-level list comparison), and a block's
        key depends only on the root and the tokens up to its end."""
        tokens = req.tokens
        root = req.root
        last = self._last.get(bs)
        same_root = last is not None and last[0] == root
        c = 0
        if same_root:
            _, head_tokens, head_keys, prev = last  # type: ignore[misc]
            c = len(head_keys)
            if c and c <= stop and tokens[:c * bs] == head_tokens:
                hashes += head_keys
            else:
                c = 0
        reused = c
        if stop > c:
            self._extend(tokens, c, stop, bs, hashes[-1] if c else root, hashes)
        if same_root:  # the head this prompt shares with the last one (equal keys: almost
            n = min(len(hashes), len(prev))  # surely equal blocks; the next prompt compares)
            while c < n and hashes[c] == prev[c]:
                c += 1
        if not same_root or c != reused:
            head_tokens, head_keys = tokens[:c * bs], hashes[:c]
        self._last[bs] = (root, head_tokens, head_keys, hashes)

    def lookup(self, req: RequestState) -> int:
        """Tokens of ``req`` cached in every group; leaves the hit pending on ``req``."""
        self.queries += len(req.tokens)
        managers = self.managers
        if not self.any_caching:
            req.pending = PendingHit(0, self.epoch(), [[] for _ in managers])
            req.fast_limit = req.slot_limit = -1
            return 0
        h = len(req.tokens) - 1
        hits: list[list[int]] = [[]] if len(managers) == 1 else [[] for _ in managers]
        answers = [-1] * len(managers)
        branch = -1  # what the token groups alone have cached: where requests diverge
        while True:  # fixed point: every group's longest valid hit of at most h equals h
            for m in managers:
                if answers[m.index] != h:
                    answers[m.index], hits[m.index] = m.find_hit(req, h)
            if branch < 0 and self.recurrent_managers:
                branch = min((answers[m.index] for m in self.token_managers), default=0)
            lowest = min(answers)
            if lowest == h:
                break
            h = lowest
        for m in self.recurrent_managers:
            m.plan_marks(req, h, branch)
        self.hits += h
        req.pending = PendingHit(h, self.epoch(), hits)
        req.fast_limit = req.slot_limit = -1
        return h

    def revalidate(self, req: RequestState) -> PendingHit | None:
        """The pending hit of ``req``, looked up again if a block of it may be gone."""
        pending = req.pending
        if pending is not None and pending.epoch != self.epoch():
            req.pending = None
            self.queries -= len(req.tokens)
            self.hits -= pending.tokens
            self.lookup(req)
            pending = req.pending
        return pending
