"""Bytes per parameter of each part of a model, as its ``quantization_config`` stores them.

Parts: ``embedding`` (embeddings and LM head), ``mixer`` (attention / recurrent
projections), ``dense`` (dense MLPs, shared experts, drafter fusion layers), ``experts``
(routed experts), ``other`` (routers, small heads). Quantized linear layers take the
scheme's bits plus its scales (and zero points) per group; a part stays in the model
dtype when the config's exclusion list (``modules_to_not_convert``, ``ignore``,
``exclude_modules``) names its modules; embeddings always do. Schemes:

============================ ===================================================
fp8 (``fp8``, ``fbgemm_fp8``) 1 byte + one fp32 scale per ``weight_block_size`` block
mxfp4                         4 bits + one 8-bit scale per 32 (gpt-oss: experts only,
                              by its exclusion list)
NVFP4 (ModelOpt, compressed-  4 bits + one fp8 scale per 16
tensors float 4-bit)
GPTQ / AWQ                    N bits + a 16-bit scale and an N-bit zero point per group
compressed-tensors            the ``weights`` scheme of the group targeting Linear:
                              N bits + scale per group (zero point when asymmetric)
============================ ===================================================
"""

from __future__ import annotations

import fnmatch
import re
import warnings
from collections.abc import Mapping

from pagedkv.errors import ConfigError
from pagedkv.models.fields import model_dtype

EMBEDDING, MIXER, DENSE, EXPERTS, OTHER = "embedding", "mixer", "dense", "experts", "other"
PARTS = (EMBEDDING, MIXER, DENSE, EXPERTS, OTHER)

# module names standing for each quantizable part, in the spellings checkpoints use
_REPRESENTATIVES = {
    MIXER: ("model.layers.0.self_attn.q_proj", "model.language_model.layers.0.self_attn.q_proj",
            "model.layers.0.mixer.in_proj", "model.layers.0.linear_attn.in_proj_qkvz"),
    DENSE: ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.shared_experts.gate_proj",
            "model.layers.0.mlp.shared_expert.gate_proj",
            "model.language_model.layers.0.mlp.gate_proj"),
    EXPERTS: ("model.layers.0.mlp.experts.0.gate_proj",
              "model.layers.0.block_sparse_moe.experts.0.w1",
              "model.language_model.layers.0.mlp.experts.0.gate_proj"),
}
_EXCLUDE_KEYS = ("modules_to_not_convert", "ignore", "exclude_modules", "ignored_layers")


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*")
    return name == pattern or name.startswith(pattern + ".") or f".{pattern}." in f".{name}."


def _names(where: Mapping, key: str, default: list) -> list:
    """A list field of module names or targets (``default`` when absent or null)."""
    value = where.get(key)
    if value is None:
        return default
    if not isinstance(value, list):
        raise ConfigError(f"quantization_config field {key!r} must be a list, got {value!r}")
    return value


def _block_scale_bytes(block: object, key: str) -> float:
    """Bytes per parameter of an fp8 scheme with one fp32 scale per ``block`` (rows, cols);
    a config without a block size has one scale per tensor (~0 per parameter)."""
    if block is None:
        return 1.0
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError(
            f"quantization_config field {key!r} must be two positive integers, got {block!r}")
    return 1.0 + 4.0 / (block[0] * block[1])


def _bits(value: object, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 32:
        raise ConfigError(
            f"quantization_config field {key!r} must be an integer from 1 to 32, got {value!r}")
    return value


def _excluded_parts(quant: Mapping) -> set[str]:
    patterns = [p for key in _EXCLUDE_KEYS for p in _names(quant, key, []) if isinstance(p, str)]
    return {
        part for part, names in _REPRESENTATIVES.items()
        if any(_matches(p, n) for p in patterns for n in names)
    }


def _group_bits(bits: float, group: int | None, scale_bytes: float, zero: bool) -> float:
    """Bytes per parameter of an N-bit scheme with one scale (and zero point) per group."""
    per = bits / 8
    if group and group > 0:
        per += scale_bytes / group + (bits / 8 / group if zero else 0.0)
    return per


def _compressed_tensors(quant: Mapping) -> float | None:
    groups = quant.get("config_groups")
    if not isinstance(groups, Mapping):
        return None
    schemes = [g for g in groups.values() if isinstance(g, Mapping)
               and isinstance(g.get("weights"), Mapping)]
    linear = [g for g in schemes if "Linear" in _names(g, "targets", ["Linear"])]
    chosen = (linear or schemes or [None])[0]
    if chosen is None or chosen["weights"].get("num_bits") is None:
        return None
    w = chosen["weights"]
    bits, group = _bits(w["num_bits"], "num_bits"), w.get("group_size")
    if group is not None and (not isinstance(group, int) or isinstance(group, bool)):
        raise ConfigError(f"quantization_config field 'group_size' must be an integer, "
                          f"got {group!r}")
    fmt = str(chosen.get("format") or quant.get("format") or "")
    if w.get("type") == "float" and bits == 4:  # mxfp4 (uint8 scale / 32) or nvfp4 (fp8 / 16)
        return _group_bits(4, group or (32 if "mx" in fmt else 16), 1.0, False)
    if w.get("type") == "float" and bits == 8:
        return _block_scale_bytes(w.get("block_structure"), "block_structure")
    return _group_bits(bits, group, 2.0, w.get("symmetric") is False)


def _scheme_bytes(quant: Mapping) -> float | None:
    """Bytes per parameter of the config's quantized linear layers (None: unknown)."""
    method = str(quant.get("quant_method", "")).lower()
    if method in ("fp8", "fbgemm_fp8", "fine_grained_fp8"):
        return _block_scale_bytes(quant.get("weight_block_size"), "weight_block_size")
    if method == "mxfp4":
        return _group_bits(4, 32, 1.0, False)
    if method == "modelopt":
        algo = str(quant.get("quant_algo", "")).upper()
        if algo == "NVFP4":
            return _group_bits(4, 16, 1.0, False)
        if algo == "FP8":
            return 1.0
        return _compressed_tensors(quant)
    if method in ("gptq", "awq", "gptq_marlin", "awq_marlin"):
        bits = quant.get("bits", quant.get("w_bit"))
        group = quant.get("group_size", quant.get("q_group_size", 128))
        if bits is not None and isinstance(group, int) and not isinstance(group, bool):
            return _group_bits(_bits(bits, "bits"), group if group > 0 else None, 2.0, True)
        return None
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    if quant.get("bits") is not None:
        return _bits(quant["bits"], "bits") / 8
    return None


def bytes_per_parameter(cfg: Mapping) -> dict[str, float]:
    """Bytes per parameter of each part (see the module docstring)."""
    base = float(model_dtype(cfg).itemsize)
    table = dict.fromkeys(PARTS, base)
    quant = cfg.get("quantization_config")
    if not isinstance(quant, Mapping):
        return table
    per = _scheme_bytes(quant)
    if per is None:
        warnings.warn(
            f"quantization method {quant.get('quant_method')!r} is unknown to the weight "
            f"estimate; counting weights at {base:g} bytes per parameter",
            stacklevel=4,
        )
        return table
    excluded = _excluded_parts(quant)
    for part in (MIXER, DENSE, EXPERTS):
        if part not in excluded:
            table[part] = per
    return table
