"""Random damage to catalog configs, and random flags, through ``pagedkv plan --json``.

Each case takes a catalog config (tests/cli/test_cli_bad_configs.py does the same 240
times in the suite), replaces or drops one or two fields anywhere in it (nested ones
included) with a value of the wrong kind or size, writes it to a file and plans it with
random flags: memory, KV dtype, block size, max-model-len, max-batched-tokens,
typical length, TP/PP and a drafter. What must hold:

- exit 2 with exactly one ``pagedkv: error:`` line (harness.check_exit);
- or exit 0 with a plan whose every rank uses at most the budget, and whose every tensor
  view lies inside its pool;
- anything else (a traceback, another status, a hang past --limit) is BAD/SLOW.

    PYTHONPATH=src python fuzz/plan.py --start 0 --count 1000
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import tempfile
from pathlib import Path

import harness

BAD = [None, -1, 0, 1, 2, 1.5, "x", "16", [], {}, True, 10**12, math.nan, [1, "a"], -0.5]
DRAFTS = ["mtp", "kimi-k3-dspark", "llama-3-8b-eagle3", "qwen3-8b-dflash"]
# the drafter each target takes (a random other one, rarely: its refusal is one line too)
OWN_DRAFT = {"deepseek-v3": "mtp", "deepseek-v3.2": "mtp", "kimi-k3": "kimi-k3-dspark",
             "llama-3-8b": "llama-3-8b-eagle3", "qwen3-8b": "qwen3-8b-dflash"}
_FILES = Path(tempfile.mkdtemp(prefix="pagedkv-fuzz-plan-"))


def _catalog() -> list[Path]:
    from pagedkv.models import catalog

    return sorted((Path(catalog.__file__).parent / "catalog").glob("*.json"))


def _paths(obj: object, prefix: tuple = ()) -> list[tuple]:
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in [(*prefix, k), *_paths(v, (*prefix, k))]]
    if isinstance(obj, list) and len(obj) < 200:
        return [p for i, v in enumerate(obj[:3]) for p in [(*prefix, i), *_paths(v, (*prefix, i))]]
    return []


def draw(seed: int, args: argparse.Namespace) -> list[str]:
    rng = random.Random(seed)
    source = rng.choice(_catalog())
    cfg = json.loads(source.read_text())
    for _ in range(rng.choice([0, 1, 1, 2])):
        path = rng.choice(_paths(cfg))
        parent = cfg
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and rng.random() < 0.3:
            del parent[path[-1]]
        elif isinstance(parent[path[-1]], int) and not isinstance(parent[path[-1]], bool) \
                and rng.random() < 0.4:
            old = parent[path[-1]]
            parent[path[-1]] = rng.choice([old * 2, old // 2, old + 1, old - 1, -old])
        else:
            parent[path[-1]] = copy.deepcopy(rng.choice(BAD))  # (a later damage may edit inside it)
    file = _FILES / f"{seed}-{source.name}"
    file.write_text(json.dumps(cfg))
    argv = ["plan", str(file), "--json",
            "--memory", rng.choice(["64MiB", "1GiB", "40GiB", "40GiB", "141GB", "1TiB", "1"])]
    flags = {"--kv-dtype": ["bf16", "fp16", "fp8", "fp8_ds_mla"],
             "--block-size": ["1", "16", "16", "64", "256", "3"],
             "--max-model-len": ["1", "128", "4096", "131072", "10000000"],
             "--max-batched-tokens": ["1", "512", "8192"],
             "--typical-len": ["1", "1024", "65536"],
             "--tp": ["1", "2", "8", "3"], "--pp": ["1", "2", "4"]}
    for flag, values in flags.items():
        if rng.random() < 0.25:
            argv += [flag, rng.choice(values)]
    own = OWN_DRAFT.get(source.stem)
    draft = own if own and rng.random() < 0.5 else (
        rng.choice(DRAFTS) if rng.random() < 0.05 else None)
    if draft:
        argv += ["--draft", draft]
    return argv


def describe(argv: list[str]) -> str:
    return "pagedkv " + " ".join(argv)


def check(argv: list[str], args: argparse.Namespace) -> None:
    try:
        rc, out, err = harness.run_cli(argv)
    finally:
        Path(argv[1]).unlink(missing_ok=True)
    harness.check_exit(rc, out, err)
    plan = json.loads(out)
    budget = plan["budget_bytes"]
    over = [r for r in plan["rank_usage"] if r["used_bytes"] > budget]
    if over:
        raise harness.Bad(f"ranks over the budget {budget}: {over[:3]}")
    pools = {p["id"]: p["nbytes"] for p in plan["pools"]}
    outside = [v for v in plan["views"]
               if v["offset"] < 0 or v["offset"] + v["nbytes"] > pools[v["pool"]]]
    if outside:
        raise harness.Bad(f"views outside their pools: {outside[:3]}")


if __name__ == "__main__":
    harness.main(__doc__, None, draw, describe, check, limit=60)
