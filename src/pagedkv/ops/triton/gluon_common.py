"""Gluon helpers the Hopper decode kernels share (GQA ``decode_gluon``, MLA ``mla_gluon``,
``mla_gluon_pph``, ``mla_gluon_e4m3``, ``mla_gluon_ds``): each query row's key interval,
and the column-half sums of the e4m3 kernels' stacked forms (an operand's e4m3 hi and lo
parts side by side as one MMA's N, so one accumulator holds hi products in its first half
of columns and lo products in the second; each thread holds both halves of its columns,
so the sums need no data from other threads).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def extents(row, q_len, seq_len, draft, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr):
    """Key interval [0, hi) per row, as ``rows.row_extents`` without window/chunk: rows at
    bottom-right positions; rows past q_len (or before position 0) see nothing."""
    first = seq_len - q_len
    pos = first + row
    valid = (row < q_len) & (pos >= 0)
    if CAUSAL:
        hi = pos + 1
    elif HAS_DRAFT:
        hi = first + (row // draft) * draft + draft
    else:
        hi = gl.zeros_like(row) + seq_len
    return gl.where(valid, gl.minimum(hi, seq_len), 0)


@gluon.jit
def half_sum(x):
    """[M, 2N] -> [M, N]: the sums of columns r and N + r (the MMA's accumulator layout
    gives each thread both)."""
    a, b = gl.split(gl.permute(gl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), (0, 2, 1)))
    return a + b
