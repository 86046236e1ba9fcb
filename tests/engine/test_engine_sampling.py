"""Sampling: top-k / top-p supports and temperature frequencies against hand-computed
distributions; seeded requests draw the same tokens whatever the batch."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_check import options, prompts  # noqa: E402

from pagedkv.engine import Engine, SamplingParams  # noqa: E402
from pagedkv.engine.sampler import sample  # noqa: E402
from pagedkv.engine.tiny import tiny_model  # noqa: E402

LOGITS = [math.log(p) for p in (0.05, 0.5, 0.15, 0.3)]  # token 1 > 3 > 2 > 0


def draws(params, n=3000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.tensor(LOGITS)
    counts = [0] * 4
    for _ in range(n):
        counts[sample(logits, params, gen)] += 1
    return [c / n for c in counts]


def test_greedy_is_argmax():
    assert sample(torch.tensor(LOGITS), SamplingParams(), None) == 1


def test_temperature_one_follows_softmax():
    freq = draws(SamplingParams(temperature=1.0))
    for got, want in zip(freq, (0.05, 0.5, 0.15, 0.3)):
        assert abs(got - want) < 0.03


def test_temperature_two_flattens():
    weights = [p ** 0.5 for p in (0.05, 0.5, 0.15, 0.3)]
    want = [w / sum(weights) for w in weights]
    for got, w in zip(draws(SamplingParams(temperature=2.0)), want):
        assert abs(got - w) < 0.03


def test_top_k_keeps_the_k_best():
    freq = draws(SamplingParams(temperature=1.0, top_k=2))
    assert freq[0] == freq[2] == 0.0
    assert abs(freq[1] - 0.5 / 0.8) < 0.03


def test_top_p_keeps_the_smallest_set_reaching_p():
    freq = draws(SamplingParams(temperature=1.0, top_p=0.7))  # 0.5 + 0.3 reaches 0.7
    assert freq[0] == freq[2] == 0.0
    assert abs(freq[3] - 0.3 / 0.8) < 0.03


def test_seeded_requests_do_not_depend_on_the_batch():
    hf = tiny_model("qwen3-8b")
    a, b, c = prompts(hf.config.vocab_size, (6, 9, 4), seed=2)
    hot = SamplingParams(max_new_tokens=6, temperature=1.5, top_p=0.9, seed=11, ignore_eos=True)
    other = SamplingParams(max_new_tokens=3, temperature=1.0, seed=5, ignore_eos=True)
    alone = Engine(hf, options(record_logits=False)).generate([a], hot)[0].token_ids
    mixed = Engine(hf, options(record_logits=False, max_batched_tokens=5)).generate(
        [b, a, c], [other, hot, other])[1].token_ids
    assert alone == mixed
    reseeded = Engine(hf, options(record_logits=False)).generate(
        [a], SamplingParams(**{**hot.__dict__, "seed": 12}))[0].token_ids
    assert reseeded != alone  # 6 draws at temperature 1.5 over 256 tokens
