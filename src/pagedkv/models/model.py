"""A target model and its optional drafter, read into one ModelSpec."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pagedkv.errors import ConfigError
from pagedkv.kvspec import TARGET, LayerSpec
from pagedkv.models.attention import resolve_kv_dtype
from pagedkv.models.compat import check_drafter
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
    max_position_embeddings: int | None  # the default max_model_len (None: the config has none)
    weight_bytes: int | None  # estimate for target + drafter, all ranks (None: cannot estimate)
    # why a None above is None: raised only when a question needs the value
    missing: dict = field(default_factory=dict, hash=False, compare=False)

    def need_weight_bytes(self) -> int:
        """The weight estimate, or the ConfigError saying which field it lacks."""
        if self.weight_bytes is None:
            raise ConfigError(f"cannot estimate the weights: {self.missing['weights']} "
                              "(give --memory, or --weights with --gpu)")
        return self.weight_bytes

    def need_max_position_embeddings(self) -> int:
        """The config's context length, or the ConfigError saying it has none."""
        if self.max_position_embeddings is None:
            raise ConfigError(f"{self.missing['max_position_embeddings']}; give --max-model-len")
        return self.max_position_embeddings

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


def _try(missing: dict, key: str, compute):
    """``compute()``, or None with the ConfigError's message kept under ``missing[key]``:
    weight-only and context-length fields are needed only by the questions that use them."""
    try:
        return compute()
    except ConfigError as exc:
        missing[key] = str(exc)
        return None


def _load(source: Source, via_transformers: bool) -> dict:
    config = load_config(source)
    if via_transformers:
        from pagedkv.models.via_transformers import normalize_config

        config = normalize_config(config)
    return config


def load_model(target: Source, draft: Source | None = None, *, kv_dtype: str = "auto",
               via_transformers: bool = False) -> ModelSpec:
    """Read a target (catalog name, config path, checkpoint folder or dict) and an optional
    drafter: another such source, or ``"mtp"`` for the target's own MTP layers.

    ``kv_dtype="auto"`` stores every KV cache -- the drafter's too -- in the target's
    dtype, as engines run a drafter in the target's dtype. Layer geometry must be readable;
    the weight estimate and ``max_position_embeddings`` may be missing (None, see
    :meth:`ModelSpec.need_weight_bytes`). A drafter that cannot belong to the target raises
    :class:`~pagedkv.errors.IncompatibleDrafterError`. ``via_transformers`` first
    normalizes each config through transformers' own config class
    (:mod:`pagedkv.models.via_transformers`; needs transformers).
    """
    config = _load(target, via_transformers)
    text = text_config(config)
    role = drafter_role(text)
    if role.kind != MODEL:
        raise ConfigError(
            f"{source_name(target, config)!r} is a {role.kind} drafter config; pass it as "
            "the draft of a target model"
        )
    fmt = resolve_kv_dtype(text, kv_dtype)
    layers = layers_from_config(config, kv_dtype=fmt)
    missing: dict = {}
    parts = [_try(missing, "weights", lambda: estimate_weight_bytes(config))]
    draft_name = None
    if isinstance(draft, str) and draft.strip().lower() == MTP:
        if num_mtp_layers(config) <= 0:
            raise ConfigError(
                f"{source_name(target, config)!r} has no MTP layers (num_nextn_predict_layers "
                "is 0 or absent), so it cannot draft with mtp"
            )
        layers += mtp_layers(config, kv_dtype=fmt, model=DRAFT)
        parts.append(_try(missing, "weights", lambda: mtp_weight_bytes(config)))
        draft_name = MTP
    elif draft is not None:
        draft_config = _load(draft, via_transformers)
        draft_name = source_name(draft, draft_config)
        check_drafter(config, draft_config, source_name(target, config), draft_name)
        layers += layers_from_config(draft_config, model=DRAFT, kv_dtype=fmt)
        parts.append(_try(missing, "weights", lambda: estimate_weight_bytes(draft_config)))
    return ModelSpec(
        name=source_name(target, config),
        config=config,
        draft_name=draft_name,
        layers=layers,
        max_position_embeddings=_try(
            missing, "max_position_embeddings", lambda: max_position_embeddings(text)),
        weight_bytes=None if "weights" in missing else sum(parts),
        missing=missing,
    )
