"""The Triton GQA decode kernel as ``decode_plan`` launches it (tile rows, head dims, page
tiles, register cap), compiled for sm_90 by Triton's own ptxas: no GPU needed. A register
cap that leaves too few registers is a ptxas error at the first launch on a Hopper GPU: head
dim 256 with 64-row tiles was one (found by fuzz/gpu_gqa.py on an H100)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from pagedkv.ops import Mask  # noqa: E402
from pagedkv.ops.triton import decode  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_sass.py"

CASES = [  # (head dim, query tokens per request, query heads, KV heads, block size)
    (128, 1, 32, 8, 64),  # 16-row page tiles: the measured cap, 128 registers
    (128, 7, 32, 8, 16),  # 32-row tiles (7-token blocks at group 4): the measured cap
    (256, 7, 32, 8, 16),  # 32 rows at head dim 256: spilled under the cap
    (256, 5, 64, 8, 16),  # 40 pairs -> 64-row tiles: ptxas refused the cap of 128
]


def planned_consts(monkeypatch, dim, q_len, heads, kv_heads, block_size) -> dict:
    """The decode kernel's constexprs and launch options as the GPU path plans them (the
    interpreter's own launch config switched off; two splits, so no device is asked)."""
    monkeypatch.setattr(decode, "interpreting", lambda: False)
    bf16 = torch.bfloat16
    q = torch.empty(q_len, heads, dim, dtype=bf16)
    cache = torch.empty(8, block_size, kv_heads, dim, dtype=bf16)
    qsl = torch.tensor([0, q_len], dtype=torch.int32)
    lens = torch.tensor([300], dtype=torch.int32)
    table = torch.zeros(1, 8, dtype=torch.int32)
    out = torch.empty_like(q)
    mask = Mask(causal=False, draft_block=q_len) if q_len > 1 else Mask()
    plan = decode.decode_plan(q, cache, cache, qsl, lens, table, out, None, mask=mask,
                              scale=dim**-0.5, soft_cap=None, sinks=None, k_scale=1.0,
                              v_scale=1.0, max_query_len=q_len, max_seq_len=300, f32=False,
                              splits=2)
    return dict(plan.kernel.consts)


def compiled_for_sm90(consts: dict) -> dict:
    """benchmarks/decode_sass.py's registers and stack for these constexprs, in a process
    without TRITON_INTERPRET (which replaces the JIT functions process-wide)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    args = [f"{k}={int(v)}" for k, v in consts.items()]
    out = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    found = re.search(r"REG:(\d+) STACK:(\d+)", out.stdout)
    assert found, out.stdout
    return {"REG": int(found.group(1)), "STACK": int(found.group(2))}


@pytest.mark.parametrize("dim,q_len,heads,kv_heads,block_size", CASES)
def test_planned_launch_compiles_for_sm90(monkeypatch, dim, q_len, heads, kv_heads, block_size):
    consts = planned_consts(monkeypatch, dim, q_len, heads, kv_heads, block_size)
    cap = consts.get("maxnreg")
    if dim <= 128:  # the tiles the caps were measured on keep them
        assert cap == 128, consts
    use = compiled_for_sm90(consts)
    if cap is not None:
        assert use["REG"] <= cap and use["STACK"] == 0, (consts, use)
    elif consts["BLOCK_M"] <= 32:  # uncapped: what it needs, without spills
        assert use["STACK"] == 0, (consts, use)
    # (64 rows over head dim 256 compile, spilling ~120 bytes: correct, speed not measured)
