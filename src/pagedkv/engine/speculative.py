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
   hashed into the prefix cache. Before the commit a drafter with a ``flush`` method
   writes its own KV at the positions the step finished, so blocks the commit caches hold
   the drafter's KV too (prefix hits need no target hidden states). Recurrent targets restore the state slots they had
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
from pagedkv.kvspec import LayerSpec


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

    def layer_specs(self, config: Any) -> tuple[LayerSpec, ...]:
        """The drafter's cache-holding layers, planned together with the target's."""
        ...

    def observe(self, engine: Engine, rid: object, start: int, rows: slice) -> None:
        """The target computed positions ``start ..`` of request ``rid`` for good: rows
        ``rows`` of its last forward (kept rows only). Drafters conditioned on the target
        read its hidden states there (``model.last_hidden`` / ``model.captured``)."""
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

    def layer_specs(self, config: Any) -> tuple[LayerSpec, ...]:
        return ()

    def observe(self, engine: Engine, rid: object, start: int, rows: slice) -> None:
        return None


class StateRollback:
    """Recurrent targets: a verify pass advances each state slot over every draft, the
    rejected ones too. Before the pass the drafting requests' slots are copied; after
    acceptance a request that rejected a draft gets its copy back and its accepted rows
    (last token + accepted drafts) are recomputed from it. (Attention KV at those
    positions is rewritten with the values it already holds.)"""

    def __init__(self, engine: Engine) -> None:
        runner = engine.runner
        self.engine = engine
        self.groups = [(engine.runner.gids.index(g.id), [
            t for name in g.layer_names for t in runner.caches.get(name, {}).values()])
            for g in runner.recurrent_groups]
        self.saved: dict[object, list[list[torch.Tensor]]] = {}

    @property
    def needed(self) -> bool:
        return bool(self.groups)

    def _slots(self, rid: object) -> list[int]:
        tables = self.engine.manager.block_tables(rid)
        return [tables[i][0] for i, _ in self.groups]

    def reachable(self, ops: Sequence[Any], chunks: Sequence[Chunk],
                  drafts: Mapping[object, Sequence[int]]) -> list[Any]:
        """Drop checkpoint saves the step cannot reach: the scheduler reserved them for
        every lookahead slot, a request drafted fewer (the block manager drops a save
        past the committed tokens at commit)."""
        end: dict[tuple[int, int], int] = {}
        for c in chunks:
            stop = c.num_computed + c.num_new_tokens + len(drafts.get(c.request.rid, ()))
            for gi, _ in self.groups:
                gid = self.engine.runner.gids[gi]
                end[(gid, self.engine.manager.block_tables(c.request.rid)[gi][0])] = stop
        return [op for op in ops if op.kind != "save"
                or op.position <= end.get((op.group_id, op.src), op.position)]

    def save(self, rids: Sequence[object]) -> None:
        self.saved = {rid: [[t[slot].clone() for t in tensors] for (_, tensors), slot
                            in zip(self.groups, self._slots(rid))] for rid in rids}

    def restore_and_recompute(self, redo: Mapping[object, tuple[Chunk, int]]) -> None:
        """``redo[rid]`` = (the verify chunk, rows to recompute) for requests that
        rejected a draft; done after the scheduler committed them."""
        if not redo:
            return
        for rid in redo:
            for (_, tensors), slot, copies in zip(self.groups, self._slots(rid), self.saved[rid]):
                for t, c in zip(tensors, copies):
                    t[slot].copy_(c)
        chunks = [Chunk(c.request, c.num_computed, n, False) for c, n in redo.values()]
        self.engine.runner.execute(chunks, ())
        self.saved = {}


class SpeculativeEngine(Engine):
    """An :class:`Engine` whose decode steps draft, verify and accept (see module doc).

    ``EngineOptions.spec_tokens`` is k, the most drafts per request per step; the
    drafter is checked against the engine before any step runs."""

    def __init__(self, model: Any, options: EngineOptions, drafter: Drafter, *,
                 tokenizer: Any = None) -> None:
        if options.spec_tokens < 1:
            raise InvalidArgumentError(
                f"speculative decoding needs spec_tokens >= 1, got {options.spec_tokens}")
        self.drafter = drafter
        super().__init__(model, options, tokenizer=tokenizer)
        self.stats = SpecStats()
        self.rollback = StateRollback(self)
        self.runner.recurrent_drafts_rolled_back = self.rollback.needed
        drafter.check(self, options.spec_tokens)

    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """The target's layers and the drafter's, planned together (shared block tables)."""
        return tuple(super().layer_specs()) + tuple(self.drafter.layer_specs(self.config))

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
        if self.rollback.needed:
            self.rollback.save(list(drafts))
            ops = self.rollback.reachable(ops, plan.chunks, drafts)
        redo: dict[object, tuple[Chunk, int]] = {}
        out = self.runner.execute(plan.chunks, ops, all_rows=self.options.record_logits,
                                  drafts=drafts)
        row0 = 0
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
                if k and len(tokens) - 1 < k and self.rollback.needed:
                    redo[rid] = (chunk, min(len(tokens), req.remaining))
            # rows past the first rejected draft saw a sequence that is not kept
            keep = chunk.num_new_tokens + (len(tokens) - 1 if tokens is not None and k else 0)
            self.drafter.observe(self, rid, chunk.num_computed, slice(row0, row0 + keep))
            row0 += chunk.num_new_tokens + k
            if self.options.record_logits:
                kept = self.logits.setdefault(rid, [])
                kept += [(chunk.num_computed + j, out.logits[r])
                         for j, r in enumerate(list(rows)[:keep])]
        flush = getattr(self.drafter, "flush", None)
        if flush is not None:  # drafter KV of finished positions, before they are cached
            flush(self, plan.chunks, sampled)
        before = {c.request.rid: c.request.num_generated for c in plan.chunks}
        done = self.scheduler.update(plan, sampled)
        self.rollback.restore_and_recompute(
            {rid: r for rid, r in redo.items() if self.requests[rid] not in done})
        self.tokens_generated += sum(c.request.num_generated - before[c.request.rid]
                                     for c in plan.chunks)
        self.steps += 1
        for req in done:
            self._generators.pop(req.rid, None)
        self.runner.release(req.rid for req in done)
        return done


@dataclass
class _Pending:
    """Target hidden rows whose MTP KV is not computed yet: positions start, start+1..."""

    start: int
    rows: list[torch.Tensor]


def _keep_rows(pending: dict[object, _Pending], rid: object, start: int,
               rows: torch.Tensor) -> None:
    """Append target rows of positions ``start ..`` to ``rid``'s catch-up rows. A request
    computed again from an earlier position (preempted, or the first time) restarts, and
    so does one resumed past its rows: preempted, it came back with a prefix hit longer
    than what it had computed (another request cached more of the shared prefix), and a
    hit covers every group, the drafter's KV up to ``start`` included."""
    pend = pending.get(rid)
    if pend is None or start < pend.start or start > pend.start + len(pend.rows):
        pend = pending[rid] = _Pending(start, [])
    pend.rows = pend.rows[: start - pend.start] + list(rows.detach())


class MTPDrafter:
    """DeepSeek MTP (depth 0, chained for k > 1) over the target's MLA block table.

    Its layer ``draft.layers.0.self_attn`` is planned with the target's (same latent
    layout, position_offset 1). At the end of each step (``flush``) it catches up: for
    every position p the target finished it computes its KV at p from (token p + 1,
    target hidden at p); the last such row drafts the next step's first token, and k - 1
    one-row passes chain on the block's own output. Chained rows' KV lies in lookahead
    slots and is overwritten by the next catch-up."""

    name = "mtp"

    def __init__(self, module: Any) -> None:
        self.module = module
        self.pending: dict[object, _Pending] = {}
        self.last: dict[object, tuple[int, torch.Tensor]] = {}  # rid -> (position, output row)
        self.first_logits: list[tuple[object, int, torch.Tensor]] = []  # (rid, position, row)

    def layer_specs(self, config: Any) -> tuple[LayerSpec, ...]:
        from pagedkv.models.drafters import mtp_layers

        raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        return mtp_layers(raw)[:1]

    def check(self, engine: Engine, k: int) -> None:
        from pagedkv.errors import IncompatibleLayersError

        name = "draft.layers.0.self_attn"
        mine = engine.runner.specs.get(name)
        target = [s for s in engine.specs if s.model != "draft" and s.attention is not None]
        if mine is None or not target or mine.layout != target[0].layout:
            raise IncompatibleLayersError(
                f"{self.name} drafter layer layout {getattr(mine, 'layout', None)} does not "
                f"match the target's {target[0].layout if target else None}")
        self.module.to(device=engine.device, dtype=engine.dtype)

    def observe(self, engine: Engine, rid: object, start: int, rows: slice) -> None:
        _keep_rows(self.pending, rid, start, engine.model.last_hidden[rows])

    @torch.inference_mode()
    def flush(self, engine: Engine, chunks: Sequence[Chunk],
              sampled: Mapping[object, Sequence[int]]) -> None:
        """End of a step, before the scheduler commits (blocks still held): compute the
        drafter's KV at every position the target just finished whose next token is known
        (the step's sampled tokens included). The block manager caches the drafter's
        blocks together with the target's, so they must hold final KV when committed: a
        request that finishes or is preempted later gets no further catch-up."""
        known = {c.request.rid: list(engine.manager.requests[c.request.rid].tokens)
                 + list(sampled.get(c.request.rid, ())) for c in chunks}
        self._catch_up(engine, [(rid, self.pending[rid], toks) for rid, toks in known.items()
                                if rid in self.pending and self.pending[rid].rows])

    def _catch_up(self, engine: Engine, items) -> None:
        """KV at pending positions p from (token p + 1, target row p), for the rows whose
        token p + 1 is known; keeps the drafter's output at the last such row to draft from."""
        rows = []
        for rid, pend, toks in items:
            n = min(len(pend.rows), len(toks) - pend.start - 1)
            if n > 0:
                rows.append((rid, pend.start, toks[pend.start + 1 : pend.start + n + 1],
                             torch.stack(pend.rows[:n])))
        if not rows:
            return
        hidden = self._run(engine, rows)
        end = 0
        for rid, first, ids, _ in rows:
            end += len(ids)
            self.last[rid] = (first + len(ids) - 1, hidden[end - 1])
            pend = self.pending[rid]
            self.pending[rid] = _Pending(first + len(ids), pend.rows[len(ids):])

    @torch.inference_mode()
    def propose(self, engine: Engine, chunks: Sequence[Chunk],
                k: Mapping[object, int]) -> dict[object, Proposal]:
        todo = [c for c in chunks if c.request.rid in k and c.request.rid in self.pending]
        if not todo:
            return {}
        for c in todo:
            pend = self.pending[c.request.rid]
            if pend.start + len(pend.rows) != c.num_computed:
                raise InvalidArgumentError(
                    f"request {c.request.rid!r}: MTP rows end at "
                    f"{pend.start + len(pend.rows)}, the step starts at {c.num_computed}")
        self._catch_up(engine, [(c.request.rid, self.pending[c.request.rid],
                                 engine.manager.requests[c.request.rid].tokens) for c in todo])
        todo = [c for c in todo if c.request.rid in self.last
                and self.last[c.request.rid][0] == c.num_computed - 1]
        if not todo:
            return {}
        rows = [(c.request.rid, self.last[c.request.rid][0]) for c in todo]
        drafts: dict[object, list[int]] = {rid: [] for rid, _ in rows}
        last = torch.stack([self.last[rid][1] for rid, _ in rows])
        for step in range(max(k[rid] for rid in drafts)):
            logits = self.module.compute_logits(last).float()
            if step == 0:
                self.first_logits += [(rid, pos, logits[i]) for i, (rid, pos) in enumerate(rows)]
            nxt = logits.argmax(-1).tolist()
            for (rid, _), tok in zip(rows, nxt):
                if len(drafts[rid]) < k[rid]:
                    drafts[rid].append(int(tok))
            live = [(i, r) for i, r in enumerate(rows) if len(drafts[r[0]]) < k[r[0]]]
            if not live:
                break
            chain = [(rid, pos + 1 + step, [drafts[rid][-1]], last[i : i + 1])
                     for i, (rid, pos) in live]
            out = self._run(engine, chain)
            last = last.clone()
            for j, (i, _) in enumerate(live):
                last[i] = out[j]
        return {rid: Proposal(tuple(d)) for rid, d in drafts.items()}

    def _run(self, engine: Engine, rows) -> torch.Tensor:
        """One MTP forward: rows (rid, first position, token ids, hidden [n, h])."""
        from pagedkv.batch import ScheduledRequest, build_metadata
        from pagedkv.modeling.base import ForwardContext

        runner = engine.runner
        name = "draft.layers.0.self_attn"
        gid = runner.layer_group[name]
        group = next(g for g in runner.attn_groups if g.id == gid)
        reqs, ids, pos, hid = [], [], [], []
        for rid, first, toks, h in rows:
            tables = engine.manager.block_tables(rid)
            blocks = {runner.gids[i]: list(t) for i, t in enumerate(tables)}
            # the layer's position_offset (1): token p + 1's row writes KV position p
            reqs.append(ScheduledRequest(rid, first + 1, len(toks), blocks))
            ids += list(toks)
            pos += range(first, first + len(toks))
            hid.append(h)
        meta = build_metadata(reqs, [group], device=engine.device)
        ctx = ForwardContext(runner.layer_group, runner.specs, meta, runner.caches,
                             backend=runner.backend)
        with torch.inference_mode():
            return self.module(torch.tensor(ids, dtype=torch.long, device=engine.device),
                               torch.cat(hid), torch.tensor(pos, dtype=torch.long,
                                                            device=engine.device), ctx)


DRAFTERS = ("mtp", "dspark", "eagle3", "scripted")


def make_drafter(name: str, config: Any, *, script: Mapping[object, Sequence[int]] | None = None,
                 weights: Any = None, seed: int = 0, dspark_block: int = 4) -> Drafter:
    """The drafter ``--draft NAME`` asks for, for a target of ``config``.

    ``scripted``: proposes ``script[rid]`` (e.g. the plain greedy run's own tokens).
    ``mtp``: the target's MTP depth; ``weights`` (an iterable of checkpoint (name, tensor))
    fills it, else random weights from ``seed`` (tiny random targets have none).
    ``dspark``: a random two-layer DSpark drafter with the target's MLA geometry, blocks of
    ``dspark_block`` (no DSpark checkpoint format is read yet).
    Raises before any step: an unknown name, a target without MTP layers, a drafter
    pagedkv does not implement yet."""
    from pagedkv.errors import UnsupportedCapabilityError

    if name not in DRAFTERS:
        raise InvalidArgumentError(f"--draft must be one of {', '.join(DRAFTERS)}, got {name!r}")
    if name == "scripted":
        return ScriptedDrafter({} if script is None else script)
    if name == "mtp":
        from pagedkv.modeling.drafters.mtp import DeepseekMTP

        torch.manual_seed(seed)
        module = DeepseekMTP(config)  # ConfigError without num_nextn_predict_layers
        if weights is not None:
            module.load_weights(weights)
        else:
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 0.1)
        return MTPDrafter(module.eval())
    if name == "eagle3":
        from pagedkv.modeling.drafters.eagle3 import Eagle3Model, default_layers

        if getattr(config, "kv_lora_rank", None) is not None:
            raise UnsupportedCapabilityError("--draft eagle3 drafts for GQA targets (Llama "
                                             "family); use mtp or dspark for MLA targets")
        missing = [k for k in ("rope_parameters", "rms_norm_eps", "num_key_value_heads",
                               "intermediate_size") if getattr(config, k, None) is None]
        if missing:  # its layer takes these from the target (Nemotron-H: no RoPE, no RMS eps)
            raise UnsupportedCapabilityError(
                f"--draft eagle3 builds its layer from a Llama-like target config; "
                f"{(getattr(config, 'architectures', None) or ['this model'])[0]} has no "
                f"{', '.join(missing)}")
        torch.manual_seed(seed)
        module = Eagle3Model(config, default_layers(int(config.num_hidden_layers)))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
        return Eagle3Drafter(module.eval())
    if name == "dspark":
        from pagedkv.modeling.drafters.dspark import DSparkConfig, DSparkModel

        if getattr(config, "kv_lora_rank", None) is None:
            raise UnsupportedCapabilityError(
                f"--draft dspark needs an MLA target (kv_lora_rank); "
                f"{(getattr(config, 'architectures', None) or ['this model'])[0]} has none")
        n = int(config.num_hidden_layers)
        cfg = DSparkConfig.for_target(  # random weights: a drafter for tiny random targets
            config, num_hidden_layers=2, block_size=dspark_block, markov_rank=8,
            target_layer_ids=sorted({0, n // 2, n - 1}))
        torch.manual_seed(seed)
        module = DSparkModel(cfg)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
        return DSparkDrafter(module.eval())
    raise UnsupportedCapabilityError(
        f"--draft {name} is not implemented in pagedkv")


class Eagle3Drafter(MTPDrafter):
    """EAGLE-3 (:mod:`pagedkv.modeling.drafters.eagle3`) for a Llama-family target: the
    MTP catch-up and chaining, with the target's low/middle/high layer outputs (taken by
    forward hooks on the target's decoder layers) as the feature."""

    name = "eagle3"

    def __init__(self, module: Any) -> None:
        super().__init__(module)
        self._aux: dict[int, torch.Tensor] = {}

    def layer_specs(self, config: Any) -> tuple[LayerSpec, ...]:
        from pagedkv.models import layers_from_config

        return layers_from_config(self.module.layer_config(), model="draft")

    def check(self, engine: Engine, k: int) -> None:
        from pagedkv.errors import UnsupportedCapabilityError

        super().check(engine, k)
        layers = getattr(getattr(engine.model, "model", None), "layers", None)
        ids = self.module.target_layer_ids
        if layers is None or not all(0 <= i < len(layers) for i in ids):
            raise UnsupportedCapabilityError(
                f"EAGLE-3 reads target layers {list(ids)}; {type(engine.model).__name__} "
                f"has {0 if layers is None else len(layers)} decoder layers")
        for i in ids:
            layers[i].register_forward_hook(
                lambda mod, args, out, i=i: self._aux.__setitem__(i, out))

    def observe(self, engine: Engine, rid: object, start: int, rows: slice) -> None:
        feats = torch.cat([self._aux[i] for i in self.module.target_layer_ids], dim=-1)
        _keep_rows(self.pending, rid, start, feats[rows])


class DSparkDrafter:
    """DSpark over the target's MLA block table (:mod:`pagedkv.modeling.drafters.dspark`).

    At the end of each step (``flush``): write the drafter layers' context K at every
    position the target finished (from the target layers' outputs kept by
    ``model.capture_layers``). Before each verify pass: one block forward per request [anchor, mask x (B-1)]
    at c .. c + B - 1 (scratch K/V in the lookahead slots), then the Markov head drafts
    left to right. k <= B - 1."""

    name = "dspark"

    def __init__(self, module: Any) -> None:
        self.module = module
        self.pending: dict[object, _Pending] = {}
        self.block_log: list[tuple[object, int, torch.Tensor]] = []  # (rid, anchor pos, logits)

    def layer_specs(self, config: Any) -> tuple[LayerSpec, ...]:
        from pagedkv.models import layers_from_config

        return layers_from_config(self.module.config.to_dict(), model="draft")

    def check(self, engine: Engine, k: int) -> None:
        from pagedkv.errors import IncompatibleLayersError, UnsupportedCapabilityError

        b = self.module.block_size
        if k > b - 1:
            raise InvalidArgumentError(
                f"--spec-tokens {k} exceeds what a DSpark block of {b} drafts ({b - 1})")
        runner = engine.runner
        target = [s for s in engine.specs if s.model != "draft" and s.attention is not None
                  and s.layout.kind == "mla_latent"]
        if not target:
            raise IncompatibleLayersError("a DSpark drafter needs a target with MLA layers")
        for name in self.module.layer_names:
            spec = runner.specs[name]
            if spec.layout != target[0].layout:
                raise IncompatibleLayersError(
                    f"DSpark layer {name} caches {spec.layout}, the target's MLA layers "
                    f"{target[0].layout}: the latent layouts must match to share a block table")
            if runner.layer_group[name] != runner.layer_group[target[0].name]:
                raise IncompatibleLayersError(
                    f"DSpark layer {name} is not in the target's MLA block-table group")
            if spec.attention is None or spec.attention.draft_block != b:
                raise IncompatibleLayersError(
                    f"DSpark layer {name}: its attention group plans draft blocks of "
                    f"{getattr(spec.attention, 'draft_block', None)}, the drafter drafts {b}")
        if engine.scheduler.lookahead < b - 1:
            raise UnsupportedCapabilityError(
                f"a DSpark block of {b} needs {b - 1} lookahead slots; the scheduler gives "
                f"{engine.scheduler.lookahead}")
        n_layers = len(getattr(engine.model.model, "layers", ()))
        bad = [i for i in self.module.target_layer_ids if not 0 <= i < n_layers]
        if not hasattr(engine.model, "capture_layers") or bad:
            raise UnsupportedCapabilityError(
                f"{type(engine.model).__name__} cannot hand DSpark the hidden states of "
                f"layers {list(self.module.target_layer_ids)} (it has {n_layers} layers)")
        engine.model.capture_layers = self.module.target_layer_ids
        self.module.to(device=engine.device, dtype=engine.dtype)

    def observe(self, engine: Engine, rid: object, start: int, rows: slice) -> None:
        _keep_rows(self.pending, rid, start, engine.model.captured[rows])

    @torch.inference_mode()
    def flush(self, engine: Engine, chunks: Sequence[Chunk],
              sampled: Mapping[object, Sequence[int]]) -> None:
        """End of a step, before the scheduler commits (blocks still held): write the
        context K of every position the target just finished. These positions sit in the
        target's MLA blocks, which the block manager caches: they must hold the drafter's
        final K when committed (a request that finishes gets no later catch-up), so that
        a prefix hit finds it there."""
        self._write_context(engine, [c.request.rid for c in chunks])

    def _write_context(self, engine: Engine, rids: Sequence[object]) -> None:
        rows = [(rid, self.pending[rid]) for rid in rids
                if rid in self.pending and self.pending[rid].rows]
        if not rows:
            return
        reqs = [self._request(engine, rid, p.start, len(p.rows)) for rid, p in rows]
        pos = [q for _, p in rows for q in range(p.start, p.start + len(p.rows))]
        self.module.write_context(
            torch.cat([torch.stack(p.rows) for _, p in rows]),
            torch.tensor(pos, dtype=torch.long, device=engine.device), self._ctx(engine, reqs))
        for rid, p in rows:
            self.pending[rid] = _Pending(p.start + len(p.rows), [])

    def _ctx(self, engine: Engine, reqs: list) -> Any:
        from pagedkv.batch import build_metadata
        from pagedkv.modeling.base import ForwardContext

        runner = engine.runner
        gid = runner.layer_group[self.module.layer_names[0]]
        group = next(g for g in runner.attn_groups if g.id == gid)
        meta = build_metadata(reqs, [group], device=engine.device)
        return ForwardContext(runner.layer_group, runner.specs, meta, runner.caches,
                              causal=False, backend=runner.backend)

    def _request(self, engine: Engine, rid: object, first: int, n: int) -> Any:
        from pagedkv.batch import ScheduledRequest

        tables = engine.manager.block_tables(rid)
        return ScheduledRequest(rid, first, n, {engine.runner.gids[i]: list(t)
                                                for i, t in enumerate(tables)})

    @torch.inference_mode()
    def propose(self, engine: Engine, chunks: Sequence[Chunk],
                k: Mapping[object, int]) -> dict[object, Proposal]:
        todo = [c for c in chunks if c.request.rid in k and c.request.rid in self.pending]
        if not todo:
            return {}
        device = engine.device
        for c in todo:
            p = self.pending[c.request.rid]
            if p.start + len(p.rows) != c.num_computed:
                raise InvalidArgumentError(
                    f"request {c.request.rid!r}: DSpark context ends at "
                    f"{p.start + len(p.rows)}, the step starts at {c.num_computed}")
        self._write_context(engine, [c.request.rid for c in todo])
        b = self.module.block_size
        reqs = [self._request(engine, c.request.rid, c.num_computed, b) for c in todo]
        anchors = torch.tensor([engine.manager.requests[c.request.rid].tokens[c.num_computed]
                                for c in todo], dtype=torch.long, device=device)
        pos = torch.tensor([q for c in todo for q in range(c.num_computed, c.num_computed + b)],
                           dtype=torch.long, device=device)
        logits = self.module.block_logits(anchors, pos, self._ctx(engine, reqs))
        drafts = torch.empty(len(todo), b - 1, dtype=torch.long, device=device)
        prev = anchors
        for i in range(b - 1):
            row = logits[:, i] + self.module.markov_bias(prev)
            prev = drafts[:, i] = row.argmax(-1)
        for j, c in enumerate(todo):
            self.block_log.append((c.request.rid, c.num_computed, logits[j]))
            self.pending[c.request.rid] = _Pending(c.num_computed, [])
        return {c.request.rid: Proposal(tuple(drafts[j, : k[c.request.rid]].tolist()))
                for j, c in enumerate(todo)}
