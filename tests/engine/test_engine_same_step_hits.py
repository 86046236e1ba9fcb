"""Prefix hits on blocks cached in the same step, before the forward that writes them,
on a plain engine: requests with identical prompts arriving together used to copy the
partly hit last block before its source was written (NaN logits, all-zero output). Now
such a hit stops at the block boundary; a whole-block hit on the same step's blocks is
still shared (one forward writes every request's KV of a layer before any attends), and
a later request copies the partly hit block once it is written. Fresh pages NaN-filled,
blocks shuffled, checked manager; logits and tokens against transformers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_check import hf_greedy, max_logit_diff, options, prompts, run  # noqa: E402

from pagedkv.engine.tiny import tiny_model  # noqa: E402

NEW = 3


def test_identical_prompts_in_one_step_and_later_are_exact():
    hf = tiny_model("llama-3-8b")
    (p,) = prompts(hf.config.vocab_size, (12,), seed=3)
    opts = options(enable_prefix_caching=True, max_batched_tokens=40)
    # one step admits all three: p (12), p again (hit stops at 8: block 2 is unwritten),
    # p + 1 token (a hit on p's three whole blocks, 12)
    batch = [p, p, p + [5]]
    engine = run(hf, batch, opts, new=NEW)
    engine = run(hf, [p], opts, new=NEW, engine=engine)  # later: 11, block 2 copied
    want = [hf_greedy(hf, q, NEW) for q in batch + [p]]
    assert [o.token_ids for o in engine.outputs] == want
    assert [engine.requests[o.rid].hit_tokens for o in engine.outputs] == [0, 8, 12, 11]
    assert max_logit_diff(hf, engine) <= 1e-4
