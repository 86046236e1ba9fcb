#!/usr/bin/env python3
"""One benchmark shape's kernel, called a few times, for Nsight Compute (``ncu``) to read the
hardware counters of one launch: where a kernel's time goes (stall reasons, pipe use,
memory throughput), which CUDA-event timings alone cannot say.

Cases (the shapes of ``benchmarks/attention.py``'s targets): ``mla_fp8`` (B64 ctx8K h16 q1,
per-tensor e4m3 latent), ``mla_ds`` (the same over fp8_ds_mla entries), ``mla_q7`` (h16, a
7-token non-causal block, bf16), ``mla_q1`` (h16 q1 bf16), ``gqa_fp8`` (B64 ctx8K, 32/8
heads, e4m3). Usage on a GPU, from the repo root:

    ncu --clock-control none --launch-skip 3 --launch-count 1 --kernel-name regex:NAME \\
        --section SpeedOfLight --section WarpStateStats ... \\
        python3 benchmarks/ncu_case.py CASE

(``--clock-control none``: leave the card's clocks as they are.)
"""

from __future__ import annotations

import math
import sys

import torch

from pagedkv.ops import Mask
from pagedkv.ops.triton.attention import paged_attention
from pagedkv.ops.triton.cache_write import write_mla_latent
from pagedkv.ops.triton.mla import paged_mla_latent

CASES = ("mla_fp8", "mla_ds", "mla_q7", "mla_q1", "gqa_fp8")


def mla_call(fmt: str, q_len: int, batch: int = 64, ctx: int = 8192, heads: int = 16,
             page: int = 64):
    dev = "cuda"
    rank, rope = 512, 64
    pages = batch * ctx // page
    table = torch.randperm(pages, device=dev, dtype=torch.int32).view(batch, -1)
    latent = torch.randn(pages, page, rank + rope, device=dev, dtype=torch.bfloat16)
    q_lat = torch.randn(batch * q_len, heads, rank, device=dev, dtype=torch.bfloat16)
    q_rope = torch.randn(batch * q_len, heads, rope, device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(0, batch * q_len + 1, q_len, device=dev, dtype=torch.int32)
    lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    mask = Mask() if q_len == 1 else Mask(causal=False, draft_block=q_len)
    kw = dict(scale=1 / math.sqrt(192), mask=mask, max_query_len=q_len, max_seq_len=ctx,
              check_blocks=False)
    if fmt == "fp8_ds_mla":
        cache = torch.empty(pages, page, 656, device=dev, dtype=torch.uint8)
        flat = latent.view(-1, rank + rope)
        write_mla_latent(flat[:, :rank], flat[:, rank:], cache, torch.arange(pages * page,
                                                                           device=dev))
    elif fmt == "fp8":
        ls = float(latent.abs().amax()) / 448
        cache = (latent.float() / ls).to(torch.float8_e4m3fn)
        kw["latent_scale"] = ls
    else:
        cache = latent
    return lambda: paged_mla_latent(q_lat, q_rope, cache, qsl, lens, table, **kw)


def gqa_fp8_call(batch: int = 64, ctx: int = 8192, page: int = 16, hq: int = 32, hkv: int = 8):
    dev = "cuda"
    blocks = batch * ctx // page
    table = torch.randperm(blocks, device=dev, dtype=torch.int32).view(batch, -1)
    k = torch.randn(blocks, page, hkv, 128, device=dev).to(torch.float8_e4m3fn)
    v = torch.randn(blocks, page, hkv, 128, device=dev).to(torch.float8_e4m3fn)
    q = torch.randn(batch, hq, 128, device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    return lambda: paged_attention(q, k, v, qsl, lens, table, k_scale=0.5, v_scale=0.5,
                                   max_query_len=1, max_seq_len=ctx)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in CASES:
        print(f"usage: ncu_case.py {{{','.join(CASES)}}}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("ncu_case.py: needs a CUDA device", file=sys.stderr)
        return 2
    case = argv[0]
    call = {"mla_fp8": lambda: mla_call("fp8", 1), "mla_ds": lambda: mla_call("fp8_ds_mla", 1),
            "mla_q7": lambda: mla_call("bf16", 7), "mla_q1": lambda: mla_call("bf16", 1),
            "gqa_fp8": gqa_fp8_call}[case]()
    for _ in range(6):
        call()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
