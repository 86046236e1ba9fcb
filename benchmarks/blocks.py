#!/usr/bin/env python3
"""Block-manager micro-benchmarks (figures in docs/blocks.md).

1. Decode step cost per running request: R requests (R = 256 and 1,024) sharing a
   1,024-token prefix + 256 private tokens decode together; each step calls
   ``allocate(rid, 1)`` and ``commit(rid, 1, [tok])`` for every running request (the
   same work vLLM's ``allocate_slots`` + ``append_output_token_ids`` do), with prefix
   caching on, for one group (full) and three groups (full + sliding window + full with
   position offset 1, an MTP-like drafter). Half the steps call per request, half use
   ``allocate_batch`` / ``commit_batch`` (one call per step).
2. Admission of a request whose 1,024-token prefix is cached: ``find_cached_prefix`` +
   ``allocate`` (64 hit blocks of 16 tokens), and the lookup alone (the prompt's blocks
   are hashed by ``add_request``, as vLLM hashes them when it creates the Request).
3. Hashing throughput of each algorithm, tokens per second (block size 16 and 64).
4. The vLLM-shaped continuous-batching loop (``--only loop``): same workload as
   ../shared/peers/vllm_blocks_bench.py, timing each manager call (hash x elastic/fixed),
   preemptions and the once-per-step ``drain_page_ops`` + ``drain_copy_ops`` included;
   each run starts with an empty sha256 memo, as a fresh process would.
5. ``--only vllm``: that loop against vLLM 0.34.0's own manager (the peer harness, in its
   venv), interleaved rounds in one window; total manager time per request, hashing
   included, with pagedkv's default hash and with the fast single-tenant one; each both
   calling per request (as vLLM's scheduler calls its manager) and ``batched:`` (decode
   steps through ``allocate_batch`` / ``commit_batch``, as pagedkv's own scheduler does),
   the same decisions (``decisions_digests``: one value when every variant agrees).
6. ``--only checked``: a simulate run unchecked vs checked mode (incremental checks).
8. ``--only calls``: each kind of call of the loop timed apart, decode steps split into
   calls that cross a block boundary and calls that do not.
7. ``--only sim``: the issue's simulator runs, elastic pools against fixed pools.
9. ``--only reclaim``: fuzz/simulate.py seed 723762's run (minimax-m1, long-context, blocks
   of one token, 1 GiB, recurrent checkpoints every 4 blocks: elastic fit checks asking a
   full-attention pool of thousands of cached blocks what it could give back), as
   ``pagedkv simulate`` in a fresh process (start-up included); with ``--baseline-src``
   the same on that tree too, alternating, and the ratio of the medians. ``--quick``: 20
   of its 57 requests.

Usage: python benchmarks/blocks.py [--quick] [--json] [--only PART] [--baseline-src DIR]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

from pagedkv.blocks import KVCacheManager
from pagedkv.blocks.hashing import DEFAULT_HASH, FAST_HASH, HASH_ALGOS, hash_extender

try:
    from pagedkv.blocks.hashing import clear_memo
except ImportError:  # an older tree given to --baseline-src: its memo dicts by hand
    def clear_memo() -> None:
        from pagedkv.blocks import hashing

        for name in ("_SHA_MEMO", "_SHA_CHUNKS"):
            getattr(hashing, name, {}).clear()
from pagedkv.kvspec import AttentionKV, Full, LayerSpec, SlidingWindow
from pagedkv.kvspec.attention import Attention
from pagedkv.plan.types import Group

ns = time.perf_counter_ns


def _group(gid: int, retention, bs: int, num_blocks: int, offset: int = 0) -> Group:
    att = Attention(window=retention.window) if isinstance(retention, SlidingWindow) else Attention()
    layer = LayerSpec(f"l{gid}", AttentionKV(8, 128), retention, att, position_offset=offset)
    return Group(gid, (layer,), retention, bs, offset, ("target",), layer.bytes_per_token, 0,
                 num_blocks, 0, 0)


def groups_for(kind: str, num_blocks: int, bs: int = 16) -> list[Group]:
    if kind == "one":
        return [_group(0, Full(), bs, num_blocks)]
    return [_group(0, Full(), bs, num_blocks), _group(1, SlidingWindow(128), bs, num_blocks),
            _group(2, Full(), bs, num_blocks, offset=1)]


def bench_decode(running: int, kind: str, steps: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    prefix = [rng.randrange(128000) for _ in range(1024)]
    per_req = (1024 + 256 + steps + 16) // 16 + 2
    mgr = KVCacheManager(groups_for(kind, running * per_req + 64), max_batched_tokens=8192,
                         checked=False)
    for r in range(running):
        prompt = prefix + [rng.randrange(128000) for _ in range(256)]
        mgr.add_request(r, prompt)
        hit = mgr.find_cached_prefix(r)
        if not mgr.allocate(r, len(prompt) - hit):
            raise SystemExit("pool too small")
        mgr.commit(r, len(prompt) - hit, [rng.randrange(128000)])
    toks = [rng.randrange(128000) for _ in range(4096)]
    allocate, commit = mgr.allocate, mgr.commit
    ids = list(range(running))
    half = steps // 2
    gc.collect()
    gc.freeze()
    t0 = ns()
    for s in range(half):  # one call per request, as vLLM's scheduler calls its manager
        tok = [toks[s & 4095]]
        for r in ids:
            if not allocate(r, 1):
                raise SystemExit("out of blocks")
        for r in ids:
            commit(r, 1, tok)
    t1 = ns()
    for s in range(half, 2 * half):  # one call per step for the whole batch
        if mgr.allocate_batch(ids) != running:
            raise SystemExit("out of blocks")
        mgr.commit_batch(ids, [toks[s & 4095]] * running)
    t2 = ns()
    gc.unfreeze()
    if mgr.num_computed(0) != 1280 + 2 * half:
        raise SystemExit("benchmark bookkeeping is off")
    return {"running": running, "groups": kind, "steps": 2 * half,
            "us_per_request_step": round((t1 - t0) / 1e3 / (half * running), 3),
            "us_per_request_step_batched": round((t2 - t1) / 1e3 / (half * running), 3)}


def bench_admission(repeats: int = 200) -> dict:
    rng = random.Random(1)
    prefix = [rng.randrange(128000) for _ in range(1024)]
    mgr = KVCacheManager(groups_for("one", 20000), max_batched_tokens=8192, checked=False)
    mgr.add_request("warm", prefix + [1])
    mgr.find_cached_prefix("warm")
    mgr.allocate("warm", 1025)
    mgr.commit("warm", 1025, [2])
    lookup = admit = 0
    for i in range(repeats):
        prompt = prefix + [rng.randrange(128000) for _ in range(16)]
        mgr.add_request(i, prompt)  # hashes nothing yet: the lookup hashes the prompt
        t0 = ns()
        hit = mgr.find_cached_prefix(i)
        t1 = ns()
        mgr.allocate(i, len(prompt) - hit)
        t2 = ns()
        if hit != 1024:
            raise SystemExit(f"expected a 1024-token hit, got {hit}")
        lookup += t1 - t0
        admit += t2 - t0
        mgr.free(i)
    return {"prefix_tokens": 1024, "hit_blocks": 64,
            "find_cached_prefix_us": round(lookup / repeats / 1e3, 2),
            "find_cached_prefix_plus_allocate_us": round(admit / repeats / 1e3, 2)}


def bench_hash(num_tokens: int = 1 << 20) -> list[dict]:
    rng = random.Random(2)
    toks = [rng.randrange(128000) for _ in range(num_tokens)]
    out = []
    for algo in HASH_ALGOS:
        try:
            extend = hash_extender(algo)
        except Exception as exc:  # noqa: BLE001 - optional algorithm unavailable
            out.append({"algo": algo, "error": str(exc)})
            continue
        for bs in (16, 64):
            best = 0.0
            for _ in range(3):
                hashes: list = []
                t0 = time.perf_counter()
                extend(toks, 0, num_tokens // bs, bs, 0, hashes)
                best = max(best, num_tokens / (time.perf_counter() - t0))
            out.append({"algo": algo, "block_size": bs, "mtokens_per_s": round(best / 1e6, 1)})
    return out


def bench_loop(requests: int = 2000, max_running: int = 256, num_blocks: int = 20000,
               token_budget: int = 8192, prefix: int = 1024, suffix: int = 256,
               decode: int = 128, bs: int = 16, seed: int = 0, hash_algo: str = DEFAULT_HASH,
               elastic: bool = True, batched: bool = False) -> dict:
    """The peer script's loop, call for call, with pagedkv's manager (elastic: one budget
    of ``num_blocks`` blocks' bytes, mapped in 2 MiB pages as blocks fill). One call each
    way per request per step, as the peer calls vLLM's manager; a preemption is timed as
    the peer times vLLM's ``free`` there; and once per step the ``drain_page_ops`` +
    ``drain_copy_ops`` an engine makes to launch the step (``step_ops``: no vLLM
    counterpart, counted in pagedkv's total). ``batched``: the decode requests of a step
    take their slots with one ``allocate_batch`` call (resumed after each preemption) and
    commit with one ``commit_batch`` call, as pagedkv's scheduler drives its manager; the
    same decisions (``decisions_digest``: each step's scheduled requests and preemptions)."""
    rng = random.Random(seed)
    system = [rng.randrange(128000) for _ in range(prefix)]
    suffixes = [[rng.randrange(128000) for _ in range(suffix)] for _ in range(requests)]
    out_tokens = [rng.randrange(128000) for _ in range(4096)]
    groups = groups_for("one", num_blocks, bs)
    extra: dict = {}
    if elastic:
        extra = {"budget_bytes": num_blocks * groups[0].page_bytes,
                 "max_model_len": prefix + suffix + decode + 64}
    mgr = KVCacheManager(groups, max_batched_tokens=token_budget, checked=False,
                         hash_algo=hash_algo, **extra)
    clear_memo()  # as a fresh process: an earlier round's prompts must not be memoised
    t = {"lookup": [0, 0], "alloc_prefill": [0, 0], "alloc_decode": [0, 0], "commit": [0, 0],
         "free": [0, 0], "add_request": [0, 0], "step_ops": [0, 0]}

    def add(key: str, dt: int) -> None:
        t[key][0] += 1
        t[key][1] += dt

    waiting: list[int] = []
    running: list[int] = []
    outputs = [0] * requests
    nxt = finished = steps = hit_total = prompt_total = preemptions = 0
    digest: list[int] = []  # each step's scheduled requests, preemptions as -2 - id
    allocate_batch = getattr(mgr, "allocate_batch", None)
    commit_batch = getattr(mgr, "commit_batch", None)
    gc.collect()
    gc.freeze()
    t_start = time.perf_counter()
    while finished < requests:
        steps += 1
        budget = token_budget
        scheduled: list[tuple[int, int]] = []
        i = 0
        if batched:
            while i < len(running):
                a = ns()
                k = allocate_batch(running[i:] if i else running)
                add("alloc_decode", ns() - a)
                i += k
                if i < len(running):  # running[i] does not fit: preempt the newest, retry
                    victim = running.pop()
                    a = ns()
                    mgr.preempt(victim)
                    add("free", ns() - a)
                    waiting.insert(0, victim)
                    preemptions += 1
                    digest.append(-2 - victim)
            scheduled = [(r, 1) for r in running]
            budget -= len(running)
        while not batched and i < len(running):
            r = running[i]
            a = ns()
            ok = mgr.allocate(r, 1)
            add("alloc_decode", ns() - a)
            if not ok:
                victim = running.pop()
                a = ns()
                mgr.preempt(victim)  # vLLM's harness times its free() here
                add("free", ns() - a)
                waiting.insert(0, victim)
                preemptions += 1
                digest.append(-2 - victim)
                continue
            scheduled.append((r, 1))
            budget -= 1
            i += 1
        n_decode = len(scheduled)
        while len(waiting) < max_running and nxt < requests:
            prompt = system + suffixes[nxt]  # built outside the timer, as the peer script does
            a = ns()
            mgr.add_request(nxt, prompt)
            add("add_request", ns() - a)
            waiting.append(nxt)
            nxt += 1
        admitted = 0
        while waiting and len(running) + admitted < max_running:
            r = waiting[0]
            a = ns()
            hit = mgr.find_cached_prefix(r)
            add("lookup", ns() - a)
            n_new = mgr.num_tokens(r) - hit
            if n_new > budget:
                break
            a = ns()
            ok = mgr.allocate(r, n_new)
            add("alloc_prefill", ns() - a)
            if not ok:
                break
            waiting.pop(0)
            if outputs[r] == 0:
                prompt_total += prefix + suffix
                hit_total += hit
            scheduled.append((r, n_new))
            budget -= n_new
            admitted += 1
            running.append(r)
        # launch the step, as an engine must: page maps/unmaps, then the copy ops (vLLM's
        # manager has neither; this is work pagedkv's side adds, so it is timed)
        a = ns()
        mgr.drain_page_ops()
        mgr.drain_copy_ops()
        add("step_ops", ns() - a)
        digest.extend(r for r, _ in scheduled)
        digest.append(-1)  # end of step
        first = 0
        if batched and n_decode:
            ids = [r for r, _ in scheduled[:n_decode]]
            toks = [out_tokens[mgr.num_tokens(r) & 4095] for r in ids]  # the "sampler"
            a = ns()
            commit_batch(ids, toks)
            add("commit", ns() - a)
            for r in ids:
                outputs[r] += 1
            first = n_decode
        for r, n in scheduled[first:]:
            tok = [out_tokens[(mgr.num_tokens(r)) & 4095]]  # the "sampler", outside the timer
            a = ns()
            mgr.commit(r, n, tok)
            add("commit", ns() - a)
            outputs[r] += 1
        still = []
        for r in running:
            if outputs[r] >= decode:
                a = ns()
                mgr.free(r)
                add("free", ns() - a)
                finished += 1
            else:
                still.append(r)
        running = still
    wall = time.perf_counter() - t_start
    gc.unfreeze()
    total_ns = sum(v[1] for v in t.values())
    return {
        "requests": requests, "steps": steps, "wall_s": round(wall, 3), "hash": hash_algo,
        "elastic": elastic, "batched": batched,
        "decisions_digest": hashlib.sha256(repr(digest).encode()).hexdigest()[:16],
        # every manager call, hashing included (add_request hashes the prompt, commit the
        # generated blocks), per finished request
        "total_us_per_request": round(total_ns / 1e3 / requests, 2),
        "calls_us": {k: {"calls": c, "mean_us": round(s / c / 1e3, 3) if c else None}
                     for k, (c, s) in t.items()},
        "decode_us_per_request_step": round((t["alloc_decode"][1] + t["commit"][1]
                                             * t["alloc_decode"][0] / max(1, t["commit"][0]))
                                            / max(1, t["alloc_decode"][0]) / 1e3, 3),
        "cache_hit_rate_tokens": round(hit_total / max(1, prompt_total), 4),
        "preemptions": preemptions,
    }


def bench_calls(hash_algo: str = DEFAULT_HASH, running: int = 256, steps: int = 128,
                seed: int = 0) -> dict:
    """Each call of the loop timed by kind (elastic pool, one group, blocks of 16): 256
    requests of a shared 1,024-token prefix + 256 tokens are added, looked up, admitted,
    then decode ``steps`` tokens, one ``allocate`` and one ``commit`` each per step; a call
    that crosses a block boundary (a new block; hashing and caching a full one) is timed
    apart from one that does not. Mean microseconds per call."""
    rng = random.Random(seed)
    prefix = [rng.randrange(128000) for _ in range(1024)]
    groups = groups_for("one", 20000, 16)
    mgr = KVCacheManager(groups, max_batched_tokens=8192, checked=False, hash_algo=hash_algo,
                         budget_bytes=20000 * groups[0].page_bytes, max_model_len=1424 + 64)
    prompts = [prefix + [rng.randrange(128000) for _ in range(256)] for _ in range(running)]
    clear_memo()
    t = {k: [0, 0] for k in ("add_request", "lookup", "alloc_prefill", "alloc_decode",
                             "alloc_boundary", "commit_decode", "commit_boundary", "free")}
    reqs = mgr.requests
    gc.collect()
    gc.freeze()
    for r in range(running):
        a = ns()
        mgr.add_request(r, prompts[r])
        b = ns()
        hit = mgr.find_cached_prefix(r)
        c = ns()
        mgr.allocate(r, 1280 - hit)
        d = ns()
        mgr.commit(r, 1280 - hit, [5])
        if r:  # the first request hashes and caches the prefix: not the common case
            for k, dt in (("add_request", b - a), ("lookup", c - b), ("alloc_prefill", d - c)):
                t[k][0] += 1
                t[k][1] += dt
    for _ in range(steps):
        for r in range(running):
            req = reqs[r]
            k = "alloc_boundary" if req.num_computed + 1 > req.fast_limit else "alloc_decode"
            a = ns()
            mgr.allocate(r, 1)
            t[k][1] += ns() - a
            t[k][0] += 1
        for r in range(running):
            req = reqs[r]
            c = req.num_computed + 1
            k = ("commit_boundary" if c >= req.next_event or req.last_block_start >= c
                 else "commit_decode")
            a = ns()
            mgr.commit(r, 1, [7])
            t[k][1] += ns() - a
            t[k][0] += 1
    for r in range(running):
        a = ns()
        mgr.free(r)
        t["free"][1] += ns() - a
        t["free"][0] += 1
    gc.unfreeze()
    return {"hash": hash_algo, "running": running,
            "mean_us": {k: round(v / n / 1e3, 3) for k, (n, v) in t.items() if n},
            "calls": {k: n for k, (n, _) in t.items()}}


PEER = "/work/shared/peers/vllm_blocks_bench.py"


def vllm_total_us_per_request(python: str, requests: int) -> dict:
    """One run of the peer harness (vLLM 0.34.0's KVCacheManager, its default sha256 block
    hash): every manager call plus the Request hashing of prompts and of appended tokens
    (vLLM hashes there what pagedkv hashes in add_request / commit), per request."""
    out = subprocess.run([python, PEER, "--requests", str(requests), "--json"], check=True,
                         capture_output=True, text=True).stdout
    res = json.loads(out[out.index("{"):])
    total_s = (res["manager_time_s"] + res["request_init_with_prompt_hashing"]["total_s"]
               + res["append_output_token_ids_with_hashing"]["total_s"])
    return {"total_us_per_request": round(total_s * 1e6 / res["requests_finished"], 2),
            "manager_calls_us_per_request": round(res["manager_time_s"] * 1e6
                                                  / res["requests_finished"], 2),
            "cache_hit_rate_tokens": res["cache_hit_rate_tokens"],
            "preemptions": res["preemptions"]}


# pagedkv's loop variants against vLLM: per-request calls (as vLLM's scheduler calls its
# manager), then batched decode calls (as pagedkv's scheduler calls its own)
VARIANTS = ((DEFAULT_HASH, False), (FAST_HASH, False), (DEFAULT_HASH, True), (FAST_HASH, True))


def _variant(algo: str, batched: bool) -> str:
    return ("batched:" if batched else "") + algo


def _loops_in(src: str, requests: int) -> dict[str, dict]:
    """This file's ``bench_loop`` (both hashes) in a fresh process importing pagedkv from
    ``src`` (another tree's ``src/``, e.g. the code before a change)."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import blocks as B; "
            "print(json.dumps([B.bench_loop(int(sys.argv[2]), hash_algo=a, batched=b) "
            f"for a, b in {VARIANTS!r}]))")
    env = dict(os.environ, PYTHONPATH=src)
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)),
                          str(requests)], check=True, capture_output=True, text=True,
                         env=env).stdout
    return {_variant(a, b): r for (a, b), r in zip(VARIANTS, json.loads(out))}


def bench_vs_vllm(python: str, rounds: int, requests: int, baseline_src: str | None = None
                  ) -> dict:
    """Interleaved rounds in one window: vLLM, pagedkv with the default hash, pagedkv with
    the fast single-tenant hash; ratios of the medians of total time per request. With
    ``baseline_src`` (another tree's ``src/``), each round also runs the loop on that code,
    both trees then in fresh processes, their order alternating between rounds."""
    trees = {"": None} if baseline_src is None else {"": _src_dir(), "baseline:": baseline_src}
    runs: dict[str, list[dict]] = {"vllm_sha256": []}
    for t in trees:
        for a, b in VARIANTS:
            runs[t + _variant(a, b)] = []
    loads = [os.getloadavg()[0]]
    for i in range(rounds):
        runs["vllm_sha256"].append(vllm_total_us_per_request(python, requests))
        order = list(trees) if i % 2 == 0 else list(trees)[::-1]
        for t in order:
            if trees[t] is None:  # this process: no baseline asked for
                got = {_variant(a, b): bench_loop(requests, hash_algo=a, batched=b)
                       for a, b in VARIANTS}
            else:
                got = _loops_in(trees[t], requests)
            for algo, r in got.items():
                runs[t + algo].append(r)
        loads.append(os.getloadavg()[0])
    med = {k: statistics.median(r["total_us_per_request"] for r in v) for k, v in runs.items()}
    vllm = [r["total_us_per_request"] for r in runs["vllm_sha256"]]
    return {
        "rounds": rounds, "requests": requests, "baseline_src": baseline_src,
        "load_avg_1min": [round(x, 2) for x in loads], "cpus": os.cpu_count(),
        "median_total_us_per_request": med,
        "ratio_default_hash_vs_vllm": round(med[DEFAULT_HASH] / med["vllm_sha256"], 4),
        "ratio_fast_hash_vs_vllm": round(med[FAST_HASH] / med["vllm_sha256"], 4),
        "ratio_default_hash_batched_vs_vllm": round(med["batched:" + DEFAULT_HASH]
                                                    / med["vllm_sha256"], 4),
        "ratio_fast_hash_batched_vs_vllm": round(med["batched:" + FAST_HASH]
                                                 / med["vllm_sha256"], 4),
        "decisions_digests": sorted({r["decisions_digest"] for k, v in runs.items()
                                     if k != "vllm_sha256" for r in v}),
        "ratios_of_medians": {k: round(m / med["vllm_sha256"], 4) for k, m in med.items()
                              if k != "vllm_sha256"},
        "per_round_ratios": {k: [round(r["total_us_per_request"] / v, 3)
                                 for r, v in zip(rs, vllm)]
                             for k, rs in runs.items() if k != "vllm_sha256"},
        "hit_rates": {k: [r["cache_hit_rate_tokens"] for r in v] for k, v in runs.items()},
        "runs": runs,
    }


def _src_dir() -> str:
    """The ``src/`` this process imports pagedkv from."""
    import pagedkv

    return os.path.dirname(os.path.dirname(os.path.abspath(pagedkv.__file__)))


def bench_checked(requests: int = 100) -> dict:
    """pagedkv simulate's gemma-3-27b chat run (40 GiB), unchecked vs checked mode."""
    from pagedkv.models import load_model
    from pagedkv.plan import PlanOptions, make_plan
    from pagedkv.sim import SimOptions, make_workload, simulate

    spec = load_model("gemma-3-27b")
    plan = make_plan(spec.layers, PlanOptions(40 << 30, spec.max_position_embeddings))
    reqs = make_workload("chat", requests, 1, plan.options.max_model_len)
    out = {}
    for checked in (False, True, False, True):
        m = KVCacheManager.from_plan(plan, checked=checked)
        t0 = time.perf_counter()
        simulate(m, reqs, SimOptions(seed=1))
        out.setdefault("checked" if checked else "unchecked", []).append(
            round(time.perf_counter() - t0, 3))
    out["ratio_checked_vs_unchecked"] = round(min(out["checked"]) / min(out["unchecked"]), 2)
    return out


def bench_sim() -> list[dict]:
    """The issue's simulator runs: elastic pools (default) against fixed pools."""
    from pagedkv.models import load_model
    from pagedkv.plan import PlanOptions, make_plan
    from pagedkv.sim import SimOptions, make_workload, simulate

    cases = [("kimi-k3", "kimi-k3-dspark", 120 << 30, "chat", 200,
              SimOptions(spec_tokens=7, acceptance=0.6, seed=1), None),
             ("kimi-k3", "kimi-k3-dspark", 120 << 30, "chat", 200,
              SimOptions(spec_tokens=7, acceptance=0.6, seed=1), 4096),
             ("gemma-3-27b", None, 40 << 30, "chat", 200, SimOptions(seed=1), None),
             ("kimi-k3", "kimi-k3-dspark", 120 << 30, "long-context", 40, SimOptions(seed=1),
              None)]
    out = []
    for model, draft, budget, workload, n, opts, typical in cases:
        spec = load_model(model, draft)
        plan = make_plan(spec.layers, PlanOptions(budget, spec.max_position_embeddings,
                                                  typical_len=typical))
        reqs = make_workload(workload, n, opts.seed, plan.options.max_model_len)
        for elastic in ((False,) if typical else (False, True)):
            r = simulate(KVCacheManager.from_plan(plan, elastic=elastic), reqs, opts)
            out.append({"model": model, "draft": draft, "budget_gib": budget >> 30,
                        "workload": workload, "requests": n, "typical_len": typical,
                        "pools": "elastic" if elastic else "fixed", "steps": r.steps,
                        "prefix_hit_rate": round(r.prefix_hit_rate, 4),
                        "preemptions": r.preemptions, "finished": r.requests_finished})
    return out


# fuzz/simulate.py seed 723762 without --checked (the fuzzer's --checked changes no answer)
RECLAIM_ARGS = ("simulate", "minimax-m1", "--json", "--seed", "723762", "--workload",
                "long-context", "--max-model-len", "4096", "--block-size", "1", "--memory",
                "1GiB", "--checkpoint-every=4", "--hash", "sha256")


def _simulate_in(src: str, requests: int) -> tuple[float, str]:
    """Wall seconds and stdout of ``pagedkv simulate`` (RECLAIM_ARGS) in a fresh process
    importing pagedkv from ``src``."""
    env = dict(os.environ, PYTHONPATH=src)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pagedkv", *RECLAIM_ARGS, "--requests",
                          str(requests)], check=True, capture_output=True, text=True,
                         env=env).stdout
    return time.perf_counter() - t0, out


def bench_reclaim(requests: int = 57, baseline_src: str | None = None, rounds: int = 1) -> dict:
    """The seed's run on this tree and, with ``baseline_src``, on that one (the order
    alternating between rounds); the two must print the same result."""
    trees = {"current": _src_dir()}
    if baseline_src is not None:
        trees["baseline"] = baseline_src
    walls: dict[str, list[float]] = {t: [] for t in trees}
    outputs = set()
    for i in range(rounds):
        for t in (list(trees) if i % 2 == 0 else list(trees)[::-1]):
            wall, out = _simulate_in(trees[t], requests)
            walls[t].append(round(wall, 2))
            outputs.add(out)
    res: dict = {"command": "pagedkv " + " ".join(RECLAIM_ARGS) + f" --requests {requests}",
                 "baseline_src": baseline_src, "wall_s": walls,
                 "same_output": len(outputs) == 1, "load_avg_1min": round(os.getloadavg()[0], 2)}
    if baseline_src is not None:
        res["ratio_baseline_vs_current"] = round(statistics.median(walls["baseline"])
                                                 / statistics.median(walls["current"]), 2)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", choices=("decode", "admission", "hash", "loop", "calls", "vllm",
                                       "checked", "sim", "reclaim"))
    ap.add_argument("--vllm-python", default="/tmp/vllm-peer/bin/python",
                    help="the peer venv's python (../shared/peers/setup_vllm_peer.sh)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds against vLLM "
                    "(or the baseline tree: --only reclaim)")
    ap.add_argument("--baseline-src", help="--only vllm / reclaim: also run each round's loop "
                    "(simulation) on the pagedkv of this src/ directory (e.g. `git archive` of "
                    "an older commit)")
    args = ap.parse_args(argv)
    steps = 32 if args.quick else 256
    res: dict = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
                 "python": platform.python_version(),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.only in (None, "decode"):
        res["decode"] = [bench_decode(r, k, steps) for r in (256, 1024) for k in ("one", "three")]
    if args.only in (None, "admission"):
        res["admission"] = bench_admission(50 if args.quick else 500)
    if args.only in (None, "hash"):
        res["hash"] = bench_hash(1 << 16 if args.quick else 1 << 20)
    if args.only in (None, "loop"):
        res["loop"] = [bench_loop(200 if args.quick else 2000, hash_algo=a, elastic=e,
                                  batched=b)
                       for a in (DEFAULT_HASH, FAST_HASH) for e in (True, False)
                       for b in (False, True)]
    if args.only in (None, "calls"):
        res["calls"] = [bench_calls(a, steps=32 if args.quick else 128)
                        for a in (DEFAULT_HASH, FAST_HASH)]
    if args.only in (None, "checked"):
        res["checked"] = bench_checked(20 if args.quick else 100)
    if args.only in (None, "sim"):
        res["sim"] = bench_sim()
    if args.only in (None, "reclaim"):
        res["reclaim"] = bench_reclaim(20 if args.quick else 57, args.baseline_src,
                                       args.rounds if args.baseline_src else 1)
    if args.only == "vllm":  # needs the peer venv: never part of the default run
        res["vs_vllm"] = bench_vs_vllm(args.vllm_python, args.rounds,
                                       200 if args.quick else 2000, args.baseline_src)
    res["load_avg_1min_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(res, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
