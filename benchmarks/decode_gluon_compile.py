#!/usr/bin/env python3
"""Compile the Gluon fp8 GQA decode kernel for sm_90 on any machine (no GPU needed) and print,
as one JSON line: shared memory bytes, registers / stack / local bytes per thread
(cuobjdump), local-memory accesses in the SASS, and the count of each wgmma / TMA / cvt
instruction kind in the PTX.

Usage: PYTHONPATH=src python benchmarks/decode_gluon_compile.py [e4m3|e5m2] [causal|draft]
[BLOCK_M] [STAGES] [PAGE] (run without TRITON_INTERPRET).
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


def compile_kernel(fmt="e4m3", mask="causal", block_m=16, stages=decode_gluon.STAGES, page=16):
    fn = decode_gluon._paged_decode_gluon
    dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    desc = decode_gluon.descriptor(torch.empty(4, page, 8, 128, dtype=dt))
    const = dict(GROUP=4, PAGE=page, D=128, BLOCK_M=block_m, BLOCK_N=decode_gluon.BLOCK_N,
                 STAGES=stages, CAUSAL=mask == "causal", HAS_DRAFT=mask == "draft",
                 SCALES_IN_MEMORY=False, CHECK=False)
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
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


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
    ptx = collections.Counter(re.findall(r"^\s*(?:@%p\d+\s+)?((?:wgmma|cp\.async\.bulk\.tensor|cvt\.rn\.f16x2\.e\w+)[\w.:]*)",
                                         kernel.asm["ptx"], re.M))
    out["ptx"] = dict(ptx)
    return out


if __name__ == "__main__":
    a = sys.argv[1:]
    print(json.dumps(report(compile_kernel(a[0] if a else "e4m3", a[1] if len(a) > 1 else "causal",
                                           *(int(x) for x in a[2:])))))
