"""What ptxas made of a kernel compiled for sm_90 on this machine (no GPU needed): the
cubin's resource usage and SASS through Triton's bundled ``cuobjdump``, and the key loop
found in the SASS. Shared by the compile scripts (decode_sass.py, decode_gluon_compile.py,
mla_gluon_compile.py)."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import triton

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def dump(kernel) -> tuple[str, str]:
    """(resource usage text, SASS) of a compiled kernel's cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as fh:
            fh.write(kernel.asm["cubin"])
        res, sass = (subprocess.run([os.path.join(BIN, "cuobjdump"), flag, path],
                                    capture_output=True, text=True, check=True).stdout
                     for flag in ("-res-usage", "-sass"))
    return res, sass


def resources(res: str) -> dict[str, int]:
    """REG, STACK and LOCAL of the resource usage text (-1 where missing)."""
    out = {}
    for key in ("REG", "STACK", "LOCAL"):
        m = re.search(r"\b" + key + r":(\d+)", res)
        out[key] = int(m.group(1)) if m else -1
    return out


def sass_lines(sass: str) -> list[tuple[int, str]]:
    """(address, instruction) of each SASS line."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def loop_counts(sass: str, mma: str, longest: bool = False) -> tuple[int, collections.Counter]:
    """Instructions of the key loop -- the backward branch's range holding an ``mma``
    instruction (``HMMA``, ``GMMA``): the shortest such range, or the longest -- and their
    count by opcode."""
    lines = sass_lines(sass)
    best = None
    for addr, ins in lines:
        tgt = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?(0x[0-9a-f]+)", ins)
        if not tgt or int(tgt.group(1), 16) >= addr:
            continue
        body = [x for a, x in lines if int(tgt.group(1), 16) <= a <= addr]
        if any(mma in x for x in body) and (best is None or (
                len(body) > len(best) if longest else len(body) < len(best))):
            best = body
    ops = collections.Counter()
    for ins in best or []:
        ops[re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0]] += 1
    return (len(best) if best else 0), ops


def gluon_source(fn, const: dict, ptrs: dict, descs: dict, floats=()):
    """A Gluon kernel's source for ``triton.compile`` with its signature spelled out: the
    constexprs ``const``, pointer types ``ptrs`` (16-byte aligned, as the launches make
    them), tensor descriptors ``descs`` (name -> descriptor), float32 scalars ``floats``,
    every other argument int32."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in descs:
            sig[name] = mangle_type(descs[name])
        else:
            sig[name] = "fp32" if name in floats else "i32"
    return GluonASTSource(fn, sig, constexprs=const, attrs=attrs)
