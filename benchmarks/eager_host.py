#!/usr/bin/env python3
"""Host time of one eager GQA decode call (``paged_attention`` at B64 ctx1K q1 p16 bf16,
``max_query_len`` / ``max_seq_len`` given, as inside an engine's step), against a plain torch
op on the same host, and where it goes (cProfile, own time). CUDA only.

Usage: PYTHONPATH=src python benchmarks/eager_host.py
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention import gqa_inputs  # noqa: E402

from pagedkv.ops import Mask  # noqa: E402
from pagedkv.ops.triton.attention import paged_attention  # noqa: E402

CALLS = 200  # few enough that the launch queue never fills (the host is never throttled)


def per_call_us(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return 1e6 * (t1 - t0) / CALLS


def main() -> int:
    if not torch.cuda.is_available():
        print("pagedkv: error: benchmarks/eager_host.py needs a CUDA device", file=sys.stderr)
        return 2
    q, k, v, qsl, lens, table = gqa_inputs(64, 1024, 1, 16)

    def call():
        return paged_attention(q, k, v, qsl, lens, table, mask=Mask(), max_query_len=1,
                               max_seq_len=1024)

    for _ in range(20):
        call()
    for _ in range(3):
        print(f"paged_attention eager, host us per call: {per_call_us(call):.1f}")
    e = torch.empty(1, device="cuda")
    e.add_(1)
    print(f"tensor.add_, host us per call: {per_call_us(lambda: e.add_(1)):.1f}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(CALLS):
        call()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
