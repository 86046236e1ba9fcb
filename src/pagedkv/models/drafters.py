"""Speculative drafters: what kind a draft config is, read from its fields.

Checked in this order; the first that matches decides:

1. ``speculators_model_type`` starting with "eagle" -> **eagle**.
2. **block drafter** (DFlash, or DSpark when ``markov_rank`` > 0 or
   ``dflash_config.projector_type`` is "dspark"): a ``dflash_config`` object, a
   ``speculators_model_type`` of "dflash"/"dspark", or a top-level ``block_size`` together
   with target-layer ids (``target_layer_ids`` / ``aux_hidden_state_layer_ids``, top level or
   in ``dflash_config``). The draft block B is ``dflash_config.block_size`` else
   ``block_size``. Layers: non-causal inside draft blocks of B, position_offset 0 (they
   are conditioned on target hidden states of the same positions).
3. **eagle**: ``draft_vocab_size``, ``eagle_config``, ``eagle_aux_hidden_state_layer_ids``,
   or an ``architectures`` entry containing "Eagle". Layers: causal, position_offset 1
   (the drafter's KV at position i is computed from token i+1).
4. otherwise an ordinary causal **model** used as a draft: layers as its config says.

An EAGLE-1 checkpoint whose config has none of the EAGLE fields reads as a plain model.
DeepSeek MTP (``--draft mtp``) is not a separate config: the target's own
``num_nextn_predict_layers`` layers (:func:`mtp_layers`), causal, position_offset 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from pagedkv.errors import ConfigError, UnsupportedArchitectureError
from pagedkv.kvspec import LayerSpec
from pagedkv.models.attention import (
    indexer_layout,
    is_mla,
    kv_layout,
    resolve_kv_dtype,
    retention_and_mask,
)
from pagedkv.models.fields import model_type, need_int, opt_int, text_config
from pagedkv.models.pattern import FULL

MODEL, EAGLE, DFLASH, DSPARK = "model", "eagle", "dflash", "dspark"
DRAFT = "draft"  # the ``model`` of drafter layers


@dataclass(frozen=True)
class DrafterRole:
    """How a config's layers behave as a drafter (``model`` for an ordinary model)."""

    kind: str = MODEL
    position_offset: int = 0
    draft_block: int | None = None

    @property
    def is_block(self) -> bool:
        return self.draft_block is not None


def _dflash_config(cfg: Mapping) -> Mapping:
    inner = cfg.get("dflash_config")
    if inner is None:
        return {}
    if not isinstance(inner, Mapping):
        raise ConfigError(f"dflash_config must be an object, got {inner!r}")
    return inner


def target_layer_ids(cfg: Mapping) -> list[int] | None:
    """Target layers whose hidden states condition a drafter (DFlash/DSpark/EAGLE-3)."""
    for source in (_dflash_config(cfg), cfg):
        for key in ("target_layer_ids", "aux_hidden_state_layer_ids",
                    "eagle_aux_hidden_state_layer_ids"):
            if source.get(key) is not None:
                ids = source[key]
                if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                    raise ConfigError(f"{key} must be a list of integers, got {ids!r}")
                return ids
    eagle = cfg.get("eagle_config")
    if isinstance(eagle, Mapping) and isinstance(eagle.get("eagle_aux_hidden_state_layer_ids"), list):
        return list(eagle["eagle_aux_hidden_state_layer_ids"])
    return None


def _is_eagle(cfg: Mapping) -> bool:
    if any(cfg.get(k) is not None for k in
           ("draft_vocab_size", "eagle_config", "eagle_aux_hidden_state_layer_ids")):
        return True
    spec_type = cfg.get("speculators_model_type")
    if isinstance(spec_type, str) and spec_type.lower().startswith("eagle"):
        return True
    archs = cfg.get("architectures") or []
    return isinstance(archs, list) and any("eagle" in str(a).lower() for a in archs)


def markov_rank(cfg: Mapping) -> int:
    """Rank of DSpark's low-rank Markov head (0: none)."""
    inner = _dflash_config(cfg)
    source = inner if inner.get("markov_rank") is not None else cfg
    return opt_int(source, "markov_rank", default=0) or 0


def drafter_role(config: Mapping) -> DrafterRole:
    """Read a config's drafter role from its fields (see the module docstring)."""
    cfg = text_config(config)
    spec_type = str(cfg.get("speculators_model_type") or "").lower()
    if spec_type.startswith("eagle"):
        return DrafterRole(EAGLE, position_offset=1)
    dflash = _dflash_config(cfg)
    has_block = dflash.get("block_size") is not None or cfg.get("block_size") is not None
    if dflash or spec_type in (DFLASH, DSPARK) or (has_block and target_layer_ids(cfg)):
        source = dflash if dflash.get("block_size") is not None else cfg
        block = need_int(source, "block_size", why="the DFlash/DSpark draft block")
        dspark = markov_rank(cfg) > 0 or dflash.get("projector_type") == DSPARK
        return DrafterRole(DSPARK if dspark else DFLASH, position_offset=0, draft_block=block)
    if _is_eagle(cfg):
        return DrafterRole(EAGLE, position_offset=1)
    return DrafterRole(MODEL)


def as_drafter(layer: LayerSpec, role: DrafterRole) -> LayerSpec:
    """Apply a drafter role to one layer: its position offset and, for block drafters,
    a non-causal mask inside draft blocks."""
    attention = layer.attention
    if attention is not None and role.is_block:
        attention = replace(attention, causal=False, draft_block=role.draft_block)
    return replace(layer, attention=attention, position_offset=role.position_offset)


def num_mtp_layers(config: Mapping) -> int:
    cfg = text_config(config)
    return opt_int(cfg, "num_nextn_predict_layers", "mtp_num_hidden_layers", default=0) or 0


def mtp_layers(config: Mapping, *, kv_dtype: str = "auto", model: str = DRAFT) -> tuple[LayerSpec, ...]:
    """The target's own multi-token-prediction layers as a drafter (``--draft mtp``).

    Each is one full decoder block with the target's attention geometry (MLA for DeepSeek,
    plus its indexer on V3.2), causal, and position_offset 1: the MTP block at position i
    reads the embedding of token i+1.
    """
    cfg = text_config(config)
    count = num_mtp_layers(cfg)
    if count <= 0:
        raise ConfigError(
            "the target has no MTP layers (num_nextn_predict_layers is 0 or absent); "
            "--draft mtp needs them"
        )
    layers = need_int(cfg, "num_hidden_layers", why="the target's depth")
    if count > layers:  # a damaged count would build that many specs (10^12: a hang)
        raise ConfigError(f"num_nextn_predict_layers {count} exceeds the target's "
                          f"{layers} layers")
    family = model_type(cfg)
    if family == "deepseek_v4" or family.startswith("minimax_m3"):
        raise UnsupportedArchitectureError(
            f"--draft mtp on model_type {family!r}: transformers skips its MTP weights "
            "(mtp.*) and no public modelling code shows what its MTP layers cache; "
            "refusing rather than planning them as plain attention"
        )
    fmt = resolve_kv_dtype(cfg, kv_dtype)
    if fmt == "fp8_ds_mla" and not is_mla(cfg):
        raise ConfigError(
            "kv_dtype fp8_ds_mla is DeepSeek's MLA latent format, but the MTP layers "
            f"{model}.layers.0..{count - 1}.self_attn are GQA/MHA attention (no kv_lora_rank)"
        )
    retention, attention = retention_and_mask(cfg, FULL)
    indexer = indexer_layout(cfg)
    layers = []
    for j in range(count):
        base = f"{model}.layers.{j}.self_attn"
        layers.append(LayerSpec(base, kv_layout(cfg, fmt), retention, attention, model, 1, j))
        if indexer is not None:
            layers.append(LayerSpec(f"{base}.indexer", indexer, retention, attention, model, 1, j))
    return tuple(layers)
