"""Checked mode and the builder's refusals: every error names the row and the values."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numpy")

from pagedkv.batch import (  # noqa: E402
    ScheduledRequest,
    build_metadata,
    checked_mode,
    validate_group_metadata,
)
from pagedkv.errors import InvalidArgumentError, MetadataError  # noqa: E402
from pagedkv.kvspec import Full, LayerSpec, MLALatent, Recurrent, RecurrentState, StateTensor  # noqa: E402
from pagedkv.plan.types import Group  # noqa: E402


def group(gid=0, block_size=4, offset=0, num_blocks=0):
    layer = LayerSpec(f"l{gid}", MLALatent(), Full(), position_offset=offset)
    return Group(gid, (layer,), Full(), block_size, offset, ("target",), 1152, 0, num_blocks, 0, 0)


REQS = [
    ScheduledRequest("a", 0, 5, {0: [7, 3]}),
    ScheduledRequest("b", 6, 1, {0: [1, 2]}),
    ScheduledRequest("c", 2, 3, {0: [5, 6]}, num_draft_tokens=2),
]


def built(**kw):
    return build_metadata(REQS, [group()], pad_batch_to=4, pad_tokens_to=11, **kw)[0]


def corrupt(meta, name, index, value):
    tensor = getattr(meta, name).clone()
    tensor.view(-1)[index] = value
    return dataclasses.replace(meta, **{name: tensor})


def test_valid_metadata_passes():
    validate_group_metadata(built(), group(), REQS)


@pytest.mark.parametrize(
    ("name", "index", "value", "match"),
    [
        ("slot_mapping", 5, 11, r"token row 5 of row 1 \(request 'b'\): slot 11 for position 6"),
        ("slot_mapping", 8, -1, r"token row 8 of row 2 \(request .c.\): slot -1 for position 4"),
        ("slot_mapping", 10, 0, "padding token row 10 writes slot 0"),
        ("positions", 2, 7, "token row 2 .*position 7, want 2"),
        ("seq_lens", 1, 6, r"row 1 \(request 'b'\): seq_len 6, want 7"),
        ("seq_lens", 3, 2, "padding row 3: seq_len 2, want 0"),
        ("query_start_loc", 1, 4, "query length 4"),
        ("block_table", 1, 9, r"block_table\[0\]\[1\]=9, allocated block is 3"),
        ("paged_kv_indices", 0, 8, "CSR pages"),
        ("paged_kv_indptr", 4, 9, "padding row 3: CSR holds 3 pages"),
        ("paged_kv_last_page_len", 0, 4, "last_page_len 4, want 1"),
    ],
)
def test_each_corruption_names_the_row(name, index, value, match):
    with pytest.raises(MetadataError, match=match):
        validate_group_metadata(corrupt(built(), name, index, value), group(), REQS)


def test_validation_against_the_wrong_group():
    with pytest.raises(MetadataError, match="checked against group 5"):
        validate_group_metadata(built(), group(5), REQS)


def test_two_requests_writing_one_block_are_caught_in_checked_mode():
    reqs = [ScheduledRequest("a", 0, 2, {0: [4]}), ScheduledRequest("b", 1, 1, {0: [4]})]
    build_metadata(reqs, [group()], checked=False)  # unchecked: the builder trusts its input
    with pytest.raises(MetadataError, match="write slot 17"):
        build_metadata(reqs, [group()], checked=True)


def test_env_turns_checked_mode_on(monkeypatch):
    reqs = [ScheduledRequest("a", 0, 2, {0: [4]}), ScheduledRequest("b", 1, 1, {0: [4]})]
    monkeypatch.setenv("PAGEDKV_DEBUG", "1")
    assert checked_mode(None) and not checked_mode(False)
    with pytest.raises(MetadataError):
        build_metadata(reqs, [group()])
    build_metadata(reqs, [group()], checked=False)  # the argument wins
    monkeypatch.setenv("PAGEDKV_DEBUG", "0")
    assert not checked_mode(None) and checked_mode(True)
    build_metadata(reqs, [group()])


def test_too_few_blocks_is_always_refused():
    reqs = [ScheduledRequest("a", 4, 5, {0: [1, 2]})]  # 9 positions need 3 blocks of 4
    with pytest.raises(MetadataError, match=r"request 'a' \(row 0\) needs 3 blocks .* has 2"):
        build_metadata(reqs, [group()], checked=False)


def test_block_id_outside_the_group_is_always_refused():
    reqs = [ScheduledRequest("a", 0, 1, {0: [1]}), ScheduledRequest("b", 0, 5, {0: [2, 10]})]
    with pytest.raises(MetadataError, match="row 1 holds block id 10, outside the group's 10"):
        build_metadata(reqs, [group(num_blocks=10)], checked=False)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pad_batch_to": 2}, "pad_batch_to=2"),
        ({"pad_tokens_to": 8}, "pad_tokens_to=8"),
        ({"max_blocks": 1}, "max_blocks=1"),
        ({"max_blocks": -1}, "max_blocks must be >= 0, got -1"),
    ],
)
def test_bad_shapes_are_refused(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        build_metadata(REQS, [group()], **kwargs)


def test_bad_groups_are_refused():
    with pytest.raises(InvalidArgumentError, match="given twice"):
        build_metadata(REQS, [group(), group()])
    state = RecurrentState((StateTensor("s", (4, 4)),))
    layer = LayerSpec("kda", state, Recurrent())
    rec = Group(1, (layer,), Recurrent(), 1, 0, ("target",), 0, 64, 8, 0, 0)
    with pytest.raises(InvalidArgumentError, match="recurrent"):
        build_metadata(REQS, [rec])


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("a", -1, 1), "num_computed_tokens"),
        (("a", 0, 1.5), "num_new_tokens"),
        (("a", 0, 2, {}, 3), "3 draft tokens but only 2"),
    ],
)
def test_bad_requests_are_refused(args, match):
    with pytest.raises(InvalidArgumentError, match=match):
        ScheduledRequest(*args)
