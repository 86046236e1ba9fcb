"""gpt-oss over pagedkv: alternating sliding-window (128) and full attention layers with
per-head attention sinks, YaRN RoPE, and a top-k MoE of clamped SwiGLU experts (a plain
loop over the experts the step routes to). Windows come from the layer specs
(``ctx.attend``); sinks are weights, passed along. Expert tensors use the Hugging Face
layout (``gate_up_proj`` [E, H, 2I], gate and up interleaved; ``down_proj`` [E, I, H]).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.errors import WeightError
from pagedkv.modeling.attention import GQAAttention
from pagedkv.modeling.decoder import DecoderLM, DecoderModel, PreNormLayer
from pagedkv.modeling.layers import RMSNorm, Rope, head_dim, routing


class GptOssRouter(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        e, self.top_k, _, _ = routing(config.num_local_experts, config.num_experts_per_tok)
        self.weight = nn.Parameter(torch.zeros(e, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(e))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], weights [T, k]): softmax over the top-k logits."""
        top, ids = torch.topk(F.linear(x, self.weight, self.bias), self.top_k, dim=-1)
        return ids, torch.softmax(top, dim=-1, dtype=top.dtype)


class GptOssExperts(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i))
        self.down_proj = nn.Parameter(torch.zeros(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h))
        # transformers before 5.2x fixed these in the model code (1.702, 7.0), not the config
        self.alpha = getattr(config, "swiglu_alpha", 1.702)
        self.limit = getattr(config, "swiglu_limit", 7.0)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            rows, slot = torch.where(ids == e)
            gate_up = x[rows] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            gate = gate_up[..., ::2].clamp(max=self.limit)
            up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
            y = ((up + 1) * gate * torch.sigmoid(gate * self.alpha)) @ self.down_proj[e]
            y = (y + self.down_proj_bias[e]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(x.dtype))
        return out


class GptOssMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.router = GptOssRouter(config)
        self.experts = GptOssExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.router(x)
        return self.experts(x, ids, weights)


class GptOssDecoderLayer(PreNormLayer):
    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = GQAAttention(config, f"model.layers.{index}.self_attn", sinks=True)
        self.mlp = GptOssMLP(config)
        self.input_layernorm = RMSNorm(h, eps, cast_after=True)
        self.post_attention_layernorm = RMSNorm(h, eps, cast_after=True)


class GptOssForCausalLM(DecoderLM):
    architectures = ("GptOssForCausalLM",)

    def __init__(self, config: Any) -> None:
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps, cast_after=True)
        super().__init__(config, DecoderModel(config, GptOssDecoderLayer, norm,
                                              Rope(config, head_dim(config))))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Plain tensors, or the released MXFP4 experts (``*_blocks`` + ``*_scales``),
        dequantized by transformers' own ``convert_moe_packed_tensors`` into this
        model's dtype."""
        return super().load_weights(_dequantized(weights, self.lm_head.weight.dtype))


def _dequantized(weights: Iterable[tuple[str, torch.Tensor]],
                 dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        for part in ("_blocks", "_scales"):
            if name.endswith(part):
                base = name[: -len(part)]
                pair = pending.setdefault(base, {})
                pair[part] = tensor
                if len(pair) == 2:
                    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

                    del pending[base]
                    yield base, convert_moe_packed_tensors(pair["_blocks"], pair["_scales"],
                                                           dtype=dtype)
                break
        else:
            yield name, tensor
    if pending:
        raise WeightError(f"MXFP4 tensors without their pair: {sorted(pending)[:4]}")
