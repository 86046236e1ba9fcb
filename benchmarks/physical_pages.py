#!/usr/bin/env python3
"""Host time that physical pages add to each decode step (figures in docs/memory.md).

R running requests (default 256) decode one token per step; a request that fills its last
block takes a new one (``--alloc lifo``: the id freed last, as BlockPool hands them out;
``--alloc lowest``: the lowest free id, as ElasticPool does); a finished
request frees all its blocks and a new one is admitted with its prompt's blocks at once.
The same loop runs twice, interleaved in chunks: *baseline* keeps only the free list;
*paged* also tells the PageLedger (``use`` / ``release``); before the launch it polls the
step events and applies the maps (``PhysicalMemory.before_launch``), after it records the
step's event, applies the deferred unmaps and tops up the stock (``after_launch``), while
the device works. ``added_before_launch`` is what lands on the step's critical path.
``--ahead N`` keeps each pool's N lowest unmapped pages mapped from the stock after each
launch (``PhysicalMemory(ahead=N)``); ``ahead_hits`` counts maps that found their page
mapped ahead (no driver call before the launch). Each step's device work is a sleep kernel (``--gpu-step-us``) so pages
really wait for their step. Reported: per-step host time of each, the difference, p50/p99
of the between-steps call, maps and unmaps per step, and maps that had to create a page.

Backings: ``vmm`` (CUDA virtual memory, the real thing), ``tensor`` (ordinary tensors:
map = a 2 MiB copy, not representative of time), ``none`` (ledger only; ops dropped).

Usage: python benchmarks/physical_pages.py [--backing vmm|tensor|none] [--requests 256]
       [--steps 2000] [--block-bytes 2097152] [--alloc lifo|lowest] [--ahead N] [--json]
"""

from __future__ import annotations

import argparse
import heapq
import json
import platform
import random
import statistics
import sys
import time

from pagedkv.blocks.pages import PAGE_BYTES, PageLedger, PoolRange

ns = time.perf_counter_ns


class Workload:
    """Request lengths and block demands, identical for both runs (one seeded stream)."""

    def __init__(self, args, seed: int) -> None:
        self.rng = random.Random(seed)
        self.bs = args.block_size
        self.args = args

    def new_request(self) -> tuple[int, int]:
        """(prompt tokens, tokens to generate)"""
        a = self.args
        return self.rng.randint(a.prompt // 2, a.prompt * 3 // 2), self.rng.randint(1, a.output)


class Loop:
    def __init__(self, args, paged: bool, mem) -> None:
        self.args = args
        self.paged = paged
        self.mem = mem
        self.ledger = mem.ledger if mem is not None else getattr(args, "ledger_only", None)
        self.work = Workload(args, args.seed)
        ceiling = args.ceiling_blocks
        self.lowest = args.alloc == "lowest"
        # lifo: pops 0, 1, 2, ... then the id freed last; lowest: a min-heap
        self.free = list(range(ceiling)) if self.lowest else list(range(ceiling - 1, -1, -1))
        self.reqs: list[list] = []  # [length, remaining, blocks]
        for _ in range(args.requests):
            self._admit()

    def _take(self, n: int) -> list[int]:
        if self.lowest:
            out = [heapq.heappop(self.free) for _ in range(n)]
        else:
            out = [self.free.pop() for _ in range(n)]
        if self.paged:
            self.ledger.use(0, out)
        return out

    def _give(self, blocks: list[int]) -> None:
        if self.paged:
            self.ledger.release(0, blocks)
        if self.lowest:
            for b in blocks:
                heapq.heappush(self.free, b)
        else:
            self.free.extend(reversed(blocks))

    def _admit(self) -> None:
        prompt, out = self.work.new_request()
        n = -(-prompt // self.args.block_size)
        self.reqs.append([prompt, out, self._take(n)])

    def step(self) -> None:
        bs = self.args.block_size
        done = []
        for i, r in enumerate(self.reqs):
            if r[0] % bs == 0:
                r[2].extend(self._take(1))
            r[0] += 1
            r[1] -= 1
            if r[1] == 0:
                done.append(i)
        for i in reversed(done):
            self._give(self.reqs.pop(i)[2])
        for _ in done:
            self._admit()


def _mean_p99(v: list[int]) -> str:
    v = sorted(v)
    return f"{sum(v) / len(v) / 1e3:.1f} / {v[min(len(v) - 1, len(v) * 99 // 100)] / 1e3:.1f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backing", choices=["vmm", "tensor", "none"], default=None,
                   help="default: vmm with CUDA, else none")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200, help="steps not timed (ramp-up)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--block-bytes", type=int, default=2 << 20,
                   help="bytes of one block, all layers (default: Llama-3-8B bf16, 16 tokens)")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=512)
    p.add_argument("--budget-gib", type=float, default=48.0)
    p.add_argument("--stock", type=int, default=16)
    p.add_argument("--alloc", choices=["lifo", "lowest"], default="lifo",
                   help="which free block a new one is: the id freed last (BlockPool) or the "
                        "lowest (ElasticPool)")
    p.add_argument("--ahead", type=int, default=0,
                   help="pages per pool mapped ahead after each launch (PhysicalMemory ahead=)")
    p.add_argument("--gpu-step-us", type=float, default=2000.0)
    p.add_argument("--lag", type=int, default=0,
                   help="wait (untimed) for step s - LAG before step s + 1, as an engine waits "
                        "for sampled tokens; 0: the host runs ahead of the device")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    cuda = False
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        torch = None
    backing_kind = args.backing or ("vmm" if cuda else "none")
    if backing_kind == "vmm" and not cuda:
        print("pagedkv: error: --backing vmm needs a CUDA device", file=sys.stderr)
        return 2
    budget = int(args.budget_gib * (1 << 30))
    args.ceiling_blocks = budget // args.block_bytes
    pools = [PoolRange(0, args.block_bytes, args.ceiling_blocks)]
    worst = args.requests * -(-(args.prompt * 3 // 2 + args.output) // args.block_size)
    if worst > args.ceiling_blocks:
        print(f"pagedkv: error: {args.requests} requests may need {worst} blocks of "
              f"{args.block_bytes} bytes, over the {args.budget_gib} GiB budget "
              f"({args.ceiling_blocks} blocks)", file=sys.stderr)
        return 2

    def make_mem():
        led = PageLedger(pools, budget, PAGE_BYTES, stock_pages=args.stock)
        if backing_kind == "none":
            args.ledger_only = led
            return None
        from pagedkv.memory.physical import PhysicalMemory
        from pagedkv.memory.steps import CudaSteps, ManualSteps

        if backing_kind == "vmm":
            from pagedkv.memory.vmm import VmmBacking

            backing = VmmBacking(pools, PAGE_BYTES, steps=CudaSteps())
        else:
            from pagedkv.memory.backing import TensorBacking

            dev = "cuda" if cuda else "cpu"
            backing = TensorBacking(pools, PAGE_BYTES, device=dev,
                                    steps=CudaSteps() if cuda else ManualSteps(True))
        return PhysicalMemory(led, backing, ahead=args.ahead)

    cycles = int(args.gpu_step_us * 1980)  # H200 SM clock ~1.98 GHz under load
    mem = make_mem()
    op_ns: dict[str, list[int]] = {"map": [], "unmap": [], "set_stock": [], "map_ahead": [],
                                   "drop_ahead": []}
    if mem is not None:  # time each backing call (a wrapper: a few hundred ns each)
        def timer(f, out):
            def timed(*a):
                t = ns()
                f(*a)
                out.append(ns() - t)
            return timed

        for name in op_ns:
            setattr(mem.backing, name, timer(getattr(mem.backing, name), op_ns[name]))
    paged = Loop(args, True, mem)
    base = Loop(args, False, None)
    t_base, t_paged, t_between, t_critical = [], [], [], []
    maps = unmaps = 0
    ahead_keys = ("ahead_maps", "ahead_hits", "ahead_dropped")
    ahead_at_warmup = dict.fromkeys(ahead_keys, 0)
    for s in range(args.warmup + args.steps):
        if s == args.warmup and mem is not None:  # count the timed steps only
            ahead_at_warmup = {k: mem.backing.stats[k] for k in ahead_keys}
        t0 = ns()
        base.step()
        t1 = ns()
        paged.step()
        t2 = ns()
        if mem is not None:
            ops = mem.before_launch()  # maps: on the step's critical path
            t3 = ns()
            if cuda:
                torch.cuda._sleep(cycles)
            t4 = ns()
            mem.after_launch(s)  # event, deferred unmaps, stock: while the device works
            t5 = ns()
            if args.lag and s >= args.lag:  # an engine waits for step s - lag's tokens
                mem.backing.steps.wait(s - args.lag)
            between = (t3 - t2) + (t5 - t4)
            before_ns = t3 - t2
        else:
            led = args.ledger_only
            t3 = ns()
            if led.launched > led.finished:
                led.step_finished(led.launched)
            ops = led.drain()
            led.step_launched(s)
            between = before_ns = ns() - t3
        if s >= args.warmup:
            t_base.append(t1 - t0)
            t_paged.append(t2 - t1 + between)
            t_between.append(between)
            t_critical.append(t2 - t1 + before_ns)
            maps += sum(1 for o in ops if type(o).__name__ == "MapOp")
            unmaps += sum(1 for o in ops if type(o).__name__ == "UnmapOp")
    if cuda:
        torch.cuda.synchronize()
    n = args.steps
    q = statistics.quantiles(t_between, n=100)
    res = {
        "backing": backing_kind, "requests": args.requests, "steps": n,
        "block_bytes": args.block_bytes, "block_size": args.block_size,
        "alloc": args.alloc, "ahead": args.ahead,
        "gpu_step_us": args.gpu_step_us if cuda else 0, "lag": args.lag,
        "baseline_us_per_step": sum(t_base) / n / 1e3,
        "paged_us_per_step": sum(t_paged) / n / 1e3,
        "added_us_per_step": (sum(t_paged) - sum(t_base)) / n / 1e3,
        "added_before_launch_us_per_step": (sum(t_critical) - sum(t_base)) / n / 1e3,
        "between_steps_p50_us": q[49] / 1e3, "between_steps_p99_us": q[98] / 1e3,
        "maps_per_step": maps / n, "unmaps_per_step": unmaps / n,
        "created_in_map": mem.backing.stats["created_in_map"] if mem else 0,
        **({f"{k}_per_step": (mem.backing.stats[k] - ahead_at_warmup[k]) / n
            for k in ahead_keys} if mem else {}),
        **{f"{k}_us_mean_p99": _mean_p99(v) for k, v in op_ns.items() if v},
        "mapped_gib_end": (mem.ledger if mem else args.ledger_only).mapped_bytes() / 2**30,
        "machine": platform.node(), "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if cuda:
        res["gpu"] = torch.cuda.get_device_name()
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for k, v in res.items():
            print(f"{k:32} {v:.2f}" if isinstance(v, float) else f"{k:32} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
