"""A minimal step driver for hybrid models over pagedkv (plan -> block manager -> metadata ->
model) and the scenarios the hybrid modeling tests run through it.

Every cache tensor starts NaN-filled and every plainly free page or state slot is NaN-filled
again before each step (so reading anything that is not the request's own shows up as
NaN), free lists are shuffled, the manager runs checked. Scheduling is the test's: each step
says which request runs how many tokens, so prefix hits, chunk boundaries, checkpoints and
preemption land exactly where a scenario wants them. Every logit row is kept and compared
with transformers' dense forward of the request's whole sequence.
"""

from __future__ import annotations

import random

import torch

from pagedkv.batch import ScheduledRequest, build_metadata
from pagedkv.blocks import KVCacheManager
from pagedkv.modeling.hybrid import HybridContext
from pagedkv.modeling.recurrent_state import RecurrentBatch, apply_restores
from pagedkv.models.layers import layers_from_config
from pagedkv.ops import fill_nan_
from pagedkv.plan import PlanOptions, make_plan

TOL = 1e-4


def expect(condition: bool, message: str) -> None:
    """An assert that survives ``python -O`` (this module is not a test module, so pytest
    does not rewrite its asserts)."""
    if not condition:
        raise AssertionError(message)


class Harness:
    def __init__(self, model, config, *, block_size=4, budget=1 << 20, max_model_len=64,
                 seed=0, caching=True, **manager_kwargs):
        self.model = model
        layers = layers_from_config(config.to_dict())
        self.plan = make_plan(layers, PlanOptions(budget_bytes=budget, max_model_len=max_model_len,
                                                  block_size=block_size, max_batched_tokens=64))
        self.mgr = KVCacheManager.from_plan(self.plan, enable_caching=caching, checked=True,
                                            **manager_kwargs)
        rng = random.Random(seed)
        for pool in self.mgr.pools:
            rng.shuffle(pool.free)
        self.groups = {g.id: g for g in self.plan.groups}
        self.layer_group = {name: g.id for g in self.plan.groups for name in g.layer_names}
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        for view in self.plan.ranks[0].views:
            t = fill_nan_(torch.empty(view.shape, dtype=torch.float32))
            tensors.setdefault(view.layer, {})[view.tensor] = t
        self.kv = {n: (t["k"], t["v"]) for n, t in tensors.items() if "k" in t}
        self.states = {n: t for n, t in tensors.items() if "k" not in t}
        self.by_group = {gid: [t for n in g.layer_names
                               for t in (self.kv[n] if n in self.kv else self.states[n].values())]
                         for gid, g in self.groups.items()}
        self.gid_of_index = [m.gid for m in self.mgr.managers]
        self.rows: dict[object, list[tuple[int, torch.Tensor]]] = {}  # rid -> (position, logits)
        self.seqs: dict[object, list[int]] = {}
        self.ops_seen: list = []

    def add(self, rid, prompt, max_new_tokens=None) -> int:
        """Register and look up a request; returns its prefix hit in tokens."""
        self.mgr.add_request(rid, prompt, max_new_tokens=max_new_tokens)
        self.seqs[rid] = list(prompt)
        self.rows.setdefault(rid, [])
        return self.mgr.find_cached_prefix(rid)

    def preempt(self, rid) -> int:
        """Drop the request's blocks and look it up again; returns the new hit."""
        self.mgr.preempt(rid)
        return self.mgr.find_cached_prefix(rid)

    def free(self, rid) -> None:
        self.mgr.free(rid)

    def remaining(self, rid) -> int:
        """Known tokens not computed yet (after a lookup: past the hit)."""
        req = self.mgr.requests[rid]
        start = req.pending[0] if req.pending is not None else req.num_computed
        return len(req.tokens) - start

    def _nan_free_pages(self) -> None:
        for pool in self.mgr.pools:
            pages = list(pool.free)  # plain free: no request, no cached content
            if not pages:
                continue
            for gid in self.groups:
                if self.mgr.managers[self.gid_of_index.index(gid)].pool is pool:
                    for t in self.by_group[gid]:
                        fill_nan_(t, pages)

    def step(self, schedule):
        """Run ``[(rid, n), ...]``; a request whose step reaches the end of its known
        tokens gets its greedy token appended. Returns {rid: logits [n, vocab]}."""
        for rid, n in schedule:
            if not self.mgr.allocate(rid, n):
                raise RuntimeError(f"no room for {rid}")
        ops = self.mgr.drain_copy_ops()
        self.ops_seen += ops
        self._nan_free_pages()
        for op in ops:
            if op.kind == "copy":
                keep = op.position % self.groups[op.group_id].block_size
                for t in self.by_group[op.group_id]:
                    t[op.dst, :keep] = t[op.src, :keep]
        apply_restores(ops, {gid: [self.states[n] for n in g.layer_names]
                             for gid, g in self.groups.items() if g.is_recurrent})
        reqs, ids, pos = [], [], []
        for rid, n in schedule:
            c = self.mgr.num_computed(rid)
            tables = self.mgr.block_tables(rid)
            blocks = {self.gid_of_index[i]: list(t) for i, t in enumerate(tables)}
            reqs.append(ScheduledRequest(rid, c, n, blocks))
            ids += self.mgr.requests[rid].tokens[c : c + n]
            pos += range(c, c + n)
        attn = [g for g in self.plan.groups if not g.is_recurrent]
        meta = build_metadata(reqs, attn, checked=True)
        batches = {g.id: RecurrentBatch.build(reqs, g.id, ops)
                   for g in self.plan.groups if g.is_recurrent}
        ctx = HybridContext(self.layer_group, meta, batches, self.kv, self.states)
        with torch.no_grad():
            logits = self.model.compute_logits(self.model(torch.tensor(ids), torch.tensor(pos), ctx))
        out, row = {}, 0
        for rid, n in schedule:
            out[rid] = logits[row : row + n]
            c = self.mgr.num_computed(rid)
            self.rows[rid] += [(c + j, out[rid][j]) for j in range(n)]
            row += n
            new = [int(out[rid][-1].argmax())] if c + n == len(self.mgr.requests[rid].tokens) else []
            self.seqs[rid] += new
            self.mgr.commit(rid, n, new)
        return out

    def finish(self, rid, max_new_tokens):
        """Decode ``rid`` alone until it has ``max_new_tokens`` tokens past ``prompt_len``."""
        while len(self.seqs[rid]) - self.mgr.requests[rid].num_prompt < max_new_tokens:
            self.step([(rid, self.remaining(rid))])

    def check(self, hf) -> float:
        """Every kept logit row equals transformers' dense forward (within TOL); returns the
        largest difference."""
        worst = 0.0
        for rid, rows in self.rows.items():
            if not rows:
                continue
            with torch.no_grad():
                ref = hf(torch.tensor([self.seqs[rid]])).logits[0].float()
            for p, row in rows:
                diff = float((row - ref[p]).abs().max())
                if not diff <= TOL:  # NaN fails too
                    raise AssertionError(f"request {rid!r} position {p}: logits differ by {diff}")
                worst = max(worst, diff)
        return worst


def perturb_(model, seed: int) -> None:
    """Random weights everywhere (norm weights, biases and router biases included), so
    that no parameter sits at an initial value that would hide a wrong formula."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
        for name, b in model.named_buffers():
            if "correction_bias" in name:
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)


def prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --- scenarios (each test file runs them on its architecture) ------------------------------

def mixed_batch(hf, model, config, seed=0):
    """Prefill, chunked prefill and decode rows in the same steps."""
    h = Harness(model, config, seed=seed)
    v = config.vocab_size
    h.add("a", prompt(v, 11, seed), 7)
    h.add("b", prompt(v, 13, seed + 1), 4)
    h.step([("a", 11)])  # whole prompt
    h.step([("a", 1), ("b", 5)])  # decode + first chunk
    h.step([("b", 3), ("a", 1)])  # chunk that crosses a block boundary
    h.step([("a", 1), ("b", 5)])  # last chunk
    for _ in range(3):
        h.step([("b", 1), ("a", 1)])
    expect(len(h.rows["a"]) == 11 + 6 and len(h.rows["b"]) == 13 + 3, "rows kept")
    return h.check(hf)


def prefix_hit_interval(hf, model, config, seed=0):
    """Checkpoints every block, saved mid-chunk; a second request sharing 10 tokens resumes
    from the checkpoint at 8 (restored into its own slot)."""
    h = Harness(model, config, seed=seed, recurrent_checkpoint_every=1)
    v = config.vocab_size
    a = prompt(v, 14, seed)
    h.add("a", a, 2)
    h.step([("a", 9)])  # saves at 4 and 8 fall inside this chunk
    h.step([("a", 5)])
    h.finish("a", 2)
    b = a[:10] + prompt(v, 5, seed + 7)
    hit = h.add("b", b, 3)
    expect(hit == 8, f"hit {hit}, not the checkpoint at 8")
    h.step([("b", 7)])
    expect(any(op.kind == "restore" for op in h.ops_seen), "no restore op")
    h.finish("b", 3)
    expect(h.rows["b"][0][0] == 8, "b recomputed its hit")
    return h.check(hf)


def prefix_hit_next_turn(hf, model, config, seed=0):
    """Default checkpoint policy: the last block boundary a finished request computed
    (during decode) is where its next turn resumes."""
    h = Harness(model, config, seed=seed)
    v = config.vocab_size
    h.add("a", prompt(v, 10, seed), 6)  # computes 15 tokens: saves at 12
    h.step([("a", 6)])
    h.step([("a", 4)])
    h.finish("a", 6)
    turn2 = h.seqs["a"] + prompt(v, 3, seed + 3)
    h.free("a")
    hit = h.add("b", turn2, 3)
    expect(hit == 12, f"hit {hit}, not the decode checkpoint at 12")
    h.step([("b", h.remaining("b"))])
    h.finish("b", 3)
    return h.check(hf)


def preempt_recompute(hf, model, config, seed=0, every=None):
    """Preempted after a few decode steps, recomputed (from scratch, or from its own
    checkpoint with ``every``), then decoded on; the other request keeps running."""
    kw = {} if every is None else {"recurrent_checkpoint_every": every}
    h = Harness(model, config, seed=seed, **kw)
    v = config.vocab_size
    h.add("a", prompt(v, 9, seed), 8)
    h.add("b", prompt(v, 6, seed + 1), 8)
    h.step([("a", 9), ("b", 6)])
    for _ in range(3):
        h.step([("a", 1), ("b", 1)])
    hit = h.preempt("a")  # 12 computed, 13 known
    want = 0 if every is None else every * 4 * (12 // (every * 4))
    expect(hit == want, f"hit {hit}, want {want}")
    h.step([("b", 1), ("a", h.remaining("a"))])
    for _ in range(3):
        h.step([("a", 1), ("b", 1)])
    return h.check(hf)


def greedy_generation(hf, model, config, seed=0, new=8):
    """Continuous batching (staggered admissions, chunked prefill) gives the tokens of
    transformers' greedy ``generate`` for every prompt."""
    h = Harness(model, config, seed=seed)
    v = config.vocab_size
    prompts = {"a": prompt(v, 7, seed), "b": prompt(v, 12, seed + 1), "c": prompt(v, 3, seed + 2)}
    h.add("a", prompts["a"], new)
    h.step([("a", 7)])
    h.add("b", prompts["b"], new)
    h.step([("a", 1), ("b", 8)])
    h.add("c", prompts["c"], new)
    h.step([("b", 4), ("c", 3), ("a", 1)])
    while True:
        todo = [(r, 1) for r in prompts
                if len(h.seqs[r]) - len(prompts[r]) < new]
        if not todo:
            break
        h.step(todo)
    hf.generation_config.eos_token_id = None
    for rid, p in prompts.items():
        with torch.no_grad():
            ids = torch.tensor([p])  # an explicit mask: token 0 is not padding here
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              do_sample=False, pad_token_id=0)[0].tolist()
        expect(h.seqs[rid] == ref, f"{rid}: {h.seqs[rid]} != generate's {ref}")
    return h.check(hf)


def checkpoint_round_trip(hf, model_class, tmp_path):
    """save_pretrained's tensors (per-expert, renamed as on the Hub) load into the native
    model exactly; a missing or misshapen tensor is refused by name."""
    from safetensors.torch import load_file

    from pagedkv.errors import PagedKVError

    hf.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    ours = model_class(hf.config)
    ours.load_weights(saved.items())
    mine = ours.state_dict()
    for name, value in hf.state_dict().items():
        expect(torch.equal(mine[name], value), name)
    drop = sorted(saved)[3]
    try:
        ours.load_weights((k, v) for k, v in saved.items() if k != drop)
    except PagedKVError as exc:
        expect("lacks 1 tensors" in str(exc), str(exc))
    else:
        raise AssertionError(f"loading without {drop} was accepted")
    try:
        ours.load_weights((k, v[:1] if k == drop else v) for k, v in saved.items())
    except PagedKVError as exc:
        expect(drop in str(exc) and "shape" in str(exc), str(exc))
    else:
        raise AssertionError(f"a misshapen {drop} was accepted")
