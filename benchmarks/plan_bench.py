"""Time make_plan on a 1,000-layer hybrid model (target: full, sliding-window, chunked-local,
MLA, MLA indexer and recurrent layers; drafter: DSpark-like MLA layers and an EAGLE-like
layer with position offset 1). Prints the median of several runs; target < 50 ms.

    python benchmarks/plan_bench.py [--layers 1000] [--repeat 30] [--tp 1] [--pp 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagedkv.kvspec import (
    Attention,
    AttentionKV,
    ChunkedLocal,
    Full,
    IndexerKV,
    LayerSpec,
    MLALatent,
    Recurrent,
    RecurrentState,
    SlidingWindow,
    StateTensor,
)
from pagedkv.plan import PlanOptions, format_bytes, make_plan

GDN = RecurrentState(
    (StateTensor("conv", (3, 8192), "bf16", 1), StateTensor("ssm", (32, 128, 128), "fp32", 0)),
    "gdn",
)


def hybrid_model(num_layers: int) -> list[LayerSpec]:
    """A repeating 8-layer pattern of every kind, then 6 drafter layers."""
    layers: list[LayerSpec] = []
    for i in range(num_layers):
        kind = i % 8
        if kind == 0:
            layers.append(LayerSpec(f"model.layers.{i}.attn", AttentionKV(8, 128), Full(), index=i))
        elif kind == 1:
            layers.append(LayerSpec(
                f"model.layers.{i}.attn", AttentionKV(8, 128), SlidingWindow(4096),
                Attention(window=4096), index=i,
            ))
        elif kind == 2:
            layers.append(LayerSpec(
                f"model.layers.{i}.attn", AttentionKV(8, 128), ChunkedLocal(8192),
                Attention(chunk=8192), index=i,
            ))
        elif kind == 3:
            layers.append(LayerSpec(f"model.layers.{i}.mla", MLALatent(), Full(), index=i))
        elif kind == 4:
            layers.append(LayerSpec(f"model.layers.{i}.indexer", IndexerKV(), Full(), index=i))
        else:
            layers.append(LayerSpec(f"model.layers.{i}.gdn", GDN, Recurrent(), index=i))
    for i in range(5):
        layers.append(LayerSpec(
            f"draft.layers.{i}.mla", MLALatent(), Full(), Attention(causal=False, draft_block=7),
            model="draft", index=i,
        ))
    layers.append(LayerSpec(
        "eagle.layers.0.attn", AttentionKV(8, 128), Full(), model="eagle", position_offset=1
    ))
    return layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    layers = hybrid_model(args.layers)
    options = PlanOptions(8 * 2**40, 131072, tp=args.tp, pp=args.pp)
    make_plan(layers, options)  # warm-up: imports, caches
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        plan = make_plan(layers, options)
        times.append(time.perf_counter() - start)
    result = {
        "layers": len(layers),
        "groups": len(plan.groups),
        "views_per_rank": len(plan.ranks[0].views),
        "ranks": len(plan.ranks),
        "median_ms": round(statistics.median(times) * 1e3, 2),
        "min_ms": round(min(times) * 1e3, 2),
        "max_ms": round(max(times) * 1e3, 2),
        "repeat": args.repeat,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"make_plan: {result['layers']} layers -> {result['groups']} groups, "
        f"{result['views_per_rank']} views per rank, {result['ranks']} rank(s), budget "
        f"{format_bytes(options.budget_bytes)}: median {result['median_ms']} ms "
        f"(min {result['min_ms']}, max {result['max_ms']}, {args.repeat} runs)"
    )


if __name__ == "__main__":
    main()
