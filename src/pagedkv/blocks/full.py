"""Full attention: every block stays; a hit is the longest run of cached leading blocks."""

from __future__ import annotations

from pagedkv.blocks.base import GroupManager
from pagedkv.blocks.request import RequestState
from pagedkv.kvspec.retention import cdiv


class FullManager(GroupManager):
    def find_hit(self, req: RequestState, max_tokens: int) -> tuple[int, list[int]]:
        if not self.caching:
            return 0, []
        get = self.cache.get
        blocks: list[int] = []
        for h in req.hashes[self.bs][:self.hit_block_limit(req, max_tokens)]:
            b = get(h)
            if b is None:
                break
            blocks.append(b)
        bs = self.bs
        tokens = min(max_tokens, len(blocks) * bs - self.offset)
        if tokens > 0 and tokens % bs and not self.partial_ok(blocks[tokens // bs]):
            tokens -= tokens % bs  # that block is written by this step: not copied yet
        if tokens <= 0:
            return 0, []
        n = cdiv(tokens, bs)
        return tokens, blocks if n == len(blocks) else blocks[:n]
