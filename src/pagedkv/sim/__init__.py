"""Discrete-step simulation of continuous batching through the real block manager
(no model, no GPU): workloads, traces, the simulator and its plot."""

from pagedkv.sim.simulator import GroupStats, SimOptions, SimResult, simulate
from pagedkv.sim.trace import read_trace
from pagedkv.sim.types import SimRequest
from pagedkv.sim.workloads import WORKLOADS, make_workload

__all__ = ["WORKLOADS", "GroupStats", "SimOptions", "SimRequest", "SimResult", "make_workload",
           "read_trace", "simulate"]
