"""Requests and their sampling parameters (standard library only: the simulator uses them)."""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass, field

from pagedkv.errors import InvalidArgumentError

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 keep every token. ``seed``
    gives the request its own generator, so its tokens do not depend on the batch."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise InvalidArgumentError(f"max_new_tokens must be >= 0, got {self.max_new_tokens!r}")
        if not _real(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise InvalidArgumentError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be >= 0, got {self.top_k!r}")
        try:  # (operator.index: ints of any kind, numpy's too; no floats, no strings)
            stops = tuple(operator.index(t) for t in self.stop_token_ids)
        except TypeError:
            raise InvalidArgumentError(
                f"stop_token_ids must be token ids, got {self.stop_token_ids!r}") from None
        object.__setattr__(self, "stop_token_ids", stops)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(eq=False)
class Request:
    """One request's life in the scheduler. ``output`` holds the tokens sampled so far;
    ``hit_tokens`` the prompt tokens its first admission found cached."""

    rid: object
    prompt: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    output: list[int] = field(default_factory=list)
    status: str = WAITING
    finish_reason: str | None = None
    first_admit: bool = True
    hit_tokens: int = 0
    error: Exception | None = None

    @property
    def num_generated(self) -> int:
        return len(self.output)

    @property
    def remaining(self) -> int:
        return self.sampling.max_new_tokens - len(self.output)

    @property
    def finished(self) -> bool:
        return self.status == FINISHED
