"""Random engine runs through the Python API, each logit row checked against transformers.

Each case is a tiny random-weight model of a catalog architecture and one ``Engine`` run
with every test aid on: the checked block manager (its invariants verified after every
call), NaN-filled free pages (a read of a page the step does not own poisons a logit),
shuffled free lists, recorded logits. Drawn: block size, max_model_len, batch and running
limits, prefix caching (prompts share two random prefixes), recurrent checkpoints,
block-major caches, both metadata modes, and in 70% of cases a cache budget of 10^-2.5 to
10^-0.3 of the automatic one (preemption, recompute, refusals). With a drafter (scripted,
MTP, DSpark, EAGLE-3, where the target supports it) the same prompts run again through a
``SpeculativeEngine``. What must hold:

- a budget that cannot hold one request is a ``PagedKVError`` from ``Engine(...)``
  (refused); after that, a request may fail only with a ``PagedKVError`` of its own, and
  not with a broken invariant (``CacheCorruptedError`` from the checked manager,
  ``MetadataError`` from the ops' checks: harness.INVARIANT_ERRORS);
- every recorded logit row within 1e-4 of transformers' fp32 forward over the same tokens;
- speculative: greedy tokens equal to the plain run's, its logits within 1e-4 too, and the
  same requests failing with the same error types.

``--triton`` runs the model's attention on the Triton backend (CPU tensors: it sets
TRITON_INTERPRET=1 unless already set; much slower). The draws are those of the first
throwaway script, seed for seed.

    PYTHONPATH=src OMP_NUM_THREADS=1 python fuzz/engine.py --start 0 --count 40
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import warnings
from dataclasses import dataclass, replace

import harness

ARCHS = ["llama-3-8b", "qwen3-8b", "mistral-7b", "gemma-3-27b", "gpt-oss-20b",
         "deepseek-v3", "deepseek-v2-lite", "kimi-k3", "qwen3-next-80b", "nemotron-h-8b"]
MLA = {"deepseek-v3", "deepseek-v2-lite", "kimi-k3"}
TOLERANCE = 1e-4  # fp32 engine against fp32 transformers


@dataclass
class Case:
    seed: int
    arch: str
    draft: str | None
    opts: dict  # EngineOptions fields, but the budget
    budget_exp: float | None  # kv_cache_bytes = auto * 10**budget_exp (None: auto)
    prompts: list[list[int]]
    new: int  # max_new_tokens (ignore_eos)
    spec_tokens: int  # the drafter's lookahead

    @property
    def model_seed(self) -> int:
        return self.seed % 7


@functools.cache
def _vocab(arch: str, mtp_layers: int) -> int:
    from pagedkv.engine.tiny import tiny_config

    return tiny_config(arch, mtp_layers=mtp_layers).get_text_config().vocab_size


def draw(seed: int, args: argparse.Namespace) -> Case:
    rng = random.Random(seed)
    arch = rng.choice(args.archs)
    draft = rng.choice([None, None, "scripted", "mtp", "dspark", "eagle3"])
    if (draft == "dspark" and arch not in MLA
            or draft == "eagle3" and (arch in MLA or arch == "nemotron-h-8b")
            or draft == "mtp" and arch != "deepseek-v3"):
        draft = None  # a drafter the target cannot take: a plain run
    vocab = _vocab(arch, 1 if draft == "mtp" else 0)
    mml = rng.randint(24, 160)
    bs = rng.choice([1, 2, 4, 8, 16])
    opts = dict(block_size=bs, max_model_len=mml, max_batched_tokens=rng.randint(4, 64),
                max_running=rng.randint(1, 8), enable_prefix_caching=rng.random() < 0.7,
                recurrent_checkpoint_every=rng.choice([None, None, 1, 2]),
                debug_nan=True, shuffle_seed=seed, record_logits=True, checked=True,
                block_major_cache=rng.random() < 0.3,
                metadata=rng.choice(["persistent", "stateless"]))
    # the automatic budget holds about 4 requests of max_model_len
    budget_exp = rng.uniform(-2.5, -0.3) if rng.random() < 0.7 else None
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(1, mml // 2))]
                for _ in range(2)]
    prompts = []
    for _ in range(rng.randint(1, 7)):
        shared = rng.choice(prefixes) if rng.random() < 0.6 else []
        prompts.append(shared + [rng.randrange(vocab) for _ in range(rng.randint(0, mml // 2))]
                       or [1])
    new = rng.randint(1, 16)
    prompts = [p[: max(1, mml - new - 1)] for p in prompts]
    return Case(seed, arch, draft, opts, budget_exp, prompts, new, rng.randint(1, 6))


def describe(case: Case) -> str:
    budget = "auto" if case.budget_exp is None else f"auto*10^{case.budget_exp:.3f}"
    draft = f" draft={case.draft} spec_tokens={case.spec_tokens}" if case.draft else ""
    return (f"{case.arch} model_seed={case.model_seed}{draft} budget={budget} {case.opts} "
            f"prompt_lens={[len(p) for p in case.prompts]} new={case.new}")


def check(case: Case, args: argparse.Namespace) -> list[str]:
    from pagedkv.engine import Engine, EngineOptions, SamplingParams
    from pagedkv.engine.speculative import SpeculativeEngine, make_drafter
    from pagedkv.engine.tiny import tiny_model
    from pagedkv.engine.verify import max_logit_diff
    from pagedkv.errors import PagedKVError

    hf = tiny_model(case.arch, seed=case.model_seed, mtp_layers=1 if case.draft == "mtp" else 0)
    opts = dict(case.opts)
    if case.budget_exp is not None:
        probe = Engine(hf, EngineOptions(block_size=opts["block_size"],
                                         max_model_len=opts["max_model_len"]))
        auto = sum(t.numel() * t.element_size()
                   for c in probe.runner.caches.values() for t in c.values())
        opts["kv_cache_bytes"] = max(1, int(auto * 10 ** case.budget_exp))
        del probe
    try:
        engine = Engine(hf, EngineOptions(**opts))
    except PagedKVError as e:
        raise harness.Refused(f"{type(e).__name__}: {e}") from None
    params = SamplingParams(max_new_tokens=case.new, ignore_eos=True)
    outs = engine.generate(case.prompts, params)
    for o in outs:  # a request's own error: a PagedKVError, and not a broken invariant
        if o.error is not None and (not isinstance(o.error, PagedKVError)
                                    or harness.is_invariant_error(o.error)):
            raise o.error
    diff, _ = max_logit_diff(engine, hf, outs)
    errors = [type(o.error).__name__ for o in outs if o.error is not None]
    summary = (f"kv_cache_bytes={opts.get('kv_cache_bytes')} diff={diff:.2e} errors={errors} "
               f"preemptions={engine.preemptions}")
    if diff > TOLERANCE:
        raise harness.Bad(f"logits off transformers': {summary}")
    tags = ["preempted"] if engine.preemptions else []
    if case.draft is None:
        return tags
    k = case.spec_tokens
    script = {i: o.token_ids for i, o in enumerate(outs)}
    drafter = make_drafter(case.draft, engine.config, script=script, weights=None,
                           seed=case.seed, dspark_block=k + 1)
    try:
        spec = SpeculativeEngine(hf, replace(EngineOptions(**opts), spec_tokens=k), drafter)
    except PagedKVError:
        return [*tags, "spec_refused"]  # lookahead slots past the budget: refused up front
    souts = spec.generate(case.prompts, params)
    for o in souts:
        if harness.is_invariant_error(o.error):
            raise o.error
    same = all(a.token_ids == b.token_ids or a.error or b.error for a, b in zip(outs, souts))
    sdiff, _ = max_logit_diff(spec, hf, souts)
    same_errors = [type(o.error) for o in souts] == [type(o.error) for o in outs]
    if not (same and sdiff <= TOLERANCE and same_errors):
        serrors = [type(o.error).__name__ for o in souts if o.error is not None]
        raise harness.Bad(f"speculative run differs: same_tokens={same} sdiff={sdiff:.2e} "
                          f"spec errors={serrors}; plain run: {summary}")
    return [*tags, "spec"]


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--archs", type=lambda s: s.split(","), default=ARCHS,
                   help="comma-separated catalog names (default: all ten)")
    p.add_argument("--triton", action="store_true",
                   help="attention on the Triton backend (TRITON_INTERPRET=1 on CPU)")


def setup(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    if args.triton:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is compiled
        warnings.filterwarnings("ignore")  # the interpreter's per-launch warnings
        from pagedkv.ops import set_backend

        set_backend("triton")


if __name__ == "__main__":
    harness.main(__doc__, add_flags, draw, describe, check, limit=300, setup=setup)
