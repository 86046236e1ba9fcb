"""Both ways of reading a published config give the same layers: pagedkv's own readers,
and transformers' config class filling the defaults first (skipped without transformers,
and for configs transformers has no class for or cannot build)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest

from pagedkv.errors import ConfigError, UnsupportedArchitectureError
from pagedkv.models import layers_from_config, load_config

pytest.importorskip("transformers")

from pagedkv.models.via_transformers import normalize_config  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "published"
NAMES = sorted(p.name for p in FIXTURES.glob("*.json"))


@lru_cache(maxsize=None)
def _normalized(name: str):
    """transformers' reading of a fixture, or the refusal's message (built once per run)."""
    try:
        return normalize_config(load_config(str(FIXTURES / name)))
    except ConfigError as exc:
        return str(exc)


def _read(config):
    try:
        return layers_from_config(config)
    except UnsupportedArchitectureError:
        return "refused"


@pytest.mark.parametrize("name", NAMES)
def test_own_reading_matches_transformers_defaults(name):
    raw = load_config(str(FIXTURES / name))
    normalized = _normalized(name)
    if isinstance(normalized, str):
        pytest.skip(f"transformers cannot build it: {normalized}")
    own = _read(raw)
    assert own == _read(normalized)
    if own != "refused":
        assert len(own) > 0


def test_fields_at_the_top_level_are_not_replaced_by_text_config_defaults():
    raw = load_config(str(FIXTURES / "stepfun-ai--Step-3.7-Flash.json"))
    normalized = _normalized("stepfun-ai--Step-3.7-Flash.json")
    assert normalized["text_config"]["layer_types"] == raw["layer_types"]


def test_a_model_type_transformers_does_not_know_is_refused_by_name():
    with pytest.raises(UnsupportedArchitectureError, match="no_such_model"):
        normalize_config({"model_type": "no_such_model"})


def test_at_least_twenty_fixtures_are_compared():
    assert sum(not isinstance(_normalized(name), str) for name in NAMES) >= 20
