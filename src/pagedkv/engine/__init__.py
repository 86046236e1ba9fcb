"""A small reference engine over pagedkv: load a Hugging Face model, schedule with
continuous batching through the block manager, run native model code over the reference
ops, sample.

The scheduler and request types need only the standard library (the simulator imports
them); :class:`Engine` needs torch and is imported on first use.
"""

from __future__ import annotations

from typing import Any

from pagedkv.engine.request import Request, SamplingParams
from pagedkv.engine.scheduler import Chunk, Scheduler, StepPlan

__all__ = ["Chunk", "Engine", "EngineOptions", "Request", "RequestOutput", "SamplingParams",
           "Scheduler", "StepPlan"]


def __getattr__(name: str) -> Any:
    if name in ("Engine", "EngineOptions", "RequestOutput"):
        from pagedkv.engine import engine

        return getattr(engine, name)
    raise AttributeError(name)
