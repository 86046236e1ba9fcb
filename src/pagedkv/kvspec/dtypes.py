"""Storage dtypes named the way configs and CLIs name them, with their sizes in bytes."""

from __future__ import annotations

from enum import Enum

from pagedkv.errors import ConfigError


class DType(str, Enum):
    """Element type of a cache tensor. Values are the short names used in configs and JSON."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"  # e4m3
    FP8_E5M2 = "fp8_e5m2"
    UINT8 = "uint8"  # packed formats (fp8_ds_mla, indexer) are stored as raw bytes
    INT8 = "int8"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]


_ITEMSIZE = {
    DType.FP32: 4,
    DType.BF16: 2,
    DType.FP16: 2,
    DType.FP8: 1,
    DType.FP8_E5M2: 1,
    DType.UINT8: 1,
    DType.INT8: 1,
}

_ALIASES = {
    "float32": DType.FP32, "float": DType.FP32, "fp32": DType.FP32,
    "bfloat16": DType.BF16, "bf16": DType.BF16,
    "float16": DType.FP16, "half": DType.FP16, "fp16": DType.FP16,
    "fp8": DType.FP8, "fp8_e4m3": DType.FP8, "float8_e4m3fn": DType.FP8, "e4m3": DType.FP8,
    "fp8_e5m2": DType.FP8_E5M2, "float8_e5m2": DType.FP8_E5M2,
    "uint8": DType.UINT8, "int8": DType.INT8,
}


def parse_dtype(name: str | DType) -> DType:
    """Read a dtype name as configs write it (``torch_dtype: "bfloat16"``, ``"fp8"``...)."""
    if isinstance(name, DType):
        return name
    key = str(name).strip().lower().removeprefix("torch.")
    if key not in _ALIASES:
        raise ConfigError(f"unknown dtype {name!r}; known: {sorted(_ALIASES)}")
    return _ALIASES[key]
