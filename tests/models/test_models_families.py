"""Family defaults and per-layer fields, read as transformers reads them; fields pagedkv
does not model are refused by name. Expected values are worked out by hand below."""

from __future__ import annotations

from collections import Counter

import pytest

from pagedkv.errors import ConfigError, UnsupportedArchitectureError
from pagedkv.kvspec import AttentionKV, ChunkedLocal, DType, Full, SlidingWindow
from pagedkv.models import layers_from_config
from pagedkv.models.geometry import unread_geometry_keys

BASE = {"hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 64, "torch_dtype": "bfloat16"}


def _shape(layers):
    """(retention, layout) per cached layer, in order."""
    return [(ly.retention, ly.layout) for ly in layers]


def _kv(heads, dim, v_dim=None, dtype=DType.BF16):
    return AttentionKV(heads, dim, dtype, v_dim)


def test_gemma3_text_without_pattern_fields_is_five_local_to_one_global():
    config = dict(BASE, model_type="gemma3_text", num_hidden_layers=12, sliding_window=1024)
    kinds = [ly.retention for ly in layers_from_config(config)]
    assert kinds == ([SlidingWindow(1024)] * 5 + [Full()]) * 2


def test_gemma4_global_layers_use_global_dims_when_k_eq_v():
    config = dict(BASE, model_type="gemma4_text", num_hidden_layers=6, sliding_window=512,
                  head_dim=256, num_key_value_heads=8, global_head_dim=512,
                  num_global_key_value_heads=2, attention_k_eq_v=True)
    assert _shape(layers_from_config(config)) == (
        [(SlidingWindow(512), _kv(8, 256))] * 5 + [(Full(), _kv(2, 512))]
    )
    # without attention_k_eq_v transformers keeps num_key_value_heads on global layers
    plain = dict(config, attention_k_eq_v=False)
    assert _shape(layers_from_config(plain))[-1] == (Full(), _kv(8, 512))
    # no global_head_dim: Gemma4TextConfig's default 512
    default = {k: v for k, v in plain.items() if k != "global_head_dim"}
    assert _shape(layers_from_config(default))[-1] == (Full(), _kv(8, 512))


def test_gemma4_last_layer_is_full_and_shared_kv_layers_cache_nothing():
    types = ["sliding_attention"] * 8
    config = dict(BASE, model_type="gemma4_text", num_hidden_layers=8, sliding_window=512,
                  layer_types=types, num_kv_shared_layers=3)
    layers = layers_from_config(config)
    assert [ly.index for ly in layers] == [0, 1, 2, 3, 4]  # 5, 6, 7 reuse earlier K/V
    forced = dict(config, num_kv_shared_layers=0)
    assert layers_from_config(forced)[-1].retention == Full()


def test_gemma4_transformers_per_layer_config_form_reads_the_same():
    config = dict(BASE, model_type="gemma4_text", num_hidden_layers=6, sliding_window=512,
                  per_layer_config={"05": {"head_dim": 512, "num_key_value_heads": 2}})
    assert _shape(layers_from_config(config))[-1] == (Full(), _kv(2, 512))


@pytest.mark.parametrize("no_rope", [None, []])
def test_llama4_without_no_rope_layers_uses_interval_4(no_rope):
    config = dict(BASE, model_type="llama4_text", num_hidden_layers=8,
                  attention_chunk_size=8192, no_rope_layers=no_rope)
    kinds = [ly.retention for ly in layers_from_config(config)]
    assert kinds == ([ChunkedLocal(8192)] * 3 + [Full()]) * 2


def test_chunking_outside_llama4_still_needs_the_pattern():
    config = dict(BASE, num_hidden_layers=4, attention_chunk_size=8192)
    with pytest.raises(ConfigError, match="no_rope_layers"):
        layers_from_config(config)


def _nas_block(no_op=False, group=8, window=None):
    return {"attention": {"no_op": no_op, "n_heads_in_group": None if no_op else group,
                          "window_length": window, "replace_with_linear": False},
            "ffn": {"ffn_mult": 2.625, "no_op": False}}


def test_nemotron_nas_blocks_no_op_and_heads_per_group():
    config = dict(BASE, model_type="nemotron-nas", num_hidden_layers=4, num_attention_heads=64,
                  head_dim=None, hidden_size=8192, num_key_value_heads=None,
                  block_configs=[_nas_block(), _nas_block(no_op=True), _nas_block(group=4),
                                 _nas_block(no_op=True)])
    layers = layers_from_config(config)
    # 64 heads / 8 = 8 KV heads, 64 / 4 = 16; head_dim 8192 / 64 = 128
    assert [(ly.index, ly.layout) for ly in layers] == [(0, _kv(8, 128)), (2, _kv(16, 128))]


def test_nemotron_nas_window_blocks_are_refused_by_name():
    config = dict(BASE, num_hidden_layers=1, block_configs=[_nas_block(window=4096)])
    with pytest.raises(UnsupportedArchitectureError, match="window_length"):
        layers_from_config(config)


def test_mimo_v2_hybrid_pattern_swa_heads_and_unequal_kv_dims():
    config = dict(BASE, model_type="mimo_v2_flash", num_hidden_layers=6, head_dim=192,
                  v_head_dim=128, num_key_value_heads=4, sliding_window=128,
                  sliding_window_size=128, attention_chunk_size=128,
                  hybrid_layer_pattern=[0, 1, 1, 1, 1, 0], swa_num_key_value_heads=8,
                  swa_head_dim=192, swa_v_head_dim=128, add_swa_attention_sink_bias=True)
    layers = layers_from_config(config)
    assert _shape(layers) == (
        [(Full(), _kv(4, 192, 128))] + [(SlidingWindow(129), _kv(8, 192, 128))] * 4
        + [(Full(), _kv(4, 192, 128))]
    )
    # K 192 + V 128 values per head: 8 x 320 x 2 B and 4 x 320 x 2 B
    assert [ly.bytes_per_token for ly in layers[:2]] == [4 * 320 * 2, 8 * 320 * 2]
    assert layers[1].attention.sinks and not layers[0].attention.sinks


def test_falcon_mamba_is_recurrent_throughout():
    config = {"model_type": "falcon_mamba", "num_hidden_layers": 3, "hidden_size": 4096,
              "intermediate_size": 8192, "state_size": 16, "conv_kernel": 4, "expand": 2,
              "torch_dtype": "bfloat16"}
    layers = layers_from_config(config)
    assert len(layers) == 3 and all(ly.retention.kind == "recurrent" for ly in layers)
    # conv [3, 8192] bf16 + ssm [8192, 16] bf16
    assert layers[0].bytes_per_request == 3 * 8192 * 2 + 8192 * 16 * 2


def test_mamba2_is_recurrent_throughout():
    config = {"model_type": "mamba2", "num_hidden_layers": 2, "hidden_size": 2048,
              "num_heads": 64, "head_dim": 64, "state_size": 128, "n_groups": 8,
              "conv_kernel": 4, "torch_dtype": "bfloat16"}
    layers = layers_from_config(config)
    # conv [3, 64*64 + 2*8*128] bf16 + ssm [64, 64, 128] bf16
    assert [ly.bytes_per_request for ly in layers] == [3 * 6144 * 2 + 64 * 64 * 128 * 2] * 2


def test_nemotron_h_ssm_state_defaults_to_fp32_like_its_config_class():
    config = {"model_type": "nemotron_h", "num_hidden_layers": 2, "hidden_size": 1024,
              "hybrid_override_pattern": "M*", "num_attention_heads": 8,
              "num_key_value_heads": 2, "head_dim": 64, "mamba_num_heads": 16,
              "mamba_head_dim": 64, "ssm_state_size": 32, "n_groups": 2, "conv_kernel": 4,
              "torch_dtype": "bfloat16"}
    mamba = layers_from_config(config)[0]
    assert mamba.bytes_per_request == 3 * (1024 + 2 * 2 * 32) * 2 + 16 * 64 * 32 * 4
    bf16 = layers_from_config(dict(config, mamba_ssm_cache_dtype="bfloat16"))[0]
    assert bf16.bytes_per_request == 3 * (1024 + 2 * 2 * 32) * 2 + 16 * 64 * 32 * 2


def test_checkpoint_fp8_kv_scheme_sets_the_auto_kv_dtype():
    quant = {"quant_method": "compressed-tensors",
             "kv_cache_scheme": {"num_bits": 8, "type": "float"}}
    config = dict(BASE, num_hidden_layers=1, quantization_config=quant)
    assert layers_from_config(config)[0].layout == _kv(4, 64, dtype=DType.FP8)
    assert layers_from_config(config, kv_dtype="bf16")[0].layout == _kv(4, 64)
    int8 = dict(config, quantization_config=dict(quant, kv_cache_scheme={"num_bits": 8,
                                                                         "type": "int"}))
    with pytest.raises(ConfigError, match="kv_cache_scheme"):
        layers_from_config(int8)


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"compress_ratios": [0, 4, 128]}, "compress_ratios"),
        ({"sparse_attention_config": {"use_sparse_attention": True}}, "sparse_attention_config"),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"cross_attention_layers": [1]}, "cross_attention_layers"),
        ({"pruned_heads": {"0": [1]}}, "pruned_heads"),
    ],
)
def test_unmodelled_geometry_fields_are_refused_by_name(extra, field):
    with pytest.raises(UnsupportedArchitectureError, match=field):
        layers_from_config(dict(BASE, num_hidden_layers=2, **extra))


def test_switched_off_sparse_attention_is_plain_attention():
    config = dict(BASE, num_hidden_layers=2,
                  sparse_attention_config={"use_sparse_attention": False})
    assert len(layers_from_config(config)) == 2


def test_unknown_geometry_looking_keys_are_named_and_reviewed_ones_are_not():
    config = dict(BASE, num_hidden_layers=2, rope_theta=1e6, num_local_experts=8,
                  kv_group_stride=2, attention_window_overlap=16, vocab_size=10)
    assert unread_geometry_keys(config) == ["attention_window_overlap", "kv_group_stride"]


def test_every_cached_layer_counts_its_own_geometry():
    config = dict(BASE, model_type="gemma4_text", num_hidden_layers=12, sliding_window=512,
                  head_dim=256, num_key_value_heads=8, num_global_key_value_heads=2,
                  attention_k_eq_v=True)
    counts = Counter(ly.bytes_per_token for ly in layers_from_config(config))
    # 10 sliding: 8 x 256 x 2 x 2 B; 2 global: 2 x 512 x 2 x 2 B
    assert counts == {8192: 10, 4096: 2}


def test_reviewed_keys_are_per_family():
    gate = dict(BASE, num_hidden_layers=2, attn_output_gate=True)
    assert unread_geometry_keys(dict(gate, model_type="qwen3_5_text")) == []
    assert unread_geometry_keys(dict(gate, model_type="llama")) == ["attn_output_gate"]
