"""Figures the docs quote from pagedkv's own commands are what those commands print today
(vLLM's side of a table was measured with vLLM itself and is only compared to pagedkv's model
of it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
CATALOG_ROWS = {  # plan.md table row -> catalog name
    "llama3-8b": "llama-3-8b",
    "gpt-oss-120b": "gpt-oss-120b",
    "deepseek-v3": "deepseek-v3",
    "llama4-scout-chunked": "llama-4-scout",
}


def _plan_rows():
    text = (DOCS / "plan.md").read_text()
    for row, name in CATALOG_ROWS.items():
        m = re.search(rf"^\| {re.escape(row)} \| (\d+) \| (\d+) / ([\d.]+) / (\d+) \| same \| "
                      r"([\d.]+) / (\d+) \|$", text, re.M)
        assert m, f"plan.md has no table row for {row}"
        yield pytest.param(name, *m.groups(), id=row)


@pytest.mark.parametrize("name, max_len, vblocks, vconc, vtokens, conc, tokens", list(_plan_rows()))
def test_plan_md_table_rows(cli, name, max_len, vblocks, vconc, vtokens, conc, tokens):
    plan = cli("plan", name, "--memory", "40GiB", "--max-model-len", max_len, "--json").json()
    vllm = next(a for a in plan["alternatives"] if a["name"] == "vllm")
    assert vllm["num_blocks"] == int(vblocks)
    assert f"{vllm['capacity']['max_concurrency']:.4f}" == vconc
    assert vllm["capacity"]["tokens"] == int(vtokens)
    assert f"{plan['capacity']['max_concurrency']:.4f}" == conc
    assert plan["capacity"]["tokens"] == int(tokens)


def test_blocks_md_simulator_figures(cli):
    text = " ".join((DOCS / "blocks.md").read_text().split())
    args = ("--memory", "40GiB", "--max-model-len", "16384", "--workload", "shared-prefix",
            "--requests", "300", "--json")
    gpt = cli("simulate", "gpt-oss-20b", *args).json()
    m = re.search(r"gpt-oss-20b runs 300 requests in (\d+) steps, ([\d.]+) generated tokens", text)
    assert gpt["steps"] == int(m[1])
    assert f"{gpt['generated_tokens_per_step']:.1f}" == m[2]
    kimi = cli("simulate", "kimi-k3", *args).json()
    m = re.search(r"Kimi-K3 \(no drafter\): (\d+) state slots elastic .*? its prefix hit rate "
                  r"is ([\d.]+) \(fixed: [\d.]+; ideal 0.8\), (\d+) steps", text)
    slots = next(g["num_blocks"] for g in kimi["groups"] if g["retention"] == "recurrent")
    assert slots == int(m[1])
    assert f"{kimi['prefix_hit_rate']:.3f}" == m[2]
    assert kimi["steps"] == int(m[3])
    gemma = cli("simulate", "gemma-3-27b", *args).json()  # elastic pools, the default
    m = re.search(r"\| gemma-3-27b \| \*\*elastic\*\* \| \*\*(\d+)\*\* \| \*\*([\d.]+)\*\* \| "
                  r"([\d.]+) \| \*\*(\d+)\*\* \|", text)
    assert gemma["steps"] == int(m[1]) and gemma["requests_finished"] == 300
    assert f"{gemma['generated_tokens_per_step']:.1f}" == m[2]
    assert f"{gemma['prefix_hit_rate']:.3f}" == m[3]
    assert gemma["preemptions"] == int(m[4])
