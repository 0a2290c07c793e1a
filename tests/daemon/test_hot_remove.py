"""Issue 13 item 1: a hot-removed GPU never makes another GPU take its layout.

The layout names GPU 0 (7 x 1g.10gb) and GPUs 1, 2 (MIG off). GPU 0 is surprise-removed with
`gpud-sim unplug`. Before the fix the indices shifted (0000:2a:00.0 became index 0) and gpud turned
MIG on there. What the other GPUs are is read from the simulator's own state file, and what gpud
did from the simulator's call counters, not from gpud's status.
"""

from __future__ import annotations

import pytest

from tests.scenarios.definitions import layout, mig
from tests.support.daemon import wait_until

pytestmark = pytest.mark.daemon

GPU0 = "0000:18:00.0"
SEVEN = {"1g.10gb": 7}
LAYOUT = layout(mig([0], SEVEN), mig([1, 2], None))


def hardware(sim: dict, pci: str) -> tuple:
    """(MIG mode, pending, [(GI profile, start)]) of one GPU as the simulator holds it."""
    g = sim["gpus"][pci]
    return g["mig_mode"], g["mig_pending"], sorted((gi["profile_id"], gi["start"]) for gi in g["gis"])


def present(sim: dict, pci: str) -> bool:
    return sim["functions"][pci]["present"]


def test_unplugged_gpu_keeps_its_index_and_no_other_gpu_takes_its_layout(daemon):
    d = daemon(["h100-80gb:3"], LAYOUT)
    assert d.ctl("apply", "--wait").returncode == 0
    before = d.status()
    assert [g["pci"] for g in before["gpus"]][0] == GPU0
    others = [g["pci"] for g in before["gpus"][1:]]
    sim = d.sim_state()
    assert hardware(sim, GPU0)[0] == 1 and len(hardware(sim, GPU0)[2]) == 7
    untouched = {pci: hardware(sim, pci) for pci in others}
    assert all(mode == 0 and not gis for mode, _, gis in untouched.values())
    calls_before = d.mutating_calls()
    events_before = len(d.events())

    assert d.sim("unplug", GPU0).returncode == 0
    st = wait_until(lambda: (s := d.status())["gpus"][0]["state"] == "gone" and s, what="GPU 0 shown gone")
    assert d.ctl("apply", "--wait").returncode == 0  # a whole pass after the removal has run

    sim = d.sim_state()
    assert not present(sim, GPU0)
    assert {pci: hardware(sim, pci) for pci in others} == untouched  # nothing on the other GPUs changed
    assert d.mutating_calls() == calls_before  # and gpud made no mutating NVML call at all
    st = d.status()
    rows = {g["index"]: g for g in st["gpus"]}
    assert sorted(rows) == [0, 1, 2]
    gone = rows[0]
    assert (gone["pci"], gone["state"], gone["converged"]) == (GPU0, "gone", False)
    assert gone["uuid"] == before["gpus"][0]["uuid"] and gone["model"] == before["gpus"][0]["model"]
    assert gone["pci_id"] == before["gpus"][0]["pci_id"]
    assert [rows[1]["pci"], rows[2]["pci"]] == others and all(rows[i]["converged"] for i in (1, 2))
    assert any(GPU0 in w and "gone" in w for w in st["layout"]["warnings"]), st["layout"]["warnings"]
    assert st["layout"]["valid"] and st["layout"]["errors"] == []
    new = d.events()[events_before:]
    kinds = [e["kind"] for e in new]
    assert "gpu-set-changed" in kinds and "gpu-gone" in kinds
    assert not any(e["kind"] in ("step", "applying") for e in new)

    # across a restart with GPU 0 still missing: the same indices, still nothing touched
    d.stop()
    d.start()
    wait_until(lambda: d.status()["phase"] not in ("starting", "applying"), what="first pass after restart")
    assert d.ctl("apply", "--wait").returncode == 0
    rows = {g["index"]: g for g in d.status()["gpus"]}
    assert (rows[0]["pci"], rows[0]["state"]) == (GPU0, "gone")
    assert [rows[1]["pci"], rows[2]["pci"]] == others
    assert {pci: hardware(d.sim_state(), pci) for pci in others} == untouched
    assert d.mutating_calls() == calls_before

    # plugged back: GPU 0 gets its own index again and its own layout
    assert d.sim("plug", GPU0).returncode == 0
    wait_until(lambda: (g := d.status()["gpus"][0])["pci"] == GPU0 and g["state"] == "converged",
               what="GPU 0 back and converged")
    sim = d.sim_state()
    mode, _, gis = hardware(sim, GPU0)
    assert mode == 1 and [profile for profile, _ in gis] == [19] * 7  # 1g.10gb is GI profile id 19
    assert {pci: hardware(sim, pci) for pci in others} == untouched
    assert not [w for w in d.status()["layout"]["warnings"] if "gone" in w]
    assert "gpu-returned" in [e["kind"] for e in d.events()]


def test_all_entry_reports_the_changed_gpu_set_before_applying(daemon):
    d = daemon(["h100-80gb:3"], layout(mig("all", None)))
    assert d.ctl("apply", "--wait").returncode == 0
    pci = d.status()["gpus"][1]["pci"]
    calls_before = d.mutating_calls()
    assert d.sim("unplug", pci).returncode == 0
    wait_until(lambda: d.status()["gpus"][1]["state"] == "gone", what="GPU 1 gone")
    st = d.status()
    warning = next(w for w in st["layout"]["warnings"] if "the GPU set changed" in w)
    assert pci in warning and "devices: all" in warning and "2 GPUs present" in warning
    assert [g["index"] for g in st["gpus"]] == [0, 1, 2]
    assert d.mutating_calls() == calls_before
    events = d.events()
    changed = next(i for i, e in enumerate(events) if e["kind"] == "gpu-set-changed")
    assert pci in events[changed]["message"]
