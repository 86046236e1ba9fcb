"""DSpark drafting over the target's MLA block table (DeepSeek-V3 and Kimi-Linear
targets): one block-table group holds the target's and the drafter's MLA layers; greedy
output with DSpark drafts equals plain greedy output; every kept target logit row equals
transformers'; every drafted block's logits equal a dense float64 reference (context K/V
from transformers' hidden states, decompressed keys and values, the block sees the context
before its anchor and all of itself); bad input is refused before any step."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_check import hf_greedy, max_logit_diff, options, prompts, run  # noqa: E402
from mla_models import layer_outputs, random_dspark, tiny_deepseek_v3, tiny_kimi_linear  # noqa: E402

from pagedkv.engine.speculative import DSparkDrafter, SpeculativeEngine  # noqa: E402
from pagedkv.errors import IncompatibleLayersError, InvalidArgumentError  # noqa: E402

NEW = 8
OPTS = dict(enable_prefix_caching=False, max_batched_tokens=12)


def dense_block_logits(hf, drafter, seq, c):
    """float64: block [seq[c], mask x (B-1)] at c.. over context K/V of positions < c."""
    m = drafter.double()
    b = m.block_size
    feats = layer_outputs(hf, seq, m.target_layer_ids)[:c].double()
    with torch.no_grad():
        f = m.hidden_norm(m.fc(feats))
        x = torch.cat([m.embed_tokens(torch.tensor([seq[c]])), m.mask_embedding.expand(b - 1, -1)])
        pos_c, pos_b = torch.arange(c), torch.arange(c, c + b)
        for layer in m.layers:
            a = layer.self_attn
            xn = layer.input_layernorm(x)
            q_nope, q_rope = a.queries(xn)
            q = torch.cat([q_nope, m.rope(q_rope, pos_b)], -1)
            lat_c, kr_c = a.latents(f)
            lat_b, kr_b = a.latents(xn)
            latent = torch.cat([lat_c, lat_b])
            k_rope = torch.cat([m.rope(kr_c[:, None], pos_c), m.rope(kr_b[:, None], pos_b)])
            kv = a.kv_b_proj(latent).view(-1, a.heads, a.nope + a.v_dim)
            k = torch.cat([kv[..., : a.nope], k_rope.expand(-1, a.heads, -1)], -1)
            v = kv[..., a.nope :]
            w = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * a.scale, -1)
            out = torch.einsum("hqk,khd->qhd", w, v).reshape(b, -1)
            x = x + a.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        out = m.lm_head(m.norm(x))[1:].float()
    m.float()
    return out


@pytest.mark.parametrize("target", ["deepseek-v3", "kimi-linear"])
def test_dspark_is_lossless_and_its_blocks_match_a_dense_reference(target):
    hf = tiny_deepseek_v3(True) if target == "deepseek-v3" else tiny_kimi_linear(seed=4)
    module = random_dspark(hf.config)
    drafter = DSparkDrafter(module)
    ps = prompts(hf.config.vocab_size, (6, 11, 3), seed=31)
    want = [hf_greedy(hf, p, NEW) for p in ps]
    opts = options(spec_tokens=3, **OPTS)
    engine = run(hf, ps, opts, new=NEW, engine=SpeculativeEngine(hf, opts, drafter))
    assert [o.token_ids for o in engine.outputs] == want
    assert max_logit_diff(hf, engine) <= 1e-4
    # one block-table group holds the target's MLA layers and the drafter's
    mla = [s.name for s in engine.specs if s.layout.kind == "mla_latent"]
    assert any(n.startswith("draft.") for n in mla) and any(n.startswith("model.") for n in mla)
    assert len({engine.runner.layer_group[n] for n in mla}) == 1
    assert engine.stats.verify_passes > 0 and len(drafter.block_log) >= engine.stats.verify_passes
    seqs = {o.rid: o.prompt_token_ids + o.token_ids for o in engine.outputs}
    for rid, c, logits in drafter.block_log[:6]:
        ref = dense_block_logits(hf, module, seqs[rid], c)
        assert float((logits - ref).abs().max()) <= 1e-4


def test_bad_dspark_input_is_refused_before_any_step():
    hf = tiny_deepseek_v3(True)
    with pytest.raises(InvalidArgumentError, match="exceeds what a DSpark block of 4"):
        SpeculativeEngine(hf, options(spec_tokens=4, **OPTS), DSparkDrafter(random_dspark(hf.config)))
    wrong = random_dspark(hf.config, kv_lora_rank=16)
    with pytest.raises(IncompatibleLayersError, match="latent layouts must match"):
        SpeculativeEngine(hf, options(spec_tokens=3, **OPTS), DSparkDrafter(wrong))
