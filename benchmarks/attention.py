#!/usr/bin/env python3
"""Paged-attention kernels on a GPU against the bandwidth limit and peers in the same process.

For each kernel and shape: the median of CUDA-event timings (triton.testing.do_bench, L2
flushed between calls), the KV bytes a kernel must read once (GQA: K + V; MLA: the latent
entries; q, out and tables not counted), GB/s, and that as a fraction of the device-to-
device copy bandwidth measured at the start of the same run (2 GiB bf16 copy_, bytes read +
written). Peers, each where it loads: torch SDPA on K/V gathered to dense (gather not
timed), torch flex_attention with a paged block mask, FlashInfer (tensor-core decode,
paged prefill, MLA fa3) and FlashMLA (sgl-flash-mla, legacy SM90 dense path). ``relerr``
is each output's relative Frobenius distance to pagedkv's triton output for that shape.

Usage: python benchmarks/attention.py [--quick] [--only gqa|mla] [--out FILE.md] [--graphs] [--gluon]
(pagedkv's rows, and the GQA peers, also timed as CUDA-graph replays: no host launch path)
GQA options: [--sweep full|small|none] (launch-config sweeps) [--no-draft-peers]
[--gqa-shapes BxCTX[xPAGE],...] (only these bf16 q1 decode shapes, default config and peers:
no sweep, no compared variants); the GQA part ends with the issue's GQA targets computed from the same run, per timing mode.
[--fp8-peers]: only pagedkv, FlashInfer and FlashMLA with bf16 and fp8 (e4m3) caches on issue
10's fp8 shapes (GQA B64 ctx8K/32K p16, MLA h16 B64 ctx8K p64, q1), relerr against float64,
ending with each fp8 row against its own bf16 call and pagedkv's fp8 row (benchmarks/fp8_peers.py).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import sys
import time
import traceback

import torch
import triton

from pagedkv.ops import Mask
from pagedkv.ops.triton import mla_gluon
from pagedkv.ops.triton.attention import paged_attention
from pagedkv.ops.triton.cache_write import write_mla_latent
from pagedkv.ops.triton.mla import paged_mla_latent

ROWS: list[tuple] = []
COPY_GBS = [0.0]
TUNED: dict[str, dict | None] = {"gqa": {}, "gqa_q7": None, "gqa_fp8": {}, "mla": {}}  # best launch config of each family's sweep


def sweep(family: str, case: str, run, grid: list[dict], ref: torch.Tensor | None = None) -> None:
    """Time each launch config on this case; the fastest becomes TUNED[family]. With ``ref``
    each config's output is also compared with it (relerr printed)."""
    best = None
    for cfg in grid:
        try:
            out = run(**cfg)
            err = f", relerr {relerr(out, ref):.1e}" if ref is not None else ""
            us = 1e3 * triton.testing.do_bench(lambda cfg=cfg: run(**cfg), warmup=5, rep=20,
                                               return_mode="median")
        except Exception as exc:
            print(f"# sweep {case} {cfg}: failed ({type(exc).__name__}: {str(exc)[:160]})", flush=True)
            continue
        print(f"# sweep {case} {cfg}: {us:.1f} us{err}", flush=True)
        if best is None or us < best[0]:
            best = (us, cfg)
    if best:
        TUNED[family] = best[1]
        print(f"# sweep {case}: best {best[1]} {best[0]:.1f} us", flush=True)


def host_us(fn, calls: int = 50) -> float:
    """Host microseconds per eager call (enqueue only: 50 calls stay far below the launch
    queue's depth, so the host is not held back by the device)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * host / calls


def record_graphed(case: str, name: str, fn, nbytes: int, flops: float) -> None:
    """The host time of one eager call (is the eager row host-bound?), then ``record_graph``."""
    print(f"# {case} {name}: host {host_us(fn):.1f} us per eager call", flush=True)
    record_graph(case, name, fn, nbytes, flops)


def config_name(cfg: dict) -> str:
    return "pagedkv_triton[" + ",".join(f"{k}={v}" for k, v in cfg.items()) + "]"


def tuned_name(family: str) -> str:
    return config_name(TUNED[family])


def bench(fn) -> float:
    """Median microseconds (lower of two medians)."""
    return 1e3 * min(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
                     for _ in range(2))


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().reshape(-1), b.float().reshape(-1)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def record(case: str, name: str, fn, nbytes: int, ref: torch.Tensor | None, flops: float = 0.0):
    try:
        out = fn()
        torch.cuda.synchronize()
        err = relerr(out, ref) if ref is not None else float("nan")
        us = bench(fn)
    except Exception as exc:  # a peer that does not load or refuses the shape
        print(f"# {case} {name}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})",
              flush=True)
        return None
    gbs = nbytes / us / 1e3
    row = (case, name, us, nbytes / 1e6, gbs, 100 * gbs / COPY_GBS[0], flops / us / 1e6, err)
    ROWS.append(row)
    print("%-30s %-34s %9.1f %8.0f %7.0f %6.1f %7.1f %8.1e" % row, flush=True)
    return out


GLUON = [False]  # --gluon: MLA bf16 also with gluon=False / True and other splits
# (PAGEDKV_BENCH_GLUON_VARIANTS: a comma list of the 64-row variants to time, default the
# first Gluon kernel and the current default, mla_gluon.ROWS_VARIANTS lists them all)
GLUON_VARIANTS = [{"gluon": False}] + [
    {"gluon": v} for v in os.environ.get("PAGEDKV_BENCH_GLUON_VARIANTS",
                                         "serial,pingpong_halves").split(",") if v]
# PAGEDKV_BENCH_MLA_FAMILIES: a comma list of the MLA families to run (mla_q1, mla_rows,
# mla_h128, mla_ds, mla_fp8; default all)
MLA_FAMILIES = [f for f in os.environ.get("PAGEDKV_BENCH_MLA_FAMILIES", "").split(",") if f]
# --gluon, MLA fp8: after the e4m3 kernel as it is (mla_gluon.FP8_VARIANTS), the same kernel
# at other ring depths and splits (PAGEDKV_BENCH_E4M3: a comma list of stages:splits, splits
# 0 = the default)


def _e4m3_form(spec: str) -> tuple[dict, int]:
    if spec.count(":") != 1:
        raise SystemExit(f"PAGEDKV_BENCH_E4M3 entry {spec!r}: stages:splits (the stacked and "
                         "warpgroups fields went with the deleted forms)")
    st, sp = spec.split(":")
    return {"gluon": "e4m3", **({"splits": int(sp)} if int(sp) else {})}, int(st)


E4M3_SWEEP = [_e4m3_form(x) for x in os.environ.get(
    "PAGEDKV_BENCH_E4M3", "2:0,3:4").split(",") if x]


@contextlib.contextmanager
def kernel_switches(module, plans: dict, **values):
    """``module``'s switches set to ``values`` for the block, the kept launch plans
    ``plans`` dropped before and after (their keys do not hold these switches)."""
    kept = {k: getattr(module, k) for k in values}
    plans.clear()
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in kept.items():
            setattr(module, k, v)
        plans.clear()


def e4m3_form(stages: int | None):
    """The e4m3 MLA kernel's ring slots set to ``stages`` (None: as they are) for the
    block."""
    from pagedkv.ops.triton import mla as triton_mla
    from pagedkv.ops.triton import mla_gluon_e4m3 as e4

    return kernel_switches(e4, triton_mla._GLUON_PLANS, STAGES=stages or e4.STAGES)


GRAPHS = [False]  # --graphs: rows also timed as CUDA-graph replays (no host launch path)


def graph_bench(fn) -> float:
    """Median microseconds of replaying ``fn`` captured in a CUDA graph (lower of two medians):
    the device time without the host's launch path, which a short kernel can hide behind."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay)


def record_graph(case: str, name: str, fn, nbytes: int, flops: float = 0.0) -> float | None:
    try:
        us = graph_bench(fn)
    except Exception as exc:
        print(f"# {case} {name}[graph]: skipped ({type(exc).__name__}: "
              f"{str(exc).splitlines()[0][:120] if str(exc) else ''})", flush=True)
        return None
    gbs = nbytes / us / 1e3
    row = (case, name + "[graph]", us, nbytes / 1e6, gbs, 100 * gbs / COPY_GBS[0], flops / us / 1e6,
           float("nan"))
    ROWS.append(row)
    print("%-30s %-34s %9.1f %8.0f %7.0f %6.1f %7.1f %8.1e" % row, flush=True)
    return us


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = bench(lambda: dst.copy_(src))
    return 2 * (1 << 31) / us / 1e3


# ---------------------------------------------------------------- GQA
GQA_TIMES: dict[tuple, dict[str, float]] = {}  # (batch, ctx, q_len, causal, page, fp8) -> name -> us


def gqa_inputs(batch, ctx, q_len, page=16, hq=32, hkv=8, dim=128):
    dev = "cuda"
    nblk = ctx // page
    pages = batch * nblk
    table = torch.randperm(pages, device=dev, dtype=torch.int32).view(batch, nblk)
    k = torch.randn(pages, page, hkv, dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn(pages, page, hkv, dim, device=dev, dtype=torch.bfloat16)
    q = torch.randn(batch * q_len, hq, dim, device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(0, batch * q_len + 1, q_len, device=dev, dtype=torch.int32)
    lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    return q, k, v, qsl, lens, table


def to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    s = float(x.abs().amax()) / 448
    return (x.float() / s).to(torch.float8_e4m3fn), s


# candidates around the defaults (``maxnreg`` caps registers: more programs per SM; ``swap``
# keys on the MMA's M side; ``fused`` the last split merges; ``heads_first`` the grid order);
# registers and shared memory of each: compiled for sm_90 on the CPU (docs/kernels-log.md)
GQA_SMALL_GRIDS = {
    "gqa": [{}, dict(maxnreg=96), dict(maxnreg=0), dict(page_tiles=False)],
    "gqa_q7": [{}, dict(page_tiles=False), dict(maxnreg=0)],
    "gqa_fp8": [{}, dict(widen=True), dict(widen=True, block_n=64, num_stages=3, maxnreg=128),
                dict(widen=True, block_n=64, num_stages=3)],
}
# variants timed on every shape of their family next to the default (same-run before/after)
GQA_COMPARE = {
    "gqa": [dict(page_tiles=False), dict(splits=1), dict(splits=2)],
    "gqa_q7": [dict(page_tiles=False)],
    "gqa_fp8": [dict(widen=True)],
}


def gqa_sweep(batch, ctx, q_len=1, page=16, fp8=False, splits_only=False, small=False) -> None:
    """Launch-config sweep of the decode kernel on one shape (printed; the fastest config of
    the sweep on each kind of shape becomes TUNED[gqa | gqa_q7 | gqa_fp8])."""
    q, k, v, qsl, lens, table = gqa_inputs(batch, ctx, q_len, page)
    kw = dict(max_query_len=q_len, max_seq_len=ctx)
    if fp8:
        k, ks = to_fp8(k)
        v, vs = to_fp8(v)
        kw.update(k_scale=ks, v_scale=vs)
    if q_len > 1:
        kw["mask"] = Mask(causal=False, draft_block=q_len)
    case = f"gqa B{batch} ctx{ctx} q{q_len}{'nc' if q_len > 1 else ''} p{page}{' fp8' if fp8 else ''}"
    family = "gqa_fp8" if fp8 else ("gqa_q7" if q_len > 1 else "gqa")
    run = lambda **c: paged_attention(q, k, v, qsl, lens, table, **kw, **c)  # noqa: E731
    if small:
        grid = GQA_SMALL_GRIDS[family]
    elif splits_only:
        base = dict(TUNED.get(family) or {})
        base.pop("splits", None)
        grid = [dict(base, splits=sp) for sp in (None, 1, 2, 4, 8, 16, 32)]
        grid += [dict(base, splits=sp, fused=True) for sp in (None, 4)]
    else:
        grid = [dict(block_n=bn, num_warps=w, num_stages=st)
                for bn in ((64, 128, 256) if fp8 else (32, 64, 128))
                for w in ((4, 8) if fp8 else (2, 4, 8)) for st in (2, 3)]
    saved = dict(TUNED.get(family) or {})
    sweep(family, case, run, grid)
    if splits_only:  # report only; keep the kernel config chosen on the main shape
        TUNED[family] = saved


def gqa_case(batch, ctx, q_len, causal, page=16, hq=32, hkv=8, dim=128, fp8=False, peers=True,
             flex=False, do_sweep=False):
    case = f"gqa B{batch} ctx{ctx} q{q_len}{'' if q_len == 1 else ('c' if causal else 'nc')}" \
           f" p{page}{' fp8' if fp8 else ''}"
    q, k, v, qsl, lens, table = gqa_inputs(batch, ctx, q_len, page, hq, hkv, dim)
    dev = "cuda"
    nblk = ctx // page
    pages = batch * nblk
    mask = Mask() if causal else Mask(causal=False, draft_block=q_len)
    scale = dim ** -0.5
    elt = 1 if fp8 else 2
    nbytes = 2 * batch * ctx * hkv * dim * elt
    flops = 4.0 * batch * q_len * hq * ctx * dim
    kw = dict(mask=mask, max_query_len=q_len, max_seq_len=ctx)
    times = GQA_TIMES.setdefault((batch, ctx, q_len, causal, page, fp8), {})

    def rec(name, fn, ref):
        out = record(case, name, fn, nbytes, ref, flops)
        if out is not None:
            times[name] = ROWS[-1][2]
            if GRAPHS[0]:
                us = record_graph(case, name, fn, nbytes, flops)
                if us is not None:
                    times[name + "[graph]"] = us
        return out

    if fp8:
        k8, ks = to_fp8(k)
        v8, vs = to_fp8(v)
        # reference: the bf16 kernel on the dequantized cache (what the fp8 cache holds)
        ref = paged_attention(q, (k8.float() * ks).to(torch.bfloat16), (v8.float() * vs).to(torch.bfloat16),
                              qsl, lens, table, **kw)
        del k, v
        rec("pagedkv_triton", lambda: paged_attention(q, k8, v8, qsl, lens, table, k_scale=ks,
                                                      v_scale=vs, **kw), ref)
        cfgs = [TUNED["gqa_fp8"]] if TUNED.get("gqa_fp8") else []
        for cfg in cfgs + [c for c in GQA_COMPARE["gqa_fp8"] if c not in cfgs]:
            rec(config_name(cfg), lambda cfg=cfg: paged_attention(
                q, k8, v8, qsl, lens, table, k_scale=ks, v_scale=vs, **kw, **cfg), ref)
        return ref
    ours = lambda: paged_attention(q, k, v, qsl, lens, table, **kw)  # noqa: E731
    ref = ours()
    rec("pagedkv_triton", ours, ref)
    family = "gqa_q7" if q_len > 1 and TUNED["gqa_q7"] is not None else "gqa"
    cfgs = [TUNED[family]] if TUNED[family] else []
    for cfg in cfgs + [c for c in GQA_COMPARE["gqa_q7" if q_len > 1 else "gqa"] if c not in cfgs]:
        rec(config_name(cfg), lambda cfg=cfg: paged_attention(q, k, v, qsl, lens, table, **kw, **cfg), ref)
    if not peers:
        return ref
    group = hq // hkv
    # SDPA on gathered dense K/V, query heads of one KV head (x q_len) folded into the rows
    kd = k[table.long()].reshape(batch, ctx, hkv, dim).transpose(1, 2).contiguous()
    vd = v[table.long()].reshape(batch, ctx, hkv, dim).transpose(1, 2).contiguous()
    qd = q.view(batch, q_len, hkv, group, dim).permute(0, 2, 1, 3, 4).reshape(batch, hkv, q_len * group, dim)

    def unfold(o):
        return o.view(batch, hkv, q_len, group, dim).permute(0, 2, 1, 3, 4).reshape(batch * q_len, hq, dim)

    if q_len == 1 or not causal:  # every query row sees every key
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION):
            def sdpa(backend=backend):
                with sdpa_kernel(backend):
                    return unfold(torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, scale=scale))
            rec(f"torch_sdpa_dense[{backend.name.split('_')[0].lower()}]", sdpa, ref)

    try:
        import flashinfer
    except Exception as exc:
        print(f"# flashinfer does not load: {exc}", flush=True)
        flashinfer = None
    if flashinfer is not None:
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        indptr = torch.arange(0, pages + 1, nblk, device=dev, dtype=torch.int32)
        indices = table.reshape(-1)
        last = torch.full((batch,), page, device=dev, dtype=torch.int32)
        if q_len == 1:
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
            try:
                w.plan(indptr, indices, last, hq, hkv, dim, page, q_data_type=torch.bfloat16,
                       kv_data_type=torch.bfloat16, sm_scale=scale)
                rec("flashinfer_decode_tc", lambda: w.run(q, (k, v)), ref)
            except Exception:
                traceback.print_exc()
        else:
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            try:
                w.plan(qsl, indptr, indices, last, hq, hkv, dim, page, causal=causal,
                       sm_scale=scale, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
                rec("flashinfer_prefill_paged", lambda: w.run(q, (k, v)), ref)
            except Exception:
                traceback.print_exc()
    if flex:
        flex_case(case, q, k, v, table, ctx, q_len, page, scale, nbytes, ref, flops, causal)
    return ref


# the Gluon fp8 kernel's sweep: splits, then ring depth against registers (programs per SM:
# 2 stages x 64 registers: 4; 3 x 80: 3; 4 x 128: 2)
GLUON_CONFIGS = [dict(gluon=True, splits=sp) for sp in (1, 2, 4)] + [
    dict(gluon=True, splits=1, num_stages=st, maxnreg=r) for st, r in ((2, 80), (3, 80), (4, 128))]


def fp8_gluon_case(batch, ctx, page=16, hq=32, hkv=8, dim=128, q_len=1) -> None:
    """bf16 cache vs fp8 (e4m3, per-tensor scales) with the Triton kernel and with the Gluon
    kernel (``gluon=True``, its defaults, then ``GLUON_CONFIGS``), one shape, same run; prints
    each fp8 row's speed-up over the bf16 row (eager, and CUDA-graph replays with --graphs).
    ``q_len`` > 1: a non-causal draft block of that many tokens per request."""
    q, k, v, qsl, lens, table = gqa_inputs(batch, ctx, q_len, page, hq, hkv, dim)
    kw = dict(max_query_len=q_len, max_seq_len=ctx)
    if q_len > 1:
        kw["mask"] = Mask(causal=False, draft_block=q_len)
    flops = 4.0 * batch * q_len * hq * ctx * dim
    times = {}

    def rec(case, name, fn, nbytes, ref):
        out = record(case, name, fn, nbytes, ref, flops)
        if out is not None:
            times[(case, name)] = ROWS[-1][2]
            if GRAPHS[0]:
                us = record_graph(case, name, fn, nbytes, flops)
                if us is not None:
                    times[(case, name + "[graph]")] = us

    base = f"gqa B{batch} ctx{ctx} q{q_len}{'nc' if q_len > 1 else ''} p{page}"
    nb16 = 2 * batch * ctx * hkv * dim * 2
    rec(base, "pagedkv_triton", lambda: paged_attention(q, k, v, qsl, lens, table, **kw), nb16, None)
    k8, ks = to_fp8(k)
    v8, vs = to_fp8(v)
    ref = paged_attention(q, (k8.float() * ks).to(torch.bfloat16),
                          (v8.float() * vs).to(torch.bfloat16), qsl, lens, table, **kw)
    case = base + " fp8"
    f8 = dict(kw, k_scale=ks, v_scale=vs)
    for cfg in [dict(gluon=False), dict(gluon=True)] + GLUON_CONFIGS:
        rec(case, config_name(cfg), lambda cfg=cfg: paged_attention(
            q, k8, v8, qsl, lens, table, **f8, **cfg), nb16 // 2, ref)
    for mode in ("", "[graph]"):
        b16 = times.get((base, "pagedkv_triton" + mode))
        if b16 is None:
            continue
        for (c, name), us in times.items():
            if c == case and name.endswith("[graph]") == (mode == "[graph]"):
                print(f"# {case} {name}: {b16 / us:.2f}x the bf16 kernel ({b16:.1f} us)", flush=True)


def same_mode(times: dict[str, float], graph: bool) -> dict[str, float]:
    return {n: u for n, u in times.items() if n.endswith("[graph]") == graph}


def gqa_targets() -> list[str]:
    """The issue's GQA targets from this run's timings (ours = faster of default and tuned)."""
    def ours(t):
        us = [v for n, v in t.items() if n.startswith("pagedkv_triton")]
        return min(us) if us else None

    lines = ["| target | timing | shape | measured | ratio | met |", "|---|---|---|---|---:|---|"]
    runs = [(key, graph, same_mode(times, graph)) for key, times in GQA_TIMES.items()
            for graph in (False, True)]
    for (b, ctx, ql, causal, page, fp8), graph, t in runs:
        if not t:
            continue
        mode = "graph" if graph else "events"  # ratios only between rows of one timing mode
        peers = {n: v for n, v in t.items() if not n.startswith("pagedkv_triton")}
        mine = ours(t)
        if ql == 1 and not fp8 and peers and mine:
            name, best = min(peers.items(), key=lambda kv: kv[1])
            r = best / mine
            lines.append(f"| decode >= 0.95x best peer | {mode} | B{b} ctx{ctx} p{page} | {mine:.1f} us vs "
                         f"{name} {best:.1f} us | {r:.3f}x | {'yes' if r >= 0.95 else 'no'} |")
        if ql > 1 and not causal and not fp8 and mine:
            one = ours(same_mode(GQA_TIMES.get((b, ctx, 1, True, page, False), {}), graph))
            if one:
                r = mine / one
                lines.append(f"| q{ql} non-causal <= 1.1x q1 | {mode} | B{b} ctx{ctx} p{page} | {mine:.1f} / "
                             f"{one:.1f} us | {r:.3f}x | {'yes' if r <= 1.1 else 'no'} |")
        if fp8 and mine:
            bf = ours(same_mode(GQA_TIMES.get((b, ctx, ql, causal, page, False), {}), graph))
            if bf:
                r = bf / mine
                lines.append(f"| fp8 >= 1.6x bf16 throughput | {mode} | B{b} ctx{ctx} p{page} | {mine:.1f} vs "
                             f"{bf:.1f} us | {r:.3f}x | {'yes' if r >= 1.6 else 'no'} |")
    return lines


def flex_case(case, q, k, v, table, ctx, q_len, page, scale, nbytes, ref, flops, causal):
    """flex_attention over the whole physical pool with a mask that follows the page table."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    batch, nblk = table.shape
    pages, _, hkv, dim = k.shape
    owner = torch.empty(pages, dtype=torch.int32, device="cuda")
    logical = torch.empty(pages, dtype=torch.int32, device="cuda")
    owner[table.reshape(-1).long()] = torch.arange(batch, device="cuda", dtype=torch.int32).repeat_interleave(nblk)
    logical[table.reshape(-1).long()] = torch.arange(nblk, device="cuda", dtype=torch.int32).repeat(batch)

    def mask_mod(b, h, q_idx, kv_idx):
        pg = kv_idx // page
        seq = q_idx // q_len
        pos = logical[pg] * page + kv_idx % page
        qpos = ctx - q_len + q_idx % q_len
        return (owner[pg] == seq) & ((pos <= qpos) if causal else (pos < ctx))

    try:
        bm = create_block_mask(mask_mod, 1, None, batch * q_len, pages * page, device="cuda")
        kf = k.view(1, pages * page, hkv, dim).transpose(1, 2)
        vf = v.view(1, pages * page, hkv, dim).transpose(1, 2)
        qf = q.view(1, batch * q_len, -1, dim).transpose(1, 2)
        fn = torch.compile(flex_attention)
        record(case, "torch_flex_paged_mask",
               lambda: fn(qf, kf, vf, block_mask=bm, scale=scale, enable_gqa=True)
               .transpose(1, 2).reshape(batch * q_len, -1, dim), nbytes, ref, flops)
    except Exception:
        traceback.print_exc()


# ---------------------------------------------------------------- MLA
def mla_grid(rows: int, fp8: bool) -> list[dict]:
    """Launch configs swept per MLA shape family (rows = q_len x heads per request): the
    pointer kernel (per-tile addresses, optionally transposed scores) and the TMA kernel
    (``num_stages`` 3 also prefetches the page ids; 1 is refused: see docs/kernels-log.md)."""
    def cfg(bm, bn, w, st, tma, swap=False, splits=1):
        return dict(block_m=bm, block_n=bn, dv_splits=1, num_warps=w, num_stages=st, tma=tma,
                    swap=swap, splits=splits)
    if rows <= 32:
        if fp8:
            return [cfg(16, 32, 4, 2, False, splits=4), cfg(16, 32, 4, 3, False, splits=4),
                    cfg(16, 32, 8, 3, True, True, splits=4)]
        return [cfg(16, 64, 4, 2, True, True, splits=2), cfg(16, 64, 4, 2, True, True, splits=4),
                cfg(16, 64, 4, 3, True, True, splits=2), cfg(16, 64, 4, 3, True, True, splits=4)]
    return [cfg(64, 64, 8, 2, True), cfg(64, 64, 8, 2, True, splits=2)]


def mla_case(batch, ctx, heads, q_len, causal, page=64, fmt="bf16", peers=True, family=None,
             do_sweep=False, graph=False):
    """``family``: which TUNED entry this shape uses (swept here when ``do_sweep``);
    ``graph``: also time pagedkv's rows as CUDA-graph replays."""
    if MLA_FAMILIES and family not in MLA_FAMILIES:
        return None
    dev = "cuda"
    rank, rope = 512, 64
    case = f"mla B{batch} ctx{ctx} h{heads} q{q_len}{'' if q_len == 1 else ('c' if causal else 'nc')}" \
           f"{'' if fmt == 'bf16' else ' ' + fmt}"
    nblk = ctx // page
    pages = batch * nblk
    table = torch.randperm(pages, device=dev, dtype=torch.int32).view(batch, nblk)
    latent = torch.randn(pages, page, rank + rope, device=dev, dtype=torch.bfloat16)
    q_lat = torch.randn(batch * q_len, heads, rank, device=dev, dtype=torch.bfloat16)
    q_rope = torch.randn(batch * q_len, heads, rope, device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(0, batch * q_len + 1, q_len, device=dev, dtype=torch.int32)
    lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    mask = Mask() if causal else Mask(causal=False, draft_block=q_len)
    scale = 1 / math.sqrt(192)
    flops = 2.0 * batch * q_len * heads * ctx * (576 + 512)
    # no host read-back of the out-of-cache flag (as inside a captured decode step)
    kw = dict(scale=scale, mask=mask, max_query_len=q_len, max_seq_len=ctx, check_blocks=False)
    family = family or f"mla_{case}"
    ref = paged_mla_latent(q_lat, q_rope, latent, qsl, lens, table, **kw)
    if fmt == "fp8_ds_mla":
        cache = torch.empty(pages, page, 656, device=dev, dtype=torch.uint8)
        slots = torch.arange(pages * page, device=dev)
        flat = latent.view(-1, rank + rope)
        write_mla_latent(flat[:, :rank], flat[:, rank:], cache, slots)
        extra, nbytes = {}, batch * ctx * 656
    elif fmt == "fp8":
        ls = float(latent.abs().amax()) / 448
        cache = (latent.float() / ls).to(torch.float8_e4m3fn)
        extra, nbytes = {"latent_scale": ls}, batch * ctx * 576
    else:
        cache, extra, nbytes = latent, {}, batch * ctx * 576 * 2
    if fmt != "bf16":
        del latent
        # relerr of fp8 rows: against the bf16 kernel on the unquantized latent (storage error)

    def run(**c):
        return paged_mla_latent(q_lat, q_rope, cache, qsl, lens, table, **kw, **extra, **c)

    record(case, "pagedkv_triton", run, nbytes, ref, flops)
    if do_sweep:
        sweep(family, case, run, mla_grid(q_len * heads, fmt != "bf16"), ref)
    if TUNED.get(family):
        record(case, tuned_name(family), lambda: run(**TUNED[family]), nbytes, ref, flops)
    if graph:
        record_graphed(case, "pagedkv_triton", run, nbytes, flops)
        if TUNED.get(family):
            record_graphed(case, tuned_name(family), lambda: run(**TUNED[family]), nbytes, flops)
    if fmt == "bf16" and GLUON[0]:  # Triton kernels forced, each 64-row Gluon variant
        if graph:  # the eager host path without the kept launch plan (rebuilt every call)
            from pagedkv.ops.triton import mla as triton_mla

            def cold():
                triton_mla._GLUON_PLANS.clear()
                return run()
            print(f"# {case} pagedkv_triton plan rebuilt every call: host {host_us(cold):.1f} us "
                  "per eager call", flush=True)
        for over in GLUON_VARIANTS:
            name = config_name(over)
            fn = lambda over=over: run(**over)  # noqa: E731
            if record(case, name, fn, nbytes, ref, flops) is not None and graph:
                record_graphed(case, name, fn, nbytes, flops)
    if fmt == "fp8" and GLUON[0]:  # the e4m3 Gluon kernel by name, then its sweep
        for over, stages in [({"gluon": v}, None) for v in mla_gluon.FP8_VARIANTS] + E4M3_SWEEP:
            name = config_name(over) + (f"[stages={stages}]" if stages else "")
            fn = lambda over=over: run(**over)  # noqa: E731
            with e4m3_form(stages):
                if record(case, name, fn, nbytes, ref, flops) is not None and graph:
                    record_graphed(case, name, fn, nbytes, flops)
    if fmt == "fp8_ds_mla" and GLUON[0]:  # the Triton kernel (the Gluon one is the default row)
        fn = lambda: run(gluon=False)  # noqa: E731
        if record(case, config_name({"gluon": False}), fn, nbytes, ref, flops) is not None \
                and graph:
            record_graphed(case, config_name({"gluon": False}), fn, nbytes, flops)
    if not peers or fmt != "bf16":
        return ref
    try:
        import flashinfer
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend="fa3")
        kv_indptr = torch.arange(0, pages + 1, nblk, device=dev, dtype=torch.int32)
        w.plan(qsl, kv_indptr, table.reshape(-1), lens, heads, rank, rope, page, causal, scale,
               torch.bfloat16, torch.bfloat16)
        ckv, kpe = latent[..., :rank], latent[..., rank:]
        record(case, "flashinfer_mla[fa3]", lambda: w.run(q_lat, q_rope, ckv, kpe), nbytes,
               ref.to(torch.bfloat16), flops)
    except Exception:
        traceback.print_exc()
    try:
        import flash_mla
        qf = torch.cat([q_lat, q_rope], -1).view(batch, q_len, heads, rank + rope)
        kc = latent.view(pages, page, 1, rank + rope)
        meta, _ = flash_mla.get_mla_metadata()

        def fmla():
            return flash_mla.flash_mla_with_kvcache(qf, kc, table, lens, rank, meta, softmax_scale=scale,
                                                    causal=causal, use_legacy=True)[0].view(-1, heads, rank)
        record(case, "flashmla_legacy_dense", fmla, nbytes, ref.to(torch.bfloat16), flops)
    except Exception:
        traceback.print_exc()
    return ref


def mla_summary() -> None:
    """Each MLA case: pagedkv's best row against the best peer of the same run, and the
    draft-block / fp8 rows against the same kernel's bf16 q1 time."""
    best: dict[tuple[str, bool], float] = {}
    for case, name, us, *_ in ROWS:
        if case.startswith("mla") and not name.endswith("[graph]"):  # eager rows, as the peers
            key = (case, name.startswith("pagedkv"))
            best[key] = min(us, best.get(key, us))
    q1 = {c: us for (c, ours), us in best.items() if ours}
    print("# MLA summary (pagedkv best us / best peer us; vs the bf16 h16 q1 kernel)")
    for (case, ours), us in sorted(best.items()):
        if not ours:
            continue
        peer = best.get((case, False))
        base = next((v for c, v in q1.items() if c.endswith(" q1") and
                     c.split(" h")[1].split(" ")[0] == case.split(" h")[1].split(" ")[0]
                     and c.split(" ")[1] == case.split(" ")[1] and c.split(" ")[2] == case.split(" ")[2]),
                    None)
        print(f"#   {case:34s} {us:8.1f} us" + (f"  peer {peer:8.1f} us  ratio {peer / us:5.2f}x" if peer else "")
              + (f"  / own bf16 q1 {us / base:5.2f}x" if base else ""), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--out", help="also write the markdown table here")
    parser.add_argument("--only", choices=["gqa", "mla"], help="one family only")
    parser.add_argument("--no-mla-sweep", action="store_true", help="MLA: launch defaults only")
    parser.add_argument("--gluon", action="store_true",
                        help="MLA bf16: also gluon=False (Triton kernels) and each 64-row Gluon "
                             "variant; MLA fp8: also the e4m3 Gluon kernel by name and its "
                             "sweep (PAGEDKV_BENCH_E4M3); MLA fp8_ds_mla: also the Triton kernel "
                             "(gluon=False)")
    parser.add_argument("--flex", action="store_true", help="also torch flex_attention (compiles)")
    parser.add_argument("--sweep", choices=["full", "small", "none"], default="full",
                        help="GQA launch-config sweeps: full grid + splits, a few candidates, or none")
    parser.add_argument("--graphs", "--graph", action="store_true",
                        help="also time pagedkv's rows (and GQA peers) as CUDA-graph replays: no "
                             "host launch path; MLA rows also print one eager call's host time")
    parser.add_argument("--no-draft-peers", action="store_true",
                        help="GQA: time no peers on the 7-token shapes")
    parser.add_argument("--gqa-shapes", help="GQA: only these bf16 q1 decode shapes, e.g. "
                        "64x1024,256x1024,64x4096x64 (batch x context [x page]), with peers")
    parser.add_argument("--fp8-peers", action="store_true",
                        help="only bf16 vs fp8 caches for pagedkv, FlashInfer and FlashMLA on the fp8 "
                             "target's shapes (benchmarks/fp8_peers.py)")
    parser.add_argument("--fp8-gluon", help="only bf16 vs fp8 Triton vs fp8 Gluon decode rows "
                        "on these shapes, e.g. 64x8192,64x32768 (batch x context [x page])")
    parser.add_argument("--fp8-q-len", type=int, default=1,
                        help="--fp8-gluon: query tokens per request (> 1: a non-causal draft "
                             "block of that many)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("pagedkv: error: benchmarks/attention.py needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    GRAPHS[0] = args.graphs
    GLUON[0] = args.gluon
    fp8_peers = prepared = None
    if args.fp8_peers:  # inputs, float64 references and compiles before any timing
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import fp8_peers
        prepared = fp8_peers.prepare(sys.modules[__name__])
    COPY_GBS[0] = copy_bandwidth()
    dev = torch.cuda.get_device_name()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# {dev}, torch {torch.__version__}, triton {triton.__version__}, {stamp}")
    print(f"# device copy {COPY_GBS[0]:.0f} GB/s (read + write)")
    print("%-30s %-34s %9s %8s %7s %6s %7s %8s" % ("case", "kernel", "us", "KV MB", "GB/s", "%copy",
                                                 "TF/s", "relerr"))
    peer_lines: list[str] = []
    if prepared is not None:
        peer_lines = fp8_peers.time_rows(prepared)
    elif args.fp8_gluon:
        for spec in args.fp8_gluon.split(","):
            b, c, *p = (int(x) for x in spec.split("x"))
            fp8_gluon_case(b, c, page=p[0] if p else 16, q_len=args.fp8_q_len)
    elif args.gqa_shapes and args.only != "mla":
        GQA_COMPARE["gqa"] = []
        for spec in args.gqa_shapes.split(","):
            b, c, *p = (int(x) for x in spec.split("x"))
            gqa_case(b, c, 1, True, page=p[0] if p else 16)
    elif args.only != "mla":
        if args.sweep == "small":
            gqa_sweep(64, 4096, small=True)
            gqa_sweep(64, 4096, q_len=7, small=True)
            gqa_sweep(64, 8192, fp8=True, small=True)
            for b, c in ((64, 1024), (256, 1024)):
                gqa_sweep(b, c, splits_only=True)
        if args.sweep == "full":
            gqa_sweep(64, 4096)
            gqa_sweep(64, 8192, fp8=True)
            if not args.quick:
                for b, c in ((64, 1024), (256, 1024), (256, 4096), (64, 32768)):
                    gqa_sweep(b, c, splits_only=True)
        gqa_case(64, 4096, 1, True, flex=args.flex)
        if not args.quick:
            gqa_case(64, 1024, 1, True)
            gqa_case(256, 1024, 1, True)
            gqa_case(256, 4096, 1, True)
            gqa_case(64, 32768, 1, True)
            gqa_case(64, 4096, 1, True, page=64)
        gqa_case(64, 4096, 7, True, peers=not args.no_draft_peers)
        gqa_case(64, 4096, 7, False, peers=not args.no_draft_peers)
        gqa_case(64, 8192, 1, True, peers=not args.quick)
        gqa_case(64, 8192, 1, True, fp8=True)
        if not args.quick:
            gqa_case(64, 32768, 1, True, fp8=True)
    if args.only != "gqa" and not args.fp8_gluon and prepared is None:
        sw = not args.no_mla_sweep
        mla_case(64, 8192, 16, 1, True, family="mla_q1", do_sweep=sw, graph=args.graphs)
        mla_case(64, 8192, 16, 7, False, family="mla_rows", do_sweep=sw, graph=args.graphs)
        mla_case(64, 8192, 16, 7, True, family="mla_rows", graph=args.graphs)
        mla_case(64, 8192, 128, 1, True, family="mla_h128", do_sweep=sw, graph=args.graphs)
        mla_case(64, 8192, 16, 1, True, fmt="fp8_ds_mla", family="mla_ds", do_sweep=sw, graph=args.graphs)
        mla_case(64, 8192, 16, 1, True, fmt="fp8", family="mla_fp8", do_sweep=sw, graph=args.graphs)
        if not args.quick:
            mla_case(64, 8192, 128, 7, False, family="mla_h128", graph=args.graphs)
            mla_case(128, 8192, 16, 1, True, family="mla_q1", graph=args.graphs)
        mla_summary()
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(f"{dev}, torch {torch.__version__}, triton {triton.__version__}, {stamp}; "
                     f"device copy {COPY_GBS[0]:.0f} GB/s\n\n")
            fh.write("| case | kernel | us | KV MB | GB/s | % copy | TF/s | relerr |\n")
            fh.write("|---|---|---:|---:|---:|---:|---:|---:|\n")
            for r in ROWS:
                fh.write("| %s | %s | %.1f | %.0f | %.0f | %.1f | %.1f | %.1e |\n" % r)
            if GQA_TIMES:
                fh.write("\n" + "\n".join(gqa_targets()) + "\n")
            if peer_lines:
                fh.write("\n" + "\n".join(peer_lines) + "\n")
    if peer_lines:
        print("\n".join(peer_lines))
    if GQA_TIMES:
        print("\n".join(gqa_targets()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
