"""Speculative decoding: a drafter proposes k tokens per decoding request, the target
verifies all k + 1 positions in one causal pass, and the longest acceptable prefix plus
one target token is kept.

One step (:meth:`SpeculativeEngine.step`):

1. the scheduler gives every decoding request ``num_lookahead`` extra slots
   (``EngineOptions.spec_tokens``);
2. the drafter proposes up to that many tokens per request (``Drafter.propose``);
3. the runner writes the drafts' KV into the lookahead slots and returns the target's
   logits for the request's last token and every draft (``ModelRunner.execute(drafts=)``);
4. acceptance: greedy requests keep the drafts that equal the target's argmax, in order,
   then the target's token at the first mismatch (or the bonus token after the last
   draft); sampled requests use rejection sampling (accept draft x with probability
   min(1, p(x) / q(x)), on rejection draw from norm(max(p - q, 0))), which leaves the
   output distributed exactly as the target's;
5. ``Scheduler.update`` commits the last token plus the accepted drafts; the block manager
   gives back every block only rejected drafts used. Rejected drafts' KV rows lie past the
   committed length, so they are never read (the next step overwrites them) and never
   hashed into the prefix cache. Recurrent targets restore the state slots they had
   before the pass and recompute the accepted tokens from it (:class:`StateRollback`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pagedkv.engine.engine import Engine, EngineOptions
from pagedkv.engine.request import Request, SamplingParams
from pagedkv.engine.scheduler import Chunk
from pagedkv.errors import InvalidArgumentError


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one request; ``probs`` [k, vocab] the drafter's distribution per
    draft (None: the drafts were chosen deterministically, q is one-hot)."""

    tokens: tuple[int, ...]
    probs: torch.Tensor | None = None


class Drafter(Protocol):
    """Proposes draft tokens; built for one target, checked before any step runs."""

    name: str

    def check(self, engine: Engine, k: int) -> None:
        """Raise before any step if this drafter cannot serve ``engine`` with k drafts."""
        ...

    def propose(self, engine: Engine, chunks: Sequence[Chunk],
                k: Mapping[object, int]) -> dict[object, Proposal]:
        """At most ``k[rid]`` drafts for each decoding request of the step."""
        ...

    def observe(self, engine: Engine, hidden: torch.Tensor | None) -> None:
        """The target's verify pass ran (``hidden``: its pre-norm hidden rows, if the
        model keeps them): drafters that condition on the target read them here."""
        ...


@dataclass
class SpecStats:
    """Counters over every verify pass of a run."""

    verify_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # accepted drafts + the target's own token, per pass summed

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens a verify pass yields on average: accepted drafts plus the target's token."""
        return self.emitted / self.verify_passes if self.verify_passes else 0.0


def accept_greedy(drafts: Sequence[int], logits: torch.Tensor) -> list[int]:
    """Longest prefix of ``drafts`` equal to the target's argmax, then the target's token.
    ``logits`` [len(drafts) + 1, vocab]: row j predicts the token after draft j - 1."""
    target = logits.argmax(-1).tolist()
    out: list[int] = []
    for j, d in enumerate(drafts):
        if d != target[j]:
            break
        out.append(int(d))
    out.append(int(target[len(out)]))
    return out


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution :func:`pagedkv.engine.sampler.sample` draws from, per row
    (temperature, then top-k, then top-p)."""
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        order = torch.argsort(scores, dim=-1, descending=True)
        sorted_probs = torch.softmax(scores.gather(-1, order), dim=-1)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, order, before >= params.top_p)
        scores = scores.masked_fill(drop, float("-inf"))
    return torch.softmax(scores, dim=-1)


def accept_sampled(proposal: Proposal, p: torch.Tensor,
                   generator: torch.Generator | None) -> list[int]:
    """Rejection sampling: drafts accepted with probability min(1, p/q); at the first
    rejection a token from norm(max(p - q, 0)); after k acceptances a bonus token from
    the last row of ``p`` [k + 1, vocab]."""
    out: list[int] = []
    for j, d in enumerate(proposal.tokens):
        q = _one_hot(d, p.shape[-1], p) if proposal.probs is None else proposal.probs[j].to(p)
        ratio = float(p[j, d]) / max(float(q[d]), 1e-30)
        u = float(torch.rand((), generator=generator, device=p.device))
        if u < min(1.0, ratio):
            out.append(int(d))
            continue
        residual = (p[j] - q).clamp_min(0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[j]
        out.append(int(torch.multinomial(dist, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[len(proposal.tokens)], 1, generator=generator)))
    return out


def _one_hot(token: int, vocab: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros(vocab, dtype=like.dtype, device=like.device)
    q[token] = 1.0
    return q


@dataclass
class ScriptedDrafter:
    """Proposes given tokens: ``script[rid]`` is the continuation it bets on (drafts for a
    request with n tokens generated are ``script[rid][n : n + k]``), so tests drive
    accept, partial accept and reject deterministically."""

    script: Mapping[object, Sequence[int]]
    name: str = "scripted"
    max_tokens: int | None = None

    def check(self, engine: Engine, k: int) -> None:
        if self.max_tokens is not None and k > self.max_tokens:
            raise InvalidArgumentError(
                f"--spec-tokens {k} exceeds what the scripted drafter proposes ({self.max_tokens})")

    def propose(self, engine: Engine, chunks: Sequence[Chunk],
                k: Mapping[object, int]) -> dict[object, Proposal]:
        out = {}
        for c in chunks:
            rid = c.request.rid
            if rid not in k or rid not in self.script:
                continue
            n = c.request.num_generated
            out[rid] = Proposal(tuple(int(t) for t in self.script[rid][n : n + k[rid]]))
        return out

    def observe(self, engine: Engine, hidden: torch.Tensor | None) -> None:
        return None


class SpeculativeEngine(Engine):
    """An :class:`Engine` whose decode steps draft, verify and accept (see module doc).

    ``EngineOptions.spec_tokens`` is k, the most drafts per request per step; the
    drafter is checked against the engine before any step runs."""

    def __init__(self, model: Any, options: EngineOptions, drafter: Drafter) -> None:
        if options.spec_tokens < 1:
            raise InvalidArgumentError(
                f"speculative decoding needs spec_tokens >= 1, got {options.spec_tokens}")
        super().__init__(model, options)
        self.drafter = drafter
        self.stats = SpecStats()
        drafter.check(self, options.spec_tokens)

    def step(self) -> list[Request]:
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return []
        ops = self.manager.drain_copy_ops()
        room = {c.request.rid: min(c.num_lookahead, c.request.remaining - 1)
                for c in plan.chunks if c.num_lookahead and c.samples}
        room = {rid: n for rid, n in room.items() if n > 0}
        proposals = self.drafter.propose(self, plan.chunks, room) if room else {}
        drafts = {rid: list(p.tokens) for rid, p in proposals.items() if p.tokens}
        out = self.runner.execute(plan.chunks, ops, all_rows=self.options.record_logits,
                                  drafts=drafts)
        self.drafter.observe(self, getattr(self.model, "last_hidden", None))
        sampled: dict[object, list[int]] = {}
        for chunk, rows in zip(plan.chunks, out.rows):
            req = chunk.request
            rid = req.rid
            k = len(drafts.get(rid, ()))
            verify = out.logits[list(rows)[len(rows) - k - 1:]]
            tokens: list[int] | None = None
            if chunk.samples and req.remaining > 0:
                gen = self._generators.get(rid, self._default_gen)
                if req.sampling.greedy:
                    tokens = accept_greedy(drafts.get(rid, []), verify)
                else:
                    p = target_probs(verify, req.sampling)
                    tokens = accept_sampled(proposals.get(rid, Proposal(())), p, gen)
                if k:
                    self.stats.verify_passes += 1
                    self.stats.drafted += k
                    self.stats.accepted += len(tokens) - 1
                    self.stats.emitted += len(tokens)
                sampled[rid] = tokens
            if self.options.record_logits:
                # rows past the first rejected draft saw a sequence that is not kept
                keep = len(rows) - k + (len(tokens) - 1 if tokens is not None and k else 0)
                kept = self.logits.setdefault(rid, [])
                kept += [(chunk.num_computed + j, out.logits[r])
                         for j, r in enumerate(list(rows)[:keep])]
        before = {c.request.rid: c.request.num_generated for c in plan.chunks}
        done = self.scheduler.update(plan, sampled)
        self.tokens_generated += sum(c.request.num_generated - before[c.request.rid]
                                     for c in plan.chunks)
        self.steps += 1
        for req in done:
            self._generators.pop(req.rid, None)
        return done
