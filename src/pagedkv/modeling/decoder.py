"""The shell most native models share: ``model.embed_tokens`` -> ``model.layers`` ->
``model.norm`` -> ``lm_head``, under the checkpoints' own parameter names.

A model file then holds only what is its own (what its layers are built of, its embedding
scale or logit cap, how checkpoint names map). Nemotron-H keeps its own shell: its checkpoints name the
parts differently (``embeddings``, ``norm_f``) and its blocks take no positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedkv.modeling.base import CausalLM, ForwardContext


class PreNormLayer(nn.Module):
    """x + self_attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x)):
    subclasses build those four modules."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: nn.Module | None,
                ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """The checkpoints' ``model`` submodule: embeddings, ``layer(config, i)`` for each of
    ``num_hidden_layers``, the final ``norm`` and the ``rope`` its layers share (None where
    they rotate nothing, or each layer brings its own)."""

    def __init__(self, config: Any, layer: Callable[[Any, int], nn.Module], norm: nn.Module,
                 rope: nn.Module | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = norm
        self.rotary_emb = rope


class DecoderLM(CausalLM):
    """A :class:`DecoderModel` and its ``lm_head`` (the embedding itself when ``tie``; by
    default the config's ``tie_word_embeddings``). Each layer is called as
    ``layer(x, positions, rope, ctx)`` with ``rope`` from :meth:`rope_for`."""

    def __init__(self, config: Any, model: DecoderModel, *, tie: bool | None = None) -> None:
        super().__init__(config)
        self.model = model
        emb = model.embed_tokens
        self.lm_head = nn.Linear(emb.embedding_dim, emb.num_embeddings, bias=False)
        self.tie = bool(getattr(config, "tie_word_embeddings", False)) if tie is None else tie
        if self.tie:
            self.lm_head.weight = emb.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def rope_for(self, layer: nn.Module) -> nn.Module | None:
        """The rope ``layer`` rotates with (the model's shared one)."""
        return self.model.rotary_emb

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, self.rope_for(layer), ctx)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def tied_weights(self) -> dict[str, str]:
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.tie else {}


class CapturingDecoderLM(DecoderLM):
    """A :class:`DecoderLM` that keeps what drafters read: ``last_hidden`` (the final
    normed rows, for MTP) and ``captured``, the outputs of the layers in
    ``capture_layers`` concatenated per row (DSpark sets the indices)."""

    def __init__(self, config: Any, model: DecoderModel, *, tie: bool | None = None) -> None:
        super().__init__(config, model, tie=tie)
        self.last_hidden: torch.Tensor | None = None
        self.capture_layers: tuple[int, ...] = ()
        self.captured: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x = self.embed(input_ids)
        kept = []
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions, self.rope_for(layer), ctx)
            if i in self.capture_layers:
                kept.append(x)
        self.captured = torch.cat(kept, dim=-1) if kept else None
        self.last_hidden = self.model.norm(x)
        return self.last_hidden
