"""Synthetic workloads, each a list of :class:`SimRequest` (deterministic per seed).

- ``chat``: conversations; every turn's prompt is the whole conversation so far (earlier
  prompts and answers) plus a new user message, arriving after the previous answer.
- ``shared-prefix``: one system prompt shared by every request, a private suffix each.
- ``agentic``: a few long sessions whose context grows by tool output every turn.
- ``long-context``: long, unrelated prompts with short answers (capacity, preemption).
Lengths shrink to fit ``max_model_len``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.types import SimRequest

VOCAB = 32000


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB) for _ in range(n))


def _fit(n: int, cap: int) -> int:
    return max(1, min(n, cap))


def _sessions(n: int, rng: random.Random, max_len: int, first: tuple[int, int],
              turn: tuple[int, int], out: tuple[int, int], turns: int, gap: int,
              system: tuple[int, ...] = ()) -> list[SimRequest]:
    """``n`` requests in sessions of ``turns`` turns whose prompts accumulate. A session
    ends at the turn that would pass ``max_len``; its first turn shrinks to fit instead
    (else a ``max_len`` shorter than every first turn made no request, ever: an endless
    loop), leaving room for at least ``out[0]`` answer tokens or half of what the system
    prompt leaves."""
    reqs: list[SimRequest] = []
    session = 0
    room = max_len - len(system)  # (>= 1: the system prompt is at most max_len // 8)
    least = max(1, min(out[0], room // 2))  # answer tokens the first turn keeps room for
    while len(reqs) < n:
        context = system + _tokens(rng, _fit(rng.randint(*first), room - least))
        step = session * gap // 4
        for i in range(turns):
            if len(reqs) >= n:
                break
            answer_len = rng.randint(*out)
            if i == 0:
                answer_len = min(answer_len, max_len - len(context))
            elif len(context) + answer_len > max_len:
                break
            answer = _tokens(rng, answer_len)
            reqs.append(SimRequest(context, answer_len, step, answer))
            context = context + answer + _tokens(rng, rng.randint(*turn))
            step += answer_len + gap
        session += 1
    return sorted(reqs, key=lambda r: r.arrival_step)


def chat(n: int, rng: random.Random, max_len: int) -> list[SimRequest]:
    system = _tokens(rng, _fit(200, max_len // 8))
    return _sessions(n, rng, max_len, (20, 200), (10, 120), (20, 200), turns=4, gap=8,
                     system=system)


def shared_prefix(n: int, rng: random.Random, max_len: int) -> list[SimRequest]:
    prefix_len = _fit(1024, max_len // 2)
    suffix_len = _fit(256, max_len // 4)
    out_len = _fit(128, max_len - prefix_len - suffix_len)
    system = _tokens(rng, prefix_len)
    return [SimRequest(system + _tokens(rng, suffix_len), out_len, i // 8)
            for i in range(n)]


def agentic(n: int, rng: random.Random, max_len: int) -> list[SimRequest]:
    system = _tokens(rng, _fit(2000, max_len // 8))
    return _sessions(n, rng, max_len, (200, 800), (300, 1500), (50, 300), turns=12, gap=2,
                     system=system)


def long_context(n: int, rng: random.Random, max_len: int) -> list[SimRequest]:
    reqs = []
    for i in range(n):
        out_len = _fit(rng.randint(32, 256), max_len // 8)
        prompt_len = _fit(rng.randint(max_len // 4, max_len * 3 // 4), max_len - out_len)
        reqs.append(SimRequest(_tokens(rng, prompt_len), out_len, i * 4))
    return reqs


WORKLOADS: dict[str, Callable[[int, random.Random, int], list[SimRequest]]] = {
    "chat": chat,
    "shared-prefix": shared_prefix,
    "agentic": agentic,
    "long-context": long_context,
}


def make_workload(name: str, num_requests: int, seed: int = 0,
                  max_model_len: int = 8192) -> list[SimRequest]:
    if name not in WORKLOADS:
        raise InvalidArgumentError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}")
    if num_requests <= 0:
        raise InvalidArgumentError(f"--requests must be > 0, got {num_requests}")
    if max_model_len < 16:
        raise InvalidArgumentError(f"max_model_len {max_model_len} is too short to simulate")
    return WORKLOADS[name](num_requests, random.Random(seed), max_model_len)
