"""MiniMax-M3 sparse attention, as transformers' ``minimax_m3_vl`` modelling code caches it.

A sparse layer keeps every token's K and V (the block-sparse selection only chooses which
blocks a query reads) and, beside them, one lightning-indexer key per token: a single head
of ``index_head_dim`` values (``sparse_index_dim``) in the model dtype. The indexer's block
size, top-k and local blocks change what is read, not what is kept.

Sparse layers are ``sparse_attention_config.sparse_attention_freq`` entries that are set
(or ``layer_types`` ``minimax_m3_sparse``, the form transformers writes). Refused by name:
``use_sparse_attention`` false beside a sparse pattern (transformers builds the indexers
anyway, so the cache is ambiguous) and ``sparse_disable_index_value`` 0 on a sparse layer
(an index-value path whose cache no public modelling code shows).
"""

from __future__ import annotations

from collections.abc import Mapping

from pagedkv.errors import ConfigError, UnsupportedArchitectureError
from pagedkv.kvspec import IndexerKV
from pagedkv.models.fields import model_dtype, model_type, need_int

SPARSE_LAYER_TYPE = "minimax_m3_sparse"
DEFAULT_INDEX_HEAD_DIM = 128  # transformers' MiniMaxM3VLTextConfig default


def is_minimax_m3(cfg: Mapping) -> bool:
    return model_type(cfg).startswith("minimax_m3")


def sparse_layers(cfg: Mapping) -> frozenset[int]:
    """Indices of the layers that keep an indexer key beside K/V."""
    types = cfg.get("layer_types")
    if isinstance(types, (list, tuple)) and SPARSE_LAYER_TYPE in types:
        return frozenset(i for i, t in enumerate(types) if t == SPARSE_LAYER_TYPE)
    sparse = cfg.get("sparse_attention_config")
    if sparse is None:
        return frozenset()
    if not isinstance(sparse, Mapping):
        raise ConfigError(f"sparse_attention_config must be an object, got {sparse!r}")
    freq = sparse.get("sparse_attention_freq")
    if freq is None:
        if sparse.get("use_sparse_attention"):
            raise UnsupportedArchitectureError(
                "sparse_attention_config sets use_sparse_attention without "
                "sparse_attention_freq: which layers are sparse is not said"
            )
        return frozenset()
    n = need_int(cfg, "num_hidden_layers", why="the number of decoder layers")
    if not isinstance(freq, (list, tuple)) or len(freq) != n:
        raise ConfigError(
            f"sparse_attention_config.sparse_attention_freq must list all {n} layers, "
            f"got {freq!r}"
        )
    layers = frozenset(i for i, f in enumerate(freq) if f)
    if layers and sparse.get("use_sparse_attention") is False:
        raise UnsupportedArchitectureError(
            "sparse_attention_config: use_sparse_attention is false but "
            "sparse_attention_freq marks sparse layers (transformers builds their indexers "
            "anyway); refusing rather than guessing what they cache"
        )
    disabled = sparse.get("sparse_disable_index_value")
    if isinstance(disabled, (list, tuple)):
        kept = sorted(i for i in layers if i < len(disabled) and not disabled[i])
    else:
        kept = sorted(layers) if disabled is not None and not disabled else []
    if kept:
        raise UnsupportedArchitectureError(
            "sparse_attention_config.sparse_disable_index_value is 0 on sparse layers "
            f"{kept[:4]}{' ...' if len(kept) > 4 else ''}: an index-value cache pagedkv does "
            "not model (no public modelling code shows it)"
        )
    return layers


def index_key_layout(cfg: Mapping) -> IndexerKV:
    """One indexer key per token: ``index_head_dim`` values in the model dtype."""
    sparse = cfg.get("sparse_attention_config")
    if isinstance(sparse, Mapping) and sparse.get("sparse_index_dim") is not None:
        dim = need_int(sparse, "sparse_index_dim", why="the MiniMax-M3 indexer key")
    elif cfg.get("index_head_dim") is not None:
        dim = need_int(cfg, "index_head_dim", why="the MiniMax-M3 indexer key")
    else:
        dim = DEFAULT_INDEX_HEAD_DIM
    return IndexerKV(dim, model_dtype(cfg))
