"""Check an engine run against transformers: every logit row the engine computed (with
``record_logits``) against the dense forward of the request's whole sequence."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.engine.engine import Engine, RequestOutput


@dataclass(frozen=True)
class LogitComparison:
    """One pass of :func:`compare_logits` over every recorded row."""

    worst: float  # largest |engine - transformers| (NaN counts as inf)
    scale: float  # largest |transformers logit|: the scale a 16-bit tolerance needs
    rows: int  # rows compared
    reference_nonfinite: int  # rows where transformers' own logits are NaN or inf: there
    # a mismatch says nothing about the engine


def compare_logits(engine: Engine, hf_model: Any,
                   outputs: Sequence[RequestOutput]) -> LogitComparison:
    """Every recorded row of every request that did not fail, against transformers'
    forward over the request's whole sequence (one forward a request)."""
    worst = scale = 0.0
    rows = nonfinite = 0
    device = next(hf_model.parameters()).device
    for out in outputs:
        if out.error is not None or out.rid not in engine.logits:
            continue
        seq = out.prompt_token_ids + out.token_ids
        with torch.inference_mode():
            ref = hf_model(torch.tensor([seq], device=device)).logits[0].float()
        for pos, row in engine.logits[out.rid]:
            diff = (row.to(ref.device) - ref[pos]).abs().max()
            value = float(diff) if bool(torch.isfinite(diff)) else float("inf")
            worst = max(worst, value)
            scale = max(scale, float(ref[pos].abs().max()))
            rows += 1
            nonfinite += not bool(torch.isfinite(ref[pos]).all())
    return LogitComparison(worst, scale, rows, nonfinite)


def max_logit_diff(engine: Engine, hf_model: Any,
                   outputs: Sequence[RequestOutput]) -> tuple[float, float]:
    """(worst, scale) of :func:`compare_logits`."""
    result = compare_logits(engine, hf_model, outputs)
    return result.worst, result.scale
