"""Issue 9, hardware truth, on a real gpud process and the real gpudctl:

- NVML enumerates at nvmlInit (docs/hardware/nvml-enumeration.md): a GPU moved from vfio-pci back
  to containers is in plain `status` (answered from memory) with its UUID and MIG state right after
  the apply, because gpud re-initialised NVML when the GPUs on nvidia changed;
- after `gpud-sim reboot` (docs/hardware/reboot.md) and a daemon start, the host converges back with
  the fewest NVML mutating calls, counted from the simulator's own state file and call counters, and
  status says what was rebuilt; a restart in the same boot claims nothing.
"""

from __future__ import annotations

import pytest

from tests.scenarios.definitions import layout, mig
from tests.support.daemon import wait_until

pytestmark = pytest.mark.daemon

GPU1 = "0000:2a:00.0"
PASSTHROUGH = layout(mig([0], None), {"devices": [1], "workload": "vm-passthrough"})
MIG_ON_1 = layout(mig([0], None), mig([1], {"3g.40gb": 2}))
REBUILD = layout(mig([0], {"1g.10gb": 4, "3g.40gb": 1}), {"devices": [1], "workload": "vm-passthrough"})


def test_a_gpu_back_from_vfio_pci_shows_its_nvml_identity_right_after(daemon):
    d = daemon(["h100-80gb:2"], PASSTHROUGH)
    assert d.ctl("apply", "--wait").returncode == 0
    assert d.sim_state()["functions"][GPU1]["driver"] == "vfio-pci"
    d.config.write_text(MIG_ON_1)
    assert d.ctl("reload").returncode == 0
    r = d.ctl("apply", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    row = next(g for g in d.status()["gpus"] if g["pci"] == GPU1)
    truth = d.sim_state()["gpus"][GPU1]
    assert row["driver"] == "nvidia" and row["uuid"] == truth["uuid"]
    assert row["mig"]["mode"] == "enabled" and truth["mig_mode"] == 1
    assert len(row["mig"]["instances"]) == len(truth["gis"]) == 2
    assert row["state"] == "converged"


def test_after_a_reboot_the_layout_is_rebuilt_with_the_fewest_calls_and_said(daemon):
    d = daemon(["h100-80gb:2"], REBUILD)
    assert d.ctl("apply", "--wait").returncode == 0
    assert d.status()["rebuilt_after_boot"] is None  # the first start ever claims nothing
    assert d.stop() == 0
    assert d.sim("reboot").returncode == 0
    sim = d.sim_state()
    gpu0 = sorted(sim["gpus"])[0]
    assert sim["functions"][GPU1]["driver"] == "vfio-pci"  # gpud's udev rule, applied at device add
    assert sim["gpus"][gpu0]["mig_mode"] == 0 and not sim["gpus"][gpu0]["gis"]  # Hopper: all gone
    calls = d.mutating_calls()

    d.start()
    st = wait_until(lambda: (s := d.status())["rebuilt_after_boot"] and s, what="the rebuild to be reported")
    assert st["phase"] == "converged"
    sim = d.sim_state()
    gis = sim["gpus"][gpu0]["gis"]
    assert len(gis) == 5 and all(len(gi["cis"]) == 1 for gi in gis)
    assert d.mutating_calls() - calls == 1 + len(gis) + len(gis)  # MIG on, one create per GI and per CI
    assert st["rebuilt_after_boot"] == f"rebuilt after boot: GPU 0 ({gpu0}): MIG on, 5 GPU instances"
    assert st["rebuilt_after_boot"] in d.ctl("status").stdout
    assert any(e["kind"] == "rebuilt-after-boot" for e in d.events())

    assert d.stop() == 0
    d.start()  # a restart in the same boot
    assert d.ctl("apply", "--wait").returncode == 0
    assert d.status()["rebuilt_after_boot"] is None
