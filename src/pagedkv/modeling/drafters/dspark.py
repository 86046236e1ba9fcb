"""A DSpark block drafter: a few MLA layers with the target's latent layout, sharing the
target's MLA block table.

Context: for every position p the target computed, each drafter layer caches its latent
K at p, projected from the target's hidden states at p (the outputs of target layers
``target_layer_ids``, concatenated, ``fc`` + RMSNorm): the same feature for every layer,
each through its own ``kv_a_proj_with_mqa``, rotated at p (DSpark uses RoPE even when the
target's MLA is NoPE).

Drafting: one forward over a block [anchor, mask x (B-1)] at positions c .. c + B - 1 (the
anchor is the last known token, at c): every block row attends to the context before the
anchor and to every row of its own block (the layers' spec: non-causal, ``draft_block``
B). The block's own K/V goes to the lookahead slots c .. c + B - 1, scratch the next
context catch-up overwrites. Row i > 0 gives logits for the token at c + i; DSpark's
low-rank sequential head adds ``markov_v(markov_u(previous token))`` to them, drafted
left to right from the anchor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedkv.modeling.base import ForwardContext
from pagedkv.modeling.layers import GatedMLP, RMSNorm
from pagedkv.modeling.mla import MLAAttention, MLARope
from pagedkv.ops import write_mla_latent


class DSparkLayer(nn.Module):
    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        self.self_attn = MLAAttention(config, f"draft.layers.{index}.self_attn")
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, act=config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: MLARope,
                ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DSparkModel(nn.Module):
    """Parameters of one DSpark drafter; ``config`` carries the MLA geometry,
    ``block_size``, ``target_layer_ids`` and ``markov_rank``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.block_size = int(config.block_size)
        self.target_layer_ids = tuple(int(i) for i in config.target_layer_ids)
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.mask_embedding = nn.Parameter(torch.zeros(h))
        self.layers = nn.ModuleList(DSparkLayer(config, j) for j in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
        rank = int(config.markov_rank)
        self.markov_u = nn.Embedding(config.vocab_size, rank)
        self.markov_v = nn.Linear(rank, config.vocab_size, bias=False)
        self.rope = MLARope(config)

    @property
    def layer_names(self) -> list[str]:
        return [layer.self_attn.name for layer in self.layers]

    def write_context(self, features: torch.Tensor, positions: torch.Tensor,
                      ctx: ForwardContext) -> None:
        """features [T, n_target_layers * h] of positions [T] -> every layer's latent K
        at those positions (``ctx``'s slot mapping of the drafter's group)."""
        f = self.hidden_norm(self.fc(features))
        for layer in self.layers:
            attn = layer.self_attn
            latent, k_rope = attn.latents(f)
            k_rope = self.rope(k_rope[:, None], positions)[:, 0]
            meta = ctx.meta(attn.name)
            write_mla_latent(latent, k_rope, ctx.cache(attn.name)["latent"],
                             meta.slot_mapping[: f.shape[0]])

    def block_logits(self, anchors: torch.Tensor, positions: torch.Tensor,
                     ctx: ForwardContext) -> torch.Tensor:
        """anchors [N] (one per block), positions [N * B] -> logits [N, B - 1, vocab] for
        the tokens after each anchor (before the Markov bias)."""
        b = self.block_size
        n = anchors.shape[0]
        x = self.mask_embedding.expand(n, b, -1).clone()
        x[:, 0] = self.embed_tokens(anchors)
        x = x.reshape(n * b, -1)
        for layer in self.layers:
            x = layer(x, positions, self.rope, ctx)
        return self.lm_head(self.norm(x)).view(n, b, -1)[:, 1:].float()

    def markov_bias(self, previous: torch.Tensor) -> torch.Tensor:
        """previous tokens [N] -> logit bias [N, vocab]."""
        return self.markov_v(self.markov_u(previous)).float()


class DSparkConfig:
    """A DSpark drafter's geometry (attribute access for the modules, ``to_dict`` for
    :func:`pagedkv.models.layers_from_config`, which plans its layers)."""

    def __init__(self, **fields: Any) -> None:
        fields.setdefault("rms_norm_eps", 1e-6)
        fields.setdefault("hidden_act", "silu")
        fields.setdefault("q_lora_rank", None)
        fields.setdefault("attention_bias", False)
        fields.setdefault("rope_interleave", False)
        fields.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
        self.__dict__.update(fields)

    def to_dict(self) -> dict[str, Any]:
        raw = dict(self.__dict__)
        raw.update(model_type="k3_dspark", architectures=["K3DSparkDraftModel"],
                   num_key_value_heads=raw["num_attention_heads"],
                   layer_types=["full_attention"] * raw["num_hidden_layers"],
                   torch_dtype="float32")
        return raw

    @classmethod
    def for_target(cls, target: Any, *, num_hidden_layers: int, block_size: int,
                   target_layer_ids: list[int], markov_rank: int, **over: Any) -> DSparkConfig:
        """A drafter with the target's MLA geometry (so its latent layout matches)."""
        keys = ("vocab_size", "hidden_size", "num_attention_heads", "q_lora_rank",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "intermediate_size", "rms_norm_eps", "max_position_embeddings")
        fields = {k: getattr(target, k) for k in keys}
        fields.update(num_hidden_layers=num_hidden_layers, block_size=block_size,
                      target_layer_ids=list(target_layer_ids), markov_rank=markov_rank)
        fields.update(over)
        return cls(**fields)
