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
  CUDA-graph mode; buckets 64/256/1024, block tables wide enough for the whole run);
- ``derive_on_device=True``: the same persistent builder whose steady decode steps (all
  but its first) send a small delta and derive the arrays on the device (one Triton
  kernel on CUDA; on a CPU device the numpy reference, which then runs on the host); the
  row below it, ``of which derive call``, is the host time of that call alone (CUDA: the
  kernel launch; CPU: the numpy derivation, which a CUDA step does not pay on the host),
  and the next, the step's host time without it (per step, then the median).

Below each builder, ``appends + step + view``: the median of the per-step sum, what an
engine's decode step pays for its metadata (the issue's target applies to this).

Reported per path: median host time of a step (perf_counter; the device work is not waited
for), its ratio to the stateless path of the same run, the 10th percentile (on a shared
machine: the steps least disturbed by other processes), and the host-to-device copies one
step issues (torch profiler ``HtoD`` memcpy events; none on CPU) and the bytes a builder step's
copy covers (``copy_bytes``; on CPU what a CUDA step would copy). The incremental and
persistent outputs are compared with ``build_metadata`` on every 10th step.

The table is printed after all timing (and after the breakdown, when asked for), then the
copies are counted. ``--breakdown`` adds (nothing of it inside the timed loop): each builder's
step run alone back to back (warm, advancing decode steps, median), a cProfile of those
steps (functions by own time per step; the profiler inflates Python-heavy lines), and on CUDA
the host cost of each CUDA call the step path makes (event record / wait, the copy from
pinned and from pageable memory at several sizes, views) and of numpy writes and reads in
pinned vs ordinary memory.

Usage: python benchmarks/metadata.py [--device cpu|cuda] [--steps N] [--batches 64,256,1024]
       [--breakdown]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
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
DERIVED = "derive_on_device=True step + view"
GRAPHS = "derive_on_device=True, derive_graphs=True step + view"
APPENDS = "appends"
LAUNCH = "derive call"
HOST = "less the derive call"
# per device-derived builder: its rows for the derive call (with graphs: the replay of the
# delta's copy and the kernel) and for the rest of its step
DERIVED_ROWS = {DERIVED: (LAUNCH, HOST), GRAPHS: ("graphs " + LAUNCH, "graphs " + HOST)}
TOTAL = " total"  # appends + step + view of a builder: what an engine's step pays
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
              att: AttentionGroup) -> tuple[list, list, object]:
    rng = random.Random(batch)
    static = Decode(batch, rng).requests()
    max_blocks = (1280 + steps + run + 8) // BLOCK + 2
    bucket = min(b for b in BUCKETS if b >= batch)

    def stateless():
        return attention_view(build_metadata(static, [g], device=dev)[0], att, causal=True)

    runs = {}
    for name, make in builders(dev, max_blocks):
        decode = Decode(batch, random.Random(batch + 1), steps + run + 10)
        builder = make()
        decode.load(builder)
        runs[name] = (decode, builder)
    launches: dict[str, list[int]] = {name: [] for name in DERIVED_ROWS if name in runs}
    for name, calls in launches.items():
        timed_derive(runs[name][1], calls)

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
            copied[name].append(getattr(builder, "copy_bytes", None))  # (older builders: none)
            times[name].append(t2 - t1)
            times[name + TOTAL].append(t2 - t0)
            if name == INCREMENTAL:
                times[APPENDS].append(t1 - t0)
            if name in launches:
                calls = launches[name]
                launch = calls[-1] if calls else 0
                times[DERIVED_ROWS[name][0]].append(launch)
                times[DERIVED_ROWS[name][1]].append(t2 - t1 - launch)
        if check:
            pad = {} if name == INCREMENTAL else dict(pad_batch_to=bucket, pad_tokens_to=bucket,
                                                      max_blocks=max_blocks)
            want = build_metadata(decode.requests(), [g], device=dev, **pad)[0]
            if not same(view.metadata, want):
                mismatch.append((batch, name, decode.computed[0]))

    times: dict[str, list[int]] = {name: [] for name in (
        STATELESS, INCREMENTAL, APPENDS, PERSISTENT, INCREMENTAL + TOTAL, PERSISTENT + TOTAL)}
    for name in launches:
        times.update({key: [] for key in (name, *DERIVED_ROWS[name], name + TOTAL)})
    copied: dict[str, list[int]] = {name: [] for name in runs}  # bytes a step's copy covers
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

    def count() -> dict[str, int]:
        """Copies per step, by the profiler: called only after every timed loop of the run
        (a CUDA profiler session can leave CUPTI hooks that slow later CUDA calls)."""
        copies = {}
        if dev.type == "cuda":
            copies[STATELESS] = h2d_copies(stateless)
            for name in runs:
                copies[name] = h2d_copies(lambda name=name: step(name, False, False))
        return copies

    medians = {name: statistics.median(t) / 1e3 for name, t in times.items()}
    tenths = {name: (statistics.quantiles(t, n=10)[0] if len(t) > 1 else t[0]) / 1e3
              for name, t in times.items()}
    base = medians[STATELESS]
    rows = []
    for name in (STATELESS, INCREMENTAL, APPENDS, INCREMENTAL + TOTAL, PERSISTENT,
                 PERSISTENT + TOTAL, DERIVED, LAUNCH, HOST, DERIVED + TOTAL,
                 GRAPHS, *DERIVED_ROWS[GRAPHS], GRAPHS + TOTAL):
        if name not in times:
            continue
        label = name
        if name == APPENDS:
            label = f"  appends (append_each, ~{batch / BLOCK:g} reqs)"
        elif name.endswith(HOST):
            label = "  step + view less the derive call"
        elif name.endswith(LAUNCH):
            label = "  of which derive call" + (" (graph replay)" if name != LAUNCH else "")
        elif name.endswith(TOTAL):
            label = "  + appends (an engine's step)"
        owner = name.removesuffix(TOTAL)
        nbytes = None
        if owner in copied and None not in copied[owner]:
            nbytes = statistics.median(copied[owner])
        rows.append((batch, label, medians[name], medians[name] / base, tenths[name], nbytes,
                     name))
    for name in launches:
        builder = runs[name][1]
        print(f"# batch {batch}: {builder.derived_steps} of the {name.removesuffix(' step + view')}"
              f" builder's {len(times[name]) + warmup} steps were derived on the device")
    return rows, mismatch, count


def builders(dev: torch.device, max_blocks: int) -> list:
    """(name, constructor) of each builder path (the device-derived one where this
    pagedkv has it)."""
    out = [
        (INCREMENTAL, lambda: MetadataBuilder([group()], device=dev, rows=BUCKETS[-1],
                                              width=max_blocks)),
    ]
    if "derive_on_device" not in PersistentMetadata.__init__.__code__.co_varnames:
        out.append((PERSISTENT, lambda: PersistentMetadata(
            [group()], max_blocks=max_blocks, batch_buckets=BUCKETS, device=dev)))
    else:  # the full path, then the derived one (the default on CUDA)
        out.append((PERSISTENT, lambda: PersistentMetadata(
            [group()], max_blocks=max_blocks, batch_buckets=BUCKETS, device=dev,
            derive_on_device=False)))
        out.append((DERIVED, lambda: PersistentMetadata(
            [group()], max_blocks=max_blocks, batch_buckets=BUCKETS, device=dev,
            derive_on_device=True, derive_graphs=False)))
        if dev.type == "cuda" and "derive_graphs" in PersistentMetadata.__init__.__code__.co_varnames:
            out.append((GRAPHS, lambda: PersistentMetadata(
                [group()], max_blocks=max_blocks, batch_buckets=BUCKETS, device=dev,
                derive_on_device=True, derive_graphs=True)))
    return out


def timed_derive(builder, launches: list[int]) -> None:
    """Record the host time of each derive call of ``builder`` (on CUDA: the launch)."""
    delta = builder._delta
    real = delta.derive

    def derive(*args) -> None:
        t0 = time.perf_counter_ns()
        real(*args)
        launches.append(time.perf_counter_ns() - t0)
    delta.derive = derive


def median_us(fn, repeat: int = 300, inner: int = 1) -> float:
    """Median host time of ``fn()`` in us (``inner`` calls per sample)."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter_ns() - t0) / inner)
    return statistics.median(out) / 1e3


def alone(batch: int, steps: int, dev: torch.device, g: Group, att: AttentionGroup) -> None:
    """Each builder's steps back to back (no other path in between), then under cProfile."""
    max_blocks = (1280 + 2 * steps + 8) // BLOCK + 2
    for name, make in builders(dev, max_blocks):
        decode = Decode(batch, random.Random(batch + 1), 2 * steps + 10)
        builder = make()
        decode.load(builder)
        launches: list[int] = []
        if name in DERIVED_ROWS:
            timed_derive(builder, launches)
        parts: list[tuple[int, int]] = []  # (appends, step + view less the derive call)

        def one(prof=None, decode=decode, builder=builder, launches=launches, parts=parts) -> int:
            opened = decode.advance()  # the benchmark's own bookkeeping: not timed
            if prof is not None:
                prof.enable()
            t0 = time.perf_counter_ns()
            if opened:
                builder.append_each([rid for rid, _ in opened], {0: [b for _, b in opened]})
            t1 = time.perf_counter_ns()
            launches.clear()
            attention_view(builder.step(decode.ids, decode.computed, decode.new)[0], att,
                           causal=True)
            t2 = time.perf_counter_ns()
            if prof is not None:
                prof.disable()
            parts.append((t1 - t0, t2 - t1 - sum(launches)))
            return t2 - t0

        for _ in range(5):
            one()
        parts.clear()
        per = statistics.median(one() for _ in range(steps)) / 1e3
        appends = statistics.median(p[0] for p in parts) / 1e3
        step = statistics.median(p[1] for p in parts) / 1e3
        print(f"# alone, batch {batch}, {name} (appends included): median {per:.1f} us "
              f"over {steps} back-to-back steps; appends {appends:.1f}, step + view "
              f"{step:.1f}" + (" less the derive call" if name in DERIVED_ROWS else ""))
        prof = cProfile.Profile()
        for _ in range(steps):
            one(prof)
        stats = pstats.Stats(prof)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:14]  # type: ignore[attr-defined]
        total = sum(v[2] for v in stats.stats.values()) / steps * 1e6  # type: ignore[attr-defined]
        print(f"#   cProfile: {total:.1f} us/step in all (profiled); own time per step:")
        for (file, line, func), (_, ncalls, tottime, _, _) in rows:
            print(f"#   {tottime / steps * 1e6:8.2f} us  {ncalls / steps:6.2f} calls  "
                  f"{os.path.basename(file)}:{line}({func})")


def cuda_calls() -> None:
    """Host cost of the CUDA calls a step makes, and of numpy on pinned memory."""
    from pagedkv.batch.buffers import _raw_stream
    n = 1 << 20
    pinned = torch.zeros(n, dtype=torch.uint8, pin_memory=True)
    pageable = torch.zeros(n, dtype=torch.uint8)
    dev = torch.zeros(n, dtype=torch.uint8, device="cuda")
    ev = torch.cuda.Event()
    stream = torch.cuda.current_stream()
    idx = dev.device.index
    torch.cuda.synchronize()
    print(f"# CUDA calls, host us (median): pinned buffer is_pinned={pinned.is_pinned()}")
    ev.record(stream)
    torch.cuda.synchronize()
    probes = {
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "_cuda_getCurrentRawStream": (lambda: _raw_stream(idx)) if _raw_stream else None,
        "event.record() (no stream)": lambda: ev.record(),
        "event.record(stream)": lambda: ev.record(stream),
        "event.synchronize() (done)": lambda: ev.synchronize(),
        "event.query() (done)": lambda: ev.query(),
        "dev[:k] slice": lambda: dev[:100000],
        "dev.as_strided": lambda: dev.as_strided((100000,), (1,)),
    }
    for label, fn in probes.items():
        if fn is not None:
            print(f"#   {label:40s} {median_us(fn, 200, 20):8.2f}")
    for size in (16 << 10, 176 << 10, 704 << 10):
        for kind, src in (("pinned", pinned), ("pageable", pageable)):
            d, h = dev[:size], src[:size]

            def copy(d=d, h=h) -> None:
                d.copy_(h, non_blocking=True)
            torch.cuda.synchronize()
            t = median_us(copy, 100, 1)
            torch.cuda.synchronize()
            print(f"#   copy_ non_blocking {kind:8s} {size >> 10:4d} KiB {t:14.2f}")
    a = pinned.numpy()[: 176 << 10]
    b = pageable.numpy()[: 176 << 10]
    src = np.arange(44 << 10, dtype=np.int32).view(np.uint8)
    for kind, arr in (("pinned", a), ("ordinary", b)):
        w = median_us(lambda arr=arr: np.copyto(arr, src), 200, 5)
        r = median_us(lambda arr=arr: np.add.reduce(arr.view(np.int32)), 200, 5)
        print(f"#   numpy 176 KiB {kind:8s}: write {w:7.2f} us, read (sum) {r:7.2f} us")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batches", default="64,256,1024")
    parser.add_argument("--run", type=int, default=1,
                        help="consecutive steps of one path per turn (1: fully interleaved)")
    parser.add_argument("--breakdown", action="store_true",
                        help="then: each builder alone, its cProfile, and CUDA call costs")
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
    bad = []
    results = []
    for batch in batches:
        rows, mismatch, count = run_batch(batch, args.steps, args.run, dev, g, att)
        bad += mismatch
        results.append((rows, count))
    load = f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    if args.breakdown:
        for batch in batches:
            alone(batch, args.steps, dev, g, att)
        if dev.type == "cuda":
            cuda_calls()
    # the table last: its copy counts use the profiler, which runs after all timing
    print("%-6s %-36s %10s %9s %9s %10s %12s" % ("batch", "path", "host us", "vs old", "p10 us",
                                                  "H2D/step", "copy B/step"))
    for rows, count in results:
        copies = count()
        for *row, nbytes, name in rows:
            print("%-6d %-36s %10.1f %8.2fx %9.1f %10d %12s" % (
                *row, copies.get(name, 0), "-" if nbytes is None else f"{nbytes:,.0f}"), flush=True)
    print("# copy B/step: median bytes of a builder step's one host-to-device copy (on a CPU "
          "device, which copies nothing: what a CUDA step of the same shape would copy)")
    print(load)
    if bad:
        print(f"pagedkv: error: metadata differs from build_metadata at {bad[:5]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
