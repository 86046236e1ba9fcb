"""Nemotron-H (Mamba-2 hybrid) over pagedkv against transformers (tiny fp32 models).

Mamba-2 conv and SSM state live in pagedkv state slots, attention K/V in paged blocks;
logits must equal transformers' dense forward within 1e-4 at every computed position, and
greedy generation must equal ``generate`` token for token (scenarios: hybrid_harness).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hybrid_harness as hh  # noqa: E402

from pagedkv.modeling.nemotron_h import NemotronHForCausalLM  # noqa: E402


@pytest.fixture(scope="module")
def models():
    config = transformers.NemotronHConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, mamba_num_heads=4, mamba_head_dim=8,
        ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=4, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16, n_group=2, topk_group=1,
        layers_block_type=["linear_attention", "mlp", "full_attention", "moe",
                           "linear_attention", "mlp"],
        dtype="float32", max_position_embeddings=64,
    )
    torch.manual_seed(0)
    hf = transformers.NemotronHForCausalLM(config).eval()
    hh.perturb_(hf, seed=2)
    ours = NemotronHForCausalLM(config).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours, config


def test_block_mix(models):
    """The tiny model has every block kind, and Mamba chunks (4) shorter than the prompts."""
    _, ours, config = models
    kinds = [type(layer.mixer).__name__ for layer in ours.model.layers]
    assert kinds == ["Mamba2Mixer", "NemotronHMLP", "GQAAttention", "NemotronHMoE",
                     "Mamba2Mixer", "NemotronHMLP"]
    assert config.chunk_size == 4


@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_chunked_prefill_and_decode_in_one_batch(models, seed):
    assert hh.mixed_batch(*models, seed=seed) <= hh.TOL


def test_prefix_hit_restored_from_mid_chunk_checkpoint(models):
    assert hh.prefix_hit_interval(*models) <= hh.TOL


def test_prefix_hit_takes_the_checkpoint_over_when_no_slot_is_free(models):
    assert hh.prefix_hit_take_over(*models) <= hh.TOL


def test_prefix_hit_next_turn_default_policy(models):
    assert hh.prefix_hit_next_turn(*models) <= hh.TOL


@pytest.mark.parametrize("every", [None, 2])
def test_preempted_then_recomputed(models, every):
    assert hh.preempt_recompute(*models, every=every) <= hh.TOL


def test_checkpoint_round_trip(models, tmp_path):
    assert hh.checkpoint_round_trip(models[0], NemotronHForCausalLM, tmp_path) <= hh.TOL


# --- through the engine (scheduler, runner, loader from the in-memory model) -------------

def test_engine_logits_with_preemption(models):
    assert hh.engine_preemption(models[0], kv_cache_bytes=18000) <= hh.TOL


@pytest.mark.parametrize("every, hits", [(None, [0, 16]), (1, [8, 16])])
def test_engine_logits_with_checkpoint_prefix_hits(models, every, hits):
    assert hh.engine_prefix_hits(models[0], every, hits) <= hh.TOL


def test_engine_greedy_tokens_equal_transformers_generate(models):
    hh.engine_greedy(models[0])  # raises on the first differing request
