"""Continuous batching, one discrete step at a time, through the real block manager.

Each step (as a scheduler would): running requests first, in arrival order — a decode
computes its last token (plus k drafts with speculative decoding), a prefill its next
chunk — and when a pool runs short the newest running request is preempted (recompute).
Then waiting requests are admitted in order while the step's token budget and
``max_running`` allow: cache lookup, then the first chunk. After the "forward" every
scheduled request commits; a request that computed all its tokens samples one (or its
accepted drafts and a bonus token). Acceptance is drawn per draft, stopping at the first
rejection, from a seeded generator: a run is reproducible.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.blocks import KVCacheManager, lookahead_tokens
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


class _Live:
    __slots__ = ("rid", "req", "generated", "first_admit", "rng")

    def __init__(self, rid: int, req: SimRequest, seed: int) -> None:
        self.rid = rid
        self.req = req
        self.generated = 0
        self.first_admit = True
        self.rng = random.Random(seed * 1_000_003 + rid)

    def sample(self, n: int) -> list[int]:
        given = self.req.output_tokens
        if given is not None and self.generated + n <= len(given):
            return list(given[self.generated:self.generated + n])
        return [self.rng.randrange(1 << 20) for _ in range(n)]


def simulate(manager: KVCacheManager, requests: Sequence[SimRequest],
             options: SimOptions = SimOptions()) -> SimResult:
    """Run ``requests`` to completion; the manager must be fresh (no live requests)."""
    lookahead = lookahead_tokens(manager.groups, options.spec_tokens) if options.spec_tokens else 0
    budget_cap = manager.max_batched_tokens
    if options.spec_tokens and 1 + lookahead > budget_cap:
        raise InvalidArgumentError(
            f"a speculative step needs {1 + lookahead} tokens, over the step budget {budget_cap}"
        )
    accept_rng = random.Random(options.seed)
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_step, i))
    arrivals = deque(order)
    waiting: deque[_Live] = deque()
    running: list[_Live] = []
    rejected: list[str] = []
    finished = generated = prompt_tokens = hit_tokens = 0
    timeline: list[tuple[int, ...]] = []
    step = 0
    mgr = manager
    while arrivals or waiting or running:
        if step >= options.max_steps:
            break
        while arrivals and requests[arrivals[0]].arrival_step <= step:
            i = arrivals.popleft()
            r = requests[i]
            try:
                mgr.add_request(i, r.prompt_tokens, max_new_tokens=r.output_len)
            except RequestTooLargeError as exc:
                rejected.append(f"request {i}: {exc}")
                continue
            waiting.append(_Live(i, r, options.seed))
        if not waiting and not running:
            step = max(step + 1, requests[arrivals[0]].arrival_step) if arrivals else step + 1
            continue
        budget = budget_cap
        scheduled: list[tuple[_Live, int, bool]] = []
        # 1) running requests, oldest first; preempt the newest when a pool is short
        idx = 0
        while idx < len(running) and budget > 0:
            live = running[idx]
            rid = live.rid
            todo = mgr.num_tokens(rid) - mgr.num_computed(rid)
            spec = todo == 1 and options.spec_tokens > 0 and budget >= 1 + lookahead
            n = 1 if spec else min(todo, budget)
            while not mgr.allocate(rid, n, lookahead if spec else 0):
                victim = running.pop()
                mgr.preempt(victim.rid)
                waiting.appendleft(victim)
                if victim is live:
                    break
            else:
                scheduled.append((live, n, spec))
                budget -= n + (lookahead if spec else 0)
                idx += 1
                continue
            break  # the request preempted itself: nothing older left to take from
        # 2) admit waiting requests in order
        while waiting and budget > 0 and len(running) < options.max_running:
            live = waiting[0]
            rid = live.rid
            hit = mgr.find_cached_prefix(rid)
            n = min(mgr.num_tokens(rid) - hit, budget)
            if not mgr.allocate(rid, n):
                break
            waiting.popleft()
            if live.first_admit:
                live.first_admit = False
                prompt_tokens += len(live.req.prompt_tokens)
                hit_tokens += min(hit, len(live.req.prompt_tokens))
            running.append(live)
            scheduled.append((live, n, False))
            budget -= n
        timeline.append(tuple(mgr.blocks_used()))
        mgr.drain_copy_ops()  # what an engine runs before the forward
        # 3) the forward is done: commit, sample, finish
        done = []
        for live, n, spec in scheduled:
            rid = live.rid
            remaining = live.req.output_len - live.generated
            if mgr.num_computed(rid) + n < mgr.num_tokens(rid) or remaining <= 0:
                mgr.commit(rid, n)  # a prefill chunk (or a recompute) that samples nothing
            elif spec:
                accepted = 0
                while accepted < options.spec_tokens and accept_rng.random() < options.acceptance:
                    accepted += 1
                take = min(accepted + 1, remaining)
                mgr.commit(rid, take, live.sample(take))
                live.generated += take
                generated += take
            else:
                mgr.commit(rid, n, live.sample(1))
                live.generated += 1
                generated += 1
            if live.generated >= live.req.output_len:
                done.append(live)
        for live in done:
            mgr.free(live.rid)
            running.remove(live)
            finished += 1
        step += 1
    groups = []
    for gi, m in enumerate(mgr.managers):
        series = [t[gi] for t in timeline] or [0]
        groups.append(GroupStats(m.gid, m.group.retention.kind, m.pool.usable, max(series),
                                 sum(series) / len(series)))
    for live in list(running) + list(waiting):  # cut short by max_steps
        mgr.free(live.rid)
    return SimResult(
        requests_total=len(requests), requests_finished=finished,
        requests_rejected=len(rejected), steps=step, generated_tokens=generated,
        prompt_tokens=prompt_tokens, hit_tokens=hit_tokens, preemptions=mgr.preemptions,
        leaked_blocks=sum(mgr.blocks_used()), groups=tuple(groups), timeline=tuple(timeline),
        rejected_reasons=tuple(rejected[:20]),
    )
