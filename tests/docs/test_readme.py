"""The README says what the tool does: its Python example prints the shared MLA group, and its
Kimi-K3 figures (weights per GPU, KV budget, requests) are the figures `pagedkv plan` prints."""

import contextlib
import io
import json
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
GiB = 2**30


def _fenced_after(text: str, marker: str) -> str:
    block = text.split(marker, 1)[1]
    return block.split("```", 2)[1].split("\n", 1)[1].strip()


def test_readme_python_example_prints_the_shared_group():
    text = README.read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    lines = out.getvalue().splitlines()
    # one line per group, then the capacity; the MLA group holds 24 target + 5 draft layers
    assert any(line.split()[:3] == ["1", "full", "29"] and line.endswith("33408") for line in lines)
    assert "29 x 1152 = 33408" in text
    assert float(lines[-1].split()[0]) > 1


def test_readme_markers_keep_the_ci_commands():
    text = README.read_text()
    main = _fenced_after(text, "<!-- main-command -->")
    test = _fenced_after(text, "<!-- test-command -->")
    assert main.startswith("pip install -e . && pagedkv plan ")
    assert test == ("pip install torch==2.13.0 && pip install -e '.[test]' && "
                    "OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider")
    assert "https://download.pytorch.org/whl/cpu" in text


def test_readme_kimi_k3_figures_are_what_the_planner_says(cli):
    text = " ".join(README.read_text().split())
    main = _fenced_after(README.read_text(), "<!-- main-command -->").split(" && ", 1)[1]
    argv = main.split()[1:]
    pp = int(argv[argv.index("--pp") + 1])
    # at --tp 8 alone the weights do not fit: exit 2 naming the per-GPU weight figure
    per_gpu = int(re.search(r"at tensor parallel 8 each GPU would need (\d+) GiB", text)[1])
    refused = cli(*argv[:argv.index("--pp")], *argv[argv.index("--pp") + 2:])
    assert refused.code == 2, refused.err
    exact = float(re.search(r"cannot hold ([\d.]+) GiB of weights per rank", refused.err)[1])
    assert int(exact) == per_gpu
    total = re.search(r"holds about ([\d.]+) TiB of weights", text)[1]
    assert abs(exact * 8 / 1024 - float(total)) < 0.05
    # the main command: weights per GPU, KV budget per GPU, requests of 131072 tokens
    m = re.search(r"each GPU holds (\d+) GiB of weights and keeps (\d+) GiB for the KV cache: "
                  r"about (\d+) requests of 131072 tokens", text)
    weights, kv, requests = (int(x) for x in m.groups())
    plan = json.loads(cli(*argv, "--json").out)
    assert round(plan["budget_bytes"] / GiB) == kv
    assert int(plan["capacity"]["max_concurrency"]) == requests
    assert round(exact / pp) == weights  # the pipeline stages split the same weights
