"""gpt-oss over pagedkv (alternating window/full layers, attention sinks, YaRN RoPE, top-k
MoE over a plain expert loop) gives transformers' logits and greedy tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import engine_check as ec  # noqa: E402


def tiny():
    import torch

    cfg = transformers.GptOssConfig(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=64,
        sliding_window=5, num_local_experts=4, num_experts_per_tok=2,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 16, "rope_theta": 1000.0})
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).eval()
    ec.randomize_(model, 3)
    return model


def test_windows_alternate_and_layers_have_sinks():
    from pagedkv.models import layers_from_config

    specs = layers_from_config(tiny().config.to_dict())
    assert [(s.attention.window, s.attention.sinks) for s in specs] == [(5, True), (None, True)]


def test_logits_through_chunks_and_preemption():
    hf = tiny()
    assert ec.preempted_logit_diff(hf, ec.budget_for(hf, 28)) <= ec.TOL


def test_logits_with_prefix_hits():
    hits, diff = ec.prefix_hits_and_logit_diff(tiny(), turn=False)
    assert hits == [8]
    assert diff <= ec.TOL


def test_greedy_tokens_equal_transformers_generate():
    ours, theirs = ec.greedy_tokens(tiny(), (5, 11, 3))
    assert ours == theirs


def test_mxfp4_experts_dequantize_on_load():
    import torch

    from pagedkv.errors import WeightError
    from pagedkv.modeling.gpt_oss import GptOssForCausalLM

    hf = tiny()
    cfg = hf.config
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator().manual_seed(0)
    state = {k: v for k, v in hf.state_dict().items() if not k.endswith("experts.gate_up_proj")}
    blocks = torch.randint(0, 256, (e, 2 * i, h // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 130, (e, 2 * i, h // 32), generator=g, dtype=torch.uint8)
    for layer in range(cfg.num_hidden_layers):
        state[f"model.layers.{layer}.mlp.experts.gate_up_proj_blocks"] = blocks
        state[f"model.layers.{layer}.mlp.experts.gate_up_proj_scales"] = scales
    model = GptOssForCausalLM(cfg)
    model.load_weights(state.items())
    w = model.model.layers[1].mlp.experts.gate_up_proj  # [E, H, 2I]
    fp4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    for ex, row, col in [(0, 0, 0), (3, 5, 33), (2, 63, 17)]:  # row: output unit, col: input
        byte = int(blocks[ex, row, col // 32, (col % 32) // 2])
        nibble = byte & 0x0F if col % 2 == 0 else byte >> 4
        want = fp4[nibble] * 2.0 ** (int(scales[ex, row, col // 32]) - 127)
        assert float(w[ex, col, row].detach()) == want
    del state["model.layers.0.mlp.experts.gate_up_proj_scales"]
    with pytest.raises(WeightError, match="without their pair"):
        GptOssForCausalLM(cfg).load_weights(state.items())
