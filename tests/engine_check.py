"""Engine-level checks shared by the modeling and engine tests: run prompts through
:class:`pagedkv.engine.Engine` (NaN-filled free pages, shuffled free lists, checked
manager, every row's logits kept) and compare with transformers' dense forward and
greedy ``generate``."""

from __future__ import annotations

import torch

from pagedkv.batch import build_metadata
from pagedkv.engine import Engine, EngineOptions, SamplingParams

TOL = 1e-4


def randomize_(model, seed: int, scale: float = 0.1) -> None:
    """Perturb every parameter, so that no weight sits at an initial value (norm weights
    at 1 or 0) that would hide a wrong formula."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def prompts(vocab: int, lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def budget_for(hf, tokens: int) -> int:
    """A cache budget (engine bytes, fp32) that holds about ``tokens`` tokens in every group."""
    from pagedkv.kvspec.layout import bytes_per_token
    from pagedkv.models import layers_from_config

    per_token = sum(bytes_per_token(s.layout) for s in layers_from_config(hf.config.to_dict()))
    return 2 * per_token * tokens


def options(**kw) -> EngineOptions:
    base = dict(block_size=4, max_model_len=64, max_batched_tokens=16, kv_cache_bytes=1 << 20,
                debug_nan=True, shuffle_seed=7, record_logits=True, checked=True)
    base.update(kw)
    return EngineOptions(**base)


def run(hf, prompt_list, opts: EngineOptions, new: int = 5, engine: Engine | None = None) -> Engine:
    """Generate ``new`` tokens for every prompt (on ``engine`` if given, else a new one);
    the outputs of every call accumulate in ``engine.outputs``."""
    engine = Engine(hf, opts) if engine is None else engine
    outs = engine.generate(prompt_list, SamplingParams(max_new_tokens=new, ignore_eos=True))
    for out in outs:
        if out.error is not None:
            raise out.error
        if len(out.token_ids) != new:
            raise AssertionError(f"request {out.rid}: {len(out.token_ids)} tokens, wanted {new}")
    engine.outputs = getattr(engine, "outputs", []) + outs
    return engine


def max_logit_diff(hf, engine: Engine) -> float:
    """Largest |engine - transformers| over every row the engine computed (a recomputed
    row counts every time); AssertionError naming the first row beyond TOL (NaN too)."""
    worst = 0.0
    for out in engine.outputs:
        seq = out.prompt_token_ids + out.token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0].float()
        rows = engine.logits[out.rid]
        hit = engine.requests[out.rid].hit_tokens
        if not {p for p, _ in rows} >= set(range(hit, len(seq) - 1)):
            raise AssertionError(f"request {out.rid}: no logits for some of positions "
                                 f"{hit}..{len(seq) - 2}")
        for p, row in rows:
            diff = float((row - ref[p]).abs().max())
            if not diff <= TOL:
                raise AssertionError(f"request {out.rid} position {p}: logits differ by {diff}")
            worst = max(worst, diff)
    return worst


def hf_greedy(hf, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, pad_token_id=0)[0].tolist()
    return seq[len(prompt):]


# --- the scenarios every model test runs ---------------------------------------------------

def preempted_logit_diff(hf, kv_cache_bytes: int, lengths=(13, 6, 19), *, seed: int = 3,
                         new: int = 6) -> float:
    """Prompts through a cache too small to hold them all (8-token steps, so prefills are
    chunked): AssertionError unless a request was preempted; else the max logit diff."""
    ps = prompts(hf.config.vocab_size, lengths, seed)
    opts = options(kv_cache_bytes=kv_cache_bytes, max_model_len=32, max_batched_tokens=8)
    engine = run(hf, ps, opts, new=new)
    if engine.preemptions == 0:
        raise AssertionError(f"no request was preempted with {kv_cache_bytes} cache bytes")
    return max_logit_diff(hf, engine)


def prefix_hits_and_logit_diff(hf, opts: EngineOptions | None = None, *, turn: bool = True,
                               first_new: int = 3) -> tuple[list[int], float]:
    """Prompt a (13 tokens), then a[:10] + b and, with ``turn``, a's whole turn + b, which
    hit a's cached blocks: (their hit tokens, the max logit diff over all rows)."""
    a, b = prompts(hf.config.vocab_size, (13, 6), seed=4)
    opts = options(max_batched_tokens=8) if opts is None else opts
    engine = run(hf, [a], opts, new=first_new)
    later = [a[:10] + b] + ([a + engine.outputs[0].token_ids + b] if turn else [])
    run(hf, later, opts, new=4, engine=engine)
    return [engine.requests[o.rid].hit_tokens for o in engine.outputs[1:]], max_logit_diff(hf, engine)


def greedy_tokens(hf, lengths, *, new: int = 8) -> tuple[list[list[int]], list[list[int]]]:
    """(the engine's greedy tokens, transformers' ``generate``) per prompt, 6-token steps."""
    ps = prompts(hf.config.vocab_size, lengths, seed=5)
    engine = run(hf, ps, options(max_batched_tokens=6, record_logits=False), new=new)
    return [out.token_ids for out in engine.outputs], [hf_greedy(hf, p, new) for p in ps]


# the device arrays of a step's metadata
ARRAYS = ("block_table", "slot_mapping", "query_start_loc", "seq_lens", "positions",
          "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")


def assert_built_as_stateless(got, reqs, groups) -> None:
    """``got`` equals build_metadata of ``reqs``, padded as ``got`` is."""
    first = next(iter(got.values()))
    want = build_metadata(reqs, groups, pad_batch_to=first.block_table.shape[0],
                          pad_tokens_to=first.slot_mapping.shape[0],
                          max_blocks=first.block_table.shape[1])
    assert set(got) == set(want)
    for gid, meta in got.items():
        for name in ARRAYS:
            assert torch.equal(getattr(meta, name), getattr(want[gid], name)), (gid, name)
        for name in ("num_reqs", "num_tokens", "req_ids", "query_lens_host",
                     "seq_lens_host", "num_draft_tokens_host"):
            assert getattr(meta, name) == getattr(want[gid], name), (gid, name)
