"""A small table of accelerators and the KV budget one leaves after the weights.

Memory is the total the driver reports (``nvidia-smi --query-gpu=memory.total``, in MiB;
``rocm-smi`` for AMD), not the marketing figure: an "80 GB" H100 shows 81559 MiB. Engines
multiply that total by a utilization fraction and subtract weights (and activations, which
this estimate leaves inside the ``1 - utilization`` headroom).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from pagedkv.errors import DoesNotFitError, InvalidArgumentError
from pagedkv.plan.sizes import format_bytes

MiB = 2**20


@dataclass(frozen=True)
class GPU:
    """One accelerator model: ``memory_bytes`` as its driver reports the total."""

    name: str
    memory_bytes: int
    description: str


def _gpu(name: str, mib: int, description: str) -> tuple[str, GPU]:
    return name, GPU(name, mib * MiB, description)


GPUS: Mapping[str, GPU] = MappingProxyType(dict([
    _gpu("h100", 81559, "NVIDIA H100 80GB HBM3 (SXM)"),
    _gpu("h100-pcie", 81559, "NVIDIA H100 80GB PCIe"),
    _gpu("h100-nvl", 95830, "NVIDIA H100 NVL 94GB"),
    _gpu("h200", 143771, "NVIDIA H200 141GB HBM3e"),
    _gpu("gh200", 97871, "NVIDIA GH200 96GB HBM3 (GPU memory only)"),
    _gpu("b200", 183359, "NVIDIA B200 180GB HBM3e"),
    _gpu("a100-80gb", 81920, "NVIDIA A100 80GB"),
    _gpu("a100-40gb", 40960, "NVIDIA A100 40GB"),
    _gpu("l40s", 46068, "NVIDIA L40S 48GB GDDR6 (ECC on)"),
    _gpu("l4", 23034, "NVIDIA L4 24GB"),
    _gpu("a10g", 23028, "NVIDIA A10G 24GB"),
    _gpu("rtx-4090", 24564, "NVIDIA GeForce RTX 4090 24GB"),
    _gpu("mi300x", 196288, "AMD Instinct MI300X 192GB HBM3"),
]))


def find_gpu(name: str) -> GPU:
    """Look a GPU up by its table name (case and surrounding spaces ignored)."""
    key = str(name).strip().lower()
    if key not in GPUS:
        raise InvalidArgumentError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return GPUS[key]


def budget_from_gpu(gpu: str, utilization: float, weight_bytes_per_rank: int) -> int:
    """KV-cache bytes per rank: ``memory x utilization - weights on that rank``."""
    if not 0 < utilization <= 1:
        raise InvalidArgumentError(f"utilization must be in (0, 1], got {utilization!r}")
    if weight_bytes_per_rank < 0:
        raise InvalidArgumentError(
            f"weight bytes per rank must be >= 0, got {weight_bytes_per_rank!r}"
        )
    device = find_gpu(gpu)
    usable = int(device.memory_bytes * utilization)
    budget = usable - int(weight_bytes_per_rank)
    if budget <= 0:
        raise DoesNotFitError(
            f"{device.name}: {utilization:g} x {format_bytes(device.memory_bytes)} = "
            f"{format_bytes(usable)} cannot hold {format_bytes(weight_bytes_per_rank)} of weights "
            "per rank, leaving nothing for the KV cache (raise --tp/--pp or --utilization)"
        )
    return budget
