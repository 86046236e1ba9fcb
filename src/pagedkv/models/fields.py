"""Reading fields of a config dict: required/optional integers, nested text configs, dtypes.

Every missing or malformed field raises :class:`ConfigError` naming the field and what
needed it, so a config we cannot read is never silently read as something else.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pagedkv.errors import ConfigError
from pagedkv.kvspec import DType, parse_dtype

# Keys whose value is the decoder's own config inside a wrapper: multimodal models
# (``text_config``) and the vLLM "speculators" drafter format (``transformer_layer_config``).
NESTED_KEYS = ("text_config", "transformer_layer_config")


# Defaults a family's transformers config class fills in when the file leaves a field out,
# where the field changes the cache (reviewed against transformers 5.24).
FAMILY_DEFAULTS = {
    "nemotron_h": {"mamba_ssm_cache_dtype": "float32"},  # NemotronHConfig
    # Gemma3TextConfig: google/gemma-3-4b-it's text_config states no head counts
    "gemma3_text": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "sliding_window": 4096},
}


def _with_family_defaults(cfg: dict) -> dict:
    for key, value in FAMILY_DEFAULTS.get(model_type(cfg), {}).items():
        if cfg.get(key) is None:
            cfg[key] = value
    return cfg


def text_config(config: Mapping) -> dict:
    """The decoder's fields: a nested ``text_config`` merged over the top level, with the
    family's defaults (:data:`FAMILY_DEFAULTS`) under fields the file leaves out.

    Top-level fields the nested config lacks (``torch_dtype``, ``quantization_config``,
    drafter fields such as ``block_size``) still apply, so they are kept underneath.
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"a model config must be a JSON object, got {type(config).__name__}")
    for key in NESTED_KEYS:
        inner = config.get(key)
        if inner is None:
            continue
        if not isinstance(inner, Mapping):
            raise ConfigError(f"{key} must be an object, got {type(inner).__name__}")
        merged = {k: v for k, v in config.items() if k not in NESTED_KEYS}
        merged.update(inner)
        return _with_family_defaults(merged)
    return _with_family_defaults(dict(config))


def first(cfg: Mapping, *keys: str) -> Any:
    """Value of the first of ``keys`` present with a non-null value (None if none is)."""
    for key in keys:
        value = cfg.get(key)
        if value is not None:
            return value
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def need_int(cfg: Mapping, *keys: str, why: str, minimum: int = 1,
             maximum: int | None = None) -> int:
    """The first present of ``keys`` as an integer in [``minimum``, ``maximum``]; ConfigError
    naming it if not."""
    value = first(cfg, *keys)
    names = " / ".join(repr(k) for k in keys)
    if value is None:
        raise ConfigError(f"config lacks {names} (needed for {why})")
    if not _is_int(value) or value < minimum:
        raise ConfigError(f"config field {names} must be an integer >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"config field {names} must be at most {maximum:,}, got {value!r}")
    return value


def opt_int(cfg: Mapping, *keys: str, default: int | None = None, minimum: int = 0) -> int | None:
    """Like :func:`need_int` but ``default`` when absent or null."""
    if first(cfg, *keys) is None:
        return default
    return need_int(cfg, *keys, why="", minimum=minimum)


def opt_positive_float(cfg: Mapping, key: str) -> float | None:
    """A finite number > 0, or None when absent, null or 0 (how configs say "off");
    ConfigError for anything else (a string, a list, a negative or NaN value)."""
    value = cfg.get(key)
    if value is None or (_is_number(value) and value == 0):
        return None
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"config field {key!r} must be a positive number, got {value!r}")
    return float(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def int_list(cfg: Mapping, key: str) -> list[int] | None:
    """A list of integers, or None when absent; ConfigError when it is anything else."""
    value = cfg.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(_is_int(v) for v in value):
        raise ConfigError(f"config field {key!r} must be a list of integers, got {value!r}")
    return list(value)


def model_dtype(cfg: Mapping) -> DType:
    """The dtype an engine runs the model in: ``torch_dtype`` / ``dtype`` of the config.

    As engines do with ``--dtype auto``, a float32 (or absent) dtype runs as bf16.
    """
    name = first(cfg, "torch_dtype", "dtype")
    if name is None:
        return DType.BF16
    if not isinstance(name, str):
        raise ConfigError(f"config field 'torch_dtype' must be a string, got {name!r}")
    try:
        dtype = parse_dtype(name)
    except ConfigError as exc:
        raise ConfigError(f"config field 'torch_dtype': {exc}") from exc
    return DType.BF16 if dtype is DType.FP32 else dtype


def model_type(cfg: Mapping) -> str:
    value = cfg.get("model_type")
    return value if isinstance(value, str) else ""
