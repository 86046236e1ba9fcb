"""Qwen3-Next (gated delta net hybrid): the tiny model the scenarios run
(test_modeling_hybrids) has both mixers, a dense MLP and a MoE layer, and a partial RoPE."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import hybrid_harness as hh  # noqa: E402


def test_layer_mix():
    tiny = hh.tiny("qwen3_next")
    assert tiny.config.layer_types == ["linear_attention", "full_attention"] * 2
    kinds = {type(layer.mlp).__name__ for layer in tiny.ours.model.layers}
    assert kinds == {"GatedMLP", "Qwen3NextSparseMoe"}
    assert tiny.ours.model.rotary_emb.rotary_dim < tiny.ours.model.layers[1].self_attn.head_dim
