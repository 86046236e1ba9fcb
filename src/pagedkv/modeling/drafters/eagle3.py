"""An EAGLE-3 drafter for a Llama-family target: one decoder layer over the target's
hidden states.

At position p it reads token p + 1 and a feature of the target at p: the outputs of three
target layers (low, middle, high), concatenated and projected by ``fc``; the layer's
attention input is [input_layernorm(embed(token)) ; hidden_norm(feature)] (2h wide), its
residual the feature. Its KV at p therefore exists only once token p + 1 is known: the
layer is planned with position_offset 1 (``draft.layers.0.self_attn``, the target's GQA
geometry, its own block-table group). Chained drafts read the layer's own output as the
next feature (no ``fc``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedkv.modeling.base import ForwardContext
from pagedkv.modeling.layers import GatedMLP, RMSNorm, Rope

NAME = "draft.layers.0.self_attn"


class Eagle3Attention(nn.Module):
    def __init__(self, h: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(2 * h, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * h, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * h, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, h, bias=False)


class Eagle3Model(nn.Module):
    """``config``: the target's (a transformers Llama config) plus ``target_layer_ids``."""

    def __init__(self, config: Any, target_layer_ids: list[int]) -> None:
        super().__init__()
        h = config.hidden_size
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or h // heads
        self.config = config
        self.target_layer_ids = tuple(int(i) for i in target_layer_ids)
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(h, heads, config.num_key_value_heads, head_dim)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = GatedMLP(h, config.intermediate_size)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
        # a full-attention layer: the target's global RoPE where its bases differ by layer
        # type (Gemma 3's local and global); ignored where they do not
        self.rope = Rope(config, head_dim, "full_attention")

    def forward(self, input_ids: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """Token p + 1 [T], feature at p [T, n*h] (target layers; ``fc`` applied here) or
        [T, h] (a chained draft's own output), positions p [T] -> output [T, h]."""
        if feature.shape[-1] != self.fc.out_features:
            feature = self.fc(feature)
        a = self.self_attn
        t = input_ids.shape[0]
        x = torch.cat([self.input_layernorm(self.embed_tokens(input_ids)),
                       self.hidden_norm(feature)], dim=-1)
        q = a.q_proj(x).view(t, a.heads, a.head_dim)
        k = a.k_proj(x).view(t, a.kv_heads, a.head_dim)
        v = a.v_proj(x).view(t, a.kv_heads, a.head_dim)
        q, k = self.rope(q, k, positions)
        out = ctx.attend(NAME, q, k, v, scale=a.head_dim ** -0.5)
        y = feature + a.o_proj(out.reshape(t, -1))
        return y + self.mlp(self.post_attention_layernorm(y))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def layer_config(self) -> dict[str, Any]:
        """The drafter's config as ``pagedkv.models`` reads drafters (an EAGLE-3 layer)."""
        c = self.config
        a = self.self_attn
        return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                "num_hidden_layers": 1, "hidden_size": c.hidden_size,
                "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads,
                "head_dim": a.head_dim, "vocab_size": c.vocab_size,
                "draft_vocab_size": c.vocab_size, "torch_dtype": "float32",
                "eagle_aux_hidden_state_layer_ids": list(self.target_layer_ids),
                "max_position_embeddings": c.max_position_embeddings}


def default_layers(num_layers: int) -> list[int]:
    """Low, middle and high target layers, as EAGLE-3 picks them."""
    return sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)})

