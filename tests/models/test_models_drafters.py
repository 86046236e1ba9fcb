"""Drafters: EAGLE, DeepSeek MTP, DFlash and DSpark read from their fields."""

from __future__ import annotations

import pytest

from pagedkv.errors import ConfigError, IncompatibleDrafterError
from pagedkv.kvspec import AttentionKV, DType, Full, MLALatent, block_table_compatibility
from pagedkv.models import drafter_role, layers_from_config, load_config, load_model, mtp_layers
from pagedkv.models.compat import drafter_mismatch

SMALL = {
    "hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 1024, "vocab_size": 1000,
    "torch_dtype": "bfloat16",
}


def test_kimi_k3_dspark_shares_the_target_latent_layout_and_retention():
    model = load_model("kimi-k3", "kimi-k3-dspark")
    target_mla = [ly for ly in model.target_layers if ly.layout.kind == "mla_latent"]
    draft = model.draft_layers
    assert model.draft_name == "kimi-k3-dspark"
    assert len(draft) == 5 and len(target_mla) == 24
    assert all(ly.layout == target_mla[0].layout == MLALatent(512, 64, "bf16") for ly in draft)
    assert all(ly.retention == Full() and ly.position_offset == 0 for ly in draft)
    assert all(not ly.attention.causal and ly.attention.draft_block == 7 for ly in draft)
    assert all(ly.attention.causal for ly in target_mla)
    assert [ly.name for ly in draft] == [f"draft.layers.{i}.self_attn" for i in range(5)]
    assert [ly.index for ly in draft] == list(range(5))
    assert all(ly.model == "draft" for ly in draft)
    # one block table: 29 x 1152 = 33408 bytes per token in bf16
    assert all(block_table_compatibility(target_mla[0], ly, 64, 64) for ly in draft)
    assert sum(ly.bytes_per_token for ly in target_mla + list(draft)) == 29 * 1152 == 33408


def test_eagle3_drafter_writes_kv_one_position_ahead():
    model = load_model("llama-3-8b", "llama-3-8b-eagle3")
    (layer,) = model.draft_layers
    assert layer.position_offset == 1 and layer.attention.causal
    assert layer.attention.draft_block is None
    # kv_dtype auto stores the drafter in the target's dtype (the drafter config says fp16)
    assert layer.layout == AttentionKV(8, 128, DType.BF16)
    assert not block_table_compatibility(model.target_layers[0], layer, 16, 16)


def test_eagle_is_recognised_by_any_of_its_fields():
    for extra in ({"draft_vocab_size": 32000}, {"eagle_config": {}},
                  {"architectures": ["LlamaForCausalLMEagle"]},
                  {"speculators_model_type": "eagle3"}):
        role = drafter_role(dict(SMALL, **extra))
        assert (role.kind, role.position_offset, role.draft_block) == ("eagle", 1, None)


def test_speculators_format_reads_the_inner_layer_config():
    config = {
        "speculators_model_type": "eagle3", "draft_vocab_size": 32000, "torch_dtype": "bfloat16",
        "transformer_layer_config": dict(SMALL, num_hidden_layers=1, num_key_value_heads=4),
    }
    (layer,) = layers_from_config(config, model="draft")
    assert layer.position_offset == 1 and layer.layout == AttentionKV(4, 64, DType.BF16)


def test_speculators_dflash_with_a_draft_vocab_is_a_block_drafter():
    config = {
        "speculators_model_type": "dflash", "block_size": 8, "draft_vocab_size": 32000,
        "aux_hidden_state_layer_ids": [1, 5, 9],
        "transformer_layer_config": dict(SMALL, sliding_window=64,
                                         layer_types=["sliding_attention"] * 2),
    }
    layers = layers_from_config(config, model="draft")
    assert all(ly.attention.draft_block == 8 and not ly.attention.causal for ly in layers)
    assert all(ly.attention.window == 64 and ly.position_offset == 0 for ly in layers)


def test_dflash_drafter_is_non_causal_in_blocks_of_its_block_size():
    model = load_model("qwen3-8b", "qwen3-8b-dflash")
    assert len(model.draft_layers) == 5
    for layer in model.draft_layers:
        assert layer.attention.draft_block == 16 and not layer.attention.causal
        assert layer.position_offset == 0 and layer.retention == Full()
    assert drafter_role(load_config("qwen3-8b-dflash")).kind == "dflash"
    assert drafter_role(load_config("kimi-k3-dspark")).kind == "dspark"


def test_block_size_alone_is_not_a_drafter():
    # MiniMax's lightning block_size must not turn a target into a block drafter
    assert drafter_role(dict(SMALL, block_size=256)).kind == "model"


def test_plain_model_as_draft_keeps_its_own_reading():
    model = load_model("llama-3-70b", "llama-3-8b")
    assert len(model.draft_layers) == 32
    assert all(ly.position_offset == 0 and ly.attention.causal for ly in model.draft_layers)
    assert block_table_compatibility(model.target_layers[0], model.draft_layers[0], 16, 16)


def test_deepseek_mtp_uses_the_target_mla_geometry():
    model = load_model("deepseek-v3", "mtp")
    (layer,) = model.draft_layers
    assert model.draft_name == "mtp"
    assert layer.layout == model.target_layers[0].layout == MLALatent(512, 64, "bf16")
    assert layer.name == "draft.layers.0.self_attn" and layer.index == 0
    assert layer.position_offset == 1 and layer.attention.causal
    assert len(model.target_layers) == 61


def test_deepseek_v32_mtp_has_its_indexer_too():
    model = load_model("deepseek-v3.2", "mtp", kv_dtype="fp8")
    assert [ly.layout.kind for ly in model.draft_layers] == ["mla_latent", "indexer"]
    assert sum(ly.bytes_per_token for ly in model.draft_layers) == 576 + 132


def test_drafter_weights_are_added():
    alone = load_model("kimi-k3").weight_bytes
    with_draft = load_model("kimi-k3", "kimi-k3-dspark").weight_bytes
    # DSpark is about 3.56B bf16 parameters (model-facts.md)
    assert 0.95 * 3.56e9 * 2 < with_draft - alone < 1.05 * 3.56e9 * 2
    assert load_model("deepseek-v3", "mtp").weight_bytes > load_model("deepseek-v3").weight_bytes


def test_mtp_of_a_gqa_target_and_fp8_ds_mla():
    config = dict(SMALL, num_nextn_predict_layers=1, max_position_embeddings=4096)
    (layer,) = load_model(config, "mtp").draft_layers
    assert layer.layout == AttentionKV(2, 64, DType.BF16) and layer.position_offset == 1
    with pytest.raises(ConfigError, match=r"draft\.layers\.0\.\.0\.self_attn"):
        mtp_layers(config, kv_dtype="fp8_ds_mla")


# --- drafter-target compatibility ---------------------------------------------------------

def test_drafter_layer_ids_beyond_the_target_are_refused_naming_both():
    with pytest.raises(IncompatibleDrafterError, match=r"89.*32 layers"):
        load_model("llama-3-8b", "kimi-k3-dspark")


def test_drafter_of_another_vocabulary_is_refused_naming_both():
    with pytest.raises(IncompatibleDrafterError, match=r"128256.*151936"):
        load_model("qwen3-8b", "llama-3-8b-eagle3")


def test_drafter_reading_hidden_states_of_another_size_is_refused():
    eagle = dict(SMALL, draft_vocab_size=100, num_hidden_layers=1)
    target = dict(SMALL, hidden_size=1024, head_dim=128)
    with pytest.raises(IncompatibleDrafterError, match=r"size 512.*hidden_size is 1024"):
        load_model(target, eagle)
    assert drafter_mismatch(SMALL, eagle) is None


def test_mla_drafter_sharing_the_block_table_needs_the_same_latent():
    target = load_config("kimi-k3")
    draft = load_config("kimi-k3-dspark")
    inner = draft.get("transformer_layer_config") or draft.get("text_config")
    (inner if inner is not None else draft)["kv_lora_rank"] = 256
    assert "kv_lora_rank 256" in drafter_mismatch(target, draft)
    assert "512" in drafter_mismatch(target, draft)
    assert drafter_mismatch(target, load_config("kimi-k3-dspark")) is None


def test_plain_model_drafts_are_not_checked_for_hidden_size_or_vocabulary():
    assert drafter_mismatch(load_config("qwen3-8b"), load_config("llama-3-8b")) is None
