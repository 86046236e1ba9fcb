"""Hand-built block-table groups (shapes of real models) shared by the block-manager,
simulator and engine tests. Lives at the tests root so any folder can import it."""

from __future__ import annotations

from pagedkv.kvspec import (
    Attention,
    AttentionKV,
    ChunkedLocal,
    Full,
    LayerSpec,
    MLALatent,
    Recurrent,
    RecurrentState,
    SlidingWindow,
    StateTensor,
    blocks_per_request,
    step_blocks,
)
from pagedkv.plan.types import Group


def _layer(name, retention, *, model="target", offset=0, draft_block=None, mla=False):
    if isinstance(retention, Recurrent):
        layout = RecurrentState((StateTensor("s", (4, 8, 8)),), family="kda")
        return LayerSpec(name, layout, retention, None, model, offset)
    if isinstance(retention, SlidingWindow):
        att = Attention(window=retention.window)
    elif isinstance(retention, ChunkedLocal):
        att = Attention(chunk=retention.chunk)
    elif draft_block:
        att = Attention(causal=False, draft_block=draft_block)
    else:
        att = Attention()
    layout = MLALatent() if mla else AttentionKV(8, 128)
    return LayerSpec(name, layout, retention, att, model, offset)


def group(gid, retention, block_size, num_blocks, *, offset=0, layers=None,
          max_model_len=4096, max_batched_tokens=256, models=("target",)):
    layers = layers or (_layer(f"l{gid}", retention, offset=offset),)
    return Group(
        id=gid, layers=tuple(layers), retention=retention, block_size=block_size,
        position_offset=offset, models=tuple(models),
        bytes_per_token=sum(lay.bytes_per_token for lay in layers),
        bytes_per_request=sum(lay.bytes_per_request for lay in layers),
        num_blocks=num_blocks,
        blocks_per_request=blocks_per_request(retention, max_model_len, block_size),
        step_blocks=step_blocks(retention, max_batched_tokens, block_size),
    )


def full_only(num_blocks=64, bs=4):
    return [group(0, Full(), bs, num_blocks)]


def gpt_oss_like(num_blocks=64, bs=4, window=8):
    """Alternating sliding-window / full layers: two groups."""
    return [group(0, Full(), bs, num_blocks), group(1, SlidingWindow(window), bs, num_blocks)]


def kimi_dspark_like(num_blocks=64, bs=4, draft_block=3, slots=8, checkpoint_every=2):
    """Kimi-K3 + DSpark: one MLA group shared by target and draft layers (draft layers
    with a non-causal draft block) and a recurrent KDA group with checkpoints."""
    mla = (_layer("t.mla0", Full(), mla=True), _layer("t.mla1", Full(), mla=True),
           _layer("d.mla0", Full(), model="dspark", draft_block=draft_block, mla=True))
    rec = Recurrent(checkpoint_every)
    return [group(0, Full(), bs, num_blocks, layers=mla, models=("target", "dspark")),
            group(1, rec, bs, slots)]


def deepseek_mtp_like(num_blocks=64, bs=4):
    """DeepSeek-V3 + MTP: the MTP layer writes position i from token i+1 (offset 1)."""
    return [group(0, Full(), bs, num_blocks),
            group(1, Full(), bs, num_blocks, offset=1,
                  layers=(_layer("mtp.0", Full(), model="mtp", offset=1),), models=("mtp",))]
