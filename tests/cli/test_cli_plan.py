"""`pagedkv plan` / `pagedkv models` as a user runs them: exit codes, one-line errors, JSON keys."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.kvspec import RETENTION_KINDS
from pagedkv.models import catalog_names

GiB = 1 << 30



def plan_json(cli, *argv):
    code, out, err = cli("plan", *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_models_lists_the_catalog(cli):
    code, out, _ = cli("models")
    assert code == 0
    listed = [line.split()[0] for line in out.splitlines()]
    assert listed == catalog_names()
    for name in ("llama-3-8b", "kimi-k3", "kimi-k3-dspark", "minimax-m1", "deepseek-v3.2"):
        assert name in listed


def test_plan_json_keys_for_a_plain_model(cli):
    doc = plan_json(cli, "llama-3-8b", "--memory", "40GiB")
    for key in ("budget_bytes", "num_blocks", "padding_bytes", "capacity", "groups"):
        assert key in doc
    assert doc["budget_bytes"] == 40 * GiB
    cap = doc["capacity"]
    assert cap["max_model_len"] == 8192  # Llama-3-8B's max_position_embeddings
    # 32 layers x K and V x 8 heads x 128 x bf16, 16-token blocks
    page = 32 * 2 * 8 * 128 * 2 * 16
    assert doc["num_blocks"] == 40 * GiB // page
    assert cap["tokens"] == doc["num_blocks"] * 16
    assert cap["tokens"] == pytest.approx(cap["max_concurrency"] * 8192, abs=1)
    (group,) = doc["groups"]
    assert group["retention"]["kind"] == "full"
    assert group["models"] == ["target"]
    assert group["bytes_per_token"] == 32 * 2 * 8 * 128 * 2
    assert len(group["layers"]) == 32


def test_plan_json_kimi_k3_with_dspark_shares_one_group(cli):
    doc = plan_json(cli, "kimi-k3", "--draft", "kimi-k3-dspark", "--memory", "40GiB",
                    "--max-model-len", "131072")
    kinds = {g["retention"]["kind"] for g in doc["groups"]}
    assert kinds <= set(RETENTION_KINDS)
    (mla,) = [g for g in doc["groups"] if g["retention"]["kind"] == "full"]
    assert sorted(mla["models"]) == ["draft", "target"]
    assert len(mla["layers"]) == 29
    assert mla["bytes_per_token"] == 29 * 1152 == 33408
    (rec,) = [g for g in doc["groups"] if g["retention"]["kind"] == "recurrent"]
    assert rec["bytes_per_token"] == 0 and len(rec["layers"]) == 69
    assert rec["bytes_per_request"] == 69 * (3 * 36864 * 4 + 96 * 128 * 128 * 4)
    assert doc["padding_bytes"] <= 0.02 * doc["budget_bytes"]
    vllm = [a for a in doc["alternatives"] if a["name"].startswith("vllm")]
    assert vllm and doc["capacity"]["tokens"] >= vllm[0]["capacity"]["tokens"]


def test_plan_human_output_names_groups_and_limit(cli):
    code, out, _ = cli("plan", "gpt-oss-120b", "--memory", "40GiB")
    assert code == 0
    assert "sliding" in out and "full" in out
    assert "limited by" in out


def test_plan_typical_len_reports_both_capacities(cli):
    doc = plan_json(cli, "gemma-3-27b", "--memory", "40GiB", "--max-model-len", "16384",
                    "--typical-len", "2048")
    cap = doc["capacity"]
    assert set(cap) == {"max_model_len", "max_concurrency", "tokens", "limited_by", "typical"}
    assert cap["max_model_len"] == 16384 and cap["max_concurrency"] >= 1
    typical = cap["typical"]
    assert set(typical) == {"len", "max_concurrency", "tokens"} and typical["len"] == 2048
    assert typical["tokens"] == int(typical["max_concurrency"] * 2048)
    names = [a["name"] for a in doc["alternatives"]]
    assert names == ["vllm", "pagedkv-max-len"]
    longest = doc["alternatives"][1]
    assert set(longest["capacity"]) == set(cap)
    # the trade: more short requests, fewer of max_model_len
    assert typical["max_concurrency"] > longest["capacity"]["typical"]["max_concurrency"]
    assert cap["max_concurrency"] <= longest["capacity"]["max_concurrency"]
    assert doc["alternatives"][0]["capacity"]["typical"] is None
    window, full = doc["groups"]
    assert window["reserved_blocks"] == 1 and full["reserved_blocks"] == 0
    pools = {p["id"]: p for p in doc["pools"]}
    assert pools[0]["reserved_pages"] == 1 and pools[0]["num_pages"] == window["num_blocks"]
    without = plan_json(cli, "gemma-3-27b", "--memory", "40GiB", "--max-model-len", "16384")
    assert without["capacity"]["typical"] is None
    assert [a["name"] for a in without["alternatives"]] == ["vllm"]
    assert without["capacity"]["max_concurrency"] == longest["capacity"]["max_concurrency"]
    code, out, _ = cli("plan", "gemma-3-27b", "--memory", "40GiB",
                           "--max-model-len", "16384", "--typical-len", "2048")
    assert code == 0 and "typical: " in out and "compare pagedkv-max-len" in out


def test_simulate_typical_len_runs_more_requests_at_once(cli):
    # fixed pools: --typical-len sizes them (elastic pools, the default, need no such flag:
    # tests/cli/test_cli_simulate.py)
    def sim(*extra):
        code, out, err = cli("simulate", "gemma-3-27b", "--memory", "40GiB",
                                 "--max-model-len", "16384", "--workload", "shared-prefix",
                                 "--requests", "150", "--fixed-pools", *extra, "--json")
        assert code == 0, err
        return json.loads(out)

    before, after = sim(), sim("--typical-len", "2048")
    for doc in (before, after):
        assert doc["requests_finished"] == 150 and doc["leaked_blocks"] == 0
    (w0, f0), (w1, f1) = before["groups"], after["groups"]
    assert w0["retention"] == w1["retention"] == "sliding_window"
    # without it the window pool is the limit: it fills up
    assert w0["peak_blocks"] >= w0["num_blocks"] - 2
    # with it the window group holds more blocks at once than the old pool had in all,
    # the full-attention group more requests' tokens, and more requests decode per step
    # (tokens per step = requests decoding at once, on average: the peak concurrency shows
    # in the pools' peaks, the JSON has no running count)
    assert w1["peak_blocks"] > w0["num_blocks"]
    assert f1["peak_blocks"] > f0["peak_blocks"]
    assert after["generated_tokens_per_step"] > before["generated_tokens_per_step"]
    assert after["steps"] < before["steps"]


def test_gpu_budget_uses_weights(cli):
    small = plan_json(cli, "llama-3-8b", "--gpu", "h200", "--weights", "100GiB")
    large = plan_json(cli, "llama-3-8b", "--gpu", "h200", "--weights", "16GiB")
    assert large["budget_bytes"] - small["budget_bytes"] == 84 * GiB


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["plan", "no-such-model", "--memory", "1GiB"], "no-such-model"),
        (["plan", "/nonexistent/config.json", "--memory", "1GiB"], "/nonexistent"),
        (["plan", "llama-3-8b", "--memory", "0"], "0"),
        (["plan", "llama-3-8b", "--memory=-5GiB"], "-5GiB"),
        (["plan", "llama-3-8b", "--memory", "lots"], "lots"),
        (["plan", "llama-3-8b", "--memory", "1MiB"], "1"),  # cannot hold one request
        (["plan", "llama-3-8b", "--gpu", "no-such-gpu"], "no-such-gpu"),
        (["plan", "llama-3-8b", "--gpu", "h200", "--weights", "200GiB"], "200"),
        (["plan", "llama-3-8b", "--memory", "40GiB", "--kv-dtype", "fp8_ds_mla"], "fp8_ds_mla"),
        (["plan", "llama-3-8b", "--memory", "40GiB", "--tp", "3"], "3"),
        (["plan", "llama-3-8b", "--memory", "40GiB", "--block-size", "0"], "0"),
        (["plan", "llama-3-8b", "--memory", "40GiB", "--typical-len", "0"], "0"),
        (["plan", "llama-3-8b", "--memory", "40GiB", "--typical-len", "9000"], "9000"),
        (["simulate", "llama-3-8b", "--memory", "40GiB", "--typical-len", "9000",
          "--workload", "chat"], "9000"),
        (["plan", "llama-3-8b", "--memory", "40GiB", "--draft", "mtp"], "mtp"),
        (["plan", "llama-3-8b"], "budget"),
        (["frobnicate"], "frobnicate"),
    ],
)
def test_bad_input_is_one_line_and_status_2(cli, argv, needle):
    code, _, err = cli(*argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedkv: error:"), err
    assert needle in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "content, needle",
    [
        ("{ not json", "json"),
        ('{"model_type": "llama", "hidden_size": 4096}', "num_hidden_layers"),
        ('{"model_type": "mystery", "num_hidden_layers": 2, "hidden_size": 64, '
         '"num_attention_heads": 4, "layer_types": ["full_attention", "teleport"]}', "teleport"),
        ("[1, 2, 3]", "object"),
    ],
)
def test_bad_config_files_exit_2(tmp_path, cli, content, needle):
    path = tmp_path / "config.json"
    path.write_text(content)
    code, _, err = cli("plan", str(path), "--memory", "40GiB")
    assert code == 2
    assert needle.lower() in err.lower()
    assert len(err.strip().splitlines()) == 1


def test_checkpoint_folder_is_read(tmp_path, cli):
    from pagedkv.models import load_config

    (tmp_path / "config.json").write_text(json.dumps(load_config("mistral-7b")))
    doc = plan_json(cli, str(tmp_path), "--memory", "8GiB")
    (group,) = doc["groups"]
    assert group["retention"]["kind"] == "sliding_window"
    assert group["retention"]["window"] == 4096


def test_console_script_runs_without_torch_under_O():
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any torch import would now fail
        "from pagedkv.cli import main\n"
        "raise SystemExit(main(['plan', 'kimi-k3', '--draft', 'kimi-k3-dspark', "
        "'--memory', '100GiB', '--json']))\n"
    )
    proc = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["num_blocks"] > 0


# --- published configs: refusals, warnings, only what the question needs ------------------

SMALL = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512,
         "vocab_size": 1000, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
NAS_WINDOW = {"attention": {"n_heads_in_group": 2, "no_op": False, "window_length": 512},
              "ffn": {"ffn_mult": 2.0}}


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"compress_ratios": [0, 4]}, "compress_ratios"),
        ({"model_type": "deepseek_v4"}, "num_key_value_heads is 2"),  # V4 shares one K=V head
        ({"sparse_attention_config": {"use_sparse_attention": True}}, "sparse_attention_config"),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"cross_attention_layers": [1]}, "cross_attention_layers"),
        ({"add_cross_attention": True}, "add_cross_attention"),
        ({"pruned_heads": {"0": [1]}}, "pruned_heads"),
        ({"num_kv_shared_layers": 3}, "num_kv_shared_layers"),
        ({"block_configs": [NAS_WINDOW, NAS_WINDOW]}, "window_length"),
        ({"block_configs": [{"attention": {"n_heads_in_group": 3}}] * 2}, "n_heads_in_group"),
        ({"quantization_config": {"quant_method": "compressed-tensors",
                                  "kv_cache_scheme": {"num_bits": 8, "type": "int"}}},
         "kv_cache_scheme"),
        ({"hybrid_layer_pattern": [0, 2]}, "hybrid_layer_pattern"),
        ({"model_type": "llama4_text", "attention_chunk_size": 64, "no_rope_layers": [1]},
         "no_rope_layers"),
    ],
)
def test_unmodelled_geometry_is_refused_in_one_line(tmp_path, cli, extra, needle):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(SMALL, **extra)))
    code, out, err = cli("plan", str(path), "--memory", "1GiB")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedkv: error:"), err
    assert needle in lines[0]


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["llama-3-8b", "--draft", "kimi-k3-dspark"], ["89", "32 layers"]),
        (["qwen3-8b", "--draft", "llama-3-8b-eagle3"], ["128256", "151936"]),
    ],
)
def test_drafter_that_cannot_belong_to_its_target_exits_2(cli, argv, needles):
    code, out, err = cli("plan", *argv, "--memory", "40GiB")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedkv: error:"), err
    assert all(n in lines[0] for n in needles)


def test_unknown_geometry_looking_keys_warn_and_the_plan_still_runs(tmp_path, cli):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(SMALL, kv_group_stride=2, rope_theta=1e6)))
    code, out, err = cli("plan", str(path), "--memory", "1GiB", "--json")
    assert code == 0
    assert json.loads(out)["groups"]
    (line,) = err.strip().splitlines()
    assert line.startswith("pagedkv: warning:") and "kv_group_stride" in line
    assert "rope_theta" not in line


def test_catalog_models_do_not_warn(cli):
    for name in catalog_names():
        if name.endswith(("-dspark", "-eagle3", "-dflash")):
            continue
        code, _, err = cli("plan", name, "--memory", "100GiB", "--max-model-len", "4096")
        assert code == 0 and err == "", (name, err)


def test_weight_fields_are_needed_only_for_a_gpu_budget(tmp_path, cli):
    config = {k: v for k, v in SMALL.items() if k != "vocab_size"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert plan_json(cli, str(path), "--memory", "1GiB")["groups"]
    code, _, err = cli("plan", str(path), "--gpu", "h200")
    assert code == 2 and "vocab_size" in err and len(err.strip().splitlines()) == 1
    assert plan_json(cli, str(path), "--gpu", "h200", "--weights", "1GiB")["groups"]


def test_max_position_embeddings_is_needed_only_without_max_model_len(tmp_path, cli):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in SMALL.items()
                                if k != "max_position_embeddings"}))
    doc = plan_json(cli, str(path), "--memory", "1GiB", "--max-model-len", "2048")
    assert doc["capacity"]["max_model_len"] == 2048
    code, _, err = cli("plan", str(path), "--memory", "1GiB")
    assert code == 2 and "max_position_embeddings" in err and "--max-model-len" in err
    assert len(err.strip().splitlines()) == 1


def test_via_transformers_gives_the_same_plan(cli):
    pytest.importorskip("transformers")
    path = Path(__file__).parents[1] / "models" / "fixtures" / "published"
    gemma = path / "google--gemma-4-26B-A4B.json"
    args = ("--memory", "40GiB", "--max-model-len", "8192")
    own = plan_json(cli, str(gemma), *args)
    via = plan_json(cli, str(gemma), *args, "--via-transformers")
    assert own["groups"] == via["groups"]
    code, _, err = cli("plan", "kimi-k3", "--via-transformers", *args)
    assert code == 2 and "kimi_k3" in err and len(err.strip().splitlines()) == 1


def test_deepseek_v4_plans_its_window_compressed_streams_and_state(cli):
    """The command a user runs on DeepSeek-V4-Flash as published; bytes from its fields
    (head_dim 512, one K=V head, sliding_window 128, index_head_dim 128, bf16)."""
    path = Path(__file__).parents[1] / "models" / "fixtures" / "published"
    doc = plan_json(cli, str(path / "deepseek-ai--DeepSeek-V4-Flash.json"),
                    "--memory", "40GiB", "--max-model-len", "131072")
    got = sorted((g["retention"]["kind"], g["retention"].get("ratio"), len(g["layers"]),
                  g["bytes_per_token"], g["bytes_per_request"], g["blocks_per_request"])
                 for g in doc["groups"])
    assert got == sorted([
        ("sliding_window", None, 43, 43 * 512 * 2, 0, 127 // 16 + 1 + 1),  # ceil(127/16)+1 = 9
        ("compressed", 4, 42, 21 * (512 * 2 + 128 * 2), 0, 131072 // 4 // 16),  # 2048 blocks
        ("compressed", 128, 20, 20 * 512 * 2, 0, 131072 // 128 // 16),  # 64 blocks
        # 20 HCA x 260096 (127 pending tokens x 512 kv + gate, bf16) + 21 CSA x 30720
        ("recurrent", None, 41, 0, 20 * 260096 + 21 * 30720, 1),
    ])
    # one request: 9 x 16 x 44032 + 2048 x 16 x 26880 + 64 x 16 x 20480 + 5847040 bytes
    # = 6340608 + 880803840 + 20971520 + 5847040 = 913963008; 40 GiB / that = 46.99, less the
    # step's window blocks (2048 / 16 = 128 pages of 16 x 44032) and the null block
    assert 46.8 < doc["capacity"]["max_concurrency"] < 47.0
    (vllm,) = [a for a in doc["alternatives"] if a["name"].startswith("vllm")]
    assert any("not modelled" in note for note in vllm["notes"])


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"attn_logit_softcapping": [1, "a"]}, "attn_logit_softcapping"),
        ({"attn_logit_softcapping": -30.0}, "attn_logit_softcapping"),
        ({"query_pre_attn_scalar": "256"}, "query_pre_attn_scalar"),
        ({"query_pre_attn_scalar": float("nan")}, "query_pre_attn_scalar"),
        ({"num_hidden_layers": 10**12}, "num_hidden_layers"),  # not a MemoryError
    ],
)
def test_malformed_attention_fields_exit_2_in_one_line(tmp_path, cli, extra, needle):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(SMALL, **extra)))
    code, out, err = cli("plan", str(path), "--memory", "1GiB")
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("pagedkv: error:") and needle in line, err


@pytest.mark.parametrize(
    "quant, needle",
    [
        ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": 128}, "weight_block_size"),
        ({"quant_method": "awq", "bits": -4, "group_size": 128}, "bits"),
        ({"quant_method": "fp8", "ignore": -1}, "ignore"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {
            "targets": 1.5, "weights": {"num_bits": 4, "type": "int"}}}}, "targets"),
    ],
)
def test_malformed_quantization_fails_only_the_weight_estimate(tmp_path, cli, quant, needle):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(SMALL, quantization_config=quant)))
    assert plan_json(cli, str(path), "--memory", "1GiB")["groups"]  # weights not needed
    code, out, err = cli("plan", str(path), "--gpu", "h200")
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("pagedkv: error:") and needle in line, err


def test_library_warnings_are_one_cli_line(tmp_path, cli):
    quant = {"quant_method": "mystery-8bit"}  # unknown: weights counted in the model dtype
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(SMALL, quantization_config=quant)))
    code, out, err = cli("plan", str(path), "--gpu", "h200")
    assert code == 0 and out
    (line,) = err.strip().splitlines()
    assert line.startswith("pagedkv: warning: quantization method 'mystery-8bit'"), err


def test_mtp_count_past_the_model_is_one_line(cli, tmp_path):
    """A damaged num_nextn_predict_layers (10^12) with --draft mtp built that many layer
    specs (a hang, fuzz/plan.py seed 19417) until 2026-12-05; now refused by name."""
    import json

    from pagedkv.models import load_config

    cfg = load_config("deepseek-v3")
    cfg["num_nextn_predict_layers"] = 10**12
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, _, err = cli("plan", str(path), "--memory", "141GB", "--draft", "mtp")
    assert code == 2 and err.count("\n") == 1
    assert "num_nextn_predict_layers 1000000000000 exceeds the target's 61 layers" in err
