"""Memory planning: layers (target + drafter, per rank) + a budget -> block-table groups,
pools, per-layer tensor views and a capacity report, next to what a vLLM-style plan fits.

Standard library only (no torch): ``pagedkv plan`` works after a plain install.
"""

from pagedkv.plan.gpus import GPU, GPUS, budget_from_gpu, find_gpu
from pagedkv.plan.grouping import default_block_size
from pagedkv.plan.planner import make_plan
from pagedkv.plan.report import format_plan, plan_to_dict
from pagedkv.plan.sizes import format_bytes, parse_size
from pagedkv.plan.sizing import reserved_blocks
from pagedkv.plan.types import (
    Capacity,
    Group,
    Plan,
    PlanOptions,
    Pool,
    RankPlan,
    StrategyReport,
    TensorView,
    TypicalCapacity,
)

__all__ = [
    "GPU", "GPUS", "Capacity", "Group", "Plan", "PlanOptions", "Pool", "RankPlan",
    "StrategyReport", "TensorView", "TypicalCapacity", "budget_from_gpu", "default_block_size",
    "find_gpu", "format_bytes", "format_plan", "make_plan", "parse_size", "plan_to_dict",
    "reserved_blocks",
]
