"""gpud.host.nvidia.nvml on simulated hosts: what it reads, what it changes, and what read-only forbids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpud.host.nvidia.nvml import Nvml, NvmlError, normalize_pci
from gpud.host.readonly import ReadOnlyError
from gpud.model import Holder, Placement
from gpud.profiles import MODELS
from gpud.sim.state import SimFault, SimProcess, load, locked
from tests.support.present import present

GPU0, GPU1 = "0000:18:00.0", "0000:2a:00.0"
PROBE = Path(__file__).resolve().parents[1] / "fixtures" / "h200" / "nvml-sysfs-readonly.json"
MUTATING = ("nvmlDeviceSetMigMode", "nvmlDeviceCreateGpuInstance", "nvmlDeviceCreateGpuInstanceWithPlacement",
            "nvmlGpuInstanceCreateComputeInstance", "nvmlGpuInstanceCreateComputeInstanceWithPlacement",
            "nvmlComputeInstanceDestroy", "nvmlGpuInstanceDestroy")


@pytest.fixture
def nvml():
    n = Nvml()
    yield n
    n.close()


def test_normalize_pci():
    assert normalize_pci("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_pci("0000:DB:00.1") == "0000:db:00.1"


@pytest.mark.parametrize("model", ["a100-40gb", "h100-80gb", "h200", "l40s"])
def test_reads_each_simulated_gpu_as_its_state_file_holds_it(sim_host, nvml, model):
    host = sim_host(f"{model}:2", mig_on=[1] if model != "l40s" else [])
    state = load(host.host_dir)
    gpus = nvml.gpus()
    assert [g.pci for g in gpus] == sorted(state.gpus) == [GPU0, GPU1]
    for g in gpus:
        sim = state.gpus[g.pci]
        assert (g.uuid, g.minor) == (sim.uuid, sim.minor)
        if g.mig_capable:
            assert (g.mig_mode, g.mig_pending) == (sim.mig_mode, sim.mig_pending)
        else:
            assert model == "l40s" and (g.mig_mode, g.mig_pending, g.profiles, g.instances) == (None, None, (), ())


def test_reads_a_real_h200_as_its_capture_says(tmp_path, nvml):
    """The adapter on a replay of a real H200's NVML answers (gpud.sim.replay_nvml): every field it
    reports is checked against the capture, read here straight from the JSON."""
    from gpud.sim import replay_nvml

    capture = json.loads(PROBE.read_text())
    device = capture["device"]
    replay_nvml.install(PROBE)
    try:
        (g,) = nvml.gpus()
    finally:
        nvml.close()
        replay_nvml.uninstall()
    assert g.pci == device["pci"]["busId"].lower()[4:]
    assert (g.name, g.uuid, g.minor) == (device["name"], device["uuid"], device["minor"])
    assert g.memory_mb == device["memory"]["total"] >> 20
    assert list(g.compute_capability) == device["cc"]
    assert (g.mig_capable, [g.mig_mode, g.mig_pending], g.instances) == (True, device["mig_mode"], ())
    answered = [p for p in capture["gpu_instance_profiles"].values() if "id" in p]
    assert sorted(p.id for p in g.profiles) == sorted(p["id"] for p in answered)
    for p in g.profiles:
        real = next(r for r in answered if r["id"] == p.id)
        assert (f"MIG {p.name}", p.slices, p.memory_mb, p.sms, p.instance_count) == \
            (real["name"], real["sliceCount"], real["memorySizeMB"], real["multiprocessorCount"], real["instanceCount"])
        assert (p.copy_engines, p.decoders, p.encoders, p.jpegs, p.ofas) == \
            (real["copyEngineCount"], real["decoderCount"], real["encoderCount"], real["jpegCount"], real["ofaCount"])
        assert [(pl.start, pl.size) for pl in p.placements] == \
            sorted((r["start"], r["size"]) for r in capture["gpu_instance_possible_placements"][str(p.id)])


def test_observed_profiles_hold_no_ci_profiles_without_a_gpu_instance(sim_host, nvml):
    """Observed state is what NVML said: NVML describes a GI profile's CI profiles only through a
    live GPU instance of it, so with MIG on and no instance none are reported."""
    sim_host("h200:1", mig_on=[0])
    (g,) = nvml.gpus()
    assert g.mig_mode == 1 and g.instances == ()
    assert g.profiles and all(p.ci_profiles == () for p in g.profiles)


def test_only_nvidia_bound_gpus_are_read(sim_host, nvml):
    host = sim_host("h200:2")
    with locked(host.host_dir) as st:
        st.functions[GPU0].driver = "vfio-pci"
    assert [g.pci for g in nvml.gpus()] == [GPU1]
    assert nvml.gpu(GPU0) is None
    assert nvml.gpu(GPU1.upper()).pci == GPU1


def test_mig_lifecycle_through_the_adapter(sim_host, nvml):
    sim_host("h100-80gb")
    assert nvml.set_mig_mode(GPU0, True) == 0
    gi3 = nvml.create_gpu_instance(GPU0, 9, 4)
    gi1 = nvml.create_gpu_instance(GPU0, 19, 0)
    ci = nvml.create_compute_instance(GPU0, gi3, 2)
    assert ci == 0
    nvml.create_compute_instance(GPU0, gi1, 0)
    g = nvml.gpu(GPU0)
    assert (g.mig_mode, g.mig_pending) == (1, 1)
    by_id = {gi.id: gi for gi in g.instances}
    assert by_id[gi3].placement == Placement(4, 4) and by_id[gi3].profile_id == 9
    assert by_id[gi1].placement == Placement(0, 1)
    assert [c.slices for c in by_id[gi3].cis] == [3]
    uuids = [c.uuid for gi in g.instances for c in gi.cis]
    assert all(u.startswith("MIG-") for u in uuids) and len(set(uuids)) == 2
    assert nvml.gpu(GPU0).instances == g.instances  # stable across reads
    # CI profiles of a profile with a live GI come from NVML itself and agree with the table
    table = next(p for p in MODELS["h100-80gb"].profiles if p.id == 9)
    assert g.profile(9).ci_profiles == table.ci_profiles
    nvml.destroy_compute_instance(GPU0, gi3, 0)
    nvml.destroy_gpu_instance(GPU0, gi3)
    assert [gi.id for gi in nvml.gpu(GPU0).instances] == [gi1]


def test_create_error_carries_code_function_and_gpu(sim_host, nvml):
    sim_host("h200", mig_on=[0])
    nvml.create_gpu_instance(GPU0, 9, 4)
    with pytest.raises(NvmlError) as e:
        nvml.create_gpu_instance(GPU0, 19, 5)
    assert (e.value.code, e.value.function, e.value.pci) == (23, "nvmlDeviceCreateGpuInstanceWithPlacement", GPU0)
    assert "Insufficient Resources" in str(e.value)
    with pytest.raises(NvmlError) as e:
        nvml.destroy_gpu_instance(GPU0, 5)
    assert e.value.code == 6


def test_ampere_mode_change_is_read_back_as_pending(sim_host, nvml):
    sim_host("a100-40gb")
    status = nvml.set_mig_mode(GPU0, True)
    assert status != 0
    g = nvml.gpu(GPU0)
    assert (g.mig_mode, g.mig_pending, g.instances) == (0, 1, ())


def test_processes_with_names_from_proc_then_nvml(sim_host):
    host = sim_host("h200:2", mig_on=[0])
    nvml = Nvml(proc_root=str(host.proc_root))
    gi = nvml.create_gpu_instance(GPU0, 19, 0)
    nvml.create_compute_instance(GPU0, gi, 0)
    mig_uuid = present(nvml.gpu(GPU0)).instances[0].cis[0].uuid
    with locked(host.host_dir) as st:
        st.processes += [SimProcess(pid=301, name="mig-worker", device=mig_uuid),
                         SimProcess(pid=302, name="nvml-name", device=GPU1)]
    (host.proc_root / "302").mkdir(parents=True)
    (host.proc_root / "302" / "comm").write_text("from-proc\n")
    g0, g1 = nvml.gpus()
    assert g0.processes == ()
    assert g0.instances[0].cis[0].holders == (Holder(301, "mig-worker", mig_uuid),)
    assert g0.instances[0].holders == (Holder(301, "mig-worker", mig_uuid),)
    assert g1.processes == (Holder(302, "from-proc", GPU1),)
    nvml.close()


def test_read_only_refuses_before_touching_nvml(sim_host):
    host = sim_host("h200", mig_on=[0])
    rw = Nvml()
    gi = rw.create_gpu_instance(GPU0, 19, 0)
    rw.create_compute_instance(GPU0, gi, 0)
    rw.close()
    before = load(host.host_dir).calls
    ro = Nvml(read_only=True)
    g = ro.gpu(GPU0)
    assert len(present(g).instances) == 1
    for call in (lambda: ro.set_mig_mode(GPU0, False), lambda: ro.create_gpu_instance(GPU0, 9, 4),
                 lambda: ro.create_compute_instance(GPU0, gi, 0), lambda: ro.create_compute_instance(GPU0, gi, 0, 0),
                 lambda: ro.destroy_compute_instance(GPU0, gi, 0),
                 lambda: ro.destroy_gpu_instance(GPU0, gi)):
        with pytest.raises(ReadOnlyError, match="read-only mode"):
            call()
    after = load(host.host_dir).calls
    assert {f: after.get(f, 0) - before.get(f, 0) for f in MUTATING} == dict.fromkeys(MUTATING, 0)
    assert after["nvmlDeviceGetMigMode"] > before.get("nvmlDeviceGetMigMode", 0)  # it did read
    ro.close()


def test_fault_surfaces_as_nvml_error(sim_host, nvml):
    host = sim_host("h200:2", mig_on=[1])
    with locked(host.host_dir) as st:
        st.faults.append(SimFault(function="nvmlDeviceGetMigMode", nth=1, error=15))
    with pytest.raises(NvmlError) as e:
        nvml.gpu(GPU1)
    assert (e.value.code, e.value.function, e.value.pci) == (15, "nvmlDeviceGetMigMode", GPU1)
    assert len(nvml.gpus()) == 2  # one-shot


def test_one_lost_gpu_does_not_hide_the_others(sim_host, nvml, caplog):
    host = sim_host("h200:2", mig_on=[1])
    with locked(host.host_dir) as st:
        st.faults.append(SimFault(function="nvmlDeviceGetMigMode", nth=2, error=15))
    gpus = nvml.gpus()
    assert [g.pci for g in gpus] == [GPU0]
    assert "GPU 1 unreadable" in caplog.text and "GPU is lost" in caplog.text


def test_close_and_reopen(sim_host):
    host = sim_host("l40s")
    n = Nvml()
    assert n.driver_version() == "580.159.04"
    n.close()
    n.close()  # idempotent
    assert [g.pci for g in n.gpus()] == [GPU0]  # reopens on demand
    n.close()
    calls = load(host.host_dir).calls
    assert calls["nvmlInitWithFlags"] == 2 and calls["nvmlShutdown"] == 2


def test_driver_not_loaded_is_an_nvml_error(sim_host):
    host = sim_host("h200")
    with locked(host.host_dir) as st:
        st.loaded_modules.remove("nvidia")
    with pytest.raises(NvmlError) as e:
        Nvml().gpus()
    assert e.value.code == 9 and e.value.function == "nvmlInit"


def test_ci_placements_are_read_and_created_as_the_state_file_holds_them(sim_host, nvml):
    host = sim_host("h100-80gb", mig_on=[0])
    gi = nvml.create_gpu_instance(GPU0, 0, 0)  # 7g: 7 compute slices
    made = {nvml.create_compute_instance(GPU0, gi, 2, 3), nvml.create_compute_instance(GPU0, gi, 1, 0),
            nvml.create_compute_instance(GPU0, gi, 0, 6)}
    assert made == {0, 1, 2}
    (sim_gi,) = load(host.host_dir).gpus[GPU0].gis
    (read,) = nvml.gpu(GPU0).instances
    assert sorted((c.id, c.profile_id, c.start) for c in read.cis) == \
        sorted((c.id, c.profile_id, c.start) for c in sim_gi.cis) == [(0, 2, 3), (1, 1, 0), (2, 0, 6)]
    starts = {c.slices: c.starts for c in read_profiles(nvml, 0)}
    assert starts[1] == (0, 1, 2, 3, 4, 5, 6) and starts[3] == (0, 3) and starts[7] == (0,)
    with pytest.raises(NvmlError) as e:  # a 2c may start at 0, 2 or 4, never at 1
        nvml.create_compute_instance(GPU0, gi, 1, 1)
    assert e.value.code == 2 and e.value.function == "nvmlGpuInstanceCreateComputeInstanceWithPlacement"


def read_profiles(nvml, profile_id):
    """CI profiles of GI profile `profile_id` as the adapter read them from the live GI."""
    return next(p for p in nvml.gpu(GPU0).profiles if p.id == profile_id).ci_profiles
