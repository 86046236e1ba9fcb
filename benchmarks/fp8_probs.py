#!/usr/bin/env python3
"""How much precision e4m3 probabilities cost an fp8 decode, on the CPU (no kernel): the
Gluon fp8 kernel's arithmetic emulated in torch (query split into e4m3 hi + lo with one
scale per row, P x 256 in e4m3 as one tile or as hi + lo, the sums over the same e4m3
values) against float64 attention over the dequantized e4m3 cache; prints the relative
error per key count. Why it exists: it chose to split P into e4m3 hi + lo in ``decode_gluon`` (docs/kernels-log.md).

Usage: python benchmarks/fp8_probs.py [SEED]
"""

from __future__ import annotations

import sys

import torch

E4 = torch.float8_e4m3fn


def e4(x: torch.Tensor) -> torch.Tensor:
    return x.float().to(E4).double()


def relerr(keys: int, q_std: float, split_p: bool, gen: torch.Generator) -> float:
    dim, heads, ks, vs = 128, 4, 2.0**-6, 2.0**-5
    q = (torch.randn(heads, dim, generator=gen) * q_std).to(torch.bfloat16).double()
    k = e4(torch.randn(keys, dim, generator=gen) / ks) * ks
    v = e4(torch.randn(keys, dim, generator=gen) / vs) * vs
    scale = dim**-0.5
    want = torch.softmax(q @ k.T * scale, -1) @ v
    sq = q.abs().amax(1, keepdim=True) / 448
    y = q / sq
    qh = e4(y)
    s = ((qh + e4(y - qh)) * sq) @ k.T * scale
    p = torch.exp(s - s.amax(1, keepdim=True)) * 256
    pq = e4(p)
    if split_p:
        pq = pq + e4(p - pq)
    got = (pq @ v) / pq.sum(1, keepdim=True)
    return float((got - want).norm() / want.norm())


def main(argv) -> int:
    gen = torch.Generator().manual_seed(int(argv[0]) if argv else 0)
    print("keys  q_std  P e4m3  P e4m3 hi+lo")
    for keys in (5, 64, 130, 1000, 8192):
        for q_std in (1.0, 3.0):
            one = relerr(keys, q_std, False, gen)
            two = relerr(keys, q_std, True, gen)
            print(f"{keys:5d} {q_std:6.1f} {one:7.2e} {two:12.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
