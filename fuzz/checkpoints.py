"""Random damage to a checkpoint's config.json, through ``pagedkv generate --model DIR``.

Each case takes a saved tiny random-weight checkpoint of a catalog architecture (built once
per architecture, in a temporary folder), changes one or two fields of its config.json
(nested ones included: RoPE parameters, layer patterns, linear-attention settings) to a
value drawn from zero, negatives, halves and doubles, wrong types, NaN, 10^12, a list one
entry short or long, and runs ``pagedkv generate --model`` on a copy (weights linked,
not copied), half the time with ``--verify --json``. What must hold:

- exit 0, and with --verify the JSON's ``match`` true (a value the model code takes must
  give transformers' logits);
- or exit 2 with exactly one ``pagedkv: error:`` line (harness.check_exit): the field
  named, never a traceback out of torch or transformers;
- anything else (a traceback, exit 1, a hang past --limit) is BAD/SLOW.

Found (2026-12-05, the throwaway script this was made from, 750 seeds): 54 tracebacks on
main at a43e5de (an unknown rope_type, negative or impossible sizes, experts past the
config's, top-k at the first token, --verify's reference failing in transformers) and NaN
logits from a RoPE base below zero; fixed in the commits that added this file.

    PYTHONPATH=src OMP_NUM_THREADS=1 python fuzz/checkpoints.py --start 0 --count 40
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import math
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import harness

ARCHS = ["llama-3-8b", "qwen3-8b", "mistral-7b", "gemma-3-27b", "gpt-oss-20b",
         "deepseek-v3", "deepseek-v2-lite", "kimi-k3", "qwen3-next-80b", "nemotron-h-8b"]
KEEP = ("architectures", "model_type", "auto_map", "transformers_version")  # not damaged
ODD = [0, -1, 1, 2, 3, 7, 1.5, -0.5, "x", None, [], {}, [1, 2], True, 10**12, math.nan,
       1e-30, 65536]
_SAVED: dict[str, Path] = {}  # architecture -> its saved checkpoint (setup)


@dataclass
class Case:
    arch: str
    damage: list[tuple[list, object]]  # (path into config.json, new value)
    argv: list[str]  # generate's flags after --model DIR


def _leaves(obj: object, path: list) -> list[list]:
    """Paths of every damageable value: leaves, and short lists as a whole."""
    if isinstance(obj, dict):
        return [p for k, v in obj.items() if k not in KEEP for p in _leaves(v, [*path, k])]
    if isinstance(obj, list) and obj and len(obj) < 40:
        return [path] + [p for i, v in enumerate(obj) for p in _leaves(v, [*path, i])]
    return [path]


def _config(arch: str) -> dict:
    return json.loads((_SAVED[arch] / "config.json").read_text())


def draw(seed: int, args: argparse.Namespace) -> Case:
    rng = random.Random(seed)
    arch = rng.choice(args.archs)
    cfg = _config(arch)
    damage = []
    for _ in range(rng.choice([1, 1, 2])):
        path = rng.choice(_leaves(cfg, []))
        node = cfg
        for key in path[:-1]:
            node = node[key]
        old = node[path[-1]]
        number = isinstance(old, (int, float)) and not isinstance(old, bool)
        if number and rng.random() < 0.5:
            new = rng.choice([old * 2, old // 2 if isinstance(old, int) else old / 2,
                              old + 1, max(old - 1, 0), -old])
        elif isinstance(old, list) and old and rng.random() < 0.5:
            new = old[:-1] if rng.random() < 0.5 else old + old[-1:]
        else:
            new = copy.deepcopy(rng.choice(ODD))  # (a later damage may edit inside it)
        node[path[-1]] = new
        damage.append((path, new))
    argv = ["--prompts", "2", "--prompt-len", str(rng.choice([6, 12, 20])),
            "--max-new-tokens", "3", "--block-size", str(rng.choice([4, 16]))]
    if rng.random() < 0.5:
        argv += ["--verify", "--json"]
    return Case(arch, damage, argv)


def describe(case: Case) -> str:
    damage = ", ".join(f"{'.'.join(map(str, p))}={v!r}" for p, v in case.damage)
    return f"{case.arch} config.json: {damage}; generate {' '.join(case.argv)}"


def check(case: Case, args: argparse.Namespace) -> None:
    folder = Path(tempfile.mkdtemp(prefix="pagedkv-fuzz-"))
    try:
        for f in _SAVED[case.arch].iterdir():
            if f.name != "config.json":
                (folder / f.name).symlink_to(f)
        cfg = _config(case.arch)
        for path, value in case.damage:
            node = cfg
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value
        (folder / "config.json").write_text(json.dumps(cfg))
        rc, out, err = harness.run_cli(["generate", "--model", str(folder), *case.argv])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    harness.check_exit(rc, out, err)
    if "--verify" in case.argv and json.loads(out).get("match") is not True:
        raise harness.Bad(f"exit 0 but --verify does not match: {out[:800]}")


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--archs", type=lambda s: s.split(","), default=ARCHS,
                   help="comma-separated catalog names (default: all ten)")


def setup(args: argparse.Namespace) -> None:
    """Save each architecture's tiny checkpoint once (removed at exit)."""
    import atexit

    import torch

    from pagedkv.engine.tiny import tiny_model

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="pagedkv-fuzz-checkpoints-"))
    atexit.register(shutil.rmtree, root, True)
    for arch in args.archs:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            tiny_model(arch).save_pretrained(root / arch)
        _SAVED[arch] = root / arch


if __name__ == "__main__":
    harness.main(__doc__, add_flags, draw, describe, check, limit=60, setup=setup)
