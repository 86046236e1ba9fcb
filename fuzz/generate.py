"""Random ``pagedkv generate --tiny ARCH --verify --json`` runs, in-process.

Each case is one command line: a tiny random-weight model of a catalog architecture, random
prompt counts and lengths, block sizes, batch and model-length limits, small cache budgets,
sampling, and a drafter (scripted, MTP, DSpark, EAGLE-3) with random lookahead. What must
hold:

- exit 0: the JSON says ``match`` is true (every logit row within the CLI's fp32 tolerance
  of transformers' own forward), ``lossless`` is not false with a drafter (speculative
  greedy output equals the plain run's), and every request finished;
- exit 2: exactly one ``pagedkv: error:`` line on stderr besides ``pagedkv: warning:``
  lines (a refusal the CLI explains, never a traceback), and not from a broken invariant
  (a ``MetadataError`` or ``CacheCorruptedError`` raised inside: harness.INVARIANT_ERRORS;
  the engine's pools past its cache tensors, 131c67e, showed as such an error line);
- anything else (another exit status, an exception, a hang past --limit) is BAD/SLOW.

``--dtypes`` also draws bf16/fp16 models (30% of cases). Off by default: a 16-bit run of a
MoE model can fail --verify by a router top-k flip (docs/engine.md), which is not an engine
bug. The draws are those of the first throwaway script, seed for seed.

    PYTHONPATH=src OMP_NUM_THREADS=1 python fuzz/generate.py --start 0 --count 40
"""

from __future__ import annotations

import argparse
import json
import random
import shlex

import harness

ARCHS = ["llama-3-8b", "qwen3-8b", "mistral-7b", "gemma-3-27b", "gpt-oss-20b",
         "deepseek-v3", "deepseek-v2-lite", "kimi-k3", "qwen3-next-80b", "nemotron-h-8b"]
DRAFTS = [None, None, "scripted", "mtp", "dspark", "eagle3"]  # None twice: half plain


def draw(seed: int, args: argparse.Namespace) -> list[str]:
    rng = random.Random(seed)
    argv = ["generate", "--tiny", rng.choice(args.archs), "--verify", "--json",
            "--seed", str(seed), "--prompts", str(rng.randint(1, 6)),
            "--prompt-len", str(rng.randint(1, 40)),
            "--max-new-tokens", str(rng.randint(1, 20)),
            "--block-size", str(rng.choice([1, 2, 4, 8, 16, 32]))]
    if rng.random() < 0.5:
        argv += ["--max-batched-tokens", str(rng.randint(1, 64))]
    if rng.random() < 0.8:
        short, long = rng.randint(8, 128), rng.randint(128, 2048)
        argv += ["--max-model-len", str(rng.choice([short, long]))]
    if rng.random() < 0.4:
        argv += ["--kv-cache-mib", str(rng.choice([1, 2, 4]))]
    if args.dtypes and rng.random() < 0.3:
        argv += ["--dtype", rng.choice(["bf16", "fp16"])]
    if rng.random() < 0.3:
        argv += ["--temperature", str(rng.choice([0.5, 1.0])),
                 "--top-k", str(rng.randint(1, 50))]
    draft = rng.choice(DRAFTS)
    if draft:
        argv += ["--draft", draft, "--spec-tokens", str(rng.randint(1, 8))]
    return argv


def describe(argv: list[str]) -> str:
    return "pagedkv " + shlex.join(argv)


def check(argv: list[str], args: argparse.Namespace) -> None:
    rc, out, err = harness.run_cli(argv)
    harness.check_exit(rc, out, err)
    try:
        result = json.loads(out)
    except json.JSONDecodeError as e:
        raise harness.Bad(f"exit 0 but stdout is not JSON ({e}): {out[:500]}") from None
    failed = [key for key, good in (("match", result.get("match") is True),
                                    ("lossless", result.get("lossless", True) is not False),
                                    ("finished", "requests" in result
                                     and result.get("finished") == result["requests"]))
              if not good]
    if failed:
        raise harness.Bad(f"{', '.join(failed)} wrong: {out[:1500]}\nstderr: {err[-500:]}")


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--archs", type=lambda s: s.split(","), default=ARCHS,
                   help="comma-separated catalog names (default: all ten)")
    p.add_argument("--dtypes", action="store_true",
                   help="also draw bf16/fp16 (MoE routing flips fail --verify: not bugs)")


if __name__ == "__main__":
    harness.main(__doc__, add_flags, draw, describe, check, limit=120)
