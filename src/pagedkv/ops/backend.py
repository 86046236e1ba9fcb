"""Which implementation the public ops run: the torch reference or the Triton kernels.

One switch for the whole package: ``set_backend("triton" | "torch")`` (or the environment
variable PAGEDKV_OPS_BACKEND, read once at import; default "torch"). ``use_backend`` scopes
a choice to a ``with`` block. The torch reference stays the oracle the kernels are tested
against; the Triton backend needs CUDA tensors, or CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from pagedkv.errors import InvalidArgumentError, UnsupportedCapabilityError

BACKENDS = ("torch", "triton")
ENV_VAR = "PAGEDKV_OPS_BACKEND"


def _from_env() -> str:
    name = os.environ.get(ENV_VAR, "torch").strip().lower() or "torch"
    if name not in BACKENDS:
        raise InvalidArgumentError(f"{ENV_VAR}={name!r}: choose one of {BACKENDS}")
    return name


_current = _from_env()


def triton_available() -> bool:
    """True when Triton imports (the kernels compile lazily on first use)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def set_backend(name: str) -> None:
    """Select the implementation every public op uses from now on."""
    global _current
    if name not in BACKENDS:
        raise InvalidArgumentError(f"unknown ops backend {name!r}: choose one of {BACKENDS}")
    if name == "triton" and not triton_available():
        raise UnsupportedCapabilityError("the triton ops backend needs the triton package")
    _current = name


def get_backend() -> str:
    return _current


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """``with use_backend("triton"): ...`` runs the block on that backend, then restores."""
    before = _current
    set_backend(name)
    try:
        yield
    finally:
        set_backend(before)
