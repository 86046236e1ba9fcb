"""Gemma 3 text over pagedkv: local (sliding-window) and global layers with their own RoPE
bases, per-head q/k RMSNorm, (1 + w) norms around attention and MLP, embeddings scaled by
sqrt(hidden), ``query_pre_attn_scalar`` scaling, final logit soft-capping where set.
Windows and attention soft-caps come from the layer specs (``ctx.attend``). Reads Gemma 3
text checkpoints and the language model of multimodal ones (vision weights skipped).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from pagedkv.errors import ConfigError
from pagedkv.modeling.attention import GQAAttention
from pagedkv.modeling.base import ForwardContext
from pagedkv.modeling.decoder import DecoderLM, DecoderModel
from pagedkv.modeling.layers import GatedMLP, RMSNorm, Rope

_MULTIMODAL = "model.language_model."
_LEGACY = ("language_model.model.", "language_model.lm_head.")
_SKIP = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
         "multi_modal_projector.")


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = config.layer_types[index]  # picks the layer's rope
        self.self_attn = GQAAttention(
            config, f"model.layers.{index}.self_attn", scale=config.query_pre_attn_scalar ** -0.5,
            qk_norm=partial(RMSNorm, eps=eps, offset=True))
        self.mlp = GatedMLP(h, config.intermediate_size, act=config.hidden_activation)
        self.input_layernorm = RMSNorm(h, eps, offset=True)
        self.post_attention_layernorm = RMSNorm(h, eps, offset=True)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, offset=True)
        self.post_feedforward_layernorm = RMSNorm(h, eps, offset=True)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope,
                ctx: ForwardContext) -> torch.Tensor:
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), positions, rope, ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(DecoderLM):
    """Embeddings scaled by sqrt(hidden); each layer rotates with its layer type's rope."""

    architectures = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")

    def __init__(self, config: Any) -> None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        cap = getattr(text, "attn_logit_softcapping", None)
        if cap is not None:  # the plan's Attention would cap, transformers' Gemma 3 does not
            raise ConfigError(f"Gemma 3 attention has no logit soft-cap (transformers ignores "
                              f"attn_logit_softcapping={cap!r}); set it to null")
        norm = RMSNorm(text.hidden_size, text.rms_norm_eps, offset=True)
        ropes = nn.ModuleDict({
            kind: Rope(text, text.head_dim, kind) for kind in sorted(set(text.layer_types))})
        tie = bool(getattr(text, "tie_word_embeddings", True)) or bool(
            getattr(config, "tie_word_embeddings", False))
        super().__init__(config, DecoderModel(text, Gemma3DecoderLayer, norm, ropes), tie=tie)
        self.text_config = text
        self.embed_scale = text.hidden_size ** 0.5
        self.final_cap = getattr(text, "final_logit_softcapping", None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        emb = self.model.embed_tokens
        return emb(input_ids) * torch.tensor(self.embed_scale, dtype=emb.weight.dtype)

    def rope_for(self, layer: nn.Module) -> nn.Module:
        return self.model.rotary_emb[layer.layer_type]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_cap:
            logits = torch.tanh(logits / self.final_cap) * self.final_cap
        return logits

    def weight_name(self, name: str) -> str | None:
        if name.startswith(_SKIP):
            return None
        if name.startswith(_MULTIMODAL):
            return "model." + name[len(_MULTIMODAL):]
        if name.startswith(_LEGACY):  # checkpoints saved before transformers 5
            return name[len("language_model."):]
        return name
