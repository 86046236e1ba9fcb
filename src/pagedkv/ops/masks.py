"""Which keys a query row sees: the mask of one attention invocation.

The mask is an argument of each call, never a property of the cache: a target's causal
layers and a drafter's non-causal layers read the same block table with different masks.

Positions are absolute token positions of one sequence. A sequence of ``seq_len`` tokens
whose step brings ``q_len`` query rows has those rows at positions seq_len - q_len ..
seq_len - 1 (bottom-right alignment). When q_len > seq_len (layers with a position offset,
whose first rows stand for tokens that have no position of their own), the leading rows
have negative positions and see no key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.errors import InvalidArgumentError
from pagedkv.kvspec import Attention


@dataclass(frozen=True)
class Mask:
    """Mask of one invocation.

    ``causal``: a row at position p sees keys <= p. Non-causal rows come in draft blocks
    of ``draft_block`` rows, tiled from the first query row of each sequence: a block sees
    every key before its anchor (its first position) and every position of the block
    itself. Non-causal without ``draft_block``: the whole query span is one block.
    ``window`` W: additionally keys > p - W. ``chunk`` C: additionally keys in p's aligned
    chunk [C*(p//C), C*(p//C) + C).
    """

    causal: bool = True
    draft_block: int | None = None
    window: int | None = None
    chunk: int | None = None

    def __post_init__(self) -> None:
        for key in ("draft_block", "window", "chunk"):
            value = getattr(self, key)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0
            ):
                raise InvalidArgumentError(f"Mask: {key} must be a positive integer, got {value!r}")
        if self.causal and self.draft_block is not None:
            raise InvalidArgumentError(
                f"Mask: draft blocks ({self.draft_block}) are non-causal; pass causal=False"
            )
        if self.window is not None and self.chunk is not None:
            raise InvalidArgumentError(
                f"Mask: window {self.window} and chunk {self.chunk} are exclusive"
            )

    @classmethod
    def of(cls, attention: Attention, causal: bool | None = None) -> Mask:
        """The mask a layer's Attention asks for; ``causal`` overrides it for this call."""
        is_causal = attention.causal if causal is None else causal
        return cls(
            causal=is_causal,
            draft_block=None if is_causal else attention.draft_block,
            window=attention.window,
            chunk=attention.chunk,
        )


CAUSAL = Mask()


def visible_keys(mask: Mask, seq_len: int, q_len: int, device: torch.device | str) -> torch.Tensor:
    """Bool [q_len, seq_len]: entry (i, k) is True when query row i may read key position k."""
    if q_len < 0 or seq_len < 0:
        raise InvalidArgumentError(f"need q_len, seq_len >= 0, got {q_len}, {seq_len}")
    first = seq_len - q_len  # < 0 when leading rows have no position (see module doc)
    row = torch.arange(q_len, device=device)
    pos = (first + row)[:, None]  # query positions
    key = torch.arange(seq_len, device=device)[None, :]
    if mask.causal:
        end = pos + 1
    elif mask.draft_block is None:
        end = torch.full_like(pos, seq_len)
    else:
        if q_len % mask.draft_block:
            raise InvalidArgumentError(
                f"non-causal draft blocks of {mask.draft_block} need a query length that is a "
                f"multiple of it, got {q_len}"
            )
        anchor = first + (row // mask.draft_block) * mask.draft_block
        end = (anchor + mask.draft_block)[:, None]
    seen = (key < end) & (pos >= 0)
    if mask.window is not None:
        seen &= key > pos - mask.window
    if mask.chunk is not None:
        seen &= key // mask.chunk == pos // mask.chunk
    return seen
