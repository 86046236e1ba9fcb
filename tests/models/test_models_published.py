"""Real published config.json files (tests/models/fixtures/published/, sources in its README)
plan right or are refused by name.

Every expected value below is worked out by hand from the config's own fields (the arithmetic is
in the comment above each entry) and from the defaults of the family's transformers config class
where the file leaves a field out; none is computed by calling pagedkv. KV caches are bf16 (2 B)
unless the config says otherwise; recurrent states follow docs/models.md (KDA / GatedDeltaNet
fp32; Mamba conv in the model dtype, SSM state in ``mamba_ssm_cache_dtype``).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from pagedkv.models import load_model
from pagedkv.plan import PlanOptions, make_plan

FIXTURES = Path(__file__).parent / "fixtures" / "published"
GiB = 2**30
BF16, FP8, FP32 = 2, 1, 4
MLA = (512 + 64) * BF16  # kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values = 1152 B/token/layer
INDEXER = 128 * FP8 + 4  # DSA indexer key: index_head_dim 128 fp8 + one fp32 scale = 132 B


def gqa(kv_heads: int, head_dim: int, v_head_dim: int | None = None, itemsize: int = BF16) -> int:
    """Bytes per token of one attention layer: K and V heads."""
    return kv_heads * (head_dim + (head_dim if v_head_dim is None else v_head_dim)) * itemsize


def mamba2(heads: int, head_dim: int, state: int, groups: int, kernel: int,
           conv_itemsize: int, ssm_itemsize: int) -> int:
    """Bytes of one Mamba2 layer's state per request: conv [k-1, H*P + 2*G*N] + ssm [H, P, N]."""
    return ((kernel - 1) * (heads * head_dim + 2 * groups * state) * conv_itemsize
            + heads * head_dim * state * ssm_itemsize)


def gdn(k_heads: int, k_dim: int, v_heads: int, v_dim: int, kernel: int) -> int:
    """Bytes of one Gated DeltaNet layer's fp32 state: conv [k-1, 2*Hk*Dk + Hv*Dv] + [Hv, Dk, Dv]."""
    return ((kernel - 1) * (2 * k_heads * k_dim + v_heads * v_dim) + v_heads * k_dim * v_dim) * FP32


def kda(heads: int, head_dim: int, kernel: int) -> int:
    """Bytes of one KDA layer's fp32 state: conv [k-1, 3*H*D] + recurrent [H, D, D]."""
    return ((kernel - 1) * 3 * heads * head_dim + heads * head_dim * head_dim) * FP32


# file -> groups as (retention kind, window or chunk or None, layers, bytes): bytes are per token
# for attention groups, per request for recurrent ones (every layer of the group together).
EXPECTED: dict[str, list[tuple[str, int | None, int, int]]] = {
    # --- DeepSeek / Kimi / GLM: MLA ---------------------------------------------------------
    # 61 MLA layers, 576-value latent; quantization_config fp8 is weights only (no
    # kv_cache_scheme), the MTP layer (num_nextn_predict_layers 1) is a drafter, not planned here
    "deepseek-ai--DeepSeek-V3.json": [("full", None, 61, 61 * MLA)],
    # 61 MLA layers + 61 DSA indexer keys (index_head_dim 128) in the same block table:
    # 61 x 1152 + 61 x 132
    "deepseek-ai--DeepSeek-V3.2.json": [("full", None, 122, 61 * MLA + 61 * INDEXER)],
    # 61 MLA layers (kv_lora_rank 512 + qk_rope_head_dim 64); num_nextn_predict_layers 0
    "moonshotai--Kimi-K2-Instruct.json": [("full", None, 61, 61 * MLA)],
    # text_config: 61 MLA layers; compressed-tensors int4 weights, kv_cache_scheme null -> bf16
    "moonshotai--Kimi-K2.5.json": [("full", None, 61, 61 * MLA)],
    # text_config.linear_attn_config: full_attn_layers (1-based) 4, 8, ..., 92, 93 = 24 MLA
    # layers; kda_layers = the other 69. KDA: num_heads 96, head_dim 128, short_conv_kernel 4:
    # conv 3 x (3 x 96 x 128 = 36864) x 4 B = 442368 + state 96 x 128 x 128 x 4 B = 6291456
    # = 6733824 B per layer per request. mxfp4 weights, kv_cache_scheme null -> bf16 MLA.
    "moonshotai--Kimi-K3.json": [
        ("full", None, 24, 24 * MLA),
        ("recurrent", None, 69, 69 * kda(96, 128, 4)),
    ],
    # glm_moe_dsa: 78 MLA layers (512 + 64) + 78 indexer keys (index_head_dim 128)
    "zai-org--GLM-5.json": [("full", None, 156, 78 * MLA + 78 * INDEXER)],
    # DeepSeek-V4-Flash: num_hidden_layers 43; compress_ratios (44 entries, the last for the MTP
    # layer) cut to 43 as DeepseekV4Config does: [0, 0] then 4, 128 alternating -> 2 sliding-only
    # layers, 21 CSA (ratio 4: layers 2, 4, ..., 42), 20 HCA (ratio 128: layers 3, 5, ..., 41).
    # Every layer keeps a sliding_window 128 K=V window: num_key_value_heads 1 x head_dim 512,
    # one tensor read as K and V, bf16: 512 x 2 B = 1024 B/token/layer.
    # Compressed entries (one per ratio tokens, bf16 as transformers keeps them): CSA a K=V
    # entry of 512 + an indexer key of index_head_dim 128 = (512 + 128) x 2 B = 1280 per layer,
    # over 21 + 21 cache layers; HCA a K=V entry of 512 x 2 B = 1024.
    # Per-request compressor state (DeepseekV4HCACache / CSACache): HCA buffers up to 127
    # pending tokens of kv + gate (head_dim 512 each, bf16): 127 x 2 x 512 x 2 B = 260096.
    # CSA (ratio 4): compressor buffer 3 tokens x (kv + gate of 2 x 512) x 2 B = 12288, overlap
    # kv 4 x 512 x 2 B = 4096 and overlap gate (plus the fp32 position_bias, so fp32)
    # 4 x 512 x 4 B = 8192; its indexer the same at 128: 3 x 2 x 256 x 2 = 3072,
    # 4 x 128 x 2 = 1024, 4 x 128 x 4 = 2048 -> 30720 per CSA layer
    "deepseek-ai--DeepSeek-V4-Flash.json": [
        ("sliding_window", 128, 43, 43 * 512 * BF16),
        ("compressed", 4, 42, 21 * 512 * BF16 + 21 * 128 * BF16),
        ("compressed", 128, 20, 20 * 512 * BF16),
        ("recurrent", None, 41,
         20 * 127 * 2 * 512 * BF16
         + 21 * (3 * 2 * 1024 * BF16 + 4 * 512 * BF16 + 4 * 512 * FP32
                 + 3 * 2 * 256 * BF16 + 4 * 128 * BF16 + 4 * 128 * FP32)),
    ],
    # --- gpt-oss ------------------------------------------------------------------------------
    # layer_types alternate: 18 sliding (sliding_window 128) + 18 full; 8 KV heads x 64 x 2 x 2 B
    # = 2048 B/token/layer (no dtype field: bf16; mxfp4 covers experts only)
    "openai--gpt-oss-120b.json": [
        ("sliding_window", 128, 18, 18 * gqa(8, 64)),
        ("full", None, 18, 18 * gqa(8, 64)),
    ],
    # 24 layers: 12 sliding (128) + 12 full, 2048 B/token/layer
    "openai--gpt-oss-20b.json": [
        ("sliding_window", 128, 12, 12 * gqa(8, 64)),
        ("full", None, 12, 12 * gqa(8, 64)),
    ],
    # --- Qwen ----------------------------------------------------------------------------------
    # qwen2: use_sliding_window false (sliding_window 131072 and max_window_layers 28 unused):
    # 28 full layers x 4 KV heads x (3584 / 28 = 128) x 2 x 2 B = 2048 B/token/layer
    "Qwen--Qwen2.5-7B-Instruct.json": [("full", None, 28, 28 * gqa(4, 128))],
    # 36 layers, use_sliding_window false; 8 KV heads x 128 x 2 x 2 B = 4096 B/token/layer
    "Qwen--Qwen3-8B.json": [("full", None, 36, 36 * gqa(8, 128))],
    # 64 layers x 8 KV heads x 128: fp8 block-scaled weights, KV stays bf16
    "Qwen--Qwen3-32B-FP8.json": [("full", None, 64, 64 * gqa(8, 128))],
    # 48 layers x 4 KV heads x 128 x 2 x 2 B = 2048 B/token/layer
    "Qwen--Qwen3-30B-A3B.json": [("full", None, 48, 48 * gqa(4, 128))],
    # 94 layers x 4 KV heads x 128
    "Qwen--Qwen3-235B-A22B.json": [("full", None, 94, 94 * gqa(4, 128))],
    # full_attention_interval 4: 12 full layers of 2 KV heads x 256 (2048 B); 36 Gated
    # DeltaNet layers: key heads 16 x 128, value heads 32 x 128, conv kernel 4:
    # conv 3 x (2 x 2048 + 4096) x 4 B = 98304 + state 32 x 128 x 128 x 4 B = 2097152
    "Qwen--Qwen3-Next-80B-A3B-Thinking.json": [
        ("full", None, 12, 12 * gqa(2, 256)),
        ("recurrent", None, 36, 36 * gdn(16, 128, 32, 128, 4)),
    ],
    # text_config.layer_types: 16 full (4 KV heads x 256 = 4096 B) + 48 linear_attention
    # (GDN 16 x 128 keys, 48 x 128 values, kernel 4: 3 x 10240 x 4 + 48 x 128 x 128 x 4
    # = 122880 + 3145728 B, mamba_ssm_dtype float32); MTP layer not planned without a drafter
    "Qwen--Qwen3.5-27B.json": [
        ("full", None, 16, 16 * gqa(4, 256)),
        ("recurrent", None, 48, 48 * gdn(16, 128, 48, 128, 4)),
    ],
    # 15 full (2 KV heads x 256 = 2048 B) + 45 GDN (16 x 128 keys, 64 x 128 values:
    # 3 x 12288 x 4 + 64 x 128 x 128 x 4 = 147456 + 4194304 B)
    "Qwen--Qwen3.5-397B-A17B.json": [
        ("full", None, 15, 15 * gqa(2, 256)),
        ("recurrent", None, 45, 45 * gdn(16, 128, 64, 128, 4)),
    ],
    # text_config: 36 layers x 8 KV heads x 128 (the vision tower keeps no KV cache)
    "Qwen--Qwen3-VL-8B-Instruct.json": [("full", None, 36, 36 * gqa(8, 128))],
    # qwen3_vl_moe text_config: 48 layers x 4 KV heads x 128 x 2 x 2 B = 2048 B/token/layer
    "Qwen--Qwen3-VL-30B-A3B-Instruct.json": [("full", None, 48, 48 * gqa(4, 128))],
    # --- Gemma 4 ------------------------------------------------------------------------------
    # text_config.layer_types: 25 sliding (1024) + 5 full (every 6th). Sliding: 8 KV heads x 256
    # x 2 x 2 B = 8192. Full: global_head_dim 512 x num_global_key_value_heads 2 (attention_k_eq_v
    # gates that override in transformers' Gemma4TextConfig); K and V both cached (V is the
    # normed pre-RoPE projection, not the same tensor as K): 2 x 512 x 2 x 2 B = 4096
    "google--gemma-4-26B-A4B.json": [
        ("sliding_window", 1024, 25, 25 * gqa(8, 256)),
        ("full", None, 5, 5 * gqa(2, 512)),
    ],
    # 60 layers: 50 sliding (1024) + 10 full. quantization_config.kv_cache_scheme is 8-bit
    # float, so KV is fp8 (1 B): sliding 16 KV heads x 256 x 2 x 1 B = 8192; full
    # num_global_key_value_heads 4 x global_head_dim 512 x 2 x 1 B = 4096
    "nvidia--Gemma-4-31B-IT-NVFP4.json": [
        ("sliding_window", 1024, 50, 50 * gqa(16, 256, itemsize=FP8)),
        ("full", None, 10, 10 * gqa(4, 512, itemsize=FP8)),
    ],
    # --- Gemma 3 ------------------------------------------------------------------------------
    # text_config (gemma3_text) as published: neither layer_types nor sliding_window_pattern, so
    # transformers' Gemma3TextConfig pattern 6 applies: layer i is full when (i + 1) % 6 == 0 ->
    # layers 5, 11, ..., 59 = 10 full, 62 - 10 = 52 sliding (sliding_window 1024). Both kinds:
    # 16 KV heads x head_dim 128 x 2 (K, V) x 2 B = 8192 B/token/layer
    "google--gemma-3-27b-it.json": [
        ("sliding_window", 1024, 52, 52 * gqa(16, 128)),
        ("full", None, 10, 10 * gqa(16, 128)),
    ],
    # text_config states only hidden_size, intermediate_size, num_hidden_layers 34 and
    # sliding_window 1024: Gemma3TextConfig fills num_key_value_heads 4, head_dim 256 and the
    # pattern 6 -> full layers 5, 11, 17, 23, 29 (5), sliding the other 29;
    # 4 KV heads x 256 x 2 x 2 B = 4096 B/token/layer
    "google--gemma-3-4b-it.json": [
        ("sliding_window", 1024, 29, 29 * gqa(4, 256)),
        ("full", None, 5, 5 * gqa(4, 256)),
    ],
    # --- Llama ---------------------------------------------------------------------------------
    # no no_rope_layers: transformers' Llama4TextConfig default interval 4 makes layers 3, 7, ...,
    # 47 NoPE (12, global) and the other 36 RoPE layers chunked (attention_chunk_size 8192);
    # 8 KV heads x 128 x 2 x 2 B = 4096 B/token/layer
    "meta-llama--Llama-4-Scout-17B-16E-Instruct.json": [
        ("chunked_local", 8192, 36, 36 * gqa(8, 128)),
        ("full", None, 12, 12 * gqa(8, 128)),
    ],
    "meta-llama--Llama-4-Maverick-17B-128E-Instruct.json": [
        ("chunked_local", 8192, 36, 36 * gqa(8, 128)),
        ("full", None, 12, 12 * gqa(8, 128)),
    ],
    # 32 layers, 8 KV heads x (4096 / 32 = 128)
    "meta-llama--Meta-Llama-3.1-8B.json": [("full", None, 32, 32 * gqa(8, 128))],
    # 80 layers, 8 KV heads x (8192 / 64 = 128)
    "meta-llama--Meta-Llama-3.1-70B.json": [("full", None, 80, 80 * gqa(8, 128))],
    # Nemotron NAS block_configs: 49 attention blocks with n_heads_in_group 8 (64 / 8 = 8 KV
    # heads x 8192 / 64 = 128) and 31 no_op attention blocks that keep no cache
    "nvidia--Llama-3_3-Nemotron-Super-49B-v1.json": [("full", None, 49, 49 * gqa(8, 128))],
    # --- Mistral -------------------------------------------------------------------------------
    # sliding_window null: 32 full layers x 8 KV heads x 128
    "mistralai--Mixtral-8x7B-v0.1.json": [("full", None, 32, 32 * gqa(8, 128))],
    # 56 layers x 8 KV heads x (6144 / 48 = 128)
    "mistralai--Mixtral-8x22B-v0.1.json": [("full", None, 56, 56 * gqa(8, 128))],
    # sliding_window null: 32 full layers x 8 KV heads x (4096 / 32 = 128) x 2 x 2 B = 4096
    "mistralai--Mistral-7B-Instruct-v0.3.json": [("full", None, 32, 32 * gqa(8, 128))],
    # ministral3, sliding_window null: 88 full layers x 8 KV heads x head_dim 128 x 2 x 2 B
    # = 4096; quantization_config fp8 is weights only (no kv_cache_scheme), KV stays bf16
    "mistralai--Devstral-2-123B-Instruct.json": [("full", None, 88, 88 * gqa(8, 128))],
    # --- Phi -----------------------------------------------------------------------------------
    # phi3, sliding_window null: 40 layers x 10 KV heads x (5120 / 40 = 128) x 2 x 2 B = 5120
    "microsoft--phi-4.json": [("full", None, 40, 40 * gqa(10, 128))],
    # phi: 24 layers x 32 KV heads x (2048 / 32 = 64) x 2 values; torch_dtype float32 runs as
    # bf16 (as engines do with --dtype auto, docs/models.md): 32 x 64 x 2 x 2 B = 8192
    "microsoft--phi-1.json": [("full", None, 24, 24 * gqa(32, 64))],
    # --- sliding 3 : 1 full by layer_types -----------------------------------------------------
    # layer_types: 3 sliding_attention then 1 full_attention, 16 times -> 48 sliding (4096) +
    # 16 full; 8 KV heads x head_dim 128 x 2 x 2 B = 4096 B/token/layer
    "LGAI-EXAONE--EXAONE-4.0-32B.json": [
        ("sliding_window", 4096, 48, 48 * gqa(8, 128)),
        ("full", None, 16, 16 * gqa(8, 128)),
    ],
    # the same layer_types and window; 8 KV heads x (5120 / 40 = 128)
    "allenai--Olmo-3.1-32B-Instruct.json": [
        ("sliding_window", 4096, 48, 48 * gqa(8, 128)),
        ("full", None, 16, 16 * gqa(8, 128)),
    ],
    # --- Nemotron-H (Mamba2 hybrids) -----------------------------------------------------------
    # hybrid_override_pattern: 10 '*' attention (8 KV heads x attention_head_dim 128 = 4096 B),
    # 54 'M' Mamba2, 54 '-' MLP. Mamba2: 256 heads x 64, state 256, 8 groups, kernel 4; no
    # mamba_ssm_cache_dtype in the file, and NemotronHConfig's default is "float32":
    # conv 3 x (16384 + 2 x 8 x 256 = 20480) x 2 B = 122880 + ssm 256 x 64 x 256 x 4 B = 16777216
    "nvidia--Nemotron-H-56B-Base-8K.json": [
        ("full", None, 10, 10 * gqa(8, 128)),
        ("recurrent", None, 54, 54 * mamba2(256, 64, 256, 8, 4, BF16, FP32)),
    ],
    # 'MEMEM*E...': 6 '*' attention (2 KV heads x 128 = 1024 B), 23 'M', 23 'E' (MoE). Mamba2:
    # 64 heads x 64, state 128, 8 groups, kernel 4, mamba_ssm_cache_dtype float32:
    # conv 3 x (4096 + 2048) x 2 B = 36864 + ssm 64 x 64 x 128 x 4 B = 2097152
    "nvidia--NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.json": [
        ("full", None, 6, 6 * gqa(2, 128)),
        ("recurrent", None, 23, 23 * mamba2(64, 64, 128, 8, 4, BF16, FP32)),
    ],
    # 88 layers: 8 '*' attention (2 KV heads x 128 = 1024 B), 40 'M' Mamba2, 40 'E' (MoE); the
    # MTP pattern ("*E") is a drafter, not planned here. Mamba2: 128 heads x 64, state 128,
    # 8 groups, kernel 4, mamba_ssm_cache_dtype float32: conv 3 x (8192 + 2 x 8 x 128 = 10240)
    # x 2 B = 61440 + ssm 128 x 64 x 128 x 4 B = 4194304. (time_step_limit holds Infinity.)
    "nvidia--NVIDIA-Nemotron-3-Super-120B-A12B-FP8.json": [
        ("full", None, 8, 8 * gqa(2, 128)),
        ("recurrent", None, 40, 40 * mamba2(128, 64, 128, 8, 4, BF16, FP32)),
    ],
    # --- MiniMax / MiMo / Step -----------------------------------------------------------------
    # 62 layers, no attn_type_list (all softmax attention): 8 KV heads x 128
    "MiniMaxAI--MiniMax-M2.5.json": [("full", None, 62, 62 * gqa(8, 128))],
    # 60 layers, every one keeps all K/V: 4 KV heads x 128 x 2 x 2 B = 2048 B/token/layer.
    # sparse_attention_config.sparse_attention_freq marks layers 3..59 (57) sparse: each also
    # caches one indexer key of sparse_index_dim 128 per token (MiniMaxM3 idx_keys, bf16):
    # 128 x 2 B = 256, in the same block table -> 60 x 2048 + 57 x 256 = 137472 B/token
    "MiniMaxAI--MiniMax-M3.json": [("full", None, 117, 60 * gqa(4, 128) + 57 * 128 * BF16)],
    # hybrid_layer_pattern: 0 = full (layers 0, 5, 11, ..., 47: 9), 1 = sliding (39).
    # Sliding: swa_num_key_value_heads 8 x (swa_head_dim 192 + swa_v_head_dim 128) x 2 B = 5120;
    # window sliding_window_size 128 + 1 = 129 (MiMoV2FlashConfig: 128 earlier tokens plus the
    # query). Full: 4 KV heads x (192 + v_head_dim 128) x 2 B = 2560
    "XiaomiMiMo--MiMo-V2-Flash.json": [
        ("sliding_window", 129, 39, 39 * gqa(8, 192, 128)),
        ("full", None, 9, 9 * gqa(4, 192, 128)),
    ],
    # 36 layers, use_sliding_window false: 8 KV heads x 128; the MTP layer is not planned
    "XiaomiMiMo--MiMo-7B-Base.json": [("full", None, 36, 36 * gqa(8, 128))],
    # layer_types: 12 full (0, 4, ..., 44) + 33 sliding (512); 8 KV heads x 128 on both
    "stepfun-ai--Step-3.7-Flash.json": [
        ("sliding_window", 512, 33, 33 * gqa(8, 128)),
        ("full", None, 12, 12 * gqa(8, 128)),
    ],
}

# file -> the field its refusal must name: caches pagedkv does not model. (DeepSeek-V4's
# compress_ratios and MiniMax-M3's sparse_attention_config were refused here until they were
# modelled; both are in EXPECTED now.)
REFUSED = {
    # text_config.layer_types holds "conv": LFM2's short-convolution layers keep a per-request
    # conv state that pagedkv has no layer kind for, so the config is refused, not read as
    # attention
    "LiquidAI--LFM2.5-VL-1.6B.json": "layer_types",
}

# (file, drafter) -> groups as (retention kind, position offset, layers, bytes per token or per
# request). A drafter layer whose KV at position i comes from token i + 1 (MTP, EAGLE) has offset 1
# and so its own block table.
DRAFTED: dict[tuple[str, str], list[tuple[str, int, int, int]]] = {
    # num_nextn_predict_layers 1: one more MLA layer (576 values)
    ("deepseek-ai--DeepSeek-V3.json", "mtp"): [
        ("full", 0, 61, 61 * MLA), ("full", 1, 1, MLA),
    ],
    # the MTP layer is a DSA layer like the others: its MLA latent and its indexer key
    ("zai-org--GLM-5.json", "mtp"): [
        ("full", 0, 156, 78 * MLA + 78 * INDEXER), ("full", 1, 2, MLA + INDEXER),
    ],
    # mtp_num_hidden_layers 1: one full-attention layer of 4 KV heads x 256
    ("Qwen--Qwen3.5-27B.json", "mtp"): [
        ("full", 0, 16, 16 * gqa(4, 256)),
        ("recurrent", 0, 48, 48 * gdn(16, 128, 48, 128, 4)),
        ("full", 1, 1, gqa(4, 256)),
    ],
    # num_nextn_predict_layers 1: one layer of 8 KV heads x 128
    ("XiaomiMiMo--MiMo-7B-Base.json", "mtp"): [
        ("full", 0, 36, 36 * gqa(8, 128)), ("full", 1, 1, gqa(8, 128)),
    ],
    # mtp_hybrid_override_pattern "*E": one attention layer (2 KV heads x 128) and an MoE
    ("nvidia--NVIDIA-Nemotron-3-Super-120B-A12B-FP8.json", "mtp"): [
        ("full", 0, 8, 8 * gqa(2, 128)),
        ("recurrent", 0, 40, 40 * mamba2(128, 64, 128, 8, 4, BF16, FP32)),
        ("full", 1, 1, gqa(2, 128)),
    ],
    # the catalog's EAGLE-3 drafter for Llama 3.1 8B: one layer of 8 KV heads x 128, offset 1
    ("meta-llama--Meta-Llama-3.1-8B.json", "llama-3-8b-eagle3"): [
        ("full", 0, 32, 32 * gqa(8, 128)), ("full", 1, 1, gqa(8, 128)),
    ],
}

# (file, drafter) -> the field the refusal must name
DRAFT_REFUSED = {
    # num_nextn_predict_layers 0: Kimi-K2 has no MTP layers to draft with
    ("moonshotai--Kimi-K2-Instruct.json", "mtp"): "num_nextn_predict_layers",
    # EAGLE-3 for Llama shares the target's embeddings: vocab_size 128256 vs Qwen3's 151936
    ("Qwen--Qwen3-8B.json", "llama-3-8b-eagle3"): "vocab_size",
}

CLI_ARGS = ("--memory", "40GiB", "--max-model-len", "131072")


def _window(group) -> int | None:
    ret = group.retention
    return (getattr(ret, "window", None) or getattr(ret, "chunk", None)
            or getattr(ret, "ratio", None))


def _groups(plan) -> list[tuple[str, int | None, int, int]]:
    return sorted(
        (g.retention.kind, _window(g), len(g.layers),
         g.bytes_per_request if g.is_recurrent else g.bytes_per_token)
        for g in plan.groups
    )


def test_every_fixture_has_an_expectation_and_is_as_copied():
    files = {p.name for p in FIXTURES.glob("*.json")}
    assert len(files) >= 30
    assert files == set(EXPECTED) | set(REFUSED)
    readme = (FIXTURES / "README.md").read_text(encoding="utf-8")
    # README rows: | file | repository | path | commit | sha256 |
    rows = {m[1]: m[2] for m in re.finditer(r"^\| (\S+\.json)[^|]*\|.*\| ([0-9a-f]{64}) \|$",
                                              readme, re.M)}
    assert set(rows) == files, "README must name every fixture's source"
    for name, digest in rows.items():
        assert hashlib.sha256((FIXTURES / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_published_config_plans_right(name):
    spec = load_model(str(FIXTURES / name))
    plan = make_plan(spec.layers, PlanOptions(budget_bytes=40 * GiB, max_model_len=8192))
    assert _groups(plan) == sorted(EXPECTED[name])


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_published_config_plans_from_the_cli(cli, name):
    """Only the KV question is asked: weight-only fields and max_position_embeddings are not
    needed with --memory and --max-model-len."""
    result = cli("plan", FIXTURES / name, "--memory", "40GiB", "--max-model-len", "8192", "--json")
    assert result.code == 0, result.err
    got = sorted(
        (g["retention"]["kind"], len(g["layers"]),
         g["bytes_per_request"] if g["retention"]["kind"] == "recurrent" else g["bytes_per_token"])
        for g in result.json()["groups"]
    )
    assert got == sorted((kind, n, nbytes) for kind, _, n, nbytes in EXPECTED[name])


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_published_config_is_refused_by_name(cli, name):
    result = cli("plan", FIXTURES / name, *CLI_ARGS)
    assert result.code == 2
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedkv: error:"), result.err
    assert REFUSED[name] in lines[0]
    assert result.out == ""


@pytest.mark.parametrize("name, draft", sorted(DRAFTED), ids=lambda x: str(x))
def test_published_target_with_its_drafter(name, draft):
    spec = load_model(str(FIXTURES / name), draft)
    plan = make_plan(spec.layers, PlanOptions(budget_bytes=40 * GiB, max_model_len=8192))
    got = sorted((g.retention.kind, g.position_offset, len(g.layers),
                  g.bytes_per_request if g.is_recurrent else g.bytes_per_token)
                 for g in plan.groups)
    assert got == sorted(DRAFTED[(name, draft)])


@pytest.mark.parametrize("name, draft", sorted(DRAFT_REFUSED), ids=lambda x: str(x))
def test_published_target_refuses_a_foreign_drafter(cli, name, draft):
    result = cli("plan", FIXTURES / name, "--draft", draft, *CLI_ARGS)
    assert result.code == 2
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedkv: error:"), result.err
    assert DRAFT_REFUSED[(name, draft)] in lines[0]
