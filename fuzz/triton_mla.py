"""The Triton absorbed-MLA kernel against naive (decompressed) float64 MLA.

Each case is one ``paged_mla_latent`` call of the Triton backend (query absorbed through
W_UK, output projected through W_UV) over a random batch (1-6 sequences of 0-70 cached +
1-16 query tokens), mask (causal, bidirectional, non-causal draft blocks of 1-16), block
size (1-64), RoPE width (0, 8, 16), latent cache format (bf16, fp16) and the kernel's
launch overrides (tiles, value-dim and sequence splits, swap, TMA, stages, max lengths).
The cache is NaN-filled with blocks from a shuffled free list
(tests/ops/test_ops_paged_mla.py's ``make_cache``). What must hold:

- a launch the kernel cannot take is a ``PagedKVError`` (refused);
- otherwise every output finite and within 2e-4 of the naive float64 MLA over the stored
  latents, relative to its largest value when that is above 1.

On CPU tensors it runs the kernel in Triton's interpreter (TRITON_INTERPRET=1, set unless
already set); on a GPU set PAGEDKV_TEST_DEVICE=cuda and TRITON_INTERPRET=0. The draws are
those of the first throwaway script, seed for seed.

    PYTHONPATH=src OMP_NUM_THREADS=1 python fuzz/triton_mla.py --start 0 --count 20
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import warnings
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "ops")]  # the ops tests' helpers

import harness  # noqa: E402
import test_ops_paged_mla as mla  # noqa: E402
import torch  # noqa: E402

from pagedkv.errors import PagedKVError  # noqa: E402
from pagedkv.ops import Mask, absorb_query, project_output  # noqa: E402
from pagedkv.ops.triton.mla import paged_mla_latent  # noqa: E402

TOLERANCE = 2e-4
LAUNCH = (("block_m", [16, 32, 64]), ("block_n", [16, 32, 64]), ("dv_splits", [1, 2, 4]),
          ("splits", [1, 2, 3]), ("swap", [True, False]), ("tma", [True, False]),
          ("num_stages", [1, 2, 3]))


def draw(seed: int, args: argparse.Namespace) -> dict:
    rng = random.Random(seed)
    kind = rng.choice(["causal", "bidirectional", "draft"])
    draft_block = rng.randint(1, 16)
    seqs = []
    for _ in range(rng.randint(1, 6)):
        q = draft_block * rng.randint(1, 2) if kind == "draft" else rng.randint(1, 16)
        seqs.append((rng.randint(0, 70) + q, q))
    case = dict(seed=seed, kind=kind, draft_block=draft_block, seqs=seqs,
                block_size=rng.choice([1, 2, 4, 16, 32, 64]), rope=rng.choice([0, 8, 16]),
                fmt=rng.choice(["bf16", "fp16"]))
    launch = {}
    for name, choices in LAUNCH:
        if rng.random() < 0.3:
            launch[name] = rng.choice(choices)
    if rng.random() < 0.3:
        launch["max_query_len"] = max(q for _, q in seqs)
        launch["max_seq_len"] = max(s for s, _ in seqs)
    case["launch"] = launch
    return case


def describe(case: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in case.items() if k != "seed")


def check(case: dict, args: argparse.Namespace) -> None:
    seed, seqs, rope = case["seed"], case["seqs"], case["rope"]
    mask = {"causal": Mask(), "bidirectional": Mask(causal=False),
            "draft": Mask(causal=False, draft_block=case["draft_block"])}[case["kind"]]
    sc = mla.make_cache([s for s, _ in seqs], case["block_size"], case["fmt"], rope=rope,
                        seed=seed)
    w_uk, w_uv = mla.weights(seed % 5)
    q_nope, q_rope, qsl, seq_lens = mla.queries(seqs, rope=rope, seed=seed)
    try:
        out = paged_mla_latent(absorb_query(q_nope, w_uk), q_rope, sc.cache, qsl, seq_lens,
                               sc.table, scale=1 / math.sqrt(mla.D_NOPE + rope), mask=mask,
                               **case["launch"])
    except PagedKVError as e:
        raise harness.Refused(f"{type(e).__name__}: {e}") from None
    got = project_output(out, w_uv).double().cpu()
    want = mla.naive(q_nope, q_rope, sc.latents, seqs, w_uk, w_uv, mask)
    err = (got - want).abs().max().item()
    bound = TOLERANCE * max(1.0, want.abs().max().item())
    if not bool(torch.isfinite(got).all()) or err > bound:
        raise harness.Bad(f"err={err:.3e} (bound {bound:.1e}) nan={int(got.isnan().sum())}")


def setup(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # the interpreter's per-launch warnings


if __name__ == "__main__":
    harness.main(__doc__, None, draw, describe, check, limit=120, setup=setup)
