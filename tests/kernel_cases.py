"""What the ops tests share across backends: which cases the Triton backend runs in the CPU
interpreter, the tolerance each backend is held to, the interpreter's warning filter.

The interpreter is slow (every program steps through Python) and decodes fp8 loads
wrongly, so on CPU the Triton backend runs a representative subset; on a GPU
(PAGEDKV_TEST_DEVICE=cuda) it runs every case.
"""

from __future__ import annotations

import os

import pytest

# Triton's interpreter (CPU runs of the triton backend) warns on every scalar index:
# ``pytestmark = INTERPRETER_WARNINGS`` in a module that runs it
INTERPRETER_WARNINGS = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning")
# float64 reference vs float64 compute (torch) or float32 accumulation (triton kernels)
EXACT = {"torch": dict(rtol=1e-9, atol=1e-9), "triton": dict(rtol=2e-4, atol=2e-4)}


def interpreted(backend: str) -> bool:
    return backend == "triton" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def only_on_gpu(backend: str, keep: bool = False, why: str = "a GPU run covers this case") -> None:
    """Skip this case when the Triton backend runs in the interpreter, unless ``keep``."""
    if interpreted(backend) and not keep:
        pytest.skip(f"triton interpreter: {why}")
