"""``pagedkv plan``: what fits, and how memory is split between a model's layers."""

from __future__ import annotations

import argparse
import json

from pagedkv.cli.common import add_budget_arguments, add_model_arguments, plan_from_args


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "plan",
        help="plan KV-cache memory for a model (and its drafter)",
        description="Plan KV-cache memory: block-table groups, pools, tensor views and what fits.",
    )
    add_model_arguments(parser)
    add_budget_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object (docs/plan.md)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedkv.plan import format_plan, plan_to_dict

    spec, plan = plan_from_args(args)
    if args.json:
        out = plan_to_dict(plan)
        out = {"model": spec.name, "draft": spec.draft_name, **out}
        print(json.dumps(out, indent=2))
    else:
        title = spec.name + (f" + {spec.draft_name}" if spec.draft_name else "")
        print(f"{title}")
        print(format_plan(plan))
    return 0
