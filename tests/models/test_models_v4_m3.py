"""DeepSeek-V4 compressed attention and MiniMax-M3 sparse attention, read as transformers'
modelling code caches them (docs/models.md). Every expected byte count is worked out by hand
from the config's fields in the comment beside it; none is computed by calling pagedkv.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.errors import ConfigError, UnsupportedArchitectureError
from pagedkv.kvspec import (
    Compressed,
    DType,
    Full,
    IndexerKV,
    Recurrent,
    SharedKV,
    SlidingWindow,
)
from pagedkv.models import layers_from_config, load_config
from pagedkv.plan import PlanOptions, make_plan

FIXTURES = Path(__file__).parent / "fixtures" / "published"
V4_FLASH = FIXTURES / "deepseek-ai--DeepSeek-V4-Flash.json"
M3 = FIXTURES / "MiniMaxAI--MiniMax-M3.json"
GiB = 2**30

# A small DeepSeek-V4: layer 0 sliding only, 1 and 3 CSA (ratio 4), 2 HCA (ratio 128)
SMALL_V4 = {
    "model_type": "deepseek_v4", "num_hidden_layers": 4, "head_dim": 64,
    "num_key_value_heads": 1, "sliding_window": 8, "index_head_dim": 32,
    "compress_ratios": [0, 4, 128, 4], "torch_dtype": "bfloat16",
}
# bytes, worked by hand (bf16 = 2, fp32 = 4):
SMALL_WINDOW = 4 * 64 * 2  # 4 layers x one K=V head of 64 values = 512 B/token
SMALL_CSA = 2 * (64 * 2 + 32 * 2)  # 2 layers x (K=V entry 128 B + indexer key 64 B) = 384 B/entry
SMALL_HCA = 1 * 64 * 2  # 1 layer x K=V entry = 128 B/entry
SMALL_STATE_HCA = 2 * 127 * 64 * 2  # pending kv + gate, <= 127 tokens x 64 values = 32512
SMALL_STATE_CSA = (
    2 * 3 * 128 * 2  # compressor pending kv + gate: 3 tokens x 2*head_dim = 1536
    + 4 * 64 * 2 + 4 * 64 * 4  # overlap: 4 x 64 kv bf16 (512) + gate fp32 (1024)
    + 2 * 3 * 64 * 2  # indexer pending kv + gate: 3 x 2*32 = 768
    + 4 * 32 * 2 + 4 * 32 * 4  # indexer overlap: 256 + 512
)  # = 4608
SMALL_STATE = SMALL_STATE_HCA + 2 * SMALL_STATE_CSA  # 32512 + 9216 = 41728


def _by_name(layers):
    return {layer.name: layer for layer in layers}


def _groups(plan):
    return sorted(
        (g.retention.kind, getattr(g.retention, "ratio", None), len(g.layers),
         g.bytes_per_request if g.is_recurrent else g.bytes_per_token, g.blocks_per_request)
        for g in plan.groups
    )


# --- DeepSeek-V4 -------------------------------------------------------------------------------


def test_small_v4_layers_are_a_window_plus_compressed_streams_and_state():
    layers = _by_name(layers_from_config(SMALL_V4))
    assert sorted(layers) == sorted([
        *(f"model.layers.{i}.self_attn" for i in range(4)),
        "model.layers.1.self_attn.compressor", "model.layers.1.self_attn.indexer",
        "model.layers.1.self_attn.compressor_state",
        "model.layers.2.self_attn.compressor", "model.layers.2.self_attn.compressor_state",
        "model.layers.3.self_attn.compressor", "model.layers.3.self_attn.indexer",
        "model.layers.3.self_attn.compressor_state",
    ])
    window = layers["model.layers.0.self_attn"]
    assert window.layout == SharedKV(64, DType.BF16)
    assert window.retention == SlidingWindow(8)
    assert window.attention.window == 8 and window.attention.sinks
    assert layers["model.layers.1.self_attn.compressor"].retention == Compressed(4)
    assert layers["model.layers.1.self_attn.indexer"].layout == IndexerKV(32, DType.BF16)
    assert layers["model.layers.2.self_attn.compressor"].retention == Compressed(128)
    assert layers["model.layers.2.self_attn.compressor_state"].retention == Recurrent()
    assert layers["model.layers.2.self_attn.compressor_state"].bytes_per_request == SMALL_STATE_HCA
    assert layers["model.layers.3.self_attn.compressor_state"].bytes_per_request == SMALL_STATE_CSA


def test_small_v4_plan_sizes_each_stream():
    plan = make_plan(layers_from_config(SMALL_V4),
                     PlanOptions(budget_bytes=GiB, max_model_len=1024, block_size=16))
    assert _groups(plan) == sorted([
        # window 8: min(1024 / 16 = 64, ceil(7 / 16) + 1 = 2) blocks
        ("sliding_window", None, 4, SMALL_WINDOW, 2),
        # 1024 // 4 = 256 entries / 16 per block = 16 blocks
        ("compressed", 4, 4, SMALL_CSA, 16),
        # 1024 // 128 = 8 entries -> 1 block
        ("compressed", 128, 1, SMALL_HCA, 1),
        ("recurrent", None, 3, SMALL_STATE, 1),
    ])


def test_v4_flash_as_published():
    # 43 layers; compress_ratios (44 entries, the last for the MTP layer) cut to 43 as
    # transformers does: [0, 0], then 4 at 2, 4, ..., 42 (21 CSA) and 128 at 3, ..., 41 (20 HCA)
    layers = _by_name(layers_from_config(load_config(str(V4_FLASH))))
    csa = {i for i in range(43) if f"model.layers.{i}.self_attn.indexer" in layers}
    hca = {i for i in range(43) if f"model.layers.{i}.self_attn.compressor" in layers} - csa
    assert csa == set(range(2, 43, 2)) and hca == set(range(3, 42, 2))
    plan = make_plan(tuple(layers.values()),
                     PlanOptions(budget_bytes=40 * GiB, max_model_len=131072, block_size=16))
    hca_state = 2 * 127 * 512 * 2  # 260096
    csa_state = (2 * 3 * 1024 * 2 + 4 * 512 * 2 + 4 * 512 * 4
                 + 2 * 3 * 256 * 2 + 4 * 128 * 2 + 4 * 128 * 4)  # 30720
    assert _groups(plan) == sorted([
        # 43 x 512 x 2 = 44032 B/token; window 128: ceil(127 / 16) + 1 = 9 blocks
        ("sliding_window", None, 43, 44032, 9),
        # 21 x (512 x 2 + 128 x 2) = 26880 B/entry; 131072 // 4 / 16 = 2048 blocks
        ("compressed", 4, 42, 26880, 2048),
        # 20 x 512 x 2 = 20480 B/entry; 131072 // 128 / 16 = 64 blocks
        ("compressed", 128, 20, 20480, 64),
        # 20 x 260096 + 21 x 30720 = 5847040 B/request
        ("recurrent", None, 41, 20 * hca_state + 21 * csa_state, 1),
    ])


def test_v4_kv_dtype_applies_to_window_and_compressed_kv_only():
    layers = layers_from_config(SMALL_V4, kv_dtype="fp8")
    plan = make_plan(layers, PlanOptions(budget_bytes=GiB, max_model_len=1024, block_size=16))
    got = {(kind, ratio): nbytes for kind, ratio, _, nbytes, _ in _groups(plan)}
    assert got == {
        ("sliding_window", None): 4 * 64,  # fp8 K=V
        ("compressed", 4): 2 * (64 + 32 * 2),  # fp8 K=V entry, indexer key stays bf16
        ("compressed", 128): 64,
        ("recurrent", None): SMALL_STATE,  # state stays in the model dtype
    }


def test_v4_layer_types_and_rates_are_read_as_transformers_does():
    explicit = dict(SMALL_V4, compress_ratios=None, layer_types=[
        "heavily_compressed_attention", "sliding_attention", "compressed_sparse_attention",
        "sliding_attention"], compress_rates={"compressed_sparse_attention": 8},
        compress_rate_hca=64)
    layers = _by_name(layers_from_config(explicit))
    assert layers["model.layers.0.self_attn.compressor"].retention == Compressed(64)
    assert layers["model.layers.2.self_attn.compressor"].retention == Compressed(8)
    assert "model.layers.1.self_attn.compressor" not in layers
    # pending tokens of an 8-token window: 7 x (2 x 64) kv + gate, overlap 8 x 64 kv + gate fp32,
    # and the indexer's 7 x (2 x 32) + 8 x 32: 3584 + 1024 + 2048 + 1792 + 512 + 1024
    assert layers["model.layers.2.self_attn.compressor_state"].bytes_per_request == 9984


def test_v4_default_layer_types_match_transformers():
    transformers = pytest.importorskip("transformers")
    config = dict(SMALL_V4, num_hidden_layers=6)
    del config["compress_ratios"]
    reference = transformers.DeepseekV4Config(num_hidden_layers=6).layer_types
    layers = _by_name(layers_from_config(config))
    ratio = {"sliding_attention": None, "compressed_sparse_attention": 4,
             "heavily_compressed_attention": 128}
    for i, kind in enumerate(reference):
        compressor = layers.get(f"model.layers.{i}.self_attn.compressor")
        assert (compressor.retention.ratio if compressor else None) == ratio[kind], (i, kind)
    # transformers' default: 2 heavily compressed, then HCA / CSA in turn
    assert [ratio[k] for k in reference] == [128, 128, 128, 4, 128, 4]


@pytest.mark.parametrize(
    "change, error, needle",
    [
        ({"compress_ratios": [0, 8, 128, 4]}, UnsupportedArchitectureError, "compress_ratios"),
        ({"compress_ratios": [0, 4]}, ConfigError, "all 4 layers"),
        ({"num_key_value_heads": 2}, UnsupportedArchitectureError, "num_key_value_heads is 2"),
        ({"layer_types": ["full_attention"] * 4}, UnsupportedArchitectureError, "full_attention"),
    ],
)
def test_v4_configs_pagedkv_cannot_read_are_refused_by_name(change, error, needle):
    with pytest.raises(error, match=needle):
        layers_from_config(dict(SMALL_V4, **change))


def test_v4_refuses_the_mla_only_fp8_format():
    with pytest.raises(ConfigError, match="fp8_ds_mla"):
        layers_from_config(SMALL_V4, kv_dtype="fp8_ds_mla")


def test_compression_fields_on_another_family_are_refused():
    llama = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64}
    with pytest.raises(UnsupportedArchitectureError, match="compress_rates"):
        layers_from_config(dict(llama, compress_rates={"compressed_sparse_attention": 4}))


def test_simulate_refuses_compressed_retention_in_one_line(cli):
    code, out, err = cli("simulate", V4_FLASH, "--memory", "40GiB", "--max-model-len", "8192",
                         "--workload", "chat", "--requests", "2")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedkv: error:"), err
    assert "compressed 1/4" in lines[0]


# --- MiniMax-M3 --------------------------------------------------------------------------------


def test_m3_sparse_layers_keep_all_kv_and_an_indexer_key():
    # sparse_attention_freq: layers 0-2 dense attention, 3-59 sparse (57); sparse_index_dim 128
    layers = _by_name(layers_from_config(load_config(str(M3))))
    indexers = sorted(int(n.split(".")[2]) for n in layers if n.endswith(".indexer"))
    assert indexers == list(range(3, 60))
    assert len(layers) == 60 + 57
    assert all(layer.retention == Full() for layer in layers.values())
    assert layers["model.layers.3.self_attn.indexer"].layout == IndexerKV(128, DType.BF16)
    plan = make_plan(tuple(layers.values()),
                     PlanOptions(budget_bytes=40 * GiB, max_model_len=131072))
    # 60 x 4 KV heads x (128 + 128) x 2 = 122880, + 57 x 128 x 2 = 14592 -> 137472 B/token
    assert _groups(plan) == [("full", None, 117, 137472, 131072 // 16)]


def _m3_small(**sparse):
    base = {"use_sparse_attention": True, "sparse_attention_freq": [0, 1, 1],
            "sparse_index_dim": 64, "sparse_disable_index_value": [0, 1, 1]}
    return {"model_type": "minimax_m3", "num_hidden_layers": 3, "num_attention_heads": 8,
            "num_key_value_heads": 2, "head_dim": 32, "torch_dtype": "bfloat16",
            "sparse_attention_config": {**base, **sparse}}


def test_m3_small_index_dim_is_read():
    layers = _by_name(layers_from_config(_m3_small()))
    # 3 x 2 heads x (32 + 32) x 2 = 768; 2 indexer keys x 64 x 2 = 256
    assert sum(layer.bytes_per_token for layer in layers.values()) == 768 + 256
    assert "model.layers.0.self_attn.indexer" not in layers


@pytest.mark.parametrize(
    "sparse, error, needle",
    [
        ({"sparse_disable_index_value": [0, 0, 1]}, UnsupportedArchitectureError,
         "sparse_disable_index_value"),
        ({"use_sparse_attention": False}, UnsupportedArchitectureError, "use_sparse_attention"),
        ({"sparse_attention_freq": [1, 1]}, ConfigError, "all 3 layers"),
    ],
)
def test_m3_configs_pagedkv_cannot_read_are_refused_by_name(sparse, error, needle):
    with pytest.raises(error, match=needle):
        layers_from_config(_m3_small(**sparse))


def test_m3_reads_the_same_through_transformers_config_class():
    pytest.importorskip("transformers")
    from transformers.models.minimax_m3_vl import MiniMaxM3VLTextConfig

    raw = json.loads(M3.read_text(encoding="utf-8"))
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "architectures")}
    flat = MiniMaxM3VLTextConfig(**fields).to_dict()
    assert "minimax_m3_sparse" in flat["layer_types"]  # the form transformers writes
    flat.pop("sparse_attention_config", None)
    assert layers_from_config(flat) == layers_from_config(raw)


@pytest.mark.parametrize("path", [V4_FLASH, M3], ids=["deepseek_v4", "minimax_m3"])
def test_mtp_drafter_of_either_family_is_refused_in_one_line(cli, path):
    # both carry num_nextn_predict_layers 1, but transformers skips their mtp.* weights
    code, out, err = cli("plan", path, "--draft", "mtp", "--memory", "40GiB",
                         "--max-model-len", "8192")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedkv: error:"), err
    assert "--draft mtp" in lines[0] and "MTP" in lines[0]


def test_requests_shorter_than_a_window_plan_with_one_block_floor():
    plan = make_plan(layers_from_config(SMALL_V4),
                     PlanOptions(budget_bytes=GiB, max_model_len=100, block_size=16,
                                 typical_len=50))
    blocks = {(kind, ratio): b for kind, ratio, _, _, b in _groups(plan)}
    assert blocks[("compressed", 4)] == 2  # 100 // 4 = 25 entries -> 2 blocks of 16
    assert blocks[("compressed", 128)] == 1  # 100 // 128 = 0 entries; the pool lends 1 block
    assert plan.capacity.max_concurrency > 1


def test_v4_weights_are_not_estimated_so_gpu_plans_need_weights(cli):
    args = ("--gpu", "h200", "--tp", "8", "--max-model-len", "8192")
    code, out, err = cli("plan", V4_FLASH, *args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "expert_dtype 'fp4'" in err
    assert "--weights" in err
    code, out, err = cli("plan", V4_FLASH, *args, "--weights", "160GB")
    assert code == 0, err
