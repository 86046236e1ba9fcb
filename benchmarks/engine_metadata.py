#!/usr/bin/env python3
"""Host time of the engine's per-step metadata build, stateless vs persistent, on the same
decode steps of the engine's own scheduler and block manager.

Times :meth:`pagedkv.engine.runner.ModelRunner.step_metadata` both ways, interleaved (one
of each per step, the order alternating), so a loaded machine slows them alike:

- ``stateless``: a ScheduledRequest per request from every block list, then
  ``build_metadata`` (what the runner did before; ``EngineOptions(metadata="stateless")``);
- ``persistent``: the tables' changes since each request's last step into the runner's one
  ``PersistentMetadata`` (``engine/stepmeta.py``: a block opened here and there, one
  ``append_each`` call per group), then its step into the fixed, bucketed buffers (the
  default).

Setup: an Engine over a tiny random Llama (fp32, CPU; the model never runs: the metadata
does not depend on the cache's contents), B requests with prompts of 768-1,280 tokens,
block size 16, ``max_running`` B, block tables ``max_model_len / 16`` wide (by default
just long enough for the run: 104 columns at 300 steps, 123 with ``--breakdown``, whose
steps come after). The prompts are
scheduled and committed without a forward, then every step is a decode step of all B
requests (schedule, time both builds, commit one token each); the first ``--warmup`` steps
are not timed. The persistent output is compared with ``build_metadata`` (padded alike)
every 10th step.

Reported per batch: median host time per step (perf_counter), the 10th percentile (the
steps least disturbed on a shared machine) and the ratio persistent / stateless of the
medians; then the machine, versions and UTC time.

``--breakdown``: afterwards, as many persistent steps alone, back to back: the medians of
the build, of the builder's ``step`` and of ``append_each`` (the rest: TableSync's checks),
and of the scheduler's ``schedule`` and ``update`` around them (for scale).

``--baseline FILE``: a third path on the same steps, interleaved with the other two (the
order rotating): the ``TableSync`` of another ``engine/stepmeta.py`` (e.g. an older
commit's, from ``git archive``; the rest of pagedkv is this tree's), with its own builder
over the same manager, called as the persistent path is (``step_metadata``, the runner's
``sync`` swapped for the call: timing one path through the runner and the other not
differed by up to ~20% on a shared machine); its output is compared with the persistent one's on every 10th
step. Reported: its median, 10th percentile and ratio to stateless, and the median over
steps of persistent / baseline (each step's pair), which a machine slowing down between
steps moves least.

Usage: python benchmarks/engine_metadata.py [--batches 64,256] [--steps N] [--warmup N]
       [--max-model-len N] [--breakdown] [--derive-on-device | --host-steps]
       [--baseline FILE]
       [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import itertools
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from metadata import cpu_name  # noqa: E402

from pagedkv.batch import build_metadata  # noqa: E402
from pagedkv.engine import Engine, EngineOptions, SamplingParams  # noqa: E402
from pagedkv.engine.tiny import tiny_model  # noqa: E402
from pagedkv.kvspec.layout import bytes_per_token  # noqa: E402
from pagedkv.models import layers_from_config  # noqa: E402

# what --profile profiles, each on its own: name -> the heading of its table
PROFILED = {"build": "the persistent builds", "schedule": "the scheduler's schedule",
            "update": "the scheduler's update"}
ARRAYS = ("block_table", "slot_mapping", "query_start_loc", "seq_lens", "positions",
          "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")


def make_engine(hf, batch: int, max_model_len: int, derive: bool | None,
                device: str = "cpu") -> Engine:
    """Room for every request at max_model_len (fp32: the planner counts 16-bit KV, so an
    fp32 engine plans half of what it is given)."""
    per_token = sum(bytes_per_token(s.layout) for s in layers_from_config(hf.config.to_dict()))
    need = 2 * per_token * (batch * max_model_len + 8192) * 5 // 4
    return Engine(hf, EngineOptions(
        device=device, block_size=16, max_model_len=max_model_len, max_batched_tokens=8192,
        max_running=batch, kv_cache_bytes=need, enable_prefix_caching=False,
        derive_on_device=derive))


def check(meta, reqs, groups) -> None:
    first = next(iter(meta.values()))
    want = build_metadata(reqs, groups, device=first.block_table.device,
                          pad_batch_to=first.block_table.shape[0],
                          pad_tokens_to=first.slot_mapping.shape[0],
                          max_blocks=first.block_table.shape[1])
    for gid, got in meta.items():
        for name in ARRAYS:
            if not torch.equal(getattr(got, name), getattr(want[gid], name)):
                raise SystemExit(f"persistent metadata differs from build_metadata: {name}")


def baseline_call(runner, base, chunks, extra):
    """``step_metadata`` through the baseline's TableSync (the runner's own put back)."""
    runner.sync, own = base, runner.sync
    try:
        return runner.step_metadata(chunks, extra)
    finally:
        runner.sync = own


def breakdown(sched, runner, steps: int, base=None, prof=None) -> dict:
    """The persistent build alone, ``steps`` decode steps back to back (warm): medians of
    the whole build, the builder's ``step`` and its ``append_each`` calls (the rest is
    TableSync's per-request checks). With ``base``, its build on the same steps too (the
    order alternating): its median and the median of persistent / baseline per step. With
    ``prof`` (a ``cProfile.Profile`` per name of ``PROFILED``), the persistent builds and
    the scheduler's calls run under theirs (outside the timed spans)."""
    builder = runner.sync.builder
    parts = {"build": [], "builder.step": [], "append_each": [], "schedule": [], "update": []}
    other = []
    step, append_each = builder.step, builder.append_each

    def timed(name, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            parts[name][-1] += time.perf_counter() - t0
            return out
        return call

    def profile(name, on):
        if prof is not None:
            (prof[name].enable if on else prof[name].disable)()

    builder.step, builder.append_each = timed("builder.step", step), timed("append_each", append_each)
    try:
        for _ in range(steps):
            profile("schedule", True)
            t0 = time.perf_counter()
            plan = sched.schedule()
            t1 = time.perf_counter()
            profile("schedule", False)
            for v in parts.values():
                v.append(0.0)
            parts["schedule"][-1] = t1 - t0
            extra = [0] * len(plan.chunks)
            if base is not None and len(other) % 2:
                t0 = time.perf_counter()
                baseline_call(runner, base, plan.chunks, extra)
                other.append(time.perf_counter() - t0)
            profile("build", True)
            t0 = time.perf_counter()
            runner.step_metadata(plan.chunks, extra)
            parts["build"][-1] = time.perf_counter() - t0
            profile("build", False)
            if base is not None and len(other) < len(parts["build"]):
                t0 = time.perf_counter()
                baseline_call(runner, base, plan.chunks, extra)
                other.append(time.perf_counter() - t0)
            sampled = {c.request.rid: [1] for c in plan.chunks if c.samples}
            profile("update", True)
            t0 = time.perf_counter()
            sched.update(plan, sampled)
            parts["update"][-1] = time.perf_counter() - t0
            profile("update", False)
    finally:
        del builder.step, builder.append_each
    out = {k: statistics.median(v) * 1e6 for k, v in parts.items()}
    if other:
        out["baseline"] = statistics.median(other) * 1e6
        out["pair"] = statistics.median(p / b for p, b in zip(parts["build"], other))
    return out


def print_profile(prof, steps: int, what: str, top: int = 18) -> None:
    """The profiled calls' functions with the most own time, in us per step."""
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, ncalls, tt, ct, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    total = sum(v[2] for v in stats.values()) * 1e6 / steps
    print(f"cProfile of {what}: {total:.1f} us/step in all (profiled); "
          "own time / cumulative per step, calls per step:")
    for (file, line, name), (_, ncalls, tt, ct, _) in rows:
        where = f"{os.path.basename(file)}:{line}" if line else file
        print(f"  {tt * 1e6 / steps:7.1f} {ct * 1e6 / steps:7.1f} {ncalls / steps:6.1f}  "
              f"{name} ({where})")


def load_baseline(path: str):
    """The ``TableSync`` class of another ``engine/stepmeta.py``."""
    spec = importlib.util.spec_from_file_location("baseline_stepmeta", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TableSync


def same(a, b) -> None:
    """Two builders' metadata of one step, equal array by array."""
    for gid, got in a.items():
        for name in ARRAYS:
            if not torch.equal(getattr(got, name), getattr(b[gid], name)):
                raise SystemExit(f"baseline metadata differs from the persistent one: {name}")


def run(hf, batch: int, steps: int, warmup: int, max_model_len: int, derive: bool | None,
        split: bool = False, baseline=None, device: str = "cpu", prof=None) -> dict:
    engine = make_engine(hf, batch, max_model_len, derive, device)
    rng = random.Random(batch)
    vocab = engine.vocab_size
    for _ in range(batch):
        n = rng.randrange(768, 1281)
        engine.add_request([rng.randrange(vocab) for _ in range(n)],  # none finishes early
                           SamplingParams(max_new_tokens=max_model_len - n, ignore_eos=True))
    sched, runner = engine.scheduler, engine.runner
    times = {"stateless": [], "persistent": []}
    base = None
    if baseline is not None:  # the runner's arguments (make_engine's options)
        base = baseline(runner.attn_groups, runner.mgr, runner.gids, device=runner.device,
                        max_batch=min(batch, 8192), max_tokens=8192,
                        max_model_len=max_model_len, derive_on_device=derive)
        if base.builder.max_blocks != runner.sync.builder.max_blocks:
            raise SystemExit("the baseline's block tables are not as wide as the runner's")
        times["baseline"] = []
    # every order in turn (each path as often before as after each other one); two
    # paths: persistent first on even steps
    orders = list(itertools.permutations(times))[::-1]
    decode_steps = 0
    while decode_steps < steps + warmup:
        plan = sched.schedule()
        if not plan.chunks or plan.preempted:
            raise SystemExit("a request was preempted or nothing was scheduled: the cache "
                             "is too small, or --max-model-len too short for the steps")
        decode = len(plan.chunks) == batch and all(c.num_new_tokens == 1 for c in plan.chunks)
        if decode:
            extra = [0] * len(plan.chunks)
            order = orders[decode_steps % len(orders)]
            out = {}
            for path in order:
                t0 = time.perf_counter()
                if path == "baseline":  # the same call, through the baseline's TableSync
                    meta, _ = baseline_call(runner, base, plan.chunks, extra)
                else:
                    meta, _ = runner.step_metadata(plan.chunks, extra,
                                                   stateless=path == "stateless")
                dt = time.perf_counter() - t0
                if decode_steps >= warmup:
                    times[path].append(dt * 1e6)
                if decode_steps % 10 == 0:
                    out[path] = meta
            if "persistent" in out:
                check(out["persistent"], [runner.scheduled(c) for c in plan.chunks],
                      runner.attn_groups)
                if base is not None:
                    same(out["baseline"], out["persistent"])
            decode_steps += 1
        sampled = {c.request.rid: [1] for c in plan.chunks if c.samples}
        sched.update(plan, sampled)
    builder = runner.sync.builder
    parts = breakdown(sched, runner, steps, base, prof) if split else None
    return {"times": times, "parts": parts, "derived": builder.derived_steps,
            "width": builder.max_blocks, "added": runner.sync.added,
            "rewritten": runner.sync.rewritten}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: 1,280 + warmup + steps + 64 (the admission steps "
                             "decode too), rounded up to 16")
    parser.add_argument("--breakdown", action="store_true",
                        help="then as many persistent steps alone, warm: where the time goes")
    parser.add_argument("--profile", action="store_true",
                        help="with --breakdown: its persistent builds, then its "
                             "scheduler's schedule and update calls, each under a cProfile "
                             "of its own: the functions with the most own time per step "
                             "(the timings of that breakdown then include the profiler's "
                             "cost)")
    parser.add_argument("--baseline", metavar="FILE",
                        help="another engine/stepmeta.py whose TableSync runs on the same "
                             "steps too (see the module doc)")
    derive = parser.add_mutually_exclusive_group()
    derive.add_argument("--derive-on-device", action="store_true",
                        help="the persistent builder derives steady decode steps 'on the "
                             "device' (on CPU: its numpy reference, on the host; on CUDA "
                             "the default, with its copy and launch replayed from graphs)")
    derive.add_argument("--host-steps", action="store_true",
                        help="every step built on the host and copied (derive_on_device "
                             "False; the CPU default, on CUDA to compare with deriving)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="the engine's device (the model never runs)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("pagedkv: error: --device cuda needs a CUDA device", file=sys.stderr)
        return 2
    if args.max_model_len is None:
        more = args.steps if args.breakdown else 0
        args.max_model_len = -(-(1280 + args.warmup + args.steps + more + 64) // 16) * 16
    torch.set_num_threads(1)
    hf = tiny_model("llama-3-8b")
    start = datetime.now(timezone.utc)
    breakdowns = []
    baselines = []
    baseline = load_baseline(args.baseline) if args.baseline else None
    print("| batch | stateless us (p10) | persistent us (p10) | ratio | derived steps | "
          "table width |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch in (int(b) for b in args.batches.split(",")):
        prof = ({name: cProfile.Profile() for name in PROFILED}
                if args.profile and args.breakdown else None)
        r = run(hf, batch, args.steps, args.warmup, args.max_model_len,
                True if args.derive_on_device else False if args.host_steps else None,
                args.breakdown, baseline, args.device, prof)
        if r["parts"]:
            breakdowns.append((batch, r["parts"], prof))
        t = r["times"]
        med = {k: statistics.median(v) for k, v in t.items()}
        p10 = {k: float(np.percentile(v, 10)) for k, v in t.items()}
        print(f"| {batch} | {med['stateless']:.0f} ({p10['stateless']:.0f}) | "
              f"{med['persistent']:.0f} ({p10['persistent']:.0f}) | "
              f"{med['persistent'] / med['stateless']:.3f} | {r['derived']} | {r['width']} |",
              flush=True)
        if baseline is not None:
            pair = statistics.median(p / b for p, b in zip(t["persistent"], t["baseline"]))
            baselines.append((batch, med["baseline"], p10["baseline"],
                              med["baseline"] / med["stateless"], pair))
    end = datetime.now(timezone.utc)
    for batch, m, p, ratio, pair in baselines:
        print(f"\nbatch {batch}, baseline {args.baseline}: {m:.0f} us ({p:.0f}), "
              f"ratio {ratio:.3f}; persistent / baseline per step: median {pair:.3f}")
    for batch, parts, prof in breakdowns:
        rest = parts["build"] - parts["builder.step"] - parts["append_each"]
        print(f"\nbatch {batch}, persistent alone ({args.steps} steps, warm, medians): build "
              f"{parts['build']:.0f} us = builder.step {parts['builder.step']:.0f} + "
              f"append_each {parts['append_each']:.0f} + TableSync checks ~{rest:.0f}; the "
              f"engine's scheduler in the same steps: schedule {parts['schedule']:.0f} us, "
              f"update {parts['update']:.0f} us (block-manager commits included)")
        if "pair" in parts:
            print(f"baseline alone, the same steps (the order alternating): build "
                  f"{parts['baseline']:.0f} us; persistent / baseline per step: median "
                  f"{parts['pair']:.3f}")
        if prof is not None:
            for name, what in PROFILED.items():
                print_profile(prof[name], args.steps, what)
    print(f"\n{len(t['stateless'])} timed decode steps per batch after {args.warmup} untimed; "
          f"persistent output equal to build_metadata on every 10th step"
          + (" (and the baseline's to it)" if baseline is not None else ""))
    print(f"machine: {os.cpu_count()} cores, {len(os.sched_getaffinity(0))} usable "
          f"({cpu_name()}), device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
          + ", load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; Python "
          f"{platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}")
    print(f"UTC {start:%Y-%m-%d %H:%M:%S} - {end:%H:%M:%S}; "
          f"command: python benchmarks/engine_metadata.py {' '.join(argv or sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
