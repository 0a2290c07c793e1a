"""The engine's label writer: phases to mig.config.state-style values, the label set setting, and
the file NFD reads (read back with the NFD-side reader of test_nfd_features)."""

from __future__ import annotations

from typing import get_args

import msgspec
import pytest

from gpud.engine.gpu_state import Phase
from gpud.engine.kube.node_labels_out import LabelsOut, Versions, layout_state
from gpud.engine.observe.discovery import observe
from gpud.host.kernel.sysfs import Sysfs
from gpud.host.nvidia.nvml import Nvml
from gpud.layout.match import DEFAULT_MATCH
from tests.support.nfd import nfd_read
from tests.support.present import present

# Written out by hand (mig.config.state's values: success | pending | failed), not derived from the code.
_CASES = [
    ("converged", False, "success"), ("applying", False, "pending"), ("waiting", False, "pending"),
    ("starting", False, "pending"), ("failed", False, "failed"), ("stuck", False, "failed"),
    ("invalid-layout", False, "failed"), ("reboot-required", False, "failed"),
    ("reboot-required", True, "rebooting"), ("pending", False, "pending"), ("drift", False, "pending"),
    ("read-only", False, "pending"), ("reset-required", False, "failed"),
]


@pytest.mark.parametrize(("phase", "rebooting", "state"), _CASES)
def test_phase_to_state(phase, rebooting, state):
    assert layout_state(phase, rebooting=rebooting) == state


def test_every_phase_is_in_the_table_above():
    named = {p for p, _, _ in _CASES}
    assert named == set(get_args(Phase))


def _gpus(sim_host):
    host = sim_host("h200:2")
    nvml = Nvml()
    nvml.open()
    try:
        return observe(Sysfs(host.sys_root, store=host.store), nvml, DEFAULT_MATCH).gpus, nvml.driver_version()
    finally:
        nvml.close()


@pytest.mark.parametrize("label_set", ["all", "gpud"])
def test_written_labels_follow_the_label_set(sim_host, tmp_path, label_set):
    gpus, driver = _gpus(sim_host)
    d = tmp_path / "features.d"
    d.mkdir()
    out = LabelsOut(str(d / "gpud"), label_set=label_set, exclude=("nvidia.com/mig.capable",))
    labels = out.write(out.inputs(gpus, workloads={}, layout="whole", state="success",
                                  versions=Versions(driver=driver, cuda=13000)))
    assert out.last_result == "written"
    read = nfd_read(str(d))
    assert read == labels.labels
    assert read["nvidia.com/gpud.layout"] == "whole" and read["nvidia.com/gpud.workload.container.count"] == "2"
    assert "nvidia.com/mig.capable" not in read
    if label_set == "all":
        assert read["nvidia.com/gpu.count"] == "2" and read["nvidia.com/cuda.driver-version.full"] == driver
    else:
        assert all(k.startswith("nvidia.com/gpud.") for k in read)


def test_without_nfd_directory_nothing_is_written(sim_host, tmp_path):
    gpus, _ = _gpus(sim_host)
    out = LabelsOut(str(tmp_path / "absent" / "gpud"))
    out.write(out.inputs(gpus, workloads={}, layout=None, state="pending", versions=Versions()))
    assert out.last_result == "no-directory" and not (tmp_path / "absent").exists()
    assert present(out.last).labels["nvidia.com/gpud.layout.state"] == "pending"


def test_unknown_label_set_is_refused():
    with pytest.raises(ValueError, match="label set 'gfd'"):
        LabelsOut(None, label_set="gfd")


def test_labels_are_made_again_only_when_what_they_come_from_changed(sim_host):
    # each observation asks for the labels; the same GPU records and values give the same labels
    # back without making them again, a replaced record (a GPU read as changed) makes them anew
    from gpud.plan.node_labels import node_labels

    gpus, driver = _gpus(sim_host)
    out = LabelsOut(None)
    ask = lambda gs, state="success": out.inputs(gs, workloads={}, layout="whole", state=state,  # noqa: E731
                                                 versions=Versions(driver=driver, cuda=13000))
    first = out.compute(ask(gpus))
    assert out.compute(ask(tuple(gpus))) is first
    moved = msgspec.structs.replace(gpus[1].function, driver="vfio-pci")
    changed = (gpus[0], msgspec.structs.replace(gpus[1], function=moved, nvml=None))
    again = out.compute(ask(changed))
    assert again is not first and again.labels == node_labels(ask(changed)).labels != first.labels
    assert out.compute(ask(changed, state="pending")).labels["nvidia.com/gpud.layout.state"] == "pending"
    out.set_mode("gpud", "mixed")  # another label set: made again
    assert all(k.startswith("nvidia.com/gpud.") for k in out.compute(ask(changed, state="pending")).labels)
