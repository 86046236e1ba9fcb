"""Cross-attention (encoder) KV: a fixed number of blocks per request, never cached
(its contents depend on the encoder input, not on the decoder's tokens)."""

from __future__ import annotations

from pagedkv.blocks.base import GroupManager
from pagedkv.blocks.request import INF, RequestState
from pagedkv.kvspec.retention import cdiv


class CrossManager(GroupManager):
    holds_tokens = False
    can_cache = False

    @property
    def fixed_blocks(self) -> int:
        return cdiv(self.group.retention.max_encoder_len, self.bs)  # type: ignore[union-attr]

    def find_hit(self, req: RequestState, max_tokens: int) -> tuple[int, list[int]]:
        return max_tokens, []  # never limits the common hit

    def blocks_needed(self, req: RequestState, end: int, hit: list[int] | None) -> int:
        return 0 if req.tables[self.index] else self.fixed_blocks

    def adopt(self, req: RequestState, hit: list[int] | None) -> None:
        """Nothing to adopt ahead: :meth:`allocate` handles the hit itself."""

    def allocate(self, req: RequestState, end: int, hit: list[int] | None) -> None:
        if not req.tables[self.index]:
            self.changed.append(req)
            req.tables[self.index] = self.pool.allocate(self.fixed_blocks, self.gid)

    def commit(self, req: RequestState) -> int:
        return INF

    def trim(self, req: RequestState) -> None:
        """Encoder blocks are fixed for the life of the request."""

    def admission_blocks(self, num_tokens: int, max_batched_tokens: int) -> int:
        return self.fixed_blocks
