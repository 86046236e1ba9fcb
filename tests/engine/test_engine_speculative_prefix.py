"""Speculative decoding with prefix caching on: every drafter (DSpark on DeepSeek-V3 and
Kimi-Linear targets, MTP, EAGLE-3) stays lossless when a request hits blocks another
request cached, in an earlier step or in the same step.

The drafter's KV lives in blocks the block manager caches (DSpark's context K in the
target's MLA blocks; MTP's and EAGLE-3's in their offset-1 group), so a hit must find it
written. The first request generates ONE token and finishes without ever drafting: its
drafter KV exists only because the engine has the drafter write it at the end of each step
(``flush``), before the commit that caches the blocks. The second call mixes a hit on
those blocks (earlier step; for offset-1 drafters it ends inside a block, which is
copied), a new prompt and a request sharing its first blocks admitted in the SAME step
(before the block manager's fix, an offset-1 drafter's hit ended inside a block that step
had not written yet, and its copy gave NaN logits), a long chunked prefill and decodes.
Fresh pages are NaN-filled and blocks shuffled (``options``). Checked: greedy tokens equal
transformers' ``generate``; every kept target logit row equals transformers'; the
drafter's logits for the hitting requests equal a dense reference over the whole sequence
(so the cached drafter KV is right)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_check import hf_greedy, max_logit_diff, options, prompts, randomize_, run  # noqa: E402
from mla_models import random_dspark, random_mtp, tiny_deepseek_v3, tiny_kimi_linear  # noqa: E402
from test_engine_speculative_dspark import dense_block_logits  # noqa: E402
from test_engine_speculative_eagle3 import dense_eagle_logits  # noqa: E402
from test_engine_speculative_mtp import dense_mtp_logits  # noqa: E402

from pagedkv.engine.speculative import (  # noqa: E402
    DSparkDrafter,
    Eagle3Drafter,
    MTPDrafter,
    SpeculativeEngine,
)
from pagedkv.engine.tiny import tiny_model  # noqa: E402
from pagedkv.modeling.drafters.eagle3 import Eagle3Model  # noqa: E402

NEW = 6


def shared_prefix_run(hf, drafter, seed, *, same_step_hit):
    """First call: one request of prefix + tail, one token. Second call: prefix + another
    tail (a hit on the first call's blocks), a new prompt S, S's first 8 tokens + another
    tail (admitted in the same step as S: hits ``same_step_hit`` tokens of S's blocks) and
    a long prompt. Returns the engine, the hitting rids and every sequence."""
    vocab = hf.config.vocab_size
    prefix, t1, t2, s, tail, long_ = prompts(vocab, (13, 2, 3, 9, 2, 15), seed=seed)
    opts = options(spec_tokens=3, enable_prefix_caching=True, max_batched_tokens=16,
                   recurrent_checkpoint_every=1)  # Kimi-Linear: a checkpoint per block
    engine = SpeculativeEngine(hf, opts, drafter)
    run(hf, [prefix + t1], opts, new=1, engine=engine)
    batch = [prefix + t2, s, s[:8] + tail, long_]
    run(hf, batch, opts, new=NEW, engine=engine)
    outs = engine.outputs[1:]
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, NEW) for p in batch]
    assert [o.token_ids for o in engine.outputs[:1]] == [hf_greedy(hf, prefix + t1, 1)]
    assert max_logit_diff(hf, engine) <= 1e-4
    earlier, same = outs[0].rid, outs[2].rid
    assert engine.requests[earlier].hit_tokens >= 11  # 3 blocks of 4 (offset 1: backed off)
    # s was admitted in that step too (4 + 9 of 16 tokens), so s's blocks were unwritten
    assert engine.requests[same].hit_tokens == same_step_hit
    assert engine.stats.verify_passes > 0
    seqs = {o.rid: o.prompt_token_ids + o.token_ids for o in engine.outputs}
    return engine, (earlier, same), seqs


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_offset_one_drafters_with_same_step_and_earlier_hits_are_lossless(kind):
    """MTP and EAGLE-3 (position offset 1): the earlier-step hit is 11 tokens (inside a
    block of both groups: copied); the same-step hit stops at the block boundary, 4 (S's
    8 tokens hold 2 offset-1 blocks, 7 positions, which end inside block 1: not copied
    before the step writes it). Their first-draft logits equal the dense references."""
    if kind == "mtp":
        hf = tiny_deepseek_v3(True)
        hf.config.num_nextn_predict_layers = 1
        module = random_mtp(hf.config)
        drafter = MTPDrafter(module)
    else:
        hf = tiny_model("llama-3-8b")
        module = Eagle3Model(hf.config, [0, 1, 1])
        randomize_(module, 3, scale=0.3)
        drafter = Eagle3Drafter(module.eval())
    engine, hits, seqs = shared_prefix_run(hf, drafter, seed=61, same_step_hit=4)
    assert engine.requests[hits[0]].hit_tokens == 11
    dense = dense_mtp_logits if kind == "mtp" else dense_eagle_logits
    refs = {rid: dense(hf, module, seqs[rid]) for rid in hits}
    mine = [r for r in drafter.first_logits if r[0] in hits]
    assert {r[0] for r in mine} == set(hits)
    for rid, position, row in mine:
        assert float((row - refs[rid][position]).abs().max()) <= 1e-4, (rid, position)


@pytest.mark.parametrize("target", ["deepseek-v3", "kimi-linear"])
def test_dspark_with_prefix_hits_is_lossless_and_drafts_from_cached_kv(target):
    hf = tiny_deepseek_v3(True) if target == "deepseek-v3" else tiny_kimi_linear(seed=4)
    module = random_dspark(hf.config)
    drafter = DSparkDrafter(module)
    # same step: DeepSeek-V3 shares S's 2 whole blocks; Kimi-Linear's recurrent
    # checkpoints are cached at commit only, so nothing of S is there yet
    engine, hits, seqs = shared_prefix_run(hf, drafter, seed=53,
                                           same_step_hit=8 if target == "deepseek-v3" else 0)
    mine = [r for r in drafter.block_log if r[0] in hits]
    assert mine
    for rid, c, logits in mine[:4] + [r for r in drafter.block_log if r[0] not in hits][:2]:
        ref = dense_block_logits(hf, module, seqs[rid], c)
        assert float((logits - ref).abs().max()) <= 1e-4, (rid, c)
