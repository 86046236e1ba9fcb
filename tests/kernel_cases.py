"""Which ops-test cases the Triton backend runs in the CPU interpreter.

The interpreter is slow (every program steps through Python) and decodes fp8 loads
wrongly, so on CPU the Triton backend runs a representative subset; on a GPU
(PAGEDKV_TEST_DEVICE=cuda) it runs every case.
"""

from __future__ import annotations

import os

import pytest


def interpreted(backend: str) -> bool:
    return backend == "triton" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def only_on_gpu(backend: str, keep: bool = False, why: str = "a GPU run covers this case") -> None:
    """Skip this case when the Triton backend runs in the interpreter, unless ``keep``."""
    if interpreted(backend) and not keep:
        pytest.skip(f"triton interpreter: {why}")
