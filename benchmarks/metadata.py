#!/usr/bin/env python3
"""Host cost of one decode step's metadata at batch 64 / 256 / 1,024 (issue 10 target:
256 running decode requests under 100 us of host time, one host-to-device copy).

Every request decodes one token per step over a ~1K-token context (block size 16, one
block-table group, one attention group). Paths, timed interleaved (one step of each in turn,
so that a loaded machine slows them alike):

- ``build_metadata + view``: the stateless builder from ScheduledRequests (the baseline; its
  requests are built before timing, and its cost does not depend on the step);
- ``MetadataBuilder.step + view``: host block tables kept across steps; every step each
  request's length grows by one, and the requests whose new token opens a block get it
  first, in one ``append_each`` call (timed apart: ``appends``, ~batch/16 requests a step);
- ``PersistentMetadata.step + view``: the same steps into fixed, bucketed buffers (the
  CUDA-graph mode; buckets 64/256/1024, block tables wide enough for the whole run).

Reported per path: median host time of a step (perf_counter; the device work is not waited
for), its ratio to the stateless path of the same run, the 10th percentile (on a shared
machine: the steps least disturbed by other processes), and the host-to-device copies one
step issues (torch profiler ``HtoD`` memcpy events; none on CPU). The incremental and
persistent outputs are compared with ``build_metadata`` on every 10th step.

Usage: python benchmarks/metadata.py [--device cpu|cuda] [--steps N] [--batches 64,256,1024]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from datetime import datetime, timezone

import numpy as np
import torch

from pagedkv.batch import AttentionGroup, ScheduledRequest, attention_view, build_metadata
from pagedkv.batch.incremental import MetadataBuilder
from pagedkv.batch.persistent import PersistentMetadata
from pagedkv.kvspec import Attention, Full, LayerSpec, MLALatent
from pagedkv.plan.types import Group

BLOCK = 16
BUCKETS = (64, 256, 1024)
STATELESS, INCREMENTAL, PERSISTENT = (
    "build_metadata + view", "MetadataBuilder.step + view", "PersistentMetadata.step + view")
APPENDS = "appends"
ARRAYS = ("block_table", "slot_mapping", "query_start_loc", "seq_lens", "positions",
          "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")


def group() -> Group:
    layer = LayerSpec("l0", MLALatent(), Full(), Attention())
    return Group(id=0, layers=(layer,), retention=Full(), block_size=BLOCK, position_offset=0,
                 models=("target",), bytes_per_token=1152, bytes_per_request=0,
                 num_blocks=1 << 22, blocks_per_request=0, step_blocks=0)


class Decode:
    """A running batch: each step every request's length grows by one; a request whose new
    token opens a block gets one first (fresh ids from a shuffled pool)."""

    def __init__(self, batch: int, rng: random.Random, steps: int = 0) -> None:
        self.ids = [f"req-{i}" for i in range(batch)]
        self.computed = np.array([rng.randrange(768, 1280) for _ in range(batch)], dtype=np.int64)
        self.new = np.ones(batch, dtype=np.int64)
        self.pool = rng.sample(range(1 << 22), batch * ((1280 + steps) // BLOCK + 2))
        self.blocks = [[self.pool.pop() for _ in range(int(c) // BLOCK + 1)] for c in self.computed]

    def requests(self) -> list[ScheduledRequest]:
        return [ScheduledRequest(rid, int(c), 1, {0: blocks})
                for rid, c, blocks in zip(self.ids, self.computed, self.blocks, strict=True)]

    def load(self, builder: MetadataBuilder) -> None:
        for rid, blocks in zip(self.ids, self.blocks, strict=True):
            builder.add(rid, {0: blocks})

    def advance(self) -> list[tuple[str, int]]:
        """Move to the next step: the (request, new block) appends it needs."""
        self.computed += 1
        out = []
        for i in np.flatnonzero(self.computed % BLOCK == 0).tolist():
            block = self.pool.pop()
            self.blocks[i].append(block)
            out.append((self.ids[i], block))
        return out


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def h2d_copies(fn) -> int:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if "HtoD" in e.name)


def same(got, want) -> bool:
    return all(torch.equal(getattr(got, n).cpu(), getattr(want, n).cpu()) for n in ARRAYS)


def run_batch(batch: int, steps: int, run: int, dev: torch.device, g: Group,
              att: AttentionGroup) -> tuple[list, list]:
    rng = random.Random(batch)
    static = Decode(batch, rng).requests()
    max_blocks = (1280 + steps + run + 8) // BLOCK + 2
    bucket = min(b for b in BUCKETS if b >= batch)

    def stateless():
        return attention_view(build_metadata(static, [g], device=dev)[0], att, causal=True)

    runs = {}
    for name, make in (
        (INCREMENTAL, lambda: MetadataBuilder([g], device=dev, rows=batch, width=max_blocks)),
        (PERSISTENT, lambda: PersistentMetadata([g], max_blocks=max_blocks, batch_buckets=BUCKETS,
                                                device=dev)),
    ):
        decode = Decode(batch, random.Random(batch + 1), steps + run + 10)
        builder = make()
        decode.load(builder)
        runs[name] = (decode, builder)

    def step(name: str, record: bool, check: bool) -> None:
        decode, builder = runs[name]
        opened = decode.advance()
        t0 = time.perf_counter_ns()
        if opened:
            builder.append_each([rid for rid, _ in opened], {0: [block for _, block in opened]})
        t1 = time.perf_counter_ns()
        view = attention_view(builder.step(decode.ids, decode.computed, decode.new)[0], att,
                              causal=True)
        t2 = time.perf_counter_ns()
        if record:
            times[name].append(t2 - t1)
            if name == INCREMENTAL:
                times[APPENDS].append(t1 - t0)
        if check:
            pad = {} if name == INCREMENTAL else dict(pad_batch_to=bucket, pad_tokens_to=bucket,
                                                      max_blocks=max_blocks)
            want = build_metadata(decode.requests(), [g], device=dev, **pad)[0]
            if not same(view.metadata, want):
                mismatch.append((batch, name, decode.computed[0]))

    times: dict[str, list[int]] = {STATELESS: [], INCREMENTAL: [], APPENDS: [], PERSISTENT: []}
    mismatch: list = []
    warmup = 5
    done = 0
    while done < warmup + steps:  # turns of `run` steps per path
        for _ in range(run):
            t0 = time.perf_counter_ns()
            stateless()
            if done >= warmup:
                times[STATELESS].append(time.perf_counter_ns() - t0)
        for name in runs:
            for j in range(run):
                step(name, done >= warmup, (done + j) % 10 == 0)
        done += run

    copies = {}
    if dev.type == "cuda":
        copies[STATELESS] = h2d_copies(stateless)
        for name in runs:
            copies[name] = h2d_copies(lambda name=name: step(name, False, False))
    medians = {name: statistics.median(t) / 1e3 for name, t in times.items()}
    tenths = {name: (statistics.quantiles(t, n=10)[0] if len(t) > 1 else t[0]) / 1e3
              for name, t in times.items()}
    base = medians[STATELESS]
    rows = []
    for name in (STATELESS, INCREMENTAL, APPENDS, PERSISTENT):
        label = f"  appends (append_each, ~{batch / BLOCK:g} reqs)" if name == APPENDS else name
        rows.append((batch, label, medians[name], medians[name] / base, tenths[name],
                     copies.get(name, 0)))
    return rows, mismatch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batches", default="64,256,1024")
    parser.add_argument("--run", type=int, default=1,
                        help="consecutive steps of one path per turn (1: fully interleaved)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("pagedkv: error: --device cuda needs a CUDA device", file=sys.stderr)
        return 2
    if args.steps < 1 or args.run < 1:
        print(f"pagedkv: error: --steps and --run must be >= 1, got {args.steps}, {args.run}",
              file=sys.stderr)
        return 2
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        batches = []
    if not batches or any(not 1 <= b <= BUCKETS[-1] for b in batches):
        print(f"pagedkv: error: --batches must be integers in 1..{BUCKETS[-1]}, got "
              f"{args.batches!r}", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    g = group()
    att = AttentionGroup("target", "target", ("l0",))
    name = torch.cuda.get_device_name() if dev.type == "cuda" else cpu_name()
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, device {args.device} ({name}), "
          f"{os.cpu_count()} cores, torch {torch.__version__}, numpy {np.__version__}, "
          f"median of {args.steps} decode steps, paths in turns of {args.run} step(s), load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("%-6s %-36s %10s %9s %9s %10s" % ("batch", "path", "host us", "vs old", "p10 us",
                                             "H2D/step"))
    bad = []
    for batch in batches:
        rows, mismatch = run_batch(batch, args.steps, args.run, dev, g, att)
        bad += mismatch
        for row in rows:
            print("%-6d %-36s %10.1f %8.2fx %9.1f %10d" % row, flush=True)
    print(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if bad:
        print(f"pagedkv: error: metadata differs from build_metadata at {bad[:5]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
