#!/usr/bin/env python3
"""Compile the Gluon MLA kernel for sm_90 on any machine (no GPU needed) and print, as one
JSON line: shared memory bytes, registers / stack / local bytes per thread (cuobjdump), the
local-memory accesses inside the key loop (SASS), and the count of each wgmma / TMA /
ldmatrix / stmatrix / setmaxnreg instruction kind in the PTX.

Usage: PYTHONPATH=src python benchmarks/mla_gluon_compile.py [causal|draft|full]
[bf16|fp16|fp8] [rows|pingpong_halves|swap|e4m3|ds] [stages] (fp8: an e4m3 cache, bf16
queries; e4m3 only) (the serial 64-row kernel; the warp-specialized ping-pong kernel over
half-tile slots; the transposed <= 16-row kernel; the <= 16-row kernel with both products
on e4m3, ``mla_gluon_e4m3``, whose ring slots ``stages`` sets, default its ``STAGES``;
``ds``: the fp8_ds_mla kernel, ``mla_gluon_ds``, on bf16 or fp16 queries (the dtype
argument), its ring slots ``stages``, default its ``STAGES``)
(run without TRITON_INTERPRET: the interpreter replaces the JIT functions process-wide).
"""

from __future__ import annotations

import collections
import json
import re
import sys

import torch
import triton
from cubin import dump, gluon_source, resources, sass_lines
from triton.backends.compiler import GPUTarget

from pagedkv.ops.triton import mla_gluon, mla_gluon_ds, mla_gluon_e4m3, mla_gluon_pph


def compile_fwd(mask: str = "causal", dtype: str = "bf16", kernel: str = "rows",
                stages: str | None = None):
    if kernel == "ds":
        return compile_ds(mask, dtype, stages)
    e4m3 = kernel == "e4m3"
    swap = kernel == "swap" or e4m3
    halves = kernel == "pingpong_halves"
    fn = mla_gluon_e4m3._mla_gluon_e4m3 if e4m3 else mla_gluon._mla_gluon_swap if swap \
        else mla_gluon_pph._mla_gluon_pph if halves else mla_gluon._mla_gluon_fwd
    if (dtype == "fp8") != e4m3:
        raise SystemExit(f"{kernel} on {dtype}: the e4m3 kernel takes fp8 (an e4m3 cache) "
                         "only, the others bf16 / fp16")
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}[dtype]
    kd, rd = mla_gluon.descriptors(torch.empty(4, 64, mla_gluon.RANK + mla_gluon.ROPE, dtype=tdt),
                                   256 if halves else mla_gluon.RANK)
    const = dict(R=mla_gluon.RANK, P=mla_gluon.ROPE, BLOCK_M=16 if swap else mla_gluon.BLOCK_M,
                 BLOCK_N=mla_gluon.BLOCK_N, STAGES=mla_gluon.STAGES, CAUSAL=mask == "causal",
                 HAS_DRAFT=mask == "draft")
    if e4m3:  # constexprs as plan passes them (one left out would compile as an i32 argument)
        const["STAGES"] = int(stages) if stages else mla_gluon_e4m3.STAGES
    options = {"num_warps": 4 if swap or halves else 8}
    if halves:
        options["maxnreg"] = mla_gluon_pph.PPH_MAXNREG
    if e4m3:
        options["maxnreg"] = mla_gluon_e4m3.MAXNREG
    q = "*fp16" if dtype == "fp16" else "*bf16"
    ptrs = {"ql_ptr": q, "qr_ptr": q, "qsl_ptr": "*i32", "lens_ptr": "*i32", "table_ptr": "*i32",
            "ws_o": "*fp32", "ws_m": "*fp32", "ws_l": "*fp32", "flag_ptr": "*i32"}
    src = gluon_source(fn, const, ptrs, {"kd": kd, "rd": rd}, ("scale", "lscale"))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_ds(mask: str = "causal", dtype: str = "bf16", stages: str | None = None):
    """The fp8_ds_mla kernel (``mla_gluon_ds._mla_gluon_ds_ws``) over a uint8 cache of
    656-byte entries, bf16 or fp16 queries."""
    descs = mla_gluon_ds.descriptors(torch.empty(4, 64, mla_gluon_ds.ENTRY, dtype=torch.uint8))
    const = dict(R=mla_gluon.RANK, P=mla_gluon.ROPE, BLOCK_M=mla_gluon.SWAP_ROWS,
                 BLOCK_N=mla_gluon.BLOCK_N, CAUSAL=mask == "causal", HAS_DRAFT=mask == "draft",
                 STAGES=int(stages) if stages else mla_gluon_ds.STAGES)
    q = "*fp16" if dtype == "fp16" else "*bf16"
    ptrs = {"ql_ptr": q, "qr_ptr": q, "qsl_ptr": "*i32", "lens_ptr": "*i32", "table_ptr": "*i32",
            "ws_o": "*fp32", "ws_m": "*fp32", "ws_l": "*fp32", "flag_ptr": "*i32"}
    src = gluon_source(mla_gluon_ds._mla_gluon_ds_ws, const, ptrs,
                       dict(zip(("kd", "rd", "sd"), descs)), ("scale",))
    options = {"num_warps": 4, "maxnreg": mla_gluon_e4m3.MAXNREG}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def loop_spills(sass: str) -> int:
    """Local-memory loads/stores (STL/LDL) in the worst loop: the most inside any one
    conditional backward branch's range (a loop's own edge; an unconditional one is a
    wait's retry path jumping back in). A warp-specialized kernel has a key loop per
    partition, so each is counted; a stack only written before a loop and read after it
    costs no per-tile traffic."""
    code = sass_lines(sass)
    spills = [a for a, i in code if re.search(r"\b(STL|LDL)", i)]
    worst = 0
    for addr, ins in code:
        t = re.match(r"@!?U?P\d\s+BRA\s+(0x[0-9a-f]+)", ins)
        if t and int(t.group(1), 16) < addr:
            worst = max(worst, sum(1 for a in spills if int(t.group(1), 16) <= a <= addr))
    return worst


def loop_sizes(sass: str, least: int = 150) -> list[list[int]]:
    """[SASS instructions, warpgroup barriers (BAR)] of each loop body (a conditional
    backward branch's range) of at least ``least`` instructions, in code order: the key
    loops of a warp-specialized kernel's partitions, a tile's work each."""
    code = sass_lines(sass)
    out = []
    for addr, ins in code:
        t = re.match(r"@!?U?P\d\s+BRA\s+(0x[0-9a-f]+)", ins)
        if t and int(t.group(1), 16) < addr:
            body = [i for a, i in code if int(t.group(1), 16) <= a <= addr]
            if len(body) >= least:
                out.append([len(body), sum(1 for i in body if re.match(r"BAR\.", i))])
    return out


def report(kernel) -> dict:
    out = {"shared": kernel.metadata.shared}
    res, sass = dump(kernel)
    out.update(resources(res))
    out["loop_spills"] = loop_spills(sass)
    out["loops"] = loop_sizes(sass)
    ptx = kernel.asm["ptx"]
    kinds = (r"(wgmma\.mma_async\.\S+|cp\.async\.bulk\.tensor\.\S+|mbarrier\.try_wait"
             r"|ldmatrix\.\S+|stmatrix\.\S+|setmaxnreg\.\S+)")
    out["ptx"] = dict(collections.Counter(re.findall(kinds, ptx)))
    return out


if __name__ == "__main__":
    print(json.dumps(report(compile_fwd(*sys.argv[1:]))))
