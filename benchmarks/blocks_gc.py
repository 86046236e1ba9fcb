#!/usr/bin/env python3
"""The cyclic GC's collections while benchmarks/blocks.py's batched loop runs: how many of
each generation and their time per request. The loop itself calls ``gc.collect()`` (then
``gc.freeze()``) before its timer starts; that collection is counted apart.

Usage: PYTHONPATH=src python benchmarks/blocks_gc.py [--runs 3] [--hash fast-single-tenant]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import blocks as B  # noqa: E402

REQUESTS = 2000


def one_run(algo: str) -> str:
    seen: list[tuple[int, int, bool]] = []  # (generation, ns, inside the timed loop)
    start = [0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            start[0] = time.perf_counter_ns()
        else:  # frozen objects: the loop's own collect() has run, its timer started
            seen.append((info["generation"], time.perf_counter_ns() - start[0],
                         gc.get_freeze_count() > 0))

    gc.callbacks.append(callback)
    try:
        r = B.bench_loop(REQUESTS, hash_algo=algo, batched=True)
    finally:
        gc.callbacks.remove(callback)
    inside = [(g, t) for g, t, timed in seen if timed]
    before = [t for _, t, timed in seen if not timed]
    per = {g: (sum(1 for x, _ in inside if x == g),
               sum(t for x, t in inside if x == g) / 1e3 / REQUESTS) for g in (0, 1, 2)}
    return (f"total {r['total_us_per_request']} us/request; inside the loop: "
            + ", ".join(f"gen {g}: {n} collections, {us:.2f} us/request"
                        for g, (n, us) in per.items())
            + f"; before its timer: {len(before)} collection(s), "
            f"{sum(before) / 1e3 / REQUESTS:.2f} us/request")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--hash", default=B.FAST_HASH)
    args = parser.parse_args(argv)
    if args.runs < 1:
        print(f"pagedkv: error: --runs must be >= 1, got {args.runs}", file=sys.stderr)
        return 2
    B.bench_loop(300, hash_algo=args.hash, batched=True)  # warm-up
    for _ in range(args.runs):
        print(one_run(args.hash))
    return 0


if __name__ == "__main__":
    sys.exit(main())
