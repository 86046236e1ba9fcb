"""Full attention: every block stays; a hit is the longest run of cached leading blocks."""

from __future__ import annotations

from pagedkv.blocks.base import GroupManager
from pagedkv.blocks.request import RequestState
from pagedkv.kvspec.retention import cdiv


class FullManager(GroupManager):
    def find_hit(self, req: RequestState, max_tokens: int) -> tuple[int, list[int]]:
        if not self.caching:
            return 0, []
        # every candidate looked up in C; the run ends at the first miss
        blocks = list(map(self.cache.get, req.hashes[self.bs][:self.hit_block_limit(req, max_tokens)]))
        if None in blocks:
            del blocks[blocks.index(None):]
        tokens = min(max_tokens, len(blocks) * self.bs - self.offset)
        if tokens <= 0:
            return 0, []
        return tokens, blocks[:cdiv(tokens, self.bs)]
