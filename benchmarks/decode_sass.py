#!/usr/bin/env python3
"""Compile the GQA decode kernel for sm_90 on any machine (no GPU needed) and count the SASS
instructions of its main loop (the backward-branch loop that holds the HMMAs), by opcode.

Usage: PYTHONPATH=src python benchmarks/decode_sass.py [NAME=VALUE ...]
(constexpr overrides, e.g. PAGE=64 BLOCK_M=32 FP8=1 PAGE_TILES=0; num_warps=, num_stages=,
maxnreg= set the launch options). Prints registers, spills, shared memory and the counts.
"""

from __future__ import annotations

import os
import re
import sys

import triton
from cubin import dump, loop_counts
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource

from pagedkv.ops.triton.decode import _paged_decode_fwd


def compile_decode(**over):
    fn = _paged_decode_fwd
    opts = {"num_warps": over.pop("num_warps", 4), "num_stages": over.pop("num_stages", 2)}
    if "maxnreg" in over:
        opts["maxnreg"] = over.pop("maxnreg")
    fp8 = bool(over.get("FP8", 0))
    kv = "*fp8e4nv" if fp8 else "*bf16"
    const = dict(GROUP=4, PAGE=16, D=128, DV=128, DIRECT=False, BLOCK_M=16, BLOCK_N=128 if fp8 else 64,
                 BLOCK_D=128, BLOCK_DV=128, CAUSAL=True, HAS_DRAFT=False, HAS_WINDOW=False,
                 HAS_CHUNK=False, HAS_CAP=False, HAS_SINKS=False, SCALES_IN_MEMORY=False,
                 CHECK=False, F32=False, FP8=False, SWAP=False, FUSED=False, HEADS_FIRST=False,
                 ROW_TILES=1, PAGE_TILES=False, OFF_ALIGN=16, WIDEN=False)
    for k, v in over.items():
        const[k] = int(v) if not isinstance(v, bool) else v
    for k in ("DIRECT", "CAUSAL", "HAS_DRAFT", "HAS_WINDOW", "HAS_CHUNK", "HAS_CAP", "HAS_SINKS",
              "SCALES_IN_MEMORY", "CHECK", "F32", "FP8", "SWAP", "FUSED", "HEADS_FIRST", "PAGE_TILES", "WIDEN"):
        if k in const:
            const[k] = bool(const[k])
    sig, attrs = {}, {}
    ptr_types = {"q_ptr": "*bf16", "k_ptr": kv, "v_ptr": kv, "qsl_ptr": "*i32", "lens_ptr": "*i32",
                 "table_ptr": "*i32", "out_ptr": "*bf16", "ws_o": "*fp32", "ws_m": "*fp32",
                 "ws_l": "*fp32", "scales_ptr": "*fp32", "sinks_ptr": "*fp32", "flag_ptr": "*i32",
                 "count_ptr": "*i32"}
    floats = {"scale", "k_scale_f", "v_scale_f", "cap"}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in ptr_types:
            sig[name] = ptr_types[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride_") and name not in ("stride_tb",):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options=opts)


def main(argv):
    over = {}
    for a in argv:
        k, v = a.split("=")
        over[k] = int(v)
    k = compile_decode(**over)
    res, sass = dump(k)
    if os.environ.get("SASS_OUT"):
        with open(os.environ["SASS_OUT"], "w") as fh:
            fh.write(sass)
        with open(os.environ["SASS_OUT"] + ".ttgir", "w") as fh:
            fh.write(k.asm["ttgir"])
    print(" ".join(a for a in argv), "|", re.search(r"REG:\d+.*", res).group(0).strip())
    n, ops = loop_counts(sass, "HMMA", longest=True)
    print(f"main loop: {n} instructions;", ", ".join(f"{o} {c}" for o, c in ops.most_common(14)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
