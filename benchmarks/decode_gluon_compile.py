#!/usr/bin/env python3
"""Compile the Gluon fp8 GQA decode kernel for sm_90 on any machine (no GPU needed) and print,
as one JSON line: shared memory bytes, registers / stack / local bytes per thread
(cuobjdump), local-memory accesses in the SASS, and the count of each wgmma / TMA / cvt
instruction kind in the PTX.

Usage: PYTHONPATH=src python benchmarks/decode_gluon_compile.py [e4m3|e5m2] [causal|draft]
[BLOCK_M] [STAGES] [PAGE] [P_SPLIT] [MAXNREG] [BLOCK_N] (run without TRITON_INTERPRET).
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

from pagedkv.ops.triton import decode_gluon

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_kernel(fmt="e4m3", mask="causal", block_m=8, stages=decode_gluon.STAGES, page=16,
                   p_split=int(decode_gluon.P_SPLIT), maxnreg=None,
                   block_n=decode_gluon.BLOCK_N):
    fn = decode_gluon._paged_decode_gluon
    dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    desc = decode_gluon.descriptor(torch.empty(4, page, 8, 128, dtype=dt))
    const = dict(GROUP=4, PAGE=page, D=128, BLOCK_M=block_m, BLOCK_N=block_n,
                 STAGES=stages, CAUSAL=mask == "causal", HAS_DRAFT=mask == "draft",
                 SCALES_IN_MEMORY=False, CHECK=False,
                 P_SPLIT=p_split)
    ptrs = {"q_ptr": "*bf16", "qsl_ptr": "*i32", "lens_ptr": "*i32", "table_ptr": "*i32",
            "ws_o": "*fp32", "ws_m": "*fp32", "ws_l": "*fp32", "scales_ptr": "*fp32",
            "flag_ptr": "*i32"}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("kd", "vd"):
            sig[name] = mangle_type(desc)
        else:
            sig[name] = "fp32" if name in ("scale", "k_scale_f", "v_scale_f") else "i32"
    src = GluonASTSource(fn, sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4,
                         "maxnreg": maxnreg or decode_gluon.MAXNREG[block_m]})


def loop_counts(sass: str):
    """Instructions of the shortest backward-branch loop holding a GMMA (the key loop), and
    their count by opcode."""
    lines = []
    for ln in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", ln)
        if m:
            lines.append((int(m.group(1), 16), m.group(2)))
    best = None
    for addr, ins in lines:
        tgt = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?(0x[0-9a-f]+)", ins)
        if not tgt or int(tgt.group(1), 16) >= addr:
            continue
        body = [x for a, x in lines if int(tgt.group(1), 16) <= a <= addr]
        if any("GMMA" in x for x in body) and (best is None or len(body) < len(best)):
            best = body
    ops = collections.Counter()
    for ins in best or []:
        ops[re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0]] += 1
    return (len(best) if best else 0), ops


def report(kernel) -> dict:
    out = {"shared": kernel.metadata.shared}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as fh:
            fh.write(kernel.asm["cubin"])
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", path],
                             capture_output=True, text=True).stdout
        for key in ("REG", "STACK", "LOCAL"):
            m = re.search(key + r":(\d+)", res)
            out[key] = int(m.group(1)) if m else -1
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path],
                              capture_output=True, text=True).stdout
    out["local_ops"] = len(re.findall(r"\b(STL|LDL)", sass))
    n, ops = loop_counts(sass)
    out["loop"] = n
    out["loop_ops"] = dict(ops.most_common(16))
    ptx = collections.Counter(re.findall(r"^\s*(?:@%p\d+\s+)?((?:wgmma|cp\.async\.bulk\.tensor|cvt\.rn\.\w+\.e\w+)[\w.:]*)",
                                         kernel.asm["ptx"], re.M))
    out["ptx"] = dict(ptx)
    return out


if __name__ == "__main__":
    a = sys.argv[1:]
    print(json.dumps(report(compile_kernel(a[0] if a else "e4m3", a[1] if len(a) > 1 else "causal",
                                           *(int(x) for x in a[2:])))))
