#!/usr/bin/env python3
"""Host cost of one decode step's metadata at batch 64 / 256 / 1,024: the stateless
``build_metadata`` + ``attention_view`` (old path), the incremental ``MetadataBuilder.step``
+ ``attention_view`` (new path, same output, checked once per batch), and the persistent,
bucketed mode (``PersistentMetadata.step``).

Every request decodes one token over a ~1K-token context (block size 16), one block-table
group. The paths are timed interleaved (old, new, persistent, old, ...) so that a loaded
machine slows them alike; reported per step: median host time (perf_counter, the device
work is not waited for), new/old ratio, and the host-to-device copies one step issues,
counted by the torch profiler (``Memcpy HtoD`` events; CPU runs issue none). ``appends``:
the builder's bookkeeping a decode step adds, ``append_blocks`` for the batch/16 requests
whose new token opens a block. Target (issue 10): 256 requests under 100 us of host time,
one copy.

Usage: python benchmarks/metadata.py [--device cpu|cuda] [--steps N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import numpy as np
import torch

from pagedkv.batch import AttentionGroup, ScheduledRequest, attention_view, build_metadata
from pagedkv.batch.incremental import MetadataBuilder
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


def measure(fns, steps: int) -> list[float]:
    """Median microseconds of each function, calls interleaved."""
    for fn in fns:
        fn()
    times: list[list[int]] = [[] for _ in fns]
    for _ in range(steps):
        for fn, out in zip(fns, times, strict=True):
            t0 = time.perf_counter_ns()
            fn()
            out.append(time.perf_counter_ns() - t0)
    return [statistics.median(t) / 1e3 for t in times]


def same(a, b) -> bool:
    names = ("block_table", "slot_mapping", "query_start_loc", "seq_lens", "positions",
             "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")
    return all(torch.equal(getattr(a, n).cpu(), getattr(b, n).cpu()) for n in names)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--no-persistent", action="store_true", help="skip PersistentMetadata")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("pagedkv: error: --device cuda needs a CUDA device", file=sys.stderr)
        return 2
    if args.steps < 1:
        print(f"pagedkv: error: --steps must be >= 1, got {args.steps}", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    g = group()
    att = AttentionGroup("target", "target", ("l0",))
    rng = random.Random(0)
    print(f"# device {args.device}{' ' + torch.cuda.get_device_name() if dev.type == 'cuda' else ''}, "
          f"torch {torch.__version__}, median of {args.steps} interleaved steps")
    print("%-6s %-38s %10s %9s %6s" % ("batch", "path", "host us", "vs old", "H2D"))
    for batch in (64, 256, 1024):
        reqs = requests(batch, rng)
        width = max(len(r.blocks(0)) for r in reqs)

        def plain(reqs=reqs):
            meta = build_metadata(reqs, [g], device=dev)
            return attention_view(meta[0], att, causal=True)

        builder = MetadataBuilder([g], device=dev, rows=batch, width=width)
        for r in reqs:
            builder.add(r.req_id, {0: r.blocks(0)})
        ids = [r.req_id for r in reqs]
        computed = np.array([r.num_computed_tokens for r in reqs], dtype=np.int64)
        new = np.ones(batch, dtype=np.int64)

        def incremental(b=builder, ids=ids, computed=computed, new=new):
            meta = b.step(ids, computed, new)
            return attention_view(meta[0], att, causal=True)

        if not same(incremental().metadata, plain().metadata):
            print("pagedkv: error: MetadataBuilder.step differs from build_metadata", file=sys.stderr)
            return 1
        side = MetadataBuilder([g], rows=batch, width=width)  # bookkeeping on its own copy
        for r in reqs:
            side.add(r.req_id, {0: r.blocks(0)})
        opening = ids[:: BLOCK][: max(1, batch // BLOCK)]

        def appends(b=side, opening=opening):
            for rid in opening:
                b.append_blocks(rid, {0: (7,)})

        paths = [("build_metadata + attention_view", plain),
                 ("MetadataBuilder.step + attention_view", incremental),
                 (f"  appends ({len(opening)} append_blocks)", appends)]
        if not args.no_persistent:
            pm = PersistentMetadata([g], max_blocks=width, batch_buckets=[64, 256, 1024], device=dev)

            def persistent(pm=pm, reqs=reqs):
                meta = pm.step(reqs)
                return attention_view(meta[0], att, causal=True)

            paths.append(("persistent step + attention_view", persistent))
        times = measure([fn for _, fn in paths], args.steps)
        for (name, fn), us in zip(paths, times, strict=True):
            copies = h2d_copies(fn) if dev.type == "cuda" and fn is not appends else 0
            print("%-6d %-38s %10.1f %8.2fx %6d" % (batch, name, us, us / times[0], copies), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
