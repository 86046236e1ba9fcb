"""Building blocks shared by the native models: RMSNorm (plain and 1 + w), RoPE, gated MLP,
the head size a config implies.

RoPE frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` (llama3, yarn,
linear... scaling), so the native models rotate exactly as the checkpoints were trained.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.errors import ConfigError


def head_dim(config: Any) -> int:
    """Attention head size: the config's ``head_dim``, else hidden size / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class RMSNorm(nn.Module):
    """x / rms(x) * w in fp32, cast back before the weight (Llama); ``offset``: Gemma's
    (1 + w) in fp32, cast after; ``cast_after``: w times the fp32 value, then cast (gpt-oss)."""

    def __init__(self, dim: int, eps: float, *, offset: bool = False,
                 cast_after: bool = False) -> None:
        super().__init__()
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < 1:
            raise ConfigError(f"an RMS norm's epsilon must be in [0, 1), got {eps!r}")
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset
        self.cast_after = cast_after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (y * (1.0 + self.weight.float())).type_as(x)
        if self.cast_after:
            return (self.weight * y).to(x.dtype)
        return self.weight * y.to(x.dtype)


def config_int(value: Any, what: str) -> int:
    """``value`` when it is a positive integer, else :class:`ConfigError` naming ``what``
    (a JSON true, a float or a string is refused, not rounded)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    return value


def routing(experts: Any, top_k: Any, groups: Any = 1,
            topk_group: Any = 1) -> tuple[int, int, int, int]:
    """A router's (experts, top_k, groups, topk_group) as ints, or :class:`ConfigError`
    where torch's top-k and group views could not take them (checked when the model is
    built, not at its first token)."""
    experts, top_k = config_int(experts, "experts"), config_int(top_k, "experts per token")
    groups, topk_group = config_int(groups, "expert groups"), config_int(
        topk_group, "groups per token")
    if top_k > experts or experts % groups or topk_group > groups:
        raise ConfigError(f"router of {experts} experts in {groups} groups cannot pick "
                          f"{top_k} experts from {topk_group} groups a token")
    return experts, top_k, groups, topk_group


def rope_frequencies(config: Any, rotary_dim: int,
                     layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies over ``rotary_dim`` and the attention scaling of the config's
    RoPE (``rope_parameters``, or its ``layer_type`` entry where it has one per layer
    type): plain RoPE here, every scaled kind through transformers' functions.
    :class:`ConfigError` names the field when the parameters are not a RoPE."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type is not None and isinstance(
            params.get(layer_type), dict):
        params = params[layer_type]
    else:
        layer_type = None
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters must be an object, got {params!r}")
    kind = params.get("rope_type", "default")
    theta = params.get("rope_theta")
    factor = params.get("factor")
    for key, value in (("rope_theta", theta), ("factor", 1.0 if factor is None else factor)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                0 < value < math.inf):  # every kind scales the base; NaN fails here too
            raise ConfigError(f"RoPE {key} must be a positive number, got {value!r}")
    if kind == "default":
        steps = torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim
        return 1.0 / (theta ** steps), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if not isinstance(kind, str) or kind not in ROPE_INIT_FUNCTIONS:
        raise ConfigError(f"rope_type {kind!r} is not one of default, "
                          f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    try:
        inv, scaling = ROPE_INIT_FUNCTIONS[kind](config, None, **kwargs)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ConfigError(f"rope_type {kind!r} cannot use rope_parameters {params}: "
                          f"{exc!r}") from None
    return inv, float(scaling)


class Rope(nn.Module):
    """Rotate-half RoPE over the leading ``rotary_dim`` of each head (all of it unless
    ``partial_rotary_factor`` says less; the rest passes through); ``layer_type`` picks
    per-type parameters (Gemma 3's local and global bases)."""

    def __init__(self, config: Any, rotary_dim: int, layer_type: str | None = None) -> None:
        super().__init__()
        inv, scaling = rope_frequencies(config, rotary_dim, layer_type)
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        self.scaling = float(scaling)

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of a head this rotates."""
        return 2 * self.inv_freq.shape[0]

    def forward(self, q: torch.Tensor, k: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hk, D] rotated at ``positions`` [T]."""
        freqs = positions.float()[:, None] * self.inv_freq.to(q.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = (emb.cos() * self.scaling).to(q.dtype)[:, None]
        sin = (emb.sin() * self.scaling).to(q.dtype)[:, None]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    head = x[..., :r]
    return torch.cat([head * cos + _rotate_half(head) * sin, x[..., r:]], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), the Llama/Gemma MLP."""

    def __init__(self, hidden: int, intermediate: int, *, bias: bool = False,
                 act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = _ACTS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


_ACTS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}
