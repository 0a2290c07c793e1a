"""Hand-made hosts for layout tests (tests/support/gpus.py)."""

from __future__ import annotations

import pytest

from gpud.model import Gpu
from tests.support.gpus import host


@pytest.fixture
def h100x8() -> list[Gpu]:
    return host(*["h100-80gb"] * 8)


@pytest.fixture
def h200x8() -> list[Gpu]:
    return host(*["h200"] * 8)
