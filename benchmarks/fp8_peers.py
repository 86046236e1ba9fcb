"""fp8 KV caches: what FlashInfer and FlashMLA reach against their own bf16 calls, next to pagedkv.

Issue 10 asks an fp8 cache for >= 1.6x the bf16 kernel's throughput; this measures what the
peers get on the same H200, shapes and run, so the target can be judged. Run through
``benchmarks/attention.py --fp8-peers`` (its timing, rows and GB/s). Caches are e4m3 with one
scale per tensor (amax / 448). Rows, bf16 and fp8 alike:

- GQA (B64, 32 q / 8 KV heads, dim 128, page 16, q_len 1, ctx 8K and 32K): pagedkv's default
  kernel (the Gluon e4m3 kernel for fp8); FlashInfer 0.6.18 ``BatchDecodeWithPagedKVCacheWrapper``
  with tensor cores (fa2 prefill kernel, bf16 query on the e4m3 cache), without (CUDA-core
  decode kernel), and with the fa3 backend, whose fp8 path takes an e4m3 query too.
- MLA (h16, B64, ctx 8K, page 64, q1): pagedkv's default kernel (per-tensor fp8 latent); FlashInfer
  ``BatchMLAPagedAttentionWrapper`` fa3 (bf16 query, ``ckv_scale`` / ``kpe_scale``); FlashMLA
  (sgl-flash-mla 1.0.0) legacy dense decode, whose fp8 kernel takes an e4m3 query.

Where a peer's fp8 call needs an e4m3 query it is quantized (per tensor) before the timer. relerr:
each output against a float64 reference over the cache that call reads (the dequantized e4m3
cache for fp8 rows) with the bf16 query, so a call that reads the cache wrong shows it.
FlashInfer's kernels are JIT-compiled in parallel (one ninja) while the references are computed:
on a fresh H200 machine (16 cores, MAX_JOBS=12) that build took 204 s (2026-12-04 13:12-13:15
UTC) and a 265 s limit ended that run before its first timed row: give a cold call more time.
``PAGEDKV_FP8_PEERS=mla`` (or ``gqa``) keeps one family's rows and builds only its modules.
"""

from __future__ import annotations

import math
import os
import threading
import time
import traceback

import torch

from pagedkv.ops import Mask
from pagedkv.ops.triton.attention import paged_attention
from pagedkv.ops.triton.mla import paged_mla_latent

BF16, E4M3, I32 = torch.bfloat16, torch.float8_e4m3fn, torch.int32
GQA_SHAPES = ((64, 8192), (64, 32768))
MLA_SHAPE = (64, 8192, 16)  # batch, context, heads
HQ, HKV, DIM, PAGE = 32, 8, 128, 16
RANK, ROPE, MLA_PAGE = 512, 64, 64
# which families to run ("gqa", "mla" or both): a cold machine builds only their modules
FAMILIES = tuple(os.environ.get("PAGEDKV_FP8_PEERS", "gqa,mla").split(","))


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """e4m3 with one scale for the tensor (amax / 448)."""
    s = float(x.abs().amax()) / 448
    return (x.float() / s).to(E4M3), s


def gather64(cache: torch.Tensor, table: torch.Tensor, scale: float) -> torch.Tensor:
    """The pages of ``table`` rows as float64, dequantized: (rows, keys, *entry)."""
    if cache.dtype == E4M3:  # index the bytes (not every index kernel takes fp8)
        pages = cache.view(torch.uint8)[table.long()].view(E4M3)
    else:
        pages = cache[table.long()]
    rows, nblk, page = pages.shape[:3]
    return pages.double().mul_(scale).reshape(rows, nblk * page, *cache.shape[2:])


def gqa_ref64(q, k, v, table, ks=1.0, vs=1.0, chunk=8) -> torch.Tensor:
    """Decode attention in float64 on the device, ``chunk`` requests at a time."""
    batch = table.shape[0]
    out = torch.empty(batch, HQ, DIM, dtype=torch.float64, device=q.device)
    for b in range(0, batch, chunk):
        kk = gather64(k, table[b:b + chunk], ks)  # (c, L, hkv, d)
        vv = gather64(v, table[b:b + chunk], vs)
        qq = q[b:b + chunk].double().view(-1, HKV, HQ // HKV, DIM)
        p = torch.softmax(torch.einsum("chgd,clhd->chgl", qq, kk) * DIM ** -0.5, -1)
        out[b:b + chunk] = torch.einsum("chgl,clhd->chgd", p, vv).reshape(-1, HQ, DIM)
    return out


def mla_ref64(q_lat, q_rope, latent, table, scale, ls=1.0, chunk=8) -> torch.Tensor:
    """Absorbed MLA decode in float64: scores over the 576-wide latent, values its first 512."""
    batch, heads = table.shape[0], q_lat.shape[1]
    out = torch.empty(batch, heads, RANK, dtype=torch.float64, device=q_lat.device)
    qf = torch.cat([q_lat, q_rope], -1).double()
    for b in range(0, batch, chunk):
        lat = gather64(latent, table[b:b + chunk], ls)  # (c, L, 576)
        p = torch.softmax(torch.einsum("chd,cld->chl", qf[b:b + chunk], lat) * scale, -1)
        out[b:b + chunk] = torch.einsum("chl,cld->chd", p, lat[..., :RANK])
    return out


def _flashinfer():
    try:
        import flashinfer
        return flashinfer
    except Exception as exc:
        print(f"# flashinfer does not load: {exc}", flush=True)
        return None


def _build(done: dict) -> None:
    """JIT-compile the FlashInfer modules the rows use, all in one parallel ninja run."""
    start = time.time()
    try:
        from flashinfer.jit import (
            build_jit_specs,
            gen_batch_decode_module,
            gen_batch_mla_module,
            gen_batch_prefill_module,
        )
        specs = []
        if "gqa" in FAMILIES:
            specs += [gen_batch_decode_module(BF16, kv, BF16, I32, DIM, DIM, 0, False, False)
                      for kv in (BF16, E4M3)]
            specs += [gen_batch_prefill_module("fa2", BF16, kv, BF16, I32, DIM, DIM, 0, False, False,
                                               False) for kv in (BF16, E4M3)]
            specs += [gen_batch_prefill_module("fa3", qd, qd, BF16, I32, DIM, DIM, 0, False, False, False)
                      for qd in (BF16, E4M3)]
        if "mla" in FAMILIES:
            specs += [gen_batch_mla_module("fa3", BF16, kv, BF16, I32, RANK, ROPE, False)
                      for kv in (BF16, E4M3)]
        build_jit_specs(specs)
    except Exception:
        traceback.print_exc()
    done["s"] = time.time() - start


def mla_case(batch: int, ctx: int, heads: int) -> dict:
    """Inputs (bf16 latent and its e4m3 copy, shuffled pages) and float64 references."""
    pages = batch * ctx // MLA_PAGE
    table = torch.randperm(pages, device="cuda", dtype=I32).view(batch, -1)
    latent = torch.randn(pages, MLA_PAGE, RANK + ROPE, device="cuda", dtype=BF16)
    lat8, ls = quantize(latent)
    q_lat = torch.randn(batch, heads, RANK, device="cuda", dtype=BF16)
    q_rope = torch.randn(batch, heads, ROPE, device="cuda", dtype=BF16)
    scale = 1 / math.sqrt(192)
    return dict(kind="mla", batch=batch, ctx=ctx, heads=heads, table=table, latent=latent,
                lat8=lat8, ls=ls, q_lat=q_lat, q_rope=q_rope, scale=scale,
                qsl=torch.arange(batch + 1, device="cuda", dtype=I32),
                lens=torch.full((batch,), ctx, device="cuda", dtype=I32),
                ref=mla_ref64(q_lat, q_rope, latent, table, scale),
                ref8=mla_ref64(q_lat, q_rope, lat8, table, scale, ls))


def prepare(att) -> dict:
    """Start the peers' JIT build, make inputs and float64 references, and call pagedkv's kernels
    once (Triton compiles) while it runs. ``att``: the benchmarks/attention.py module."""
    t0 = time.time()
    fi = _flashinfer()
    built: dict = {}
    thread = threading.Thread(target=_build, args=(built,)) if fi is not None else None
    if thread is not None:
        thread.start()
    cases = []
    for batch, ctx in GQA_SHAPES if "gqa" in FAMILIES else ():
        q, k, v, qsl, lens, table = att.gqa_inputs(batch, ctx, 1, PAGE, HQ, HKV, DIM)
        k8, ks = quantize(k)
        v8, vs = quantize(v)
        g = dict(kind="gqa", batch=batch, ctx=ctx, q=q, k=k, v=v, k8=k8, v8=v8, ks=ks, vs=vs, qsl=qsl,
                 lens=lens, table=table, ref=gqa_ref64(q, k, v, table),
                 ref8=gqa_ref64(q, k8, v8, table, ks, vs))
        cases.append(g)
    for batch, ctx, heads in (MLA_SHAPE,) if "mla" in FAMILIES else ():
        cases.append(mla_case(batch, ctx, heads))
    torch.cuda.synchronize()
    print(f"# inputs and float64 references: {time.time() - t0:.0f} s after the start", flush=True)
    for c in cases:  # first calls compile pagedkv's kernels
        for fp8 in (False, True):
            ours(c, fp8)()
    torch.cuda.synchronize()
    print(f"# pagedkv's first calls: {time.time() - t0:.0f} s after the start", flush=True)
    if thread is not None:
        thread.join()
        print(f"# FlashInfer JIT build ({FAMILIES}, parallel): {built.get('s', float('nan')):.0f} s; "
              f"{time.time() - t0:.0f} s after the start", flush=True)
    return {"att": att, "fi": fi, "cases": cases}


def ours(c: dict, fp8: bool):
    if c["kind"] == "gqa":
        kw = dict(max_query_len=1, max_seq_len=c["ctx"])
        if fp8:
            kw.update(k_scale=c["ks"], v_scale=c["vs"])
        k, v = (c["k8"], c["v8"]) if fp8 else (c["k"], c["v"])
        return lambda: paged_attention(c["q"], k, v, c["qsl"], c["lens"], c["table"], **kw)
    kw = dict(scale=c["scale"], mask=Mask(), max_query_len=1, max_seq_len=c["ctx"], check_blocks=False)
    if fp8:
        kw["latent_scale"] = c["ls"]
    cache = c["lat8"] if fp8 else c["latent"]
    return lambda: paged_mla_latent(c["q_lat"], c["q_rope"], cache, c["qsl"], c["lens"], c["table"], **kw)


def gqa_peers(fi, c: dict, fp8: bool) -> list[tuple[str, object]]:
    """FlashInfer's decode wrapper three ways; each (name, call) or a printed skip."""
    batch, ctx, table = c["batch"], c["ctx"], c["table"]
    nblk = ctx // PAGE
    indptr = torch.arange(0, batch * nblk + 1, nblk, device="cuda", dtype=I32)
    last = torch.full((batch,), PAGE, device="cuda", dtype=I32)
    q, k, v = c["q"], *((c["k8"], c["v8"]) if fp8 else (c["k"], c["v"]))
    kv = E4M3 if fp8 else BF16
    sc = dict(k_scale=c["ks"], v_scale=c["vs"]) if fp8 else {}
    q8, qs = quantize(q)
    rows = []
    for name, tc, backend in (("flashinfer_decode_tc[fa2]", True, "auto"),
                              ("flashinfer_decode[cuda_cores]", False, "auto"),
                              ("flashinfer_decode_tc[fa3]", True, "fa3")):
        try:
            w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                                      "NHD", use_tensor_cores=tc, backend=backend)
            qd = E4M3 if (fp8 and backend == "fa3") else BF16  # its fp8 path wants an e4m3 query
            w.plan(indptr, table.reshape(-1), last, HQ, HKV, DIM, PAGE, q_data_type=qd, kv_data_type=kv,
                   o_data_type=BF16, sm_scale=DIM ** -0.5)
            if qd == E4M3:  # scales as the kernel's scalars (q, k, v)
                rows.append((name + "[e4m3 q]", lambda w=w: w.run(q8, (k, v), qs, c["ks"], c["vs"])))
            else:
                rows.append((name, lambda w=w: w.run(q, (k, v), **sc)))
        except Exception as exc:
            print(f"# {name} {'fp8' if fp8 else 'bf16'}: skipped ({type(exc).__name__}: "
                  f"{str(exc).splitlines()[0][:160] if str(exc) else ''})", flush=True)
    return rows


def mla_peers(fi, c: dict, fp8: bool) -> list[tuple[str, object]]:
    batch, ctx, heads, table = c["batch"], c["ctx"], c["heads"], c["table"]
    lat = c["lat8"] if fp8 else c["latent"]
    rows = []
    if fi is not None:
        try:
            w = fi.mla.BatchMLAPagedAttentionWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                                     backend="fa3")
            nblk = ctx // MLA_PAGE
            w.plan(c["qsl"], torch.arange(0, batch * nblk + 1, nblk, device="cuda", dtype=I32),
                   table.reshape(-1), c["lens"], heads, RANK, ROPE, MLA_PAGE, True, c["scale"], BF16,
                   E4M3 if fp8 else BF16)
            sc = dict(ckv_scale=c["ls"], kpe_scale=c["ls"]) if fp8 else {}
            ckv, kpe = lat[..., :RANK], lat[..., RANK:]
            rows.append(("flashinfer_mla[fa3]", lambda: w.run(c["q_lat"], c["q_rope"], ckv, kpe, **sc)))
        except Exception as exc:
            print(f"# flashinfer_mla[fa3] {'fp8' if fp8 else 'bf16'}: skipped ({type(exc).__name__}: "
                  f"{str(exc).splitlines()[0][:160] if str(exc) else ''})", flush=True)
    try:
        import flash_mla
        from flash_mla.flash_mla_interface import FlashMLASchedMeta
        qf = torch.cat([c["q_lat"], c["q_rope"]], -1).view(batch, 1, heads, RANK + ROPE)
        kc = lat.view(-1, MLA_PAGE, 1, RANK + ROPE)
        meta = FlashMLASchedMeta()
        kw = dict(softmax_scale=c["scale"], causal=True, use_legacy=True)
        if fp8:  # dense fp8 is the legacy SM90 kernel: e4m3 query and cache, (1,) descales
            q8, qs = quantize(qf)
            meta.tile_scheduler_metadata, meta.num_splits = flash_mla.get_mla_decoding_metadata(
                c["lens"], heads, 1, is_fp8_kvcache=True, use_legacy=True)
            kw.update(is_fp8_kvcache=True, descale_q=torch.tensor([qs], device="cuda"),
                      descale_k=torch.tensor([c["ls"]], device="cuda"))
            qf, name = q8, "flashmla_legacy_dense[e4m3 q]"
        else:
            name = "flashmla_legacy_dense"
        rows.append((name, lambda: flash_mla.flash_mla_with_kvcache(qf, kc, table, c["lens"], RANK, meta,
                                                                    **kw)[0]))
    except Exception as exc:
        print(f"# flashmla {'fp8' if fp8 else 'bf16'}: skipped ({type(exc).__name__}: "
              f"{str(exc).splitlines()[0][:160] if str(exc) else ''})", flush=True)
    return rows


def time_rows(prep: dict) -> list[str]:
    """Time every row (events, and graph replays with --graphs); returns the summary table."""
    att, fi = prep["att"], prep["fi"]
    times: dict[tuple[str, str], float] = {}  # (case, name[graph]) -> us
    cases = []  # (bf16 case, fp8 case, fp8 bytes)
    for c in prep["cases"]:
        if c["kind"] == "gqa":
            base = f"gqa B{c['batch']} ctx{c['ctx']} q1 p{PAGE}"
            nb16 = 2 * c["batch"] * c["ctx"] * HKV * DIM * 2
            flops = 4.0 * c["batch"] * HQ * c["ctx"] * DIM
            peers = (lambda fp8, c=c: gqa_peers(fi, c, fp8)) if fi is not None else (lambda fp8: [])
        else:
            base = f"mla B{c['batch']} ctx{c['ctx']} h{c['heads']} q1"
            nb16 = c["batch"] * c["ctx"] * (RANK + ROPE) * 2
            flops = 2.0 * c["batch"] * c["heads"] * c["ctx"] * (RANK + ROPE + RANK)
            peers = lambda fp8, c=c: mla_peers(fi, c, fp8)  # noqa: E731
        cases.append((base, base + " fp8", nb16 // 2))
        for fp8 in (False, True):
            case = base + (" fp8" if fp8 else "")
            nbytes = nb16 // 2 if fp8 else nb16
            ref = c["ref8"] if fp8 else c["ref"]
            for name, fn in [("pagedkv", ours(c, fp8))] + peers(fp8):
                if att.record(case, name, fn, nbytes, ref, flops) is None:
                    continue
                times[(case, name)] = att.ROWS[-1][2]
                if att.GRAPHS[0]:
                    us = att.record_graph(case, name, fn, nbytes, flops)
                    if us is not None:
                        times[(case, name + "[graph]")] = us
        torch.cuda.synchronize()
    return summary(times, cases, att.COPY_GBS[0])


def summary(times: dict, cases: list, copy_gbs: float) -> list[str]:
    """Each fp8 row: us, GB/s, its own bf16 call's us over it, pagedkv's fp8 us over it (same
    timing mode; a peer's "[e4m3 q]" row is set against the same call on the bf16 cache)."""
    lines = ["| case | kernel | timing | fp8 us | GB/s | % copy | own bf16 us | fp8 / own bf16 "
             "throughput | pagedkv fp8 us / this |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for base, case, nbytes in cases:
        for (c, name), us in times.items():
            if c != case:
                continue
            mode = "[graph]" if name.endswith("[graph]") else ""
            kernel = name.removesuffix("[graph]")
            own = times.get((base, kernel.removesuffix("[e4m3 q]") + mode))
            mine = times.get((case, "pagedkv" + mode))
            gbs = nbytes / us / 1e3
            lines.append(f"| {case} | {kernel} | {'graph' if mode else 'events'} | {us:.1f} | {gbs:.0f} | "
                         f"{100 * gbs / copy_gbs:.1f} | {'' if own is None else f'{own:.1f}'} | "
                         f"{'' if own is None else f'{own / us:.2f}x'} | "
                         f"{'' if mine is None else f'{mine / us:.2f}x'} |")
    return lines
