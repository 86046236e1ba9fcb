"""Simulator: trace reading, exact hit rates on hand-built traces, speculative steps."""

from __future__ import annotations

import json

import pytest
from block_groups import deepseek_mtp_like, full_only, gpt_oss_like, kimi_dspark_like

from pagedkv.blocks import KVCacheManager
from pagedkv.errors import InvalidArgumentError, TraceError
from pagedkv.sim import SimOptions, SimRequest, make_workload, read_trace, simulate


def write_lines(tmp_path, lines):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_trace_reads_requests_and_defaults_arrival(tmp_path):
    path = write_lines(tmp_path, [
        json.dumps({"prompt_tokens": [1, 2, 3], "output_len": 4}),
        "",
        json.dumps({"prompt_tokens": [5], "output_len": 0, "arrival_step": 7}),
    ])
    reqs = read_trace(path)
    assert reqs == [SimRequest((1, 2, 3), 4, 0), SimRequest((5,), 0, 7)]


@pytest.mark.parametrize("bad, why", [
    ("{not json", "not JSON"),
    ('[1, 2]', "JSON object"),
    ('{"output_len": 3}', "prompt_tokens"),
    ('{"prompt_tokens": [1]}', "output_len"),
    ('{"prompt_tokens": [], "output_len": 3}', "empty"),
    ('{"prompt_tokens": [1, -2], "output_len": 3}', "negative"),
    ('{"prompt_tokens": [1, "a"], "output_len": 3}', "integers"),
    ('{"prompt_tokens": [1], "output_len": -1}', "output_len"),
    ('{"prompt_tokens": [1], "output_len": 2, "arrival_step": -3}', "arrival_step"),
    ('{"prompt_tokens": [1], "output_len": true}', "output_len"),
])
def test_bad_trace_lines_name_their_line(tmp_path, bad, why):
    good = json.dumps({"prompt_tokens": [1], "output_len": 1})
    path = write_lines(tmp_path, [good, good, bad])
    with pytest.raises(TraceError, match=rf"trace.jsonl:3: .*{why}"):
        read_trace(path)


def test_missing_and_empty_traces(tmp_path):
    with pytest.raises(TraceError):
        read_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="no request"):
        read_trace(write_lines(tmp_path, ["", "  "]))


# Two requests: A has 12 prompt tokens and 2 outputs, B repeats A's prompt plus 4 new
# tokens. Blocks of 4. B's lookup may use at most 15 tokens. 28 prompt tokens in all.
A = tuple(range(12))
B = A + (90, 91, 92, 93)


def run(groups, b_arrival, **opts):
    m = KVCacheManager(groups, checked=True, max_batched_tokens=64)
    reqs = [SimRequest(A, 2, 0), SimRequest(B, 1, b_arrival)]
    return simulate(m, reqs, SimOptions(**opts))


@pytest.mark.parametrize("groups, later, same_step", [
    # full: A's 3 prompt blocks are cached when scheduled -> 12 either way
    (full_only(), 12, 12),
    # window 8: a hit at 12 reads positions 5..11, blocks 1 and 2: cached -> 12
    (gpt_oss_like(window=8), 12, 12),
    # MTP (offset 1): block j is final once token 4j+4 is computed. Later: A computed 13
    # tokens -> 3 blocks -> 12 - 1 = 11. Same step: only 12 scheduled -> 2 blocks -> 7,
    # which ends inside block 1, written by that same step's forward: copying it before
    # the forward would copy nothing, so the hit stops at the block's start -> 4
    (deepseek_mtp_like(), 11, 4),
    # recurrent, checkpoint every 2 blocks (8 tokens): only the state at 8 exists; the
    # same step cannot restore a state saved by a forward that has not run yet -> 0
    (kimi_dspark_like(checkpoint_every=2), 8, 0),
])
def test_exact_hit_rates_on_a_hand_built_trace(groups, later, same_step):
    r_later = run(groups, 10)
    assert r_later.hit_tokens == later
    assert r_later.prefix_hit_rate == pytest.approx(later / 28)
    r_same = run(groups, 0)
    assert r_same.hit_tokens == same_step
    for r in (r_later, r_same):
        assert r.requests_finished == 2 and r.leaked_blocks == 0 and r.generated_tokens == 3


@pytest.mark.parametrize("acceptance, steps", [(1.0, 3), (0.0, 9)])
def test_speculative_steps_generate_accepted_drafts_plus_one(acceptance, steps):
    # one request, 5 prompt tokens, 9 outputs: the prefill step samples 1; then each
    # step yields accepted + 1: all 3 accepted -> 8 / 4 = 2 steps; none -> 8 steps
    m = KVCacheManager(full_only(), checked=True, max_batched_tokens=64)
    r = simulate(m, [SimRequest(tuple(range(5)), 9)],
                 SimOptions(spec_tokens=3, acceptance=acceptance))
    assert r.steps == steps and r.generated_tokens == 9 and r.leaked_blocks == 0


@pytest.mark.parametrize("accepted, steps", [((3, 0, 2), 4), ((3,), 6), ((9, 9), 3)])
def test_replayed_acceptance_decides_each_speculative_step(accepted, steps):
    # 5 prompt tokens, 9 outputs, k = 3, acceptance 0 past the replayed counts: the
    # prefill samples 1; (3, 0, 2) -> 4 + 1 + 3 = 8 more in 3 steps; (3,) -> 4, then 1
    # per step (4 steps); (9, 9) is clamped to k = 3 -> 4 + 4 in 2 steps
    m = KVCacheManager(full_only(), checked=True, max_batched_tokens=64)
    r = simulate(m, [SimRequest(tuple(range(5)), 9, accepted_drafts=accepted)],
                 SimOptions(spec_tokens=3, acceptance=0.0))
    assert r.steps == steps and r.generated_tokens == 9 and r.leaked_blocks == 0


def test_negative_replayed_acceptance_is_refused():
    with pytest.raises(InvalidArgumentError, match=r"accepted_drafts must be >= 0, got \[1, -1\]"):
        SimRequest((1, 2), 3, accepted_drafts=(1, -1))


def test_small_pool_preempts_and_still_finishes_everything():
    m = KVCacheManager(full_only(num_blocks=12), checked=True, max_batched_tokens=64)
    reqs = [SimRequest(tuple(range(i, i + 10)), 12) for i in range(0, 50, 10)]
    r = simulate(m, reqs, SimOptions(max_running=8))
    # 5 requests reach 21 computed tokens (6 blocks); 12 blocks hold 2 at once
    assert r.preemptions > 0
    assert r.requests_finished == 5 and r.leaked_blocks == 0
    assert r.generated_tokens == 60
    assert r.groups[0].peak_blocks <= 12


def test_too_large_requests_are_rejected_not_left_waiting():
    m = KVCacheManager(full_only(num_blocks=4), checked=True, max_batched_tokens=64)
    r = simulate(m, [SimRequest(tuple(range(20)), 1), SimRequest((1, 2), 1)])
    assert r.requests_rejected == 1 and r.requests_finished == 1
    assert "needs 6 blocks" in r.rejected_reasons[0]


@pytest.mark.parametrize("name", ["chat", "shared-prefix", "agentic", "long-context"])
def test_workloads_are_deterministic_fit_and_run_clean(name):
    a = make_workload(name, 12, seed=3, max_model_len=2048)
    assert a == make_workload(name, 12, seed=3, max_model_len=2048)
    assert len(a) == 12
    assert all(len(r.prompt_tokens) + r.output_len <= 2048 and r.prompt_tokens for r in a)
    m = KVCacheManager(gpt_oss_like(num_blocks=600, bs=16, window=128),
                       max_batched_tokens=512)
    r = simulate(m, a, SimOptions(max_running=16, spec_tokens=2, acceptance=0.5))
    assert r.requests_finished == 12 and r.leaked_blocks == 0
    assert r.generated_tokens == sum(x.output_len for x in a)



@pytest.mark.parametrize("name", ["chat", "shared-prefix", "agentic", "long-context"])
@pytest.mark.parametrize("max_model_len", [16, 40, 256, 700])
def test_workloads_fit_short_model_lengths_in_finite_time(name, max_model_len):
    """A model length shorter than every first turn of a session (agentic at 256: a
    system prompt of 32 and first contexts of 200-800) made no request, ever: the
    workload looped forever. Run in a thread so that a hang fails instead of hanging."""
    import threading

    got: list = []
    t = threading.Thread(target=lambda: got.append(
        make_workload(name, 30, seed=5, max_model_len=max_model_len)), daemon=True)
    t.start()
    t.join(timeout=20)
    assert got, f"{name} at max_model_len {max_model_len}: no workload after 20 s"
    (reqs,) = got
    assert len(reqs) == 30
    assert all(r.prompt_tokens and r.output_len >= 1
               and len(r.prompt_tokens) + r.output_len <= max_model_len for r in reqs)

def test_shared_prefix_workload_hits_all_but_the_first_prompt():
    reqs = make_workload("shared-prefix", 40, max_model_len=4096)
    m = KVCacheManager(full_only(num_blocks=4000, bs=16), max_batched_tokens=8192)
    r = simulate(m, reqs)
    # 1024 shared of 1280 prompt tokens; only the very first request misses
    assert r.prefix_hit_rate == pytest.approx(1024 * 39 / (1280 * 40))


def test_bad_options_and_workloads():
    with pytest.raises(InvalidArgumentError):
        SimOptions(acceptance=1.5)
    with pytest.raises(InvalidArgumentError):
        SimOptions(max_running=0)
    with pytest.raises(InvalidArgumentError):
        make_workload("nope", 3)
