"""CDMM on Grace: NVIDIA's GPU Operator 25.3.2 release notes, known issues
(github.com/NVIDIA/cloud-native-docs gpu-operator/release-notes.rst): from driver 580.65.06 the
driver container enables Coherent Driver Memory Management, which "is not compatible with the
Multi-Instance GPUs (MIG) sharing", and "applies only to Grace-based systems such as GH200 and
GB200 and is ignored on other GPU platforms". The driver states the mode in
/proc/driver/nvidia/params (`CoherentGPUMemoryMode: "driver"`, kernel-open/nvidia/nv-procfs.c).
`check` must refuse MIG on such a GPU with that reason and change nothing; the same layout checks
on the same GPU without CDMM and on a non-Grace GPU with it."""

from __future__ import annotations

import pynvml
import pytest

from gpud.sim import nvml_lib
from gpud.sim.cli import create
from tests.support.daemon import Daemon

pytestmark = pytest.mark.daemon

MIG = """version: v1
layouts:
  l:
    - devices: all
      mig-enabled: true
      mig-devices: {"%s": 2}
"""


def _check(tmp_path, model: str, profile: str, cdmm: bool):
    d = Daemon(tmp_path / f"{model}-{cdmm}", [f"{model}:1"], "version: v1\n", cdmm=cdmm)
    try:
        cand = d.tmp / "cand.yaml"
        cand.write_text(MIG % profile)
        return d.ctl("check", str(cand)), d.sim_state()
    finally:
        d.stop()


def test_check_refuses_mig_on_a_grace_gpu_in_cdmm_with_the_reason(tmp_path):
    r, st = _check(tmp_path, "gh200-96gb", "1g.12gb", cdmm=True)
    out = r.stdout + r.stderr
    assert r.returncode == 4, out
    assert "MIG is not available" in out and "CDMM" in out and "GPU Operator 25.3.2" in out, out
    assert all(g["mig_mode"] == 0 and not g["gis"] for g in st["gpus"].values())


@pytest.mark.parametrize(("model", "profile", "cdmm"), [("gh200-96gb", "1g.12gb", False), ("h200", "1g.18gb", True)])
def test_without_cdmm_or_off_grace_the_same_layout_checks(tmp_path, model, profile, cdmm):
    r, _ = _check(tmp_path, model, profile, cdmm)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_simulated_driver_refuses_mig_mode_under_cdmm(tmp_path):
    host = tmp_path / "host"
    create(host, ["gh200-96gb:1"], [], cdmm=True)
    assert (host / "proc/driver/nvidia/params").read_text() == 'CoherentGPUMemoryMode: "driver"\n'
    nvml_lib.install(str(host))
    try:
        pynvml.nvmlInit()
        dev = pynvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceSetMigMode(dev, 1)
        assert pynvml.nvmlDeviceGetMigMode(dev) == [0, 0]
        pynvml.nvmlShutdown()
    finally:
        nvml_lib.uninstall()
