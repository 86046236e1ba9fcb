"""Every catalog model against numbers worked out by hand from its public config.

Each row: layer counts per retention, the indices of full-attention layers, bytes per token
of the target's layers and fixed state bytes per request, with the arithmetic written out.
"""

from __future__ import annotations

from collections import Counter

import pytest

from pagedkv.kvspec import ChunkedLocal, Full, Recurrent, SlidingWindow
from pagedkv.models import (
    catalog_description,
    catalog_names,
    catalog_source,
    layers_from_config,
    load_config,
)

BF16, FP32 = 2, 4

# name -> (retention counts, full-attention layer indices (None: every attention layer),
#          bytes per token, state bytes per request)
EXPECTED = {
    "llama-3-8b": ({Full(): 32}, None, 32 * 2 * 8 * 128 * BF16, 0),
    "llama-3-70b": ({Full(): 80}, None, 80 * 2 * 8 * 128 * BF16, 0),
    "qwen3-8b": ({Full(): 36}, None, 36 * 2 * 8 * 128 * BF16, 0),
    "mistral-7b": ({SlidingWindow(4096): 32}, [], 32 * 2 * 8 * 128 * BF16, 0),
    # Gemma 2: sliding on even layers, full on odd (no layer_types in its config)
    "gemma-2-9b": (
        {SlidingWindow(4096): 21, Full(): 21}, list(range(1, 42, 2)), 42 * 2 * 8 * 256 * BF16, 0
    ),
    # Gemma 3: every 6th layer full (5, 11, ..., 59), the other 52 slide over 1024
    "gemma-3-27b": (
        {SlidingWindow(1024): 52, Full(): 10}, list(range(5, 62, 6)), 62 * 2 * 16 * 128 * BF16, 0
    ),
    "gpt-oss-20b": (
        {SlidingWindow(128): 12, Full(): 12}, list(range(1, 24, 2)), 24 * 2 * 8 * 64 * BF16, 0
    ),
    "gpt-oss-120b": (
        {SlidingWindow(128): 18, Full(): 18}, list(range(1, 36, 2)), 36 * 2 * 8 * 64 * BF16, 0
    ),
    # Llama 4: every 4th layer (3, 7, ...) is global NoPE, the others chunked over 8192
    "llama-4-scout": (
        {ChunkedLocal(8192): 36, Full(): 12}, list(range(3, 48, 4)), 48 * 2 * 8 * 128 * BF16, 0
    ),
    "deepseek-v2-lite": ({Full(): 27}, None, 27 * (512 + 64) * BF16, 0),
    "deepseek-v3": ({Full(): 61}, None, 70272, 0),  # model-facts: 61 x 1152
    # 61 MLA latents + 61 indexer keys (128 fp8 values + one fp32 scale)
    "deepseek-v3.2": ({Full(): 122}, None, 61 * (512 + 64) * BF16 + 61 * (128 + 4), 0),
    "kimi-k2": ({Full(): 61}, None, 61 * (512 + 64) * BF16, 0),
    # 24 MLA layers (1-based 4, 8, ..., 92 and 93) + 69 KDA states:
    # conv (4 - 1) x (3 x 96 x 128) fp32 + recurrent 96 x 128 x 128 fp32
    "kimi-k3": (
        {Full(): 24, Recurrent(): 69},
        [*range(3, 92, 4), 92],
        24 * (512 + 64) * BF16,
        69 * (3 * 3 * 96 * 128 * FP32 + 96 * 128 * 128 * FP32),
    ),
    # 12 full (every 4th) + 36 GatedDeltaNet: conv 3 x (2 x 16 x 128 + 32 x 128) fp32 +
    # recurrent 32 x 128 x 128 fp32
    "qwen3-next-80b": (
        {Full(): 12, Recurrent(): 36},
        list(range(3, 48, 4)),
        12 * 2 * 2 * 256 * BF16,
        36 * (3 * (2 * 16 * 128 + 32 * 128) * FP32 + 32 * 128 * 128 * FP32),
    ),
    # attention at i % 8 == 4; Mamba-1 d_inner = 2 x 4096: conv 3 x 8192, ssm 8192 x 16, bf16
    "jamba-v0.1": (
        {Full(): 4, Recurrent(): 28},
        [4, 12, 20, 28],
        4 * 2 * 8 * 128 * BF16,
        28 * (3 * 8192 * BF16 + 8192 * 16 * BF16),
    ),
    # "*" at 7, 18, 29, 40; Mamba2 conv 3 x (128 x 64 + 2 x 8 x 128) bf16, ssm 128 x 64 x 128
    # fp32: the public config sets no mamba_ssm_cache_dtype, and transformers' NemotronHConfig
    # defaults it to "float32" (which vLLM then uses); "-" MLP layers hold nothing
    "nemotron-h-8b": (
        {Full(): 4, Recurrent(): 24},
        [7, 18, 29, 40],
        4 * 2 * 8 * 128 * BF16,
        24 * (3 * (128 * 64 + 2 * 8 * 128) * BF16 + 128 * 64 * 128 * FP32),
    ),
    # attn_type_list 1 at every 8th layer; lightning state 64 x 128 x 128 fp32
    "minimax-m1": (
        {Full(): 10, Recurrent(): 70},
        list(range(7, 80, 8)),
        10 * 2 * 8 * 128 * BF16,
        70 * 64 * 128 * 128 * FP32,
    ),
    # drafters, read on their own (model="draft")
    "kimi-k3-dspark": ({Full(): 5}, None, 5 * (512 + 64) * BF16, 0),
    "llama-3-8b-eagle3": ({Full(): 1}, None, 1 * 2 * 8 * 128 * 2, 0),  # float16
    "qwen3-8b-dflash": ({Full(): 5}, None, 5 * 2 * 8 * 128 * BF16, 0),
}
DRAFTERS = {"kimi-k3-dspark", "llama-3-8b-eagle3", "qwen3-8b-dflash"}


def test_catalog_has_the_required_models_and_every_entry_is_checked_here():
    required = {
        "llama-3-8b", "llama-3-70b", "mistral-7b", "gemma-3-27b", "gpt-oss-20b", "gpt-oss-120b",
        "llama-4-scout", "deepseek-v2-lite", "deepseek-v3", "deepseek-v3.2", "kimi-k2",
        "kimi-k3", "kimi-k3-dspark", "qwen3-next-80b", "jamba-v0.1", "nemotron-h-8b",
        "minimax-m1",
    }
    names = catalog_names()
    assert required <= set(names)
    assert names == sorted(names) and all(n == n.lower() for n in names)
    assert set(names) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_catalog_model_matches_hand_arithmetic(name):
    retentions, full_indices, per_token, per_request = EXPECTED[name]
    model = "draft" if name in DRAFTERS else "target"
    layers = layers_from_config(load_config(name), model=model)
    assert Counter(layer.retention for layer in layers) == retentions
    assert sum(layer.bytes_per_token for layer in layers) == per_token
    assert sum(layer.bytes_per_request for layer in layers) == per_request
    attention = [layer for layer in layers if layer.retention != Recurrent()]
    full = sorted({layer.index for layer in attention if layer.retention == Full()})
    expected_full = sorted({layer.index for layer in attention}) if full_indices is None else full_indices
    assert full == expected_full
    assert len({layer.name for layer in layers}) == len(layers)
    assert all(layer.model == model for layer in layers)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_catalog_entries_describe_themselves_in_one_line(name):
    description = catalog_description(name)
    assert description and "\n" not in description
    assert catalog_source(name)
    assert "_pagedkv" not in load_config(name)


def test_catalog_lookup_ignores_case_and_returns_fresh_copies():
    a = load_config("Llama-3-8B")
    a["num_hidden_layers"] = 1
    assert load_config("llama-3-8b")["num_hidden_layers"] == 32


def test_estimated_entries_say_so():
    assert "ESTIMATE" in catalog_source("kimi-k3")
    assert "ESTIMATE" in catalog_source("kimi-k3-dspark")
