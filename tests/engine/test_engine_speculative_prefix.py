"""Speculative decoding with prefix caching on: DSpark (DeepSeek-V3 and Kimi-Linear
targets) stays lossless when a request hits blocks another request cached; MTP and EAGLE-3
still refuse prefix caching (see their test for why).

DSpark's context K lives in the target's MLA blocks, which the block manager caches, so a
hit must find it written. The first request generates ONE token and finishes without ever
drafting: its drafter K exists only because the engine has the drafter write it at the end
of each step (``flush``), before the commit that caches the blocks. Fresh pages are
NaN-filled and blocks shuffled (``options``); the second call mixes a prefix hit, a short
and a long (chunked) prefill and decodes in the same steps. Checked: greedy tokens equal
transformers' ``generate``; every kept target logit row equals transformers'; the drafter's
block logits for the hitting request equal the dense float64 reference of DSpark over the
whole sequence (so the cached drafter K is right)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_check import hf_greedy, max_logit_diff, options, prompts, run  # noqa: E402
from mla_models import random_dspark, random_mtp, tiny_deepseek_v3, tiny_kimi_linear  # noqa: E402
from test_engine_speculative_dspark import dense_block_logits  # noqa: E402

from pagedkv.engine.speculative import (  # noqa: E402
    DSparkDrafter,
    Eagle3Drafter,
    MTPDrafter,
    SpeculativeEngine,
)

NEW = 6


def shared_prefix_run(hf, drafter, seed):
    """First call: one request of prefix + tail, one token. Second call: prefix + another
    tail (a hit), a short and a long prompt. Returns the engine and the hitting rid."""
    vocab = hf.config.vocab_size
    prefix, t1, t2, short, long_ = prompts(vocab, (13, 2, 3, 3, 15), seed=seed)
    opts = options(spec_tokens=3, enable_prefix_caching=True, max_batched_tokens=12,
                   recurrent_checkpoint_every=1)  # Kimi-Linear: a checkpoint per block
    engine = SpeculativeEngine(hf, opts, drafter)
    run(hf, [prefix + t1], opts, new=1, engine=engine)
    batch = [prefix + t2, short, long_]
    run(hf, batch, opts, new=NEW, engine=engine)
    outs = engine.outputs[1:]
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, NEW) for p in batch]
    assert [o.token_ids for o in engine.outputs[:1]] == [hf_greedy(hf, prefix + t1, 1)]
    assert max_logit_diff(hf, engine) <= 1e-4
    hit = outs[0].rid
    assert engine.requests[hit].hit_tokens >= 11  # 3 blocks of 4 (MTP, EAGLE-3: one backed off)
    assert engine.stats.verify_passes > 0
    seqs = {o.rid: o.prompt_token_ids + o.token_ids for o in engine.outputs}
    return engine, hit, seqs


def test_mtp_and_eagle3_refuse_prefix_caching():
    """Kept refusal: a same-step hit of an offset-1 group ends inside a block whose copy
    precedes its source's prefill (target logits NaN at the hit's last position)."""
    from pagedkv.engine.tiny import tiny_model
    from pagedkv.errors import InvalidArgumentError
    from pagedkv.modeling.drafters.eagle3 import Eagle3Model

    hf = tiny_deepseek_v3(True)
    hf.config.num_nextn_predict_layers = 1
    opts = options(spec_tokens=3, enable_prefix_caching=True)
    with pytest.raises(InvalidArgumentError, match="offset-1 hit ends inside a block"):
        SpeculativeEngine(hf, opts, MTPDrafter(random_mtp(hf.config)))
    llama = tiny_model("llama-3-8b")
    with pytest.raises(InvalidArgumentError, match="offset-1 hit ends inside a block"):
        SpeculativeEngine(llama, opts, Eagle3Drafter(Eagle3Model(llama.config, [0, 1, 1])))


@pytest.mark.parametrize("target", ["deepseek-v3", "kimi-linear"])
def test_dspark_with_prefix_hits_is_lossless_and_drafts_from_cached_kv(target):
    hf = tiny_deepseek_v3(True) if target == "deepseek-v3" else tiny_kimi_linear(seed=4)
    module = random_dspark(hf.config)
    drafter = DSparkDrafter(module)
    engine, hit, seqs = shared_prefix_run(hf, drafter, seed=53)
    mine = [r for r in drafter.block_log if r[0] == hit]
    assert mine
    for rid, c, logits in mine[:3] + [r for r in drafter.block_log if r[0] != hit][:2]:
        ref = dense_block_logits(hf, module, seqs[rid], c)
        assert float((logits - ref).abs().max()) <= 1e-4, (rid, c)
