"""Continuous batching, one discrete step at a time, through the real block manager and
the engine's own scheduler (:class:`pagedkv.engine.Scheduler`), with a "model" that does
no arithmetic: the simulator and the engine cannot disagree on scheduling.

A request that computed all its tokens samples one (its given output token, or a seeded
pseudo-random one), or with speculative decoding its accepted drafts and a bonus token.
Acceptance is the request's own ``accepted_drafts`` while they last (a replayed engine
run), else drawn per draft, stopping at the first rejection, from a seeded generator:
a run is reproducible.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.blocks import KVCacheManager
from pagedkv.engine import Request, SamplingParams, Scheduler
from pagedkv.errors import InvalidArgumentError, RequestTooLargeError
from pagedkv.sim.types import SimRequest


@dataclass(frozen=True)
class SimOptions:
    max_running: int = 256
    spec_tokens: int = 0
    acceptance: float = 0.0
    seed: int = 0
    max_steps: int = 10_000_000

    def __post_init__(self) -> None:
        if self.max_running <= 0:
            raise InvalidArgumentError(f"max_running must be > 0, got {self.max_running}")
        if self.spec_tokens < 0:
            raise InvalidArgumentError(f"spec_tokens must be >= 0, got {self.spec_tokens}")
        if not 0.0 <= self.acceptance <= 1.0:
            raise InvalidArgumentError(f"acceptance must be in [0, 1], got {self.acceptance}")


@dataclass(frozen=True)
class GroupStats:
    group_id: int
    retention: str
    num_blocks: int  # usable blocks of its pool
    peak_blocks: int
    mean_blocks: float


@dataclass(frozen=True)
class SimResult:
    requests_total: int
    requests_finished: int
    requests_rejected: int
    steps: int
    generated_tokens: int
    prompt_tokens: int
    hit_tokens: int
    preemptions: int
    leaked_blocks: int
    groups: tuple[GroupStats, ...]
    timeline: tuple[tuple[int, ...], ...]  # blocks used per group after each step's allocation
    rejected_reasons: tuple[str, ...] = ()

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the cache at first admission / prompt tokens."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.generated_tokens / self.steps if self.steps else 0.0

    def to_json(self) -> dict:
        return {
            "requests_total": self.requests_total,
            "requests_finished": self.requests_finished,
            "requests_rejected": self.requests_rejected,
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "generated_tokens_per_step": round(self.tokens_per_step, 4),
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "prefix_hit_rate": round(self.prefix_hit_rate, 6),
            "preemptions": self.preemptions,
            "leaked_blocks": self.leaked_blocks,
            "groups": [
                {"id": g.group_id, "retention": g.retention, "num_blocks": g.num_blocks,
                 "peak_blocks": g.peak_blocks, "mean_blocks": round(g.mean_blocks, 3)}
                for g in self.groups
            ],
            "rejected": list(self.rejected_reasons),
        }


class _Sampler:
    """The "model" of one request: its given output tokens, else seeded pseudo-random ones."""

    __slots__ = ("given", "rng", "accepted", "passes")

    def __init__(self, rid: int, req: SimRequest, seed: int) -> None:
        self.given = req.output_tokens
        self.rng = random.Random(seed * 1_000_003 + rid)
        self.accepted = req.accepted_drafts or ()
        self.passes = 0  # speculative decode steps so far

    def scripted_acceptance(self) -> int | None:
        """This decode step's accepted drafts from ``accepted_drafts``; None past its end."""
        i = self.passes
        self.passes += 1
        return self.accepted[i] if i < len(self.accepted) else None

    def sample(self, generated: int, n: int) -> list[int]:
        given = self.given
        if given is not None and generated + n <= len(given):
            return list(given[generated:generated + n])
        return [self.rng.randrange(1 << 20) for _ in range(n)]


def simulate(manager: KVCacheManager, requests: Sequence[SimRequest],
             options: SimOptions = SimOptions()) -> SimResult:
    """Run ``requests`` to completion through the engine's own :class:`Scheduler` with a
    runner that does no arithmetic; the manager must be fresh (no live requests)."""
    sched = Scheduler(manager, max_running=options.max_running, spec_tokens=options.spec_tokens)
    accept_rng = random.Random(options.seed)
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_step, i))
    arrivals = deque(order)
    samplers: dict[int, _Sampler] = {}
    rejected: list[str] = []
    finished = generated = 0
    timeline: list[tuple[int, ...]] = []
    step = 0
    mgr = manager
    while arrivals or sched.has_work():
        if step >= options.max_steps:
            break
        while arrivals and requests[arrivals[0]].arrival_step <= step:
            i = arrivals.popleft()
            r = requests[i]
            try:
                sched.add(Request(i, tuple(r.prompt_tokens), SamplingParams(max_new_tokens=r.output_len)))
            except RequestTooLargeError as exc:
                rejected.append(f"request {i}: {exc}")
                continue
            samplers[i] = _Sampler(i, r, options.seed)
        if not sched.has_work():
            step = max(step + 1, requests[arrivals[0]].arrival_step) if arrivals else step + 1
            continue
        plan = sched.schedule()
        timeline.append(tuple(mgr.blocks_used()))
        mgr.drain_copy_ops()  # what an engine runs before the forward
        # the "forward": each sampling request gets its next token (or accepted drafts + 1)
        sampled: dict[object, list[int]] = {}
        for chunk in plan.chunks:
            req = chunk.request
            if not chunk.samples or req.remaining <= 0:
                continue
            take = 1
            if chunk.num_lookahead:
                accepted = samplers[req.rid].scripted_acceptance()
                if accepted is None:
                    accepted = 0
                    while accepted < options.spec_tokens and accept_rng.random() < options.acceptance:
                        accepted += 1
                accepted = min(accepted, options.spec_tokens)
                take = min(accepted + 1, req.remaining)
            sampled[req.rid] = samplers[req.rid].sample(req.num_generated, take)
            generated += take
        finished += len(sched.update(plan, sampled))
        step += 1
    groups = []
    for gi, m in enumerate(mgr.managers):
        series = [t[gi] for t in timeline] or [0]
        groups.append(GroupStats(m.gid, m.group.retention.kind, m.pool.usable, max(series),
                                 sum(series) / len(series)))
    for req in list(sched.running) + list(sched.waiting):  # cut short by max_steps
        mgr.free(req.rid)
    return SimResult(
        requests_total=len(requests), requests_finished=finished,
        requests_rejected=len(rejected), steps=step, generated_tokens=generated,
        prompt_tokens=sched.prompt_tokens, hit_tokens=sched.hit_tokens,
        preemptions=mgr.preemptions, leaked_blocks=sum(mgr.blocks_used()),
        groups=tuple(groups), timeline=tuple(timeline), rejected_reasons=tuple(rejected[:20]),
    )
