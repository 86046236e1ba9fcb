"""Optional: let transformers' own config class fill a config's defaults before reading it.

``normalize_config(d)`` builds ``CONFIG_MAPPING[d["model_type"]](**d)`` offline and returns
its ``to_dict()``: every default the family's class fills in (layer types, NoPE layers,
per-layer head dims...) becomes an explicit field. pagedkv's own readers apply the same
defaults, so both paths give the same layers (a test checks this over the published
configs); this path is a cross-check, and the way to read families whose defaults pagedkv
does not know. transformers is imported here only, lazily: the core stays standard-library.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from pagedkv.errors import ConfigError, UnsupportedArchitectureError


def _config_classes():
    try:
        from transformers import CONFIG_MAPPING
    except ImportError as exc:
        raise ConfigError(
            "reading configs through transformers needs the transformers package "
            f"(pip install transformers): {exc}"
        ) from exc
    return CONFIG_MAPPING


def _build(cls, fields: Mapping) -> dict:
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)  # its notes on unused keys are not ours to print
    try:
        return cls(**fields).to_dict()
    except Exception as exc:  # noqa: BLE001 -- any failure of a foreign class is one refusal
        raise ConfigError(
            f"transformers' {cls.__name__} cannot build this config: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        logger.setLevel(level)


def normalize_config(config: Mapping) -> dict:
    """``config`` as transformers' config class for its ``model_type`` writes it back.

    A config whose decoder fields sit at the top level although its class keeps them in a
    ``text_config`` sub-config has that part built by the sub-config's class from the top
    level, so the fields are not replaced by the class's defaults.
    """
    mapping = _config_classes()
    kind = config.get("model_type")
    if not isinstance(kind, str) or kind not in mapping:
        raise UnsupportedArchitectureError(
            f"transformers has no config class for model_type {kind!r}"
        )
    cls = mapping[kind]
    out = _build(cls, config)
    text_cls = getattr(cls, "sub_configs", {}).get("text_config")
    if text_cls is not None and "text_config" not in config:
        out["text_config"] = _build(text_cls, config)
    for key in ("quantization_config", "torch_dtype", "dtype"):
        if key in config and key not in out:  # fields pagedkv reads beside the geometry
            out[key] = config[key]
    return out
