"""Check an engine run against transformers: every logit row the engine computed (with
``record_logits``) against the dense forward of the request's whole sequence."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pagedkv.engine.engine import Engine, RequestOutput


def max_logit_diff(engine: Engine, hf_model: Any,
                   outputs: Sequence[RequestOutput]) -> tuple[float, float]:
    """(largest |engine - transformers| over every recorded row (NaN counts as inf),
    largest |transformers logit| over those rows: the scale a 16-bit tolerance needs)."""
    worst = scale = 0.0
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
    return worst, scale


def reference_nonfinite_rows(engine: Engine, hf_model: Any,
                             outputs: Sequence[RequestOutput]) -> tuple[int, int]:
    """(rows where transformers' own logits are NaN or inf, rows recorded): when the
    reference has no finite answer, a mismatch says nothing about the engine."""
    bad = total = 0
    device = next(hf_model.parameters()).device
    for out in outputs:
        if out.error is not None or out.rid not in engine.logits:
            continue
        seq = out.prompt_token_ids + out.token_ids
        with torch.inference_mode():
            ref = hf_model(torch.tensor([seq], device=device)).logits[0].float()
        for pos, _ in engine.logits[out.rid]:
            total += 1
            bad += not bool(torch.isfinite(ref[pos]).all())
    return bad, total
