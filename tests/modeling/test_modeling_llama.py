"""Llama (3.1 RoPE scaling too), Mistral, Qwen2 and Qwen3 (with per-layer sliding windows) over pagedkv give
transformers' logits at every computed position: prefill, chunked prefill, decode, prefix
hits and preempted-then-recomputed requests, with NaN-filled free pages and shuffled
blocks; and transformers' greedy tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import engine_check as ec  # noqa: E402

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)


def tiny(arch: str):
    import torch

    if arch == "llama":
        cfg = transformers.LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True)
        cls = transformers.LlamaForCausalLM
    elif arch == "llama31":  # Llama 3.1's frequency-dependent RoPE scaling
        rope = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        cfg = transformers.LlamaConfig(**SMALL, rope_parameters=rope)
        cls = transformers.LlamaForCausalLM
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**SMALL, sliding_window=6)
        cls = transformers.MistralForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**SMALL, tie_word_embeddings=True)
        cls = transformers.Qwen2ForCausalLM
    else:
        cfg = transformers.Qwen3Config(**{**SMALL, "num_hidden_layers": 3}, head_dim=24,
                                       use_sliding_window=True, sliding_window=5,
                                       layer_types=["sliding_attention", "full_attention",
                                                    "sliding_attention"])
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    ec.randomize_(model, 1)
    return model


ARCHS = ["llama", "llama31", "mistral", "qwen2", "qwen3"]
CACHE_TOKENS = {"llama": 40, "llama31": 40, "mistral": 24, "qwen2": 40, "qwen3": 26}  # small enough to preempt


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_through_chunks_and_preemption(arch):
    hf = tiny(arch)
    assert ec.preempted_logit_diff(hf, ec.budget_for(hf, CACHE_TOKENS[arch])) <= ec.TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_with_prefix_hits(arch):
    hits, diff = ec.prefix_hits_and_logit_diff(tiny(arch))
    assert hits == [8, 12]
    assert diff <= ec.TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_transformers_generate(arch):
    ours, theirs = ec.greedy_tokens(tiny(arch), (5, 11, 3))
    assert ours == theirs
