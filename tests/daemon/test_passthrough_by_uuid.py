"""Issue 29 item 2: a GPU named by UUID for vm-passthrough stays selected after it left NVML (on
vfio-pci NVML does not see it): a reload, a daemon restart and a host reboot (`gpud-sim reboot`:
the udev rule binds it to vfio-pci before gpud starts) all keep the layout valid and converged.
The UUID comes from the simulator's own state file, not from gpud."""

from __future__ import annotations

import pytest

from tests.scenarios.definitions import layout

pytestmark = pytest.mark.daemon

GPU1 = "0000:2a:00.0"


def _valid_and_converged(d) -> dict:
    r = d.ctl("reload")
    assert r.returncode == 0, r.stdout + r.stderr
    r = d.ctl("apply", "--wait", "--timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    st = d.status()
    assert st["layout"]["valid"] and st["layout"]["errors"] == [], st["layout"]
    row = next(g for g in st["gpus"] if g["pci"] == GPU1)
    assert row["driver"] == "vfio-pci" and row["workload"] == "vm-passthrough" and row["converged"], row
    return st


def test_a_passthrough_gpu_named_by_uuid_stays_resolvable(daemon):
    d = daemon(["h100-80gb:2"], "version: v1\n")
    uuid = d.sim_state()["gpus"][GPU1]["uuid"]
    d.config.write_text(layout({"devices": [uuid], "workload": "vm-passthrough"}))
    _valid_and_converged(d)
    assert d.sim_state()["functions"][GPU1]["driver"] == "vfio-pci"
    _valid_and_converged(d)  # the next reload: NVML no longer sees it
    assert d.stop() == 0
    d.start()
    _valid_and_converged(d)  # a restart: the UUID comes from the state directory
    assert d.stop() == 0
    assert d.sim("reboot").returncode == 0
    assert d.sim_state()["functions"][GPU1]["driver"] == "vfio-pci"  # gpud's udev rule at boot
    d.start()
    _valid_and_converged(d)
    # a candidate naming it is checked the same way
    cand = d.tmp / "cand.yaml"
    cand.write_text(layout({"devices": [uuid], "workload": "vm-passthrough"}))
    r = d.ctl("check", str(cand))
    assert r.returncode == 0, r.stdout + r.stderr
