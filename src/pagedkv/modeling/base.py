"""The contract between the engine's model runner and native model code.

One step, as the runner drives it (``pagedkv.engine``):

1. the scheduler picks requests and token counts; the block manager allocates and hands
   back block tables (one per block-table group) and the step's copy ops
   (``KVCacheManager.drain_copy_ops``);
2. the runner applies the ``copy`` ops (K/V block copies) and the ``restore`` ops
   (recurrent checkpoint -> request slot) to the cache tensors *before* the forward;
3. the runner builds :class:`ForwardContext`: every attention group's metadata
   (``pagedkv.batch``: a persistent builder, or ``build_metadata``; padded to a bucket
   in the former: rows past ``num_reqs`` / ``num_tokens`` are padding), every recurrent group's segments
   (``RecurrentBatch.build(requests, gid, copy_ops)``: the model writes ``save`` states
   itself, they can fall mid-chunk), the per-layer cache tensors (views into the plan's
   pools), and the layer specs;
4. ``hidden = model(input_ids [T], positions [T], ctx)`` with the step's token rows packed
   request after request (rows of request i are ``query_start_loc[i]:[i + 1]``);
5. ``logits = model.compute_logits(hidden[rows])`` for the rows that are sampled (or all
   rows, when logits are checked).

Within a step, each attention layer writes the K/V (or latent) of *every* request's rows
before any request of the step attends in that layer (write the whole batch, then attend):
the block manager relies on it when one request of a step hits whole blocks that another
request of the same step fills (docs/blocks.md, "unwritten" blocks). Drafters that write
their own rows keep the same order.

A model never allocates, frees or zeroes cache memory, never reads a page it was not given
(fresh pages hold NaN in the tests), and takes its attention mask from its layers'
:class:`~pagedkv.kvspec.LayerSpec` (``ctx.attend``), so the block manager's retention and
the kernel's mask cannot disagree. Layer names are those of
:func:`pagedkv.models.layers_from_config` (``model.layers.{i}.self_attn``,
``.linear_attn``, ``.mamba``...); the native module tree uses the same names.

Attention goes through one seam, :class:`AttentionBackend` (``ctx.attend``): the torch
reference ops today, fast kernels later, without touching model code.

Building a model: ``cls(config)`` with a transformers ``PretrainedConfig`` (the text config
for multimodal checkpoints), then ``model.load_weights(iterable of (checkpoint name,
tensor))``: names are mapped by :meth:`CausalLM.weight_name` and checked (unknown names,
missing parameters and misshapen tensors raise :class:`~pagedkv.errors.WeightError`).
The registry (:mod:`pagedkv.modeling.registry`) maps a config's ``architectures[0]`` to
its class.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import nn

from pagedkv.batch import GroupMetadata, ScheduledRequest
from pagedkv.blocks import CopyOp
from pagedkv.errors import MetadataError, WeightError
from pagedkv.kvspec import LayerSpec
from pagedkv.ops import Mask, paged_attention, write_kv

if TYPE_CHECKING:
    from pagedkv.modeling.recurrent_state import RecurrentBatch

Tensors = Mapping[str, torch.Tensor]
# buffers some older checkpoints saved although every model recomputes them
COMPUTED_BUFFERS = ("rotary_emb.inv_freq",)


class AttentionBackend(Protocol):
    """Writes one layer's new K/V rows and attends over the paged cache (the kernel seam)."""

    def __call__(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, Dv]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: GroupMetadata,
        *,
        mask: Mask,
        scale: float,
        soft_cap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:  # [T, Hq, Dv]
        ...


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: GroupMetadata,
    *,
    mask: Mask,
    scale: float,
    soft_cap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The torch reference ops: write through the slot mapping, attend through the table."""
    t = q.shape[0]
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping[:t])
    return paged_attention(
        q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_table,
        mask=mask, scale=scale, soft_cap=soft_cap, sinks=sinks,
    )


@dataclass(frozen=True, eq=False)
class ForwardContext:
    """What a model's layers read during one forward, by layer name.

    ``groups``: layer name -> block-table group id (every cache-holding layer);
    ``specs``: layer name -> LayerSpec (masks, soft-cap, scale come from here);
    ``metadata``: group id -> this step's metadata (attention groups only);
    ``caches``: layer name -> its cache tensors by the plan's tensor names
    (``k``/``v`` [blocks, block_size, Hkv, D]; ``latent`` [blocks, block_size, E];
    recurrent ``conv``/``ssm``/``recurrent``... [slots, ...]);
    ``batches``: group id -> the step's recurrent segments (recurrent groups only);
    ``requests``: the step's scheduled requests, in row order (the engine's persistent
    metadata path gives only recurrent groups' block ids here, and no requests at all
    without recurrent groups: attention groups' tables are in ``metadata``);
    ``copy_ops``: the step's drained copy ops (already applied except ``save``);
    ``causal``: this invocation's causality (False only for non-causal drafter passes);
    ``backend``: the attention seam.
    """

    groups: Mapping[str, int]
    specs: Mapping[str, LayerSpec]
    metadata: Mapping[int, GroupMetadata]
    caches: Mapping[str, Tensors]
    batches: Mapping[int, RecurrentBatch] = field(default_factory=dict)
    requests: Sequence[ScheduledRequest] = ()
    copy_ops: Sequence[CopyOp] = ()
    causal: bool = True
    backend: AttentionBackend = field(default=reference_attention)

    def group_of(self, layer: str) -> int:
        gid = self.groups.get(layer)
        if gid is None:
            raise MetadataError(f"layer {layer!r} is in no block-table group of the plan")
        return gid

    def meta(self, layer: str) -> GroupMetadata:
        gid = self.group_of(layer)
        meta = self.metadata.get(gid)
        if meta is None:
            raise MetadataError(f"layer {layer!r}: group {gid} has no attention metadata this step")
        return meta

    def cache(self, layer: str) -> Tensors:
        tensors = self.caches.get(layer)
        if tensors is None:
            raise MetadataError(f"layer {layer!r} has no cache tensors")
        return tensors

    def attention(self, layer: str) -> tuple[GroupMetadata, torch.Tensor, torch.Tensor]:
        """(metadata, K cache, V cache) of a GQA/MHA layer."""
        tensors = self.cache(layer)
        return self.meta(layer), tensors["k"], tensors["v"]

    def recurrent(self, layer: str) -> tuple[RecurrentBatch, Tensors]:
        """(segments, state tensors) of a recurrent layer."""
        gid = self.group_of(layer)
        batch = self.batches.get(gid)
        if batch is None:
            raise MetadataError(f"layer {layer!r}: group {gid} has no recurrent batch this step")
        return batch, self.cache(layer)

    def mask(self, layer: str) -> Mask:
        """The mask this invocation uses for ``layer`` (from its LayerSpec)."""
        spec = self.specs.get(layer)
        if spec is None or spec.attention is None:
            raise MetadataError(f"layer {layer!r} has no attention spec")
        return Mask.of(spec.attention, causal=None if self.causal else False)

    def attend(
        self,
        layer: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write k/v [T, Hkv, D] of ``layer`` and attend q [T, Hq, D] -> [T, Hq, Dv].

        Mask, soft-cap and (unless given) scale come from the layer's spec; ``sinks`` are
        the model's per-head sink logits (weights, so the model passes them).
        """
        spec = self.specs[layer]
        att = spec.attention
        if att is None:
            raise MetadataError(f"layer {layer!r} does not attend")
        meta, k_cache, v_cache = self.attention(layer)
        if scale is None:
            scale = att.scale if att.scale is not None else q.shape[-1] ** -0.5
        return self.backend(
            q, k, v, k_cache, v_cache, meta,
            mask=self.mask(layer), scale=scale, soft_cap=att.soft_cap, sinks=sinks,
        )


class CausalLM(nn.Module):
    """Base of native models: packed rows in, hidden states out, logits on demand.

    Subclasses set ``architectures`` (the HF ``architectures`` names they serve), build
    their modules with the checkpoint's parameter names in ``__init__(config)``, and
    implement :meth:`forward` and :meth:`compute_logits`. Override :meth:`weight_name` to
    map or skip checkpoint names, :meth:`load_weights` for fused or per-expert tensors.
    """

    architectures: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions int64 [T] -> hidden [T, hidden_size]."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab] (soft-capped where configured)."""
        raise NotImplementedError

    @classmethod
    def layer_specs(cls, config: Any, *, kv_dtype: str = "auto") -> tuple[LayerSpec, ...]:
        """The model's cache-holding layers, read from its config by ``pagedkv.models``."""
        from pagedkv.models import layers_from_config

        raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        return layers_from_config(raw, kv_dtype=kv_dtype)

    def weight_name(self, name: str) -> str | None:
        """Parameter name for a checkpoint tensor name; None skips the tensor."""
        return name

    def tied_weights(self) -> dict[str, str]:
        """Parameters that may be absent from a checkpoint because they alias another
        (``lm_head.weight`` -> ``model.embed_tokens.weight`` with tied embeddings)."""
        if getattr(self.config, "tie_word_embeddings", False):
            return {"lm_head.weight": "model.embed_tokens.weight"}
        return {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into parameters (converting dtype, onto their device).

        Raises :class:`WeightError` for a name that maps to no parameter, a misshapen
        tensor, or a parameter the checkpoint does not provide. Returns loaded names.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        params.update(dict(self.named_buffers()))
        loaded: set[str] = set()
        for name, tensor in weights:
            target = None if name.endswith(COMPUTED_BUFFERS) else self.weight_name(name)
            if target is None:
                continue
            param = params.get(target)
            if param is None:
                raise WeightError(f"checkpoint tensor {name!r} matches no parameter of "
                                  f"{type(self).__name__} (mapped to {target!r})")
            if tuple(param.shape) != tuple(tensor.shape):
                raise WeightError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"parameter {target!r} needs {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor.to(dtype=param.dtype))
            loaded.add(target)
        check_loaded(self, loaded)
        return loaded


def check_loaded(model: CausalLM, loaded: set[str]) -> None:
    """Raise :class:`WeightError` naming parameters no checkpoint tensor filled."""
    tied = model.tied_weights()
    missing = sorted(
        name for name, _ in model.named_parameters(remove_duplicate=False)
        if name not in loaded and tied.get(name) not in loaded
    )
    if missing:
        raise WeightError(f"checkpoint lacks {len(missing)} tensors of {type(model).__name__}: "
                          f"{missing[:6]}{' ...' if len(missing) > 6 else ''}")
