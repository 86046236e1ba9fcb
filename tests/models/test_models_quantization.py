"""Bytes per parameter by part, as quantization_config stores the weights (hand arithmetic)."""

from __future__ import annotations

import json
from pathlib import Path

from pagedkv.models import estimate_weight_bytes, load_config, parameter_counts
from pagedkv.models.quantization import bytes_per_parameter

BF16 = {"torch_dtype": "bfloat16"}
PUBLISHED = Path(__file__).parent / "fixtures" / "published"


def _table(quant):
    return bytes_per_parameter(dict(BF16, quantization_config=quant))


def test_fp8_with_128x128_block_scales():
    table = _table({"quant_method": "fp8", "weight_block_size": [128, 128]})
    per = 1 + 4 / (128 * 128)  # one fp8 byte + one fp32 scale per 16384 weights
    assert (table["mixer"], table["dense"], table["experts"]) == (per, per, per)
    assert table["embedding"] == 2.0


def test_mxfp4_takes_4_25_bits_and_skips_excluded_modules():
    gpt_oss = {"quant_method": "mxfp4",
               "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                          "model.embed_tokens", "lm_head"]}
    table = _table(gpt_oss)
    assert table["experts"] == 0.5 + 1 / 32 == 4.25 / 8
    assert table["mixer"] == 2.0 and table["dense"] == 0.5 + 1 / 32


def test_compressed_tensors_mxfp4_with_regex_ignores():
    quant = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
             "config_groups": {"g": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "float", "group_size": 32}}},
             "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
                        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*"]}
    table = _table(quant)
    assert table == {"embedding": 2.0, "mixer": 2.0, "dense": 2.0, "experts": 4.25 / 8,
                     "other": 2.0}


def test_nvfp4_int4_gptq_and_awq():
    nvfp4 = _table({"quant_method": "modelopt", "quant_algo": "NVFP4"})
    assert nvfp4["dense"] == 0.5 + 1 / 16  # fp8 scale per 16
    gptq = _table({"quant_method": "gptq", "bits": 4, "group_size": 128})
    assert gptq["mixer"] == 0.5 + 2 / 128 + 0.5 / 128  # fp16 scale + 4-bit zero per group
    awq = _table({"quant_method": "awq", "bits": 4, "group_size": 64,
                  "modules_to_not_convert": ["self_attn"]})
    assert awq["dense"] == 0.5 + 2 / 64 + 0.5 / 64 and awq["mixer"] == 2.0
    ct_int4 = _table({"quant_method": "compressed-tensors", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "group_size": 128,
                                           "symmetric": True}}}})
    assert ct_int4["experts"] == 0.5 + 2 / 128


def test_kimi_k3_published_mxfp4_weights():
    """Worked out by hand from text_config: compressed-tensors mxfp4 (4 bits + a one-byte
    scale per 32 = 4.25 bits) on every Linear except what ``ignore`` keeps in bf16 (self_attn,
    shared_experts, mlp.{gate,up,down}_proj, lm_head); the MoE router is not a Linear."""
    config = json.loads((PUBLISHED / "moonshotai--Kimi-K3.json").read_text())
    h, vocab = 7168, 163840  # hidden_size, vocab_size; tie_word_embeddings false
    # bf16 parts, parameters:
    embeddings = 2 * vocab * h  # embed_tokens + lm_head = 2348810240
    # MLA (24 full_attn_layers): 96 heads, q_lora_rank 1536, qk_nope 128 + qk_rope 64,
    # kv_lora_rank 512, v_head_dim 128, mla_use_output_gate:
    # q_a h x 1536 + q_b 1536 x 96 x 192 + kv_a h x (512 + 64) + kv_b 512 x 96 x (128 + 128)
    # + o 96 x 128 x h + gate h x 96 x 128 = 232194048
    mla = (h * 1536 + 1536 * 96 * 192 + h * 576 + 512 * 96 * 256 + 96 * 128 * h
           + h * 96 * 128)
    # KDA (69 kda_layers): 96 heads x head_dim 128 = 12288, short_conv_kernel_size 4:
    # q, k, v, o 4 x h x 12288 + low-rank forget and output gates 2 x (h x 128 + 128 x 12288)
    # + beta h x 96 + q/k/v short convs 3 x 12288 x 4 = 358137856
    kda = 4 * h * 12288 + 2 * (h * 128 + 128 * 12288) + h * 96 + 3 * 12288 * 4
    # first_k_dense_replace 1: layer 0 is a dense gated MLP of intermediate_size 33792
    dense = 3 * h * 33792  # = 726663168
    # the other 92 layers (moe_layer_freq 1) are MoE: router h x 896 experts, latent
    # projections in and out h x routed_expert_hidden_size 3584, 2 shared experts of
    # moe_intermediate_size 3072 at width h: h x 896 + 2 x h x 3584 + 2 x 3 x h x 3072
    moe_bf16 = h * 896 + 2 * h * 3584 + 2 * 3 * h * 3072  # = 189923328
    bf16_params = embeddings + 24 * mla + 69 * kda + dense + 92 * moe_bf16  # = 50832588800
    # mxfp4 part: 92 layers x 896 routed experts x 3 matrices x 3584 x 3072 = 2722740830208
    expert_params = 92 * 896 * 3 * 3584 * 3072
    # bytes: experts x 4.25 / 8 (= 1446456066048) + bf16 x 2 (= 101665177600)
    expected = expert_params * 17 // 32 + bf16_params * 2
    assert expert_params * 17 % 32 == 0 and expected == 1_548_121_243_648
    assert estimate_weight_bytes(config) == expected  # about 1.55 TB, not 2.78 TB at 1 B/param
    assert parameter_counts(config)["experts"] == expert_params
    # the bundled catalog entry is read from the same published fields
    assert estimate_weight_bytes(load_config("kimi-k3")) == expected


def test_devstral_2_published_per_tensor_fp8_weights():
    """fp8 with weight_block_size null (one scale per tensor, negligible): 1 B per parameter
    of every linear layer; embed_tokens and lm_head (modules_to_not_convert) stay bf16."""
    config = json.loads((PUBLISHED / "mistralai--Devstral-2-123B-Instruct.json").read_text())
    h, layers = 12288, 88  # hidden_size, num_hidden_layers
    # attention: 96 heads x head_dim 128 = 12288 for q and o, 8 KV heads x 128 = 1024 for k, v:
    # 2 x h x 12288 + 2 x h x 1024 = 327155712 per layer
    attention = 2 * h * 12288 + 2 * h * 1024
    mlp = 3 * h * 28672  # gated MLP of intermediate_size 28672 = 1056964608 per layer
    embeddings = 2 * 131072 * h  # vocab_size 131072, untied: 3221225472
    expected = layers * (attention + mlp) * 1 + embeddings * 2
    assert expected == 128_245_039_104
    assert estimate_weight_bytes(config) == expected
