"""Shared fixtures."""

from __future__ import annotations

import os

import pytest

# The simulated NVML library skips comparing the host's state after a getter (it only reads); in
# the tests it compares, and a getter that changed the state fails the call (gpud.sim.state).
# Daemons and tools the tests start inherit it.
os.environ.setdefault("GPUD_SIM_CHECK_READS", "1")


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
