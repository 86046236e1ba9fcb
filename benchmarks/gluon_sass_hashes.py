#!/usr/bin/env python3
"""sha1 of the sm_90 SASS of the Gluon decode kernels, one line per configuration, compiled
on any machine (no GPU needed): run it before and after a refactor that should not change
what the GPU runs, and compare (the compile is deterministic).

Configurations: the GQA fp8 kernel (``decode_gluon``) at 8 / 16 / 32 (row, head) pairs; the
MLA kernels (``mla_gluon``: 64-row serial, ping-pong over half-tile slots, the transposed
<= 16-row kernel for bf16; ``mla_gluon_e4m3``; ``mla_gluon_ds`` on bf16 and fp16 queries).

The SASS is not a function of the PTX's code alone: ptxas also reads the line info (moving
a block into a helper, or lines above a kernel, can change the SASS with the same PTX
code), and on a loaded machine some configurations compile to other SASS from run to run
(seen on this repo's 2-core CPU box while other jobs ran). So compare on an idle machine,
and with ``--ptx`` compare the PTX without its debug info, which is deterministic.

Usage: PYTHONPATH=src python benchmarks/gluon_sass_hashes.py [--ptx] (run without
TRITON_INTERPRET).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_gluon_compile  # noqa: E402
import mla_gluon_compile  # noqa: E402
from cubin import dump  # noqa: E402

GQA = ((8, "causal"), (16, "causal"), (32, "draft"))
MLA = (("causal", "bf16", "rows"), ("causal", "bf16", "pingpong_halves"),
       ("causal", "bf16", "swap"), ("causal", "fp8", "e4m3"), ("draft", "fp8", "e4m3"),
       ("causal", "bf16", "ds"), ("draft", "fp16", "ds"))


def ptx_code(ptx: str) -> str:
    """The PTX without its debug info (line info, file table, debug labels and sections)."""
    code = re.split(r"^\s*\.section", ptx, maxsplit=1, flags=re.M)[0]
    return "\n".join(x for x in code.splitlines()
                     if not re.match(r"\s*(\.loc|\.file|\$L__tmp|\$L__func|//)", x))


def sha(kernel, ptx: bool = False) -> str:
    text = ptx_code(kernel.asm["ptx"]) if ptx else dump(kernel)[1]
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def main() -> int:
    ptx = "--ptx" in sys.argv[1:]
    for block_m, mask in GQA:
        kernel = decode_gluon_compile.compile_kernel("e4m3", mask, block_m=block_m)
        print(f"gqa pairs={block_m} {mask} {sha(kernel, ptx)}", flush=True)
    for args in MLA:
        print(f"mla {' '.join(args)} {sha(mla_gluon_compile.compile_fwd(*args), ptx)}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
