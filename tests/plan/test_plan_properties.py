"""Hypothesis properties of make_plan over random mixes of layouts, retentions and drafters."""

from __future__ import annotations

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_plan_builders import layer_specs

from pagedkv.errors import DoesNotFitError
from pagedkv.kvspec import TARGET, block_table_compatibility, bytes_per_request, bytes_per_token
from pagedkv.plan import PlanOptions, make_plan

SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

options_st = st.builds(
    PlanOptions,
    budget_bytes=st.integers(2**33, 2**37),
    max_model_len=st.integers(1, 32768),
    block_size=st.sampled_from([None, 16, 32, 64]),
    max_batched_tokens=st.sampled_from([256, 2048, 8192]),
)


def _plan(layers, options):
    try:
        return make_plan(layers, options)
    except DoesNotFitError:
        assume(False)


def _pool_of(group):
    return group.id if group.pool is None else group.pool


def check_invariants(plan, layers, options):
    """Everything a valid plan must satisfy; used by several properties."""
    bs = plan.groups[0].block_size
    # every layer in exactly one group
    names = [name for g in plan.groups for name in g.layer_names]
    assert sorted(names) == sorted(layer.name for layer in layers)
    assert len(set(names)) == len(names)
    # a group never mixes retentions or positions; different groups could not share
    for g in plan.groups:
        assert g.block_size == bs
        for layer in g.layers:
            assert layer.retention == g.retention
            assert layer.position_offset == g.position_offset
            assert block_table_compatibility(g.layers[0], layer, bs, bs)
        assert g.models == tuple(dict.fromkeys(layer.model for layer in g.layers))
    for a in plan.groups:
        for b in plan.groups:
            if a.id != b.id:
                assert not block_table_compatibility(a.layers[0], b.layers[0], bs, bs)
    # drafter layers with the target's retention and positions share the target's group
    group_of = {name: g.id for g in plan.groups for name in g.layer_names}
    for d in layers:
        if d.model == TARGET:
            continue
        for t in layers:
            if t.model == TARGET and (t.retention, t.position_offset) == (
                d.retention, d.position_offset
            ):
                assert group_of[d.name] == group_of[t.name]
    # views inside their pool, aligned, never overlapping; pools within the budget
    by_name = {layer.name: layer for layer in layers}
    groups = {g.id: g for g in plan.groups}
    for rank in plan.ranks:
        pools = {p.id: p for p in rank.pools}
        assert sum(p.nbytes for p in rank.pools) == rank.used_bytes <= plan.budget_bytes
        spans: dict[int, list[tuple[int, int]]] = {}
        aliases = []
        for v in rank.views:
            assert v.offset % 256 == 0 and v.offset >= 0
            assert v.offset + v.nbytes <= pools[v.pool].nbytes
            g = groups[group_of[v.layer]]
            assert g.id in pools[v.pool].group_ids and _pool_of(g) == v.pool
            assert g.num_blocks == pools[v.pool].num_pages
            lead = (g.num_blocks,) if g.is_recurrent else (g.num_blocks, bs)
            assert v.shape[: len(lead)] == lead
            if g.id == v.pool:  # the pool's first group owns its spans
                spans.setdefault(v.pool, []).append((v.offset, v.offset + v.nbytes))
            else:
                aliases.append(v)
        for ranges in spans.values():
            ranges.sort()
            for (_, end), (start, _) in zip(ranges, ranges[1:]):
                assert end <= start
        # views never overlap except declared aliases: a layer of another group of a shared
        # pool takes exactly the span, shape and dtype of a layer of the pool's first group,
        # and each such span once per group
        owned = {(v.pool, v.offset): v for v in rank.views if group_of[v.layer] == v.pool}
        taken: set[tuple[int, int, int]] = set()
        for v in aliases:
            owner = owned[(v.pool, v.offset)]
            assert (owner.shape, owner.dtype) == (v.shape, v.dtype)
            key = (group_of[v.layer], v.pool, v.offset)
            assert key not in taken
            taken.add(key)
        for p in rank.pools:
            members = [groups[gid] for gid in p.group_ids]
            if len(members) > 1:  # sharing: token groups whose layers pair up
                assert not any(m.is_recurrent for m in members)
                assert len({len(m.layers) for m in members}) == 1
        # each layer's views hold exactly its (sharded) bytes for its group's blocks
        per_layer: dict[str, int] = {}
        for v in rank.views:
            per_layer[v.layer] = per_layer.get(v.layer, 0) + v.nbytes
        for name, nbytes in per_layer.items():
            layer = by_name[name]
            layout = layer.layout.shard(options.tp)
            g = groups[group_of[name]]
            if g.is_recurrent:
                assert nbytes == g.num_blocks * bytes_per_request(layout)
            else:
                assert nbytes == g.num_blocks * bs * bytes_per_token(layout)
    # capacity: at least one request; every group holds max_concurrency requests
    cap = plan.capacity
    assert cap.max_concurrency >= 1
    exact = cap.max_concurrency * options.max_model_len  # tokens = floor(exact), float-safe
    assert cap.tokens <= exact * (1 + 1e-12) and cap.tokens + 1 > exact * (1 - 1e-12)
    by_pool: dict[int, list] = {}
    for g in plan.groups:
        by_pool.setdefault(_pool_of(g), []).append(g)
    for members in by_pool.values():
        g = members[0]
        if g.is_recurrent:
            assert g.num_blocks >= cap.max_concurrency
            continue
        # one null block per pool serving a windowed group; requests of the pool's groups
        # hold sum b_g pages each, the step sum s_g once
        windowed = any(m.retention.kind in ("sliding_window", "chunked_local") for m in members)
        assert all(m.reserved_blocks == windowed for m in members)
        assert len({m.num_blocks for m in members}) == 1
        step = sum(m.step_blocks for m in members)
        held = (g.num_blocks - g.reserved_blocks - step) / sum(
            m.blocks_per_request for m in members
        )
        assert held >= cap.max_concurrency * (1 - 1e-12)
    assert 0 <= plan.padding_bytes <= plan.budget_bytes
    assert [a.name for a in plan.alternatives] == ["vllm"]


@SETTINGS
@given(layers=layer_specs(), options=options_st)
def test_plan_invariants(layers, options):
    plan = _plan(layers, options)
    check_invariants(plan, layers, options)


@SETTINGS
@given(layers=layer_specs(max_layers=12), options=options_st, extra=st.integers(1, 2**34))
def test_monotone_in_budget(layers, options, extra):
    small = _plan(layers, options)
    large = make_plan(
        layers,
        PlanOptions(
            options.budget_bytes + extra,
            options.max_model_len,
            options.block_size,
            options.max_batched_tokens,
        ),
    )
    assert large.capacity.max_concurrency >= small.capacity.max_concurrency
    assert large.capacity.tokens >= small.capacity.tokens


@SETTINGS
@given(layers=layer_specs(max_layers=12), options=options_st)
def test_plan_is_deterministic_and_order_follows_first_appearance(layers, options):
    a = _plan(layers, options)
    b = make_plan(list(layers), options)
    assert a == b
    first = [min(layers.index(layer) for layer in g.layers) for g in a.groups]
    assert first == sorted(first)
