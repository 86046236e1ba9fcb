"""Byte sizes as people write them (``80GiB``, ``1.5TB``, ``1234``) and back."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from pagedkv.errors import InvalidArgumentError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in ``text``: a plain integer or a number with a unit.

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB)
    powers of 1024; units are case-insensitive. Bare ``K``/``M``/``G`` are refused because
    tools disagree on what they mean. Fractions of a byte are dropped.
    """
    if str(text).strip().startswith("-"):
        raise InvalidArgumentError(f"size {text!r} is negative; sizes are byte counts >= 0")
    match = _SIZE.match(str(text))
    if match is None:
        raise InvalidArgumentError(
            f"cannot read size {text!r}: expected a number with an optional unit "
            "(B, kB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '80GiB' or '40GB'"
        )
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise InvalidArgumentError(
            f"cannot read size {text!r}: unknown unit {unit!r}; use one of "
            "B, kB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
        )
    try:
        value = Decimal(number) * factor
    except InvalidOperation as exc:  # pragma: no cover - the pattern admits only numbers
        raise InvalidArgumentError(f"cannot read size {text!r}") from exc
    return int(value)


def format_bytes(n: int) -> str:
    """Short binary form for people: ``40.0 GiB``, ``1.2 MiB``, ``512 B``."""
    if abs(n) < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
