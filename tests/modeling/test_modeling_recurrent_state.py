"""Segments of a recurrent group's step: cut at checkpoint saves, in rounds, fresh requests
start from zeros; restores copy every state tensor of the group; bad ops are refused."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pagedkv.batch import ScheduledRequest  # noqa: E402
from pagedkv.blocks import CopyOp  # noqa: E402
from pagedkv.errors import MetadataError, UnsupportedCapabilityError  # noqa: E402
from pagedkv.modeling.recurrent_state import (  # noqa: E402
    RecurrentBatch,
    Segment,
    apply_restores,
    causal_conv,
    run_segments,
)

G = 3  # the recurrent group's id


def req(rid, computed, new, slot):
    return ScheduledRequest(rid, computed, new, {G: [slot], 0: [9, 8]})


def test_saves_cut_a_chunk_and_rounds_keep_each_request_in_order():
    ops = [CopyOp("save", G, 5, 11, 8), CopyOp("save", G, 5, 12, 4),
           CopyOp("save", G, 2, 13, 7), CopyOp("save", 0, 5, 14, 6)]  # other group: ignored
    batch = RecurrentBatch.build([req("a", 0, 10, 5), req("b", 6, 1, 7), req("c", 3, 4, 2)], G, ops)
    assert batch.num_tokens == 15
    assert batch.rounds == (
        (Segment(0, 4, 5, True, (12,)), Segment(10, 1, 7, False), Segment(11, 4, 2, False, (13,))),
        (Segment(4, 4, 5, False, (11,)),),
        (Segment(8, 2, 5, False),),
    )


@pytest.mark.parametrize("op, words", [
    (CopyOp("save", G, 5, 11, 11), "outside"),  # past the step's last position
    (CopyOp("save", G, 5, 11, 2), "outside"),  # at or before what is computed
    (CopyOp("save", G, 6, 11, 4), "no scheduled request"),
])
def test_bad_saves_are_refused(op, words):
    with pytest.raises(MetadataError, match=words):
        RecurrentBatch.build([req("a", 2, 8, 5)], G, [op])


def test_a_request_needs_exactly_one_slot():
    bad = ScheduledRequest("a", 0, 3, {G: [1, 2]})
    with pytest.raises(MetadataError, match="exactly one"):
        RecurrentBatch.build([bad], G)


def test_draft_tokens_are_refused_not_silently_folded_into_the_state():
    draft = ScheduledRequest("a", 4, 3, {G: [1]}, num_draft_tokens=2)
    with pytest.raises(UnsupportedCapabilityError, match="2 draft tokens"):
        RecurrentBatch.build([draft], G)


def test_segments_read_their_slot_unless_fresh_and_write_slot_and_saves():
    nan = float("nan")
    states = {"s": torch.full((6, 2), nan)}
    states["s"][1] = torch.tensor([1.0, 2.0])
    batch = RecurrentBatch.build([req("a", 0, 3, 4), req("b", 5, 2, 1)], G,
                                 [CopyOp("save", G, 4, 0, 2)])

    def running_sum(init, inputs):  # state += sum of rows; output = state after each row
        (x,) = inputs
        out = init["s"][:, None] + x.cumsum(1)
        return [out], {"s": out[:, -1]}

    x = torch.arange(10.0).view(5, 2)
    (y,) = run_segments(batch, states, [x], running_sum)
    assert torch.equal(y[:3], x[:3].cumsum(0))  # fresh: from zeros, not the NaN slot
    assert torch.equal(y[3:], torch.tensor([1.0, 2.0]) + x[3:].cumsum(0))
    assert torch.equal(states["s"][0], x[:2].sum(0))  # the save at position 2
    assert torch.equal(states["s"][4], x[:3].sum(0))
    assert torch.equal(states["s"][1], y[4])
    assert torch.isnan(states["s"][[2, 3, 5]]).all()  # nothing else written


def test_restores_copy_every_tensor_of_their_group_only():
    a = {"conv": torch.zeros(4, 2), "ssm": torch.zeros(4, 3)}
    b = {"conv": torch.zeros(4, 2)}
    for t in (a["conv"], a["ssm"], b["conv"]):
        t[2] = 7.0
    apply_restores([CopyOp("restore", G, 2, 1, 8), CopyOp("restore", 9, 2, 3, 8),
                    CopyOp("save", G, 2, 0, 4)], {G: [a, b]})
    for t in (a["conv"], a["ssm"], b["conv"]):
        assert (t[1] == 7.0).all() and (t[[0, 3]] == 0).all()


def test_causal_conv_continues_from_its_state():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 5, generator=g)
    w, bias = torch.randn(5, 4, generator=g), torch.randn(5, generator=g)
    whole, _ = causal_conv(x, torch.zeros(2, 3, 5), w, bias, None)
    first, state = causal_conv(x[:, :2], torch.zeros(2, 3, 5), w, bias, None)
    rest, end = causal_conv(x[:, 2:], state, w, bias, None)
    torch.testing.assert_close(torch.cat([first, rest], 1), whole)
    assert torch.equal(end, x[:, -3:])
    ref = torch.nn.functional.conv1d(x.transpose(1, 2), w[:, None], bias, padding=3, groups=5)
    torch.testing.assert_close(whole, ref[..., :9].transpose(1, 2))
