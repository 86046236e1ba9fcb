"""Next-token choice per request: greedy, or temperature / top-k / top-p sampling with the
request's own generator (so a seeded request draws the same tokens in any batch)."""

from __future__ import annotations

import torch

from pagedkv.engine.request import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> int:
    """One token from ``logits`` [vocab] (float32)."""
    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        order = torch.argsort(scores, descending=True)
        probs = torch.softmax(scores[order], dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly better tokens
        drop = order[before >= params.top_p]
        scores = scores.index_fill(0, drop, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
