"""A target model and its optional drafter, read into one ModelSpec."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pagedkv.errors import ConfigError
from pagedkv.kvspec import TARGET, LayerSpec
from pagedkv.models.attention import resolve_kv_dtype
from pagedkv.models.config import Source, load_config, source_name
from pagedkv.models.drafters import DRAFT, MODEL, drafter_role, mtp_layers, num_mtp_layers
from pagedkv.models.fields import need_int, text_config
from pagedkv.models.layers import layers_from_config
from pagedkv.models.weights import estimate_weight_bytes, mtp_weight_bytes

MTP = "mtp"


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a model (and its drafter)."""

    name: str
    config: dict = field(hash=False)  # the loaded config, as read
    draft_name: str | None
    layers: tuple[LayerSpec, ...]  # target layers, then drafter layers (model="draft")
    max_position_embeddings: int  # the default max_model_len
    weight_bytes: int  # estimate for target + drafter, all ranks together

    @property
    def target_layers(self) -> tuple[LayerSpec, ...]:
        return tuple(layer for layer in self.layers if layer.model == TARGET)

    @property
    def draft_layers(self) -> tuple[LayerSpec, ...]:
        return tuple(layer for layer in self.layers if layer.model != TARGET)


def max_position_embeddings(config: Mapping) -> int:
    return need_int(
        text_config(config),
        "max_position_embeddings", "model_max_length", "max_seq_len", "seq_length",
        why="the default max_model_len",
    )


def load_model(target: Source, draft: Source | None = None, *, kv_dtype: str = "auto") -> ModelSpec:
    """Read a target (catalog name, config path, checkpoint folder or dict) and an optional
    drafter: another such source, or ``"mtp"`` for the target's own MTP layers.

    ``kv_dtype="auto"`` stores every KV cache -- the drafter's too -- in the target's
    dtype, as engines run a drafter in the target's dtype.
    """
    config = load_config(target)
    text = text_config(config)
    role = drafter_role(text)
    if role.kind != MODEL:
        raise ConfigError(
            f"{source_name(target, config)!r} is a {role.kind} drafter config; pass it as "
            "the draft of a target model"
        )
    fmt = resolve_kv_dtype(text, kv_dtype)
    layers = layers_from_config(config, kv_dtype=fmt)
    weights = estimate_weight_bytes(config)
    draft_name = None
    if isinstance(draft, str) and draft.strip().lower() == MTP:
        if num_mtp_layers(config) <= 0:
            raise ConfigError(
                f"{source_name(target, config)!r} has no MTP layers (num_nextn_predict_layers "
                "is 0 or absent), so it cannot draft with mtp"
            )
        layers += mtp_layers(config, kv_dtype=fmt, model=DRAFT)
        weights += mtp_weight_bytes(config)
        draft_name = MTP
    elif draft is not None:
        draft_config = load_config(draft)
        layers += layers_from_config(draft_config, model=DRAFT, kv_dtype=fmt)
        weights += estimate_weight_bytes(draft_config)
        draft_name = source_name(draft, draft_config)
    return ModelSpec(
        name=source_name(target, config),
        config=config,
        draft_name=draft_name,
        layers=layers,
        max_position_embeddings=max_position_embeddings(text),
        weight_bytes=weights,
    )
