"""The GQA/MHA attention layer the native models share (Llama family, gpt-oss, Gemma 3,
Qwen3-Next, Nemotron-H): q/k/v/o projections under the checkpoints' names, then the paged
attention of ``ctx.attend``. What differs between the models is a constructor argument.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedkv.modeling.base import ForwardContext
from pagedkv.modeling.layers import Rope, head_dim


class GQAAttention(nn.Module):
    """One attention layer named ``name`` (its cache and mask are looked up by that name).

    ``bias``: q/k/v (and, unless ``o_bias`` says otherwise, o) projection bias, by default
    the config's ``attention_bias``; ``scale``: default 1/sqrt(head_dim); ``qk_norm``:
    builds the per-head q and k norms from the head size (applied before rope);
    ``sinks``: per-head sink logits (gpt-oss); ``output_gate``: q_proj also yields a gate
    per head and the output is multiplied by its sigmoid (Qwen3-Next).
    """

    def __init__(self, config: Any, name: str, *, bias: bool | None = None,
                 o_bias: bool | None = None, scale: float | None = None,
                 qk_norm: Callable[[int], nn.Module] | None = None, sinks: bool = False,
                 output_gate: bool = False) -> None:
        super().__init__()
        self.name = name
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = head_dim(config)
        self.scale = self.head_dim ** -0.5 if scale is None else scale
        self.output_gate = output_gate
        if bias is None:
            bias = bool(getattr(config, "attention_bias", False))
        h, q_width = config.hidden_size, self.heads * self.head_dim * (2 if output_gate else 1)
        self.q_proj = nn.Linear(h, q_width, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=bias if o_bias is None else o_bias)
        self.q_norm = self.k_norm = None
        if qk_norm is not None:
            self.q_norm = qk_norm(self.head_dim)
            self.k_norm = qk_norm(self.head_dim)
        self.sinks = nn.Parameter(torch.zeros(self.heads)) if sinks else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None, rope: Rope | None,
                ctx: ForwardContext) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; ``rope`` None: no positional rotation."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.heads, -1)
        if self.output_gate:
            q, gate = q.chunk(2, dim=-1)
        k = self.k_proj(x).view(t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = rope(q, k, positions)
        out = ctx.attend(self.name, q, k, v, scale=self.scale, sinks=self.sinks).reshape(t, -1)
        if self.output_gate:
            out = out * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(out)
