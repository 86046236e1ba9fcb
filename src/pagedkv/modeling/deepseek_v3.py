"""DeepSeek-V3 (and V3-shaped checkpoints: q-LoRA or a plain q projection, YaRN) over the
paged MLA latent cache in absorbed form (:mod:`pagedkv.modeling.mla`).

MoE runs as a plain loop over the experts a step's tokens picked (sigmoid router with a
score-correction bias, group-limited top-k, shared experts), which is what the reference
needs to be: obviously right, not fast. Multi-token-prediction layers
(``model.layers.{num_hidden_layers}...``) are not part of the target; the MTP drafter
(:mod:`pagedkv.modeling.drafters.mtp`) loads them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.modeling.decoder import CapturingDecoderLM, DecoderModel, PreNormLayer
from pagedkv.modeling.layers import _ACTS, GatedMLP, RMSNorm, routing
from pagedkv.modeling.mla import MLAAttention, MLARope
from pagedkv.modeling.weight_pieces import Piece, expert_pieces, load_pieces


def num_experts(config: Any) -> int:
    """Routed experts (``n_routed_experts``; Kimi: ``num_experts``)."""
    return int(getattr(config, "n_routed_experts", None) or config.num_local_experts)


class TopkRouter(nn.Module):
    """DeepSeek-V3: sigmoid scores + correction bias, best ``topk_group`` groups (by their
    top-2 sum), top-k experts, optionally renormalised. DeepSeek-V2 (``v2``): softmax
    scores, top-k over all experts (``greedy``) or over the best groups by their maximum
    (``group_limited_greedy``), never renormalised."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        e = num_experts(config)
        self.v2 = config.model_type == "deepseek_v2"
        self.weight = nn.Parameter(torch.zeros(e, config.hidden_size))
        if not self.v2:
            self.register_buffer("e_score_correction_bias", torch.zeros(e))
        self.method = getattr(config, "topk_method", None) or "greedy"
        grouped = not (self.v2 and self.method == "greedy")  # V2's greedy ignores groups
        _, self.top_k, self.groups, self.topk_group = routing(
            e, config.num_experts_per_tok, config.n_group if grouped else 1,
            config.topk_group if grouped else 1)
        self.norm = bool(config.norm_topk_prob) and not self.v2
        self.factor = float(config.routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, h] -> (weights [T, k] fp32, expert ids [T, k])."""
        if self.v2:
            return self._v2(F.linear(x.float(), self.weight.float()).softmax(-1))
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        t, e = choice.shape
        grouped = choice.view(t, self.groups, e // self.groups)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(
            1, group_scores.topk(self.topk_group, dim=-1, sorted=False)[1], 1.0)
        keep = keep[:, :, None].expand_as(grouped).reshape(t, e).bool()
        ids = choice.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.factor, ids

    def _v2(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.method == "group_limited_greedy":
            t, e = scores.shape
            grouped = scores.view(t, self.groups, e // self.groups)
            best = grouped.max(-1).values.topk(self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros(t, self.groups, device=scores.device).scatter_(1, best, 1.0)
            keep = keep[:, :, None].expand_as(grouped).reshape(t, e).bool()
            scores = scores.masked_fill(~keep, 0.0)
        weights, ids = scores.topk(self.top_k, dim=-1, sorted=False)
        return weights * self.factor, ids


class Experts(nn.Module):
    """Stacked SwiGLU experts (gate and up fused, as transformers keeps them in memory)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.act = _ACTS[config.hidden_act]
        e, h, i = num_experts(config), config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down_proj[e])
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(x.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.gate = TopkRouter(config)
        self.experts = Experts(config)
        shared = config.moe_intermediate_size * (config.n_shared_experts or 0)
        self.shared_experts = (GatedMLP(config.hidden_size, shared, act=config.hidden_act)
                               if shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DecoderLayer(PreNormLayer):
    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        self.self_attn = MLAAttention(config, f"model.layers.{index}.self_attn")
        dense = index < config.first_k_dense_replace or not config.n_routed_experts
        self.mlp = (GatedMLP(config.hidden_size, config.intermediate_size, act=config.hidden_act)
                    if dense else MoE(config))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV3ForCausalLM(CapturingDecoderLM):
    """DeepSeek-V3, and DeepSeek-V2 (``model_type`` deepseek_v2: softmax router, rope on
    interleaved pairs)."""

    architectures = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")

    def __init__(self, config: Any) -> None:
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        super().__init__(config, DecoderModel(config, DecoderLayer, norm, MLARope(config)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors (per-expert as saved, or stacked as in memory) -> parameters."""
        return load_pieces(self, weights, self._pieces)

    def _pieces(self, name: str) -> list[Piece]:
        m = _LAYER.match(name)
        if m is not None and int(m.group(1)) >= self.config.num_hidden_layers:
            return []  # multi-token-prediction layers: the MTP drafter's, not the target's
        if name == "lm_head.weight" and self.tie:
            return []
        return expert_pieces(name, self.config.moe_intermediate_size)


_LAYER = re.compile(r"model\.layers\.(\d+)\.")
