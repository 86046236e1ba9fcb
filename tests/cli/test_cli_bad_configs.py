"""Random damage to real configs: ``pagedkv plan`` either plans or exits 2 with one error
line, never a traceback (the CLI contract), whatever a field is replaced by or dropped.

The mutations are seeded (a failure names its seed and mutation, so it reproduces); the
cases this kind of search found once are pinned by name in test_cli_plan.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pagedkv.models import catalog

CATALOG = sorted((Path(catalog.__file__).parent / "catalog").glob("*.json"))
# values of the wrong kind or size for any field: what hand edits and broken exports produce
BAD = [None, -1, 0, 1.5, "x", "16", [], {}, True, 10**12, float("nan"), [1, "a"], -0.5]


def _paths(obj, prefix=()):
    """Every key path of a config (lists: their first three entries)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield (*prefix, key)
            yield from _paths(value, (*prefix, key))
    elif isinstance(obj, list) and len(obj) < 200:
        for i, value in enumerate(obj[:3]):
            yield (*prefix, i)
            yield from _paths(value, (*prefix, i))


def _mutate(cfg: dict, rng: random.Random) -> str:
    path = rng.choice(list(_paths(cfg)))
    parent = cfg
    for key in path[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and rng.random() < 0.3:
        del parent[path[-1]]
        return f"del {path}"
    value = rng.choice(BAD)
    parent[path[-1]] = value
    return f"{path} = {value!r}"


@pytest.mark.parametrize("seed", range(4))
def test_damaged_configs_plan_or_exit_2_in_one_line(tmp_path, cli, seed):
    rng = random.Random(seed)
    for i in range(60):
        source = rng.choice(CATALOG)
        cfg = json.loads(source.read_text())
        what = [_mutate(cfg, rng) for _ in range(rng.choice((1, 1, 2)))]
        path = tmp_path / f"{i}.json"
        path.write_text(json.dumps(cfg))
        argv = ["plan", str(path), "--memory", "40GiB"]
        if rng.random() < 0.3:
            argv += ["--kv-dtype", rng.choice(("fp8", "bf16", "fp8_ds_mla"))]
        code, _, err = cli(*argv)
        errors = [line for line in err.splitlines() if not line.startswith("pagedkv: warning:")]
        where = f"seed {seed}, case {i}: {source.name} {what} {argv[2:]}"
        assert code in (0, 2), (where, err)
        assert "Traceback" not in err, (where, err)
        assert len(errors) == (code == 2), (where, err)
        if code == 2:
            assert errors[0].startswith("pagedkv: error:"), (where, err)
