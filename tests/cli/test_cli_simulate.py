"""`pagedkv simulate` as a user runs it: real plans of catalog models, JSON keys, exit codes."""

from __future__ import annotations

import json

import pytest


def sim_json(cli, *argv):
    code, out, err = cli("simulate", *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_shared_prefix_on_llama_hits_all_but_the_first_prompt(cli):
    doc = sim_json(cli, "llama-3-8b", "--memory", "2GiB", "--max-model-len", "4096",
                   "--workload", "shared-prefix", "--requests", "20")
    for key in ("requests_finished", "steps", "prefix_hit_rate", "preemptions",
                "leaked_blocks", "groups", "generated_tokens_per_step"):
        assert key in doc
    assert doc["requests_finished"] == 20 and doc["leaked_blocks"] == 0
    # 1,024 shared + 256 own tokens per prompt; blocks of 16; the first request misses
    assert doc["prefix_hit_rate"] == pytest.approx(19 * 1024 / (20 * 1280), abs=1e-6)
    (g,) = doc["groups"]
    assert 0 < g["peak_blocks"] <= g["num_blocks"] and g["mean_blocks"] <= g["peak_blocks"]
    # 2 GiB / (131072 B/token x 16) = 1024 blocks
    assert g["num_blocks"] == 1024


def test_deepseek_mtp_trace_backs_off_one_token(tmp_path, cli):
    a = list(range(1, 201))
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"prompt_tokens": a, "output_len": 3}) + "\n"
                     + json.dumps({"prompt_tokens": a + [7] * 10, "output_len": 1,
                                   "arrival_step": 50}) + "\n")
    doc = sim_json(cli, "deepseek-v3", "--draft", "mtp", "--memory", "4GiB",
                   "--max-model-len", "4096", "--trace", str(trace))
    # blocks of 64 (MLA). A computes 200 + 2 tokens: the target caches 3 blocks (192
    # tokens); the MTP layer's 3rd block is final too (needs token 192): 192 - 1 = 191
    assert doc["requests_finished"] == 2 and doc["leaked_blocks"] == 0
    assert doc["prefix_hit_rate"] == pytest.approx(191 / 410, abs=1e-6)
    assert [g["retention"] for g in doc["groups"]] == ["full", "full"]


def test_kimi_with_dspark_speculative_steps_leak_nothing(cli):
    doc = sim_json(cli, "kimi-k3", "--draft", "kimi-k3-dspark", "--memory", "8GiB",
                   "--max-model-len", "8192", "--workload", "chat", "--requests", "30",
                   "--spec-tokens", "6", "--acceptance", "0.6", "--checkpoint-every", "4")
    assert doc["requests_finished"] == 30 and doc["leaked_blocks"] == 0
    assert sorted(g["retention"] for g in doc["groups"]) == ["full", "recurrent"]


def test_human_output_and_plot(tmp_path, cli):
    pytest.importorskip("matplotlib")
    png = tmp_path / "blocks.png"
    code, out, err = cli("simulate", "gpt-oss-20b", "--memory", "1GiB",
                             "--max-model-len", "4096", "--workload", "agentic",
                             "--requests", "10", "--plot", str(png))
    assert code == 0, err
    assert "prefix hit rate" in out and "sliding_window" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_one_line_and_status_2(tmp_path, cli, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # any import of it now fails
    code, _, err = cli("simulate", "gpt-oss-20b", "--memory", "1GiB",
                           "--max-model-len", "4096", "--workload", "agentic",
                           "--requests", "2", "--plot", str(tmp_path / "x.png"))
    assert code == 2
    assert "matplotlib" in err and len(err.strip().splitlines()) == 1


def test_bad_trace_exits_2_with_the_line_number(tmp_path, cli):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"prompt_tokens": [1], "output_len": 1}\n{"prompt_tokens": []}\n')
    code, out, err = cli("simulate", "llama-3-8b", "--memory", "1GiB",
                             "--trace", str(trace))
    assert code == 2 and out == ""
    assert "bad.jsonl:2:" in err and len(err.strip().splitlines()) == 1


def test_workload_or_trace_is_required(cli):
    assert cli("simulate", "llama-3-8b", "--memory", "1GiB").code == 2


@pytest.mark.parametrize("flags, hit", [
    # default policy: the first request saves nothing, the second finds 3 blocks cached
    # in the MLA group (blocks of 64) and saves its state there, the third resumes at 192
    ((), 192),
    (("--checkpoint-every", "3"), 2 * 192),  # the first saves at 192 too
    (("--no-checkpoints",), 0),
])
def test_kimi_checkpoint_flags_on_a_branching_trace(tmp_path, cli, flags, hit):
    shared = list(range(1, 193))
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(
        json.dumps({"prompt_tokens": shared + [1000 * (i + 1)] * 64, "output_len": 1,
                    "arrival_step": 50 * i}) + "\n" for i in range(3)))
    doc = sim_json(cli, "kimi-k3", "--memory", "8GiB", "--max-model-len", "4096",
                   "--trace", str(trace), *flags)
    assert doc["requests_finished"] == 3 and doc["leaked_blocks"] == 0
    assert doc["prefix_hit_rate"] == pytest.approx(hit / (3 * 256), abs=1e-6)


def test_checkpoint_flags_exclude_each_other(cli):
    assert cli("simulate", "kimi-k3", "--memory", "8GiB", "--workload", "chat",
               "--checkpoint-every", "2", "--no-checkpoints").code == 2


def test_elastic_pools_need_no_typical_len(cli):
    """The same run as the --typical-len test in test_cli_plan.py: elastic pools (the
    default) without the flag do at least as well as fixed pools sized with it."""
    def sim(*extra):
        code, out, err = cli("simulate", "gemma-3-27b", "--memory", "40GiB",
                             "--max-model-len", "16384", "--workload", "shared-prefix",
                             "--requests", "150", *extra, "--json")
        assert code == 0, err
        return json.loads(out)

    typical, elastic = sim("--fixed-pools", "--typical-len", "2048"), sim()
    with_flag = sim("--typical-len", "2048")  # still accepted; elastic pools ignore the sizes
    assert elastic["requests_finished"] == 150 and elastic["leaked_blocks"] == 0
    assert elastic["steps"] <= typical["steps"]
    assert elastic["preemptions"] <= typical["preemptions"]
    assert with_flag["steps"] == elastic["steps"]
