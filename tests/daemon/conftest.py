"""A real gpud process on a simulated host, driven through the real gpudctl (tests/support/daemon.py)."""

from __future__ import annotations

import pytest

from tests.support.daemon import Daemon


@pytest.fixture
def daemon(tmp_path):
    made: list[Daemon] = []

    def make(gpus: list[str], layout: str, *extra: str, nvswitch: bool = False, vgpu: str | None = None,
             persistence: str = "legacy", fabric_manager: str = "running") -> Daemon:
        d = Daemon(tmp_path / f"d{len(made)}", gpus, layout, list(extra), nvswitch=nvswitch, vgpu=vgpu,
                   persistence=persistence, fabric_manager=fabric_manager)
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()
