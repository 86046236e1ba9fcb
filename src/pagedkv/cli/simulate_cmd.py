"""``pagedkv simulate``: continuous batching through the real block manager, no model."""

from __future__ import annotations

import argparse
import json
import sys

from pagedkv.cli.common import add_budget_arguments, add_model_arguments, positive_int


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    from pagedkv.blocks.hashing import DEFAULT_HASH, HASH_ALGOS
    from pagedkv.sim.workloads import WORKLOADS

    parser = sub.add_parser(
        "simulate",
        help="simulate continuous batching through the block manager (no model, no GPU)",
        description="Discrete-step simulation of continuous batching through pagedkv's block "
        "manager for a planned model: hit rate, preemptions, blocks used per group.",
    )
    add_model_arguments(parser)
    add_budget_arguments(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--workload", choices=sorted(WORKLOADS), help="a synthetic workload")
    source.add_argument("--trace", metavar="FILE", help="JSON lines: prompt_tokens, output_len, "
                        "optional arrival_step")
    parser.add_argument("--requests", type=positive_int, default=200, metavar="N",
                        help="requests of a synthetic workload (default 200)")
    parser.add_argument("--seed", type=_non_negative, default=0, metavar="S")
    parser.add_argument("--max-running", type=positive_int, default=256, metavar="N",
                        help="most requests running at once (default 256)")
    parser.add_argument("--spec-tokens", type=_non_negative, default=0, metavar="K",
                        help="draft tokens per step (speculative decoding)")
    parser.add_argument("--acceptance", type=_probability, default=0.7, metavar="P",
                        help="probability each draft token is accepted (default 0.7)")
    parser.add_argument("--hash", choices=HASH_ALGOS, default=DEFAULT_HASH,
                        help=f"block hash (default {DEFAULT_HASH}: collision-resistant, safe for "
                        "multi-tenant caches; fast-single-tenant is a 64-bit hash anyone can "
                        "collide: one tenant only)")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--fixed-pools", action="store_true",
                        help="give every pool the plan's fixed size instead of sharing the "
                        "budget by demand (elastic pools, the default)")
    ckpt = parser.add_mutually_exclusive_group()
    ckpt.add_argument("--checkpoint-every", type=positive_int, metavar="N",
                      help="recurrent groups whose model sets no checkpoints save their state "
                      "every N blocks and nowhere else (default: at branch points and the "
                      "newest decoded block, in spare state slots)")
    ckpt.add_argument("--no-checkpoints", action="store_true",
                      help="no recurrent checkpoints (recurrent models then get no prefix hits)")
    parser.add_argument("--checked", action="store_true",
                        help="check what every call touched, with a full sweep every 1,024 calls "
                        "(also PAGEDKV_DEBUG=1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", help="draw blocks used per group over time")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedkv.blocks import KVCacheManager
    from pagedkv.cli.common import plan_from_args
    from pagedkv.sim import SimOptions, make_workload, read_trace, simulate

    options = SimOptions(max_running=args.max_running, spec_tokens=args.spec_tokens,
                         acceptance=args.acceptance, seed=args.seed)
    requests = read_trace(args.trace) if args.trace else None  # bad traces fail before planning
    spec, plan = plan_from_args(args)
    if requests is None:
        requests = make_workload(args.workload, args.requests, args.seed,
                                 plan.options.max_model_len)
    manager = KVCacheManager.from_plan(plan, hash_algo=args.hash, elastic=not args.fixed_pools,
                                       enable_caching=not args.no_prefix_caching,
                                       checked=True if args.checked else None,
                                       recurrent_checkpoint_every=0 if args.no_checkpoints
                                       else args.checkpoint_every)
    result = simulate(manager, requests, options)
    title = spec.name + (f" + {spec.draft_name}" if spec.draft_name else "")
    if args.plot:
        from pagedkv.sim.plot import plot_blocks

        plot_blocks(result, args.plot, f"{title}: {args.workload or args.trace}")
    if args.json:
        out = {"model": spec.name, "draft": spec.draft_name,
               "workload": args.workload, "trace": args.trace, **result.to_json()}
        print(json.dumps(out, indent=2))
    else:
        print(format_result(title, result))
    for reason in result.rejected_reasons[:3]:
        print(f"pagedkv: warning: rejected {reason}", file=sys.stderr)
    return 0


def format_result(title: str, r) -> str:  # noqa: ANN001 - SimResult, imported lazily
    lines = [
        f"{title}: {r.requests_finished} of {r.requests_total} requests finished in {r.steps} "
        f"steps ({r.requests_rejected} rejected as too large)",
        f"  generated tokens      {r.generated_tokens} ({r.tokens_per_step:.2f} per step)",
        f"  prefix hit rate       {r.prefix_hit_rate:.4f} ({r.hit_tokens} of {r.prompt_tokens} "
        "prompt tokens from cache)",
        f"  preemptions           {r.preemptions}",
        f"  leaked blocks         {r.leaked_blocks}",
        "  group  retention        blocks   peak used   mean used",
    ]
    for g in r.groups:
        lines.append(f"  {g.group_id:>5}  {g.retention:<15} {g.num_blocks:>7} {g.peak_blocks:>11} "
                     f"{g.mean_blocks:>11.1f}")
    return "\n".join(lines)
