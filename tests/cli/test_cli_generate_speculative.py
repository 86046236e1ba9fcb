"""``pagedkv generate --draft ... --spec-tokens K``: acceptance keys, ``lossless`` with
--verify, and bad input (a drafter that is not built, a target without MTP layers,
--spec-tokens without --draft, k over the step budget) as one line with exit status 2
before any step runs."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ARGS = ("--tiny", "deepseek-v3", "--prompts", "3", "--prompt-len", "12", "--max-new-tokens",
        "6", "--block-size", "4", "--max-model-len", "64", "--verify", "--json")


@pytest.mark.parametrize("draft, rate, tiny", [("scripted", 1.0, "deepseek-v3"),
                                               ("mtp", None, "deepseek-v3"),
                                               ("dspark", None, "deepseek-v3"),
                                               ("eagle3", None, "llama-3-8b"),
                                               # per-layer-type RoPE (was a KeyError)
                                               ("eagle3", None, "gemma-3-27b")])
def test_speculative_generate_is_lossless(cli, draft, rate, tiny):
    args = list(ARGS)
    args[1] = tiny
    res = cli("generate", *args, "--draft", draft, "--spec-tokens", "3")
    assert res.code == 0, res.err
    report = res.json()
    assert report["draft"] == draft and report["spec_tokens"] == 3
    assert report["lossless"] is True
    assert report["match"] is True
    assert report["tokens_generated"] == 18
    assert 0.0 <= report["acceptance_rate"] <= 1.0
    assert 1.0 <= report["mean_accepted_tokens"] <= 4.0
    if rate is not None:  # the scripted drafter proposes the plain run's own tokens
        assert report["acceptance_rate"] == rate
        assert report["mean_accepted_tokens"] == 4.0
        assert report["steps"] < 6  # several tokens per verify pass


@pytest.mark.parametrize("draft, tiny", [("mtp", "deepseek-v3"), ("eagle3", "llama-3-8b")])
def test_offset_one_drafters_run_with_prefix_hits(cli, draft, tiny):
    """A step budget of 12 admits one 12-token prompt per step: requests 2 and 3 hit the
    first's block 0 (the prompts share 6 tokens), less the offset-1 group's one token: 3
    tokens each, inside a block that an earlier step wrote (copied): 6 of 36 prompt tokens."""
    args = list(ARGS)
    args[1] = tiny
    res = cli("generate", *args, "--draft", draft, "--max-batched-tokens", "12")
    assert res.code == 0, res.err
    report = res.json()
    assert report["prefix_hit_rate"] == pytest.approx(6 / 36, abs=1e-6)
    assert report["lossless"] is True and report["match"] is True


def test_tiny_kimi_k3_with_dspark_is_lossless_with_hits(cli):
    """--tiny kimi-k3 builds K3's text model, transformers' Kimi-Linear: the fewest layers
    holding each kind once (3 KDA, then MLA); K3's MLA output gate, which transformers
    does not model, is left out. With DSpark on its MLA block table, prompts in separate
    steps (budget 12) hit recurrent checkpoints and MLA blocks, lossless."""
    from pagedkv.engine.tiny import tiny_config

    cfg = tiny_config("kimi-k3")
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert not hasattr(cfg, "mla_use_output_gate")
    args = list(ARGS)
    args[1] = "kimi-k3"
    res = cli("generate", *args, "--draft", "dspark", "--max-batched-tokens", "12")
    assert res.code == 0, res.err
    report = res.json()
    assert report["architecture"] == "KimiLinearForCausalLM"
    assert report["lossless"] is True and report["match"] is True
    assert report["prefix_hit_rate"] > 0


@pytest.mark.parametrize("argv, message", [
    (("--tiny", "deepseek-v3", "--draft", "eagle3"), "drafts for GQA targets"),
    (("--tiny", "llama-3-8b", "--draft", "dspark"), "needs an MLA target"),
    # no RoPE or RMS epsilon to build the layer from (was an AttributeError traceback)
    (("--tiny", "nemotron-h-8b", "--draft", "eagle3"), "no rope_parameters, rms_norm_eps"),
    (("--tiny", "llama-3-8b", "--draft", "mtp"), "no MTP layers"),
    (("--tiny", "llama-3-8b", "--spec-tokens", "2"), "--spec-tokens needs --draft"),
    (("--tiny", "llama-3-8b", "--draft", "scripted", "--spec-tokens", "40",
      "--max-batched-tokens", "16"), "over the step budget"),
])
def test_bad_speculation_input_exits_2(cli, argv, message):
    res = cli("generate", *argv, "--prompts", "1", "--max-new-tokens", "2")
    assert res.code == 2
    assert res.err.count("\n") == 1 and res.err.startswith("pagedkv: error:")
    assert message in res.err
    assert res.out == ""  # refused before any step
