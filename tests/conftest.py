"""Shared fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture
def sim_host(tmp_path):
    """Factory for simulated hosts with the fake NVML installed in pynvml:
    `sim_host("h200:2", "l40s", mig_on=[0])` -> gpud.sim.SimHost (host_dir under tmp_path).
    Every host it made is uninstalled at teardown."""
    from gpud import sim
    from gpud.sim.cli import create

    made: list[sim.SimHost] = []

    def make(*gpus: str, mig_on=()) -> sim.SimHost:
        d = tmp_path / f"simhost{len(made)}"
        create(d, list(gpus) or ["h200"], list(mig_on))
        host = sim.install(d)
        made.append(host)
        return host

    yield make
    for _ in made:
        sim.uninstall()
