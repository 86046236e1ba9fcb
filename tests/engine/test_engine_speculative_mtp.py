"""DeepSeek MTP drafting over the target's MLA block table: lossless (greedy output with
MTP drafts equals plain greedy output), every kept logit row equals transformers', and the
MTP's first-draft logits equal a dense reference of the MTP block (transformers'
DeepseekV3DecoderLayer with the same weights, causal over the whole sequence)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine_check import hf_greedy, max_logit_diff, options, prompts, run  # noqa: E402
from mla_models import random_mtp, tiny_deepseek_v3  # noqa: E402

from pagedkv.engine.speculative import MTPDrafter, SpeculativeEngine  # noqa: E402
from pagedkv.errors import ConfigError  # noqa: E402

NEW = 8


@pytest.fixture(scope="module")
def target():
    hf = tiny_deepseek_v3(True)
    hf.config.num_nextn_predict_layers = 1
    return hf


def dense_mtp_logits(hf, mtp, seq):
    """MTP logits at every position i < len(seq) - 1 from (seq[i + 1], target hidden i)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    layer = mtp.layers[0]
    n = len(seq) - 1
    ids = torch.tensor([seq])
    with torch.no_grad():
        h = hf.model(ids).last_hidden_state[0, :n]
        x = layer.eh_proj(torch.cat([layer.enorm(layer.embed_tokens(ids[0, 1:])),
                                     layer.hnorm(h)], -1))[None]
        ref = DeepseekV3DecoderLayer(hf.config, hf.config.num_hidden_layers).eval()
        ref.load_state_dict(layer.block.state_dict())
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = ref(x, attention_mask=mask, position_ids=pos,
                  position_embeddings=hf.model.rotary_emb(x, pos))
        out = out[0] if isinstance(out, tuple) else out
        return layer.compute_logits(out[0]).detach()


def test_mtp_is_lossless_and_its_drafts_match_a_dense_reference(target):
    mtp = random_mtp(target.config)
    ps = prompts(target.config.vocab_size, (6, 11, 3), seed=21)
    want = [hf_greedy(target, p, NEW) for p in ps]
    drafter = MTPDrafter(mtp)
    opts = options(spec_tokens=3, enable_prefix_caching=False, max_batched_tokens=10)
    engine = run(target, ps, opts, new=NEW, engine=SpeculativeEngine(target, opts, drafter))
    assert [o.token_ids for o in engine.outputs] == want
    assert max_logit_diff(target, engine) <= 1e-4
    assert engine.stats.verify_passes > 0 and engine.stats.drafted > 0
    assert len(drafter.first_logits) >= engine.stats.verify_passes
    seqs = {o.rid: o.prompt_token_ids + o.token_ids for o in engine.outputs}
    refs = {rid: dense_mtp_logits(target, mtp, seq) for rid, seq in seqs.items()}
    for rid, position, row in drafter.first_logits:
        assert float((row - refs[rid][position]).abs().max()) <= 1e-4


def test_mtp_refuses_targets_without_mtp():
    plain = tiny_deepseek_v3(False)
    with pytest.raises(ConfigError, match="num_nextn_predict_layers"):
        random_mtp(plain.config)
