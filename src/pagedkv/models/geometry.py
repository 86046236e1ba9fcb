"""Fields that change cache geometry: refuse the ones pagedkv does not model, and name
unknown keys that look like geometry so a user can see what was not read.

A wrong plan with exit status 0 is the worst answer this tool can give, so a field known
to change what a layer caches is never silently skipped: either a reader models it, or
:func:`refuse_unmodelled` raises naming it. DeepSeek-V4 compression (models/deepseek_v4) and
MiniMax-M3 sparse attention (models/minimax_m3) are modelled for their own families only. Keys nobody reviewed that *look* like
geometry (``attention``, ``kv``, ``head``, ``window``, ``layer``, ``sparse``,
``compress``...) are returned by :func:`unread_geometry_keys` for a warning.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from pagedkv.errors import UnsupportedArchitectureError
from pagedkv.models.fields import model_type

# field -> what it is; a config with a non-empty value is refused
_UNMODELLED = {
    "cross_attention_layers": "cross-attention layers (encoder K/V per request)",
    "kv_shared_layer_index": "layers reading another layer's K/V",
    "add_cross_attention": "cross-attention to an encoder",
    "pruned_heads": "pruned attention heads (fewer K/V heads in some layers)",
}

_GEOMETRY_WORDS = re.compile(
    r"attn|attention|kv|key|value|head|window|layer|sparse|compress|chunk|lora_rank|"
    r"mamba|ssm|conv|state|linear|index|sink|block|nope|rope_layer|global|local|swa|"
    r"mla|latent|shared"
)

# Keys pagedkv reads (models/pattern, attention, overrides, recurrent, drafters, weights).
_READ = frozenset("""
num_hidden_layers num_attention_heads num_key_value_heads head_dim attention_head_dim v_head_dim
kv_lora_rank qk_rope_head_dim qk_nope_head_dim q_lora_rank index_head_dim index_n_heads
sliding_window sliding_window_pattern sliding_window_size use_sliding_window
max_window_layers layer_types layers_block_type attention_chunk_size no_rope_layers
no_rope_layer_interval linear_attn_config hybrid_override_pattern hybrid_layer_pattern
attn_type_list full_attention_interval attn_layer_period attn_layer_offset block_configs
per_layer_config global_head_dim num_global_key_value_heads attention_k_eq_v
num_kv_shared_layers swa_num_attention_heads swa_num_key_value_heads swa_head_dim
swa_v_head_dim add_swa_attention_sink_bias add_full_attention_sink_bias
attn_logit_softcapping query_pre_attn_scalar linear_num_value_heads linear_num_key_heads
linear_key_head_dim linear_value_head_dim linear_conv_kernel_dim mamba_num_heads mamba_n_heads
mamba_head_dim mamba_d_head ssm_state_size mamba_d_state n_groups mamba_n_groups conv_kernel
mamba_d_conv mamba_expand mamba_dt_rank time_step_rank mamba_ssm_cache_dtype mamba_ssm_dtype
state_size expand num_heads linear_attn_alpha_factor layernorm_linear_attention_alpha
num_nextn_predict_layers mtp_num_hidden_layers mla_use_nope mla_use_output_gate
use_bidirectional_attention sparse_attention_config add_cross_attention pruned_heads
cross_attention_layers compress_ratios compress_rates compress_rate_csa compress_rate_hca
first_k_dense_replace moe_layer_freq moe_layers mlp_layer_types mlp_only_layers
decoder_sparse_step interleave_moe_layer_step expert_layer_period expert_layer_offset
n_shared_experts num_shared_experts shared_expert_intermediate_size
moe_shared_expert_intermediate_size num_local_experts moe_latent_size routed_expert_hidden_size
tie_word_embeddings block_size num_target_layers target_layer_ids aux_hidden_state_layer_ids
eagle_aux_hidden_state_layer_ids target_hidden_size draft_vocab_size
""".split())

# Reviewed, and known not to change what any layer caches, in every family: scalars of the
# attention math, RoPE, norms, MoE routing, and transformers' generic serialization keys.
_REVIEWED_COMMON = frozenset("""
attention_bias attention_dropout attention_multiplier attention_scale attn_scale
attn_temperature_tuning head_dim_scale use_qk_norm qk_layernorm use_qkv_bias qkv_bias
rope_theta rope_scaling rope_parameters partial_rotary_factor rotary_dim rotary_pct
rope_interleave index_topk norm_topk_prob num_experts_per_tok num_experts_per_token
shared_expert_gate layer_norm_eps layernorm_epsilon layer_norm_epsilon norm_eps rms_norm_eps
residual_in_fp32 num_logits_to_keep use_cache chunk_size_feed_forward output_attentions
output_hidden_states remove_invalid_values cross_attention_hidden_size ignore_index
image_token_index boi_token_index eoi_token_index mm_tokens_per_image layer_scale_init_value
qk_head_dim
""".split())

# Reviewed per family (model_type prefix): fields of one family's math or weights only.
_REVIEWED_BY_FAMILY = {
    "gemma": "hidden_size_per_layer_input vocab_size_per_layer_input enable_moe_block "
             "vision_soft_tokens_per_image eoa_token_index",
    "mimo": "attention_value_scale swa_rope_theta",
    "deepseek_v4": "num_hash_layers hc_mult hc_eps hc_sinkhorn_iters o_groups o_lora_rank "
                   "compress_rope_theta",
    "kimi": "attn_res_block_size activation_situ_linear_beta latent_moe_use_norm "
            "use_unified_vision_chunk",
    "minimax": "num_mtp_modules mtp_transformer_layers layernorm_full_attention_alpha "
               "use_gemma_norm qk_norm_type attention_output_gate shared_intermediate_size "
               "index_block_size index_topk_blocks index_local_blocks",
    "step": "num_sliding_attention_heads share_expert_dim",
    "glm": "indexer_rope_interleave",
    "qwen3": "attn_output_gate",
    "nemotron_h": "mtp_layers_block_type mtp_layer_types mtp_mlp_layer_types "
                  "moe_shared_expert_overlap mixer_rms_eps",
    "mamba": "use_mambapy use_conv_bias mixer_rms_eps time_step_min time_step_max "
             "time_step_floor time_step_scale time_step_init_scheme",
}

# Mamba mixers' own numerics, wherever they appear (Jamba, Nemotron-H, Bamba, Falcon-H1...).
_REVIEWED_MAMBA = frozenset("""
use_mamba_kernels use_mambapy use_conv_bias mamba_conv_bias mamba_proj_bias mamba_chunk_size
chunk_size time_step_limit time_step_min time_step_max time_step_floor time_step_scale
time_step_init_scheme mamba_hidden_act ssm_cfg rescale_prenorm_residual mamba_dt_min
mamba_dt_max mamba_dt_init_floor mamba_dt_limit linear_attn_gate linear_conv_bias
""".split())


def _reviewed(kind: str) -> frozenset:
    extra = [keys for prefix, keys in _REVIEWED_BY_FAMILY.items() if kind.startswith(prefix)]
    return frozenset(" ".join(extra).split())

# Sub-objects whose keys are reviewed as a whole (quantization, vision towers, tokens...).
_OPAQUE = frozenset((
    "quantization_config", "vision_config", "audio_config", "rope_scaling", "rope_parameters",
    "auto_map", "id2label", "label2id", "task_specific_params", "text_config",
    "transformer_layer_config", "dflash_config", "eagle_config", "linear_attn_config",
    "sparse_attention_config", "block_configs", "per_layer_config",
))


def _enabled(value: object) -> bool:
    return value not in (None, False, 0, [], {}, "")


def refuse_unmodelled(cfg: Mapping) -> None:
    """Raise naming the first field that changes cache geometry in a way pagedkv does not
    model (DeepSeek-V4 compression, MiniMax-M3 sparse attention, bidirectional Gemma...)."""
    for field, what in _UNMODELLED.items():
        if _enabled(cfg.get(field)):
            raise UnsupportedArchitectureError(
                f"config field {field!r} ({what}) changes what layers cache and pagedkv does "
                "not model it; refusing rather than planning it as plain attention"
            )
    sparse = cfg.get("sparse_attention_config")
    switched_on = isinstance(sparse, Mapping) and sparse.get("use_sparse_attention", True)
    if switched_on and not model_type(cfg).startswith("minimax_m3"):
        raise UnsupportedArchitectureError(
            f"config field 'sparse_attention_config' on model_type {model_type(cfg)!r}: "
            "pagedkv models it for MiniMax-M3 only; refusing rather than planning it as "
            "plain attention"
        )
    for field in ("compress_ratios", "compress_rates"):
        if _enabled(cfg.get(field)) and model_type(cfg) != "deepseek_v4":
            raise UnsupportedArchitectureError(
                f"config field {field!r} (compressed attention) on model_type "
                f"{model_type(cfg)!r}: pagedkv models it for DeepSeek-V4 only"
            )
    bidirectional = cfg.get("use_bidirectional_attention")
    # "vision" (Gemma 4): only an image's own tokens see each other; text stays causal
    if bidirectional not in (None, False, "vision"):
        raise UnsupportedArchitectureError(
            f"config field 'use_bidirectional_attention' is {bidirectional!r} (every token "
            "sees every other, as an encoder: no causal KV cache, and transformers halves "
            "the window); pagedkv plans decoder caches only"
        )


def unread_geometry_keys(cfg: Mapping) -> list[str]:
    """Top-level keys that look like cache geometry but that pagedkv neither reads nor has
    reviewed as harmless, sorted (for a warning; the plan still runs)."""
    family = _reviewed(model_type(cfg))
    known = _READ | _REVIEWED_COMMON | _REVIEWED_MAMBA | family
    return sorted(
        key for key in cfg
        if isinstance(key, str) and key not in known and key not in _OPAQUE
        and not key.startswith("_") and not key.endswith("_token_id")
        and _GEOMETRY_WORDS.search(key)
    )
