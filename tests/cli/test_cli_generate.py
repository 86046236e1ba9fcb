"""``pagedkv generate``: --tiny models verified against transformers, JSON keys, and every
bad input as one line on stderr with exit status 2 (other requests still finish)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ["llama-3-8b", "gemma-3-27b", "gpt-oss-20b"])
def test_tiny_verify_matches_transformers(cli, arch):
    res = cli("generate", "--tiny", arch, "--prompts", "3", "--prompt-len", "12",
              "--max-new-tokens", "5", "--block-size", "4", "--max-model-len", "64",
              "--verify", "--json")
    report = res.json()
    assert {"architecture", "requests", "tokens_generated", "max_abs_logit_diff", "match",
            "prefix_hit_rate", "preemptions"} <= set(report)
    assert report["requests"] == 3
    assert report["tokens_generated"] == 15
    assert report["match"] is True
    assert 0.0 <= report["max_abs_logit_diff"] <= 1e-4
    assert res.err == ""  # no progress bar with --json


def test_text_prompts_with_the_byte_tokenizer(cli):
    res = cli("generate", "--tiny", "qwen3-8b", "--prompt", "hello", "--prompt", "pagedkv",
              "--max-new-tokens", "3", "--json")
    outs = res.json()["outputs"]
    assert [o["prompt_tokens"] for o in outs] == [5, 7]
    assert all(len(o["token_ids"]) == 3 for o in outs)


def test_prompt_too_long_fails_alone(cli):
    res = cli("generate", "--tiny", "llama-3-8b", "--prompt", "x" * 30, "--prompt", "hi",
              "--max-model-len", "32", "--max-new-tokens", "4")
    assert res.code == 2
    assert res.err.count("\n") == 1 and res.err.startswith("pagedkv: error: 1 of 2 requests")
    assert "max_model_len 32" in res.err
    assert "[1] length:" in res.out  # the other request finished


def _folder(tmp_path, capsys, arch="llama-3-8b"):
    from pagedkv.engine.tiny import tiny_model

    model = tiny_model(arch)
    model.save_pretrained(tmp_path)
    capsys.readouterr()  # transformers' own progress output is not ours
    return model


@pytest.mark.parametrize("case", ["no-config", "no-weights", "misshapen", "missing",
                                  "architecture", "not-a-folder", "bad-field", "json-list"])
def test_bad_checkpoints_exit_2_with_one_line(cli, tmp_path, capsys, case):
    import torch
    from safetensors.torch import load_file, save_file

    if case == "not-a-folder":
        target = tmp_path / "nothing-here"
    else:
        _folder(tmp_path, capsys)
        target = tmp_path
        weights = tmp_path / "model.safetensors"
        if case == "no-config":
            (tmp_path / "config.json").unlink()
        elif case == "no-weights":
            weights.unlink()
        elif case in ("misshapen", "missing"):
            state = load_file(weights)
            name = "model.layers.1.mlp.up_proj.weight"
            if case == "missing":
                del state[name]
            else:
                state[name] = torch.zeros(3, 3)
            save_file(state, weights)
        elif case == "json-list":
            (tmp_path / "config.json").write_text("[1, 2]")
        else:
            cfg = json.loads((tmp_path / "config.json").read_text())
            if case == "bad-field":  # transformers' strict fields: a multi-line message
                cfg["hidden_size"] = "big"
            else:
                cfg["architectures"] = ["LlamaForTokenClassification"]
            (tmp_path / "config.json").write_text(json.dumps(cfg))
    res = cli("generate", "--model", target, "--prompts", "1", "--max-new-tokens", "2")
    assert res.code == 2
    assert res.err.startswith("pagedkv: error: ") and res.err.count("\n") == 1
    assert "Traceback" not in res.err
    expected = {"no-config": "config.json", "no-weights": "safetensors",
                "misshapen": "up_proj", "missing": "up_proj",
                "architecture": "LlamaForTokenClassification", "not-a-folder": "not a folder",
                "bad-field": "hidden_size", "json-list": "not a JSON object"}
    assert expected[case] in res.err


def test_checkpoint_folder_verifies(cli, tmp_path, capsys):
    _folder(tmp_path, capsys, "mistral-7b")
    res = cli("generate", "--model", tmp_path, "--prompts", "2", "--prompt-len", "10",
              "--max-new-tokens", "4", "--block-size", "4", "--max-model-len", "64",
              "--verify", "--json")
    report = res.json()
    assert report["architecture"] == "MistralForCausalLM"
    assert report["match"] is True


def test_kimi_k2_runs_on_deepseek_v3_code(cli):
    """Kimi K2's config names model_type kimi_k2, which transformers has no class for, and
    DeepSeek-V3's architecture: it is read as a deepseek_v3 config (was a refusal)."""
    res = cli("generate", "--tiny", "kimi-k2", "--prompts", "2", "--prompt-len", "10",
              "--max-new-tokens", "3", "--verify", "--json")
    report = res.json()
    assert report["architecture"] == "DeepseekV3ForCausalLM"
    assert report["match"] is True and report["tokens_generated"] == 6


def test_aliased_model_type_checkpoint_verifies(cli, tmp_path, capsys):
    """A checkpoint folder as Kimi K2 ships it (model_type kimi_k2, remote-code auto_map)
    loads into the native DeepSeek-V3 code and into transformers' for --verify."""
    _folder(tmp_path, capsys, "deepseek-v3")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(model_type="kimi_k2", auto_map={
        "AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    res = cli("generate", "--model", tmp_path, "--prompts", "2", "--prompt-len", "10",
              "--max-new-tokens", "3", "--verify", "--json")
    report = res.json()
    assert report["architecture"] == "DeepseekV3ForCausalLM" and report["match"] is True


def test_unknown_model_type_is_one_short_line(cli, tmp_path, capsys):
    """transformers' own message lists every model_type it knows (over 10,000 characters)."""
    _folder(tmp_path, capsys)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "llama_from_the_future"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    res = cli("generate", "--model", tmp_path, "--prompts", "1", "--max-new-tokens", "2")
    assert res.code == 2 and res.err.count("\n") == 1
    assert "'llama_from_the_future'" in res.err and len(res.err) < 300


def test_bad_device_exits_2(cli):
    res = cli("generate", "--tiny", "llama-3-8b", "--device", "tpu")
    assert res.code == 2 and res.err.startswith("pagedkv: error: --device")


def test_tiny_without_native_code_exits_2(cli):
    res = cli("generate", "--tiny", "jamba-v0.1")
    assert res.code == 2 and res.err.count("\n") == 1
    assert "JambaForCausalLM" in res.err and "no native model code" in res.err


def test_16_bit_run_without_verify_reports_no_tolerance(cli):
    res = cli("generate", "--tiny", "llama-3-8b", "--dtype", "bf16", "--prompts", "2",
              "--prompt-len", "8", "--max-new-tokens", "2", "--json")
    report = res.json()
    assert res.code == 0 and report["dtype"] == "bfloat16"
    assert report["max_abs_logit_diff"] is None and report["tolerance"] is None
    assert report["match"] is None and report["tokens_generated"] == 4


@pytest.mark.parametrize("argv, needle", [
    (["--kv-cache-mib", str(1 << 40)], "the KV cache needs"),  # more than any machine holds
    (["--max-batched-tokens", str(10**14)], "the KV cache needs"),
    (["--prompt-len", str(10**14)], "--prompt-len"),  # (was a MemoryError making it)
])
def test_impossible_sizes_exit_2_with_one_line(cli, argv, needle):
    res = cli("generate", "--tiny", "llama-3-8b", "--prompts", "2", "--max-new-tokens", "2",
              *argv)
    assert res.code == 2 and res.out == ""
    assert res.err.count("\n") == 1 and res.err.startswith(f"pagedkv: error: {needle}"), res.err
