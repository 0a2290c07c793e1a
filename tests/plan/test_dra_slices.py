"""The DRA slice builder against the simulator's MIG rules (gpud.sim.gpu_rules, which share no
code with the builder): any set of dynamic devices whose counter consumptions fit the GPU's
counter set is a set of instances the simulator creates side by side, and the other way round."""

from __future__ import annotations

import random

import pytest

from gpud.layout.desired import DesiredGpu
from gpud.model import Gpu, NvmlGpu, PciFunction, Placement
from gpud.plan.dra_slices import (
    MAX_COUNTER_SETS,
    MAX_COUNTERS,
    MAX_DEVICES_CONSUMING,
    DraInputs,
    build_slices,
    device_name,
    semver,
)
from gpud.profiles import MODELS
from gpud.sim import gpu_rules
from gpud.sim.state import SimGpu
from tests.support.present import present

MIG_MODELS = [k for k, m in MODELS.items() if m.mig_capable and not m.unknown]


def gpu(model: str, n: int, *, mig: int | None = 1, driver: str = "nvidia", group: int | None = None,
        companions: tuple[PciFunction, ...] = ()) -> Gpu:
    m = MODELS[model]
    fn = PciFunction(f"0000:{n + 16:02x}:00.0", 0x10DE, m.device, 0x10DE, m.subsystem_device or 0, 0x030200,
                     driver=driver, iommu_group=group)
    nvml = None if driver != "nvidia" else NvmlGpu(
        fn.address, f"GPU-{n}", m.name, minor=n, memory_mb=m.memory_mb, mig_capable=m.mig_capable,
        mig_mode=mig if m.mig_capable else None, profiles=m.profiles, compute_capability=m.compute_capability)
    return Gpu(n, fn, companions=companions, nvml=nvml)


def dynamic(g: Gpu) -> DesiredGpu:
    return DesiredGpu(g.pci, g.index, "layouts.x[0]", mig_enabled=True, dynamic=True)


def quantity(v: str) -> int:
    return int(v[:-2]) if v.endswith("Mi") else int(v)


def counter_sets(slices: list[dict]) -> dict[str, dict[str, int]]:
    return {cs["name"]: {k: quantity(c["value"]) for k, c in cs["counters"].items()}
            for s in slices for cs in s["spec"].get("sharedCounters", ())}


def all_devices(slices: list[dict]) -> dict[str, dict]:
    return {d["name"]: d for s in slices for d in s["spec"].get("devices", ())}


def fits(devs: list[dict], sets: dict[str, dict[str, int]]) -> bool:
    """What the scheduler checks for partitionable devices: per counter, the sum of what allocated
    devices consume is within the counter set's value."""
    used: dict[tuple[str, str], int] = {}
    for d in devs:
        for c in d.get("consumesCounters", ()):
            for k, v in c["counters"].items():
                used[c["counterSet"], k] = used.get((c["counterSet"], k), 0) + quantity(v["value"])
    return all(v <= sets[cs][k] for (cs, k), v in used.items())


@pytest.mark.parametrize("model", MIG_MODELS)
@pytest.mark.parametrize("seed", range(8))
def test_counters_admit_exactly_what_the_simulator_creates(model: str, seed: int):
    g = gpu(model, 0)
    out = build_slices(DraInputs("node-a", (g,), {g.pci: dynamic(g)}))
    sets = counter_sets(out.slices)
    devs = all_devices(out.slices)
    mig = [d for d in devs if out.devices[d].kind == "mig"]
    rng = random.Random(seed)
    m = MODELS[model]
    sim = SimGpu(address=g.pci, model=model, uuid="GPU-0", minor=0, mig_mode=1, mig_pending=1)
    chosen: list[dict] = []
    for _ in range(40):
        name = rng.choice(mig)
        sd = out.devices[name]
        trial = chosen + [devs[name]]
        try:
            prof = next(p for p in m.profiles if p.name == sd.profile)
            assert sd.placement is not None
            gpu_rules.create_gi(sim, m, present(gpu_rules.profile_of(m, prof.id)), sd.placement.start, sd.placement.size)
            created = True
        except gpu_rules.Refused:
            created = False
        assert fits(trial, sets) == created, (model, [d["name"] for d in trial])
        if created:
            chosen = trial
    # the whole GPU fits only beside nothing
    whole = devs[device_name("gpu", 0)]
    assert fits([whole], sets)
    assert not fits([whole, devs[mig[0]]], sets)


def test_seven_1g_on_an_h100_then_no_eighth():
    g = gpu("h100-80gb", 0)
    out = build_slices(DraInputs("node-a", (g,), {g.pci: dynamic(g)}))
    devs, sets = all_devices(out.slices), counter_sets(out.slices)
    ones = [n for n, sd in out.devices.items() if sd.profile == "1g.10gb"]
    assert len(ones) == 7
    assert fits([devs[n] for n in ones], sets)
    others = [n for n, sd in out.devices.items() if sd.kind == "mig" and n not in ones]
    assert all(not fits([devs[n] for n in ones] + [devs[o]], sets) for o in others)


def test_static_whole_vfio_vgpu_and_limits():
    whole = gpu("h100-80gb", 0, mig=0)
    vf = gpu("h100-80gb", 1, driver="vfio-pci", group=42,
             companions=(PciFunction("0000:11:00.1", 0x10DE, 0x22A3, 0, 0, 0x068000, driver="vfio-pci", iommu_group=42),))
    dyn = [gpu("h100-80gb", n) for n in range(2, 12)]
    inputs = DraInputs("node-a", (whole, vf, *dyn), {g.pci: dynamic(g) for g in dyn}, driver_version="570.124.06")
    out = build_slices(inputs)
    devs = all_devices(out.slices)
    assert devs["gpu-0"]["attributes"]["type"] == {"string": "gpu"}
    assert devs["gpu-0"]["attributes"]["driverVersion"] == {"version": "570.124.6"}
    assert devs["gpu-0"]["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:10:00.0"}
    assert out.devices["gpu-1-vfio"].group == ("0000:11:00.0", "0000:11:00.1")
    # one pool: every slice names the same pool, generation and count; devices and counters apart
    pools = {(s["spec"]["pool"]["name"], s["spec"]["pool"]["resourceSliceCount"]) for s in out.slices}
    assert pools == {("node-a", len(out.slices))}
    for s in out.slices:
        spec = s["spec"]
        assert ("devices" in spec) != ("sharedCounters" in spec)
        assert len(spec.get("sharedCounters", ())) <= MAX_COUNTER_SETS
        assert all(len(cs["counters"]) <= MAX_COUNTERS for cs in spec.get("sharedCounters", ()))
        assert len(spec.get("devices", ())) <= MAX_DEVICES_CONSUMING
    assert len(counter_sets(out.slices)) == 10
    assert len({s["metadata"]["name"] for s in out.slices}) == len(out.slices)


def test_foreign_instances_and_unhealthy_gpus_are_not_offered():
    g, h = gpu("h100-80gb", 0), gpu("h100-80gb", 1)
    out = build_slices(DraInputs("n", (g, h), {g.pci: dynamic(g), h.pci: dynamic(h)},
                                 foreign={g.pci: (Placement(4, 4),)}, unhealthy=frozenset({h.pci})))
    names = set(out.devices)
    assert "gpu-0" not in names and not any(n.startswith("gpu-1") for n in names)
    assert all(not (sd.placement and sd.placement.slices & {4, 5, 6, 7}) for sd in out.devices.values())
    assert "gpu-0-mig-1g-10gb-0" in names


def test_semver_and_names():
    assert semver("550.54.15") == "550.54.15" and semver("570.124.06") == "570.124.6" and semver("x") is None
    assert device_name("gpu", 3, "mig", "1g.10gb+me", 6) == "gpu-3-mig-1g-10gb-me-6"
