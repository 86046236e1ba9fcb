"""DeepSeek-V4's attention caches, as transformers' ``deepseek_v4`` modelling code keeps them.

Every layer attends over a sliding window of shared K=V entries (one head of ``head_dim``
values, ``sliding_window`` tokens). Besides the window, a layer with a compressor keeps:

- ``compressed_sparse_attention`` (``compress_ratios`` entry 4): one compressed K=V entry
  of ``head_dim`` values per window of ``compress_rates['compressed_sparse_attention']``
  tokens, and the lightning indexer's compressed key (``index_head_dim`` values) per
  window, both for the whole request;
- ``heavily_compressed_attention`` (entry 128): one compressed K=V entry per window of
  ``compress_rates['heavily_compressed_attention']`` tokens, for the whole request;
- per request, the compressor's pending state: the projected K/V and gate of the tokens of
  the incomplete window (at most ratio - 1), and for CSA the previous window's first-half
  K/V and gate (the overlap; its gate already carries the fp32 position bias).

Entries and state are in the model dtype (transformers writes them so); ``--kv-dtype``
applies to the window and the compressed K=V, not to the indexer keys or the state.
Layer types come from ``layer_types``, else the legacy ``compress_ratios`` (0 / 4 / 128,
cut to ``num_hidden_layers`` as transformers does: published configs list one more, for
the MTP layer), else transformers' default (2 heavily compressed, then CSA / HCA in turn).
"""

from __future__ import annotations

from collections.abc import Mapping

from pagedkv.errors import ConfigError, UnsupportedArchitectureError
from pagedkv.kvspec import (
    TARGET,
    Attention,
    Compressed,
    DType,
    IndexerKV,
    LayerSpec,
    Recurrent,
    RecurrentState,
    SharedKV,
    SlidingWindow,
    StateTensor,
    parse_dtype,
)
from pagedkv.models.fields import model_dtype, need_int

SLIDING_ONLY = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
_BY_RATIO = {0: SLIDING_ONLY, 4: CSA, 128: HCA}  # transformers' legacy compress_ratios map
DEFAULT_RATES = {CSA: 4, HCA: 128}


def is_deepseek_v4(cfg: Mapping) -> bool:
    return cfg.get("model_type") == "deepseek_v4"


def layer_types(cfg: Mapping) -> list[str]:
    """Each decoder layer's attention type, read as transformers' DeepseekV4Config does."""
    n = need_int(cfg, "num_hidden_layers", why="the number of decoder layers")
    explicit = cfg.get("layer_types")
    legacy = cfg.get("compress_ratios")
    if explicit is not None:
        field, types = "layer_types", explicit
    elif legacy is not None:
        if not isinstance(legacy, (list, tuple)) or any(r not in _BY_RATIO for r in legacy):
            raise UnsupportedArchitectureError(
                f"compress_ratios must list 0, 4 or 128 per layer (the values transformers "
                f"maps to layer types), got {legacy!r}"
            )
        field, types = "compress_ratios", [_BY_RATIO[r] for r in legacy]
    else:
        rest = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        field, types = "default", [HCA] * min(n, 2) + rest
    if not isinstance(types, (list, tuple)) or len(types) < n:
        raise ConfigError(f"{field} must describe all {n} layers, got {types!r}")
    types = list(types[:n])
    bad = sorted({t for t in types if t not in (SLIDING_ONLY, CSA, HCA)}, key=str)
    if bad:
        raise UnsupportedArchitectureError(
            f"{field} has DeepSeek-V4 layer types pagedkv cannot read: {bad}"
        )
    return types


def compress_rates(cfg: Mapping) -> dict[str, int]:
    rates = dict(DEFAULT_RATES)
    given = cfg.get("compress_rates")
    if given is not None:
        if not isinstance(given, Mapping):
            raise ConfigError(f"compress_rates must be an object, got {given!r}")
        rates.update(given)
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if cfg.get(legacy) is not None:
            rates[kind] = cfg[legacy]
    return {kind: need_int(rates, kind, why="compress_rates") for kind in (CSA, HCA)}


def _state(
    ratio: int, width: int, dtype: DType, overlap: bool, prefix: str = ""
) -> list[StateTensor]:
    """The compressor's pending tokens (K/V and gate, ``width`` values each) and, with
    ``overlap``, the previous window's first half (K/V, and its gate in fp32)."""
    out = []
    if ratio > 1:
        out += [
            StateTensor(f"{prefix}buffer_kv", (ratio - 1, width), dtype),
            StateTensor(f"{prefix}buffer_gate", (ratio - 1, width), dtype),
        ]
    if overlap:
        out += [
            StateTensor(f"{prefix}overlap_kv", (ratio, width // 2), dtype),
            StateTensor(f"{prefix}overlap_gate", (ratio, width // 2), DType.FP32),
        ]
    return out


def deepseek_v4_layers(cfg: Mapping, fmt: str, model: str = TARGET) -> list[LayerSpec]:
    """LayerSpecs of a DeepSeek-V4 config (text part), K/V stored as ``fmt`` (resolved)."""
    if fmt == "fp8_ds_mla":
        raise ConfigError(
            "kv_dtype fp8_ds_mla is DeepSeek's MLA latent format; DeepSeek-V4 keeps shared "
            "K=V entries (no kv_lora_rank)"
        )
    heads = need_int(cfg, "num_key_value_heads", why="DeepSeek-V4 attention")
    if heads != 1:
        raise UnsupportedArchitectureError(
            f"DeepSeek-V4 attention shares one K=V head; num_key_value_heads is {heads}"
        )
    dim = need_int(cfg, "head_dim", why="DeepSeek-V4 attention")
    window = need_int(cfg, "sliding_window", why="DeepSeek-V4 attention")
    dtype = model_dtype(cfg)
    kv = SharedKV(dim, parse_dtype(fmt))
    rates = compress_rates(cfg)
    prefix = "model" if model == TARGET else model
    out: list[LayerSpec] = []
    for i, kind in enumerate(layer_types(cfg)):
        base = f"{prefix}.layers.{i}.self_attn"
        out.append(LayerSpec(
            base, kv, SlidingWindow(window), Attention(window=window, sinks=True), model, 0, i
        ))
        if kind == SLIDING_ONLY:
            continue
        ratio = rates[kind]
        entries = Compressed(ratio)
        out.append(LayerSpec(
            f"{base}.compressor", kv, entries, Attention(sinks=True), model, 0, i
        ))
        if kind == CSA:
            index_dim = need_int(cfg, "index_head_dim", why="the DeepSeek-V4 indexer")
            out.append(LayerSpec(
                f"{base}.indexer", IndexerKV(index_dim, dtype), entries, Attention(), model, 0, i
            ))
            tensors = _state(ratio, 2 * dim, dtype, True)
            tensors += _state(ratio, 2 * index_dim, dtype, True, "index_")
        else:
            tensors = _state(ratio, dim, dtype, False)
        if tensors:
            state = RecurrentState(tuple(tensors), "compressor")
            out.append(LayerSpec(
                f"{base}.compressor_state", state, Recurrent(), None, model, 0, i
            ))
    return out
