"""Reading configs by their fields: attention kinds, MLA, recurrent states, dtypes."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.errors import ConfigError, UnsupportedArchitectureError
from pagedkv.kvspec import (
    AttentionKV,
    ChunkedLocal,
    DType,
    Full,
    MLALatent,
    Recurrent,
    RecurrentState,
    SlidingWindow,
)
from pagedkv.models import layers_from_config, load_config

BASE = {
    "hidden_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "torch_dtype": "bfloat16",
}


def _kinds(layers):
    return [layer.retention for layer in layers]


# --- softmax attention ------------------------------------------------------------------

def test_kv_heads_default_to_attention_heads_and_head_dim_to_hidden_over_heads():
    config = {"hidden_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8}
    layout = layers_from_config(config)[0].layout
    assert layout == AttentionKV(8, 1024 // 8, DType.BF16)


def test_explicit_head_dim_beats_hidden_over_heads():
    layout = layers_from_config(dict(BASE, hidden_size=2880, head_dim=64))[0].layout
    assert (layout.num_kv_heads, layout.head_dim) == (2, 64)


def test_head_dim_that_cannot_be_derived():
    config = {"hidden_size": 1000, "num_hidden_layers": 2, "num_attention_heads": 3}
    with pytest.raises(ConfigError, match="not divisible"):
        layers_from_config(config)


def test_layer_types_win_over_other_pattern_fields():
    config = dict(BASE, sliding_window=256, full_attention_interval=2,
                  layer_types=["sliding_attention", "full_attention"] * 3)
    assert _kinds(layers_from_config(config)) == [SlidingWindow(256), Full()] * 3


def test_sliding_layers_need_a_window():
    with pytest.raises(ConfigError, match="sliding_window"):
        layers_from_config(dict(BASE, layer_types=["sliding_attention"] * 6))


def test_sliding_window_pattern_and_gemma2_alternation():
    by_pattern = layers_from_config(dict(BASE, sliding_window=512, sliding_window_pattern=3))
    assert _kinds(by_pattern) == [SlidingWindow(512), SlidingWindow(512), Full()] * 2
    gemma2 = layers_from_config(dict(BASE, model_type="gemma2", sliding_window=4096))
    assert _kinds(gemma2) == [SlidingWindow(4096), Full()] * 3
    mistral = layers_from_config(dict(BASE, sliding_window=4096))
    assert _kinds(mistral) == [SlidingWindow(4096)] * 6


def test_qwen2_sliding_window_switch_and_max_window_layers():
    off = layers_from_config(dict(BASE, sliding_window=4096, use_sliding_window=False))
    assert _kinds(off) == [Full()] * 6
    on = layers_from_config(
        dict(BASE, sliding_window=4096, use_sliding_window=True, max_window_layers=4)
    )
    assert _kinds(on) == [Full()] * 4 + [SlidingWindow(4096)] * 2


def test_attention_mask_follows_retention():
    layers = layers_from_config(
        dict(BASE, layer_types=["sliding_attention", "full_attention"] * 3, sliding_window=128)
    )
    assert layers[0].attention.window == 128 and layers[1].attention.window is None
    assert all(layer.attention.causal for layer in layers)


def test_llama4_chunked_rope_layers_and_global_nope_layers():
    config = dict(BASE, num_hidden_layers=8, attention_chunk_size=1024,
                  no_rope_layers=[1, 1, 1, 0, 1, 1, 1, 0])
    layers = layers_from_config(config)
    assert _kinds(layers) == ([ChunkedLocal(1024)] * 3 + [Full()]) * 2
    assert layers[0].attention.chunk == 1024 and layers[3].attention.chunk is None
    by_interval = layers_from_config(
        dict(BASE, num_hidden_layers=8, attention_chunk_size=1024, no_rope_layer_interval=4)
    )
    assert _kinds(by_interval) == _kinds(layers)


def test_chunking_without_a_rope_pattern_is_refused():
    with pytest.raises(ConfigError, match="no_rope_layers"):
        layers_from_config(dict(BASE, attention_chunk_size=8192))


def test_softcap_scale_and_sinks():
    gemma = load_config("gemma-2-9b")
    attention = layers_from_config(gemma)[0].attention
    assert attention.soft_cap == 50.0
    # query_pre_attn_scalar 256 == head_dim 256: the default scale, left as None
    assert attention.scale is None
    assert not attention.sinks
    gemma3 = layers_from_config(load_config("gemma-3-27b"))[0].attention
    assert gemma3.scale == pytest.approx(168 ** -0.5)  # scalar 168, head_dim 128
    assert all(layer.attention.sinks for layer in layers_from_config(load_config("gpt-oss-20b")))


# --- MLA ----------------------------------------------------------------------------------

MLA = dict(BASE, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


@pytest.mark.parametrize(
    ("kv_dtype", "fmt", "nbytes"),
    [
        ("auto", "bf16", (512 + 64) * 2),
        ("bf16", "bf16", (512 + 64) * 2),
        ("fp16", "fp16", (512 + 64) * 2),
        ("fp8", "fp8", 512 + 64),
        ("fp8_ds_mla", "fp8_ds_mla", 512 + 4 * (512 // 128) + 64 * 2),  # 656
    ],
)
def test_mla_latent_formats(kv_dtype, fmt, nbytes):
    layer = layers_from_config(MLA, kv_dtype=kv_dtype)[0]
    assert layer.layout == MLALatent(512, 64, fmt)
    assert layer.bytes_per_token == nbytes


def test_mla_needs_its_rope_dim():
    config = dict(MLA)
    del config["qk_rope_head_dim"]
    with pytest.raises(ConfigError, match="qk_rope_head_dim"):
        layers_from_config(config)


def test_v32_indexer_is_its_own_layer_spec_per_mla_layer():
    layers = layers_from_config(load_config("deepseek-v3.2"), kv_dtype="fp8_ds_mla")
    indexers = [layer for layer in layers if layer.layout.kind == "indexer"]
    assert len(indexers) == 61
    assert all(layer.bytes_per_token == 128 + 4 for layer in indexers)
    assert indexers[0].name == "model.layers.0.self_attn.indexer" and indexers[0].index == 0
    assert sum(layer.bytes_per_token for layer in layers) == 61 * 656 + 61 * 132


def test_indexer_without_mla_is_refused():
    with pytest.raises(ConfigError, match="index_head_dim"):
        layers_from_config(dict(BASE, index_head_dim=128))


# --- dtypes of GQA caches -----------------------------------------------------------------

@pytest.mark.parametrize(
    ("torch_dtype", "kv_dtype", "itemsize"),
    [("bfloat16", "auto", 2), ("float16", "auto", 2), ("float32", "auto", 2),
     ("bfloat16", "fp8", 1), ("bfloat16", "fp16", 2)],
)
def test_gqa_kv_dtype(torch_dtype, kv_dtype, itemsize):
    layer = layers_from_config(dict(BASE, torch_dtype=torch_dtype), kv_dtype=kv_dtype)[0]
    assert layer.bytes_per_token == 2 * 2 * 64 * itemsize


def test_auto_kv_dtype_follows_float16_config():
    layer = layers_from_config(dict(BASE, torch_dtype="float16"))[0]
    assert layer.layout.dtype is DType.FP16


# --- recurrent states ----------------------------------------------------------------------

def test_kimi_k3_kda_state_matches_the_peer_harness():
    layers = layers_from_config(load_config("kimi-k3"))
    kda = [layer for layer in layers if layer.retention == Recurrent()]
    state = kda[0].layout
    assert isinstance(state, RecurrentState) and state.family == "kda"
    shapes = [(t.shape, t.dtype) for t in state.tensors]
    assert shapes == [((3, 36864), DType.FP32), ((96, 128, 128), DType.FP32)]
    assert kda[0].bytes_per_request == 6_733_824
    assert kda[0].name == "model.layers.0.linear_attn" and kda[0].attention is None


def test_state_shards_split_heads_and_channels():
    state = layers_from_config(load_config("kimi-k3"))[0].layout
    conv, recurrent = state.shard(8).tensors
    assert conv.shape == (3, 36864 // 8) and recurrent.shape == (96 // 8, 128, 128)


def test_mamba_ssm_cache_dtype_overrides_the_ssm_tensor_only():
    jamba = load_config("jamba-v0.1")
    plain = next(ly for ly in layers_from_config(jamba) if ly.retention == Recurrent()).layout
    assert [t.dtype for t in plain.tensors] == [DType.BF16, DType.BF16]
    jamba["mamba_ssm_cache_dtype"] = "float32"
    forced = next(ly for ly in layers_from_config(jamba) if ly.retention == Recurrent()).layout
    assert [t.dtype for t in forced.tensors] == [DType.BF16, DType.FP32]
    assert forced.tensors[1].shape == (2 * 4096, 16)


def test_nemotron_mlp_layers_hold_no_cache():
    layers = layers_from_config(load_config("nemotron-h-8b"))
    assert len(layers) == 28
    assert layers[0].name == "model.layers.0.mamba" and layers[1].index == 2


def test_hybrid_pattern_errors():
    config = dict(BASE, hybrid_override_pattern="M-*X-M", mamba_num_heads=8,
                  mamba_head_dim=16, ssm_state_size=16, n_groups=1, conv_kernel=4)
    with pytest.raises(UnsupportedArchitectureError, match="'X'"):
        layers_from_config(config)
    with pytest.raises(ConfigError, match="4 layers but num_hidden_layers is 6"):
        layers_from_config(dict(config, hybrid_override_pattern="M-*-"))


def test_kda_partition_must_cover_every_layer():
    config = load_config("kimi-k3")
    config["text_config"]["linear_attn_config"]["kda_layers"].pop()
    with pytest.raises(ConfigError, match="every layer"):
        layers_from_config(config)


def test_kda_needs_its_head_geometry():
    config = load_config("kimi-k3")
    del config["text_config"]["linear_attn_config"]["num_heads"]
    with pytest.raises(ConfigError, match="num_heads"):
        layers_from_config(config)


def test_recurrent_layers_without_mixer_fields_are_refused():
    config = dict(BASE, layer_types=["linear_attention", "full_attention"] * 3)
    with pytest.raises(UnsupportedArchitectureError, match="which mixer"):
        layers_from_config(config)


def test_recurrent_layers_with_two_mixers_are_ambiguous():
    config = dict(BASE, full_attention_interval=2, linear_num_value_heads=4,
                  linear_attn_config={"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4,
                                      "full_attn_layers": [2, 4, 6], "kda_layers": [1, 3, 5]})
    with pytest.raises(UnsupportedArchitectureError, match="several"):
        layers_from_config(config)


def test_unread_hybrid_fields_are_never_read_as_full_attention():
    with pytest.raises(UnsupportedArchitectureError, match="mamba_d_state"):
        layers_from_config(dict(BASE, mamba_d_state=16))


def test_jamba_offset_must_be_inside_its_period():
    with pytest.raises(ConfigError, match="attn_layer_offset"):
        layers_from_config(dict(BASE, attn_layer_period=4, attn_layer_offset=4))


def test_minimax_attn_type_list_values():
    with pytest.raises(UnsupportedArchitectureError, match="attn_type_list"):
        layers_from_config(dict(BASE, attn_type_list=[0, 1, 2, 0, 1, 0]))


# --- properties ----------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(
    types=st.lists(st.sampled_from(["full_attention", "sliding_attention"]), min_size=1,
                   max_size=40),
    kv=st.sampled_from([1, 2, 4, 8]),
    head=st.sampled_from([64, 80, 128, 256]),
    window=st.integers(1, 8192),
    dtype=st.sampled_from([("bfloat16", 2), ("float16", 2)]),
)
def test_gqa_bytes_and_kinds_follow_layer_types(types, kv, head, window, dtype):
    config = {
        "num_hidden_layers": len(types), "num_attention_heads": 4 * kv,
        "num_key_value_heads": kv, "head_dim": head, "sliding_window": window,
        "layer_types": types, "torch_dtype": dtype[0],
    }
    layers = layers_from_config(config)
    assert [layer.index for layer in layers] == list(range(len(types)))
    assert sum(layer.bytes_per_token for layer in layers) == len(types) * 2 * kv * head * dtype[1]
    assert Counter(type(layer.retention) for layer in layers) == Counter(
        SlidingWindow if t == "sliding_attention" else Full for t in types
    )


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 64), data=st.data())
def test_kda_partition_gives_mla_and_state_layers_where_listed(n, data):
    full = sorted(data.draw(st.sets(st.integers(1, n))))
    kda = [i for i in range(1, n + 1) if i not in full]
    config = dict(MLA, num_hidden_layers=n, linear_attn_config={
        "full_attn_layers": full, "kda_layers": kda, "num_heads": 4, "head_dim": 32,
        "short_conv_kernel_size": 4})
    layers = layers_from_config(config)
    assert [ly.index + 1 for ly in layers if ly.retention == Full()] == full
    assert [ly.index + 1 for ly in layers if ly.retention == Recurrent()] == kda
    per_state = 3 * 3 * 4 * 32 * 4 + 4 * 32 * 32 * 4
    assert sum(ly.bytes_per_request for ly in layers) == len(kda) * per_state


@settings(max_examples=60, deadline=None)
@given(pattern=st.text(alphabet="M*-E", min_size=1, max_size=60))
def test_hybrid_override_pattern_counts(pattern):
    config = {"num_hidden_layers": len(pattern), "hybrid_override_pattern": pattern,
              "num_attention_heads": 4, "head_dim": 32, "mamba_num_heads": 8,
              "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4}
    layers = layers_from_config(config)
    assert sum(ly.retention == Full() for ly in layers) == pattern.count("*")
    assert sum(ly.retention == Recurrent() for ly in layers) == pattern.count("M")
    assert [ly.index for ly in layers] == [i for i, c in enumerate(pattern) if c in "M*"]
