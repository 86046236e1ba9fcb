"""A simulated request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SimRequest:
    """``output_tokens`` (optional) are the tokens the "model" samples, so that workloads
    whose later prompts repeat earlier answers (chat turns) can hit the cache; without
    them the simulator samples pseudo-random tokens."""

    prompt_tokens: tuple[int, ...]
    output_len: int
    arrival_step: int = 0
    output_tokens: tuple[int, ...] | None = None
