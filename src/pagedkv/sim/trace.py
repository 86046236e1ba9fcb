"""Reading a workload trace: JSON lines of ``{"prompt_tokens": [...], "output_len": N,
"arrival_step": S}`` (``arrival_step`` optional, default 0). Blank lines are skipped.
Every malformed line raises :class:`TraceError` naming the file and line number."""

from __future__ import annotations

import json
from pathlib import Path

from pagedkv.errors import TraceError
from pagedkv.sim.types import SimRequest


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_line(text: str, where: str) -> SimRequest:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("prompt_tokens", "output_len"):
        if key not in obj:
            raise TraceError(f"{where}: missing field {key!r}")
    prompt = obj["prompt_tokens"]
    if not isinstance(prompt, list) or not all(_int(t) for t in prompt):
        raise TraceError(f"{where}: prompt_tokens must be a list of integers")
    if not prompt:
        raise TraceError(f"{where}: prompt_tokens is empty")
    if any(t < 0 for t in prompt):
        raise TraceError(f"{where}: prompt_tokens holds a negative token id")
    out = obj["output_len"]
    if not _int(out) or out < 0:
        raise TraceError(f"{where}: output_len must be an integer >= 0, got {out!r}")
    arrival = obj.get("arrival_step", 0)
    if not _int(arrival) or arrival < 0:
        raise TraceError(f"{where}: arrival_step must be an integer >= 0, got {arrival!r}")
    return SimRequest(tuple(prompt), out, arrival)


def read_trace(path: str | Path) -> list[SimRequest]:
    """All requests of the trace at ``path`` (TraceError on the first bad line)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read trace ({exc})") from None
    requests = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            requests.append(parse_line(line, f"{path}:{lineno}"))
    if not requests:
        raise TraceError(f"{path}: the trace holds no request")
    return requests
