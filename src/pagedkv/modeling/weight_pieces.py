"""Loading checkpoint tensors that fill *parts* of a parameter: per-expert tensors as
checkpoints save them (``experts.{e}.gate_proj.weight``...) into the stacked expert
parameters the native models keep ([E, ...]), gate and up halves into one fused tensor.

A model maps each checkpoint name to pieces ``(parameter name, index)``; every parameter
and persistent buffer must end up covered exactly once, with matching shapes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagedkv.errors import WeightError

Piece = tuple[str, tuple]  # (parameter or buffer name, index into it; () for all of it)

_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def expert_pieces(name: str, size: int) -> list[Piece]:
    """Per-expert checkpoint names (``...mlp.experts.{e}.gate_proj.weight``...) -> slices
    of the stacked ``gate_up_proj`` [E, 2 * size, H] and ``down_proj`` [E, H, size]; any
    other name -> the whole parameter of that name."""
    m = _PER_EXPERT.fullmatch(name)
    if m is None:
        return [(name, ())]
    prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
    if proj == "down_proj":
        return [(f"{prefix}.down_proj", (e,))]
    part = slice(0, size) if proj == "gate_proj" else slice(size, 2 * size)
    return [(f"{prefix}.gate_up_proj", (e, part))]


def load_pieces(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    pieces_of: Callable[[str], list[Piece]],
) -> set[str]:
    """Copy each checkpoint tensor to ``pieces_of(name)`` (empty: skip it), converting dtype.

    Raises :class:`WeightError` for a name mapped to no parameter, a shape that does not
    fit, a piece given twice, or a parameter (or persistent buffer) left partly unfilled.
    Returns the names of the parameters and buffers filled.
    """
    targets: dict[str, torch.Tensor] = dict(module.named_parameters())
    for name, buf in module.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf not in module.get_submodule(owner)._non_persistent_buffers_set:
            targets[name] = buf
    covered: dict[str, int] = {}
    seen: set[tuple[str, str]] = set()
    for name, tensor in weights:
        for target, index in pieces_of(name):
            param = targets.get(target)
            if param is None:
                raise WeightError(f"checkpoint tensor {name!r} matches no parameter of "
                                  f"{type(module).__name__} (mapped to {target!r})")
            try:
                dst = param.data[index] if index else param.data
            except IndexError:  # e.g. expert 7's tensors for a config of 4 experts
                raise WeightError(f"checkpoint tensor {name!r} maps to {target!r}"
                                  f"{list(index)}, outside its shape {tuple(param.shape)}"
                                  ) from None
            if tuple(dst.shape) != tuple(tensor.shape):
                where = f"{target!r}{list(index)}" if index else repr(target)
                raise WeightError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"{where} needs {tuple(dst.shape)}")
            key = (target, repr(index))
            if key in seen:
                raise WeightError(f"checkpoint tensor {name!r} fills {target!r} a second time")
            seen.add(key)
            with torch.no_grad():
                dst.copy_(tensor)
            covered[target] = covered.get(target, 0) + dst.numel()
    missing = sorted(n for n, p in targets.items() if covered.get(n, 0) != p.numel())
    if missing:
        raise WeightError(f"checkpoint lacks {len(missing)} tensors of {type(module).__name__}: "
                          f"{missing[:6]}{' ...' if len(missing) > 6 else ''}")
    return set(covered)
