"""EAGLE-3 on a Llama-family target: its layer (position_offset 1, own block-table group)
drafts from the target's low/middle/high layer outputs; greedy output with EAGLE-3 drafts
equals plain greedy output, kept target logits equal transformers', and the first-draft
logits equal a dense reference of the EAGLE-3 layer (causal GQA attention written out)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_check import hf_greedy, max_logit_diff, options, prompts, randomize_, run  # noqa: E402
from mla_models import layer_outputs  # noqa: E402

from pagedkv.engine.speculative import Eagle3Drafter, SpeculativeEngine, make_drafter  # noqa: E402
from pagedkv.engine.tiny import tiny_model  # noqa: E402
from pagedkv.errors import UnsupportedCapabilityError  # noqa: E402
from pagedkv.modeling.drafters.eagle3 import Eagle3Model  # noqa: E402

NEW = 8


def dense_eagle_logits(hf, m, seq):
    """Logits at every position p < len(seq) - 1 from (seq[p + 1], target feature at p)."""
    n = len(seq) - 1
    a = m.self_attn
    with torch.no_grad():
        feat = m.fc(layer_outputs(hf, seq, m.target_layer_ids)[:n])
        ids = torch.tensor(seq[1:])
        x = torch.cat([m.input_layernorm(m.embed_tokens(ids)), m.hidden_norm(feat)], -1)
        q = a.q_proj(x).view(n, a.heads, a.head_dim)
        k = a.k_proj(x).view(n, a.kv_heads, a.head_dim)
        v = a.v_proj(x).view(n, a.kv_heads, a.head_dim)
        q, k = m.rope(q, k, torch.arange(n))
        rep = a.heads // a.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) * a.head_dim ** -0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v).reshape(n, -1)
        y = feat + a.o_proj(out)
        y = y + m.mlp(m.post_attention_layernorm(y))
        return m.compute_logits(y)


def test_eagle3_is_lossless_and_its_drafts_match_a_dense_reference():
    hf = tiny_model("llama-3-8b")
    module = Eagle3Model(hf.config, [0, 1, 1])
    randomize_(module, 3, scale=0.3)
    drafter = Eagle3Drafter(module.eval())
    ps = prompts(hf.config.vocab_size, (6, 11, 3), seed=41)
    want = [hf_greedy(hf, p, NEW) for p in ps]
    opts = options(spec_tokens=3, enable_prefix_caching=False, max_batched_tokens=10)
    engine = run(hf, ps, opts, new=NEW, engine=SpeculativeEngine(hf, opts, drafter))
    assert [o.token_ids for o in engine.outputs] == want
    assert max_logit_diff(hf, engine) <= 1e-4
    spec = engine.runner.specs["draft.layers.0.self_attn"]
    assert spec.position_offset == 1
    assert engine.stats.verify_passes > 0
    seqs = {o.rid: o.prompt_token_ids + o.token_ids for o in engine.outputs}
    refs = {rid: dense_eagle_logits(hf, module, seq) for rid, seq in seqs.items()}
    assert drafter.first_logits
    for rid, position, row in drafter.first_logits:
        assert float((row - refs[rid][position]).abs().max()) <= 1e-4


def test_eagle3_refuses_mla_targets():
    from mla_models import tiny_deepseek_v3

    with pytest.raises(UnsupportedCapabilityError, match="GQA targets"):
        make_drafter("eagle3", tiny_deepseek_v3(True).config)
