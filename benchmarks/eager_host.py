#!/usr/bin/env python3
"""Host time of one eager GQA decode call (``paged_attention`` at B64 ctx1K q1 p16 bf16 by
default, ``max_query_len`` / ``max_seq_len`` given, as inside an engine's step), against a
plain torch op on the same host, and where it goes (cProfile, own time). CUDA only.

Usage: PYTHONPATH=src python benchmarks/eager_host.py [--batch 64] [--ctx 1024] [--page 16]
[--no-profile]
"""

from __future__ import annotations

import argparse
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile table")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("pagedkv: error: benchmarks/eager_host.py needs a CUDA device", file=sys.stderr)
        return 2
    q, k, v, qsl, lens, table = gqa_inputs(args.batch, args.ctx, 1, args.page)

    def call():
        return paged_attention(q, k, v, qsl, lens, table, mask=Mask(), max_query_len=1,
                               max_seq_len=args.ctx)

    for _ in range(20):
        call()
    shape = f"B{args.batch} ctx{args.ctx} p{args.page}"
    passes = [per_call_us(call) for _ in range(3)]
    for us in passes:
        print(f"paged_attention eager {shape}, host us per call: {us:.1f}")
    e = torch.empty(1, device="cuda")
    e.add_(1)
    add = [per_call_us(lambda: e.add_(1)) for _ in range(3)]
    print(f"tensor.add_, host us per call: {min(add):.1f}")
    print(f"summary {shape}: paged_attention {min(passes):.1f} us (best of 3 passes), "
          f"tensor.add_ {min(add):.1f} us, ratio {min(passes) / min(add):.1f}")
    if args.no_profile:
        return 0
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
