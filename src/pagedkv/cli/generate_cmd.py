"""``pagedkv generate``: run prompts through the reference engine (a checkpoint folder, or
a tiny random model of a catalog architecture), optionally checked against transformers."""

from __future__ import annotations

import argparse
import json
import random
import sys

from pagedkv.cli.common import positive_int
from pagedkv.errors import InvalidArgumentError, PagedKVError


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "generate", help="generate with the reference engine (checkpoint or --tiny model)",
        description="Continuous batching over pagedkv's plan, block manager, metadata and "
        "reference ops on native model code; --verify compares every logit row with "
        "transformers' dense forward.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="PATH", help="Hugging Face checkpoint folder")
    source.add_argument("--tiny", metavar="ARCH", help="tiny random fp32 model of a catalog "
                        "model (see `pagedkv models`), built offline")
    parser.add_argument("--prompt", action="append", metavar="TEXT",
                        help="a prompt (repeatable); needs a tokenizer (--tiny: bytes)")
    parser.add_argument("--prompts", type=positive_int, metavar="N",
                        help="N random token prompts (default 4 without --prompt)")
    parser.add_argument("--prompt-len", type=positive_int, default=24, metavar="N",
                        help="tokens of each random prompt; the first half is shared")
    parser.add_argument("--max-new-tokens", type=positive_int, default=16, metavar="N")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verify", action="store_true",
                        help="compare logits at every position with transformers (dense)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto")
    parser.add_argument("--block-size", type=positive_int, default=16, metavar="N")
    parser.add_argument("--max-model-len", type=positive_int, metavar="N",
                        help="default: the config's, at most 4096")
    parser.add_argument("--max-batched-tokens", type=positive_int, default=256, metavar="N")
    parser.add_argument("--kv-cache-mib", type=positive_int, metavar="N",
                        help="KV-cache budget (default: room for 4 requests of --max-model-len)")
    parser.add_argument("--draft", choices=("mtp", "dspark", "eagle3", "scripted"),
                        help="speculative decoding with this drafter (scripted: proposes the "
                        "plain run's own tokens); reports acceptance_rate, mean_accepted_tokens "
                        "and, with --verify, lossless")
    parser.add_argument("--spec-tokens", type=positive_int, metavar="K",
                        help="draft tokens per step (default 3; needs --draft)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from pagedkv.engine import Engine, EngineOptions, SamplingParams

    device = _device(args.device)
    if device.type == "cuda":  # fp32 means fp32: no TF32 in matmuls or convolutions
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    hf = None
    if args.tiny is not None:
        from pagedkv.engine.tiny import ByteTokenizer, tiny_model

        hf = tiny_model(args.tiny, seed=args.seed,
                        mtp_layers=1 if args.draft == "mtp" else 0).to(device)
        source, tokenizer = hf, ByteTokenizer()
        arch = type(hf).__name__
    else:
        source, tokenizer = args.model, None
        arch = None
    dtype = None if args.dtype == "auto" else args.dtype
    options = EngineOptions(
        device=str(device), dtype=dtype, block_size=args.block_size,
        max_model_len=args.max_model_len, max_batched_tokens=args.max_batched_tokens,
        kv_cache_bytes=None if args.kv_cache_mib is None else args.kv_cache_mib << 20,
        seed=args.seed, record_logits=args.verify)
    if options.max_model_len is None:
        options = _capped(options, source)
    if not args.prompt and args.prompt_len > options.max_model_len:
        raise InvalidArgumentError(f"--prompt-len {args.prompt_len} is longer than "
                                   f"max_model_len {options.max_model_len}")
    if args.spec_tokens is not None and args.draft is None:
        raise InvalidArgumentError("--spec-tokens needs --draft")
    spec_options = None
    if args.draft is not None:
        from dataclasses import replace

        spec_options = replace(options, spec_tokens=args.spec_tokens or 3)
    engine = Engine(source, options, tokenizer=tokenizer)
    arch = arch or (getattr(engine.config, "architectures", None) or ["?"])[0]
    prompts = _prompts(args, engine.vocab_size)
    sampling = [SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               top_p=args.top_p, top_k=args.top_k, seed=args.seed + i)
                for i in range(len(prompts))]
    bar = None
    if not args.json:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts) * args.max_new_tokens, unit="tok", file=sys.stderr,
                   disable=None)
    plain = None
    if spec_options is not None:
        from pagedkv.engine.speculative import SpeculativeEngine, make_drafter

        script: dict = {}  # scripted: the plain run's own tokens, filled in below
        weights = None
        if args.draft == "mtp" and args.model is not None:
            from pathlib import Path

            from pagedkv.engine.loader import iter_safetensors, weight_files

            weights = iter_safetensors(weight_files(Path(args.model)))
        drafter = make_drafter(args.draft, engine.config, script=script, weights=weights,
                               seed=args.seed, dspark_block=spec_options.spec_tokens + 1)
        spec = SpeculativeEngine(source, spec_options, drafter, tokenizer=tokenizer)
        if args.draft == "scripted" or args.verify:  # also --verify's lossless baseline
            plain = engine.generate(prompts, sampling)
            script.update({i: o.token_ids for i, o in enumerate(plain)})
        engine = spec
    outputs = engine.generate(prompts, sampling, progress=bar.update if bar else None)
    if bar is not None:
        bar.close()
    diff = scale = None
    if args.verify:
        from pagedkv.engine.verify import compare_logits

        if hf is None:
            hf = _reference(args.model, device, engine.dtype)
        elif engine.dtype != torch.float32:
            hf = hf.to(engine.dtype)
        try:
            compared = compare_logits(engine, hf, outputs)
        except Exception as exc:  # noqa: BLE001 - transformers' forward on a config it took
            raise PagedKVError(f"transformers' own forward fails for --verify: "
                               f"{type(exc).__name__}: {exc}") from None
        if compared.reference_nonfinite:
            raise PagedKVError(
                f"transformers' own logits are NaN or inf at {compared.reference_nonfinite} "
                f"of {compared.rows} rows: this config and weights give no finite output to "
                "verify against")
        diff, scale = compared.worst, compared.scale
    # fp32: exact to rounding. 16-bit: both sides round every op to 8 (bf16) or 11 (fp16)
    # mantissa bits, in different orders; 4% of the largest logit (at least 0.04) allows that
    tol = None
    if diff is not None:
        tol = 1e-4 if engine.dtype == torch.float32 else 0.04 * max(1.0, scale)
    report = {
        "architecture": arch,
        "device": str(device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "requests": len(prompts),
        "finished": sum(o.error is None for o in outputs),
        "tokens_generated": engine.tokens_generated,
        "steps": engine.steps,
        "max_abs_logit_diff": diff,
        "tolerance": None if tol is None else round(tol, 6),
        "match": None if diff is None else diff <= tol,
        "prefix_hit_rate": round(engine.prefix_hit_rate, 6),
        "preemptions": engine.preemptions,
        **_speculation(args, engine, plain, outputs),
        "outputs": [{"prompt_tokens": len(o.prompt_token_ids), "token_ids": o.token_ids,
                     "text": o.text, "finish_reason": o.finish_reason} for o in outputs],
    }
    if args.json:
        print(json.dumps(report))
    else:
        for i, o in enumerate(outputs):
            shown = o.text if o.text is not None else o.token_ids
            print(f"[{i}] {o.finish_reason}: {shown!r}")
        print(f"{arch}: {report['requests']} requests, {report['tokens_generated']} tokens in "
              f"{report['steps']} steps, prefix hit rate {report['prefix_hit_rate']:.1%}, "
              f"{report['preemptions']} preemptions")
        if args.draft is not None:
            print(f"speculative ({args.draft}, k={report['spec_tokens']}): acceptance rate "
                  f"{report['acceptance_rate']:.1%}, {report['mean_accepted_tokens']:.2f} tokens "
                  f"per verify pass, lossless {report['lossless']}")
        if diff is not None:
            verdict = "match" if report["match"] else "MISMATCH"
            print(f"verify: max |logit diff| {diff:.3g} vs transformers ({verdict}, "
                  f"tolerance {tol:g})")
    failed = [(i, o) for i, o in enumerate(outputs) if o.error is not None]
    if failed:
        i, o = failed[0]
        raise type(o.error)(f"{len(failed)} of {len(outputs)} requests failed "
                            f"(the first: prompt {i}): {o.error}")
    if report.get("lossless") is False:
        print("pagedkv: error: greedy output with speculation differs from greedy output "
              "without it", file=sys.stderr)
        return 1
    if diff is not None and not report["match"]:
        print(f"pagedkv: error: logits differ from transformers by {diff:.3g} "
              f"(tolerance {tol:g})", file=sys.stderr)
        return 1
    return 0


def _speculation(args: argparse.Namespace, engine, plain, outputs) -> dict:  # noqa: ANN001
    """Report keys of a speculative run: acceptance, and (--verify, greedy) lossless."""
    if args.draft is None:
        return {}
    stats = engine.stats
    lossless = None
    if args.verify and args.temperature == 0 and plain is not None:
        lossless = [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    return {"draft": args.draft, "spec_tokens": engine.options.spec_tokens,
            "acceptance_rate": round(stats.acceptance_rate, 6),
            "mean_accepted_tokens": round(stats.mean_accepted_tokens, 6),
            "lossless": lossless}


def _device(name: str):  # noqa: ANN202 - torch.device
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise InvalidArgumentError(f"--device must be cpu or cuda, got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError("--device cuda, but torch sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"--device must be cpu or cuda, got {name!r}")
    return device


def _capped(options, source):  # noqa: ANN001, ANN202
    """Default max_model_len: the config's, at most 4096 (a CLI run needs no more)."""
    from dataclasses import replace

    config = getattr(source, "config", None)
    if config is None:
        from pathlib import Path

        from pagedkv.engine.loader import read_config

        config = read_config(Path(source))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    from pagedkv.modeling.layers import config_int

    limit = config_int(getattr(text, "max_position_embeddings", None) or 4096,
                       "max_position_embeddings")
    return replace(options, max_model_len=min(limit, 4096))


def _prompts(args: argparse.Namespace, vocab: int) -> list:
    if args.prompt:
        if args.prompts is not None:
            raise InvalidArgumentError("give --prompt TEXT or --prompts N, not both")
        return list(args.prompt)
    rng = random.Random(args.seed)
    shared = [rng.randrange(vocab) for _ in range(args.prompt_len // 2)]
    return [shared + [rng.randrange(vocab) for _ in range(args.prompt_len - len(shared))]
            for _ in range(args.prompts or 4)]


def _reference(path: str, device, dtype):  # noqa: ANN001, ANN202
    from pathlib import Path

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from pagedkv.engine.loader import read_config

    config = read_config(Path(path))  # aliased model_types too (loader.transformers_config)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its "Loading weights" bar is not our stderr's
    try:
        return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype).to(
            device).eval()
    except Exception as exc:  # noqa: BLE001 - transformers' own checks raise any class
        raise PagedKVError(f"transformers cannot load {path} for --verify: "
                           f"{type(exc).__name__}: {exc}") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
