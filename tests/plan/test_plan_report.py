"""plan_to_dict (the --json object), its documentation, and format_plan."""

from __future__ import annotations

import json
import pathlib

from test_plan_builders import GiB, gpt_oss_120b, kimi_k3

from pagedkv.plan import PlanOptions, format_plan, make_plan, plan_to_dict
from pagedkv.plan.report import compress_names

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "plan.md"


def _keys(obj, prefix=""):
    """Every key path of a JSON object, lists marked: groups[], groups[].retention.kind."""
    for key, value in obj.items():
        if isinstance(value, list):
            yield f"{prefix}{key}[]"
            if value and isinstance(value[0], dict):
                yield from _keys(value[0], f"{prefix}{key}[].")
        else:
            yield f"{prefix}{key}"
            if isinstance(value, dict):
                yield from _keys(value, f"{prefix}{key}.")


def test_json_object_has_the_documented_keys():
    plan = make_plan(kimi_k3(), PlanOptions(40 * GiB, 131072))
    data = json.loads(json.dumps(plan_to_dict(plan)))
    for key in ("budget_bytes", "num_blocks", "padding_bytes", "strategy", "capacity", "groups",
                "pools", "views", "ranks", "alternatives"):
        assert key in data
    assert data["budget_bytes"] == 40 * GiB
    assert data["strategy"] == "pagedkv"
    assert data["num_blocks"] == sum(g["num_blocks"] for g in data["groups"])
    assert data["ranks"] == 1
    cap = data["capacity"]
    assert cap["max_model_len"] == 131072
    assert cap["tokens"] == int(cap["max_concurrency"] * 131072)
    state, mla = data["groups"]
    assert mla["models"] == ["target", "draft"]
    assert mla["retention"] == {"kind": "full"}
    assert mla["bytes_per_token"] == 29 * 1152 and mla["bytes_per_request"] == 0
    assert len(mla["layers"]) == 29 and mla["layers"][-1] == "draft.layers.4.self_attn"
    assert state["retention"]["kind"] == "recurrent" and state["bytes_per_token"] == 0
    assert len(data["views"]) == 29 + 69 * 2  # one latent per MLA layer, conv + ssm per KDA
    (alt,) = data["alternatives"]
    assert alt["name"] == "vllm" and set(alt["capacity"]) == set(cap)
    documented = DOCS.read_text()
    for key in sorted(set(_keys(data))):  # the path, or its tail in the row of a parent
        parts = key.split(".")
        tails = {".".join(parts[i:]) for i in range(len(parts))}
        tails |= {tail.removesuffix("[]") for tail in tails}
        assert any(f"`{tail}`" in documented for tail in tails), f"docs lack `{key}`"


def test_json_retention_parameters():
    data = plan_to_dict(make_plan(gpt_oss_120b(), PlanOptions(40 * GiB, 131072)))
    assert data["groups"][0]["retention"] == {"kind": "sliding_window", "window": 128}
    assert data["groups"][0]["step_blocks"] == 2048 // 16


def test_format_plan_shows_groups_capacity_limit_and_comparison():
    plan = make_plan(kimi_k3(), PlanOptions(40 * GiB, 131072))
    text = format_plan(plan)
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("group "))
    for column in ("retention", "layers", "models", "block", "B/token", "fixed B/req"):
        assert column in header
    row = next(line for line in lines if line.startswith("1 "))
    assert "full-attention" in row and "29 MLA" in row and "target,draft" in row
    assert "33408" in row
    assert f"{69 * 6733824}" in next(line for line in lines if line.startswith("0 "))
    assert any(line.startswith("limited by: KV memory: 40.0 GiB holds") for line in lines)
    assert any(line.startswith("compare vllm: 7.52 requests") for line in lines)
    assert "draft.layers.{0-4}.self_attn" in text


def test_compress_names():
    names = tuple(f"model.layers.{i}.attn" for i in (0, 1, 2, 4, 6, 7)) + ("lm_head",)
    assert compress_names(names) == "model.layers.{0-2,4,6-7}.attn; lm_head"
    assert compress_names(("a.1.x",)) == "a.1.x"
    assert compress_names(tuple(f"x.{i}" for i in range(0, 400, 2)), limit=20).endswith("...")


def test_elastic_floors_and_ceilings_are_reported():
    plan = make_plan(kimi_k3(), PlanOptions(40 * GiB, 131072))
    data = json.loads(json.dumps(plan_to_dict(plan)))
    state, mla = data["groups"]
    page = 2 << 20
    assert data["elastic"]["page_bytes"] == page
    # floors: one slot; 131072 / 64 = 2048 MLA blocks (full attention: no step blocks)
    assert state["floor_blocks"] == 1 and mla["floor_blocks"] == 2048
    sb, mb = state["page_bytes"], mla["page_bytes"]
    # a ceiling is the budget less the other floor, rounded up to whole 2 MiB pages
    assert state["ceiling_blocks"] == (40 * GiB - -(-2048 * mb // page) * page) // sb
    assert mla["ceiling_blocks"] == (40 * GiB - -(-sb // page) * page) // mb
    assert state["ceiling_blocks"] > state["num_blocks"] and mla["ceiling_blocks"] >= mla["num_blocks"]
    text = format_plan(plan)
    assert "floor" in text and str(mla["ceiling_blocks"]) in text
