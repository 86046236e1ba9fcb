#!/usr/bin/env python3
"""Compile the Gluon fp8 GQA decode kernel for sm_90 on any machine (no GPU needed) and print,
as one JSON line: shared memory bytes, registers / stack / local bytes per thread
(cuobjdump), local-memory accesses in the SASS, and the count of each wgmma / TMA / cvt
instruction kind in the PTX.

Usage: PYTHONPATH=src python benchmarks/decode_gluon_compile.py [e4m3|e5m2] [causal|draft]
[BLOCK_M] [STAGES] [PAGE] [MAXNREG] [BLOCK_N] (run without TRITON_INTERPRET). "loop" counts
the key loop's SASS with both V^T paths in it (the masked one is the forward-branched block
of ~290 instructions with the SEL).
"""

from __future__ import annotations

import collections
import json
import re
import sys

import torch
import triton
from cubin import dump, gluon_source, loop_counts, resources
from triton.backends.compiler import GPUTarget

from pagedkv.ops.triton import decode_gluon


def compile_kernel(fmt="e4m3", mask="causal", block_m=8, stages=decode_gluon.STAGES, page=16,
                   maxnreg=None, block_n=decode_gluon.BLOCK_N):
    fn = decode_gluon._paged_decode_gluon
    dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    desc = decode_gluon.descriptor(torch.empty(4, page, 8, 128, dtype=dt))
    const = dict(GROUP=4, PAGE=page, D=128, BLOCK_M=block_m, BLOCK_N=block_n,
                 STAGES=stages, CAUSAL=mask == "causal", HAS_DRAFT=mask == "draft",
                 SCALES_IN_MEMORY=False, CHECK=False)
    ptrs = {"q_ptr": "*bf16", "qsl_ptr": "*i32", "lens_ptr": "*i32", "table_ptr": "*i32",
            "ws_o": "*fp32", "ws_m": "*fp32", "ws_l": "*fp32", "scales_ptr": "*fp32",
            "flag_ptr": "*i32"}
    src = gluon_source(fn, const, ptrs, {"kd": desc, "vd": desc},
                       ("scale", "k_scale_f", "v_scale_f"))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4,
                         "maxnreg": maxnreg or decode_gluon.MAXNREG[block_m]})


def report(kernel) -> dict:
    out = {"shared": kernel.metadata.shared}
    res, sass = dump(kernel)
    out.update(resources(res))
    out["local_ops"] = len(re.findall(r"\b(STL|LDL)", sass))
    n, ops = loop_counts(sass, "GMMA")
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
