"""Nemotron-H (Mamba-2 hybrid): the tiny model the scenarios run (test_modeling_hybrids)
has every block kind, and Mamba chunks shorter than the prompts."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import hybrid_harness as hh  # noqa: E402


def test_block_mix():
    tiny = hh.tiny("nemotron_h")
    kinds = [type(layer.mixer).__name__ for layer in tiny.ours.model.layers]
    assert kinds == ["Mamba2Mixer", "NemotronHMLP", "GQAAttention", "NemotronHMoE",
                     "Mamba2Mixer", "NemotronHMLP"]
    assert tiny.config.chunk_size == 4
