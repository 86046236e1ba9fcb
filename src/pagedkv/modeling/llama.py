"""The Llama family over pagedkv: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k
RMSNorm). Sliding windows, per layer where ``layer_types`` says so, come from the layers'
specs (``ctx.attend``), not from this file. Parameter names follow the HF checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedkv.modeling.base import ForwardContext
from pagedkv.modeling.decoder import DecoderLM, DecoderModel
from pagedkv.modeling.layers import GatedMLP, RMSNorm, Rope, head_dim


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        self.name = f"model.layers.{index}.self_attn"
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = head_dim(config)
        kind = config.model_type
        qkv_bias = True if kind == "qwen2" else bool(getattr(config, "attention_bias", False))
        o_bias = False if kind == "qwen2" else qkv_bias
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=o_bias)
        self.qk_norm = kind == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope,
                ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.heads, self.head_dim)
        k = self.k_proj(x).view(t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, k, positions)
        out = ctx.attend(self.name, q, k, v, scale=self.head_dim**-0.5)
        return self.o_proj(out.reshape(t, -1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, index)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size,
                            bias=bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope,
                ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(DecoderLM):
    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                     "Qwen3ForCausalLM")

    def __init__(self, config: Any) -> None:
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        super().__init__(config, DecoderModel(config, LlamaDecoderLayer, norm,
                                              Rope(config, head_dim(config))))
