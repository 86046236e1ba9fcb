"""Every fenced block of README.md and docs/*.md is labelled, and every ``python`` and ``sh``
block runs: Python blocks are executed, shell lines run one command at a time (``a && b`` is two
commands). In a ``text`` block, a line ``$ pagedkv ...`` is a transcript: the command runs and
prints the lines that follow it (exit status 2 when they show ``pagedkv: error:``). ``pagedkv`` commands run in-process, ``python`` scripts in a subprocess. Package
installs and the test suite itself are skipped with a reason (.ci/run runs those in a fresh
virtual environment); a line ending in ``# slow`` runs only with PAGEDKV_DOCS_SLOW=1; blocks
that need torch skip without it.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
RUN = {"python", "sh"}
SHOWN = {"text", "json"}  # output samples and synopses: shown, not run
SLOW = "# slow"

try:
    import torch  # noqa: F401
except ImportError:
    HAVE_TORCH = False
else:
    HAVE_TORCH = True


def _blocks():
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            yield path.relative_to(ROOT).as_posix(), line, m.group(1).strip(), m.group(2)


def _commands():
    for doc, line, lang, body in _blocks():
        if lang != "sh":
            continue
        joined = body.replace("\\\n", " ")
        for i, raw in enumerate(joined.splitlines()):
            text = raw.strip()
            if not text or text.startswith("#"):
                continue
            slow = text.endswith(SLOW)
            text = re.split(r"\s+#\s", text, maxsplit=1)[0].strip()
            for part in text.split(" && "):
                yield pytest.param(part.strip(), slow, id=f"{doc}:{line + 1 + i}:{part.split()[0]}")


def _python_blocks():
    for doc, line, lang, body in _blocks():
        if lang == "python":
            yield pytest.param(body, id=f"{doc}:{line}")


def _transcripts():
    for doc, line, lang, body in _blocks():
        if lang != "text":
            continue
        lines = body.splitlines()
        starts = [i for i, text in enumerate(lines) if text.startswith("$ ")]
        for k, i in enumerate(starts):
            end = starts[k + 1] if k + 1 < len(starts) else len(lines)
            expected = [text for text in lines[i + 1:end] if text.strip()]
            yield pytest.param(lines[i][2:], expected, id=f"{doc}:{line + 1 + i}")


@pytest.mark.parametrize("command, expected", list(_transcripts()))
def test_doc_transcript_prints_what_it_shows(command, expected, cli):
    argv = shlex.split(command)
    assert argv[0] == "pagedkv", f"transcripts may only show pagedkv commands: {command}"
    result = cli(*argv[1:])
    failing = any(text.startswith("pagedkv: error:") for text in expected)
    assert result.code == (2 if failing else 0), result.err
    printed = (result.out + result.err).splitlines()
    missing = [text for text in expected if text not in printed]
    assert not missing, f"{command} no longer prints {missing}"


def test_every_fenced_block_is_labelled():
    unlabelled = [f"{doc}:{line} ({lang or 'no label'})" for doc, line, lang, _ in _blocks()
                  if lang not in RUN | SHOWN]
    assert not unlabelled, f"label each block python, sh (run by the tests) or text: {unlabelled}"


def test_docs_have_commands_and_python():
    assert sum(1 for _ in _commands()) >= 10
    assert sum(1 for _ in _python_blocks()) >= 3


def test_docs_name_no_path_outside_the_repository():
    pattern = re.compile(r"(?<![\w.])(/work/|/tmp/|/root/|/home/|\.\./shared|~/)")
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for p in DOCS for i, line in enumerate(p.read_text().splitlines(), 1)
             if pattern.search(line)]
    assert not found, found


def _needs_torch(text: str) -> bool:
    return bool(re.search(r"^\s*(import torch|from torch|from pagedkv\.(ops|batch)|"
                          r"import pagedkv\.(ops|batch))", text, re.M))


@pytest.mark.parametrize("command, slow", list(_commands()))
def test_doc_command_runs(command, slow, cli):
    argv = shlex.split(command)
    if argv[:2] == ["pip", "install"]:
        pytest.skip("installs packages: .ci/run runs it in a fresh virtual environment")
    if "pytest" in argv:
        pytest.skip("runs the whole test suite")
    if slow and not os.environ.get("PAGEDKV_DOCS_SLOW"):
        pytest.skip("slow: set PAGEDKV_DOCS_SLOW=1 to run it")
    if argv[0] == "pagedkv":
        result = cli(*argv[1:])
        assert result.code == 0, f"{command}: {result.err}"
        assert result.out
        return
    assert argv[0] == "python", f"docs may only show pagedkv, python and pip commands: {command}"
    script = ROOT / argv[1] if argv[1].endswith(".py") else None
    if script is not None and _needs_torch(script.read_text()) and not HAVE_TORCH:
        pytest.skip("needs torch")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{command}: {proc.stderr[-2000:]}"


@pytest.mark.parametrize("code", list(_python_blocks()))
def test_doc_python_block_runs(code, monkeypatch):
    if _needs_torch(code) and not HAVE_TORCH:
        pytest.skip("needs torch")
    monkeypatch.chdir(ROOT)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<doc block>", "exec"), {"__name__": "__doc_block__"})
