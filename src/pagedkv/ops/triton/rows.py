"""Per-row key extents shared by the attention kernels (Triton device functions).

A sequence of ``seq_len`` tokens with ``q_len`` query rows has row i at position
seq_len - q_len + i (bottom-right). Each row sees one interval [lo, hi) of key positions,
which expresses every mask of ``pagedkv.ops.masks``: causal, non-causal (whole span or
draft blocks tiled from the first row), sliding window and aligned chunks. Rows without a
position (or past q_len) get the empty interval.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_extents(row, q_len, seq_len, window, chunk, draft,
                CAUSAL: tl.constexpr, HAS_DRAFT: tl.constexpr, HAS_WINDOW: tl.constexpr,
                HAS_CHUNK: tl.constexpr):
    first = seq_len - q_len
    pos = first + row
    valid = (row < q_len) & (pos >= 0)
    if CAUSAL:
        hi = pos + 1
    elif HAS_DRAFT:
        hi = first + (row // draft) * draft + draft
    else:
        hi = tl.zeros_like(row) + seq_len
    hi = tl.minimum(hi, seq_len)
    lo = tl.zeros_like(row)
    if HAS_WINDOW:
        lo = tl.maximum(lo, pos - window + 1)
    if HAS_CHUNK:
        start = (tl.maximum(pos, 0) // chunk) * chunk
        lo = tl.maximum(lo, start)
        hi = tl.minimum(hi, start + chunk)
    lo = tl.where(valid, lo, 2147483647)
    hi = tl.where(valid, hi, 0)
    return lo, hi


@triton.jit
def split_range(kv_lo, kv_hi, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """This split's key range: [kv_lo, kv_hi) cut into NUM_SPLITS BLOCK_N-aligned pieces."""
    start = (tl.minimum(kv_lo, kv_hi) // BLOCK_N) * BLOCK_N
    per = tl.cdiv(tl.cdiv(tl.maximum(kv_hi - start, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
    s_lo = start + split * per
    s_hi = tl.minimum(s_lo + per, kv_hi)
    return s_lo, s_hi


@triton.jit
def soft_cap_scores(s, cap):
    """cap * tanh(s / cap), tanh written with exp so the interpreter runs it too."""
    x = s / cap
    t = tl.exp(-2.0 * tl.abs(x))
    th = (1.0 - t) / (1.0 + t)
    return cap * tl.where(x < 0, -th, th)
