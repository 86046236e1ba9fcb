"""Nemotron-H: a stack of single-mixer blocks (Mamba-2, attention, MLP or MoE).

Each block is RMSNorm -> mixer -> residual. Mamba-2 blocks run :class:`Mamba2Mixer` over
pagedkv state slots; attention blocks (no positional encoding: the Mamba layers carry
position) run paged attention over pagedkv blocks; MLP blocks are up -> relu^2 -> down;
MoE blocks route by sigmoid scores with a correction bias (grouped top-k) to non-gated
experts plus a shared expert. Parameter names follow the Hugging Face checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.errors import UnsupportedArchitectureError
from pagedkv.modeling.attention import GQAAttention
from pagedkv.modeling.base import CausalLM, ForwardContext
from pagedkv.modeling.layers import routing
from pagedkv.modeling.mamba2 import Mamba2Mixer
from pagedkv.modeling.weight_pieces import Piece, load_pieces

_ACTS = {"relu2": lambda x: torch.square(F.relu(x)), "silu": F.silu, "gelu": F.gelu}


def _act(name: str):
    try:
        return _ACTS[name]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"Nemotron-H mlp_hidden_act {name!r}; implemented: {sorted(_ACTS)}"
        ) from None


class RMSNorm(nn.Module):
    """weight * x / rms(x), both in fp32, cast back to x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


class NemotronHMLP(nn.Module):
    def __init__(self, config: Any, intermediate: int | None = None) -> None:
        super().__init__()
        size = intermediate or config.intermediate_size
        self.up_proj = nn.Linear(config.hidden_size, size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=config.mlp_bias)
        self.act = _act(config.mlp_hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class NemotronHRouter(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        e = config.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(e, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32))


class NemotronHExperts(nn.Module):
    """Non-gated experts stacked as transformers keeps them: up [E, I, D], down [E, D, I]
    (checkpoints save them per expert; ``load_weights`` stacks them)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        d = config.moe_latent_size or config.hidden_size
        e, i = config.n_routed_experts, config.moe_intermediate_size
        self.up_proj = nn.Parameter(torch.empty(e, i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))


class NemotronHMoE(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        _, self.top_k, self.n_group, self.topk_group = routing(
            config.n_routed_experts, config.num_experts_per_tok, config.n_group,
            config.topk_group)
        self.norm_topk_prob = config.norm_topk_prob
        self.scale = config.routed_scaling_factor
        self.act = _act(config.mlp_hidden_act)
        self.gate = NemotronHRouter(config)
        self.experts = NemotronHExperts(config)
        self.shared_experts = NemotronHMLP(config, config.moe_shared_expert_intermediate_size)
        latent = config.moe_latent_size
        if latent is not None:
            self.fc1_latent_proj = nn.Linear(config.hidden_size, latent, bias=config.mlp_bias)
            self.fc2_latent_proj = nn.Linear(latent, config.hidden_size, bias=config.mlp_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = nn.Identity()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], experts [T, k]): groups ranked by their two best biased scores,
        top-k experts inside the best ``topk_group`` groups, weights from unbiased scores."""
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()
        biased = scores + self.gate.e_score_correction_bias
        t, e = biased.shape
        grouped = biased.view(t, self.n_group, e // self.n_group)
        best_groups = grouped.topk(2, dim=-1)[0].sum(-1).topk(self.topk_group, dim=-1)[1]
        keep = torch.zeros(t, self.n_group, dtype=torch.bool, device=x.device)
        keep.scatter_(1, best_groups, True)
        keep = keep[:, :, None].expand(-1, -1, e // self.n_group).reshape(t, e)
        experts = biased.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scale, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        h = self.fc1_latent_proj(x)
        out = torch.zeros_like(h, dtype=weights.dtype)
        for e in experts.unique().tolist():
            token, slot = torch.where(experts == e)
            y = F.linear(self.act(F.linear(h[token], self.experts.up_proj[e])),
                         self.experts.down_proj[e])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return self.fc2_latent_proj(out.to(x.dtype)) + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        self.kind = config.layers_block_type[index]
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        if self.kind == "linear_attention":
            self.mixer = Mamba2Mixer(config)
            self.state_name = f"model.layers.{index}.mamba"
        elif self.kind == "full_attention":
            self.mixer = GQAAttention(config, f"model.layers.{index}.self_attn", bias=False)
        elif self.kind == "mlp":
            self.mixer = NemotronHMLP(config)
        elif self.kind == "moe":
            self.mixer = NemotronHMoE(config)
        else:
            raise UnsupportedArchitectureError(
                f"Nemotron-H layer {index} is {self.kind!r}; known: linear_attention, "
                "full_attention, mlp, moe"
            )

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.norm(x)
        if self.kind == "linear_attention":
            h = self.mixer(h, *ctx.recurrent(self.state_name))
        elif self.kind == "full_attention":
            h = self.mixer(h, None, None, ctx)  # no positional encoding
        else:
            h = self.mixer(h)
        return x + h


class NemotronHModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            NemotronHBlock(config, i) for i in range(len(config.layers_block_type))
        )
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)


class NemotronHForCausalLM(CausalLM):
    """Packed rows in, hidden states out; ``compute_logits`` for the rows sampled."""

    architectures = ("NemotronHForCausalLM",)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.model = NemotronHModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embeddings.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x = self.model.embeddings(input_ids)
        for layer in self.model.layers:
            x = layer(x, ctx)
        return self.model.norm_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def tied_weights(self) -> dict[str, str]:
        if getattr(self.config, "tie_word_embeddings", False):
            return {"lm_head.weight": "model.embeddings.weight"}
        return {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors (``backbone.*``, per-expert, as saved; or ``model.*`` stacked,
        as in memory) -> parameters."""
        return load_pieces(self, weights, self._pieces)

    def _pieces(self, name: str) -> list[Piece]:
        if name.startswith("mtp.") or (name == "lm_head.weight" and self.config.tie_word_embeddings):
            return []  # the multi-token-prediction layers are not run; a tied head is the embedding
        if name.startswith("backbone."):
            name = "model." + name[len("backbone."):]
        m = _PER_EXPERT.fullmatch(name)
        if m is None:
            return [(name, ())]
        return [(f"{m.group(1)}.{m.group(3)}", (int(m.group(2)),))]


_PER_EXPERT = re.compile(r"(model\.layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight")
