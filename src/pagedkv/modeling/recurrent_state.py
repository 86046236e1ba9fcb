"""Recurrent state over pagedkv's state slots: one step's segments, restores, causal conv.

A recurrent group of the block manager gives each request one state slot (its block id in
that group); every recurrent layer of the group keeps its state tensors (conv, SSM or delta
state) at that slot index of its own per-layer tensors. Prefix caching adds checkpoints:
``restore`` copy ops bring a cached state into a request's slot before the forward
(:func:`apply_restores`), and ``save`` ops ask the forward to write the state after a given
position into a spare slot. Saves may fall inside a chunk, so a request's rows are cut into
segments at its save positions (:class:`RecurrentBatch`) and the mixer runs segment by
segment, writing each segment's final state to the working slot and to the save slot.

A request that has computed nothing starts from zeros and never reads its slot (a fresh
slot holds whatever its last owner left, NaN in the tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedkv.batch import ScheduledRequest
from pagedkv.blocks import CopyOp
from pagedkv.errors import InvalidArgumentError, MetadataError, UnsupportedCapabilityError
from pagedkv.ops import write_state

StateDict = dict[str, torch.Tensor]
# (initial states [B, ...] by name, inputs [B, L, ...]) -> (outputs [B, L, ...], final states)
SegmentFn = Callable[[StateDict, Sequence[torch.Tensor]], tuple[Sequence[torch.Tensor], StateDict]]


@dataclass(frozen=True)
class Segment:
    """Rows [start, start + length) of the packed batch, run from one initial state.

    ``fresh``: start from zeros (nothing computed yet); otherwise read ``slot``.
    The final state goes to ``slot`` and to every slot of ``saves``.
    """

    start: int
    length: int
    slot: int
    fresh: bool
    saves: tuple[int, ...] = ()


@dataclass(frozen=True)
class RecurrentBatch:
    """One step's segments of one recurrent group, in rounds: round r holds the r-th segment
    of every request that has one, so a request's segments run in order while the
    segments of one round are independent (run together, batched by length)."""

    rounds: tuple[tuple[Segment, ...], ...]
    num_tokens: int

    @classmethod
    def build(
        cls,
        requests: Sequence[ScheduledRequest],
        group_id: int,
        copy_ops: Iterable[CopyOp] = (),
        *,
        drafts_rolled_back: bool = False,
    ) -> RecurrentBatch:
        """Segments of ``requests`` (rows packed in order) for group ``group_id``.

        ``copy_ops`` are the step's ops from ``KVCacheManager.drain_copy_ops``; the
        ``save`` ops of this group say where, besides the end, a state must be kept.
        ``drafts_rolled_back``: the caller restores the slots of requests with draft
        tokens after verification (``engine.speculative``), so drafts may run here.
        """
        saves: dict[int, list[tuple[int, int]]] = {}
        for op in copy_ops:
            if op.kind == "save" and op.group_id == group_id:
                saves.setdefault(op.src, []).append((op.position, op.dst))
        per_request: list[list[Segment]] = []
        row = 0
        for req in requests:
            blocks = req.blocks(group_id)
            n = req.num_new_tokens
            if n == 0:
                per_request.append([])
                continue
            if req.num_draft_tokens and not drafts_rolled_back:
                raise UnsupportedCapabilityError(
                    f"request {req.req_id!r} carries {req.num_draft_tokens} draft tokens in "
                    f"recurrent group {group_id}: a rejected draft would have advanced the "
                    "state, and rolling recurrent state back is not implemented"
                )
            if len(blocks) != 1:
                raise MetadataError(
                    f"request {req.req_id!r} has {len(blocks)} state slots in recurrent group "
                    f"{group_id}; a recurrent group holds exactly one per request"
                )
            slot = blocks[0]
            begin, end = req.num_computed_tokens, req.num_tokens
            cuts: dict[int, list[int]] = {}
            for position, dst in saves.pop(slot, ()):
                if not begin < position <= end:
                    raise MetadataError(
                        f"request {req.req_id!r}: a save at position {position} lies outside "
                        f"this step's positions ({begin}, {end}]"
                    )
                cuts.setdefault(position, []).append(dst)
            segs = []
            pos = begin
            for stop in sorted(set(cuts) | {end}):
                if stop == pos:
                    continue
                segs.append(Segment(row + pos - begin, stop - pos, slot, pos == 0,
                                    tuple(cuts.get(stop, ()))))
                pos = stop
            per_request.append(segs)
            row += n
        if saves:
            raise MetadataError(
                f"save ops of group {group_id} name slots {sorted(saves)} that no scheduled "
                "request holds"
            )
        depth = max((len(s) for s in per_request), default=0)
        rounds = tuple(
            tuple(s[r] for s in per_request if len(s) > r) for r in range(depth)
        )
        return cls(rounds, row)


def apply_restores(copy_ops: Iterable[CopyOp], group_states: Mapping[int, Sequence[StateDict]]) -> None:
    """Run the step's ``restore`` ops: checkpoint slot ``src`` -> request slot ``dst`` in every
    state tensor of every layer of the op's group (``group_states[group_id]``). Run before
    the forward; ops of groups not in ``group_states`` are left to their owner."""
    for op in copy_ops:
        if op.kind != "restore" or op.group_id not in group_states:
            continue
        for states in group_states[op.group_id]:
            for tensor in states.values():
                tensor[op.dst].copy_(tensor[op.src])


def run_segments(
    batch: RecurrentBatch,
    states: StateDict,
    inputs: Sequence[torch.Tensor],
    fn: SegmentFn,
) -> list[torch.Tensor]:
    """Run ``fn`` over every segment of ``batch``; inputs are packed rows [T, ...].

    Segments of one round and one length run as one batch. Each reads its initial state
    from its slot (zeros when fresh) and writes its final state to its slot and its saves.
    Returns ``fn``'s outputs, packed like the inputs (rows of no segment stay zero).
    """
    if inputs and inputs[0].shape[0] < batch.num_tokens:
        raise InvalidArgumentError(
            f"{inputs[0].shape[0]} input rows for a batch of {batch.num_tokens} tokens"
        )
    outputs: list[torch.Tensor] | None = None
    for segments in batch.rounds:
        by_length: dict[int, list[Segment]] = {}
        for seg in segments:
            by_length.setdefault(seg.length, []).append(seg)
        for length, group in by_length.items():
            rows = torch.stack(
                [torch.arange(s.start, s.start + length) for s in group]
            ).to(inputs[0].device)
            initial = _initial(states, group)
            outs, final = fn(initial, [x[rows] for x in inputs])
            if outputs is None:
                outputs = [o.new_zeros(inputs[0].shape[0], *o.shape[2:]) for o in outs]
            for packed, out in zip(outputs, outs):
                packed[rows] = out.to(packed.dtype)
            _store(states, final, group)
    if outputs is None:  # nothing scheduled in this group
        raise InvalidArgumentError("a recurrent layer ran with no scheduled tokens")
    return outputs


def _initial(states: StateDict, group: Sequence[Segment]) -> StateDict:
    slots = torch.tensor([s.slot for s in group], device=next(iter(states.values())).device)
    fresh = torch.tensor([s.fresh for s in group], device=slots.device)
    out = {}
    for name, tensor in states.items():
        value = tensor[slots]
        if bool(fresh.any()):  # never read a fresh slot's contents: it may hold NaN
            shape = (-1,) + (1,) * (value.dim() - 1)
            value = torch.where(fresh.view(shape), torch.zeros_like(value), value)
        out[name] = value
    return out


def _store(states: StateDict, final: StateDict, group: Sequence[Segment]) -> None:
    slots = [s.slot for s in group]
    for name, tensor in states.items():
        value = final[name]
        write_state(value, tensor, torch.tensor(slots, device=tensor.device))
        extra = [(b, dst) for b, s in enumerate(group) for dst in s.saves]
        if extra:
            rows = torch.tensor([b for b, _ in extra], device=value.device)
            write_state(value[rows], tensor, torch.tensor([d for _, d in extra], device=tensor.device))


def causal_conv(
    x: torch.Tensor,
    state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: Callable[[torch.Tensor], torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of x [B, L, C] continuing from state [B, k-1, C] (the last k-1
    inputs before x); weight [C, k]. Returns (output [B, L, C], new state [B, k-1, C])."""
    length = x.shape[1]
    full = torch.cat([state.to(x.dtype), x], dim=1)  # [B, k-1+L, C]
    out = F.conv1d(full.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), bias,
                   groups=weight.shape[0])  # [B, C, L]
    out = out.transpose(1, 2)[:, -length:]
    if activation is not None:
        out = activation(out)
    return out.to(x.dtype), full[:, full.shape[1] - state.shape[1]:]
