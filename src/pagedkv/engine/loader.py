"""Build a native model from a Hugging Face checkpoint folder or an in-memory transformers
model: config, architecture -> class (:mod:`pagedkv.modeling.registry`), weights.

Folders: ``config.json`` plus ``model.safetensors``, or shards listed by
``model.safetensors.index.json`` (``weight_map``), or every ``*.safetensors`` file. Tensors
stream shard by shard and convert to the model's dtype as they are copied.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedkv.errors import (
    CheckpointError,
    ConfigError,
    DeviceMemoryError,
    InvalidArgumentError,
    UnsupportedArchitectureError,
    WeightError,
)
from pagedkv.modeling.base import CausalLM
from pagedkv.modeling.registry import architecture_of, config_model_type, model_class

INDEX = "model.safetensors.index.json"


def transformers_config(raw: dict, source: str) -> Any:
    """A transformers config object of config dict ``raw`` (from ``source``, for messages).
    A model_type transformers has no class for is read by its alias's class where pagedkv
    has one (:func:`~pagedkv.modeling.registry.config_model_type`), else refused by name."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(raw, dict):
        raise CheckpointError(f"{source} is not a JSON object")
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")}
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise UnsupportedArchitectureError(f"{source} names no model_type")
    known = config_model_type(model_type)
    if known not in CONFIG_MAPPING:
        import transformers

        raise UnsupportedArchitectureError(
            f"{source}: transformers {transformers.__version__} has no config class for "
            f"model_type {model_type!r}")
    try:
        return CONFIG_MAPPING[known].from_dict(fields)
    except Exception as exc:  # noqa: BLE001 - transformers' checks raise their own classes
        raise ConfigError(f"{source}: transformers cannot build a {known!r} config: "
                          f"{' '.join(str(exc).split())}") from None


def read_config(folder: Path) -> Any:
    """The folder's transformers config (CheckpointError without a readable config.json)."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder")
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json")
    from transformers import PretrainedConfig

    try:  # transformers' reader: it decodes its own JSON tags ({"__float__": "Infinity"})
        raw, _ = PretrainedConfig.get_config_dict(str(folder))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} cannot be read: {exc}") from None
    return transformers_config(raw, str(path))


def weight_files(folder: Path) -> list[Path]:
    """Safetensors files of the checkpoint, in index order (CheckpointError if none)."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index: {exc}") from None
        files = list(dict.fromkeys(weight_map.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards that are absent: {missing[:4]}")
        return [folder / f for f in files]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no *.safetensors weights")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, f.get_tensor(name)
        except SafetensorError as exc:
            raise CheckpointError(f"{path} cannot be read: {exc}") from None


def torch_dtype(name: str | torch.dtype | None, config: Any) -> torch.dtype:
    """The dtype asked for, else the config's (float32 when it names none)."""
    if isinstance(name, torch.dtype):
        return name
    if name is None or name == "auto":
        name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        text = getattr(config, "get_text_config", None)
        if name is None and text is not None:
            name = getattr(text(), "dtype", None)
        if name is None:
            return torch.float32
        if isinstance(name, torch.dtype):
            return name
    key = str(name).removeprefix("torch.")
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if key not in table:
        raise InvalidArgumentError(f"unsupported model dtype {name!r}; use one of {sorted(table)}")
    return table[key]


def build_model(config: Any, weights: Iterator[tuple[str, torch.Tensor]], *,
                device: torch.device, dtype: torch.dtype,
                architecture: str | None = None) -> CausalLM:
    """Native model of ``config``'s architecture on ``device`` in ``dtype``, weights loaded."""
    cls = model_class(architecture or architecture_of(config))
    try:
        with torch.device(device):
            model = cls(config)
    except torch.OutOfMemoryError as exc:
        raise DeviceMemoryError(f"{cls.__name__} does not fit on {device}: {exc}") from None
    except (RuntimeError, TypeError, ValueError, KeyError, IndexError, AttributeError,
            ZeroDivisionError) as exc:  # what torch and the layers raise on a config's
        # impossible sizes (negative, zero heads, more bytes than the machine has)
        raise ConfigError(f"{cls.__name__} cannot be built from this config: "
                          f"{type(exc).__name__}: {exc}") from None
    model.to(dtype=dtype)
    model.requires_grad_(False)  # inference only
    tied = model.tied_weights()
    held: dict[str, torch.Tensor] = {}

    def untied_first() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name in tied:
                held[name] = tensor  # compared once what it aliases is loaded
            else:
                yield name, tensor

    model.load_weights(untied_first())
    for name, tensor in held.items():
        _untie_if_different(model, name, tied[name], tensor)
    return model.eval()


def _untie_if_different(model: CausalLM, name: str, alias_of: str,
                        tensor: torch.Tensor) -> None:
    """A checkpoint that ties ``name`` to ``alias_of`` but stores a different ``name``
    gets its own tensor, untied, with a warning: what transformers does (a tied head
    would silently use the embedding instead of the checkpoint's head)."""
    shared = model.get_parameter(name)
    value = tensor.to(device=shared.device, dtype=shared.dtype)
    _same_shape(name, tuple(value.shape), tuple(shared.shape))
    if torch.equal(value, shared):
        return
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner), leaf, nn.Parameter(value, requires_grad=False))
    warnings.warn(f"the config ties {name} to {alias_of}, but the checkpoint stores a "
                  f"different {name}: it is used, untied (as transformers does)",
                  stacklevel=2)


def _same_shape(name: str, have: tuple[int, ...], need: tuple[int, ...]) -> None:
    """A stored tied tensor (which bypasses ``load_weights``' own check) must fit its
    parameter."""
    if have != need:
        raise WeightError(f"checkpoint tensor {name!r} has shape {have}, "
                          f"parameter {name!r} needs {need}")


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def header_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor's shape, from the files' headers (no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except SafetensorError as exc:
            raise CheckpointError(f"{path} cannot be read: {exc}") from None
    return shapes


def _check_layer_count(config: Any, shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse a config that counts more decoder layers than the checkpoint has tensors
    for, before building them (a config saying 10^12 layers would build for hours)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    wanted = getattr(text, "num_hidden_layers", None)
    if not isinstance(wanted, int):
        return
    found = max((int(m.group(1)) for m in map(_LAYER.search, shapes) if m), default=-1)
    if found >= 0 and wanted > found + 1:
        raise CheckpointError(f"config.json has num_hidden_layers {wanted}, the checkpoint "
                              f"holds tensors of {found + 1} layers")


def _check_shapes(cls: type[CausalLM], config: Any, shapes: dict[str, tuple[int, ...]]) -> None:
    """Load the checkpoint's names and shapes into the model built on the meta device (no
    memory): a config whose sizes disagree with its weights is a :class:`WeightError`
    before any parameter is allocated (hidden_size 65536 over a small checkpoint would
    otherwise take the machine's memory building a model the weights cannot fill). A
    config the meta device cannot build is left to the real build to report."""
    try:
        with torch.device("meta"):
            model = cls(config)
    except Exception:  # noqa: BLE001 - the real build names what is wrong with the config
        return
    tied = model.tied_weights()
    try:
        model.load_weights((name, torch.empty(shape, device="meta"))
                           for name, shape in shapes.items() if name not in tied)
    except (RuntimeError, NotImplementedError):  # a meta-device limit (not a WeightError):
        return  # the real load decides
    for name in tied.keys() & shapes.keys():
        _same_shape(name, shapes[name], tuple(model.get_parameter(name).shape))


def load_folder(folder: str | Path, *, device: torch.device,
                dtype: str | torch.dtype | None = None) -> tuple[Any, CausalLM]:
    folder = Path(folder)
    config = read_config(folder)
    cls = model_class(architecture_of(config))  # unsupported architectures fail before reading
    files = weight_files(folder)
    shapes = header_shapes(files)
    _check_layer_count(config, shapes)
    _check_shapes(cls, config, shapes)
    dt = torch_dtype(dtype, config)
    return config, build_model(config, iter_safetensors(files), device=device, dtype=dt)


def from_transformers(hf_model: Any, *, device: torch.device,
                      dtype: str | torch.dtype | None = None) -> tuple[Any, CausalLM]:
    """Native twin of an in-memory transformers model (its state dict as the checkpoint)."""
    config = hf_model.config
    dt = torch_dtype(dtype, config) if dtype is not None else next(hf_model.parameters()).dtype
    arch = (getattr(config, "architectures", None) or [type(hf_model).__name__])[0]
    state = hf_model.state_dict()
    return config, build_model(config, iter(state.items()), device=device, dtype=dt,
                               architecture=arch)
