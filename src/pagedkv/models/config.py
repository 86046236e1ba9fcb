"""Loading a model config from a catalog name, a config.json, a checkpoint folder or a dict."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path

from pagedkv.errors import ConfigError, UnknownModelError
from pagedkv.models.catalog import catalog_config, catalog_names, is_catalog_name

Source = str | os.PathLike | Mapping


def _looks_like_path(text: str) -> bool:
    return os.sep in text or "/" in text or text.endswith(".json") or text.startswith("~")


def read_config_file(path: Path) -> dict:
    """Parse one config.json; ConfigError with file, line and column when malformed."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read model config {str(path)!r}: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"model config {str(path)!r} is malformed JSON: {exc.msg} "
            f"(line {exc.lineno}, column {exc.colno})"
        ) from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"model config {str(path)!r} must hold a JSON object, got {type(data).__name__}"
        )
    return data


def config_path(source: str | os.PathLike) -> Path | None:
    """The config.json a path names (itself, or ``config.json`` inside a folder); None if
    the source is a catalog name."""
    text = os.fspath(source)
    if not _looks_like_path(text) and is_catalog_name(text):
        return None
    path = Path(text).expanduser()
    if path.is_dir():
        inside = path / "config.json"
        if not inside.is_file():
            raise UnknownModelError(f"folder {text!r} has no config.json")
        return inside
    if not path.is_file():
        raise UnknownModelError(
            f"{text!r} is neither a catalog model ({', '.join(catalog_names())}) "
            "nor an existing config file or checkpoint folder"
        )
    return path


def load_config(source: Source) -> dict:
    """A config dict from a catalog name, a config.json path, a checkpoint folder or a dict.

    Names without a path separator are looked up in the catalog first; anything else is a
    path. The result is a fresh copy: callers may change it freely.
    """
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(
            f"a model is a catalog name, a path or a config dict, got {type(source).__name__}"
        )
    path = config_path(source)
    if path is None:
        return catalog_config(os.fspath(source))
    return read_config_file(path)


def source_name(source: Source, config: Mapping) -> str:
    """A short name for reports: the catalog name, the checkpoint folder, or the file stem."""
    if isinstance(source, Mapping):
        raw = config.get("_name_or_path") or config.get("model_type") or "model"
        return str(raw).rstrip("/").rsplit("/", 1)[-1]
    text = os.fspath(source)
    path = config_path(source)
    if path is None:
        return text.lower()
    if path.name == "config.json":
        return path.resolve().parent.name
    return path.stem
