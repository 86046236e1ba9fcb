#!/usr/bin/env python3
"""Host cost of one decode step's metadata: ``build_metadata`` + ``attention_view`` and the
persistent, bucketed mode (``PersistentMetadata.step``) at batch 64 / 256 / 1,024.

Every request decodes one token over a ~1K-token context (block size 16), one block-table
group. Reported per step: median host time (perf_counter, the device work is not waited
for), and the host-to-device copies one step issues, counted by the torch profiler
(``Memcpy HtoD`` events; CPU runs issue none). Target (issue 10): 256 requests under
100 us of host time, one copy.

Usage: python benchmarks/metadata.py [--device cpu|cuda] [--steps N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from pagedkv.batch import AttentionGroup, ScheduledRequest, attention_view, build_metadata
from pagedkv.batch.persistent import PersistentMetadata
from pagedkv.kvspec import Attention, Full, LayerSpec, MLALatent
from pagedkv.plan.types import Group

BLOCK = 16


def group() -> Group:
    layer = LayerSpec("l0", MLALatent(), Full(), Attention())
    return Group(id=0, layers=(layer,), retention=Full(), block_size=BLOCK, position_offset=0,
                 models=("target",), bytes_per_token=1152, bytes_per_request=0,
                 num_blocks=1 << 22, blocks_per_request=0, step_blocks=0)


def requests(batch: int, rng: random.Random) -> list[ScheduledRequest]:
    out, next_block = [], 0
    for i in range(batch):
        ctx = rng.randrange(768, 1280)
        n = -(-(ctx + 1) // BLOCK)
        out.append(ScheduledRequest(i, ctx, 1, {0: range(next_block, next_block + n)}))
        next_block += n
    return out


def h2d_copies(fn) -> int:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if "HtoD" in e.name)


def measure(fn, steps: int) -> float:
    fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("pagedkv: error: --device cuda needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    g = group()
    att = AttentionGroup("target", "target", ("l0",))
    rng = random.Random(0)
    print(f"# device {args.device}{' ' + torch.cuda.get_device_name() if dev.type == 'cuda' else ''}, "
          f"torch {torch.__version__}, median of {args.steps} steps")
    print("%-6s %-34s %10s %8s" % ("batch", "path", "host us", "H2D"))
    for batch in (64, 256, 1024):
        reqs = requests(batch, rng)
        width = max(len(r.blocks(0)) for r in reqs)

        def plain(reqs=reqs):
            meta = build_metadata(reqs, [g], device=dev)
            return attention_view(meta[0], att, causal=True)

        pm = PersistentMetadata([g], max_blocks=width, batch_buckets=[64, 256, 1024], device=dev)

        def persistent(pm=pm, reqs=reqs):
            meta = pm.step(reqs)
            return attention_view(meta[0], att, causal=True)

        for name, fn in (("build_metadata + attention_view", plain),
                         ("persistent step + attention_view", persistent)):
            us = measure(fn, args.steps)
            copies = h2d_copies(fn) if dev.type == "cuda" else 0
            print("%-6d %-34s %10.1f %8d" % (batch, name, us, copies), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
