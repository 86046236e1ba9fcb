"""Attention groups: per-invocation causality and decode/prefill split, and their refusals."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numpy")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pagedkv.batch import AttentionGroup, ScheduledRequest, attention_view, build_metadata  # noqa: E402
from pagedkv.errors import ConfigError, InvalidArgumentError, UnsupportedCapabilityError  # noqa: E402
from pagedkv.kvspec import Attention, Full, LayerSpec, MLALatent  # noqa: E402
from pagedkv.plan.types import Group  # noqa: E402

TARGET = [LayerSpec(f"t{i}", MLALatent(), Full(), Attention(), index=i) for i in range(2)]
DRAFT = [
    LayerSpec(f"d{i}", MLALatent(), Full(), Attention(causal=False, draft_block=7), model="dspark", index=i)
    for i in range(2)
]
GROUP = Group(
    id=0, layers=tuple(TARGET + DRAFT), retention=Full(), block_size=4, position_offset=0,
    models=("target", "dspark"), bytes_per_token=4 * 1152, bytes_per_request=0, num_blocks=0,
    blocks_per_request=0, step_blocks=0,
)


def meta_for(q_lens, computed=10):
    reqs = [
        ScheduledRequest(f"r{i}", computed, q, {0: list(range(i * 20, i * 20 + 20))})
        for i, q in enumerate(q_lens)
    ]
    return build_metadata(reqs, [GROUP])[0]


def test_from_layers_reads_model_and_draft_block():
    target = AttentionGroup.from_layers("target", TARGET)
    draft = AttentionGroup.from_layers("draft", DRAFT, supports_non_causal=True, decode_threshold=16)
    assert (target.model, target.draft_block, target.supports_non_causal) == ("target", None, False)
    assert (draft.model, draft.draft_block, draft.decode_threshold) == ("dspark", 7, 16)
    assert draft.layer_names == ("d0", "d1")


def test_from_layers_refuses_mixed_groups():
    with pytest.raises(ConfigError, match="mixes models"):
        AttentionGroup.from_layers("x", TARGET + DRAFT)
    other = LayerSpec("d9", MLALatent(), Full(), Attention(causal=False, draft_block=4), model="dspark")
    with pytest.raises(ConfigError, match="mixes draft blocks"):
        AttentionGroup.from_layers("x", DRAFT + [other])
    with pytest.raises(ConfigError, match="decode_threshold"):
        AttentionGroup("x", "target", ("t0",), decode_threshold=0)
    with pytest.raises(ConfigError, match="no layers"):
        AttentionGroup.from_layers("x", [])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 20), max_size=8), st.integers(1, 16))
def test_split_follows_this_invocations_query_lengths(q_lens, threshold):
    meta = meta_for(q_lens)
    group = AttentionGroup("t", "target", ("t0", "t1"), decode_threshold=threshold)
    view = attention_view(meta, group, causal=True)
    want_dec = [i for i, q in enumerate(q_lens) if 1 <= q <= threshold]
    want_pre = [i for i, q in enumerate(q_lens) if q > threshold]
    assert view.decode_reqs.tolist() == want_dec and list(view.decode_reqs_host) == want_dec
    assert view.prefill_reqs.tolist() == want_pre and list(view.prefill_reqs_host) == want_pre
    assert view.decode_reqs.dtype == torch.int32
    assert view.num_decodes == len(want_dec) and view.num_prefills == len(want_pre)
    assert view.num_decode_tokens == sum(q_lens[i] for i in want_dec)
    assert view.num_prefill_tokens == sum(q_lens[i] for i in want_pre)
    assert view.causal is True and view.decode_threshold == threshold


def test_padding_rows_are_in_neither_split():
    reqs = [ScheduledRequest("a", 0, 1, {0: [0]}), ScheduledRequest("b", 0, 5, {0: [1, 2]})]
    meta = build_metadata(reqs, [GROUP], pad_batch_to=4)[0]
    view = attention_view(meta, AttentionGroup("t", "target", ("t0",)), causal=True)
    assert view.decode_reqs_host == (0,) and view.prefill_reqs_host == (1,)


def test_two_groups_one_block_table_get_their_own_splits():
    meta = meta_for([7, 7, 7])
    target = AttentionGroup.from_layers("target", TARGET)
    draft = AttentionGroup.from_layers("draft", DRAFT, supports_non_causal=True, decode_threshold=7)
    d = attention_view(meta, draft, causal=False)
    t = attention_view(meta, target, causal=True)
    assert (d.causal, d.num_decodes, d.num_prefills) == (False, 3, 0)
    assert (t.causal, t.num_decodes, t.num_prefills) == (True, 0, 3)
    # the drafter's view did not change what the target gets from the same metadata
    again = attention_view(meta, target, causal=True)
    assert again.prefill_reqs_host == t.prefill_reqs_host and again.causal


def test_non_causal_needs_the_capability():
    meta = meta_for([7, 7])
    target = AttentionGroup.from_layers("target", TARGET)
    with pytest.raises(UnsupportedCapabilityError, match="supports_non_causal"):
        attention_view(meta, target, causal=False)


def test_non_causal_needs_a_draft_block():
    meta = meta_for([7, 7])
    group = AttentionGroup("t", "target", ("t0",), supports_non_causal=True)
    with pytest.raises(UnsupportedCapabilityError, match="draft block"):
        attention_view(meta, group, causal=False)


@pytest.mark.parametrize("q_lens", [[7, 3], [8, 8], [1]])
def test_non_causal_needs_uniform_draft_blocks(q_lens):
    draft = AttentionGroup.from_layers("draft", DRAFT, supports_non_causal=True)
    with pytest.raises(UnsupportedCapabilityError, match="draft block 7"):
        attention_view(meta_for(q_lens), draft, causal=False)


def test_view_refuses_layers_of_another_block_table():
    stranger = AttentionGroup("x", "target", ("t0", "elsewhere"))
    with pytest.raises(InvalidArgumentError, match="elsewhere"):
        attention_view(meta_for([1]), stranger, causal=True)


def test_view_has_every_field_as_the_constructor_sets_it():
    """attention_view fills the frozen view through its instance dict (no __init__): every
    dataclass field must be set, and the view must equal a constructed one field by field."""
    import dataclasses

    from pagedkv.batch import AttentionView

    meta = meta_for([1, 3, 1])
    view = attention_view(meta, AttentionGroup.from_layers("target", TARGET), causal=True)
    fields = {f.name: getattr(view, f.name) for f in dataclasses.fields(AttentionView)}
    assert fields == {**AttentionView(**fields).__dict__}
    assert (view.decode_reqs_host, view.prefill_reqs_host) == ((0, 2), (1,))
    assert view.decode_reqs.tolist() == [0, 2] and view.num_prefill_tokens == 3
