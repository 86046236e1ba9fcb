"""Independent float64 dense attention with explicit masks: the reference the ops tests
compare against. It must not import pagedkv.ops (it would then test the ops against
themselves). Masks are built by plain Python loops from the rules as stated in words;
MLA is computed in its naive form (keys and values decompressed per head), not absorbed.
"""

from __future__ import annotations

import math
import os
import random
import struct

import torch


def test_device() -> torch.device:
    """Where the ops tests run: env PAGEDKV_TEST_DEVICE (default cpu)."""
    return torch.device(os.environ.get("PAGEDKV_TEST_DEVICE", "cpu"))


test_device.__test__ = False  # not a test despite its name


def dense_mask(
    seq_len: int,
    q_len: int,
    *,
    causal: bool = True,
    draft_block: int | None = None,
    window: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Bool [q_len, seq_len]: may query row i (at position seq_len - q_len + i) read key k?

    - causal: keys at or before the row's own position;
    - non-causal draft blocks of B rows (counted from the first query row): every key
      before the block's first position (its anchor) and every key of the block;
      non-causal without blocks: every key of the sequence;
    - window W: only the W latest positions up to the row's own (k > p - W);
    - chunk C: only keys in the same aligned chunk of C positions as the row;
    - a row whose position is negative (no position of its own) sees nothing.
    """
    rows = []
    for i in range(q_len):
        p = seq_len - q_len + i
        row = []
        for k in range(seq_len):
            if p < 0:
                ok = False
            elif causal:
                ok = k <= p
            elif draft_block is None:
                ok = True
            else:
                anchor = (seq_len - q_len) + (i // draft_block) * draft_block
                ok = k < anchor or anchor <= k < anchor + draft_block
            if window is not None and not p - window < k:
                ok = False
            if chunk is not None and math.floor(k / chunk) != math.floor(p / chunk):
                ok = False
            row.append(ok)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool).reshape(q_len, seq_len)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [Q, Hq, D], k [N, Hkv, D], v [N, Hkv, Dv], mask [Q, N] -> [Q, Hq, Dv] in float64.

    Query head h uses KV head h // (Hq // Hkv). The softmax is written out: weights
    exp(s - m) over visible keys, divided by their sum plus exp(sink - m) when a sink is
    given. A row that sees nothing outputs zeros.
    """
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    mask = mask.cpu()
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape[0], heads, v.shape[-1], dtype=torch.float64)
    for h in range(heads):
        kh = h // (heads // kv_heads)
        for i in range(q.shape[0]):
            keys = mask[i].nonzero().flatten()
            if keys.numel() == 0:
                continue
            s = (k[keys, kh, :] @ q[i, h, :]) * scale
            if soft_cap is not None:
                s = soft_cap * torch.tanh(s / soft_cap)
            m = s.max()
            sink = None if sinks is None else sinks[h].double().cpu()
            if sink is not None:
                m = torch.maximum(m, sink)
            w = torch.exp(s - m)
            denom = w.sum() + (torch.exp(sink - m) if sink is not None else 0.0)
            out[i, h] = (w / denom) @ v[keys, kh, :]
    return out


def dense_mla(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor | None,
    c_kv: torch.Tensor,
    k_rope: torch.Tensor | None,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """Naive MLA in float64: decompress k_nope = W_UK c and v = W_UV c per head, append the
    shared k_rope to every head's key, then ordinary multi-head attention."""
    c = c_kv.double().cpu()
    k_nope = torch.einsum("hdr,nr->nhd", w_uk.double().cpu(), c)
    v = torch.einsum("hvr,nr->nhv", w_uv.double().cpu(), c)
    q = q_nope.double().cpu()
    k = k_nope
    if q_rope is not None and q_rope.shape[-1]:
        heads = q.shape[1]
        q = torch.cat([q, q_rope.double().cpu()], dim=-1)
        rope = k_rope.double().cpu()[:, None, :].expand(-1, heads, -1)
        k = torch.cat([k_nope, rope], dim=-1)
    return dense_attention(q, k, v, mask, scale=scale)


def place_blocks(
    num_blocks_needed: list[int], num_blocks: int, rng: random.Random, width: int | None = None
) -> torch.Tensor:
    """Block table int32 [batch, width]: blocks drawn from a shuffled free list (random
    placement); unused entries 0."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    width = max(num_blocks_needed, default=0) if width is None else width
    table = torch.zeros(len(num_blocks_needed), max(width, 1), dtype=torch.int32)
    for b, n in enumerate(num_blocks_needed):
        if n > len(free):
            raise ValueError(f"test scenario needs more than {num_blocks} blocks")
        for j in range(n):
            table[b, j] = free.pop()
    return table


def slots_of(table_row: torch.Tensor, positions: range, block_size: int) -> list[int]:
    """slot = block id * block_size + offset, for the given positions of one sequence."""
    return [int(table_row[p // block_size]) * block_size + p % block_size for p in positions]


def e4m3_to_float(byte: int) -> float:
    """Decode one fp8 e4m3fn byte by its definition: 1 sign, 4 exponent (bias 7), 3 mantissa
    bits; exponent 0 is subnormal; 0x7F / 0xFF are NaN; no infinities."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return float("nan")
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def bf16_bits_to_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def decode_ds_mla_entry(entry: bytes, kv_lora_rank: int) -> tuple[list[float], list[float]]:
    """One fp8_ds_mla entry -> (latent, rope): kv_lora_rank e4m3 bytes, then one little-endian
    fp32 scale per 128 latent values, then little-endian bf16 rope values."""
    groups = kv_lora_rank // 128
    scales = struct.unpack(f"<{groups}f", entry[kv_lora_rank : kv_lora_rank + 4 * groups])
    latent = [e4m3_to_float(entry[i]) * scales[i // 128] for i in range(kv_lora_rank)]
    rope_raw = entry[kv_lora_rank + 4 * groups :]
    bits = struct.unpack(f"<{len(rope_raw) // 2}H", rope_raw)
    return latent, [bf16_bits_to_float(b) for b in bits]
