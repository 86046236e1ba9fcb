#!/usr/bin/env python3
"""Host time per request of a decode step's batched block-manager calls, on steps where
every request crosses a block boundary and on steps where none does.

256 requests (prompts of 320-416 tokens, blocks of 16, one full-attention group in an
elastic pool with room for all) decode in lockstep, so every 16th step each request opens
a block in ``allocate_batch`` and every 16th step each fills one in ``commit_batch``
(hashed and cached); the other steps are plain. Fast hash. Medians over ``--runs`` fresh
managers of 64 steps each, per request.

Usage: PYTHONPATH=src python benchmarks/decode_boundaries.py [--runs 5] [--requests 256]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blocks import groups_for  # noqa: E402

from pagedkv.blocks import KVCacheManager  # noqa: E402
from pagedkv.blocks.hashing import FAST_HASH  # noqa: E402


def run(seed: int, requests: int) -> dict[str, list[int]]:
    groups = groups_for("one", 40000, 16)
    mgr = KVCacheManager(groups, max_batched_tokens=8192, checked=False, hash_algo=FAST_HASH,
                         budget_bytes=40000 * groups[0].page_bytes, max_model_len=3000)
    rng = random.Random(seed)
    ids = list(range(requests))
    for r in ids:  # computed to the last prompt token: the next decode fills block's end
        mgr.add_request(r, [rng.randrange(128000) for _ in range(16 * (20 + r % 7))])
        mgr.find_cached_prefix(r)
        mgr.allocate(r, mgr.num_tokens(r))
        mgr.commit(r, mgr.num_tokens(r) - 1, [5])
    toks = [7] * requests
    out: dict[str, list[int]] = {"allocate, opening": [], "allocate, plain": [],
                                 "commit, filling": [], "commit, plain": []}
    ns = time.perf_counter_ns
    for step in range(64):
        t0 = ns()
        mgr.allocate_batch(ids)
        t1 = ns()
        mgr.commit_batch(ids, toks)
        t2 = ns()
        mgr.drain_page_ops()
        mgr.drain_copy_ops()
        out["commit, filling" if step % 16 == 0 else "commit, plain"].append(t2 - t1)
        out["allocate, opening" if step % 16 == 1 else "allocate, plain"].append(t1 - t0)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=256)
    args = parser.parse_args(argv)
    if args.runs < 1 or args.requests < 1:
        print(f"pagedkv: error: --runs and --requests must be >= 1, got {args.runs}, "
              f"{args.requests}", file=sys.stderr)
        return 2
    results = [run(seed, args.requests) for seed in range(args.runs)]
    for name in results[0]:
        per = statistics.median(x for r in results for x in r[name]) / args.requests / 1e3
        print(f"{name:20s} {per:.3f} us per request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
