"""What the scheduler and the block manager hand the metadata builder for one invocation.

Counts are in tokens of the target's sequence. ``num_new_tokens`` is every query row this
invocation runs for the request (prompt chunk, the last sampled token, and any draft
tokens); the last ``num_draft_tokens`` of them are speculative. ``block_ids`` maps a
block-table group id to the request's block ids in logical order (block j holds positions
[j * block_size, (j + 1) * block_size)), lookahead blocks for draft tokens included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from pagedkv.errors import InvalidArgumentError


def _count(req_id: object, key: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgumentError(
            f"request {req_id!r}: {key} must be an integer >= 0, got {value!r}"
        )
    return value


@dataclass(frozen=True, eq=False)
class ScheduledRequest:
    """One request of one invocation (a row of the batch)."""

    req_id: str | int
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: Mapping[int, Sequence[int]] = field(default_factory=dict)
    num_draft_tokens: int = 0

    def __post_init__(self) -> None:
        _count(self.req_id, "num_computed_tokens", self.num_computed_tokens)
        _count(self.req_id, "num_new_tokens", self.num_new_tokens)
        _count(self.req_id, "num_draft_tokens", self.num_draft_tokens)
        if self.num_draft_tokens > self.num_new_tokens:
            raise InvalidArgumentError(
                f"request {self.req_id!r}: {self.num_draft_tokens} draft tokens but only "
                f"{self.num_new_tokens} new tokens (drafts are counted among the new tokens)"
            )
        # ids are range-checked by the builder, vectorised, not here per id
        tables = {gid: tuple(ids) for gid, ids in self.block_ids.items()}
        object.__setattr__(self, "block_ids", MappingProxyType(tables))

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence once this invocation ran (computed + new)."""
        return self.num_computed_tokens + self.num_new_tokens

    def blocks(self, group_id: int) -> tuple[int, ...]:
        """Block ids of one group; a request without an entry has none allocated."""
        return self.block_ids.get(group_id, ())  # type: ignore[return-value]
