"""Softmax-attention layers: K/V geometry (GQA/MHA or MLA latent), the DeepSeek-V3.2
indexer cache, and the retention/mask each attention kind implies.

Fields read: ``num_attention_heads``, ``num_key_value_heads`` (default: the head count),
``head_dim`` / ``attention_head_dim`` (default: hidden_size / heads), ``v_head_dim`` (GQA
layers whose V heads are narrower than K, MiMo-V2), ``kv_lora_rank`` +
``qk_rope_head_dim`` (MLA: a latent of kv_lora_rank + rope values per token, whatever
``mla_use_nope`` says), ``index_head_dim`` (V3.2 indexer: one fp8 key + fp32 scale per
token), ``sliding_window``, ``attention_chunk_size``, ``attn_logit_softcapping``,
``query_pre_attn_scalar`` (scale). Attention sinks: gpt-oss checkpoints carry per-head sink
logits but no config field says so, so ``model_type == "gpt_oss"`` sets them (a mask flag
only; it never changes memory).
"""

from __future__ import annotations

from collections.abc import Mapping

from pagedkv.errors import ConfigError, InvalidArgumentError
from pagedkv.kvspec import (
    Attention,
    AttentionKV,
    ChunkedLocal,
    DType,
    Full,
    IndexerKV,
    Layout,
    MLALatent,
    Retention,
    SlidingWindow,
    parse_dtype,
)
from pagedkv.models.fields import first, model_dtype, model_type, need_int, opt_positive_float
from pagedkv.models.pattern import CHUNKED, FULL, SLIDING

KV_DTYPES = ("auto", "bf16", "fp16", "fp8", "fp8_ds_mla")
_SINK_MODEL_TYPES = ("gpt_oss",)


def resolve_kv_dtype(cfg: Mapping, kv_dtype: str) -> str:
    """``auto`` -> the model dtype; aliases (``bfloat16``...) -> bf16/fp16/fp8; or fp8_ds_mla."""
    if not isinstance(kv_dtype, str):
        raise InvalidArgumentError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    key = kv_dtype.strip().lower()
    if key == "fp8_ds_mla":
        return key
    if key == "auto":
        dtype = checkpoint_kv_dtype(cfg) or model_dtype(cfg)
    else:
        try:
            dtype = parse_dtype(key)
        except ConfigError:
            dtype = None
    if dtype not in (DType.BF16, DType.FP16, DType.FP8):
        raise InvalidArgumentError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    return dtype.value


def checkpoint_kv_dtype(cfg: Mapping) -> DType | None:
    """The KV-cache dtype a quantized checkpoint was calibrated for, which engines use with
    ``--kv-cache-dtype auto``: an 8-bit float ``quantization_config.kv_cache_scheme``
    (compressed-tensors, ModelOpt) or ModelOpt's ``kv_cache_quant_algo: FP8``."""
    quant = cfg.get("quantization_config")
    if not isinstance(quant, Mapping):
        return None
    scheme = quant.get("kv_cache_scheme")
    if isinstance(scheme, Mapping):
        if scheme.get("num_bits") == 8 and scheme.get("type", "float") == "float":
            return DType.FP8
        raise ConfigError(
            f"quantization_config.kv_cache_scheme {dict(scheme)!r} is not an 8-bit float KV "
            "cache; pagedkv models fp8 KV only (pass --kv-dtype to choose another)"
        )
    algo = quant.get("kv_cache_quant_algo")
    if isinstance(algo, str) and algo.upper() == "FP8":
        return DType.FP8
    return None


def is_mla(cfg: Mapping) -> bool:
    return cfg.get("kv_lora_rank") is not None


def num_heads(cfg: Mapping) -> int:
    return need_int(cfg, "num_attention_heads", why="attention geometry")


def head_dim(cfg: Mapping) -> int:
    explicit = first(cfg, "head_dim", "attention_head_dim")
    if explicit is not None:
        return need_int(cfg, "head_dim", "attention_head_dim", why="attention geometry")
    hidden = need_int(cfg, "hidden_size", why="head_dim = hidden_size / num_attention_heads")
    heads = num_heads(cfg)
    if hidden % heads:
        raise ConfigError(
            f"no head_dim given and hidden_size {hidden} is not divisible by "
            f"num_attention_heads {heads}"
        )
    return hidden // heads


def value_head_dim(cfg: Mapping) -> int | None:
    """V head dim of GQA/MHA layers when it differs from the K head dim (MiMo-V2)."""
    if cfg.get("v_head_dim") is None:
        return None
    value = need_int(cfg, "v_head_dim", why="attention geometry")
    return None if value == head_dim(cfg) else value


def sliding_window(cfg: Mapping) -> int:
    """The window of sliding layers. MiMo-V2's ``sliding_window_size`` counts the earlier
    tokens a query sees, so its window is one more (transformers reads it so)."""
    if model_type(cfg).startswith("mimo_v2") and cfg.get("sliding_window_size") is not None:
        return need_int(cfg, "sliding_window_size", why="sliding-window layers") + 1
    return need_int(cfg, "sliding_window", why="sliding-window layers")


def kv_heads(cfg: Mapping) -> int:
    if cfg.get("num_key_value_heads") is None:
        return num_heads(cfg)
    return need_int(cfg, "num_key_value_heads", why="attention geometry")


def kv_layout(cfg: Mapping, fmt: str) -> Layout:
    """Per-token K/V of one attention layer in storage format ``fmt`` (resolved)."""
    if is_mla(cfg):
        rank = need_int(cfg, "kv_lora_rank", why="the MLA latent")
        rope = need_int(cfg, "qk_rope_head_dim", why="the MLA latent", minimum=0)
        return MLALatent(rank, rope, fmt)  # type: ignore[arg-type]
    if fmt == "fp8_ds_mla":
        raise ConfigError("fp8_ds_mla is an MLA-only format")  # callers check first
    return AttentionKV(kv_heads(cfg), head_dim(cfg), parse_dtype(fmt), value_head_dim(cfg))


def indexer_layout(cfg: Mapping) -> IndexerKV | None:
    """DeepSeek-V3.2 sparse-attention indexer cache, when ``index_head_dim`` is set."""
    if cfg.get("index_head_dim") is None:
        return None
    return IndexerKV(need_int(cfg, "index_head_dim", why="the indexer cache"))


def _scale(cfg: Mapping, scalar: float | None) -> float | None:
    """Softmax scale from ``query_pre_attn_scalar``; None when it is the default
    1/sqrt(head_dim) (transformers fills scalar = head_dim for some families)."""
    if scalar is None:
        return None
    if not is_mla(cfg) and scalar == head_dim(cfg):
        return None
    return scalar ** -0.5


def retention_and_mask(cfg: Mapping, kind: str) -> tuple[Retention, Attention]:
    """Retention and mask of an attention layer of canonical ``kind``."""
    soft_cap = opt_positive_float(cfg, "attn_logit_softcapping")
    scalar = opt_positive_float(cfg, "query_pre_attn_scalar")
    sinks = model_type(cfg) in _SINK_MODEL_TYPES or bool(
        cfg.get("add_swa_attention_sink_bias" if kind == SLIDING else "add_full_attention_sink_bias")
    )
    common = {
        "sinks": sinks,
        "soft_cap": soft_cap,
        "scale": _scale(cfg, scalar),
    }
    if kind == FULL:
        return Full(), Attention(**common)
    if kind == SLIDING:
        window = sliding_window(cfg)
        return SlidingWindow(window), Attention(window=window, **common)
    if kind == CHUNKED:
        chunk = need_int(cfg, "attention_chunk_size", why="chunked-attention layers")
        return ChunkedLocal(chunk), Attention(chunk=chunk, **common)
    raise ConfigError(f"{kind!r} is not an attention layer kind")
