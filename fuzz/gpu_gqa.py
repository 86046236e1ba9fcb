"""The GQA/MHA paged-attention kernels an engine runs, on the GPU, at production geometry,
against float64 attention over what the caches hold.

Each case is one ``paged_attention`` call on the Triton backend (its default dispatch: the
decode kernel, the Hopper fp8 Gluon decode kernel, or the general kernel for prefill rows)
over 1-8 requests of 1-9,000 keys (often a page or 64-key tile boundary +- 1, sometimes a
padding request of no query rows), decode rows (1 query token), draft blocks (2-8) or
prefill chunks (up to 64 tokens), head groupings of real models (32/8, 64/8, 16/16, 8/1,
28/4, 40/8) at head dim 64 / 128 / 256, block size 16-128, a bf16 / fp16 cache or an fp8
one (e4m3 / e5m2, scales as floats or device tensors, powers of two or not), causal
(bottom-right), sliding window, non-causal draft blocks or bidirectional, with soft-cap,
sinks, split counts, ``gluon`` and ``max_query_len`` / ``max_seq_len`` (kept launch plans,
no host sync) drawn at random. Caches are NaN-filled with blocks from a shuffled free list.
What must hold:

- a call the kernels cannot take is a ``PagedKVError`` (refused);
- otherwise every output row of the batch finite and, against float64 attention over the
  stored (dequantized) keys and values written out here on the GPU (masks from
  tests/dense_reference.py): bf16 / fp16 within 4e-2 / 2e-2 x max(1, |reference|max) per
  element (the CPU fuzzer's bars), and each request's relative Frobenius error under 1e-2
  (the GPU tests' bar for bf16 and fp8; it is what catches a dropped or extra key in an
  average of thousands, far below the element bar). The progress lines count the cases by
  format and by their worst relative error (``rel<1e-3``, ``rel<3e-3``, ``rel<1e-2``).

GPU only:

    PYTHONPATH=src python3 fuzz/gpu_gqa.py --start 0 --count 200
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]  # the tests' float64 mask and block placement

import harness  # noqa: E402
import torch  # noqa: E402
from dense_reference import dense_mask, place_blocks, slots_of  # noqa: E402

from pagedkv.errors import PagedKVError  # noqa: E402
from pagedkv.ops import Mask, fill_nan_  # noqa: E402
from pagedkv.ops.triton.attention import paged_attention  # noqa: E402

TOLERANCE = {"bfloat16": 4e-2, "float16": 2e-2}
REL = 1e-2  # a request's relative Frobenius error
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
DEVICE = torch.device("cuda")


def _seq_len(rng: random.Random, q: int, block: int) -> int:
    pick = rng.random()
    if pick < 0.3:
        n = rng.randint(1, 300)
    elif pick < 0.65:
        n = rng.choice([block, 64]) * rng.randint(1, 140) + rng.choice([-1, 0, 1])
    else:
        n = rng.randint(300, 9000)
    return max(n, q)


def draw(seed: int, args: argparse.Namespace) -> dict:
    rng = random.Random(seed)
    fmt = rng.choice(["bfloat16", "bfloat16", "float16", "e4m3", "e4m3", "e5m2"])
    kind = rng.choice(["causal", "causal", "window", "draft", "bidirectional"])
    rows = rng.choice(["decode", "decode", "draft", "prefill"])
    if kind == "draft":
        rows = "draft"
    heads = rng.choice([(32, 8), (32, 8), (64, 8), (16, 16), (8, 1), (28, 4), (40, 8)])
    dim = rng.choice([128, 128, 64, 256])
    block = rng.choice([16, 16, 32, 64, 128])
    draft_block = rng.randint(2, 8)
    seqs = []
    for _ in range(rng.randint(1, 8)):
        if rows == "decode":
            q = 1
        elif rows == "draft":
            q = draft_block
        else:
            q = rng.choice([1, rng.randint(2, 64)])
        seqs.append((_seq_len(rng, q, block), q))
    if rng.random() < 0.2:
        seqs.insert(rng.randrange(len(seqs) + 1), (rng.choice([0, 1, 500]), 0))
    case = dict(seed=seed, fmt=fmt, kind=kind, heads=heads, dim=dim, block=block,
                draft_block=draft_block, window=rng.choice([16, 100, 1024, 4096]), seqs=seqs)
    kw: dict = {}
    if rng.random() < 0.2:
        kw["soft_cap"] = rng.choice([30.0, 50.0])
    case["sinks"] = rng.random() < 0.2
    if fmt in FP8:
        case["scales"] = (rng.choice([2.0**-6, 0.013, 1.0]), rng.choice([2.0**-5, 0.021, 1.0]))
        case["device_scales"] = rng.random() < 0.3
    if rng.random() < 0.3:
        kw["splits"] = rng.randint(1, 8)
    if rng.random() < 0.4:
        kw["max_query_len"] = max(q for _, q in seqs)
        kw["max_seq_len"] = max(s for s, _ in seqs)
    if fmt in FP8 and rng.random() < 0.3:
        kw["gluon"] = rng.choice([True, False])
    case["kw"] = kw
    return case


def describe(case: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in case.items() if k != "seed")


def mask_of(case: dict) -> Mask:
    return {"causal": Mask(), "window": Mask(window=case["window"]),
            "draft": Mask(causal=False, draft_block=case["draft_block"]),
            "bidirectional": Mask(causal=False)}[case["kind"]]


def _caches(case: dict, gen: torch.Generator, rng: random.Random):
    """NaN-filled K/V caches with a shuffled table; per request the stored keys and values
    in float64 (dequantized for fp8)."""
    seqs, bs, dim = case["seqs"], case["block"], case["dim"]
    heads, kv_heads = case["heads"]
    needed = [-(-s // bs) for s, _ in seqs]
    num_blocks = sum(needed) + 3
    table = place_blocks(needed, num_blocks, rng)
    fmt = case["fmt"]
    dt = FP8.get(fmt) or getattr(torch, fmt)
    k_cache = fill_nan_(torch.empty(num_blocks, bs, kv_heads, dim, dtype=dt, device=DEVICE))
    v_cache = fill_nan_(torch.empty(num_blocks, bs, kv_heads, dim, dtype=dt, device=DEVICE))
    ks, vs = case.get("scales", (1.0, 1.0))
    top = torch.finfo(dt).max
    keys, values = [], []
    for b, (s, _) in enumerate(seqs):
        k = torch.randn(s, kv_heads, dim, generator=gen)
        v = torch.randn(s, kv_heads, dim, generator=gen)
        if fmt in FP8:
            k = (k / ks).clamp(-top, top).to(dt)
            v = (v / vs).clamp(-top, top).to(dt)
        else:
            k, v = k.to(dt), v.to(dt)
        slots = torch.tensor(slots_of(table[b], range(s), bs), dtype=torch.int64, device=DEVICE)
        k_cache.view(-1, kv_heads, dim)[slots] = k.to(DEVICE)
        v_cache.view(-1, kv_heads, dim)[slots] = v.to(DEVICE)
        keys.append(k.double() * ks)
        values.append(v.double() * vs)
    return k_cache, v_cache, table, keys, values


def reference(q, k, v, seen, *, scale, soft_cap, sink) -> torch.Tensor:
    """Float64 attention of q [Q, H, D] over k, v [N, Hkv, D] on the GPU: softmax over the
    keys ``seen`` [Q, N] lets each row read (and a sink logit per head), zeros for a row
    that sees nothing."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.to(DEVICE).repeat_interleave(heads // kv_heads, 1)
    v = v.to(DEVICE).repeat_interleave(heads // kv_heads, 1)
    s = torch.einsum("qhd,nhd->hqn", q.double().to(DEVICE), k) * scale
    if soft_cap is not None:
        s = soft_cap * torch.tanh(s / soft_cap)
    s = s.masked_fill(~seen.to(DEVICE)[None], float("-inf"))
    if sink is not None:  # one more logit per head, with no value
        s = torch.cat([s, sink.to(DEVICE)[:, None, None].expand(-1, s.shape[1], 1)], -1)
    m = s.amax(-1, keepdim=True)
    w = torch.where(torch.isfinite(m), torch.exp(s - m), torch.zeros_like(s))
    denom = w.sum(-1, keepdim=True)
    w = torch.where(denom > 0, w / denom, w)
    if sink is not None:
        w = w[..., :-1]
    return torch.einsum("hqn,nhd->qhd", w, v)


def check(case: dict, args: argparse.Namespace) -> list[str]:
    seed, seqs, mask = case["seed"], case["seqs"], mask_of(case)
    heads, _ = case["heads"]
    dim = case["dim"]
    rng = random.Random(seed ^ 0x5EED)
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, table, keys, values = _caches(case, gen, rng)
    total = sum(q for _, q in seqs)
    qdt = torch.bfloat16 if case["fmt"] in FP8 else getattr(torch, case["fmt"])
    q = torch.randn(total + 2, heads, dim, generator=gen).to(qdt)
    q[total:] = float("nan")  # rows past the batch are never read
    qsl = torch.tensor([0, *torch.tensor([n for _, n in seqs]).cumsum(0).tolist()],
                       dtype=torch.int32)
    lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32)
    kw = dict(case["kw"])
    sinks = None
    if case["sinks"]:
        sinks = torch.randn(heads, generator=gen) * 2
        kw["sinks"] = sinks.to(DEVICE)
    if case["fmt"] in FP8:
        ks, vs = case["scales"]
        if case["device_scales"]:
            ks, vs = (torch.tensor([x], device=DEVICE) for x in (ks, vs))
        kw.update(k_scale=ks, v_scale=vs)
    try:
        got = paged_attention(q.to(DEVICE), k_cache, v_cache, qsl.to(DEVICE), lens.to(DEVICE),
                              table.to(DEVICE), mask=mask, **kw)
    except PagedKVError as e:
        raise harness.Refused(f"{type(e).__name__}: {e}") from None
    got = got[:total].double()
    if not bool(torch.isfinite(got).all()):
        raise harness.Bad(f"{int((~torch.isfinite(got)).sum())} output values not finite")
    want = torch.zeros_like(got)
    start, worst = 0, 0.0
    for b, (s, n) in enumerate(seqs):
        r = slice(start, start + n)
        start += n
        if n == 0:
            continue
        seen = dense_mask(s, n, causal=mask.causal, draft_block=mask.draft_block,
                          window=mask.window)
        want[r] = reference(q[r], keys[b], values[b], seen, scale=dim ** -0.5,
                            soft_cap=kw.get("soft_cap"),
                            sink=None if sinks is None else sinks.double())
        rel = float((got[r] - want[r]).norm() / want[r].norm().clamp_min(1e-30))
        if rel > REL:
            raise harness.Bad(f"request {b}: relative error {rel:.3e} over {REL}")
        worst = max(worst, rel)
    if case["fmt"] not in FP8:
        err = float((got - want).abs().max())
        bound = TOLERANCE[case["fmt"]] * max(1.0, float(want.abs().max()))
        if err > bound:
            raise harness.Bad(f"max error {err:.3e} over {bound:.1e}")
    return [case["fmt"], harness.rel_tag(worst)]


if __name__ == "__main__":
    harness.main(__doc__, None, draw, describe, check, limit=300, setup=harness.require_cuda)
