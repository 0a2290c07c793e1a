"""Issue 29 item 16: vfio-pci is loaded only where a layout needs it. A host whose layout keeps its
GPUs for containers and MIG never gets the module (the simulator's own list of loaded modules);
the first layout that passes a GPU through has gpud load it, once, and bind the GPU. On a real host
that load is systemd's modprobe@vfio_pci.service, started over D-Bus (tests/systemd/test_modprobe_unit.py)."""

from __future__ import annotations

import pytest

from tests.scenarios.definitions import layout, mig

pytestmark = pytest.mark.daemon

GPU1 = "0000:2a:00.0"


def test_vfio_pci_is_loaded_by_the_first_layout_that_needs_it(daemon):
    d = daemon(["h100-80gb:2"], layout(mig([0], {"1g.10gb": 2})))
    assert d.ctl("apply", "--wait", "--timeout", "60").returncode == 0
    assert "vfio_pci" not in d.sim_state()["loaded_modules"]
    d.config.write_text(layout(mig([0], {"1g.10gb": 2}), {"devices": [1], "workload": "vm-passthrough"}))
    r = d.ctl("apply", "--wait", "--timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    st = d.sim_state()
    assert "vfio_pci" in st["loaded_modules"]
    assert st["functions"][GPU1]["driver"] == "vfio-pci"
