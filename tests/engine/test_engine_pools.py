"""The engine's block manager hands out only block ids its cache tensors hold.

The engine allocates each pool's tensors once, at the plan's size; the block manager's
pools must be those sizes. An elastic manager (``KVCacheManager.from_plan``'s default,
for an engine that maps physical pages) lets a pool grow into the others' bytes: over
fixed tensors that gave a Kimi-Linear target with a DSpark drafter recurrent slots past
its 7-slot state tensors (an IndexError on the CPU; out-of-bounds reads and writes in a
GPU kernel), found by random ``pagedkv generate`` runs."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pagedkv.blocks import KVCacheManager  # noqa: E402
from pagedkv.cli import main  # noqa: E402
from pagedkv.engine import Engine, EngineOptions  # noqa: E402
from pagedkv.engine.runner import ModelRunner  # noqa: E402
from pagedkv.engine.speculative import SpeculativeEngine, make_drafter  # noqa: E402
from pagedkv.engine.tiny import tiny_model  # noqa: E402
from pagedkv.errors import InvalidArgumentError  # noqa: E402


def _k3_dspark(block_size: int = 16) -> SpeculativeEngine:
    hf = tiny_model("kimi-k3")
    opts = EngineOptions(block_size=block_size, spec_tokens=3, max_model_len=4096)
    drafter = make_drafter("dspark", hf.config, script={}, weights=None, seed=0, dspark_block=4)
    return SpeculativeEngine(hf, opts, drafter)


def _rows(engine: Engine) -> dict[int, int]:
    """Per group id: the blocks (or state slots) its cache tensors hold."""
    return {gid: min(t.shape[0] for t in tensors)
            for gid, tensors in engine.runner.group_tensors.items() if tensors}


@pytest.mark.parametrize(("name", "max_model_len"), [
    ("llama-3-8b", 512), ("gpt-oss-20b", 512), ("gemma-3-27b", 1024), ("qwen3-next-80b", 4096),
    ("kimi-k3", 4096)])
def test_every_pool_hands_out_only_ids_its_tensors_hold(name, max_model_len):
    engine = Engine(tiny_model(name), EngineOptions(block_size=8, max_model_len=max_model_len))
    rows = _rows(engine)
    pools = {gid: gm.pool.num_blocks for gm, gid in zip(engine.manager.managers, engine.runner.gids)}
    assert rows and set(rows) <= set(pools)
    for gid, n in rows.items():
        assert pools[gid] <= n, (gid, pools[gid], n)


def test_a_recurrent_target_with_a_dspark_drafter_keeps_its_slots_inside_the_state_tensors():
    engine = _k3_dspark()
    rows = _rows(engine)
    recurrent = [g.id for g in engine.plan.groups if g.is_recurrent]
    assert recurrent
    for gm, gid in zip(engine.manager.managers, engine.runner.gids):
        if gid in rows:
            assert gm.pool.num_blocks <= rows[gid], (gid, gm.pool.num_blocks, rows[gid])


def test_the_runner_refuses_an_elastic_manager_over_fixed_tensors():
    engine = Engine(tiny_model("gemma-3-27b"), EngineOptions(block_size=8, max_model_len=1024))
    elastic = KVCacheManager.from_plan(engine.plan)  # ceilings from the whole budget
    rows = _rows(engine)
    over = [gid for gm, gid in zip(elastic.managers, engine.runner.gids)
            if gid in rows and gm.pool.num_blocks > rows[gid]]
    assert over, "this plan's elastic ceilings no longer exceed its pools; pick another"
    with pytest.raises(InvalidArgumentError, match=f"group {over[0]}:.*elastic=False"):
        ModelRunner(engine.model, engine.plan, engine.specs, elastic,
                    device=torch.device("cpu"), kv_dtype=torch.float32)


def test_generate_kimi_k3_with_dspark_and_more_requests_than_the_auto_budget_matches():
    """The run that found it: five prompts sharing their first half, where the cache is
    sized for four requests; every logit row within fp32 rounding of transformers'."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["generate", "--tiny", "kimi-k3", "--draft", "dspark", "--prompts", "5",
                   "--prompt-len", "40", "--max-new-tokens", "6", "--block-size", "16",
                   "--verify", "--json"])
    result = json.loads(out.getvalue())
    assert rc == 0
    assert result["finished"] == result["requests"] == 5
    assert result["match"] is True and result["lossless"] is True
