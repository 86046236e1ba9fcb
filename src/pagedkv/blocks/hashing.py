"""Chained block hashes: the identity of a full block of committed tokens.

Block ``i``'s hash covers its own tokens and, through its parent, every token before it,
plus the request's extra keys (cache salt, LoRA id) folded into the root. Hashing runs
once per newly full block (never per token) and returns plain ints, so the prefix cache
is a dict from int to block id.

Algorithms (``hash_algo``):
- ``"fast"`` (default): CPython's tuple hash of (parent, tokens). Deterministic across
  processes for integer tokens (ints and tuples are not salted), 64-bit, not
  collision-resistant against an adversary: use it for one tenant.
- ``"sha256"``: SHA-256 over the int64 little-endian tokens and the 32-byte parent;
  for multi-tenant caches where one user must not be able to forge another's hit.
- ``"xxh3_128"``: xxHash3 128-bit (needs the optional ``xxhash`` package).
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
    h = parent
    append = out.append
    for lo in range(start * bs, stop * bs, bs):
        h = hash((h, tuple(tokens[lo:lo + bs])))
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


def _sha256_int(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest(), "little")


def _xxh3_extender() -> Extender:
    try:
        import xxhash
    except ImportError:
        raise InvalidArgumentError(
            "hash algorithm 'xxh3_128' needs the xxhash package; use 'fast' or 'sha256'"
        ) from None
    return _bytes_extender(16, xxhash.xxh3_128_intdigest)


_ALGOS: dict[str, Callable[[], Extender]] = {
    "fast": lambda: _extend_fast,
    "sha256": lambda: _bytes_extender(32, _sha256_int),
    "xxh3_128": _xxh3_extender,
}
HASH_ALGOS = tuple(_ALGOS)


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


def root_hash(extra_keys: Sequence[object] = ()) -> int:
    """Parent of a request's first block: folds in keys that change every block's meaning
    (cache salt, LoRA adapter). Requests with different keys never share a block."""
    h = ROOT_SEED
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
    return _mix_fast if algo == "fast" else _mix_strong
