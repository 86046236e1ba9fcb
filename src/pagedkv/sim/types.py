"""A simulated request."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import InvalidArgumentError


@dataclass(frozen=True)
class SimRequest:
    """``output_tokens`` (optional) are the tokens the "model" samples, so that workloads
    whose later prompts repeat earlier answers (chat turns) can hit the cache; without
    them the simulator samples pseudo-random tokens. ``accepted_drafts`` (optional) are
    the drafts accepted at each of its speculative decode steps, in order (e.g. what an
    engine run accepted, to replay its trace); past its end the seeded draw decides."""

    prompt_tokens: tuple[int, ...]
    output_len: int
    arrival_step: int = 0
    output_tokens: tuple[int, ...] | None = None
    accepted_drafts: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.accepted_drafts is not None and any(n < 0 for n in self.accepted_drafts):
            raise InvalidArgumentError(
                f"accepted_drafts must be >= 0, got {list(self.accepted_drafts)}")
