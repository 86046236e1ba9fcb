"""The bundled catalog: needed fields of public config.json files, by short lower-case name.

Each ``catalog/<name>.json`` is a config (HF field names, nested ``text_config`` where the
public config has one) plus a ``_pagedkv`` object with a one-line ``description`` and the
``source`` of its numbers.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from importlib import resources

from pagedkv.errors import ConfigError, UnknownModelError

META_KEY = "_pagedkv"


def _dir():
    return resources.files("pagedkv.models") / "catalog"


@lru_cache(maxsize=1)
def _names() -> tuple[str, ...]:
    return tuple(
        sorted(p.name[: -len(".json")] for p in _dir().iterdir() if p.name.endswith(".json"))
    )


def catalog_names() -> list[str]:
    """Sorted short lower-case names of the bundled models."""
    return list(_names())


def is_catalog_name(name: str) -> bool:
    return name.lower() in _names()


@lru_cache(maxsize=None)
def _entry(name: str) -> dict:
    key = name.lower()
    if key not in _names():
        raise UnknownModelError(
            f"{name!r} is not in the catalog; known: {', '.join(_names())}"
        )
    text = (_dir() / f"{key}.json").read_text(encoding="utf-8")
    try:
        entry = json.loads(text)
    except json.JSONDecodeError as exc:  # a broken bundled file: still an explicit error
        raise ConfigError(f"catalog entry {key!r} is malformed JSON: {exc}") from exc
    meta = entry.get(META_KEY) if isinstance(entry, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get("description"), str):
        raise ConfigError(f"catalog entry {key!r} lacks {META_KEY}.description")
    return entry


def catalog_description(name: str) -> str:
    """One line for ``pagedkv models``."""
    return _entry(name)[META_KEY]["description"]


def catalog_source(name: str) -> str:
    """Where the entry's numbers come from (and which are estimates)."""
    return str(_entry(name)[META_KEY].get("source", ""))


def catalog_config(name: str) -> dict:
    """The entry's config fields (a fresh copy, without the ``_pagedkv`` object)."""
    entry = copy.deepcopy(_entry(name))
    entry.pop(META_KEY, None)
    return entry
