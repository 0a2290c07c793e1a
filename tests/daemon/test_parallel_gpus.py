"""Issue 13 item 6: independent GPUs proceed independently, and an IN_USE nobody holds is no wait.

Ordering, not timing: with an unbind timeout far beyond the test's own bound, GPU 1 can only reach
vfio-pci while GPU 0's unbind is still blocked if the two GPUs run side by side. What is on which
driver is read from the simulator's state file."""

from __future__ import annotations

import pytest

from gpud.sim.kernel import unhang
from tests.scenarios.definitions import layout, mig
from tests.support.daemon import wait_until

pytestmark = pytest.mark.daemon

BOTH_CONTAINER = layout({"devices": [0, 1], "workload": "container"})
BOTH_PASSTHROUGH = layout({"devices": [0, 1], "workload": "vm-passthrough"})


def test_a_hung_unbind_does_not_delay_another_gpus_rebind(daemon):
    d = daemon(["h100-80gb:2"], BOTH_CONTAINER, "--unbind-timeout", "600")
    assert d.ctl("apply", "--wait").returncode == 0
    first, second = (g["pci"] for g in d.status()["gpus"])
    assert d.sim("hang", first).returncode == 0
    try:
        seen = len(d.events())
        d.config.write_text(BOTH_PASSTHROUGH)
        wait_until(lambda: d.sim_state()["functions"][second]["driver"] == "vfio-pci", timeout=90,
                   what="the second GPU on vfio-pci")
        st = d.status()
        sim = d.sim_state()
        # the first GPU is still inside its unbind: on nvidia, wedged, not converged
        assert first in sim["hangs"] and sim["functions"][first]["driver"] == "nvidia"
        assert st["gpus"][0]["state"] == "applying", st["gpus"][0]
        events = d.events()
        assert not any(e["gpu"] == first and e["kind"] in ("converged", "stuck", "failed") for e in events[seen:])
        wait_until(lambda: d.status()["gpus"][1]["converged"], what="the second GPU converged")
        assert d.status()["gpus"][0]["state"] == "applying"  # still in the unbind that never returns
    finally:
        unhang(d.host, first)
    wait_until(lambda: (g := d.status()["gpus"][0])["converged"] and g["driver"] == "vfio-pci",
               timeout=90, what="the first GPU converged once its unbind returned")
    assert d.sim_state()["functions"][first]["driver"] == "vfio-pci"


def test_in_use_with_no_holder_is_retried_not_waited_on(daemon):
    """`gpud-sim fault DIR nvmlDeviceCreateGpuInstanceWithPlacement --nth 3 --error 19` left the GPU
    `waiting ... in use` with no holders and 2 of 7 instances, for good."""
    d = daemon(["h100-80gb:1"], layout(mig([0], None)))
    assert d.ctl("apply", "--wait").returncode == 0
    pci = d.status()["gpus"][0]["pci"]
    r = d.sim("fault", "nvmlDeviceCreateGpuInstanceWithPlacement", "--nth", "3", "--error", "19")
    assert r.returncode == 0, r.stderr
    d.config.write_text(layout(mig([0], {"1g.10gb": 7})))
    r = d.ctl("apply", "--wait", "--timeout", "120")
    assert r.returncode == 0, r.stdout + r.stderr
    gpu = d.sim_state()["gpus"][pci]
    assert gpu["mig_mode"] == 1 and sorted(gi["profile_id"] for gi in gpu["gis"]) == [19] * 7
    assert d.sim_state()["faults"] == []  # the fault did fire
    assert not any(e["kind"] == "waiting" and e["gpu"] == pci for e in d.events())
