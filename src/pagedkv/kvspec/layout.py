"""Layout: how many bytes a token (or a request) occupies in a layer's cache, in what shape.

A layout knows nothing about which positions stay resident (Retention) or how queries see
keys (Attention). Token-proportional layouts describe one token's tensors; recurrent
layouts describe one request's state. Bytes are derived from the tensors, never stored twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Union

from pagedkv.errors import ConfigError, InvalidArgumentError
from pagedkv.kvspec.dtypes import DType, parse_dtype


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a cache entry: ``shape`` is per token (token layouts) or per request."""

    name: str
    shape: tuple[int, ...]
    dtype: DType

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _positive(owner: str, **values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{owner}: {key} must be a positive integer, got {value!r}")


def _shard_heads(owner: str, heads: int, tp: int) -> int:
    """Heads per rank: split when divisible, replicated (one per rank) when fewer than ranks."""
    if not isinstance(tp, int) or tp <= 0:
        raise InvalidArgumentError(f"tensor-parallel size must be a positive integer, got {tp!r}")
    if heads >= tp:
        if heads % tp:
            raise InvalidArgumentError(f"{owner}: {heads} heads cannot be split over tp={tp} ranks")
        return heads // tp
    if tp % heads:
        raise InvalidArgumentError(
            f"{owner}: {heads} heads cannot be replicated evenly over tp={tp} ranks"
        )
    return 1


@dataclass(frozen=True)
class AttentionKV:
    """Per-token K and V for GQA/MHA: ``num_kv_heads`` x ``head_dim`` (V may differ)."""

    num_kv_heads: int
    head_dim: int
    dtype: DType = DType.BF16
    v_head_dim: int | None = None
    kind: Literal["attention_kv"] = field(default="attention_kv", init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        _positive("AttentionKV", num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        if self.v_head_dim is not None:
            _positive("AttentionKV", v_head_dim=self.v_head_dim)

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def token_tensors(self) -> tuple[TensorSpec, ...]:
        return (
            TensorSpec("k", (self.num_kv_heads, self.head_dim), self.dtype),
            TensorSpec("v", (self.num_kv_heads, self.value_dim), self.dtype),
        )

    def request_tensors(self) -> tuple[TensorSpec, ...]:
        return ()

    def shard(self, tp: int) -> AttentionKV:
        heads = _shard_heads("AttentionKV", self.num_kv_heads, tp)
        return AttentionKV(heads, self.head_dim, self.dtype, self.v_head_dim)

    def with_dtype(self, dtype: DType) -> AttentionKV:
        return AttentionKV(self.num_kv_heads, self.head_dim, dtype, self.v_head_dim)


MLAFormat = Literal["bf16", "fp16", "fp8", "fp8_ds_mla"]
_MLA_FORMATS = ("bf16", "fp16", "fp8", "fp8_ds_mla")


@dataclass(frozen=True)
class MLALatent:
    """Per-token compressed latent of multi-head latent attention (DeepSeek, Kimi).

    ``fp8_ds_mla`` is DeepSeek's packed format: the latent in fp8 with one fp32 scale per
    128 values, then the rope part in bf16 (512 + 4*4 + 64*2 = 656 bytes for 512 + 64).
    Per-tensor ``fp8`` keeps one scale per layer, not per token.
    """

    kv_lora_rank: int = 512
    rope_dim: int = 64
    format: MLAFormat = "bf16"
    kind: Literal["mla_latent"] = field(default="mla_latent", init=False)

    SCALE_GROUP = 128  # latent values per fp32 scale in fp8_ds_mla

    def __post_init__(self) -> None:
        _positive("MLALatent", kv_lora_rank=self.kv_lora_rank)
        if not isinstance(self.rope_dim, int) or self.rope_dim < 0:
            raise ConfigError(f"MLALatent: rope_dim must be >= 0, got {self.rope_dim!r}")
        if self.format not in _MLA_FORMATS:
            raise ConfigError(f"MLALatent: unknown format {self.format!r}; known: {_MLA_FORMATS}")
        if self.format == "fp8_ds_mla" and self.kv_lora_rank % self.SCALE_GROUP:
            raise ConfigError(
                f"MLALatent: fp8_ds_mla needs kv_lora_rank divisible by {self.SCALE_GROUP}, "
                f"got {self.kv_lora_rank}"
            )

    @property
    def entry_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def token_tensors(self) -> tuple[TensorSpec, ...]:
        if self.format == "fp8_ds_mla":
            packed = (
                self.kv_lora_rank  # fp8 latent
                + 4 * (self.kv_lora_rank // self.SCALE_GROUP)  # fp32 scales
                + 2 * self.rope_dim  # bf16 rope
            )
            return (TensorSpec("latent", (packed,), DType.UINT8),)
        return (TensorSpec("latent", (self.entry_dim,), parse_dtype(self.format)),)

    def request_tensors(self) -> tuple[TensorSpec, ...]:
        return ()

    def shard(self, tp: int) -> MLALatent:
        _shard_heads("MLALatent", 1, tp)  # validates tp; the latent is replicated on every rank
        return self

    def with_dtype(self, dtype: DType | str) -> MLALatent:
        fmt = dtype if dtype == "fp8_ds_mla" else parse_dtype(dtype).value
        if fmt not in _MLA_FORMATS:
            raise ConfigError(f"MLA latent cannot be stored as {dtype!r}; use one of {_MLA_FORMATS}")
        return MLALatent(self.kv_lora_rank, self.rope_dim, fmt)  # type: ignore[arg-type]


@dataclass(frozen=True)
class IndexerKV:
    """Sparse-attention indexer key, one head per token (or per compressed entry).

    ``dtype`` None is DeepSeek-V3.2's packed format: fp8 values plus one fp32 scale. A dtype
    stores plain values (MiniMax-M3 and DeepSeek-V4 keep them in the model dtype).
    """

    head_dim: int = 128
    dtype: DType | None = None
    kind: Literal["indexer"] = field(default="indexer", init=False)

    def __post_init__(self) -> None:
        _positive("IndexerKV", head_dim=self.head_dim)
        if self.dtype is not None:
            object.__setattr__(self, "dtype", parse_dtype(self.dtype))

    def token_tensors(self) -> tuple[TensorSpec, ...]:
        if self.dtype is None:
            return (TensorSpec("index_k", (self.head_dim + 4,), DType.UINT8),)
        return (TensorSpec("index_k", (self.head_dim,), self.dtype),)

    def request_tensors(self) -> tuple[TensorSpec, ...]:
        return ()

    def shard(self, tp: int) -> IndexerKV:
        _shard_heads("IndexerKV", 1, tp)
        return self

    def with_dtype(self, dtype: DType | str) -> IndexerKV:
        return self  # the indexer has its own fixed format


@dataclass(frozen=True)
class SharedKV:
    """One tensor per token read as both K and V (DeepSeek-V4's shared-KV MQA: one head of
    ``head_dim`` values, replicated on every tensor-parallel rank)."""

    head_dim: int
    dtype: DType = DType.BF16
    kind: Literal["shared_kv"] = field(default="shared_kv", init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        _positive("SharedKV", head_dim=self.head_dim)

    def token_tensors(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("kv", (self.head_dim,), self.dtype),)

    def request_tensors(self) -> tuple[TensorSpec, ...]:
        return ()

    def shard(self, tp: int) -> SharedKV:
        _shard_heads("SharedKV", 1, tp)
        return self

    def with_dtype(self, dtype: DType) -> SharedKV:
        return SharedKV(self.head_dim, dtype)


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a recurrent state; ``shard_dim`` (if any) is split over TP ranks."""

    name: str
    shape: tuple[int, ...]
    dtype: DType = DType.FP32
    shard_dim: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        _positive(f"StateTensor {self.name!r}", **{f"shape[{i}]": d for i, d in enumerate(self.shape)})
        if self.shard_dim is not None and not 0 <= self.shard_dim < len(self.shape):
            raise ConfigError(
                f"StateTensor {self.name!r}: shard_dim {self.shard_dim} outside shape {self.shape}"
            )


@dataclass(frozen=True)
class RecurrentState:
    """Fixed-size state per request (Mamba, GatedDeltaNet, KDA, lightning attention)."""

    tensors: tuple[StateTensor, ...]
    family: str = "recurrent"  # mamba1, mamba2, gdn, kda, lightning: for humans and kernels
    kind: Literal["recurrent_state"] = field(default="recurrent_state", init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", tuple(self.tensors))
        if not self.tensors:
            raise ConfigError("RecurrentState needs at least one tensor")

    def token_tensors(self) -> tuple[TensorSpec, ...]:
        return ()

    def request_tensors(self) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(t.name, t.shape, t.dtype) for t in self.tensors)

    def shard(self, tp: int) -> RecurrentState:
        out = []
        for t in self.tensors:
            if t.shard_dim is None:
                _shard_heads(f"state {t.name!r}", 1, tp)
                out.append(t)
                continue
            shape = list(t.shape)
            shape[t.shard_dim] = _shard_heads(f"state {t.name!r}", shape[t.shard_dim], tp)
            out.append(StateTensor(t.name, tuple(shape), t.dtype, t.shard_dim))
        return RecurrentState(tuple(out), self.family)

    def with_dtype(self, dtype: DType | str) -> RecurrentState:
        return self  # --kv-dtype applies to KV caches; state dtype comes from the config


Layout = Union[AttentionKV, MLALatent, IndexerKV, SharedKV, RecurrentState]


def bytes_per_token(layout: Layout) -> int:
    """Bytes one token occupies in this layer's cache (0 for per-request state)."""
    return sum(t.nbytes for t in layout.token_tensors())


def bytes_per_request(layout: Layout) -> int:
    """Fixed bytes one request occupies whatever its length (recurrent state)."""
    return sum(t.nbytes for t in layout.request_tensors())
