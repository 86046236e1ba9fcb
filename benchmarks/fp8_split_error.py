#!/usr/bin/env python3
"""Relative error of the fp8 GQA decode kernels against float64 attention over the
dequantized cache, per split count and context: whether a kernel's error grows with the
keys one split accumulates (the Gluon kernel's did, before its value products were summed
outside the tensor core; docs/kernels-log.md).

Two sequences (``ctx`` and ``ctx - 37`` tokens, q_len 1), 32 query / 8 KV heads, head dim
128, pages of 16 slots placed in shuffled order, e4m3 K/V with per-tensor scales (values
clamped to e4m3's range), bf16 queries; unused slots NaN. Needs a CUDA device (the Gluon
kernel: Hopper).

Usage: PYTHONPATH=src python3 benchmarks/fp8_split_error.py [--contexts 8192,32768,65536]
       [--splits 1,2,4,8] [--seed 3]
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone

import torch

from pagedkv.ops.triton.attention import paged_attention

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16
K_SCALE, V_SCALE = 2.0**-6, 2.0**-5


def case(lens: list[int], gen: torch.Generator, dev: torch.device):
    """(q, k8, v8, qsl, seq_lens, table) and the dequantized float64 keys / values."""
    pages = [-(-n // PAGE) for n in lens]
    ids = torch.randperm(sum(pages) + 3, generator=gen)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    at = 0
    for b, p in enumerate(pages):
        table[b, :p] = ids[at:at + p]
        at += p
    top = torch.finfo(torch.float8_e4m3fn).max
    k8 = torch.full((len(ids), PAGE, KV_HEADS, DIM), float("nan")).to(torch.float8_e4m3fn)
    v8 = k8.clone()
    keys, values = [], []
    for b, n in enumerate(lens):
        kq = (torch.randn(n, KV_HEADS, DIM, generator=gen) / K_SCALE).clamp(-top, top)
        vq = (torch.randn(n, KV_HEADS, DIM, generator=gen) / V_SCALE).clamp(-top, top)
        kq, vq = kq.to(torch.float8_e4m3fn), vq.to(torch.float8_e4m3fn)
        slots = table[b, torch.arange(n) // PAGE].long() * PAGE + torch.arange(n) % PAGE
        k8.view(-1, KV_HEADS, DIM)[slots] = kq
        v8.view(-1, KV_HEADS, DIM)[slots] = vq
        keys.append(kq.double() * K_SCALE)
        values.append(vq.double() * V_SCALE)
    q = torch.randn(len(lens), HEADS, DIM, generator=gen).to(torch.bfloat16)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    tensors = [t.to(dev) for t in (q, k8, v8, qsl, torch.tensor(lens, dtype=torch.int32), table)]
    return tensors, keys, values


def reference(q: torch.Tensor, keys, values, dev: torch.device) -> torch.Tensor:
    """Float64 attention of each sequence's one query row over its whole context."""
    out = []
    group = HEADS // KV_HEADS
    for b, (k, v) in enumerate(zip(keys, values)):
        qb = q[b].double().to(dev).view(KV_HEADS, group, DIM)
        s = torch.einsum("hgd,nhd->hgn", qb, k.to(dev)) * DIM**-0.5
        out.append(torch.einsum("hgn,nhd->hgd", s.softmax(-1), v.to(dev)).reshape(HEADS, DIM))
    return torch.stack(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="8192,32768,65536")
    parser.add_argument("--splits", default="1,2,4,8")
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("pagedkv: error: this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
        splits = [int(s) for s in args.splits.split(",")]
    except ValueError:
        print(f"pagedkv: error: --contexts and --splits take integers, got {args.contexts!r}, "
              f"{args.splits!r}", file=sys.stderr)
        return 2
    if any(c < 38 for c in contexts) or any(s < 1 for s in splits):
        print("pagedkv: error: contexts of at least 38 tokens and splits of at least 1",
              file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}; relative error against float64, per split count")
    print("| context | kernel | " + " | ".join(f"splits {s}" for s in splits) + " |")
    print("|---:|---|" + "---:|" * len(splits))
    for ctx in contexts:
        gen = torch.Generator().manual_seed(args.seed)
        (q, k8, v8, qsl, lens, table), keys, values = case([ctx, ctx - 37], gen, dev)
        want = reference(q, keys, values, dev)
        for gluon in (True, False):
            errs = []
            for s in splits:
                got = paged_attention(q, k8, v8, qsl, lens, table, k_scale=K_SCALE,
                                      v_scale=V_SCALE, max_query_len=1, max_seq_len=ctx,
                                      gluon=gluon, splits=s)
                errs.append(float((got.double() - want).norm() / want.norm()))
            name = "Gluon fp8" if gluon else "Triton fp8"
            print(f"| {ctx} | {name} | " + " | ".join(f"{e:.2e}" for e in errs) + " |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
