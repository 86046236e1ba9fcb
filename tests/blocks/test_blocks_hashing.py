"""Chained block hashes: prefix property, incremental = one shot, extra keys, stability."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.blocks.hashing import HASH_ALGOS, block_hasher, hash_extender, root_hash
from pagedkv.errors import InvalidArgumentError

ALGOS = [a for a in HASH_ALGOS if a != "xxh3_128"]
try:
    import xxhash  # noqa: F401

    ALGOS.append("xxh3_128")
except ImportError:
    pass

tokens_st = st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=80)
# tokens outside uint32 take the default hash's wide (tagged int64) encoding
wide_tokens_st = st.lists(st.one_of(st.integers(0, 2**32 - 1), st.integers(-2**63, 2**63 - 1)),
                          min_size=0, max_size=48)


def chain(algo, tokens, bs, parent=0):
    out: list[int] = []
    hash_extender(algo)(tokens, 0, len(tokens) // bs, bs, parent, out)
    return out


@pytest.mark.parametrize("algo", ALGOS)
@settings(max_examples=40, deadline=None)
@given(a=tokens_st, b=tokens_st, bs=st.sampled_from([1, 4, 16]))
def test_equal_prefixes_have_equal_hashes_and_a_difference_propagates(algo, a, b, bs):
    ha, hb = chain(algo, a, bs), chain(algo, b, bs)
    for i in range(min(len(ha), len(hb))):
        same_prefix = a[:(i + 1) * bs] == b[:(i + 1) * bs]
        assert (ha[i] == hb[i]) == same_prefix


@pytest.mark.parametrize("algo", ALGOS)
@settings(max_examples=30, deadline=None)
@given(toks=tokens_st, cut=st.integers(0, 20), bs=st.sampled_from([2, 4]))
def test_incremental_extension_equals_one_shot(algo, toks, cut, bs):
    n = len(toks) // bs
    cut = min(cut, n)
    ext = hash_extender(algo)
    part: list[int] = []
    ext(toks, 0, cut, bs, 5, part)
    ext(toks, cut, n, bs, part[-1] if part else 5, part)
    assert part == chain(algo, toks, bs, 5)


@pytest.mark.parametrize("algo", ALGOS)
@settings(max_examples=30, deadline=None)
@given(toks=st.one_of(tokens_st, wide_tokens_st), bs=st.sampled_from([1, 4, 16]),
       parent=st.integers(0, 2**64 - 1))
def test_the_one_block_hasher_gives_the_chains_next_key(algo, toks, bs, parent):
    # the decode path hashes a newly full block alone: same key as extending the chain
    n = len(toks) // bs
    whole = chain(algo, toks, bs, parent)
    one = block_hasher(algo)
    h = parent
    for i in range(n):
        h = one(h, toks[i * bs:(i + 1) * bs])
        assert h == whole[i]


def test_sha256_matches_an_independent_computation():
    toks = list(range(8))
    parent = 123
    expected = []
    h = parent
    for i in range(2):
        raw = h.to_bytes(32, "little") + array("I", toks[i * 4:(i + 1) * 4]).tobytes()
        h = int.from_bytes(hashlib.sha256(raw).digest(), "little")
        expected.append(h)
    assert chain("sha256", toks, 4, parent) == expected


def test_extra_keys_separate_requests():
    assert root_hash(()) != root_hash(("tenant-a",))
    assert root_hash(("tenant-a",)) != root_hash(("tenant-b",))
    assert root_hash(("salt", 3)) != root_hash(("salt", 4))
    assert root_hash(("a", "b")) != root_hash(("b", "a"))
    with pytest.raises(InvalidArgumentError):
        root_hash((object(),))


def test_unknown_algorithm_is_refused():
    with pytest.raises(InvalidArgumentError):
        hash_extender("md5")


def test_fast_hash_is_the_same_in_another_process_with_another_hash_seed():
    code = ("from pagedkv.blocks.hashing import hash_extender, root_hash; out=[];"
            "hash_extender('fast-single-tenant')(list(range(64)), 0, 4, 16, root_hash(('salt',)), out);"
            "print(out)")
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                capture_output=True, text=True).stdout)
    assert len(outs) == 1


@settings(max_examples=40, deadline=None)
@given(toks=wide_tokens_st, cut=st.integers(0, 12), bs=st.sampled_from([1, 2, 4]))
def test_default_hash_with_wide_tokens_is_incremental_and_prefix_exact(toks, cut, bs):
    n = len(toks) // bs
    cut = min(cut, n)
    ext = hash_extender("sha256")
    part: list[int] = []
    ext(toks, 0, cut, bs, 5, part)
    ext(toks, cut, n, bs, part[-1] if part else 5, part)
    assert part == chain("sha256", toks, bs, 5)
    other = [t ^ 1 for t in toks]  # every block differs
    assert not set(chain("sha256", other, bs, 5)) & set(part)


def test_default_hash_of_a_wide_block_matches_an_independent_computation():
    toks = [1, 2, 2**40, 3]  # second block holds a token outside uint32
    b0 = hashlib.sha256((7).to_bytes(32, "little") + array("I", [1, 2]).tobytes()).digest()
    b1 = hashlib.sha256(b0 + b"\xff" + array("q", [2**40, 3]).tobytes()).digest()
    assert chain("sha256", toks, 2, 7) == [int.from_bytes(b0, "little"),
                                           int.from_bytes(b1, "little")]


def test_the_default_hash_is_the_collision_resistant_one():
    from pagedkv.blocks.hashing import DEFAULT_HASH, FAST_HASH, MULTI_TENANT_SAFE

    assert DEFAULT_HASH == "sha256" and DEFAULT_HASH in MULTI_TENANT_SAFE
    assert FAST_HASH not in MULTI_TENANT_SAFE and "single-tenant" in FAST_HASH


def test_a_deployment_secret_changes_every_key():
    assert len({root_hash(()), root_hash((), b"k1"), root_hash((), b"k2")}) == 3
    assert root_hash(("salt",), b"k1") != root_hash(("salt",), b"k2")
    a = chain("sha256", list(range(8)), 4, root_hash((), b"k1"))
    b = chain("sha256", list(range(8)), 4, root_hash((), b"k2"))
    assert not set(a) & set(b)


def test_sha256_shared_prefix_from_the_memo_matches_an_independent_computation():
    # the second and third prompts reuse the first one's chain links (and the memo is
    # cleared when full): every key is still SHA-256 of parent digest + block bytes
    from pagedkv.blocks import hashing

    rng = random.Random(11)
    shared = [rng.randrange(1 << 20) for _ in range(32)]
    prompts = [shared + [rng.randrange(1 << 20) for _ in range(8)] for _ in range(3)]
    for parent in (5, 6, 5):  # another root (secret, salt) shares no link
        for toks in prompts:
            expected, h = [], parent
            for i in range(len(toks) // 8):
                raw = h.to_bytes(32, "little") + array("I", toks[i * 8:(i + 1) * 8]).tobytes()
                h = int.from_bytes(hashlib.sha256(raw).digest(), "little")
                expected.append(h)
            assert chain("sha256", toks, 8, parent) == expected
    old = hashing._SHA_MEMO_MAX
    hashing._SHA_MEMO_MAX = 2  # cleared on nearly every link
    try:
        fresh = [rng.randrange(1 << 20) for _ in range(40)]
        assert chain("sha256", fresh, 8, 5) == chain("sha256", fresh[:], 8, 5)
        assert len(hashing._SHA_MEMO) <= 2
    finally:
        hashing._SHA_MEMO_MAX = old


def _sha_chain(toks, bs, parent):
    expected, h = [], parent
    for i in range(len(toks) // bs):
        raw = h.to_bytes(32, "little") + array("I", toks[i * bs:(i + 1) * bs]).tobytes()
        h = int.from_bytes(hashlib.sha256(raw).digest(), "little")
        expected.append(h)
    return expected


def test_sha256_runs_of_links_from_the_memo_match_an_independent_computation():
    # runs of 8 links are memoised as one entry: prompts sharing 25 blocks, diverging
    # inside a run, and one block size whose single link has the byte length of another's
    # run of 8 (64 tokens = 8 blocks of 8), chained on the same parent
    rng = random.Random(12)
    shared = [rng.randrange(1 << 20) for _ in range(200)]
    prompts = [shared + [rng.randrange(1 << 20) for _ in range(rng.randrange(1, 90))]
               for _ in range(3)]
    prompts.append(shared[:100] + [7] + shared[101:])  # diverges inside the second run
    for _ in range(2):  # the second pass is served from the memo
        for toks in prompts:
            for bs in (8, 64):
                assert chain("sha256", toks, bs, 5) == _sha_chain(toks, bs, 5)
    # growing a chain block by block (decode) gives the keys of hashing it at once
    toks = prompts[0]
    grown: list = []
    ext = hash_extender("sha256")
    for i in range(len(toks) // 8):
        ext(toks, i, i + 1, 8, grown[-1] if grown else 5, grown)
    assert grown == _sha_chain(toks, 8, 5)


def test_fast_hash_matches_its_definition():
    # fast-single-tenant is hash((parent, block tuple)) chained (blocks are cut by zip):
    # shared prefixes, a divergence, two block sizes, whole chains and partial tails
    rng = random.Random(13)
    shared = [rng.randrange(1 << 20) for _ in range(300)]
    prompts = [shared + [rng.randrange(1 << 20) for _ in range(rng.randrange(1, 90))]
               for _ in range(3)] + [shared[:150] + [1] + shared[151:]]

    def by_definition(toks, bs, parent):
        out, h = [], parent
        for i in range(len(toks) // bs):
            h = hash((h, tuple(toks[i * bs:(i + 1) * bs])))
            out.append(h)
        return out

    for _ in range(2):
        for toks in prompts:
            for bs in (4, 16):
                assert chain("fast-single-tenant", toks, bs, 9) == by_definition(toks, bs, 9)


def _fast_chain(toks, bs, parent):
    out, h = [], parent
    for i in range(len(toks) // bs):
        h = hash((h, tuple(toks[i * bs:(i + 1) * bs])))
        out.append(h)
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), algo=st.sampled_from(["sha256", "fast-single-tenant"]))
def test_prompts_sharing_the_last_prompts_blocks_get_their_keys_by_definition(seed, algo):
    # add_request copies the keys of the leading blocks a prompt shares with the last one
    # hashed (same root); in a row of prompts that share, diverge early, late, inside a
    # block, switch tenant (extra keys) or secret, are shorter than a block or carry
    # multimodal spans, every key of both block sizes is its chain by definition
    from block_groups import group

    from pagedkv.blocks import KVCacheManager
    from pagedkv.kvspec import Full

    rng = random.Random(seed)
    secret = rng.choice([b"", b"s3cret"])
    m = KVCacheManager([group(0, Full(), 4, 400), group(1, Full(), 8, 400)], hash_algo=algo,
                       hash_secret=secret, checked=False)
    bases = [[rng.randrange(1 << 20) for _ in range(120)] for _ in range(2)]
    by_def = _fast_chain if algo == "fast-single-tenant" else _sha_chain
    for i in range(30):
        base = bases[rng.randrange(2)] if rng.random() < 0.9 else []
        toks = base[:rng.randrange(0, 120)] + [rng.randrange(1 << 20)
                                               for _ in range(rng.randrange(1, 30))]
        if rng.random() < 0.2 and len(toks) > 3:
            toks[rng.randrange(len(toks))] ^= 1  # one changed token, anywhere
        keys = rng.choice([(), (), ("tenant-b",)])
        spans = [(9, 10, 77)] if rng.random() < 0.1 and len(toks) > 10 else []
        m.add_request(i, toks, extra_keys=keys, mm_spans=spans)
        req = m.requests[i]
        root = root_hash(keys, secret)
        assert req.root == root
        for bs in (4, 8):
            if spans:
                assert req.hashes[bs][:1] == by_def(toks, bs, root)[:1]  # before the span
            else:
                assert req.hashes.get(bs, []) == by_def(toks, bs, root)


def test_a_prompt_sharing_the_last_two_prompts_head_reuses_their_keys():
    from block_groups import group

    from pagedkv.blocks import KVCacheManager
    from pagedkv.kvspec import Full

    m = KVCacheManager([group(0, Full(), 4, 400)], hash_algo="fast-single-tenant",
                       checked=False)
    system = list(range(1000, 1020))  # 5 blocks
    for i, tail in enumerate(([1, 2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12, 13, 14, 15])):
        m.add_request(i, system + tail)
    keys = [m.requests[i].hashes[4] for i in range(3)]
    assert keys[2] == _fast_chain(system + [10, 11, 12, 13, 14, 15], 4, m.requests[2].root)
    assert all(a is b for a, b in zip(keys[2][:5], keys[1][:5]))  # copied, not hashed again
    assert keys[2][5] is not keys[1][5]
    m.add_request(3, [5] + system)  # starts otherwise: hashed, by definition
    assert m.requests[3].hashes[4] == _fast_chain([5] + system, 4, m.requests[3].root)
