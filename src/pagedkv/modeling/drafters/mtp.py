"""DeepSeek multi-token prediction (MTP) layers as a drafter.

The checkpoint stores them after the target's layers (``model.layers.{N + j}``, N =
``num_hidden_layers``): per layer ``enorm``, ``hnorm``, ``eh_proj``, a full DeepSeek-V3
decoder block (MLA + MoE), ``shared_head.norm`` / ``shared_head.head`` (and an
``embed_tokens`` copy). The MTP block at position i reads token i + 1 and the target's
final hidden state at i:

    x_i = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])  ->  decoder block  ->  head

so it predicts token i + 2. Its MLA layer (``draft.layers.{j}.self_attn``) caches the
same latent layout as the target's and is planned into the target's block table
(``pagedkv.models.drafters.mtp_layers``: position_offset 1). Chained for k > 1: the next
draft reads the previous draft and the MTP block's own output hidden state.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedkv.errors import ConfigError, WeightError
from pagedkv.modeling.base import ForwardContext
from pagedkv.modeling.deepseek_v3 import DecoderLayer, expert_pieces
from pagedkv.modeling.layers import RMSNorm
from pagedkv.modeling.mla import MLARope
from pagedkv.modeling.weight_pieces import Piece, load_pieces


class SharedHead(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class MTPLayer(nn.Module):
    """One MTP depth; its decoder block is a DeepSeek-V3 layer named for the drafter."""

    def __init__(self, config: Any, depth: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = DecoderLayer(config, config.num_hidden_layers + depth)
        self.block.self_attn.name = f"draft.layers.{depth}.self_attn"
        self.shared_head = SharedHead(config)

    def forward(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor,
                positions: torch.Tensor, rope: MLARope, ctx: ForwardContext) -> torch.Tensor:
        """Token i+1 ids [T], hidden at i [T, h], positions i [T] -> block output [T, h]."""
        x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(input_ids)),
                                    self.hnorm(prev_hidden)], dim=-1))
        return self.block(x, positions, rope, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(hidden))


class DeepseekMTP(nn.Module):
    """The target's ``num_nextn_predict_layers`` MTP depths (depth 0 drafts every token
    when chained; deeper depths are loaded and checked but not run)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        count = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
        if count <= 0:
            raise ConfigError("the target has no MTP layers (num_nextn_predict_layers is 0 "
                              "or absent); --draft mtp needs them")
        self.config = config
        self.layers = nn.ModuleList(MTPLayer(config, j) for j in range(count))
        self.rope = MLARope(config)

    def forward(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor,
                positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.layers[0](input_ids, prev_hidden, positions, self.rope, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layers[0].compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Target checkpoint tensors; only ``model.layers.{N + j}.*`` are taken."""
        return load_pieces(self, weights, self._pieces)

    def _pieces(self, name: str) -> list[Piece]:
        m = _MTP.fullmatch(name)
        if m is None:
            return []
        depth = int(m.group(1)) - self.config.num_hidden_layers
        if depth < 0:
            return []
        if depth >= len(self.layers):
            raise WeightError(f"checkpoint tensor {name!r}: MTP depth {depth} beyond "
                              f"num_nextn_predict_layers {len(self.layers)}")
        rest = m.group(2)
        if not rest.startswith(_OWN):
            rest = "block." + rest
        return expert_pieces(f"layers.{depth}.{rest}", self.config.moe_intermediate_size)


_MTP = re.compile(r"model\.layers\.(\d+)\.(.+)")
_OWN = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")

