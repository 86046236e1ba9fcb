"""Blocks used per group over the simulated steps (matplotlib, imported only here)."""

from __future__ import annotations

from pathlib import Path

from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.simulator import SimResult


def plot_blocks(result: SimResult, path: str | Path, title: str = "") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidArgumentError("--plot needs matplotlib (pip install 'pagedkv[plot]')") from None
    fig, ax = plt.subplots(figsize=(8, 4))
    steps = range(len(result.timeline))
    for gi, g in enumerate(result.groups):
        ax.plot(steps, [t[gi] for t in result.timeline],
                label=f"group {g.group_id} ({g.retention}, {g.num_blocks} blocks)")
    ax.set_xlabel("step")
    ax.set_ylabel("blocks used")
    ax.set_title(title or "blocks used per group")
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
