"""What the daemon answers is true now (issue 12, sections 3 and 4), on a simulated host driven by
the real reconciler and request handler. Expected values come from outside the code under test:
the profile limits as NVIDIA documents them, the real H200's `nvidia-smi mig -lgip` capture, and
the simulator's own state file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from gpud.api import replies
from gpud.api.handlers import RequestHandler
from gpud.cli.render import render_plan
from gpud.engine.engine import Engine
from gpud.model import Gpu, PciFunction
from gpud.sim import cli as simcli
from tests.scenarios.definitions import layout, mig
from tests.support.simrig import SimRig

REPO = Path(__file__).resolve().parents[2]
WHOLE = layout(mig("all", None))


@pytest.fixture
def rig(tmp_path):
    made: list[SimRig] = []

    def make(*gpus: str) -> SimRig:
        r = SimRig(tmp_path / f"r{len(made)}", gpus)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


async def test_check_reports_what_the_planner_cannot_do_in_plans_words(rig):
    # NVIDIA's MIG user guide: A100 40GB has 4 x 1g.10gb at most; 4g + 2 x 3g needs 4+4+4 of the
    # 8 memory slices; 7g.80gb is one per GPU.
    r = rig("a100-40gb:1", "h100-80gb:1")
    handler = RequestHandler(Engine(r.rec))
    assert await r.apply(WHOLE)
    before = r.calls()
    for text in (layout(mig([0], {"1g.10gb": 7})),
                 layout(mig([1], {"4g.40gb": 1, "3g.40gb": 2})),
                 layout(mig([1], {"7g.80gb": 2}))):
        check = await handler.op_check(text, "cand.yaml")
        plan = await handler.op_plan(text, "cand.yaml")
        assert len(plan.errors) == 1 and plan.gpus == [], render_plan(plan)
        assert not check.valid and check.errors == plan.errors  # the same words as plan
        # at the line of the entry's mig-devices, as the text has it
        line = next(n for n, ln in enumerate(text.splitlines(), 1) if ln.strip() == "mig-devices:")
        assert re.match(rf"cand\.yaml:{line} layouts\.test\[0\]\.mig-devices: GPU [01] 0000:[0-9a-f:.]+: "
                        "infeasible: ", check.errors[0]), check.errors
    assert "needs 12 of 8 memory slices" in (await handler.op_check(
        layout(mig([1], {"4g.40gb": 1, "3g.40gb": 2})), "c.yaml")).errors[0]
    ok = await handler.op_check(layout(mig([0], {"1g.10gb": 4})), "c.yaml")
    assert ok.valid and ok.errors == []
    assert r.mutating(before) == 0  # checking and planning change nothing


async def test_phase_and_states_say_what_is_true_now(rig):
    r = rig("h100-80gb:1")
    assert await r.apply(WHOLE)
    assert replies.status_reply(r.rec.view()).phase == "converged"
    pci = r.rec.observation.gpus[0].pci
    # an edit, before the pass starts: the GPU is pending, not converged (the hardware: MIG still off)
    r.config.write_text(layout(mig([0], {"7g.80gb": 1})))
    assert await r.rec.reload_async("layout changed")
    st = replies.status_reply(r.rec.view())
    assert st.phase == "pending" and st.gpus[0].state == "pending", st
    assert r.mig_mode(0) == 0
    # during the pass: applying, at the moment the GPU is being changed
    seen: list[tuple[str, str]] = []
    r.rec.on_change(lambda: seen.append((replies.status_reply(r.rec.view()).phase,
                                         r.rec.gpu_states[pci].state if pci in r.rec.gpu_states else "")))
    await r.rec.converge()
    assert ("applying", "applying") in seen, seen
    assert replies.status_reply(r.rec.view()).phase == "converged" and r.mig_mode(0) == 1
    # an invalid file: the top line says so, whatever the last pass concluded
    r.config.write_text("version: v1\nlayouts: [\n")
    assert not await r.rec.reload_async("layout changed")
    st = replies.status_reply(r.rec.view())
    assert st.phase == "invalid-layout" and not st.layout.valid
    assert st.gpus[0].state == "converged"  # the GPU itself still matches the last good layout


async def test_plan_lists_what_a_rebind_to_vfio_takes_away(rig):
    r = rig("h100-80gb:1")
    assert await r.apply(WHOLE)
    pci = r.rec.observation.gpus[0].pci
    simcli.hold(r.dir, pci, 4242, "nvidia-persistenced")
    plan = await RequestHandler(Engine(r.rec)).op_plan(layout({"devices": [0], "workload": "vm-passthrough"}), "vm.yaml")
    [rebind] = plan.disruption.rebinds
    assert rebind.pci == pci and rebind.to == "vfio-pci" and rebind.detached[pci] == "nvidia" and rebind.leaves_nvml
    assert [h.pid for h in rebind.holders] == [4242]
    text = render_plan(plan)
    assert "disruption: none" not in text
    assert f"rebinds {pci} and its IOMMU group to vfio-pci: {pci} leaves nvidia" in text
    assert "pid 4242 nvidia-persiste" in text  # comm: 15 characters, as the kernel keeps it
    assert "load-module vfio-pci" in text and "vfio-pci  vfio-pci" not in text


def _lgip_capture() -> set[tuple[str, int, int]]:
    """(name, profile id, total instances) from the real H200's `nvidia-smi mig -lgip`."""
    text = (REPO / "tests/fixtures/h200/nvidia-smi-mig-lgip.txt").read_text()
    return {(m[1], int(m[2]), int(m[4])) for m in re.finditer(r"MIG (\S+)\s+(\d+)\s+(\d+)/(\d+)", text)}


async def test_mig_profiles_of_a_gpu_on_vfio_pci_come_from_the_known_table(rig):
    r = rig("h200:1")
    assert await r.apply(layout({"devices": [0], "workload": "vm-passthrough"}))
    assert r.rec.observation.gpus[0].function.driver == "vfio-pci"
    reply = await RequestHandler(Engine(r.rec)).op_mig_profiles()
    [gpu] = reply.gpus
    assert gpu.source == "table"
    assert {(p.name, p.id, p.total) for p in gpu.profiles} == _lgip_capture()


async def test_events_read_clearly(rig):
    r = rig("h100-80gb:1")
    assert await r.apply(WHOLE)
    r.rec.load_config()  # `apply` re-reads the same file: not a second load
    assert await r.apply(layout(mig([0], {"1g.10gb": 4, "3g.40gb": 1})))
    events = r.bus.recent()
    assert [e["kind"] for e in events].count("layout-loaded") == 2  # two different texts
    steps = [e["message"] for e in events if e["kind"] == "step"]
    assert steps and all("  " not in m for m in steps), steps
    # 4 x 1g at 0..3 leave only start 4 for the 3g (its starts are 0 and 4): the exact cover
    assert "create-gi 3g.40gb@4:4 done" in steps
    assert "set-mig-mode on done" in steps
    converged = [e["message"] for e in events if e["kind"] == "converged"]
    assert converged[-1] == "MIG on, 5 GPU instances"


def test_vfio_events_name_the_group_and_its_gpu():
    from gpud.device_events import DeviceEvent, describe_device_event

    fn = PciFunction("0000:18:00.0", 0x10DE, 0x2330, 0x10DE, 0x16C1, 0x030200, driver="vfio-pci", iommu_group=12)
    gpu = Gpu(index=0, function=fn)
    assert describe_device_event(DeviceEvent("add", "vfio", "12"), (gpu,)) == (
        "0000:18:00.0", "/dev/vfio/12 added (IOMMU group 12)")
    assert describe_device_event(DeviceEvent("bind", "pci", "0000:18:00.0", "vfio-pci"), (gpu,)) == (
        "0000:18:00.0", "PCI device 0000:18:00.0 bound to vfio-pci")


async def test_check_all_layouts_plans_every_layout_a_node_label_may_select(rig):
    # NVIDIA's MIG user guide: A100 40GB has 4 x 1g.10gb at most, so `seven` cannot be converged.
    r = rig("a100-40gb:1")
    handler = RequestHandler(Engine(r.rec))
    doc = {"version": "v1", "selected": "whole",
           "layouts": {"whole": [mig("all", None)], "seven": [mig([0], {"1g.10gb": 7})]}}
    text = yaml.safe_dump(doc, sort_keys=False)
    selected_only = await handler.op_check(text, "two.yaml")
    assert selected_only.valid and selected_only.checked == ["whole"]
    every = await handler.op_check(text, "two.yaml", all_layouts=True)
    assert every.checked == ["whole", "seven"] and not every.valid
    plan = await handler.op_plan(yaml.safe_dump({**doc, "selected": "seven"}, sort_keys=False), "two.yaml")
    assert every.errors == plan.errors and len(plan.errors) == 1 and "two.yaml:11 layouts.seven[0].mig-devices: GPU 0 " \
        "0000:18:00.0: infeasible: 7 x 1g.10gb exceeds the 4 instances allowed" in plan.errors[0]
    assert every.errors_omitted == 0


async def test_no_layout_in_force_is_not_starting(rig):
    """Issue 33 item 11: with no valid layout since start no pass ever looks at a GPU, yet status and
    `apply --wait` said `starting` (a pass is coming) for each."""
    r = rig("h100-80gb:2")
    r.config.write_text("version: v1\nlayouts: [\n")
    assert not await r.rec.reload_async("layout changed")
    await r.rec.converge()
    st = replies.status_reply(r.rec.view())
    assert st.phase == "invalid-layout"
    assert [g.state for g in st.gpus] == ["unmanaged"] * 2, [g.state for g in st.gpus]
    assert all("no valid layout" in g.message for g in st.gpus)
    applied = replies.apply_reply(r.rec.view(), True)
    assert {g.state for g in applied.gpus} == {"unmanaged"}
    assert r.mig_mode(0) == 0 and r.mig_mode(1) == 0  # and indeed nothing was changed
