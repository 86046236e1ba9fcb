"""``pagedkv generate --model`` on checkpoint folders whose config.json a hand damaged: one
field changed to a value the model code cannot take. Each was a traceback (KeyError,
RuntimeError from torch, IndexError, or a top-k failing at the first token) or NaN
logits (a RoPE base below zero) until 2026-12-05; now one ``pagedkv: error:`` line naming the field or the value, exit 2."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

CASES = [
    # RoPE parameters (the GQA rope, Gemma 3's per-layer-type rope, MLA's rope)
    ("llama-3-8b", ["rope_parameters", "rope_type"], 7, "rope_type 7"),
    ("mistral-7b", ["rope_parameters", "rope_theta"], None, "rope_theta"),
    ("gemma-3-27b", ["rope_parameters", "full_attention", "rope_type"], "x", "rope_type 'x'"),
    ("deepseek-v3", ["rope_parameters", "rope_type"], [], "rope_type []"),
    ("gemma-3-27b", ["rope_parameters", "full_attention", "rope_theta"], -1.0, "rope_theta"),
    ("gemma-3-27b", ["rope_parameters", "full_attention", "factor"], 0, "factor"),  # linear
    ("qwen3-next-80b", ["rope_parameters", "rope_theta"], float("nan"), "rope_theta"),
    ("qwen3-8b", ["rms_norm_eps"], -0.5, "epsilon"),
    # routers: checked when the model is built, not at its first token's top-k
    ("qwen3-next-80b", ["num_experts_per_tok"], -2, "experts per token"),
    ("gpt-oss-20b", ["num_experts_per_tok"], 9, "cannot pick 9 experts"),
    ("kimi-k3", ["num_expert_group"], 65536, "in 65536 groups"),
    ("deepseek-v3", ["topk_group"], 2, "from 2 groups"),
    ("deepseek-v3", ["n_group"], 0, "expert groups must be a positive integer"),  # was 1
    ("qwen3-next-80b", ["rope_parameters", "partial_rotary_factor"], 1.25, "partial_rotary"),
    ("nemotron-h-8b", ["chunk_size"], 0, "chunk_size"),
    ("deepseek-v3", ["head_dim"], 4, "qk_rope_head_dim"),  # transformers rotates head_dim
    # a field transformers' Gemma 3 ignores and the plan would apply (logits 0.56 off)
    ("gemma-3-27b", ["attn_logit_softcapping"], 1.5, "soft-cap"),
    # a checkpoint holding more experts than its config
    ("deepseek-v3", ["n_routed_experts"], 3, "outside its shape"),
    # more layers than the checkpoint has (built for minutes before the weights said so)
    ("mistral-7b", ["num_hidden_layers"], 65536, "num_hidden_layers 65536"),
    # Kimi-Linear's max_position_embeddings is its model_max_length (was a TypeError)
    ("kimi-k3", ["model_max_length"], [4096, 1e-30], "max_position_embeddings"),
    # sizes torch cannot allocate
    ("nemotron-h-8b", ["conv_kernel"], -4, "cannot be built from this config"),
    ("llama-3-8b", ["vocab_size"], -256, "negative dimension"),
]


def _damaged(tmp_path, capsys, arch, path, value):
    from pagedkv.engine.tiny import tiny_model

    tiny_model(arch).save_pretrained(tmp_path)
    capsys.readouterr()  # transformers' own output is not ours
    cfg = json.loads((tmp_path / "config.json").read_text())
    node = cfg
    for key in path[:-1]:
        node = node[key]
    if path[-1] not in node:
        raise AssertionError(f"{arch}'s config has no {'.'.join(path)} to damage")
    node[path[-1]] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("arch, path, value, needle", CASES,
                         ids=[f"{a}-{'.'.join(p)}" for a, p, _, _ in CASES])
def test_damaged_config_is_one_line(cli, tmp_path, capsys, arch, path, value, needle):
    folder = _damaged(tmp_path, capsys, arch, path, value)
    res = cli("generate", "--model", folder, "--prompts", "2", "--prompt-len", "8",
              "--max-new-tokens", "2")
    assert res.code == 2, res.err
    assert res.err.startswith("pagedkv: error: ") and res.err.count("\n") == 1
    assert needle in res.err


def test_reference_that_transformers_cannot_build_is_one_line(cli, tmp_path, capsys):
    """DeepSeek-V2's MLA ignores num_key_value_heads, transformers divides by it: the
    engine runs, --verify's reference fails in transformers' constructor."""
    folder = _damaged(tmp_path, capsys, "deepseek-v2-lite", ["num_key_value_heads"], 0)
    assert cli("generate", "--model", folder, "--prompts", "1", "--prompt-len", "6",
               "--max-new-tokens", "2").code == 0
    res = cli("generate", "--model", folder, "--prompts", "1", "--prompt-len", "6",
              "--max-new-tokens", "2", "--verify")
    assert res.code == 2 and res.err.count("\n") == 1
    assert "for --verify: ZeroDivisionError" in res.err


@pytest.mark.parametrize("arch", ["mistral-7b", "nemotron-h-8b"])
def test_tied_config_with_its_own_head_uses_the_head(cli, tmp_path, capsys, arch):
    """tie_word_embeddings true, but the checkpoint stores an lm_head unlike the
    embedding: transformers uses the stored head, untied; the engine tied it to the
    embedding (logits 2.5 off) until 2026-12-05. Now the same, with a warning line; and
    --verify's reference loads without transformers' progress bar on our stderr."""
    folder = _damaged(tmp_path, capsys, arch, ["tie_word_embeddings"], True)
    res = cli("generate", "--model", folder, "--prompts", "2", "--prompt-len", "10",
              "--max-new-tokens", "3", "--verify", "--json")
    report = res.json()
    assert report["match"] is True and report["max_abs_logit_diff"] <= 1e-4
    assert res.err.count("\n") == 1 and res.err.startswith("pagedkv: warning: the config ties")


@pytest.mark.parametrize("arch, path, value, needle", [
    ("deepseek-v3", ["routed_scaling_factor"], float("nan"), "NaN or inf at"),
    ("deepseek-v3", ["num_key_value_heads"], 2, "own forward fails for --verify"),
])
def test_reference_without_an_answer_is_one_line(cli, tmp_path, capsys, arch, path, value,
                                                 needle):
    """A config whose transformers forward gives NaN, or fails (MLA ignores
    num_key_value_heads, transformers' DeepSeek-V3 repeats keys by it): --verify says so
    in one line (was "logits differ by inf", exit 1, and a traceback)."""
    folder = _damaged(tmp_path, capsys, arch, path, value)
    res = cli("generate", "--model", folder, "--prompts", "2", "--prompt-len", "8",
              "--max-new-tokens", "2", "--verify", "--json")
    assert res.code == 2 and res.err.count("\n") == 1
    assert needle in res.err


def test_mamba2_step_size_limit_holds_in_decode_steps(cli, tmp_path, capsys):
    """time_step_min is a lower limit on every Mamba-2 step size. The chunked scan (prefill)
    applied it and transformers' one-token step (decode) did not, so a decoded token
    differed from the same token prefilled (5e-3 here) until 2026-12-05."""
    folder = _damaged(tmp_path, capsys, "nemotron-h-8b", ["time_step_min"], 1.001)
    res = cli("generate", "--model", folder, "--prompts", "2", "--prompt-len", "12",
              "--max-new-tokens", "4", "--verify", "--json")
    report = res.json()
    assert report["match"] is True and report["max_abs_logit_diff"] <= 1e-4
