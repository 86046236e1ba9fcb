"""Chained block hashes: the identity of a full block of committed tokens.

Block ``i``'s hash covers its own tokens and, through its parent, every token before it,
plus the request's extra keys (cache salt, LoRA id) folded into the root. Hashing runs
once per newly full block (never per token) and returns plain ints, so the prefix cache
is a dict from int to block id.

Algorithms (``hash_algo``):
- ``"sha256"`` (default): SHA-256 of the parent's 32-byte digest followed by the block's
  tokens as uint32 little-endian (a block holding a token outside [0, 2**32) is written
  as a 0xFF tag byte and int64 instead: the two forms never have the same length, so the
  encoding stays injective). Collision-resistant, 256-bit keys, the same in every
  process: safe for a multi-tenant cache, where one user must not be able to forge
  another's hit. ``secret`` (a per-deployment key, see :func:`root_hash`) also makes the
  keys unpredictable to anyone without it; ``extra_keys`` carry a per-request cache salt.
  The compact encoding keeps it within ~2x of the 64-bit hash (benchmarks/blocks.py), and
  a memo of exact inputs (runs of 8 links, and a run's first new link) serves a shared
  prefix without hashing it again: still SHA-256 of the same bytes, no new collisions.
- ``"fast-single-tenant"``: CPython's tuple hash of (parent, tokens). 64-bit and NOT
  collision-resistant: anyone who chooses prompts can forge collisions and read or
  poison another user's cache entries. Only for a cache serving a single tenant.
- ``"xxh3_128"``: xxHash3 128-bit (needs the optional ``xxhash`` package); fast, but not
  cryptographic: single tenant as well.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

from pagedkv.errors import InvalidArgumentError

# extend(tokens, start, stop, block_size, parent, out): append the hashes of blocks
# [start, stop) to ``out``, the first one chained on ``parent``.
Extender = Callable[[Sequence[int], int, int, int, int, list], None]

ROOT_SEED = 0x5EED_BA5E


def _extend_fast(tokens: Sequence[int], start: int, stop: int, bs: int, parent: int,
                 out: list) -> None:
    # no memo: a tuple hash per block costs less than the uint32 keys a memo would need
    if stop - start == 1:  # a block filled while decoding: the same tuple, without zip's setup
        out.append(hash((parent, tuple(tokens[start * bs:stop * bs]))))
        return
    h = parent
    append = out.append
    # a whole prompt's blocks straight from its list (zip drops a partial tail block)
    run = iter(tokens) if start == 0 and len(tokens) // bs == stop else iter(
        tokens[start * bs:stop * bs])
    for block in zip(*[run] * bs):  # blocks cut in C
        h = hash((h, block))
        append(h)


def _bytes_extender(width: int, digest: Callable[[bytes], int]) -> Extender:
    """An extender over the int64 little-endian bytes of the tokens, each block's digest
    taken over the ``width``-byte parent followed by the block's bytes."""

    def extend(tokens: Sequence[int], start: int, stop: int, bs: int, parent: int,
               out: list) -> None:
        if stop <= start:
            return
        buf = array("q", tokens[start * bs:stop * bs]).tobytes()
        step = bs * 8
        h = parent
        append = out.append
        for off in range(0, len(buf), step):
            h = digest(h.to_bytes(width, "little") + buf[off:off + step])
            append(h)

    return extend


_WIDE = b"\xff"  # tags a block written as int64 (a token outside uint32)


def _block_bytes(block: Sequence[int]) -> bytes:
    """The compact, injective encoding of one block's tokens."""
    try:
        return array("I", block).tobytes()
    except OverflowError:
        return _WIDE + array("q", block).tobytes()


def _extend_sha256(tokens: Sequence[int], start: int, stop: int, bs: int, parent: int,
                   out: list) -> None:
    if stop <= start:
        return
    sha256 = hashlib.sha256
    from_bytes = int.from_bytes
    h = parent.to_bytes(32, "little")
    if stop - start == 1:  # a block filled while decoding: one link, not worth a memo entry
        block = tokens[start * bs:stop * bs]
        out.append(from_bytes(sha256(h + _block_bytes(block)).digest(), "little"))
        return
    append = out.append
    arr = array("I")
    try:  # one conversion for the whole range: the common case
        if start == 0 and type(tokens) is list and len(tokens) // bs == stop:
            # a whole prompt: no slice of its list
            arr.fromlist(tokens)  # faster than array("I", run)
            buf = arr.tobytes()[:stop * bs * 4]  # less any partial tail block
        else:
            run = tokens[start * bs:stop * bs]
            arr.fromlist(run if type(run) is list else list(run))
            buf = arr.tobytes()
    except OverflowError:
        for lo in range(start * bs, stop * bs, bs):
            h = sha256(h + _block_bytes(tokens[lo:lo + bs])).digest()
            append(from_bytes(h, "little"))
        return
    step = bs * 4
    span = step * _SHA_CHUNK
    links = _SHA_MEMO
    get_link = links.get
    chunks = _SHA_CHUNKS
    off = 0
    end = len(buf)
    while off < end:
        stop_off = off + span
        chunk_key = None
        if stop_off <= end:  # a whole chunk: one lookup for _SHA_CHUNK links
            chunk_key = h + buf[off:stop_off]
            known_chunk = chunks.get(chunk_key)
            if known_chunk is not None:
                h = known_chunk[-1].to_bytes(32, "little")  # the run's last digest
                out += known_chunk
                off = stop_off
                continue
        else:
            stop_off = end
        first = len(out)
        o = off
        while o < stop_off:  # links another prompt hashed before, up to the first new one
            link = h + buf[o:o + step]
            known = get_link(link)
            if known is None:
                break
            h = known
            append(from_bytes(h, "little"))
            o += step
        if o < stop_off:  # the first new link is memoised (a prefix that ends inside a
            # run finds it next time); the rest of the chain hangs on a new digest
            link = h + buf[o:o + step]
            h = sha256(link).digest()
            if len(links) >= _SHA_MEMO_MAX:
                links.clear()
            links[link] = h
            append(from_bytes(h, "little"))
            for rest in range(o + step, stop_off, step):
                h = sha256(h + buf[rest:rest + step]).digest()
                append(from_bytes(h, "little"))
        if chunk_key is not None:
            if len(chunks) >= _SHA_CHUNKS_MAX:
                chunks.clear()
            chunks[chunk_key] = tuple(out[first:])
        off = stop_off


# Recent chain links of ``sha256``: the exact input (parent digest + block bytes) -> its
# digest; and runs of ``_SHA_CHUNK`` links: parent digest + the run's bytes -> every link's
# key (the last key's 32 bytes are the run's last digest). Bytes and one tuple of ints per
# entry: the fewest objects for the cyclic GC to count. A prefix many requests share (a
# system prompt) is then hashed once, not once per request, and looked up in a few steps;
# the dicts compare whole inputs, so this is SHA-256 exactly (no new collisions), and the
# parent digest carries the secret and salts. Bounded: each is cleared when full (at most
# ~16 MiB of links at blocks of 16 tokens, ~6 MiB of runs). A run and a link of another
# block size can have inputs of one length: they live in separate dicts.
_SHA_MEMO: dict[bytes, bytes] = {}
_SHA_MEMO_MAX = 1 << 16
_SHA_CHUNK = 8
_SHA_CHUNKS: dict[bytes, tuple[int, ...]] = {}
_SHA_CHUNKS_MAX = 1 << 13


def clear_memo() -> None:
    """Forget every memoised ``sha256`` link and run (the state of a fresh process; the
    benchmarks start each run from it so that one run's prompts do not speed up the next)."""
    _SHA_MEMO.clear()
    _SHA_CHUNKS.clear()


def _xxh3_extender() -> Extender:
    try:
        import xxhash
    except ImportError:
        raise InvalidArgumentError(
            f"hash algorithm 'xxh3_128' needs the xxhash package; use {DEFAULT_HASH!r} or "
            f"{FAST_HASH!r}"
        ) from None
    return _bytes_extender(16, xxhash.xxh3_128_intdigest)


DEFAULT_HASH = "sha256"
FAST_HASH = "fast-single-tenant"
_ALGOS: dict[str, Callable[[], Extender]] = {
    DEFAULT_HASH: lambda: _extend_sha256,
    FAST_HASH: lambda: _extend_fast,
    "xxh3_128": _xxh3_extender,
}
HASH_ALGOS = tuple(_ALGOS)
MULTI_TENANT_SAFE = frozenset({DEFAULT_HASH})


def _one_fast(parent: int, block: Sequence[int]) -> int:
    return hash((parent, tuple(block)))


def _one_sha256(parent: int, block: Sequence[int]) -> int:
    return int.from_bytes(hashlib.sha256(parent.to_bytes(32, "little") + _block_bytes(block))
                          .digest(), "little")


def block_hasher(algo: str) -> Callable[[int, Sequence[int]], int]:
    """``one(parent, block_tokens)``: the key the extender named ``algo`` gives that one
    block chained on ``parent`` (a block filled while decoding, without the extender's
    setup for runs)."""
    if algo == FAST_HASH:
        return _one_fast
    if algo == DEFAULT_HASH:
        return _one_sha256
    extend = hash_extender(algo)

    def one(parent: int, block: Sequence[int]) -> int:
        out: list[int] = []
        extend(block, 0, 1, len(block), parent, out)
        return out[0]

    return one


def hash_extender(algo: str) -> Extender:
    """The block-hash function named ``algo`` (see the module docstring)."""
    if algo not in _ALGOS:
        raise InvalidArgumentError(f"unknown hash algorithm {algo!r}; known: {list(_ALGOS)}")
    return _ALGOS[algo]()


def _key_int(key: object) -> int:
    """Stable integer for one extra key (str/bytes/int/None/tuple), the same in every process."""
    if isinstance(key, bool) or key is None:
        raw = repr(key).encode()
    elif isinstance(key, int):
        raw = b"i" + str(key).encode()
    elif isinstance(key, str):
        raw = b"s" + key.encode()
    elif isinstance(key, bytes):
        raw = b"b" + key
    elif isinstance(key, tuple):
        raw = b"t" + b",".join(_key_int(k).to_bytes(16, "little") for k in key)
    else:
        raise InvalidArgumentError(
            f"extra cache keys must be str, bytes, int, None or tuples of them; got {key!r}"
        )
    return int.from_bytes(hashlib.sha256(raw).digest()[:16], "little")


def root_hash(extra_keys: Sequence[object] = (), secret: bytes = b"") -> int:
    """Parent of a request's first block: folds in keys that change every block's meaning
    (cache salt, LoRA adapter; requests with different keys never share a block) and the
    deployment's ``secret`` (with one, nobody without it can compute any block's key)."""
    h = ROOT_SEED
    if secret:
        h = int.from_bytes(hashlib.sha256(b"pagedkv-secret" + secret).digest()[:16], "little")
    for key in extra_keys:
        h = int.from_bytes(
            hashlib.sha256(h.to_bytes(32, "little") + _key_int(key).to_bytes(16, "little"))
            .digest()[:16], "little")
    return h


def _mix_fast(parent: int, values: Sequence[int]) -> int:
    return hash((parent, tuple(values)))


def _mix_strong(parent: int, values: Sequence[int]) -> int:
    raw = parent.to_bytes(32, "little") + b"".join(_key_int(v).to_bytes(16, "little")
                                                   for v in values)
    return int.from_bytes(hashlib.sha256(raw).digest()[:16], "little")  # fits every chain


def key_mixer(algo: str) -> Callable[[int, Sequence[int]], int]:
    """Derives a key from a block hash and a few more integers (multimodal ids inside a
    block, the look-ahead tokens of position-offset layers), as strong as ``algo``."""
    hash_extender(algo)
    return _mix_fast if algo == FAST_HASH else _mix_strong
