"""Whether a drafter config can belong to a target config.

A drafter that reads the target's hidden states (EAGLE, DFlash, DSpark) needs every
target layer id it names to exist and the target's hidden size; one that shares the
target's embeddings (the same drafters) needs its vocabulary; MLA drafters whose layers
share the target's block table need the target's latent layout (kv_lora_rank and
qk_rope_head_dim). A plain draft model is checked for none of these (its own embeddings,
hidden states and cache). :func:`drafter_mismatch` returns the reason, or None.
"""

from __future__ import annotations

from collections.abc import Mapping

from pagedkv.errors import IncompatibleDrafterError
from pagedkv.models.drafters import MODEL, drafter_role, target_layer_ids
from pagedkv.models.fields import opt_int, text_config
from pagedkv.models.pattern import layer_pattern


def _differs(target: Mapping, draft: Mapping, target_key: str, *draft_keys: str) -> tuple | None:
    want = opt_int(target, target_key)
    have = opt_int(draft, *draft_keys)
    if want is None or have is None or want == have:
        return None
    return want, have


def drafter_mismatch(target_config: Mapping, draft_config: Mapping) -> str | None:
    """Why the drafter cannot serve the target (both values named), or None if it can."""
    target, draft = text_config(target_config), text_config(draft_config)
    role = drafter_role(draft)
    if role.kind == MODEL:
        return None
    depth = len(layer_pattern(target))
    ids = target_layer_ids(draft) or []
    outside = [i for i in ids if not 0 <= i < depth]
    if outside:
        return (f"its target layer ids {ids} include {outside}, but the target has "
                f"{depth} layers (ids 0..{depth - 1})")
    hidden = _differs(target, draft, "hidden_size", "target_hidden_size", "hidden_size")
    if hidden:
        return (f"it reads target hidden states of size {hidden[1]}, but the target's "
                f"hidden_size is {hidden[0]}")
    vocab = _differs(target, draft, "vocab_size", "vocab_size")
    if vocab:
        return (f"it shares the target's embeddings with vocab_size {vocab[1]}, but the "
                f"target's vocab_size is {vocab[0]}")
    if target.get("kv_lora_rank") is not None and draft.get("kv_lora_rank") is not None:
        for key in ("kv_lora_rank", "qk_rope_head_dim"):
            diff = _differs(target, draft, key, key)
            if diff:
                return (f"its MLA latent has {key} {diff[1]}, but the target's (whose block "
                        f"table it shares) has {diff[0]}")
    return None


def check_drafter(target_config: Mapping, draft_config: Mapping, target_name: str,
                  draft_name: str) -> None:
    """Raise :class:`IncompatibleDrafterError` when the drafter cannot serve the target."""
    reason = drafter_mismatch(target_config, draft_config)
    if reason is not None:
        raise IncompatibleDrafterError(
            f"drafter {draft_name!r} cannot draft for {target_name!r}: {reason}"
        )
