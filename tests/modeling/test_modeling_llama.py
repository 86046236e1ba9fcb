"""Llama (3.1 RoPE scaling too), Mistral, Qwen2 and Qwen3 (with per-layer sliding windows) over pagedkv give
transformers' logits at every computed position: prefill, chunked prefill, decode, prefix
hits and preempted-then-recomputed requests, with NaN-filled free pages and shuffled
blocks; and transformers' greedy tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine_check import budget_for, hf_greedy, max_logit_diff, options, prompts, randomize_, run  # noqa: E402

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
    randomize_(model, 1)
    return model


ARCHS = ["llama", "llama31", "mistral", "qwen2", "qwen3"]
CACHE_TOKENS = {"llama": 40, "llama31": 40, "mistral": 24, "qwen2": 40, "qwen3": 26}  # small enough to preempt


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_through_chunks_and_preemption(arch):
    hf = tiny(arch)
    v = hf.config.vocab_size
    a, b, c = prompts(v, (13, 6, 19), seed=3)
    # a small cache: three requests cannot all hold their blocks, so one is preempted
    opts = options(kv_cache_bytes=budget_for(hf, CACHE_TOKENS[arch]), max_model_len=32, max_batched_tokens=8)
    engine = run(hf, [a, b, c], opts, new=6)
    assert engine.preemptions > 0
    assert max_logit_diff(hf, engine) <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_with_prefix_hits(arch):
    hf = tiny(arch)
    a, b = prompts(hf.config.vocab_size, (13, 6), seed=4)
    opts = options(max_batched_tokens=8)
    engine = run(hf, [a], opts, new=3)
    # later requests sharing a's first 10 tokens (and a's whole turn) hit a's cached blocks
    turn = a + engine.outputs[0].token_ids
    run(hf, [a[:10] + b, turn + b], opts, new=4, engine=engine)
    hits = [engine.requests[o.rid].hit_tokens for o in engine.outputs[1:]]
    assert hits == [8, 12]
    assert max_logit_diff(hf, engine) <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_transformers_generate(arch):
    hf = tiny(arch)
    ps = prompts(hf.config.vocab_size, (5, 11, 3), seed=5)
    engine = run(hf, ps, options(max_batched_tokens=6, record_logits=False), new=8)
    for out, p in zip(engine.outputs, ps):
        assert out.token_ids == hf_greedy(hf, p, 8)
