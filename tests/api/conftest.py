"""Every client connection a test opened is closed on its own loop when it ends, also when it
failed half-way (an open one would be a ResourceWarning, and warnings are errors)."""

from __future__ import annotations

import pytest

from tests.support.api import Conn


@pytest.fixture(autouse=True)
async def _connections_closed():
    yield
    await Conn.close_all()
