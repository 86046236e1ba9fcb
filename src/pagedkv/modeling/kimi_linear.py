"""Kimi-Linear (the Kimi-K3 shape): KDA recurrent layers on pagedkv state slots and MLA
layers (no rope: the rope part of the latent is cached and used unrotated) on the paged
latent cache, with DeepSeek-style MoE.

Checkpoints name both mixers ``model.layers.{i}.self_attn``; pagedkv's layer names (and so
the cache and block-table group a layer reads) are ``.linear_attn`` for KDA layers and
``.self_attn`` for MLA layers. The KDA scan itself is transformers' torch code (chunked
for segments of several tokens, token by token for one), as the Hugging Face model runs
it; which state it starts from and where its state goes is ours
(:mod:`pagedkv.modeling.recurrent_state`).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Sequence
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.errors import UnsupportedArchitectureError
from pagedkv.modeling.base import ForwardContext
from pagedkv.modeling.decoder import CapturingDecoderLM, DecoderModel, PreNormLayer
from pagedkv.modeling.deepseek_v3 import MoE
from pagedkv.modeling.layers import GatedMLP, RMSNorm
from pagedkv.modeling.mla import MLAAttention
from pagedkv.modeling.recurrent_state import StateDict, causal_conv, run_segments
from pagedkv.modeling.weight_pieces import Piece, expert_pieces, load_pieces


@cache
def _kda_scans():
    """transformers' torch KDA scans (unwrapped: never a hub or FLA kernel)."""
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    return (inspect.unwrap(hf.chunk_kimi_delta_attention),
            inspect.unwrap(hf.recurrent_kimi_delta_attention))


class ForgetGate(nn.Module):
    """Per-channel decay log-rate: -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        d, h = config.linear_head_dim, config.linear_num_heads
        self.head_dim = d
        self.f_a_proj = nn.Linear(config.hidden_size, d, bias=False)
        self.f_b_proj = nn.Linear(d, h * d, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(h * d))
        self.A_log = nn.Parameter(torch.zeros(1, 1, h, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> g [T, H, D] fp32."""
        g = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float())
        g = g.view(x.shape[0], -1, self.head_dim)
        soft = torch.where(g > 20.0, g, torch.log1p(torch.exp(g)))
        return -self.A_log.float().exp()[0] * soft


class SigmoidGatedNorm(nn.Module):
    """fp32 RMSNorm times sigmoid(gate) (KDA's output norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = self.weight.float() * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps))
        return (y * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    """KDA token mixer: packed rows [T, hidden]; state ``conv`` [k-1, 3*H*D] (pre-conv
    q|k|v rows) and ``recurrent`` [H, D, D] per request slot."""

    def __init__(self, config: Any, name: str) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise UnsupportedArchitectureError(
                f"KDA with hidden_act {config.hidden_act!r}; only silu is implemented")
        self.name = name
        self.heads, self.head_dim = config.linear_num_heads, config.linear_head_dim
        dim = self.heads * self.head_dim
        self.dim = dim
        h = config.hidden_size
        k = config.linear_conv_kernel_dim
        self.q_proj = nn.Linear(h, dim, bias=False)
        self.k_proj = nn.Linear(h, dim, bias=False)
        self.v_proj = nn.Linear(h, dim, bias=False)
        self.conv1d = nn.Conv1d(3 * dim, 3 * dim, k, bias=False, groups=3 * dim, padding=k - 1)
        self.forget_gate = ForgetGate(config)
        self.b_proj = nn.Linear(h, self.heads, bias=False)
        self.g_a_proj = nn.Linear(h, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, dim, bias=False)
        self.o_norm = SigmoidGatedNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = nn.Linear(dim, h, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: None,
                ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        g = self.forget_gate(x)
        beta = torch.sigmoid(self.b_proj(x))
        batch, states = ctx.recurrent(self.name)
        (core,) = run_segments(batch, states, [mixed, g, beta], self._segment)
        gate = self.g_b_proj(self.g_a_proj(x)).view(t, self.heads, self.head_dim)
        out = self.o_norm(core.view(t, self.heads, self.head_dim), gate)
        return self.o_proj(out.reshape(t, self.dim))

    def _segment(self, init: StateDict, inputs: Sequence[torch.Tensor]):
        mixed, g, beta = inputs  # [B, L, 3*dim], [B, L, H, D], [B, L, H]
        n, length, _ = mixed.shape
        conv_out, conv_state = causal_conv(mixed, init["conv"], self.conv1d.weight.squeeze(1),
                                           None, F.silu)
        q, k, v = (y.reshape(n, length, self.heads, self.head_dim)
                   for y in conv_out.split(self.dim, dim=-1))
        chunked, token_by_token = _kda_scans()
        scan = token_by_token if length == 1 else chunked
        out, final = scan(q, k, v, g=g, beta=beta, initial_state=init["recurrent"],
                          output_final_state=True, use_qk_l2norm_in_kernel=True)
        return [out], {"conv": conv_state, "recurrent": final.float()}


class DecoderLayer(PreNormLayer):
    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        kind = config.layer_types[index]
        if kind == "full_attention":
            self.self_attn: nn.Module = MLAAttention(
                config, f"model.layers.{index}.self_attn",
                scale=(config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5)
        elif kind == "linear_attention":
            self.self_attn = KimiDeltaAttention(config, f"model.layers.{index}.linear_attn")
        else:
            raise UnsupportedArchitectureError(f"Kimi-Linear layer {index} has type {kind!r}")
        sparse = config.mlp_layer_types[index] == "sparse"
        self.mlp = MoE(config) if sparse else GatedMLP(
            config.hidden_size, config.intermediate_size, act=config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class KimiLinearForCausalLM(CapturingDecoderLM):
    """No shared rope: MLA layers use the rope part of their latent unrotated."""

    architectures = ("KimiLinearForCausalLM",)

    def __init__(self, config: Any) -> None:
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        super().__init__(config, DecoderModel(config, DecoderLayer, norm))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors (per-expert as saved, or stacked as in memory) -> parameters."""
        return load_pieces(self, weights, self._pieces)

    def _pieces(self, name: str) -> list[Piece]:
        """In-memory names as they are; checkpoint names as Moonshot saves them
        (``block_sparse_moe``, experts' w1/w2/w3, separate q/k/v convs, forget-gate
        tensors on the attention module) mapped onto the same parameters."""
        if name == "lm_head.weight" and self.tie:
            return []
        name = name.replace(".block_sparse_moe.", ".mlp.")
        name = _FORGET.sub(r"self_attn.forget_gate.\1", name)
        name = _W123.sub(lambda m: f"{m.group(1)}.{_W_NAMES[m.group(2)]}.weight", name)
        conv = _QKV_CONV.fullmatch(name)
        if conv is not None:
            dim = self.config.linear_num_heads * self.config.linear_head_dim
            i = "qkv".index(conv.group(2))
            return [(f"{conv.group(1)}.conv1d.weight", (slice(i * dim, (i + 1) * dim),))]
        return expert_pieces(name, self.config.moe_intermediate_size)


_FORGET = re.compile(r"self_attn\.(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)$")
_W123 = re.compile(r"(\.experts\.\d+)\.(w1|w2|w3)\.weight$")
_W_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_QKV_CONV = re.compile(r"(.*\.self_attn)\.([qkv])_conv1d\.weight")
