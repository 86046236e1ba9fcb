"""A Mamba-2 mixer (as Nemotron-H names it) over pagedkv state slots.

Parameters are named as in the Hugging Face checkpoint (``mixer.*``). The state per request
is the plan's ``conv`` [k-1, H*P + 2*G*N] (the last k-1 pre-conv x|B|C rows) and ``ssm``
[H, P, N]. The SSM scan is transformers' torch code (the chunked scan for segments of
several tokens, the single-step update for one, as the Hugging Face model runs them); where
the scan starts from and where its state goes is ours (:mod:`.recurrent_state`).
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
from pagedkv.modeling.layers import config_int
from pagedkv.modeling.recurrent_state import RecurrentBatch, StateDict, causal_conv, run_segments


@cache
def _scans():
    """transformers' torch scans (unwrapped: never a hub or mamba_ssm kernel)."""
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    return inspect.unwrap(hf.mamba2_chunk_scan), inspect.unwrap(hf.mamba2_selective_state_update)


class GroupedGatedRMSNorm(nn.Module):
    """x * silu(gate), RMS-normalised per group of ``group_size`` channels, times weight."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() * F.silu(gate.float())
        groups = x.view(*x.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * groups.view(x.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    """Token mixer of a Mamba-2 layer: packed rows [T, hidden] -> [T, hidden]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.num_heads = config.mamba_num_heads
        self.head_dim = config.mamba_head_dim
        self.state_size = config.ssm_state_size
        self.n_groups = config.n_groups
        self.kernel = config.conv_kernel
        self.chunk_size = config_int(config.chunk_size, "chunk_size")
        self.inner = self.num_heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.n_groups * self.state_size
        self.dt_limit = (config.time_step_min, float("inf"))
        if config.mamba_hidden_act != "silu":
            raise UnsupportedArchitectureError(
                f"Mamba-2 with mamba_hidden_act {config.mamba_hidden_act!r}; only silu is implemented"
            )
        hidden = config.hidden_size
        self.in_proj = nn.Linear(hidden, self.inner + self.conv_dim + self.num_heads,
                                 bias=config.use_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel,
                                bias=config.use_conv_bias, groups=self.conv_dim,
                                padding=self.kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GroupedGatedRMSNorm(self.inner, self.inner // self.n_groups,
                                        config.layer_norm_epsilon)
        self.out_proj = nn.Linear(self.inner, hidden, bias=config.use_bias)

    def forward(self, hidden: torch.Tensor, batch: RecurrentBatch, states: StateDict) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]; updates ``states`` (conv, ssm)."""
        gate, xbc, dt = self.in_proj(hidden).split([self.inner, self.conv_dim, self.num_heads], -1)
        (scan,) = run_segments(batch, states, [xbc, dt], self._segment)
        out = self.norm(scan, gate)
        return self.out_proj(out.to(hidden.dtype))

    def _segment(self, init: StateDict, inputs: Sequence[torch.Tensor]):
        xbc, dt = inputs  # [B, L, conv_dim], [B, L, H]
        n, length, _ = xbc.shape
        conv_out, conv_state = causal_conv(xbc, init["conv"], self.conv1d.weight.squeeze(1),
                                           self.conv1d.bias, F.silu)
        gs = self.n_groups * self.state_size
        x, b, c = conv_out.split([self.inner, gs, gs], dim=-1)
        a = -torch.exp(self.A_log.float())
        chunked, one_step = _scans()
        h, p, s = self.num_heads, self.head_dim, self.state_size
        if length == 1:
            ssm = init["ssm"].clone()  # updated in place by the step
            # the step size clamped to dt_limit here, as the chunked scan clamps it:
            # transformers' torch step ignores the limit, so a token decoded one at a time
            # differed from the same token in a prefill (5e-3 at time_step_min 1.001)
            step = F.softplus(dt[:, 0] + self.dt_bias.to(dt.dtype)).clamp(*self.dt_limit)
            y = one_step(
                ssm, x.view(n, h, p), step[:, :, None].expand(-1, -1, p),
                a[:, None, None].expand(-1, p, s), b.view(n, self.n_groups, s),
                c.view(n, self.n_groups, s), self.D[:, None].expand(-1, p),
            )
            return [y.view(n, 1, self.inner)], {"conv": conv_state, "ssm": ssm}
        y, final = chunked(
            x.view(n, length, h, p), dt, a, b.view(n, length, self.n_groups, s),
            c.view(n, length, self.n_groups, s), D=self.D,
            chunk_size=min(self.chunk_size, length),  # a chunk past the rows adds only zeros
            dt_bias=self.dt_bias, initial_states=init["ssm"], dt_softplus=True,
            dt_limit=self.dt_limit, return_final_states=True,
        )
        return [y.reshape(n, length, self.inner)], {"conv": conv_state, "ssm": final}
