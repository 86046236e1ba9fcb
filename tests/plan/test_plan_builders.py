"""Hand-built layer lists shaped like public models (geometry from their config.json), and
hypothesis strategies for random ones; imported by the other test_plan* modules."""

from __future__ import annotations

from hypothesis import strategies as st

from pagedkv.kvspec import (
    Attention,
    AttentionKV,
    ChunkedLocal,
    Cross,
    Full,
    IndexerKV,
    LayerSpec,
    MLALatent,
    Recurrent,
    RecurrentState,
    SlidingWindow,
    StateTensor,
)

GiB = 2**30

# Kimi-K3 KDA state per layer, as the peer harness has it: conv [3, 36864] + [96, 128, 128] fp32
KDA = RecurrentState(
    (StateTensor("conv", (3, 36864), "fp32", 1), StateTensor("ssm", (96, 128, 128), "fp32", 0)),
    "kda",
)
KDA_BYTES = 3 * 36864 * 4 + 96 * 128 * 128 * 4


def full_layer(i: int, layout=None, model: str = "target", prefix: str = "model") -> LayerSpec:
    return LayerSpec(
        f"{prefix}.layers.{i}.self_attn", layout or AttentionKV(8, 128), Full(), model=model, index=i
    )


def llama3_8b() -> list[LayerSpec]:
    """32 full-attention layers, 8 KV heads x 128, bf16."""
    return [full_layer(i) for i in range(32)]


def gpt_oss_120b() -> list[LayerSpec]:
    """36 layers alternating sliding window 128 (even) / full (odd), 8 KV heads x 64."""
    layers = []
    for i in range(36):
        if i % 2 == 0:
            layers.append(LayerSpec(
                f"model.layers.{i}.attn", AttentionKV(8, 64), SlidingWindow(128),
                Attention(window=128, sinks=True), index=i,
            ))
        else:
            layers.append(LayerSpec(
                f"model.layers.{i}.attn", AttentionKV(8, 64), Full(), Attention(sinks=True), index=i
            ))
    return layers


def llama4_scout() -> list[LayerSpec]:
    """48 layers: every 4th full (NoPE), the rest chunked-local 8192; 8 KV heads x 128."""
    return [
        LayerSpec(f"model.layers.{i}.attn", AttentionKV(8, 128), Full(), index=i)
        if i % 4 == 3
        else LayerSpec(
            f"model.layers.{i}.attn", AttentionKV(8, 128), ChunkedLocal(8192),
            Attention(chunk=8192), index=i,
        )
        for i in range(48)
    ]


def deepseek_v3() -> list[LayerSpec]:
    """61 MLA layers: 512 latent + 64 rope, bf16."""
    return [full_layer(i, MLALatent()) for i in range(61)]


def kimi_k3(draft: bool = True) -> list[LayerSpec]:
    """93 layers: MLA every 4th (3, 7, ..., 91) plus the last (92), KDA elsewhere; with the
    DSpark drafter's 5 MLA layers (same latent, non-causal 7-token blocks)."""
    layers = []
    for i in range(93):
        if i % 4 == 3 or i == 92:
            layers.append(full_layer(i, MLALatent()))
        else:
            layers.append(LayerSpec(f"model.layers.{i}.linear_attn", KDA, Recurrent(), index=i))
    if draft:
        for i in range(5):
            layers.append(LayerSpec(
                f"draft.layers.{i}.self_attn", MLALatent(), Full(),
                Attention(causal=False, draft_block=7), model="draft", index=i,
            ))
    return layers


def test_builders_shapes():
    assert len(llama3_8b()) == 32
    assert sum(isinstance(x.retention, SlidingWindow) for x in gpt_oss_120b()) == 18
    assert sum(isinstance(x.retention, ChunkedLocal) for x in llama4_scout()) == 36
    kimi = kimi_k3()
    assert sum(isinstance(x.layout, MLALatent) for x in kimi) == 24 + 5
    assert sum(isinstance(x.retention, Recurrent) for x in kimi) == 69
    assert KDA_BYTES == 6_733_824  # the figure the peer harness and model-facts.md give


# ---------------------------------------------------------------- hypothesis strategies

token_layouts = st.one_of(
    st.builds(
        AttentionKV,
        num_kv_heads=st.sampled_from([1, 2, 4, 8]),
        head_dim=st.sampled_from([64, 80, 96, 128]),
        dtype=st.sampled_from(["bf16", "fp8", "fp32"]),
    ),
    st.builds(MLALatent, format=st.sampled_from(["bf16", "fp8", "fp8_ds_mla"])),
    st.just(IndexerKV()),
)
state_layouts = st.builds(
    lambda heads, dim, conv: RecurrentState(
        (
            StateTensor("conv", (3, conv), "bf16", 1),
            StateTensor("ssm", (heads, dim, dim), "fp32", 0),
        ),
        "mamba2",
    ),
    heads=st.sampled_from([2, 4, 8]),
    dim=st.sampled_from([16, 32, 64]),
    conv=st.sampled_from([64, 96, 256]),
)
retentions = st.one_of(
    st.just(Full()),
    st.builds(SlidingWindow, st.sampled_from([128, 500, 1024, 4096])),
    st.builds(ChunkedLocal, st.sampled_from([1000, 2048, 8192])),
    st.builds(Cross, st.sampled_from([1500, 4096])),
)


@st.composite
def layer_specs(draw, max_layers: int = 24) -> list[LayerSpec]:
    """Target layers (index 0..n-1) then optional drafter layers, every kind mixed."""
    n = draw(st.integers(1, max_layers))
    layers = []
    for i in range(n):
        if draw(st.integers(0, 4)) == 0:
            layers.append(LayerSpec(f"t.{i}.state", draw(state_layouts), Recurrent(), index=i))
        else:
            ret = draw(retentions)
            att = _attention_for(ret)
            layers.append(LayerSpec(f"t.{i}.attn", draw(token_layouts), ret, att, index=i))
    for i in range(draw(st.integers(0, 3))):
        ret = draw(retentions)
        offset = draw(st.sampled_from([0, 0, 1]))
        layers.append(LayerSpec(
            f"d.{i}.attn", draw(token_layouts), ret, _attention_for(ret), model="draft",
            position_offset=offset, index=i,
        ))
    return layers


def _attention_for(ret) -> Attention | None:
    if isinstance(ret, SlidingWindow):
        return Attention(window=ret.window)
    if isinstance(ret, ChunkedLocal):
        return Attention(chunk=ret.chunk)
    return None
