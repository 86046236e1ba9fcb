"""Recurrent-state layers: which mixer a ``recurrent`` layer is, and its state tensors.

The mixer is read from fields (exactly one family must match):

========== ======================================================= ======================
family     fields                                                  state per request
========== ======================================================= ======================
kda        ``linear_attn_config`` {num_heads H, head_dim D,         conv [k-1, 3*H*D],
           short_conv_kernel_size k} (Kimi-Linear / Kimi-K3)        recurrent [H, D, D]
gdn        ``linear_num_value_heads`` Hv, ``linear_num_key_heads``  conv [k-1, 2*Hk*Dk+Hv*Dv],
           Hk, ``linear_key_head_dim`` Dk, ``linear_value_head_dim`` recurrent [Hv, Dk, Dv]
           Dv, ``linear_conv_kernel_dim`` k (Qwen3-Next)
mamba2     ``mamba_num_heads`` H, ``mamba_head_dim`` P,              conv [k-1, H*P+2*G*N],
           ``ssm_state_size`` N, ``n_groups`` G, ``conv_kernel`` k    ssm [H, P, N]
           (Nemotron-H; Bamba's ``mamba_n_heads``... spellings too)
mamba1     ``mamba_d_state`` N, ``mamba_d_conv`` k, ``mamba_expand`` conv [k-1, e*hidden],
           e, ``hidden_size`` (Jamba)                               ssm [e*hidden, N]
lightning  ``attn_type_list`` / ``linear_attn_alpha_factor`` /     kv [H, D, D]
           ``layernorm_linear_attention_alpha`` (MiniMax); heads
           and head_dim of the attention
========== ======================================================= ======================

Dtypes, as engines keep them: KDA, GatedDeltaNet and lightning states are fp32 (every
tensor); Mamba-1/2 conv states are in the model dtype and their SSM state in the model
dtype too. A config's ``mamba_ssm_cache_dtype`` (Qwen3.5: ``mamba_ssm_dtype``; not "auto")
overrides the dtype of the recurrent/SSM tensor of any family (Nemotron-H's config class
defaults it to float32). ``shard_dim`` marks the head/channel dimension that
tensor parallelism splits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pagedkv.errors import ConfigError, UnsupportedArchitectureError
from pagedkv.kvspec import DType, RecurrentState, StateTensor, parse_dtype
from pagedkv.models.attention import head_dim, num_heads
from pagedkv.models.fields import first, model_dtype, model_type, need_int

KDA, GDN, MAMBA2, MAMBA1, LIGHTNING = "kda", "gdn", "mamba2", "mamba1", "lightning"

_SIGNATURES = {
    KDA: ("linear_attn_config",),
    GDN: ("linear_num_value_heads", "linear_key_head_dim"),
    MAMBA2: ("mamba_num_heads", "mamba_n_heads"),
    MAMBA1: ("mamba_d_state", "mamba_expand"),
    LIGHTNING: ("attn_type_list", "linear_attn_alpha_factor", "layernorm_linear_attention_alpha"),
}


_PURE = {"mamba": MAMBA1, "falcon_mamba": MAMBA1, "mamba2": MAMBA2}


def recurrent_family(cfg: Mapping) -> str:
    """The one mixer family whose fields the config has (see the module table); pure
    Mamba models (``model_type`` mamba, falcon_mamba, mamba2) by their type."""
    if model_type(cfg) in _PURE:
        return _PURE[model_type(cfg)]
    found = [fam for fam, keys in _SIGNATURES.items() if any(cfg.get(k) is not None for k in keys)]
    if MAMBA2 in found and MAMBA1 in found:  # Bamba-style Mamba2 configs also use mamba_d_state
        found.remove(MAMBA1)
    if len(found) == 1:
        return found[0]
    if not found:
        wanted = "; ".join(f"{fam}: {' or '.join(keys)}" for fam, keys in _SIGNATURES.items())
        raise UnsupportedArchitectureError(
            "config has linear-attention / Mamba layers but no fields saying which mixer "
            f"they are (looked for {wanted})"
        )
    raise UnsupportedArchitectureError(
        f"config has fields of several recurrent mixers ({', '.join(found)}); cannot tell "
        "which one its recurrent layers use"
    )


def _ssm_dtype(cfg: Mapping, default: DType) -> DType:
    name = first(cfg, "mamba_ssm_cache_dtype", "mamba_ssm_dtype")  # Qwen3.5 spells it so
    if name is None or name == "auto":
        return default
    if not isinstance(name, str):
        raise ConfigError(f"mamba_ssm_cache_dtype must be a string, got {name!r}")
    return parse_dtype(name)


def _kda(cfg: Mapping) -> RecurrentState:
    lac = cfg["linear_attn_config"]
    if not isinstance(lac, Mapping):
        raise ConfigError(f"linear_attn_config must be an object, got {lac!r}")
    why = "the KDA state (linear_attn_config)"
    heads = need_int(lac, "num_heads", why=why)
    dim = need_int(lac, "head_dim", why=why)
    kernel = need_int(lac, "short_conv_kernel_size", why=why, minimum=2)
    return RecurrentState(
        (
            StateTensor("conv", (kernel - 1, 3 * heads * dim), DType.FP32, shard_dim=1),
            StateTensor("recurrent", (heads, dim, dim), _ssm_dtype(cfg, DType.FP32), shard_dim=0),
        ),
        family=KDA,
    )


def _gdn(cfg: Mapping) -> RecurrentState:
    why = "the GatedDeltaNet state"
    v_heads = need_int(cfg, "linear_num_value_heads", why=why)
    k_heads = need_int(cfg, "linear_num_key_heads", why=why)
    k_dim = need_int(cfg, "linear_key_head_dim", why=why)
    v_dim = need_int(cfg, "linear_value_head_dim", why=why)
    kernel = need_int(cfg, "linear_conv_kernel_dim", why=why, minimum=2)
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    return RecurrentState(
        (
            StateTensor("conv", (kernel - 1, conv_dim), DType.FP32, shard_dim=1),
            StateTensor(
                "recurrent", (v_heads, k_dim, v_dim), _ssm_dtype(cfg, DType.FP32), shard_dim=0
            ),
        ),
        family=GDN,
    )


def mamba2_dims(cfg: Mapping) -> tuple[int, int, int, int, int]:
    """(heads, head_dim, state, groups, conv kernel) of a Mamba2 mixer."""
    why = "the Mamba2 state"
    pure = model_type(cfg) == "mamba2"  # transformers' Mamba2Config spells them plainly
    heads = need_int(cfg, "mamba_num_heads", "mamba_n_heads", *(("num_heads",) if pure else ()),
                     why=why)
    dim = need_int(cfg, "mamba_head_dim", "mamba_d_head", *(("head_dim",) if pure else ()),
                   why=why)
    state = need_int(cfg, "ssm_state_size", "mamba_d_state", "state_size", why=why)
    groups = need_int(cfg, "n_groups", "mamba_n_groups", why=why)
    kernel = need_int(cfg, "conv_kernel", "mamba_d_conv", why=why, minimum=2)
    return heads, dim, state, groups, kernel


def _mamba2(cfg: Mapping) -> RecurrentState:
    heads, dim, state, groups, kernel = mamba2_dims(cfg)
    dtype = model_dtype(cfg)
    conv_dim = heads * dim + 2 * groups * state
    return RecurrentState(
        (
            StateTensor("conv", (kernel - 1, conv_dim), dtype, shard_dim=1),
            StateTensor("ssm", (heads, dim, state), _ssm_dtype(cfg, dtype), shard_dim=0),
        ),
        family=MAMBA2,
    )


def mamba1_dims(cfg: Mapping) -> tuple[int, int, int]:
    """(inner channels, state, conv kernel) of a Mamba-1 mixer."""
    why = "the Mamba state"
    state = need_int(cfg, "mamba_d_state", "state_size", why=why)
    kernel = need_int(cfg, "mamba_d_conv", "conv_kernel", why=why, minimum=2)
    if model_type(cfg) in _PURE and cfg.get("intermediate_size") is not None:
        return need_int(cfg, "intermediate_size", why=why), state, kernel
    hidden = need_int(cfg, "hidden_size", why=why)
    expand = need_int(cfg, "mamba_expand", "expand", why=why)
    return expand * hidden, state, kernel


def _mamba1(cfg: Mapping) -> RecurrentState:
    inner, state, kernel = mamba1_dims(cfg)
    dtype = model_dtype(cfg)
    return RecurrentState(
        (
            StateTensor("conv", (kernel - 1, inner), dtype, shard_dim=1),
            StateTensor("ssm", (inner, state), _ssm_dtype(cfg, dtype), shard_dim=0),
        ),
        family=MAMBA1,
    )


def _lightning(cfg: Mapping) -> RecurrentState:
    heads, dim = num_heads(cfg), head_dim(cfg)
    return RecurrentState(
        (StateTensor("kv", (heads, dim, dim), _ssm_dtype(cfg, DType.FP32), shard_dim=0),),
        family=LIGHTNING,
    )


_BUILDERS = {KDA: _kda, GDN: _gdn, MAMBA2: _mamba2, MAMBA1: _mamba1, LIGHTNING: _lightning}


def recurrent_state(cfg: Mapping) -> RecurrentState:
    """State tensors of one recurrent layer of this config, per request."""
    return _BUILDERS[recurrent_family(cfg)](cfg)


def mamba_dt_rank(cfg: Mapping, hidden: int) -> int:
    """Jamba's ``mamba_dt_rank`` ("auto" = ceil(hidden / 16))."""
    value = first(cfg, "mamba_dt_rank", "time_step_rank")
    if value is None or value == "auto":
        return math.ceil(hidden / 16)
    return need_int(cfg, "mamba_dt_rank", "time_step_rank", why="the Mamba dt projection")
