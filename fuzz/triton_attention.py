"""The Triton paged-attention kernel against the float64 dense reference.

Each case is one ``paged_attention`` call on the Triton backend over a random batch (1-5
sequences of 0-90 cached + 1-10 query tokens, sometimes a padding row), mask (causal,
sliding window, chunked, non-causal draft blocks, bidirectional), head grouping (1-16 query
heads per 1-4 KV heads), block size (1-64), head and value dims, query/cache dtype (fp32,
bf16, fp16), soft-cap, scale, attention sinks and the kernel's launch overrides (splits,
tiles, swap, fused, heads-first, page tiles, max lengths). The caches are NaN-filled with
blocks from a shuffled free list (tests/ops/test_ops_paged_attention.py's ``make_scenario``),
so a read outside a sequence's blocks shows. What must hold:

- a launch the kernel cannot take is a ``PagedKVError`` (refused);
- otherwise every output row finite and within 2e-4 (fp32), 2e-2 (fp16) or 4e-2 (bf16) of
  the float64 reference, relative to the reference's largest value when that is above 1
  (the padding rows past the batch are not compared).

On CPU tensors it runs the kernels in Triton's interpreter (TRITON_INTERPRET=1, set unless
already set); on a GPU set PAGEDKV_TEST_DEVICE=cuda and TRITON_INTERPRET=0. The draws are
those of the first throwaway script, seed for seed.

    PYTHONPATH=src OMP_NUM_THREADS=1 python fuzz/triton_attention.py --start 0 --count 40
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import warnings
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "ops")]  # the ops tests' helpers

import harness  # noqa: E402
import torch  # noqa: E402
from test_ops_paged_attention import make_scenario, reference, run  # noqa: E402

from pagedkv.errors import PagedKVError  # noqa: E402
from pagedkv.ops import Mask, set_backend  # noqa: E402

TOLERANCE = {"float32": 2e-4, "float16": 2e-2, "bfloat16": 4e-2}
LAUNCH = (("splits", [None, 1, 2, 3, 5]), ("block_n", [None, 16, 32, 64]),
          ("swap", [None, True, False]), ("fused", [None, True, False]),
          ("heads_first", [None, True, False]), ("block_m", [None, 16, 64]),
          ("page_tiles", [None, True, False]),
          ("max_query_len", [None]))  # a None that only costs a draw: kept, seeds unchanged


def draw(seed: int, args: argparse.Namespace) -> dict:
    rng = random.Random(seed)
    kind = rng.choice(["causal", "window", "chunk", "draft", "bidirectional"])
    extra = rng.randint(1, 9)  # the window or chunk width
    draft_block = rng.randint(1, 8)
    seqs = []
    for _ in range(rng.randint(1, 5)):
        cached, q = rng.randint(0, 90), rng.randint(1, 10)
        if kind == "draft":
            q = draft_block * rng.randint(1, 2)
        seqs.append((cached + q, q))
    if rng.random() < 0.2:
        seqs.append((0, 0))  # a padding batch row
    case = dict(seed=seed, kind=kind, extra=extra, draft_block=draft_block, seqs=seqs,
                heads_kv=rng.choice([(1, 1), (2, 1), (4, 2), (6, 3), (8, 1), (16, 2), (4, 4)]),
                block_size=rng.choice([1, 2, 4, 8, 16, 32, 64]), dim=rng.choice([4, 8, 16, 32]),
                vdim=rng.choice([None, None, 4, 8, 16]),
                dtype=rng.choice(["float32", "bfloat16", "float16"]))
    kw: dict = {}
    if rng.random() < 0.3:
        kw["soft_cap"] = rng.choice([5.0, 30.0])
    kw["scale"] = rng.choice([None, 0.3, 1.0])
    case["sinks"] = rng.random() < 0.3  # drawn from torch.Generator(seed) in check
    for name, choices in LAUNCH:
        if rng.random() < 0.3:
            kw[name] = rng.choice(choices)
    if rng.random() < 0.3:
        kw["max_query_len"] = max(q for _, q in seqs)
        kw["max_seq_len"] = max(s for s, _ in seqs)
    case["kw"] = kw
    return case


def describe(case: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in case.items() if k != "seed")


def mask_of(case: dict) -> Mask:
    return {"causal": Mask(), "window": Mask(window=case["extra"]),
            "chunk": Mask(chunk=case["extra"]),
            "draft": Mask(causal=False, draft_block=case["draft_block"]),
            "bidirectional": Mask(causal=False)}[case["kind"]]


def check(case: dict, args: argparse.Namespace) -> None:
    seed, dim, mask = case["seed"], case["dim"], mask_of(case)
    heads, kv_heads = case["heads_kv"]
    kw = dict(case["kw"])
    sinks = None
    if case["sinks"]:
        sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed))
    sc = make_scenario(case["seqs"], case["block_size"], heads, kv_heads, dim=dim,
                       vdim=case["vdim"], dtype=getattr(torch, case["dtype"]), seed=seed)
    if sinks is not None:  # on the call's device (the reference reads them on the host)
        kw["sinks"] = sinks.to(sc.q.device)
    try:
        got = run(sc, mask, **kw)
    except PagedKVError as e:
        raise harness.Refused(f"{type(e).__name__}: {e}") from None
    scale = kw["scale"] if kw["scale"] is not None else dim ** -0.5
    want = reference(sc, mask, scale=scale, soft_cap=kw.get("soft_cap"), sinks=sinks)
    n = want.shape[0] - 2  # PAD_ROWS query rows past the batch are never computed
    if n == 0:
        return
    got, want = got.cpu().double()[:n], want[:n]
    err = (got - want).abs().max().item()
    bound = TOLERANCE[case["dtype"]] * max(1.0, want.abs().max().item())
    if not bool(torch.isfinite(got).all()) or err > bound:
        raise harness.Bad(f"err={err:.3e} (bound {bound:.1e}) nan={int(got.isnan().sum())}")


def setup(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # the interpreter's per-launch warnings
    set_backend("triton")


if __name__ == "__main__":
    harness.main(__doc__, None, draw, describe, check, limit=120, setup=setup)
