"""Passthrough of a Grace GPU binds Linux's VFIO variant driver nvgrace_gpu_vfio_pci, found as the
kernel's modules.alias names it for the device (drivers/vfio/pci/nvgrace-gpu/main.c lists GH200's
ids with PCI_DRIVER_OVERRIDE_DEVICE_VFIO), not vfio-pci; a GPU the alias file names no variant for
gets vfio-pci. The oracle is the simulator's state file (driver, driver_override, modules loaded)
and the boot-time udev rule gpud writes."""

from __future__ import annotations

import pytest

from tests.scenarios.definitions import layout
from tests.support.daemon import Daemon, wait_until

pytestmark = pytest.mark.daemon

PASS = layout({"devices": [0], "workload": "vm-passthrough"})
BACK = layout({"devices": [0], "workload": "container"})


@pytest.mark.parametrize(("model", "driver"), [("gh200-96gb", "nvgrace_gpu_vfio_pci"), ("h200", "vfio-pci")])
def test_passthrough_binds_the_driver_modules_alias_names(tmp_path, model, driver):
    d = Daemon(tmp_path / "d", [f"{model}:1"], PASS)
    try:
        r = d.ctl("apply", "--wait", "--timeout", "60")
        assert r.returncode == 0, r.stdout + r.stderr
        st = d.sim_state()
        (pci,) = st["gpus"]
        f = st["functions"][pci]
        assert (f["driver"], f["driver_override"]) == (driver, driver)
        assert (driver.replace("-", "_") in st["loaded_modules"]) and (
            driver == "vfio-pci" or "vfio_pci" not in st["loaded_modules"])
        g = d.status()["gpus"][0]
        assert g["workload"] == "vm-passthrough" and g["converged"]
        assert g["vfio_device"] == f"/dev/vfio/{g['iommu_group']}"
        assert (d.host / "dev/vfio" / str(g["iommu_group"])).exists()
        rules = (d.host / "etc/udev/rules.d/70-gpud-vfio.rules").read_text()
        assert f'ATTR{{driver_override}}="{driver}", RUN{{builtin}}+="kmod load {driver}"' in rules
        d.config.write_text(BACK)
        wait_until(lambda: d.status()["gpus"][0]["driver"] == "nvidia" and d.status()["gpus"][0]["converged"],
                   timeout=60, what="back on nvidia")
        assert d.sim_state()["functions"][pci]["driver_override"] is None
    finally:
        d.stop()
