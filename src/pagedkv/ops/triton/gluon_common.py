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
def request_tile(qsl_ptr, lens_ptr, tiles):
    """Program (request x row tile, split) of the MLA kernels' grid: (request, row tile,
    split, first query token, query tokens, sequence length)."""
    pid = gl.program_id(0)
    b = pid // tiles
    q_start = gl.load(qsl_ptr + b)
    q_len = gl.load(qsl_ptr + b + 1) - q_start
    return b, pid % tiles, gl.program_id(1), q_start, q_len, gl.load(lens_ptr + b)


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


@gluon.jit
def key_order(x):
    """[64 keys, N] -> the keys in the MLA e4m3 kernels' V^T order
    (``mla_gluon_e4m3._transpose_matrix``): position 16w + 4q + 2e + h holds key
    16w + 8h + 2q + e (the keys 8 apart that a thread of an MMA accumulator holds side by
    side: P's stores are 16-bit)."""
    y = gl.permute(gl.reshape(x, [4, 2, 4, 2, x.shape[1]]), (0, 2, 3, 1, 4))
    return gl.reshape(y, [64, x.shape[1]])


@gluon.jit
def e4m3_softmax(s, m_i, l_acc, p_dst, BLOCK_M: gl.constexpr, MLA_KEYS: gl.constexpr = False):
    """One tile's online-softmax step on scaled scores ``s`` [keys, rows] (log2 units, -inf
    where not seen): P x 256 (normal in e4m3 down to 2^-14 after the factor) as e4m3 hi and
    lo, stored transposed into rows [0, BLOCK_M) and [BLOCK_M, 2 BLOCK_M) of ``p_dst``;
    returns (alpha, new maxima, row sums kept per thread), the sums adding the e4m3 values
    the MMA multiplies. ``MLA_KEYS``: P's keys stored in the MLA e4m3 kernels' V^T order
    (``mla_gluon_e4m3.key_order``)."""
    e4: gl.constexpr = gl.float8e4nv
    m_new = gl.maximum(m_i, gl.max(s, 0))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - m_use[None, :]) * 256.0
    alpha = gl.exp2(m_i - m_use)
    p8 = p.to(e4)
    pq = p8.to(gl.float32)
    p8l = (p - pq).to(e4)
    l_new = l_acc * alpha[None, :] + (pq + p8l.to(gl.float32))
    if MLA_KEYS:
        p8 = key_order(p8)
        p8l = key_order(p8l)
    p_dst.slice(0, BLOCK_M, dim=0).store(gl.permute(p8, (1, 0)))
    p_dst.slice(BLOCK_M, BLOCK_M, dim=0).store(gl.permute(p8l, (1, 0)))
    return alpha, m_new, l_new
