"""Per-layer fields: the config a single decoder layer is built from.

Most configs give one geometry for every layer. Some give layers their own fields, and
this module folds those into one mapping per layer so that every reader downstream
(K/V layout, weights) sees plain field names:

- ``per_layer_config`` ({layer index: {field: value}}), the form transformers' own config
  classes write (Gemma 4, Step);
- Gemma 4 as published: full-attention layers use ``global_head_dim`` (default 512) and,
  when ``attention_k_eq_v`` is set, ``num_global_key_value_heads`` KV heads;
- MiMo-V2: sliding layers use ``swa_num_attention_heads``, ``swa_num_key_value_heads``,
  ``swa_head_dim`` and ``swa_v_head_dim``;
- Nemotron NAS ``block_configs``: KV heads = heads / ``attention.n_heads_in_group`` and the
  MLP width from ``ffn.ffn_mult`` (rounded up to a multiple of 256, as DeciLM does).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pagedkv.errors import ConfigError
from pagedkv.models.fields import model_type, need_int
from pagedkv.models.pattern import FULL, SLIDING, block_config

_SWA_FIELDS = {
    "swa_num_attention_heads": "num_attention_heads",
    "swa_num_key_value_heads": "num_key_value_heads",
    "swa_head_dim": "head_dim",
    "swa_v_head_dim": "v_head_dim",
}
GEMMA4_GLOBAL_HEAD_DIM = 512  # transformers' default when global_head_dim is absent


def _per_layer_entry(cfg: Mapping, index: int) -> Mapping:
    table = cfg.get("per_layer_config")
    if not table:
        return {}
    if not isinstance(table, Mapping):
        raise ConfigError(f"per_layer_config must be an object, got {type(table).__name__}")
    for key, value in table.items():
        try:
            matches = int(key) == index
        except (TypeError, ValueError):
            raise ConfigError(f"per_layer_config key {key!r} is not a layer index") from None
        if matches:
            if not isinstance(value, Mapping):
                raise ConfigError(f"per_layer_config[{key!r}] must be an object, got {value!r}")
            return value
    return {}


def _gemma4_global(cfg: Mapping) -> dict:
    out = {"head_dim": cfg.get("global_head_dim") or GEMMA4_GLOBAL_HEAD_DIM}
    if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads") is not None:
        out["num_key_value_heads"] = cfg["num_global_key_value_heads"]
    return out


def _nas_block(cfg: Mapping, index: int) -> dict:
    block = block_config(cfg, index)
    out: dict = {}
    attention = block.get("attention") or {}
    group = attention.get("n_heads_in_group")
    if group is not None and not attention.get("no_op") and not attention.get("replace_with_linear"):
        heads = need_int(cfg, "num_attention_heads", why="block_configs attention")
        if not isinstance(group, int) or group <= 0 or heads % group:
            raise ConfigError(
                f"block_configs[{index}].attention.n_heads_in_group must divide "
                f"num_attention_heads {heads}, got {group!r}"
            )
        out["num_key_value_heads"] = heads // group
    ffn = block.get("ffn") or {}
    if ffn.get("no_op") or ffn.get("replace_with_linear"):
        out["intermediate_size"] = 0
        out["_ffn_linear"] = bool(ffn.get("replace_with_linear"))
    elif ffn.get("ffn_mult") is not None:
        mult = ffn["ffn_mult"]
        if not isinstance(mult, (int, float)) or mult <= 0:
            raise ConfigError(f"block_configs[{index}].ffn.ffn_mult must be > 0, got {mult!r}")
        hidden = need_int(cfg, "hidden_size", why="block_configs ffn_mult")
        out["intermediate_size"] = 256 * math.ceil(int(2 * mult * hidden / 3) / 256)
    return out


def layer_fields(cfg: Mapping, index: int, kind: str) -> Mapping:
    """The fields decoder layer ``index`` (of canonical ``kind``) is built from."""
    changes: dict = {}
    if cfg.get("block_configs") is not None:
        changes.update(_nas_block(cfg, index))
    if kind == FULL and model_type(cfg).startswith("gemma4") and not cfg.get("per_layer_config"):
        changes.update(_gemma4_global(cfg))
    if kind == SLIDING:
        changes.update({plain: cfg[swa] for swa, plain in _SWA_FIELDS.items()
                        if cfg.get(swa) is not None})
    changes.update(_per_layer_entry(cfg, index))
    if not changes:
        return cfg
    return {**cfg, **changes}
