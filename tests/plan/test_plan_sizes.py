"""parse_size, format_bytes, the GPU table and budget_from_gpu."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.errors import DoesNotFitError, InvalidArgumentError
from pagedkv.plan import GPUS, budget_from_gpu, find_gpu, format_bytes, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("80GiB", 80 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("1.5TB", 1_500_000_000_000),
        ("40GB", 40_000_000_000),
        ("1234", 1234),
        ("1234B", 1234),
        (" 40 GiB ", 40 * 1024**3),
        ("2kib", 2048),
        ("3KB", 3000),
        ("0.5GiB", 512 * 1024**2),
        ("1_000", 1000),
        ("0", 0),
        ("2TiB", 2 * 1024**4),
        ("0.1B", 0),  # fractions of a byte are dropped
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "abc", "40G", "40 gigs", "1.2.3GB", "-5GiB", "nan"])
def test_parse_size_rejects(text):
    with pytest.raises(InvalidArgumentError) as info:
        parse_size(text)
    assert repr(text) in str(info.value)  # the message names the offending text


@given(st.integers(0, 2**60))
def test_parse_size_round_trips_integers(n):
    assert parse_size(str(n)) == n
    assert parse_size(f"{n}MiB") == n * 2**20


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(40 * 2**30) == "40.0 GiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**40) == "3.0 TiB"


def test_gpu_table_has_the_usual_parts():
    for name in ("h100", "h200", "a100-80gb", "a100-40gb", "l40s", "b200", "mi300x"):
        assert name in GPUS
    # totals as the driver reports them: an "80GB" A100 shows 81920 MiB, an H200 143771 MiB
    assert GPUS["a100-80gb"].memory_bytes == 81920 * 2**20
    assert GPUS["h200"].memory_bytes == 143771 * 2**20
    assert find_gpu(" H200 ") is GPUS["h200"]


def test_budget_from_gpu():
    memory = 143771 * 2**20
    assert budget_from_gpu("h200", 0.9, 0) == int(memory * 0.9)
    assert budget_from_gpu("h200", 0.9, 10**9) == int(memory * 0.9) - 10**9
    assert budget_from_gpu("H100", 1.0, 0) == 81559 * 2**20


@pytest.mark.parametrize("utilization", [0, -0.1, 1.01, float("nan")])
def test_budget_from_gpu_rejects_utilization(utilization):
    with pytest.raises(InvalidArgumentError, match="utilization"):
        budget_from_gpu("h100", utilization, 0)


def test_budget_from_gpu_errors():
    with pytest.raises(InvalidArgumentError, match="unknown GPU 'h900'.*h100"):
        budget_from_gpu("h900", 0.9, 0)
    with pytest.raises(InvalidArgumentError, match="weight bytes"):
        budget_from_gpu("h100", 0.9, -1)
    with pytest.raises(DoesNotFitError, match="weights"):
        budget_from_gpu("a100-40gb", 0.9, 40 * 2**30)
