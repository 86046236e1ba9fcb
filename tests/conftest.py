"""Shared test fixtures: one torch thread, the device the torch tests run on, a CLI runner.

Tests live in folders that mirror the packages (tests/<package>/); this file's folder is on
sys.path, so helpers such as ``dense_reference`` import by name from any of them.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
if os.environ.get("PAGEDKV_TEST_DEVICE", "cpu") == "cpu":
    # Triton kernels run in the interpreter on CPU; it must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # torch is optional: the core suite runs without it
    import torch
except ImportError:  # pragma: no cover - exercised on a core-only install
    torch = None
else:
    # Two threads on a busy 2-core machine make the tests 20-40x slower.
    torch.set_num_threads(1)


@pytest.fixture
def device():
    """Where torch tests run: env PAGEDKV_TEST_DEVICE (default cpu); skips if unavailable."""
    if torch is None:
        pytest.skip("needs torch")
    dev = torch.device(os.environ.get("PAGEDKV_TEST_DEVICE", "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("PAGEDKV_TEST_DEVICE=cuda but no CUDA device")
    return dev


class CliResult(NamedTuple):
    code: int
    out: str
    err: str

    def json(self):
        if self.code != 0:
            raise AssertionError(f"exit {self.code}: {self.err}")
        return json.loads(self.out)


@pytest.fixture
def cli(capsys):
    """Run ``pagedkv ARGV...`` in-process; returns exit code, stdout and stderr."""
    from pagedkv.cli import main

    def run(*argv: str) -> CliResult:
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse's own usage errors exit directly
            code = exc.code
        out, err = capsys.readouterr()
        return CliResult(code, out, err)

    return run


OPS_BACKENDS = ("torch", "triton")


@pytest.fixture(params=OPS_BACKENDS)
def ops_backend(request):
    """Run a pagedkv.ops test once per backend. The triton run skips without triton; on CPU
    it runs the kernels in Triton's interpreter (TRITON_INTERPRET=1, set above)."""
    if torch is None:
        pytest.skip("needs torch")
    name = request.param
    if name == "triton":
        pytest.importorskip("triton")
    from pagedkv.ops import use_backend

    with use_backend(name):
        yield name
