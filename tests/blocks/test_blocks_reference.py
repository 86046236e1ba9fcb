"""Prefix hits against an independent reference: a brute-force set of cached token
prefixes (no hashes, no pools). Pools are large enough that nothing is evicted."""

from __future__ import annotations

from block_groups import deepseek_mtp_like, full_only, gpt_oss_like
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.blocks import KVCacheManager

BS = 4

# a prompt is a cut of an earlier request's sequence (or of a fixed base) plus a suffix,
# so that prefixes repeat often
request_st = st.tuples(
    st.integers(-1, 7),  # which earlier sequence to extend (-1 or out of range: the base)
    st.integers(0, 24),  # how much of it
    st.lists(st.integers(0, 2), min_size=0, max_size=8),  # own suffix
    st.lists(st.integers(0, 2), min_size=1, max_size=6),  # sampled tokens
)
BASE = [i % 3 for i in range(24)]


def reference_hit(cached: list[set[tuple[int, ...]]], offsets: list[int], prompt) -> int:
    """Longest prefix every group can serve: a group with offset k serves its first
    (cached leading blocks) * BS - k positions; never more than len(prompt) - 1."""
    limit = len(prompt) - 1
    best = limit
    for blocks, k in zip(cached, offsets):
        n = 0
        while (n + 1) * BS <= len(prompt) and tuple(prompt[:(n + 1) * BS]) in blocks:
            n += 1
        best = min(best, max(0, n * BS - k))
    return best


def record(cached, offsets, seq, computed):
    """Blocks of ``seq`` a group caches once ``computed`` tokens are final."""
    for blocks, k in zip(cached, offsets):
        for j in range((computed - k) // BS):
            blocks.add(tuple(seq[:(j + 1) * BS]))


@settings(max_examples=100, deadline=None)
@given(requests=st.lists(request_st, min_size=1, max_size=8),
       which=st.sampled_from(["full", "window", "mtp"]))
def test_hits_match_a_brute_force_reference(requests, which):
    groups = {"full": full_only, "window": gpt_oss_like, "mtp": deepseek_mtp_like}[which](
        num_blocks=400, bs=BS)
    m = KVCacheManager(groups, checked=True, sweep_every=1, max_batched_tokens=64)
    offsets = [g.position_offset for g in groups]
    cached: list[set[tuple[int, ...]]] = [set() for _ in groups]
    seqs: list[list[int]] = []
    for i, (src, cut, suffix, sampled) in enumerate(requests):
        prompt = ((seqs[src] if 0 <= src < len(seqs) else BASE)[:cut] + suffix) or [1]
        m.add_request(i, prompt)
        expected = reference_hit(cached, offsets, prompt)
        hit = m.find_cached_prefix(i)
        assert hit == expected
        assert m.allocate(i, len(prompt) - hit)
        m.commit(i, len(prompt) - hit, [sampled[0]])
        for tok in sampled[1:]:
            assert m.allocate(i, 1)
            m.commit(i, 1, [tok])
        seq = list(prompt) + list(sampled)
        seqs.append(seq)
        record(cached, offsets, seq, m.num_computed(i))
        m.free(i)
