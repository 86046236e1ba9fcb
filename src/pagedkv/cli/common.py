"""Arguments shared by the commands that plan a model (plan, simulate), and their reading."""

from __future__ import annotations

import argparse
import sys

from pagedkv.errors import InvalidArgumentError

KV_DTYPES = ("auto", "bf16", "fp16", "fp8", "fp8_ds_mla")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="catalog name (see `pagedkv models`), "
                        "config.json, or checkpoint folder")
    parser.add_argument("--draft", metavar="DRAFT", help="drafter: catalog name, path, or 'mtp' "
                        "(the target's own MTP layers)")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto")
    parser.add_argument("--block-size", type=positive_int, metavar="N",
                        help="tokens per block (default 64 with MLA layers, else 16)")
    parser.add_argument("--max-model-len", type=positive_int, metavar="N",
                        help="longest request in tokens (default: the config's "
                        "max_position_embeddings)")
    parser.add_argument("--max-batched-tokens", type=positive_int, default=2048, metavar="N",
                        help="tokens one step may process over the whole batch (default 2048)")
    parser.add_argument("--typical-len", type=positive_int, metavar="N",
                        help="size the pools for the most requests of N tokens at once, "
                        "keeping room for one of --max-model-len (default: size them for "
                        "requests of --max-model-len)")
    parser.add_argument("--via-transformers", action="store_true",
                        help="fill the config's defaults with transformers' own config class "
                        "before reading it (needs transformers; a cross-check)")
    parser.add_argument("--tp", type=positive_int, default=1, metavar="N", help="tensor parallel")
    parser.add_argument("--pp", type=positive_int, default=1, metavar="N", help="pipeline parallel")


def add_budget_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--memory", metavar="SIZE",
                       help="KV-cache bytes per rank: 80GiB, 512MiB, 1.5TB or plain bytes")
    group.add_argument("--gpu", metavar="NAME", help="plan for this GPU: h100, h200, b200, a100-80gb, ... (an unknown name lists them)")
    parser.add_argument("--utilization", type=float, default=0.9, metavar="F",
                        help="fraction of GPU memory pagedkv may use with --gpu (default 0.9)")
    parser.add_argument("--weights", metavar="SIZE",
                        help="weight bytes over all ranks with --gpu (default: estimated "
                        "from the config)")


def budget_bytes(args: argparse.Namespace, estimated_weight_bytes) -> int:
    """Per-rank KV budget from --memory, or from --gpu, --utilization and the weights.

    ``estimated_weight_bytes`` is an int or a callable returning one: it is asked for only
    with --gpu and no --weights, so weight-only config fields are needed only then."""
    from pagedkv.plan import budget_from_gpu, parse_size

    if args.memory is not None:
        if args.weights is not None:
            raise InvalidArgumentError("--weights only applies with --gpu (--memory is the KV budget)")
        budget = parse_size(args.memory)
        if budget <= 0:
            raise InvalidArgumentError(f"--memory must be positive, got {args.memory!r}")
        return budget
    if args.gpu is None:
        raise InvalidArgumentError("give a budget: --memory SIZE or --gpu NAME")
    if not 0 < args.utilization <= 1:
        raise InvalidArgumentError(f"--utilization must be in (0, 1], got {args.utilization}")
    if args.weights is not None:
        weights = parse_size(args.weights)
    elif callable(estimated_weight_bytes):
        weights = estimated_weight_bytes()
    else:
        weights = estimated_weight_bytes
    ranks = args.tp * args.pp
    return budget_from_gpu(args.gpu, args.utilization, -(-weights // ranks))


def warn_unread_keys(args: argparse.Namespace) -> None:
    """One stderr line per config naming keys that look like cache geometry but that
    pagedkv does not read; the plan still runs and the exit status is unchanged."""
    from pagedkv.models import load_config
    from pagedkv.models.fields import text_config
    from pagedkv.models.geometry import unread_geometry_keys

    sources = [("MODEL", args.model)]
    if args.draft is not None and args.draft.strip().lower() != "mtp":
        sources.append(("--draft", args.draft))
    for label, source in sources:
        keys = unread_geometry_keys(text_config(load_config(source)))
        if keys:
            print(f"pagedkv: warning: {label} config has keys that look like cache geometry "
                  f"but are not read: {', '.join(keys)}", file=sys.stderr)


def plan_from_args(args: argparse.Namespace):
    """Load MODEL (+ --draft) and plan it with the budget and options the arguments give.

    Returns ``(model_spec, plan)``.
    """
    from pagedkv.models import load_model
    from pagedkv.plan import PlanOptions, make_plan

    spec = load_model(args.model, args.draft, kv_dtype=args.kv_dtype,
                      via_transformers=args.via_transformers)
    warn_unread_keys(args)
    options = PlanOptions(
        budget_bytes=budget_bytes(args, spec.need_weight_bytes),
        max_model_len=args.max_model_len or spec.need_max_position_embeddings(),
        block_size=args.block_size,
        max_batched_tokens=args.max_batched_tokens,
        tp=args.tp,
        pp=args.pp,
        typical_len=args.typical_len,
    )
    return spec, make_plan(spec.layers, options)
