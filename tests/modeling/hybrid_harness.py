"""Scenario-level checks of the hybrid models over pagedkv: the engine's own runner
(:class:`pagedkv.engine.runner.ModelRunner`: copy ops, restores, metadata, segments, NaN in
every plainly free page and state slot before each step, shuffled free lists) driven by a
schedule the test writes, so that prefix hits, chunk boundaries, mid-chunk checkpoint saves
and preemption land exactly where a scenario wants them. The engine's scheduler runs the
same models in the engine-level tests (tests/engine_check.py). Every logit row is kept and compared with
transformers' dense forward of the request's whole sequence.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from pagedkv.blocks import KVCacheManager
from pagedkv.engine.request import Request
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.scheduler import Chunk
from pagedkv.errors import PagedKVError
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
        specs = type(model).layer_specs(config)
        self.plan = make_plan(specs, PlanOptions(budget_bytes=budget, max_model_len=max_model_len,
                                                 block_size=block_size, max_batched_tokens=64))
        self.mgr = KVCacheManager.from_plan(self.plan, enable_caching=caching, checked=True,
                                            **manager_kwargs)
        self.runner = ModelRunner(model, self.plan, specs, self.mgr, device=torch.device("cpu"),
                                  kv_dtype=torch.float32, debug_nan=True, shuffle_seed=seed)
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

    def step(self, schedule):
        """Run ``[(rid, n), ...]``; a request whose step reaches the end of its known
        tokens gets its greedy token appended. Returns {rid: logits [n, vocab]}."""
        for rid, n in schedule:
            if not self.mgr.allocate(rid, n):
                raise RuntimeError(f"no room for {rid}")
        ops = self.mgr.drain_copy_ops()
        self.ops_seen += ops
        chunks = []
        for rid, n in schedule:
            c = self.mgr.num_computed(rid)
            known = len(self.mgr.requests[rid].tokens)
            chunks.append(Chunk(Request(rid, tuple(self.seqs[rid])), c, n, c + n == known))
        out = self.runner.execute(chunks, ops, all_rows=True)
        result = {}
        for chunk, rows in zip(chunks, out.rows):
            rid, c = chunk.request.rid, chunk.num_computed
            logits = out.logits[rows.start : rows.stop]
            result[rid] = logits
            self.rows[rid] += [(c + j, logits[j]) for j in range(chunk.num_new_tokens)]
            new = [int(logits[-1].argmax())] if chunk.samples else []
            self.seqs[rid] += new
            self.mgr.commit(rid, chunk.num_new_tokens, new)
        return result

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
    """``engine_check.randomize_`` (every parameter), plus MoE routers' score-correction
    biases, which are buffers, so that no value sits where it would hide a wrong formula."""
    from engine_check import randomize_

    randomize_(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
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


def state_slot_budget(model, config, slots, block_size=4, max_model_len=64):
    """The smallest plan budget (bytes, in 1 KiB steps) that gives exactly ``slots`` state slots."""
    specs = type(model).layer_specs(config)
    for budget in range(1024, 1 << 20, 1024):
        try:
            plan = make_plan(specs, PlanOptions(budget_bytes=budget, max_model_len=max_model_len,
                                                block_size=block_size, max_batched_tokens=64))
        except PagedKVError:
            continue
        if [g.num_blocks for g in plan.groups if g.is_recurrent] == [slots]:
            return budget
    raise AssertionError(f"no budget gives {slots} state slots")


def prefix_hit_take_over(hf, model, config, seed=0):
    """Two state slots: a running request and its one checkpoint hold both, so a second
    request hitting that checkpoint takes it over as its working state (no copy) while the
    first keeps decoding."""
    budget = state_slot_budget(model, config, 2)
    h = Harness(model, config, seed=seed, budget=budget, recurrent_checkpoint_every=1)
    v = config.vocab_size
    a = prompt(v, 14, seed)
    h.add("a", a, 8)
    h.step([("a", 14)])  # one free slot: only the longest point, 12, is saved
    saves = [op for op in h.ops_seen if op.kind == "save"]
    expect([op.position for op in saves] == [12], f"saves {saves}")
    hit = h.add("b", a[:13] + prompt(v, 4, seed + 5), 3)
    expect(hit == 12, f"hit {hit}, not the checkpoint at 12")
    before = len(h.ops_seen)
    h.step([("a", 1), ("b", h.remaining("b"))])
    expect(not any(op.kind == "restore" for op in h.ops_seen[before:]), "copied, not taken over")
    (gid,) = [g.id for g in h.plan.groups if g.is_recurrent]
    slot = h.mgr.block_tables("b")[h.runner.gids.index(gid)]
    expect(slot == [saves[0].dst], f"b's slot {slot}, the checkpoint was {saves[0].dst}")
    for _ in range(3):
        h.step([("b", 1), ("a", 1)])
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


def checkpoint_round_trip(hf, model_class, tmp_path):
    """save_pretrained's folder (per-expert tensors, Hub names) through the engine's loader
    gives transformers' logits; a missing or misshapen tensor is refused by name."""
    from engine_check import max_logit_diff, options, prompts, run
    from safetensors.torch import load_file

    from pagedkv.errors import WeightError

    hf.save_pretrained(tmp_path)
    engine = run(str(tmp_path), prompts(hf.config.vocab_size, (9, 5), seed=6), options(), new=4)
    diff = max_logit_diff(hf, engine)
    saved = load_file(str(tmp_path / "model.safetensors"))
    ours = model_class(hf.config)
    drop = sorted(saved)[3]
    try:
        ours.load_weights((k, v) for k, v in saved.items() if k != drop)
    except WeightError as exc:
        expect("lacks 1 tensors" in str(exc), str(exc))
    else:
        raise AssertionError(f"loading without {drop} was accepted")
    try:
        ours.load_weights((k, v[:1] if k == drop else v) for k, v in saved.items())
    except WeightError as exc:
        expect(drop in str(exc) and "shape" in str(exc), str(exc))
    else:
        raise AssertionError(f"a misshapen {drop} was accepted")
    return diff


# --- the tiny models ---------------------------------------------------------------------

class Tiny(NamedTuple):
    hf: Any  # transformers' model (fp32, random perturbed weights)
    ours: Any  # the native model with the same weights
    config: Any
    preempt_bytes: int  # an engine cache small enough that three long requests preempt


def tiny(name: str) -> Tiny:
    """``"nemotron_h"``: every block kind (Mamba-2, MLP, attention, MoE), Mamba chunks (4)
    shorter than the prompts; ``"qwen3_next"``: both mixers, a dense MLP and a MoE layer,
    a partial RoPE."""
    import transformers

    if name == "nemotron_h":
        from pagedkv.modeling.nemotron_h import NemotronHForCausalLM as ours_cls

        config = transformers.NemotronHConfig(
            vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, mamba_num_heads=4, mamba_head_dim=8,
            ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=4, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=16, n_group=2, topk_group=1,
            layers_block_type=["linear_attention", "mlp", "full_attention", "moe",
                               "linear_attention", "mlp"],
            dtype="float32", max_position_embeddings=64,
        )
        hf_cls, seed, preempt_bytes = transformers.NemotronHForCausalLM, 2, 18000
    elif name == "qwen3_next":
        from pagedkv.modeling.qwen3_next import Qwen3NextForCausalLM as ours_cls

        config = transformers.Qwen3NextConfig(
            vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            decoder_sparse_step=2, full_attention_interval=2, dtype="float32",
            max_position_embeddings=64,
        )
        hf_cls, seed, preempt_bytes = transformers.Qwen3NextForCausalLM, 1, 40000
    else:
        raise ValueError(f"no tiny hybrid model {name!r}")
    torch.manual_seed(0)
    hf = hf_cls(config).eval()
    perturb_(hf, seed=seed)
    ours = ours_cls(config).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return Tiny(hf, ours, config, preempt_bytes)


HYBRIDS = ("nemotron_h", "qwen3_next")
