"""Qwen3-Next's gated delta net (linear attention) over pagedkv state slots.

Parameters are named as in the Hugging Face checkpoint (``linear_attn.*``). The state per
request is the plan's ``conv`` [k-1, 2*Hk*Dk + Hv*Dv] (the last k-1 pre-conv q|k|v rows)
and ``recurrent`` [Hv, Dk, Dv], both fp32. The delta-rule scan itself is transformers'
torch code (chunked for segments of several tokens, token by token for one), as the
Hugging Face model runs it; what the scan starts from and where its state goes is ours
(:mod:`pagedkv.modeling.recurrent_state`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.errors import UnsupportedArchitectureError
from pagedkv.modeling.recurrent_state import (
    RecurrentBatch,
    StateDict,
    causal_conv,
    run_segments,
)


@cache
def _delta_rules():
    """transformers' torch scans (unwrapped: never a hub or FLA kernel)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    return (inspect.unwrap(hf.torch_chunk_gated_delta_rule),
            inspect.unwrap(hf.torch_recurrent_gated_delta_rule))


class GatedRMSNorm(nn.Module):
    """RMSNorm of x (weight w), then times silu(gate); computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.weight * x.to(dtype)
        return (x * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """Token mixer of a Qwen3-Next ``linear_attention`` layer: packed rows [T, hidden]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_v_heads = config.linear_num_value_heads
        self.num_k_heads = config.linear_num_key_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.kernel = config.linear_conv_kernel_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        if config.hidden_act != "silu":
            raise UnsupportedArchitectureError(
                f"gated delta net with hidden_act {config.hidden_act!r}; only silu is implemented"
            )
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, bias=False,
                                groups=self.conv_dim, padding=self.kernel - 1)
        self.in_proj_qkvz = nn.Linear(self.hidden_size, 2 * self.key_dim + 2 * self.value_dim,
                                      bias=False)
        self.in_proj_ba = nn.Linear(self.hidden_size, 2 * self.num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)

    def _split(self, qkvz: torch.Tensor, ba: torch.Tensor):
        """The checkpoint's per-key-head interleaving -> q, k, v, z [T, heads, dim], b, a."""
        t = qkvz.shape[0]
        per = self.num_v_heads // self.num_k_heads
        qkvz = qkvz.view(t, self.num_k_heads, 2 * self.head_k_dim + 2 * per * self.head_v_dim)
        q, k, v, z = torch.split(
            qkvz, [self.head_k_dim, self.head_k_dim, per * self.head_v_dim, per * self.head_v_dim],
            dim=-1,
        )
        b, a = torch.split(ba.view(t, self.num_k_heads, 2 * per), [per, per], dim=-1)
        return (q, k, v.reshape(t, self.num_v_heads, self.head_v_dim),
                z.reshape(t, self.num_v_heads, self.head_v_dim),
                b.reshape(t, self.num_v_heads), a.reshape(t, self.num_v_heads))

    def forward(self, hidden: torch.Tensor, batch: RecurrentBatch, states: StateDict) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]; updates ``states`` (conv, recurrent)."""
        q, k, v, z, b, a = self._split(self.in_proj_qkvz(hidden), self.in_proj_ba(hidden))
        t = hidden.shape[0]
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        (core,) = run_segments(batch, states, [mixed, beta, g], self._segment)
        out = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(t, self.value_dim))

    def _segment(self, init: StateDict, inputs: Sequence[torch.Tensor]):
        mixed, beta, g = inputs  # [B, L, conv_dim], [B, L, Hv], [B, L, Hv]
        n, length, _ = mixed.shape
        weight = self.conv1d.weight.squeeze(1)
        conv_out, conv_state = causal_conv(mixed, init["conv"], weight, None, F.silu)
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(n, length, self.num_k_heads, self.head_k_dim)
        k = k.reshape(n, length, self.num_k_heads, self.head_k_dim)
        v = v.reshape(n, length, self.num_v_heads, self.head_v_dim)
        if self.num_v_heads != self.num_k_heads:
            # each q/k head serves consecutive value heads; repeat here because older
            # transformers' scans (5.17) expect it done by the caller, newer ones accept both
            q = q.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
            k = k.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
        chunked, token_by_token = _delta_rules()
        scan = token_by_token if length == 1 else chunked
        out, final = scan(q, k, v, g=g, beta=beta, initial_state=init["recurrent"],
                          output_final_state=True, use_qk_l2norm_in_kernel=True)
        return [out], {"conv": conv_state, "recurrent": final}
