"""gpudctl reads a real gpud's replies (on a simulated host) as it read them with msgspec's typed
decode: every read command prints the same both ways (tests/support/client_view.py), on a host with
MIG instances (a compute instance smaller than its GPU instance among them), a GPU bound to vfio-pci
for a VM, and a dynamic GPU holding a lease."""

from __future__ import annotations

import pytest

from tests.scenarios.definitions import layout, mig
from tests.support.client_view import both_ways

pytestmark = pytest.mark.daemon

READS = [
    ["status"], ["status", "--json"], ["status", "0"], ["status", "1"], ["status", "2", "--json"], ["status", "--kube"],
    ["list"], ["list", "--json"], ["mig", "instances"], ["mig", "compute"], ["mig", "compute", "--json"],
    ["mig", "profiles"], ["mig", "profiles", "--json"], ["mig", "compute-profiles"], ["mig", "compute-profiles", "--json"],
    ["passthrough"], ["passthrough", "--json"], ["labels"], ["leases"], ["leases", "--json"], ["plan"], ["plan", "--json"],
    ["version"], ["events"], ["events", "--json"], ["vgpu", "types"],
]


def test_every_read_of_a_real_gpud_prints_the_same_as_from_the_typed_decode(daemon, monkeypatch):
    d = daemon(["h100-80gb:3"], layout(mig([0], {"1g.10gb": 2, "1c.3g.40gb": 2}),
                                       {"devices": [1], "workload": "vm-passthrough"},
                                       {"devices": [2], "mig-enabled": True, "mig-devices": "dynamic"}))
    assert d.ctl("apply", "--wait", "--timeout", "120", timeout=180).returncode == 0
    lease = d.ctl("lease", "1g.10gb", "--gpu", "2", "--owner", "job-1")
    assert lease.returncode == 0, lease.stderr
    status = d.status()
    assert status["gpus"][0]["mig"]["instances"] and status["gpus"][1]["driver"] == "vfio-pci" and status["gpus"][2]["leases"]
    for argv in READS:
        viewed, typed = both_ways(monkeypatch, ["--socket", str(d.socket), *argv])
        assert viewed == typed, argv
        assert viewed[0] == 0, (argv, viewed)
