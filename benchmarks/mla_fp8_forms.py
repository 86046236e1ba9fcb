#!/usr/bin/env python3
"""The fp8 MLA Gluon kernels under module switches, each against the bf16 Gluon kernel timed
in the same process: one decode shape (B64 ctx8K h16 q1, page 64; ``B`` / ``CTX`` in the
environment change batch and context), CUDA-graph replays of 10 calls, median of 20.

Why: a switch of ``mla_gluon_e4m3`` or ``mla_gluon_ds`` (ring slots, MMA warpgroup
registers) is a compile-time constant; this flips them one spec at a time and reports the
time, the ratio of bf16 time to it (throughput) and the relative error against the bf16
kernel on the unquantized latent (the storage error, ~3e-2). ``benchmarks/attention.py`` is the
issue's table; this is the quick A/B of forms.

Usage on a GPU, from the repo root:

    PYTHONPATH=src python3 benchmarks/mla_fp8_forms.py e4m3 STAGES=3 STAGES=2
    PYTHONPATH=src python3 benchmarks/mla_fp8_forms.py ds STAGES=2

A spec is NAME=INT[,NAME=INT...] of the module's attributes; ``MMA_REGS`` (both modules) is
read by the kernels as a global, which Triton fixes at their first compile: give one such
spec per process.
"""

from __future__ import annotations

import math
import os
import sys

import torch


def _timed(fn, calls: int = 10, reps: int = 20) -> float:
    """Median us per call of ``fn`` replayed from a CUDA graph of ``calls`` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / calls)
    times.sort()
    return times[len(times) // 2]


def main(argv: list[str]) -> int:
    if len(argv) < 1 or argv[0] not in ("e4m3", "ds"):
        print("usage: mla_fp8_forms.py e4m3|ds [NAME=INT[,NAME=INT...] ...]", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("mla_fp8_forms.py: needs a CUDA device (a Hopper GPU)", file=sys.stderr)
        return 2
    from triton.experimental.gluon import language as gl

    from pagedkv.ops import Mask
    from pagedkv.ops.triton import mla as triton_mla
    from pagedkv.ops.triton import mla_gluon_ds, mla_gluon_e4m3
    from pagedkv.ops.triton.cache_write import write_mla_latent
    from pagedkv.ops.triton.mla import paged_mla_latent

    torch.manual_seed(0)
    dev = "cuda"
    batch, ctx, heads, page = int(os.environ.get("B", 64)), int(os.environ.get("CTX", 8192)), 16, 64
    pages = batch * ctx // page
    table = torch.randperm(pages, device=dev, dtype=torch.int32).view(batch, -1)
    latent = torch.randn(pages, page, 576, device=dev, dtype=torch.bfloat16)
    ql = torch.randn(batch, heads, 512, device=dev, dtype=torch.bfloat16)
    qr = torch.randn(batch, heads, 64, device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(0, batch + 1, device=dev, dtype=torch.int32)
    lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    kw = dict(scale=1 / math.sqrt(192), mask=Mask(), max_query_len=1, max_seq_len=ctx,
              check_blocks=False)
    if argv[0] == "ds":
        module, extra = mla_gluon_ds, {"gluon": True}
        cache = torch.empty(pages, page, 656, device=dev, dtype=torch.uint8)
        flat = latent.view(-1, 576)
        write_mla_latent(flat[:, :512], flat[:, 512:], cache,
                         torch.arange(pages * page, device=dev))
    else:
        scale = float(latent.abs().amax()) / 448
        module, extra = mla_gluon_e4m3, {"gluon": "e4m3", "latent_scale": scale}
        cache = (latent.float() / scale).to(torch.float8_e4m3fn)
    ref = paged_mla_latent(ql, qr, latent, qsl, lens, table, **kw).float()
    bf16 = _timed(lambda: paged_mla_latent(ql, qr, latent, qsl, lens, table, **kw))
    print(f"{'bf16 Gluon kernel':40s} {bf16:7.1f} us", flush=True)
    for spec in argv[1:] or [""]:
        values = {}
        for item in filter(None, spec.split(",")):
            name, _, value = item.partition("=")
            if not hasattr(module, name) or not value.lstrip("-").isdigit():
                print(f"mla_fp8_forms.py: {item!r} is not NAME=INT of {module.__name__}",
                      file=sys.stderr)
                return 2
            values[name] = gl.constexpr(int(value)) if name.endswith("MMA_REGS") else int(value)
        kept = {name: getattr(module, name) for name in values}
        for name, value in values.items():
            setattr(module, name, value)
        triton_mla._GLUON_PLANS.clear()
        try:
            def fn():
                return paged_mla_latent(ql, qr, cache, qsl, lens, table, **kw, **extra)
            err = float((fn().float() - ref).norm() / ref.norm())
            t = _timed(fn)
        finally:
            for name, value in kept.items():
                setattr(module, name, value)
        print(f"{argv[0] + ' ' + (spec or 'as set'):40s} {t:7.1f} us  {bf16 / t:.2f}x bf16  "
              f"relerr {err:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
