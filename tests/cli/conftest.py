"""The socket server gpudctl's tests talk to: the real server (gpud.api.server) on its own loop in a
thread, answering from tests.api.fakes' handler."""

from __future__ import annotations

import pytest

from tests.api.fakes import ThreadedServer


@pytest.fixture
def daemon():
    srv = ThreadedServer(group=None).start()
    yield srv
    srv.stop()
