"""The seed loop every fuzzer in this folder shares.

A fuzzer gives three functions: ``draw(seed, args)`` builds the case from
``random.Random(seed)`` alone (same seed and flags, same case: a seed is a reproducer),
``describe(case)`` says it in one line, and ``check(case, args)`` runs it. ``check``
returns normally when the case ran and passed (optionally an iterable of tag names, counted
and shown in the progress lines), raises :class:`Refused` when the target turned the case
down as documented (a budget too small, an unsupported combination), and raises
:class:`Bad` when a check failed; any other exception is BAD too, with its traceback. A
case running past ``--limit`` seconds is stopped by ``signal.alarm`` and reported SLOW
(the loop goes on): a hang is a finding, not a stuck fuzzer. The alarm can interrupt
anything, a module import half done included, so a BAD after a SLOW in the same process
says so: rerun that seed alone before believing it.

Every BAD or SLOW line carries the seed, the case and the command that reruns that seed
alone. Exit status: 1 when anything was BAD or SLOW, else 0.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import os
import shlex
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any


class Refused(Exception):
    """The target refused the case up front, the documented way (not a failure)."""


class Bad(Exception):
    """A check failed; the message says which and with what values."""


class Slow(BaseException):
    """The case ran past its wall-clock limit. A BaseException, so that a target's own
    ``except Exception`` cannot swallow it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise Slow()


def parser(doc: str | None, *, limit: int) -> argparse.ArgumentParser:
    """The loop's flags; a fuzzer adds its own to the parser it gets back."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--start", type=int, default=0, help="first seed (default 0)")
    p.add_argument("--count", type=int, default=100, help="number of seeds (default 100)")
    p.add_argument("--limit", type=int, default=limit,
                   help=f"seconds a case may run before it is SLOW (default {limit}; 0: no limit)")
    p.add_argument("--every", type=int, default=20,
                   help="a progress line every this many seeds (default 20)")
    p.add_argument("--stop", action="store_true", help="stop at the first BAD or SLOW case")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop after this many minutes (the summary is still printed)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="one line per case, refusals with their reason")
    return p


# the loop's own flags, left out of a reproducing command (each takes a value but --stop)
_LOOP_FLAGS = {"--start": 1, "--count": 1, "--every": 1, "--max-minutes": 1, "--stop": 0}


def reproduce(seed: int) -> str:
    """The command that reruns ``seed`` alone, with this run's other flags."""
    rest, argv = [], sys.argv[1:]
    i = 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        if name in _LOOP_FLAGS:
            i += 1 + (_LOOP_FLAGS[name] if "=" not in argv[i] else 0)
            continue
        rest.append(argv[i])
        i += 1
    env = [f"{k}={os.environ[k]}" for k in ("PYTHONPATH", "TRITON_INTERPRET") if k in os.environ]
    cmd = ["python", os.path.relpath(sys.argv[0]), "--start", str(seed), "--count", "1", *rest]
    return " ".join(env + [shlex.join(cmd)])


def _indent(text: str, limit: int = 2000) -> str:
    text = text.strip()
    if len(text) > limit:
        text = "..." + text[-limit:]
    return "\n".join("    " + line for line in text.splitlines())


def run(args: argparse.Namespace, draw: Callable[[int, argparse.Namespace], Any],
        describe: Callable[[Any], str],
        check: Callable[[Any, argparse.Namespace], Iterable[str] | None]) -> int:
    """Seeds ``args.start`` .. ``args.start + args.count - 1``; returns the exit status."""
    # the first line says where pagedkv comes from (without PYTHONPATH, an editable install
    # elsewhere is found)
    import pagedkv

    print(f"{os.path.relpath(sys.argv[0])}: seeds {args.start}..{args.start + args.count - 1},"
          f" pagedkv from {os.path.dirname(pagedkv.__file__)}", flush=True)
    signal.signal(signal.SIGALRM, _on_alarm)
    counts: collections.Counter[str] = collections.Counter(ran=0, refused=0, bad=0, slow=0)
    t0 = time.monotonic()
    done, stopped = 0, ""

    def line(label: str) -> str:
        minutes = (time.monotonic() - t0) / 60
        rate = f"{done / minutes:.1f}" if minutes > 0 else "-"
        tags = " ".join(f"{k}={v}" for k, v in counts.items())
        return f"{label} {tags} seeds={done} in {minutes * 60:.0f} s ({rate} seeds/min)"

    for seed in range(args.start, args.start + args.count):
        if args.max_minutes is not None and time.monotonic() - t0 > args.max_minutes * 60:
            stopped = f" (stopped at --max-minutes before seed {seed})"
            break
        if done and done % args.every == 0:
            print(line(f"progress seed={seed}"), flush=True)
        case = None
        outcome, message = "ran", ""
        started = time.monotonic()
        try:
            case = draw(seed, args)
            signal.alarm(args.limit)
            try:
                tags = check(case, args)
            finally:
                signal.alarm(0)
            for tag in tags or ():
                counts[tag] += 1
        except Refused as e:
            outcome, message = "refused", str(e)
        except Bad as e:
            outcome, message = "bad", str(e)
        except Slow:
            # where it was when the alarm rang: the loop a hang is stuck in
            outcome = "slow"
            message = f"still running after {args.limit} s, at:\n{traceback.format_exc()}"
        except KeyboardInterrupt:
            stopped = f" (interrupted at seed {seed})"
            break
        except Exception:
            outcome, message = "bad", traceback.format_exc()
        counts[outcome] += 1
        done += 1
        what = describe(case) if case is not None else "(draw failed)"
        if outcome in ("bad", "slow"):
            # the alarm may have interrupted anything, an import half done included: what
            # fails after it in this process is suspect until rerun alone
            suspect = ("\n    (after a SLOW case in this process: rerun alone to confirm)"
                       if outcome == "bad" and counts["slow"] else "")
            print(f"{outcome.upper()} seed={seed} {what}\n{_indent(message)}\n"
                  f"    reproduce: {reproduce(seed)}{suspect}", flush=True)
            if args.stop:
                stopped = f" (stopped at the first {outcome.upper()})"
                break
        elif args.verbose:
            reason = f" -- {message.strip().splitlines()[-1]}" if message.strip() else ""
            print(f"{outcome} seed={seed} {time.monotonic() - started:.2f}s {what}{reason}",
                  flush=True)
    end = args.start + args.count - 1
    print(line(f"done seeds {args.start}..{end}{stopped}:"), flush=True)
    return 1 if counts["bad"] or counts["slow"] else 0


def main(doc: str | None, add_flags: Callable[[argparse.ArgumentParser], None] | None,
         draw: Callable[[int, argparse.Namespace], Any], describe: Callable[[Any], str],
         check: Callable[[Any, argparse.Namespace], Iterable[str] | None], *,
         limit: int, setup: Callable[[argparse.Namespace], None] | None = None) -> None:
    """Parse the flags (the loop's and ``add_flags``'), call ``setup(args)`` once, run the
    loop, exit with its status."""
    p = parser(doc, limit=limit)
    if add_flags is not None:
        add_flags(p)
    args = p.parse_args()
    if setup is not None:
        setup(args)
    sys.exit(run(args, draw, describe, check))


def rel_tag(worst: float) -> str:
    """A progress-line tag for a passing case's worst relative error (the kernel fuzzers'
    bars stop at 1e-2)."""
    return next((f"rel<{t}" for t in ("1e-3", "3e-3") if worst < float(t)), "rel<1e-2")


def require_cuda(args: argparse.Namespace) -> None:
    """``setup`` of the GPU-only fuzzers: one line and exit 2 where there is no CUDA GPU;
    Triton's per-launch warnings off."""
    import warnings

    import torch

    if not torch.cuda.is_available():
        print(f"{os.path.relpath(sys.argv[0])}: needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    warnings.filterwarnings("ignore")


# pagedkv's errors that only a broken invariant raises (a block-manager check in checked
# mode, inconsistent per-step metadata caught by the ops): from a valid command or API
# call they are a bug even when the CLI prints them as its one error line, or the engine
# files them as one request's error. pagedkv catches them only to re-raise.
INVARIANT_ERRORS = ("CacheCorruptedError", "MetadataError")


def is_invariant_error(exc: BaseException | None) -> bool:
    return type(exc).__name__ in INVARIANT_ERRORS


@contextlib.contextmanager
def invariant_errors() -> Iterator[list[str]]:
    """The INVARIANT_ERRORS created inside the block, as "Name: message" (the CLI turns
    them into its error line, which hides their class)."""
    from pagedkv import errors

    seen: list[str] = []
    patched = []
    for name in INVARIANT_ERRORS:
        cls = getattr(errors, name)
        own = cls.__dict__.get("__init__")
        base = cls.__init__

        def init(self: BaseException, *a: Any, _base: Any = base, **k: Any) -> None:
            seen.append(f"{type(self).__name__}: {a[0] if a else ''}")
            _base(self, *a, **k)

        cls.__init__ = init
        patched.append((cls, own))
    try:
        yield seen
    finally:
        for cls, own in patched:
            if own is None:
                del cls.__init__
            else:
                cls.__init__ = own


# the two command-line fuzzers (generate.py, simulate.py)

def run_cli(argv: list[str]) -> tuple[object, str, str]:
    """(exit status, stdout, stderr) of ``pagedkv ARGV`` run in this process; an invariant
    error raised inside is BAD whatever the exit status."""
    from pagedkv.cli import main

    out, err = io.StringIO(), io.StringIO()
    with (invariant_errors() as broken, contextlib.redirect_stdout(out),
          contextlib.redirect_stderr(err)):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
        except Exception:  # a traceback out of main: BAD, with what it printed before
            rc = "exception"
            err.write(traceback.format_exc())
    if broken:
        raise Bad(f"exit status {rc!r} after an invariant error: {broken[0]}\n"
                  f"stderr: {err.getvalue()[-1500:]}")
    return rc, out.getvalue(), err.getvalue()


def check_exit(rc: object, out: str, err: str) -> None:
    """Exit 2 is a refusal: exactly one error line besides warnings; 0 passes on; any other
    status is BAD."""
    if rc == 2:
        lines = [ln for ln in err.strip().splitlines() if not ln.startswith("pagedkv: warning:")]
        if len(lines) == 1 and lines[0].startswith("pagedkv: error:"):
            raise Refused(lines[0])
        raise Bad(f"exit 2 without exactly one error line:\n{err}")
    if rc != 0:
        raise Bad(f"exit status {rc!r}\nstderr: {err}\nstdout: {out[:500]}")
