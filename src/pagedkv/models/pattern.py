"""Which kind of layer each decoder layer is, read from the config's pattern fields.

The result is one canonical kind per layer:

- ``full``: softmax attention over every earlier position;
- ``sliding``: softmax attention over a window (``sliding_window``);
- ``chunked``: softmax attention inside aligned chunks (``attention_chunk_size``);
- ``recurrent``: a fixed-size state (Mamba, GatedDeltaNet, KDA, lightning); which one is
  read from other fields (:mod:`pagedkv.models.recurrent`);
- ``mlp`` / ``moe``: a layer with no token mixer and no cache (Nemotron-H ``-`` / ``E``);
- ``noop``: a decoder block whose attention is skipped (Nemotron NAS ``no_op``): its MLP
  remains, it caches nothing.

Fields are read in this order; the first present decides: ``layer_types`` (or
``layers_block_type``), ``block_configs`` (Nemotron NAS), ``linear_attn_config.full_attn_layers/
kda_layers`` (1-based), ``hybrid_override_pattern``, ``hybrid_layer_pattern`` (MiMo-V2: 0 full,
1 sliding), ``attn_type_list``, ``full_attention_interval``, ``attn_layer_period/offset``,
``attention_chunk_size`` (+ ``no_rope_layers``; Llama 4 fills an absent or empty list from
``no_rope_layer_interval``, default 4), ``sliding_window`` (+ ``sliding_window_pattern``;
Gemma 2 alternates; Gemma 3/4 default to 5 local : 1 global; Qwen2
``use_sliding_window``/``max_window_layers``); pure Mamba / Mamba-2 model types are recurrent
throughout. With none of them every layer is full attention -- unless the config carries
fields of a mixer we did not read, which is an error rather than a guess. Gemma 4's last
layer is always full attention, as transformers forces it.
"""

from __future__ import annotations

from collections.abc import Mapping

from pagedkv.errors import ConfigError, UnsupportedArchitectureError
from pagedkv.models.fields import int_list, model_type, need_int, opt_int

FULL, SLIDING, CHUNKED, RECURRENT, MLP, MOE, NOOP = (
    "full", "sliding", "chunked", "recurrent", "mlp", "moe", "noop"
)
ATTENTION_KINDS = (FULL, SLIDING, CHUNKED)
NO_CACHE_KINDS = (MLP, MOE)

# layer_types spellings seen in HF configs -> canonical kind
_LAYER_TYPES = {
    "full_attention": FULL,
    "attention": FULL,  # Jamba / Nemotron-H layers_block_type
    "global_attention": FULL,
    "indexed_attention": FULL,  # DeepSeek-V3.2 (sparse attention with an indexer)
    "minimax_m3_sparse": FULL,  # MiniMax-M3: all K/V kept, plus an indexer key
    "sliding_attention": SLIDING,
    "chunked_attention": CHUNKED,
    "linear_attention": RECURRENT,
    "mamba": RECURRENT,
    "mlp": MLP,
    "moe": MOE,
}
_HYBRID_CHARS = {"M": RECURRENT, "*": FULL, "-": MLP, "E": MOE}
PURE_MAMBA_TYPES = ("mamba", "falcon_mamba", "mamba2")
LLAMA4_NOPE_INTERVAL = 4  # transformers' default no_rope_layer_interval
GEMMA_LOCAL_PERIOD = 6  # Gemma 3/4 default: 5 sliding layers, then 1 full
# NAS block fields that change what a block caches and that pagedkv does not model
_NAS_UNMODELLED = ("window_length", "sparsify", "num_sink_tokens")

# Field-name prefixes of token mixers other than softmax attention. A config that has any
# of them but none of the pattern fields above is a hybrid we cannot read.
_UNREAD_MIXER_HINTS = (
    "mamba", "ssm_", "linear_attn", "linear_num_", "linear_key_", "linear_value_",
    "rwkv", "block_types", "attn_type", "hybrid_", "lru_width", "full_attn_layers",
    "kda_", "time_step",
)


# far above any published model; a larger count is a broken config, not a plan to make
MAX_LAYERS = 100_000


def num_layers(cfg: Mapping) -> int:
    return need_int(cfg, "num_hidden_layers", why="the number of decoder layers",
                    maximum=MAX_LAYERS)


def _check_length(cfg: Mapping, kinds: list[str], field: str) -> tuple[str, ...]:
    declared = cfg.get("num_hidden_layers")
    if declared is not None and declared != len(kinds):
        raise ConfigError(
            f"{field} describes {len(kinds)} layers but num_hidden_layers is {declared!r}"
        )
    if not kinds:
        raise ConfigError(f"{field} is empty")
    return tuple(kinds)


def _from_layer_types(cfg: Mapping, field: str) -> tuple[str, ...]:
    raw = cfg[field]
    if not isinstance(raw, (list, tuple)):
        raise ConfigError(f"config field {field!r} must be a list, got {raw!r}")
    kinds = []
    for i, name in enumerate(raw):
        kind = _LAYER_TYPES.get(name) if isinstance(name, str) else None
        if kind is None:
            raise UnsupportedArchitectureError(
                f"{field}[{i}] is {name!r}, a layer type pagedkv cannot read; "
                f"known: {sorted(_LAYER_TYPES)}"
            )
        kinds.append(kind)
    return _check_length(cfg, kinds, field)


def _from_linear_attn_config(cfg: Mapping, lac: Mapping) -> tuple[str, ...]:
    """Kimi-Linear: ``full_attn_layers`` and ``kda_layers`` are 1-based and partition 1..N."""
    full, kda = int_list(lac, "full_attn_layers"), int_list(lac, "kda_layers")
    if full is None or kda is None:
        missing = [k for k, v in (("full_attn_layers", full), ("kda_layers", kda)) if v is None]
        raise ConfigError(f"linear_attn_config lacks {missing} (needed for the layer pattern)")
    n = num_layers(cfg)
    everything = sorted(full + kda)
    if everything != list(range(1, n + 1)):
        raise ConfigError(
            "linear_attn_config.full_attn_layers and kda_layers must list every layer "
            f"1..{n} exactly once (1-based); got {len(full)} full + {len(kda)} KDA entries"
        )
    full_set = set(full)
    return tuple(FULL if i + 1 in full_set else RECURRENT for i in range(n))


def _from_hybrid_pattern(cfg: Mapping, pattern: object) -> tuple[str, ...]:
    if not isinstance(pattern, str):
        raise ConfigError(f"hybrid_override_pattern must be a string, got {pattern!r}")
    kinds = []
    for i, char in enumerate(pattern):
        if char not in _HYBRID_CHARS:
            raise UnsupportedArchitectureError(
                f"hybrid_override_pattern[{i}] is {char!r}; known: {sorted(_HYBRID_CHARS)}"
            )
        kinds.append(_HYBRID_CHARS[char])
    return _check_length(cfg, kinds, "hybrid_override_pattern")


def _from_attn_type_list(cfg: Mapping) -> tuple[str, ...]:
    """MiniMax: 0 = lightning (linear) attention, 1 = softmax attention."""
    values = int_list(cfg, "attn_type_list") or []
    kinds = []
    for i, v in enumerate(values):
        if v not in (0, 1):
            raise UnsupportedArchitectureError(f"attn_type_list[{i}] is {v!r}; known: 0, 1")
        kinds.append(FULL if v == 1 else RECURRENT)
    return _check_length(cfg, kinds, "attn_type_list")


def _periodic(n: int, is_full) -> tuple[str, ...]:
    return tuple(FULL if is_full(i) else RECURRENT for i in range(n))


def _from_chunking(cfg: Mapping) -> tuple[str, ...]:
    """Llama 4: RoPE layers attend inside chunks; NoPE layers (``no_rope_layers[i] == 0``)
    attend globally. ``no_rope_layers[i]`` is 1 where layer i *uses* RoPE."""
    n = num_layers(cfg)
    flags = int_list(cfg, "no_rope_layers")
    if flags:
        if len(flags) != n or any(f not in (0, 1) for f in flags):
            raise ConfigError(
                f"no_rope_layers must hold {n} entries of 0/1, got {len(flags)}: {flags!r}"
            )
        return tuple(CHUNKED if f else FULL for f in flags)
    default = LLAMA4_NOPE_INTERVAL if model_type(cfg).startswith("llama4") else None
    interval = opt_int(cfg, "no_rope_layer_interval", default=default, minimum=1)
    if interval is None:
        raise ConfigError(
            "attention_chunk_size is set but neither no_rope_layers nor "
            "no_rope_layer_interval says which layers are chunked"
        )
    return tuple(CHUNKED if (i + 1) % interval else FULL for i in range(n))


def _from_sliding_window(cfg: Mapping) -> tuple[str, ...]:
    n = num_layers(cfg)
    if cfg.get("use_sliding_window") is False:  # Qwen2/3: the window is switched off
        return (FULL,) * n
    period = opt_int(cfg, "sliding_window_pattern", minimum=1)
    if period is None and model_type(cfg) == "gemma2":
        period = 2  # Gemma 2 alternates sliding / full, starting with sliding
    if period is None and model_type(cfg).startswith(("gemma3", "gemma4")):
        period = GEMMA_LOCAL_PERIOD
    if period is not None:
        return tuple(SLIDING if (i + 1) % period else FULL for i in range(n))
    if cfg.get("use_sliding_window") is True and cfg.get("max_window_layers") is not None:
        first_windowed = need_int(cfg, "max_window_layers", why="Qwen2 windows", minimum=0)
        return tuple(SLIDING if i >= first_windowed else FULL for i in range(n))
    return (SLIDING,) * n  # Mistral: every layer windowed


def _refuse_unread_mixers(cfg: Mapping) -> None:
    hints = sorted(
        k for k, v in cfg.items()
        if v not in (None, [], {}, 0, False) and k.startswith(_UNREAD_MIXER_HINTS)
    )
    if hints:
        raise UnsupportedArchitectureError(
            f"config has fields of a non-attention mixer ({', '.join(hints)}) but none of "
            "layer_types, hybrid_override_pattern, attn_layer_period, full_attention_interval, "
            "attn_type_list or linear_attn_config says which layers use it; refusing to "
            "read it as full attention"
        )


def block_config(cfg: Mapping, index: int) -> Mapping:
    """Nemotron NAS ``block_configs[index]``, checked to be an object."""
    blocks = cfg.get("block_configs")
    if not isinstance(blocks, list) or not 0 <= index < len(blocks):
        raise ConfigError(f"block_configs has no entry {index} (got {type(blocks).__name__})")
    block = blocks[index]
    if not isinstance(block, Mapping):
        raise ConfigError(f"block_configs[{index}] must be an object, got {block!r}")
    return block


def _from_block_configs(cfg: Mapping) -> tuple[str, ...]:
    """Nemotron NAS: a block whose attention is ``no_op`` (or a linear replacement) caches
    nothing; every other block is full attention with its own KV head count."""
    blocks = cfg["block_configs"]
    if not isinstance(blocks, list):
        raise ConfigError(f"block_configs must be a list, got {type(blocks).__name__}")
    kinds = []
    for i in range(len(blocks)):
        attention = block_config(cfg, i).get("attention") or {}
        if not isinstance(attention, Mapping):
            raise ConfigError(f"block_configs[{i}].attention must be an object")
        for field in _NAS_UNMODELLED:
            if attention.get(field) not in (None, False):
                raise UnsupportedArchitectureError(
                    f"block_configs[{i}].attention.{field} is {attention[field]!r}; pagedkv "
                    "does not model this NAS attention variant"
                )
        skipped = attention.get("no_op") or attention.get("replace_with_linear")
        kinds.append(NOOP if skipped else FULL)
    return _check_length(cfg, kinds, "block_configs")


def _from_hybrid_layer_pattern(cfg: Mapping) -> tuple[str, ...]:
    """MiMo-V2: ``hybrid_layer_pattern[i]`` is 0 for full attention, 1 for sliding."""
    values = int_list(cfg, "hybrid_layer_pattern") or []
    kinds = []
    for i, v in enumerate(values):
        if v not in (0, 1):
            raise UnsupportedArchitectureError(f"hybrid_layer_pattern[{i}] is {v!r}; known: 0, 1")
        kinds.append(SLIDING if v else FULL)
    return _check_length(cfg, kinds, "hybrid_layer_pattern")


def _force_last_full(cfg: Mapping, kinds: tuple[str, ...]) -> tuple[str, ...]:
    """Gemma 4: transformers makes the last layer full attention whatever the config says."""
    if model_type(cfg).startswith("gemma4") and kinds and kinds[-1] != FULL:
        return kinds[:-1] + (FULL,)
    return kinds


def layer_pattern(cfg: Mapping) -> tuple[str, ...]:
    """One canonical kind per decoder layer (see the module docstring)."""
    return _force_last_full(cfg, _layer_pattern(cfg))


def _layer_pattern(cfg: Mapping) -> tuple[str, ...]:
    for field in ("layer_types", "layers_block_type"):
        if cfg.get(field) is not None:
            return _from_layer_types(cfg, field)
    if cfg.get("block_configs") is not None:
        return _from_block_configs(cfg)
    if model_type(cfg) in PURE_MAMBA_TYPES:
        return (RECURRENT,) * num_layers(cfg)
    lac = cfg.get("linear_attn_config")
    if lac is not None:
        if not isinstance(lac, Mapping):
            raise ConfigError(f"linear_attn_config must be an object, got {lac!r}")
        return _from_linear_attn_config(cfg, lac)
    if cfg.get("hybrid_override_pattern") is not None:
        return _from_hybrid_pattern(cfg, cfg["hybrid_override_pattern"])
    if cfg.get("hybrid_layer_pattern") is not None:
        return _from_hybrid_layer_pattern(cfg)
    if cfg.get("attn_type_list") is not None:
        return _from_attn_type_list(cfg)
    if cfg.get("full_attention_interval") is not None:
        k = need_int(cfg, "full_attention_interval", why="Qwen3-Next layer pattern")
        return _periodic(num_layers(cfg), lambda i: (i + 1) % k == 0)
    if cfg.get("attn_layer_period") is not None:
        period = need_int(cfg, "attn_layer_period", why="Jamba layer pattern")
        offset = need_int(cfg, "attn_layer_offset", why="Jamba layer pattern", minimum=0)
        if offset >= period:
            raise ConfigError(f"attn_layer_offset {offset} must be < attn_layer_period {period}")
        return _periodic(num_layers(cfg), lambda i: i % period == offset)
    if cfg.get("attention_chunk_size") is not None:
        return _from_chunking(cfg)
    if cfg.get("sliding_window") is not None:
        return _from_sliding_window(cfg)
    _refuse_unread_mixers(cfg)
    return (FULL,) * num_layers(cfg)
