"""Tiny random fp32 MLA targets (DeepSeek-V3, Kimi-Linear) shared by the modeling and the
engine tests: every weight perturbed, expert correction biases that change routing."""

from __future__ import annotations

import torch
import transformers
from engine_check import randomize_

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}
# DeepSeek-V2 and V3 alike: one dense layer then MoE with group-limited routing, MLA
DEEPSEEK = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
    n_shared_experts=1, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
    first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
    v_head_dim=12, max_position_embeddings=64,
    eos_token_id=None,  # generate(min_new_tokens=...) would suppress it: plain argmax
)


def tiny_deepseek_v3(q_lora: bool, *, yarn: bool = True, interleave: bool = True, seed: int = 0):
    cfg = transformers.DeepseekV3Config(
        **DEEPSEEK, routed_scaling_factor=2.5, norm_topk_prob=True,
        q_lora_rank=24 if q_lora else None, rope_interleave=interleave,
        num_nextn_predict_layers=0,
        rope_parameters=dict(YARN) if yarn else {"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    randomize_(model, seed + 1)
    with torch.no_grad():  # a correction bias that changes which experts win
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.2)
    return model


def tiny_kimi_linear(seed: int = 0, q_lora: int | None = None):
    cfg = transformers.KimiLinearConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        num_experts=8, num_experts_per_token=2, num_shared_experts=1, num_expert_group=2,
        topk_group=1, routed_scaling_factor=2.0, q_lora_rank=q_lora, kv_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
        linear_attn_config={"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
                            "full_attn_layers": [2], "kda_layers": [1, 3]},
        pad_token_id=0, bos_token_id=1, eos_token_id=None,  # generate: no EOS suppression
    )
    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(cfg).eval()
    randomize_(model, seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.2)
    return model


def random_mtp(config, seed: int = 5):
    """The MTP depth of a DeepSeek-V3 config with random weights (transformers has none)."""
    from pagedkv.modeling.drafters.mtp import DeepseekMTP

    torch.manual_seed(seed)
    mtp = DeepseekMTP(config)
    randomize_(mtp, seed, scale=0.3)
    return mtp.eval()


def random_dspark(target_config, *, block_size: int = 4, layers=(0, 1), seed: int = 6, **over):
    """A DSpark drafter with the target's MLA geometry and random weights."""
    from pagedkv.modeling.drafters.dspark import DSparkConfig, DSparkModel

    cfg = DSparkConfig.for_target(target_config, num_hidden_layers=2, block_size=block_size,
                                  target_layer_ids=list(layers), markov_rank=8, **over)
    torch.manual_seed(seed)
    model = DSparkModel(cfg)
    randomize_(model, seed, scale=0.3)
    return model.eval()


def layer_outputs(hf, seq, ids):
    """Outputs of the target's decoder layers ``ids`` over ``seq`` (forward hooks)."""
    kept = {}
    hooks = [hf.model.layers[i].register_forward_hook(
        lambda mod, args, out, i=i: kept.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in ids]
    try:
        with torch.no_grad():
            hf(torch.tensor([seq]))
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([kept[i][0] for i in ids], dim=-1)


def tiny_deepseek_v2(q_lora: bool, topk_method: str = "group_limited_greedy", seed: int = 0):
    """DeepSeek-V2: softmax router (greedy or group-limited), rope on interleaved pairs."""
    cfg = transformers.DeepseekV2Config(
        **DEEPSEEK, routed_scaling_factor=1.5, topk_method=topk_method,
        q_lora_rank=24 if q_lora else None, rope_parameters=dict(YARN),
    )
    torch.manual_seed(seed)
    model = transformers.DeepseekV2ForCausalLM(cfg).eval()
    randomize_(model, seed + 1)
    return model
