"""The hybrid models over pagedkv against transformers (tiny fp32 models, random weights):
Nemotron-H (Mamba-2 conv and SSM state) and Qwen3-Next (gated delta net state) in pagedkv
state slots, attention K/V in paged blocks. Logits must equal transformers' dense forward
within 1e-4 at every computed position, and greedy generation must equal ``generate``
token for token (scenarios: hybrid_harness, then the engine's scheduler: engine_check).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import engine_check as ec  # noqa: E402
import hybrid_harness as hh  # noqa: E402


@pytest.fixture(scope="module", params=hh.HYBRIDS)
def tiny(request):
    return hh.tiny(request.param)


@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_chunked_prefill_and_decode_in_one_batch(tiny, seed):
    assert hh.mixed_batch(tiny.hf, tiny.ours, tiny.config, seed=seed) <= hh.TOL


def test_prefix_hit_restored_from_mid_chunk_checkpoint(tiny):
    assert hh.prefix_hit_interval(tiny.hf, tiny.ours, tiny.config) <= hh.TOL


def test_prefix_hit_takes_the_checkpoint_over_when_no_slot_is_free(tiny):
    assert hh.prefix_hit_take_over(tiny.hf, tiny.ours, tiny.config) <= hh.TOL


def test_prefix_hit_next_turn_default_policy(tiny):
    assert hh.prefix_hit_next_turn(tiny.hf, tiny.ours, tiny.config) <= hh.TOL


@pytest.mark.parametrize("every", [None, 2])
def test_preempted_then_recomputed(tiny, every):
    assert hh.preempt_recompute(tiny.hf, tiny.ours, tiny.config, every=every) <= hh.TOL


def test_checkpoint_round_trip(tiny, tmp_path):
    assert hh.checkpoint_round_trip(tiny.hf, type(tiny.ours), tmp_path) <= hh.TOL


# --- through the engine (scheduler, runner, loader from the in-memory model) -------------

def test_engine_logits_with_preemption(tiny):
    """Three long requests in a small cache: the victims recompute (new state slots, their
    checkpoints perhaps gone)."""
    assert ec.preempted_logit_diff(tiny.hf, tiny.preempt_bytes, (21, 23, 25), new=7) <= ec.TOL


@pytest.mark.parametrize("every, hits", [(None, [0, 16]), (1, [8, 16])])
def test_engine_logits_with_checkpoint_prefix_hits(tiny, every, hits):
    """Hits come from recurrent checkpoints: by default the last boundary a computed (16),
    with ``every`` also every block."""
    opts = ec.options(max_batched_tokens=8, recurrent_checkpoint_every=every)
    got, diff = ec.prefix_hits_and_logit_diff(tiny.hf, opts, first_new=6)
    assert got == hits
    assert diff <= ec.TOL


def test_engine_greedy_tokens_equal_transformers_generate(tiny):
    ours, theirs = ec.greedy_tokens(tiny.hf, (5, 11, 3))
    assert ours == theirs
