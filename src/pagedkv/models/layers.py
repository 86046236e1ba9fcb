"""A config's layers as LayerSpecs: the pattern, then each layer's layout/retention/mask."""

from __future__ import annotations

from collections.abc import Mapping

from pagedkv.errors import ConfigError
from pagedkv.kvspec import TARGET, LayerSpec, Recurrent
from pagedkv.models.attention import (
    indexer_layout,
    is_mla,
    kv_layout,
    resolve_kv_dtype,
    retention_and_mask,
)
from pagedkv.models.deepseek_v4 import deepseek_v4_layers, is_deepseek_v4
from pagedkv.models.drafters import as_drafter, drafter_role
from pagedkv.models.fields import opt_int, text_config
from pagedkv.models.geometry import refuse_unmodelled
from pagedkv.models.minimax_m3 import index_key_layout, is_minimax_m3, sparse_layers
from pagedkv.models.overrides import layer_fields
from pagedkv.models.pattern import ATTENTION_KINDS, RECURRENT, layer_pattern
from pagedkv.models.recurrent import MAMBA1, MAMBA2, recurrent_state


def _prefix(model: str) -> str:
    return "model" if model == TARGET else model


def _names_preview(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} layers)" if len(names) > limit else "")


def _refuse_ds_mla_on_gqa(cfg: Mapping, pattern: tuple[str, ...], model: str) -> None:
    if is_mla(cfg):
        return
    names = [
        f"{_prefix(model)}.layers.{i}.self_attn"
        for i, kind in enumerate(pattern)
        if kind in ATTENTION_KINDS
    ]
    if names:
        raise ConfigError(
            "kv_dtype fp8_ds_mla is DeepSeek's MLA latent format, but these layers are "
            f"GQA/MHA attention (no kv_lora_rank): {_names_preview(names)}"
        )


def kv_shared_from(cfg: Mapping, num_layers: int) -> int:
    """Index of the first layer that reuses an earlier layer's K/V (Gemma ``num_kv_shared_layers``:
    the last N layers cache nothing), or ``num_layers`` when none does."""
    shared = opt_int(cfg, "num_kv_shared_layers", default=0) or 0
    if shared > num_layers:
        raise ConfigError(
            f"num_kv_shared_layers {shared} exceeds num_hidden_layers {num_layers}"
        )
    return num_layers - shared


def layers_from_config(
    config: Mapping, *, model: str = TARGET, kv_dtype: str = "auto"
) -> tuple[LayerSpec, ...]:
    """LayerSpecs of every cache-holding layer of ``config``, in layer order.

    ``model`` names the model the layers belong to (``"target"``, or e.g. ``"draft"``):
    layer names start with ``model.`` for the target and with the model name otherwise,
    and ``index`` is the layer's index inside its own model. A drafter config (see
    :mod:`pagedkv.models.drafters`) yields its layers with the drafter's mask and
    position offset. ``kv_dtype`` is ``auto`` (the config's dtype), ``bf16``, ``fp16``,
    ``fp8`` or ``fp8_ds_mla`` (MLA only); recurrent states keep their own dtypes.
    """
    cfg = text_config(config)
    refuse_unmodelled(cfg)
    fmt = resolve_kv_dtype(cfg, kv_dtype)
    role = drafter_role(cfg)
    if is_deepseek_v4(cfg):
        layers = deepseek_v4_layers(cfg, fmt, model)
        if role.kind != "model":
            layers = [as_drafter(layer, role) for layer in layers]
        return tuple(layers)
    pattern = layer_pattern(cfg)
    cached = kv_shared_from(cfg, len(pattern))
    if fmt == "fp8_ds_mla":
        _refuse_ds_mla_on_gqa(cfg, pattern, model)
    prefix = _prefix(model)
    sparse = sparse_layers(cfg) if is_minimax_m3(cfg) else frozenset()
    layers: list[LayerSpec] = []
    state = None
    for i, kind in enumerate(pattern):
        if kind in ATTENTION_KINDS and i < cached:
            fields = layer_fields(cfg, i, kind)
            retention, attention = retention_and_mask(fields, kind)
            base = f"{prefix}.layers.{i}.self_attn"
            layers.append(
                LayerSpec(base, kv_layout(fields, fmt), retention, attention, model, 0, i)
            )
            if i in sparse:  # MiniMax-M3: an indexer key per token beside K/V
                layers.append(LayerSpec(
                    f"{base}.indexer", index_key_layout(cfg), retention, attention, model, 0, i
                ))
                continue
            indexer = None if is_minimax_m3(cfg) else indexer_layout(cfg)
            if indexer is not None:
                if not is_mla(cfg):
                    raise ConfigError(
                        "index_head_dim (DeepSeek-V3.2 indexer) is set on a model without "
                        "MLA layers (no kv_lora_rank)"
                    )
                layers.append(
                    LayerSpec(f"{base}.indexer", indexer, retention, attention, model, 0, i)
                )
        elif kind == RECURRENT:
            state = state or recurrent_state(layer_fields(cfg, i, kind))
            suffix = "mamba" if state.family in (MAMBA1, MAMBA2) else "linear_attn"
            layers.append(
                LayerSpec(f"{prefix}.layers.{i}.{suffix}", state, Recurrent(), None, model, 0, i)
            )
    if role.kind != "model":
        layers = [as_drafter(layer, role) for layer in layers]
    return tuple(layers)
