"""Multi-head latent attention (DeepSeek-V2/V3, Kimi) over the paged latent cache.

The layer projects the queries and the compressed latent exactly as the checkpoints do
(q-LoRA or a plain q projection; ``kv_a_proj_with_mqa`` -> RMS-normed latent + shared rope
key), writes [latent | rotated rope key] into its latent cache pages, and attends in
absorbed form (:func:`pagedkv.ops.paged_mla`): ``kv_b_proj`` is split per head into W_UK
and W_UV, so no per-head key or value is ever materialised or cached.

The mask comes from the layer's spec through ``ctx.mask`` (causal for a target, the
draft-block mask for a DSpark drafter), like every other attention layer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedkv.errors import ConfigError
from pagedkv.modeling.base import ForwardContext
from pagedkv.modeling.layers import RMSNorm, rope_frequencies
from pagedkv.ops import paged_mla, write_mla_latent


class MLARope(nn.Module):
    """RoPE over the rope part of MLA queries and keys, with DeepSeek's interleaved pair
    layout (``rope_interleave``) or rotate-half; frequencies and the YaRN attention
    factor come from transformers' ``ROPE_INIT_FUNCTIONS``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        rope_dim, declared = config.qk_rope_head_dim, getattr(config, "head_dim", None)
        v2 = getattr(config, "model_type", None) == "deepseek_v2"
        if declared is not None and declared != rope_dim and not v2:
            # transformers' DeepSeek-V3 sizes its rotary frequencies by head_dim
            raise ConfigError(f"an MLA config's head_dim ({declared!r}) must equal "
                              f"qk_rope_head_dim ({rope_dim!r}), the width RoPE rotates")
        inv, factor = rope_frequencies(config, rope_dim)
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        self.factor = float(factor)
        # DeepSeek-V2 always rotates interleaved pairs (as complex numbers); V3 says so
        self.interleave = bool(getattr(config, "rope_interleave", False)) or (
            getattr(config, "model_type", None) == "deepseek_v2")

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, H, P] rotated at positions [T] (interleaved pairs come out de-interleaved,
        as transformers lays them out, for queries and cached keys alike)."""
        freqs = positions.float()[:, None] * self.inv_freq.to(x.device)
        cos = (freqs.cos() * self.factor).to(x.dtype)[:, None]
        sin = (freqs.sin() * self.factor).to(x.dtype)[:, None]
        if self.interleave:
            a, b = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def softmax_scale(config: Any) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale(factor, mscale_all_dim)^2 where set."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        all_dim = params.get("mscale_all_dim", 0)
        factor = params.get("factor", 1.0)
        if all_dim and factor > 1:
            m = 0.1 * all_dim * math.log(factor) + 1.0
            scale *= m * m
    return scale


class MLAAttention(nn.Module):
    """One MLA layer named ``name`` (its cache and mask are looked up by that name)."""

    def __init__(self, config: Any, name: str, *, scale: float | None = None) -> None:
        super().__init__()
        self.name = name
        self.heads = config.num_attention_heads
        self.nope = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.rank = config.kv_lora_rank
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        h = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        qk = self.nope + self.rope_dim
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, h, bias=bias)
        self.scale = softmax_scale(config) if scale is None else scale

    def queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, h] -> (q_nope [T, H, Dn], q_rope [T, H, P]) before rotation."""
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(
            self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(x.shape[0], self.heads, self.nope + self.rope_dim)
        return q[..., : self.nope], q[..., self.nope :]

    def latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, h] -> (normed latent [T, R], rope key [T, P] before rotation)."""
        kv = self.kv_a_proj_with_mqa(x)
        return self.kv_a_layernorm(kv[:, : self.rank]), kv[:, self.rank :]

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UK [H, Dn, R], W_UV [H, Dv, R]."""
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: MLARope | None,
                ctx: ForwardContext) -> torch.Tensor:
        q_nope, q_rope = self.queries(x)
        latent, k_rope = self.latents(x)
        if rope is not None:
            q_rope = rope(q_rope, positions)
            k_rope = rope(k_rope[:, None], positions)[:, 0]
        meta = ctx.meta(self.name)
        cache = ctx.cache(self.name)["latent"]
        t = x.shape[0]
        write_mla_latent(latent, k_rope, cache, meta.slot_mapping[:t])
        w_uk, w_uv = self.absorbed_weights()
        out = paged_mla(
            q_nope, q_rope if self.rope_dim else None, cache, meta.query_start_loc,
            meta.seq_lens, meta.block_table, w_uk=w_uk, w_uv=w_uv, scale=self.scale,
            mask=ctx.mask(self.name),
            compute_dtype=torch.float32 if x.dtype != torch.float64 else torch.float64,
        )
        return self.o_proj(out.reshape(t, -1))
