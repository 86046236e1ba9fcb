"""Bytes per parameter by part, as quantization_config stores the weights (hand arithmetic)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
    config = json.loads((PUBLISHED / "moonshotai--Kimi-K3.json").read_text())
    counts = parameter_counts(config)
    # routed experts at 4.25 bits; attention, shared experts, dense MLP and embeddings bf16
    expected = counts["experts"] * 4.25 / 8 + (sum(counts.values()) - counts["experts"]) * 2
    assert estimate_weight_bytes(config) == pytest.approx(expected, rel=1e-9)
    # 93 layers, 92 of them MoE: 896 experts x 3 x 3584 x 3072 each
    assert counts["experts"] == 92 * 896 * 3 * 3584 * 3072
    assert 1.4e12 < estimate_weight_bytes(config) < 1.6e12  # not the 2.78 TB of 1 B/param
    assert estimate_weight_bytes(load_config("kimi-k3")) == estimate_weight_bytes(config)
