"""Models: HF ``config.json`` (and a bundled catalog) -> LayerSpecs for target + drafter.

Configs are read by their fields (``layer_types``, ``kv_lora_rank``, ``linear_attn_config``,
``hybrid_override_pattern``...), never by an allow-list of class names; a config whose
architecture cannot be read raises :class:`~pagedkv.errors.UnsupportedArchitectureError`
or :class:`~pagedkv.errors.ConfigError` naming what is missing. Family defaults are applied
as the family's transformers config class applies them (:mod:`~pagedkv.models.pattern`,
:mod:`~pagedkv.models.overrides`); DeepSeek-V4 compressed attention and MiniMax-M3 sparse
attention are read as their transformers modelling code caches them
(:mod:`~pagedkv.models.deepseek_v4`, :mod:`~pagedkv.models.minimax_m3`); fields that change the
cache in ways pagedkv does not model are refused by name (:mod:`~pagedkv.models.geometry`); drafters are checked against their
target (:mod:`~pagedkv.models.compat`). Standard library only; the optional
:mod:`~pagedkv.models.via_transformers` imports transformers lazily.
"""

from pagedkv.models.catalog import catalog_description, catalog_names, catalog_source
from pagedkv.models.config import load_config
from pagedkv.models.drafters import drafter_role, mtp_layers
from pagedkv.models.layers import layers_from_config
from pagedkv.models.model import ModelSpec, load_model
from pagedkv.models.weights import (
    estimate_parameters,
    estimate_weight_bytes,
    parameter_counts,
)

__all__ = [
    "ModelSpec", "catalog_description", "catalog_names", "catalog_source", "drafter_role",
    "estimate_parameters", "estimate_weight_bytes", "layers_from_config", "load_config",
    "load_model", "mtp_layers", "parameter_counts",
]
