"""Qwen3-Next: gated delta net layers and gated full-attention layers, MoE MLPs.

Full attention: q_proj yields a query and an output gate per head, q/k RMSNorm (1 + w),
RoPE on the first ``partial_rotary_factor`` of each head, paged attention through the
context's seam (``ctx.attend``), output times sigmoid(gate). Linear attention:
:class:`GatedDeltaNet` over pagedkv state slots (``ctx.recurrent``). Parameter names follow
the Hugging Face checkpoint; per-expert checkpoint tensors load into stacked experts.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.errors import ConfigError
from pagedkv.modeling.attention import GQAAttention
from pagedkv.modeling.base import ForwardContext
from pagedkv.modeling.decoder import DecoderLM, DecoderModel
from pagedkv.modeling.gated_delta_net import GatedDeltaNet
from pagedkv.modeling.layers import GatedMLP, RMSNorm, Rope, head_dim, routing
from pagedkv.modeling.weight_pieces import Piece, expert_pieces, load_pieces


class Qwen3NextRouter(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))


class Qwen3NextExperts(nn.Module):
    """Expert weights stacked as transformers keeps them: gate_up [E, 2I, H], down [E, H, I]
    (checkpoints save them per expert; ``load_weights`` stacks them)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))


class Qwen3NextSparseMoe(nn.Module):
    """Softmax top-k routing (renormalised when ``norm_topk_prob``), a plain loop over the
    experts hit, plus a sigmoid-gated shared expert."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        _, self.top_k, _, _ = routing(config.num_experts, config.num_experts_per_tok)
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = Qwen3NextRouter(config)
        self.experts = Qwen3NextExperts(config)
        self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            token, slot = torch.where(experts == e)
            gate, up = F.linear(x[token], self.experts.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.experts.down_proj[e])
            out.index_add_(0, token, y * weights[token, slot, None])
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        self.kind = config.layer_types[index]
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(config)
            self.mixer_name = f"model.layers.{index}.linear_attn"
        else:
            self.self_attn = GQAAttention(
                config, f"model.layers.{index}.self_attn", output_gate=True,
                qk_norm=partial(RMSNorm, eps=config.rms_norm_eps, offset=True))
        sparse = (index not in config.mlp_only_layers and config.num_experts > 0
                  and (index + 1) % config.decoder_sparse_step == 0)
        self.mlp = Qwen3NextSparseMoe(config) if sparse else GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=True)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope,
                ctx: ForwardContext) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.kind == "linear_attention":
            batch, states = ctx.recurrent(self.mixer_name)
            h = self.linear_attn(h, batch, states)
        else:
            h = self.self_attn(h, positions, rope, ctx)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextForCausalLM(DecoderLM):
    """Packed rows in, hidden states out; ``compute_logits`` for the rows sampled."""

    architectures = ("Qwen3NextForCausalLM",)

    def __init__(self, config: Any) -> None:
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=True)
        factor = config.rope_parameters.get("partial_rotary_factor", 1.0)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (
                0 < factor <= 1):
            raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {factor!r}")
        rope = Rope(config, int(head_dim(config) * factor))  # rotates that part of each head
        super().__init__(config, DecoderModel(config, Qwen3NextDecoderLayer, norm, rope))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors (per-expert as saved, or stacked as in memory) -> parameters."""
        return load_pieces(self, weights, self._pieces)

    def _pieces(self, name: str) -> list[Piece]:
        if name.startswith("mtp.") or (name == "lm_head.weight" and self.tie):
            return []  # the multi-token-prediction head is not run; a tied head is the embedding
        return expert_pieces(name, self.config.moe_intermediate_size)
