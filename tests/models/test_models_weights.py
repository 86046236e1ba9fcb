"""Weight estimates against published parameter counts and hand arithmetic."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.models import estimate_parameters, estimate_weight_bytes, load_config

# Published totals (model cards / papers). Multimodal entries count the text model only.
PUBLISHED = {
    "llama-3-8b": 8.03e9,
    "llama-3-70b": 70.6e9,
    "mistral-7b": 7.24e9,
    "deepseek-v3": 671e9,
    "gpt-oss-120b": 116.8e9,
    "gpt-oss-20b": 20.9e9,
    "deepseek-v2-lite": 15.7e9,
    "gemma-2-9b": 9.24e9,
    "jamba-v0.1": 51.6e9,
    "minimax-m1": 456e9,
    "qwen3-next-80b": 80e9,
    "kimi-k2": 1.04e12,  # K2 technical report
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_within_a_few_percent_of_published(name):
    estimate = estimate_parameters(load_config(name))
    assert estimate == pytest.approx(PUBLISHED[name], rel=0.03)


def test_llama3_8b_bytes_by_hand():
    h, kv, inter, vocab, layers = 4096, 8 * 128, 14336, 128256, 32
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * inter
    params = 2 * vocab * h + layers * per_layer
    assert estimate_parameters(load_config("llama-3-8b")) == params
    assert estimate_weight_bytes(load_config("llama-3-8b")) == 2 * params


def test_fp8_checkpoint_counts_one_byte_per_linear_weight():
    embeddings = 2 * 129280 * 7168  # bf16 embedding + LM head
    expected = (671e9 - embeddings) * 1 + embeddings * 2
    assert estimate_weight_bytes(load_config("deepseek-v3")) == pytest.approx(expected, rel=0.03)


def test_mxfp4_experts_take_4_25_bits():
    experts = 36 * 128 * 3 * 2880 * 2880
    expected = experts * 4.25 / 8 + (116.8e9 - experts) * 2
    assert estimate_weight_bytes(load_config("gpt-oss-120b")) == pytest.approx(expected, rel=0.03)


def test_int_quantization_and_unknown_methods():
    base = load_config("llama-3-8b")
    bf16 = estimate_weight_bytes(base)
    int4 = dict(base, quantization_config={
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": {"weights": {"num_bits": 4}}}})
    embeddings = 2 * 128256 * 4096
    assert estimate_weight_bytes(int4) == pytest.approx(
        embeddings * 2 + (bf16 / 2 - embeddings) * 0.5, rel=1e-6)
    odd = dict(base, quantization_config={"quant_method": "mystery"})
    with pytest.warns(UserWarning, match="mystery"):
        assert estimate_weight_bytes(odd) == bf16


def test_plain_config_estimates_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        estimate_weight_bytes(load_config("kimi-k3"))


@settings(max_examples=80, deadline=None)
@given(
    layers=st.integers(1, 48),
    heads=st.sampled_from([4, 8, 16, 32]),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([32, 64, 128]),
    hidden=st.sampled_from([256, 1024, 4096]),
    inter=st.integers(1, 20000),
    vocab=st.integers(1, 300000),
    tied=st.booleans(),
)
def test_dense_parameter_count_matches_a_reference_formula(
    layers, heads, group, head_dim, hidden, inter, vocab, tied
):
    config = {
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": heads // group, "head_dim": head_dim, "hidden_size": hidden,
        "intermediate_size": inter, "vocab_size": vocab, "tie_word_embeddings": tied,
        "torch_dtype": "float16",
    }
    q, kv = heads * head_dim, heads // group * head_dim
    reference = layers * (2 * hidden * q + 2 * hidden * kv + 3 * hidden * inter)
    reference += vocab * hidden * (1 if tied else 2)
    assert estimate_parameters(config) == reference
    assert estimate_weight_bytes(config) == 2 * reference


# Published totals of real configs (from their names / model cards), text model only.
PUBLISHED_FILES = {
    "nvidia--NVIDIA-Nemotron-3-Super-120B-A12B-FP8.json": 120e9,  # latent MoE (moe_latent_size)
    "nvidia--Llama-3_3-Nemotron-Super-49B-v1.json": 49.9e9,  # NAS blocks, per-block ffn_mult
    "meta-llama--Llama-4-Maverick-17B-128E-Instruct.json": 400e9,
    "XiaomiMiMo--MiMo-V2-Flash.json": 309e9,  # per-layer MoE flags, K 192 / V 128
    "zai-org--GLM-5.json": 744e9,
    "mistralai--Mixtral-8x22B-v0.1.json": 141e9,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_FILES))
def test_published_config_parameter_count(name):
    path = Path(__file__).parent / "fixtures" / "published" / name
    estimate = estimate_parameters(load_config(str(path)))
    assert estimate == pytest.approx(PUBLISHED_FILES[name], rel=0.03)
