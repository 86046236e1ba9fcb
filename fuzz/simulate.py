"""Random ``pagedkv simulate MODEL --checked --json`` runs, in-process.

Each case is one command line over a catalog model (no weights, no torch: the block manager
and scheduler alone): random workload, request count, max_model_len (256 to 16,384), memory
(64 MiB to 16 GiB), block size, KV dtype, batch and running limits, fixed or elastic pools,
prefix caching off, recurrent checkpoints, hash algorithm, typical length, tensor
parallelism, and drafters where the catalog has one (DSpark, MTP, EAGLE-3, DFlash) with
random lookahead and acceptance. ``--checked`` verifies the manager's invariants after
every call (a block in two tables, a wrong refcount, a leak). What must hold:

- exit 0 with JSON on stdout;
- exit 2: exactly one ``pagedkv: error:`` line besides ``pagedkv: warning:`` lines, and
  not from a broken invariant (``CacheCorruptedError``, ``MetadataError`` raised inside:
  harness.INVARIANT_ERRORS; the CLI prints them as its one error line);
- no hang: a case still running after --limit seconds is SLOW (default 60: the longest
  case in 2,318 took 15 s on the 2-core CPU machine, seed 1086; a hang is endless).

The draws are those of the first throwaway script, seed for seed.

    PYTHONPATH=src OMP_NUM_THREADS=1 python fuzz/simulate.py --start 0 --count 100
"""

from __future__ import annotations

import argparse
import json
import random
import shlex

import harness

MODELS = ["deepseek-v2-lite", "deepseek-v3", "deepseek-v3.2", "gemma-2-9b", "gemma-3-27b",
          "gpt-oss-120b", "gpt-oss-20b", "jamba-v0.1", "kimi-k2", "kimi-k3", "llama-3-70b",
          "llama-3-8b", "llama-4-scout", "minimax-m1", "mistral-7b", "nemotron-h-8b", "qwen3-8b",
          "qwen3-next-80b"]
DRAFTS = {"kimi-k3": ["kimi-k3-dspark"], "deepseek-v3": ["mtp"], "deepseek-v3.2": ["mtp"],
          "llama-3-8b": ["llama-3-8b-eagle3"], "qwen3-8b": ["qwen3-8b-dflash"]}


def draw(seed: int, args: argparse.Namespace) -> list[str]:
    rng = random.Random(seed)
    model = rng.choice(args.models)
    argv = ["simulate", model, "--checked", "--json", "--seed", str(seed),
            "--workload", rng.choice(["agentic", "chat", "long-context", "shared-prefix"]),
            "--requests", str(rng.randint(5, 60)),
            "--max-model-len", str(rng.choice([256, 1024, 4096, 16384]))]
    if model in DRAFTS and rng.random() < 0.5:
        argv += ["--draft", rng.choice(DRAFTS[model]), "--spec-tokens", str(rng.randint(1, 8)),
                 "--acceptance", str(rng.choice([0.0, 0.3, 0.7, 1.0]))]
    if rng.random() < 0.5:
        argv += ["--block-size", str(rng.choice([1, 4, 16, 32, 64, 128]))]
    if rng.random() < 0.3:
        argv += ["--kv-dtype", rng.choice(["bf16", "fp8", "fp8_ds_mla"])]
    argv += ["--memory", rng.choice(["64MiB", "256MiB", "1GiB", "4GiB", "16GiB"])]
    if rng.random() < 0.4:
        argv += ["--max-batched-tokens", str(rng.choice([64, 256, 512, 2048, 8192]))]
    if rng.random() < 0.3:
        argv += ["--max-running", str(rng.randint(1, 64))]
    if rng.random() < 0.3:
        argv += ["--fixed-pools"]
    if rng.random() < 0.2:
        argv += ["--no-prefix-caching"]
    if rng.random() < 0.3:
        argv += [rng.choice(["--no-checkpoints", "--checkpoint-every=1", "--checkpoint-every=4"])]
    if rng.random() < 0.3:
        argv += ["--hash", rng.choice(["sha256", "fast-single-tenant", "xxh3_128"])]
    if rng.random() < 0.2:
        argv += ["--typical-len", str(rng.choice([128, 512, 2048]))]
    if rng.random() < 0.15:
        argv += ["--tp", str(rng.choice([2, 4, 8]))]
    return argv


def describe(argv: list[str]) -> str:
    return "pagedkv " + shlex.join(argv)


def check(argv: list[str], args: argparse.Namespace) -> None:
    rc, out, err = harness.run_cli(argv)
    harness.check_exit(rc, out, err)
    try:
        json.loads(out)
    except json.JSONDecodeError as e:
        raise harness.Bad(f"exit 0 but stdout is not JSON ({e}): {out[:500]}") from None


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", type=lambda s: s.split(","), default=MODELS,
                   help="comma-separated catalog names (default: eighteen)")


if __name__ == "__main__":
    harness.main(__doc__, add_flags, draw, describe, check, limit=60)
