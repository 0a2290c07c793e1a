"""GB300's MIG profile names depend on the driver, its profile ids do not: NVIDIA's DGX Station
GB300 MIG playbook (github.com/NVIDIA/dgx-spark-playbooks, nvidia/station-mig and the
mig-configure skill): "Driver 59x reports the …35gb/139gb/278gb names; 61x reports
…31gb/126gb/251gb for the same IDs". The table below is that source's, written out here, not
read from gpud.profiles."""

from __future__ import annotations

import pynvml
import pytest

from gpud.sim import nvml_lib
from gpud.sim.cli import SimCliError, create
from gpud.sim.state import load

# id -> (R59x name, R61x name), NVIDIA's playbook
PLAYBOOK = {19: ("1g.35gb", "1g.31gb"), 20: ("1g.35gb+me", "1g.31gb+me"), 15: ("1g.70gb", "1g.70gb"),
            14: ("2g.70gb", "2g.70gb"), 9: ("3g.139gb", "3g.126gb"), 5: ("4g.139gb", "4g.126gb"),
            0: ("7g.278gb", "7g.251gb")}


def _nvml_names(host) -> dict[int, str]:
    nvml_lib.install(str(host))
    try:
        pynvml.nvmlInit()
        dev = pynvml.nvmlDeviceGetHandleByIndex(0)
        out = {}
        for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = pynvml.nvmlDeviceGetGpuInstanceProfileInfoV(dev, index)
            except pynvml.NVMLError:
                continue
            name = info.name.decode() if isinstance(info.name, bytes) else info.name
            out[info.id] = name.removeprefix("MIG ")
        pynvml.nvmlShutdown()
        return out
    finally:
        nvml_lib.uninstall()


@pytest.mark.parametrize(("driver", "column"), [("595.45.04", 0), ("610.43.02", 1)])
def test_gb300_names_follow_the_driver_branch(tmp_path, driver, column):
    host = tmp_path / "host"
    create(host, ["gb300:1"], [0], driver=driver)
    assert load(host).driver_version == driver
    assert _nvml_names(host) == {pid: names[column] for pid, names in PLAYBOOK.items()}


def test_a_bad_driver_version_is_refused(tmp_path):
    with pytest.raises(SimCliError, match="--driver 'r610'"):
        create(tmp_path / "host", ["gb300:1"], [], driver="r610")
    assert not (tmp_path / "host").exists()
