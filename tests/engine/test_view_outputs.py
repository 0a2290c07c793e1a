"""Every output of the engine is a function of an EngineView: status, the STATUS= line, the apply
reply, metrics and the layout part of status come out of a view made here by hand, with no
Reconciler, no host and no simulator. The expected values are written out, not computed by gpud."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gpud.api import replies
from gpud.api.metrics import render
from gpud.engine import status_line
from gpud.engine.gpu_state import GpuState
from gpud.engine.observe.discovery import Observation
from gpud.engine.view import EngineView
from gpud.model import Gpu, Holder, KnownGpu, PciFunction

H100 = 0x2330


def _gpu(index: int, pci: str, driver: str = "nvidia") -> Gpu:
    fn = PciFunction(address=pci, vendor=0x10DE, device=H100, subsystem_vendor=0x10DE, subsystem_device=0x16C1,
                     class_code=0x030200, driver=driver, iommu_group=10 + index)
    return Gpu(index=index, function=fn)


def _view(**kw) -> EngineView:
    gpus = (_gpu(0, "0000:18:00.0"), _gpu(1, "0000:2a:00.0", driver="vfio-pci"))
    gone = (KnownGpu(index=2, pci="0000:3a:00.0", vendor=0x10DE, device=H100, model="NVIDIA H100 80GB HBM3",
                     uuid="GPU-gone"),)
    states = {
        "0000:18:00.0": GpuState("converged", "whole GPU"),
        "0000:2a:00.0": GpuState("waiting", "waiting for pid 41 python3 on /dev/nvidia1",
                                 (Holder(pid=41, name="python3", device="/dev/nvidia1"),)),
        "0000:3a:00.0": GpuState("gone", "GPU 2 left the PCI bus"),
    }
    base: dict[str, Any] = dict(observation=Observation(gpus=gpus, functions=tuple(g.function for g in gpus), gone=gone),
                resolution=None, gpu_states=MappingProxyType(states), phase="waiting", phase_now="waiting",
                layout=None, layout_errors=(), layout_warnings=("layout.yaml:3 devices: GPU 5 is not on this host",),
                config_path="/etc/gpud/layout.yaml", read_only=False, notes=MappingProxyType({"0000:3a:00.0": "GPU 2 gone"}),
                problems=("gpu-index.json set aside",), passes=4, completed_passes=3)
    base.update(kw)
    return EngineView(**base)


def test_status_comes_from_the_view_alone():
    st = replies.status_reply(_view())
    assert st.phase == "waiting"
    assert [(g.index, g.pci, g.state, g.driver) for g in st.gpus] == [
        (0, "0000:18:00.0", "converged", "nvidia"), (1, "0000:2a:00.0", "waiting", "vfio-pci"),
        (2, "0000:3a:00.0", "gone", None)]
    assert [h.pid for h in st.gpus[1].holders] == [41]
    assert st.state_files == ["gpu-index.json set aside"]
    # no resolution: the layout's own warnings are shown, and the GPU-set note waits for one
    assert st.layout.warnings == ["layout.yaml:3 devices: GPU 5 is not on this host"]
    assert st.layout.path == "/etc/gpud/layout.yaml" and st.layout.valid


def test_the_status_line_and_the_apply_reply_come_from_the_view():
    view = _view()
    assert status_line.of(view) == "2 GPUs: 1 converged, 1 waiting, 1 gone (waiting for pid 41)"
    done = replies.apply_reply(view, finished=True)
    assert (done.phase, done.converged) == ("waiting", False)
    assert done.message == "0000:2a:00.0: waiting: waiting for pid 41 python3 on /dev/nvidia1"
    assert replies.apply_reply(view, finished=False).phase == "timeout"


def test_an_invalid_file_shows_in_every_output(tmp_path):
    view = _view(layout_errors=("layout.yaml:1 version: must be v1",), phase_now="invalid-layout")
    assert status_line.of(view).endswith("; layout.yaml invalid, keeping the last good layout")
    st = replies.status_reply(view)
    assert st.phase == "invalid-layout" and not st.layout.valid
    out = tmp_path / "gpud.prom"
    render(st, view.passes, str(out))
    samples = {s.name: s.value for f in text_string_to_metric_families(out.read_text()) for s in f.samples
               if not s.labels}
    assert samples["gpud_layout_valid"] == 0
    assert samples["gpud_reconcile_passes"] == 4


def test_a_new_view_rebuilds_only_the_gpus_whose_part_changed(monkeypatch):
    """During an apply every step makes a new view; the status answer for it is the one a fresh
    build gives, while only the GPU whose record or state changed is built again."""
    import dataclasses

    from gpud.api.status_snapshot import StatusSnapshot

    built: list[str] = []
    real = replies.gpu_status

    def counted(gpu, *a, **kw):
        built.append(gpu.pci)
        return real(gpu, *a, **kw)

    monkeypatch.setattr(replies, "gpu_status", counted)
    snap = StatusSnapshot()
    first = _view()
    assert snap.reply(first, observed_at=1.0, age=0.0).gpus == replies.status_reply(first).gpus
    built.clear()
    states = dict(first.gpu_states)
    states["0000:18:00.0"] = GpuState("applying", "step 3 of 7")
    second = dataclasses.replace(first, gpu_states=MappingProxyType(states))
    got = snap.reply(second, observed_at=2.0, age=0.0)
    assert built == ["0000:18:00.0"]
    built.clear()
    assert got.gpus == replies.status_reply(second).gpus


def test_a_new_resolution_with_the_same_entries_rebuilds_no_gpu(monkeypatch):
    """Each re-read of the host resolves the layout again (new DesiredGpu objects, equal to the
    last ones): with the GPUs' records kept (observer: keep_unchanged) no GPU's part is rebuilt."""
    import dataclasses

    from gpud.api.status_snapshot import StatusSnapshot
    from gpud.layout.desired import DesiredGpu
    from gpud.layout.resolve import Resolution

    built: list[str] = []
    real = replies.gpu_status

    def counted(gpu, *a, **kw):
        built.append(gpu.pci)
        return real(gpu, *a, **kw)

    def resolution() -> Resolution:
        return Resolution(desired={"0000:18:00.0": DesiredGpu(pci="0000:18:00.0", index=0, entry="layouts.mig[0]",
                                                              mig_enabled=True, mig_devices={"1g.10gb": 7})})

    monkeypatch.setattr(replies, "gpu_status", counted)
    snap = StatusSnapshot()
    first = _view(resolution=resolution())
    snap.reply(first, observed_at=1.0, age=0.0)
    assert sorted(built) == ["0000:18:00.0", "0000:2a:00.0"]
    built.clear()
    second = dataclasses.replace(first, resolution=resolution(), passes=5)
    got = snap.reply(second, observed_at=2.0, age=0.0)
    assert built == [] and got.gpus == replies.status_reply(second).gpus
    changed = Resolution(desired={"0000:18:00.0": DesiredGpu(pci="0000:18:00.0", index=0, entry="layouts.mig[0]",
                                                             mig_enabled=True, mig_devices={"1g.10gb": 3})})
    built.clear()  # (the oracle's build above counted too)
    snap.reply(dataclasses.replace(first, resolution=changed), observed_at=3.0, age=0.0)
    assert built == ["0000:18:00.0"]
