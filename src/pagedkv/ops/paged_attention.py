"""Reference paged attention for GQA/MHA over mixed prefill and decode rows.

Every row is handled the same way (no decode/prefill split): this is the oracle that
fast kernels, which do split, are tested against. Work is per sequence and in
``compute_dtype`` (float32 by default; float64 for the tightest comparisons).

Tensors: q [T, Hq, D]; k_cache [num_blocks, block_size, Hkv, D]; v_cache
[num_blocks, block_size, Hkv, Dv]; query head h reads KV head h // (Hq // Hkv). fp8
caches are read with their per-tensor scales. See ``sequences`` for query_start_loc,
seq_lens and block_table, ``masks`` for which keys a row sees.
"""

from __future__ import annotations

import math

import torch

from pagedkv.errors import InvalidArgumentError
from pagedkv.ops.gather import read_positions, to_compute
from pagedkv.ops.masks import CAUSAL, Mask, visible_keys
from pagedkv.ops.sequences import sequences


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seen: torch.Tensor,
    scale: float,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense masked attention of one sequence: q [Q, Hq, D], k [N, Hkv, D], v [N, Hkv, Dv],
    seen [Q, N] -> [Q, Hq, Dv]. Soft-cap is cap * tanh(s / cap) after scaling; a sink is a
    per-query-head logit that joins the softmax denominator and reads no value. A row that
    sees no key outputs 0."""
    rows, heads, _ = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    qg = q.reshape(rows, kv_heads, group, q.shape[-1])
    scores = torch.einsum("qhgd,khd->hgqk", qg, k) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).reshape(kv_heads, group, 1, 1).expand(-1, -1, rows, 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : k.shape[0]]
    blind = ~seen.any(dim=1)  # rows without a position see nothing: output 0, not NaN
    probs = probs.masked_fill(blind[:, None], 0.0)
    out = torch.einsum("hgqk,khd->qhgd", probs, v)
    return out.reshape(rows, heads, v.shape[-1])


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    mask: Mask = CAUSAL,
    scale: float | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Attention output [T, Hq, Dv] of packed queries over a paged K/V cache.

    ``scale`` defaults to 1/sqrt(D). ``sinks`` [Hq] (gpt-oss) are logits in the softmax
    denominator. Padding rows (past query_start_loc[-1]) come out as zeros.
    """
    check_attention_args(q, k_cache, v_cache, soft_cap, sinks)
    rows, heads, dim = q.shape
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    out = torch.zeros(rows, heads, v_cache.shape[-1], dtype=compute_dtype, device=q.device)
    for s in sequences(query_start_loc, seq_lens, block_table, rows, k_cache.shape[1]):
        seen = visible_keys(mask, s.seq_len, s.q_len, q.device)
        read = seen.any(dim=0).nonzero().flatten()  # keys some row sees; no other is touched
        k = to_compute(read_positions(k_cache, block_table[s.index], read), k_scale, compute_dtype)
        v = to_compute(read_positions(v_cache, block_table[s.index], read), v_scale, compute_dtype)
        rows_q = q[s.q_start : s.q_start + s.q_len].to(compute_dtype)
        out[s.q_start : s.q_start + s.q_len] = attend(
            rows_q, k, v, seen[:, read], scale, soft_cap, sinks
        )
    return out.to(out_dtype or q.dtype)


def check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    soft_cap: float | None,
    sinks: torch.Tensor | None,
) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise InvalidArgumentError(
            f"need q [T, Hq, D] and caches [blocks, block_size, Hkv, D]; got q "
            f"{tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != q.shape[2]:
        raise InvalidArgumentError(
            f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)} and q "
            f"{tuple(q.shape)} disagree on blocks, block size, KV heads or head_dim"
        )
    if heads % kv_heads:
        raise InvalidArgumentError(f"{heads} query heads cannot share {kv_heads} KV heads")
    if soft_cap is not None and not soft_cap > 0:
        raise InvalidArgumentError(f"soft_cap must be > 0, got {soft_cap!r}")
    if sinks is not None and tuple(sinks.shape) != (heads,):
        raise InvalidArgumentError(f"sinks must be [{heads}] (one per query head), got {tuple(sinks.shape)}")
