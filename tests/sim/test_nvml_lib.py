"""The fake NVML library driven through nvidia-ml-py's own wrappers (as gpud.host.nvidia.nvml uses them)."""

from __future__ import annotations

import json
import subprocess
import sys
from ctypes import byref, c_uint
from pathlib import Path

import pynvml as N
import pytest

from gpud.sim import gpu_rules
from gpud.sim.state import SimProcess, load, locked

H200_GPUS = ("0000:18:00.0", "0000:2a:00.0")
# What a real H200 answered (read-only probe): the independent source for placements.
PROBE = json.loads((Path(__file__).resolve().parents[1] / "fixtures/h200/nvml-sysfs-readonly.json").read_text())
PROBE_1G = PROBE["gpu_instance_profiles"]["NVML_GPU_INSTANCE_PROFILE_1_SLICE"]
# What a real H200 answered to the calls NVIDIA's tools make, MIG off (2026-12-01 capture).
REAL_H200 = json.loads((Path(__file__).resolve().parents[1] / "fixtures/h200/nvml-and-files.json").read_text())


def code_of(fn, *args) -> int:
    with pytest.raises(N.NVMLError) as e:
        fn(*args)
    return e.value.value


@pytest.fixture
def h200(sim_host):
    """Two H200s (MIG on for the first) and an L40S; NVML initialised."""
    host = sim_host("h200:2", "l40s", mig_on=[0])
    N.nvmlInit()
    yield host
    N.nvmlShutdown()


def handle(i: int = 0):
    return N.nvmlDeviceGetHandleByIndex(i)


def place(h, profile_id: int, start: int, size: int):
    pl = N.c_nvmlGpuInstancePlacement_t(start, size)
    return N.nvmlDeviceCreateGpuInstanceWithPlacement(h, profile_id, byref(pl))


def add_process(host, device: str, pid: int = 4242, name: str = "trainer") -> None:
    with locked(host.host_dir) as st:
        st.processes.append(SimProcess(pid=pid, name=name, device=device))


# --- library lifecycle, enumeration, identity ----------------------------------------------------


def test_calls_before_init_are_uninitialized(sim_host):
    sim_host("h200")
    assert code_of(N.nvmlDeviceGetHandleByIndex, 0) == N.NVML_ERROR_UNINITIALIZED


def test_init_without_the_nvidia_module_fails(sim_host):
    host = sim_host("h200")
    with locked(host.host_dir) as st:
        st.loaded_modules.remove("nvidia")
    assert code_of(N.nvmlInit) == N.NVML_ERROR_DRIVER_NOT_LOADED


def test_unknown_function_is_function_not_found(h200):
    assert code_of(N.nvmlDeviceGetPowerUsage, handle()) == N.NVML_ERROR_FUNCTION_NOT_FOUND


def test_enumerates_nvidia_bound_present_gpus_in_pci_order(h200):
    assert N.nvmlDeviceGetCount() == 3
    buses = [N.nvmlDeviceGetPciInfo(handle(i)).busId for i in range(3)]
    assert buses == ["00000000:18:00.0", "00000000:2A:00.0", "00000000:3A:00.0"]
    with locked(h200.host_dir) as st:
        st.functions["0000:18:00.0"].driver = "vfio-pci"
        st.functions["0000:3a:00.0"].present = False
    # the session keeps what it enumerated at nvmlInit; the two that left are lost to it
    assert N.nvmlDeviceGetCount() == 3
    assert code_of(N.nvmlDeviceGetHandleByIndex, 0) == N.NVML_ERROR_GPU_IS_LOST
    assert code_of(N.nvmlDeviceGetHandleByIndex, 2) == N.NVML_ERROR_GPU_IS_LOST
    N.nvmlShutdown()
    N.nvmlInit()
    assert N.nvmlDeviceGetCount() == 1
    assert N.nvmlDeviceGetPciInfo(handle(0)).busId == "00000000:2A:00.0"


def test_a_gpu_coming_to_nvidia_is_seen_only_by_a_new_session(h200):
    """NVML enumerates at nvmlInit (docs/hardware/nvml-enumeration.md): a GPU rebound to nvidia
    later is unknown to the open session, by index, bus id and UUID, until shutdown + init."""
    with locked(h200.host_dir) as st:
        st.functions["0000:2a:00.0"].driver = "vfio-pci"
        uuid = st.gpus["0000:2a:00.0"].uuid
    N.nvmlShutdown()
    N.nvmlInit()
    assert N.nvmlDeviceGetCount() == 2
    with locked(h200.host_dir) as st:
        st.functions["0000:2a:00.0"].driver = "nvidia"
    assert N.nvmlDeviceGetCount() == 2
    assert code_of(N.nvmlDeviceGetHandleByPciBusId, b"0000:2a:00.0") == N.NVML_ERROR_NOT_FOUND
    assert code_of(N.nvmlDeviceGetHandleByUUID, uuid.encode()) == N.NVML_ERROR_NOT_FOUND
    N.nvmlInit()  # a nested init is counted, not a new enumeration
    assert N.nvmlDeviceGetCount() == 2
    N.nvmlShutdown()
    N.nvmlShutdown()
    N.nvmlInit()
    assert N.nvmlDeviceGetCount() == 3
    assert N.nvmlDeviceGetUUID(N.nvmlDeviceGetHandleByPciBusId(b"0000:2a:00.0")) == uuid
    assert N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByUUID(uuid.encode())) == 1


def test_a_handle_of_a_gpu_that_left_is_lost(h200):
    from gpud.sim import kernel

    h = N.nvmlDeviceGetHandleByPciBusId(b"0000:3a:00.0")
    kernel.unplug(h200.host_dir, "0000:3a:00.0")
    assert code_of(N.nvmlDeviceGetUUID, h) == N.NVML_ERROR_GPU_IS_LOST
    assert code_of(N.nvmlDeviceGetHandleByPciBusId, b"0000:3a:00.0") == N.NVML_ERROR_GPU_IS_LOST
    kernel.plug(h200.host_dir, "0000:3a:00.0")  # back at the same address: a new device to the driver
    assert load(h200.host_dir).functions["0000:3a:00.0"].driver == "nvidia"
    assert code_of(N.nvmlDeviceGetUUID, h) == N.NVML_ERROR_GPU_IS_LOST
    N.nvmlShutdown()
    N.nvmlInit()
    assert N.nvmlDeviceGetUUID(N.nvmlDeviceGetHandleByPciBusId(b"0000:3a:00.0")).startswith("GPU-")


def test_identity_queries_match_the_fixture_formats(h200):
    h = handle(0)
    info = N.nvmlDeviceGetPciInfo(h)
    assert info.busIdLegacy == "0000:18:00.0"
    assert (info.domain, info.bus, info.device) == (0, 0x18, 0)
    assert info.pciDeviceId == 590680286 and info.pciSubSystemId == 415174878  # as on the real H200
    assert N.nvmlDeviceGetName(h) == "NVIDIA H200"
    assert N.nvmlDeviceGetUUID(h).startswith("GPU-")
    assert N.nvmlDeviceGetSerial(h).isdigit()
    assert N.nvmlDeviceGetMinorNumber(handle(1)) == 1
    assert N.nvmlDeviceGetIndex(handle(2)) == 2
    assert N.nvmlDeviceGetMemoryInfo(h).total == 143771 * 2**20
    assert N.nvmlSystemGetDriverVersion() == "580.159.04"
    assert N.nvmlSystemGetNVMLVersion() == "13.580.159.04"
    assert N.nvmlSystemGetCudaDriverVersion() == 13000
    assert N.nvmlErrorString(N.NVML_ERROR_IN_USE) == "In use by another client"


def test_handles_by_pci_bus_id_any_spelling_and_by_uuid(h200):
    uuid = N.nvmlDeviceGetUUID(handle(1))
    for spelling in ("0000:2a:00.0", "00000000:2A:00.0", "2a:00.0"):
        assert N.nvmlDeviceGetUUID(N.nvmlDeviceGetHandleByPciBusId(spelling)) == uuid
    assert N.nvmlDeviceGetUUID(N.nvmlDeviceGetHandleByUUID(uuid)) == uuid
    assert code_of(N.nvmlDeviceGetHandleByPciBusId, "0000:0c:00.0") == N.NVML_ERROR_NOT_FOUND  # the NIC
    assert code_of(N.nvmlDeviceGetHandleByIndex, 3) == N.NVML_ERROR_INVALID_ARGUMENT


def test_stale_handle_after_unbind_is_gpu_lost(h200):
    h = handle(1)
    with locked(h200.host_dir) as st:
        st.functions["0000:2a:00.0"].driver = None
    assert code_of(N.nvmlDeviceGetName, h) == N.NVML_ERROR_GPU_IS_LOST


# --- GI profiles and placements ------------------------------------------------------------------


def test_profile_info_takes_index_and_reports_id(h200):
    h = handle(1)  # MIG disabled: profile queries still answer, as on the real H200
    assert N.nvmlDeviceGetMigMode(h) == [0, 0]
    expect = {N.NVML_GPU_INSTANCE_PROFILE_1_SLICE: (19, "MIG 1g.18gb"),
              N.NVML_GPU_INSTANCE_PROFILE_7_SLICE: (0, "MIG 7g.141gb"),
              N.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: (20, "MIG 1g.18gb+me"),
              N.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2: (15, "MIG 1g.35gb")}
    for index, (pid, name) in expect.items():
        info = N.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
        assert (info.id, info.name) == (pid, name)
    v1 = N.nvmlDeviceGetGpuInstanceProfileInfo(h, N.NVML_GPU_INSTANCE_PROFILE_3_SLICE, version=1)
    assert (v1.id, v1.memorySizeMB, v1.multiprocessorCount) == (9, 71424, 60)
    assert N.nvmlDeviceGetGpuInstanceProfileInfoById(h, 14).sliceCount == 2
    assert code_of(N.nvmlDeviceGetGpuInstanceProfileInfo, h, N.NVML_GPU_INSTANCE_PROFILE_8_SLICE) == \
        N.NVML_ERROR_NOT_SUPPORTED
    assert code_of(N.nvmlDeviceGetGpuInstanceProfileInfo, h, N.NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX) == \
        N.NVML_ERROR_INVALID_ARGUMENT


def test_non_mig_gpu_answers_not_supported(h200):
    h = handle(2)
    assert code_of(N.nvmlDeviceGetMigMode, h) == N.NVML_ERROR_NOT_SUPPORTED
    assert code_of(N.nvmlDeviceGetGpuInstanceProfileInfo, h, 0) == N.NVML_ERROR_NOT_SUPPORTED
    assert code_of(N.nvmlDeviceSetMigMode, h, 1) == N.NVML_ERROR_NOT_SUPPORTED


def test_possible_placements_two_call_pattern_with_mig_disabled(h200):
    h = handle(1)
    count = c_uint(0)
    N.nvmlDeviceGetGpuInstancePossiblePlacements(h, 15, None, byref(count))
    assert count.value == 4
    arr = (N.c_nvmlGpuInstancePlacement_t * count.value)()
    N.nvmlDeviceGetGpuInstancePossiblePlacements(h, 15, arr, byref(count))
    assert [(p.start, p.size) for p in arr] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    # The driver ignores a short count: it writes every placement and says how many (the real
    # H200, tests/fixtures/h200/2026-12-04/nvml-real.json); an array truly too short would be
    # written past its end, which the simulator refuses as the crash it would be.
    roomy, short = (N.c_nvmlGpuInstancePlacement_t * 8)(), c_uint(1)
    N.nvmlDeviceGetGpuInstancePossiblePlacements(h, 15, roomy, byref(short))
    assert short.value == 4 and [(p.start, p.size) for p in roomy][:4] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    with pytest.raises(ValueError, match="past its end"):
        N.nvmlDeviceGetGpuInstancePossiblePlacements(h, 15, (N.c_nvmlGpuInstancePlacement_t * 2)(), byref(c_uint(2)))


def test_remaining_capacity(h200):
    h = handle(0)
    assert N.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19) == 7
    place(h, 9, 4, 4)
    assert N.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19) == 4
    assert N.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 9) == 1
    assert N.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 0) == 0


# --- GPU instances -------------------------------------------------------------------------------


def test_create_gi_needs_mig_enabled_and_not_pending(h200):
    h1 = handle(1)
    assert code_of(place, h1, 19, 0, 1) == N.NVML_ERROR_NOT_SUPPORTED
    with locked(h200.host_dir) as st:
        st.gpus["0000:18:00.0"].mig_pending = 0
    assert code_of(place, handle(0), 19, 0, 1) == N.NVML_ERROR_NOT_SUPPORTED
    # MIG off: no such GPU instance, as the real H200 answers (tests/fixtures/h200/nvml-and-files.json)
    assert code_of(N.nvmlDeviceGetGpuInstanceById, h1, 1) == REAL_H200["nvmlDeviceGetGpuInstanceById(1) MIG off"]["error"]
    count = c_uint(5)
    N.nvmlDeviceGetGpuInstances(h1, 19, (N.c_nvmlGpuInstance_t * 7)(), byref(count))  # listing answers (probe)
    assert count.value == 0


def test_create_with_placement_rules(h200):
    h = handle(0)
    assert code_of(place, h, 9, 2, 4) == N.NVML_ERROR_INVALID_ARGUMENT  # start not allowed for 3g
    assert code_of(place, h, 9, 0, 2) == N.NVML_ERROR_INVALID_ARGUMENT  # wrong size
    assert code_of(place, h, 77, 0, 1) == N.NVML_ERROR_INVALID_ARGUMENT  # unknown profile id
    gi = place(h, 9, 4, 4)
    assert code_of(place, h, 19, 5, 1) == N.NVML_ERROR_INSUFFICIENT_RESOURCES  # overlap
    assert code_of(place, h, 15, 6, 2) == N.NVML_ERROR_INSUFFICIENT_RESOURCES
    place(h, 20, 0, 1)
    assert code_of(place, h, 20, 1, 1) == N.NVML_ERROR_INSUFFICIENT_RESOURCES  # only one +me
    info = N.nvmlGpuInstanceGetInfo(gi)
    # GPU 0 numbers its GIs as the tree (gpud.sim.gi_ids): the 3g at 4:4 is the second half, GI 2.
    assert (info.id, info.profileId, info.placement.start, info.placement.size) == (2, 9, 4, 4)


def test_placement_passed_by_value_is_the_crash_it_would_be(h200):
    pl = N.c_nvmlGpuInstancePlacement_t(0, 1)
    with pytest.raises(TypeError, match="byref"):
        N.nvmlDeviceCreateGpuInstanceWithPlacement(handle(0), 19, pl)


def test_create_without_placement_takes_only_real_placements(h200):
    """The driver's choice of slot without a placement is not documented (the order the simulator
    uses is inferred), so what is checked is what a real H200 does say: every start is one of the
    possible placements the real GPU listed, instances never overlap, state.json records exactly
    what NVML answered, and when no placement is left the call fails with INSUFFICIENT_RESOURCES."""
    h = handle(0)
    real_starts = {p["start"] for p in PROBE["gpu_instance_possible_placements"]["19"]}
    gis = [N.nvmlDeviceCreateGpuInstance(h, 19) for _ in range(PROBE_1G["instanceCount"])]
    infos = [N.nvmlGpuInstanceGetInfo(gi) for gi in gis]
    starts = [i.placement.start for i in infos]
    assert set(starts) == real_starts and len(starts) == len(real_starts)
    assert code_of(N.nvmlDeviceCreateGpuInstance, h, 19) == N.NVML_ERROR_INSUFFICIENT_RESOURCES
    assert code_of(N.nvmlDeviceCreateGpuInstance, h, 9) == N.NVML_ERROR_INSUFFICIENT_RESOURCES
    recorded = {(gi.id, gi.profile_id, gi.start, gi.size) for gi in load(h200.host_dir).gpus[H200_GPUS[0]].gis}
    assert recorded == {(i.id, i.profileId, i.placement.start, i.placement.size) for i in infos}


def test_3g_first_then_four_1g_fits(h200):
    h = handle(0)
    assert N.nvmlGpuInstanceGetInfo(N.nvmlDeviceCreateGpuInstance(h, 9)).placement.start == 4
    starts = sorted(N.nvmlGpuInstanceGetInfo(N.nvmlDeviceCreateGpuInstance(h, 19)).placement.start
                    for _ in range(4))
    assert starts == [0, 1, 2, 3]


def test_gi_ids_match_the_state_file_and_listing_is_per_profile(h200):
    """Which id the driver hands out is not a documented rule (real captures differ from any simple
    one), so ids are checked against the simulator's state file: each GI NVML names is the one
    state.json holds under that id, ids stay unique, and a destroyed GI's handle is NOT_FOUND."""
    h = handle(0)
    a, b, c = place(h, 19, 0, 1), place(h, 19, 1, 1), place(h, 14, 2, 2)
    N.nvmlGpuInstanceDestroy(b)
    d = place(h, 9, 4, 4)
    live = {N.nvmlGpuInstanceGetInfo(x).id: (N.nvmlGpuInstanceGetInfo(x).profileId,
                                            N.nvmlGpuInstanceGetInfo(x).placement.start) for x in (a, c, d)}
    assert len(live) == 3
    recorded = {gi.id: (gi.profile_id, gi.start) for gi in load(h200.host_dir).gpus[H200_GPUS[0]].gis}
    assert recorded == live and set(live.values()) == {(19, 0), (14, 2), (9, 4)}
    count = c_uint(0)
    arr = (N.c_nvmlGpuInstance_t * 7)()
    N.nvmlDeviceGetGpuInstances(h, 19, arr, byref(count))
    assert count.value == 1 and N.nvmlGpuInstanceGetInfo(arr[0]).placement.start == 0
    for gi_id, (profile_id, _) in recorded.items():
        assert N.nvmlGpuInstanceGetInfo(N.nvmlDeviceGetGpuInstanceById(h, gi_id)).profileId == profile_id
    unused = next(i for i in range(1, 9) if i not in recorded)
    assert code_of(N.nvmlDeviceGetGpuInstanceById, h, unused) == N.NVML_ERROR_NOT_FOUND
    assert code_of(N.nvmlGpuInstanceGetInfo, b) == N.NVML_ERROR_NOT_FOUND  # handle of a destroyed GI


# --- compute instances ---------------------------------------------------------------------------


def test_ci_profiles_create_list_destroy(h200):
    h = handle(0)
    gi = place(h, 9, 0, 4)
    eng = N.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    p1 = N.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, N.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, eng)
    assert (p1.id, p1.sliceCount, p1.instanceCount, p1.name) == (0, 1, 3, "MIG 1c.3g.71gb")
    p3 = N.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, N.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, eng)
    assert (p3.id, p3.multiprocessorCount, p3.name) == (2, 60, "MIG 3g.71gb")
    assert code_of(N.nvmlGpuInstanceGetComputeInstanceProfileInfo, gi,
                   N.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE, eng) == N.NVML_ERROR_NOT_SUPPORTED
    cis = [N.nvmlGpuInstanceCreateComputeInstance(gi, 0) for _ in range(3)]
    assert [N.nvmlComputeInstanceGetInfo(c).id for c in cis] == [0, 1, 2]
    assert [N.nvmlComputeInstanceGetInfo(c).placement.start for c in cis] == [0, 1, 2]
    assert code_of(N.nvmlGpuInstanceCreateComputeInstance, gi, 0) == N.NVML_ERROR_INSUFFICIENT_RESOURCES
    assert N.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, 0) == 0
    count = c_uint(0)
    arr = (N.c_nvmlComputeInstance_t * 3)()
    N.nvmlGpuInstanceGetComputeInstances(gi, 0, arr, byref(count))
    assert count.value == 3
    assert code_of(N.nvmlGpuInstanceDestroy, gi) == N.NVML_ERROR_IN_USE
    for c in cis:
        N.nvmlComputeInstanceDestroy(c)
    N.nvmlGpuInstanceDestroy(gi)
    assert load(h200.host_dir).gpus["0000:18:00.0"].gis == []


def test_destroy_with_process_on_the_mig_device_is_in_use(h200):
    h = handle(0)
    gi = place(h, 19, 0, 1)
    ci = N.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    uuid = N.nvmlDeviceGetUUID(N.nvmlDeviceGetMigDeviceHandleByIndex(h, 0))
    add_process(h200, uuid)
    assert code_of(N.nvmlComputeInstanceDestroy, ci) == N.NVML_ERROR_IN_USE


# --- MIG devices and processes -------------------------------------------------------------------


def test_mig_device_handles_ordered_by_gi_then_ci(h200):
    h = handle(0)
    assert N.nvmlDeviceGetMaxMigDeviceCount(h) == 7
    assert N.nvmlDeviceGetMaxMigDeviceCount(handle(1)) == 0
    g_low = place(h, 9, 4, 4)  # GI 2: ids follow the placement (GPU 0 numbers as the tree)
    g_high = place(h, 19, 0, 1)  # GI 7, created later and listed later all the same
    N.nvmlGpuInstanceCreateComputeInstance(g_high, 0)
    N.nvmlGpuInstanceCreateComputeInstance(g_low, 1)  # 2c: its one placement is 0:2
    N.nvmlGpuInstanceCreateComputeInstance(g_low, 0)  # 1c: the lowest free slot, 2:1
    seen = []
    for i in range(3):
        m = N.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
        assert N.nvmlDeviceIsMigDeviceHandle(m)
        seen.append((N.nvmlDeviceGetGpuInstanceId(m), N.nvmlDeviceGetComputeInstanceId(m), N.nvmlDeviceGetName(m)))
        parent = N.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)
        assert N.nvmlDeviceGetUUID(parent) == N.nvmlDeviceGetUUID(h)
    assert seen == [(2, 0, "NVIDIA H200 MIG 2c.3g.71gb"), (2, 1, "NVIDIA H200 MIG 1c.3g.71gb"),
                    (7, 0, "NVIDIA H200 MIG 1g.18gb")]
    assert code_of(N.nvmlDeviceGetMigDeviceHandleByIndex, h, 3) == N.NVML_ERROR_NOT_FOUND
    assert code_of(N.nvmlDeviceGetMigDeviceHandleByIndex, h, 7) == N.NVML_ERROR_INVALID_ARGUMENT
    is_mig = N.nvmlDeviceIsMigDeviceHandle(h)
    assert isinstance(is_mig, c_uint) and not is_mig
    # a whole-GPU handle, as the real H200 answers (tests/fixtures/h200/nvml-and-files.json)
    assert code_of(N.nvmlDeviceGetGpuInstanceId, h) == REAL_H200["nvmlDeviceGetGpuInstanceId (MIG off, full GPU)"]["error"]
    assert code_of(N.nvmlDeviceGetComputeInstanceId, h) == REAL_H200["nvmlDeviceGetComputeInstanceId (full GPU)"]["error"]
    with pytest.raises(N.NVMLError) as e:
        N.nvmlDeviceGetAttributes_v2(h)
    assert e.value.value == REAL_H200["nvmlDeviceGetAttributes_v2 (full GPU)"]["error"]
    with pytest.raises(N.NVMLError) as e:
        N.nvmlDeviceGetMigDeviceHandleByIndex(handle(1), 0)  # MIG off
    assert e.value.value == REAL_H200["nvmlDeviceGetMigDeviceHandleByIndex(0) MIG off"]["error"]


def test_mig_uuid_is_stable_for_the_life_of_the_ci(h200):
    h = handle(0)
    gi = place(h, 19, 3, 1)
    N.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    uuid = N.nvmlDeviceGetUUID(N.nvmlDeviceGetMigDeviceHandleByIndex(h, 0))
    assert uuid.startswith("MIG-")
    place(h, 9, 4, 4)  # more devices do not change it
    assert N.nvmlDeviceGetUUID(N.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)) == uuid
    assert N.nvmlDeviceGetGpuInstanceId(N.nvmlDeviceGetHandleByUUID(uuid)) == 10  # 1g at 3:1 on a "tree" GPU
    assert load(h200.host_dir).gpus["0000:18:00.0"].gis[0].cis[0].uuid == uuid


def test_processes_per_gpu_and_per_mig_device(h200):
    """A MIG device lists its processes; the GPU lists its own and, with MIG on, every MIG device's."""
    h0, h1 = handle(0), handle(1)
    gi = place(h0, 19, 0, 1)
    N.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    m = N.nvmlDeviceGetMigDeviceHandleByIndex(h0, 0)
    add_process(h200, N.nvmlDeviceGetUUID(m), pid=10, name="mig-job")
    add_process(h200, "0000:2a:00.0", pid=11)
    add_process(h200, N.nvmlDeviceGetUUID(h1), pid=12)
    # the GPU's own handle, MIG on: the aggregate, each process with its GI and CI ids (NVML API
    # reference, nvmlDeviceGetComputeRunningProcesses_v3: "In MIG mode, if device handle is provided,
    # the API returns aggregate information")
    (agg,) = N.nvmlDeviceGetComputeRunningProcesses(h0)
    assert (agg.pid, agg.gpuInstanceId, agg.computeInstanceId) == (10, 7, 0)
    procs = N.nvmlDeviceGetComputeRunningProcesses(h1)
    assert sorted(p.pid for p in procs) == [11, 12]
    assert procs[0].gpuInstanceId == 0xFFFFFFFF and procs[0].usedGpuMemory == 256 * 2**20
    (mp,) = N.nvmlDeviceGetComputeRunningProcesses(m)
    assert (mp.pid, mp.gpuInstanceId, mp.computeInstanceId) == (10, 7, 0)  # 1g at 0:1: GI 7
    assert N.nvmlSystemGetProcessName(10) == "mig-job"
    assert code_of(N.nvmlSystemGetProcessName, 99) == N.NVML_ERROR_NOT_FOUND


# --- MIG mode ------------------------------------------------------------------------------------


def test_hopper_idle_mode_change_applies_at_once(h200):
    h = handle(1)
    assert N.nvmlDeviceSetMigMode(h, 1) == N.NVML_SUCCESS
    assert N.nvmlDeviceGetMigMode(h) == [1, 1]
    assert N.nvmlDeviceGetMaxMigDeviceCount(h) == 7


def test_hopper_busy_mode_change_stays_pending_until_reset(h200):
    h = handle(1)
    add_process(h200, "0000:2a:00.0")
    assert N.nvmlDeviceSetMigMode(h, 1) == N.NVML_ERROR_IN_USE
    assert N.nvmlDeviceGetMigMode(h) == [0, 1]
    with locked(h200.host_dir) as st:
        gpu_rules.reset_gpu(st, "0000:2a:00.0")
    assert N.nvmlDeviceGetMigMode(h) == [1, 1]


def test_ampere_mode_change_waits_for_reset(sim_host):
    host = sim_host("a100-40gb")
    N.nvmlInit()
    h = handle(0)
    assert N.nvmlDeviceSetMigMode(h, 1) == N.NVML_ERROR_RESET_REQUIRED
    assert N.nvmlDeviceGetMigMode(h) == [0, 1]
    assert code_of(place, h, 19, 0, 1) == N.NVML_ERROR_NOT_SUPPORTED
    with locked(host.host_dir) as st:
        gpu_rules.reset_gpu(st, "0000:18:00.0")
    assert N.nvmlDeviceGetMigMode(h) == [1, 1]
    place(h, 19, 0, 1)


def test_disabling_with_gis_is_in_use_and_reset_to_off_drops_gis(h200):
    h = handle(0)
    place(h, 19, 0, 1)
    assert code_of(N.nvmlDeviceSetMigMode, h, 0) == N.NVML_ERROR_IN_USE
    with locked(h200.host_dir) as st:
        st.gpus["0000:18:00.0"].mig_pending = 0
        gpu_rules.reset_gpu(st, "0000:18:00.0")
        assert st.gpus["0000:18:00.0"].gis == [] and st.gpus["0000:18:00.0"].mig_mode == 0


# --- faults, stats, sharing ----------------------------------------------------------------------


def test_fault_hits_the_nth_call_once(h200):
    with locked(h200.host_dir) as st:
        st.faults.append(nvml_lib_fault("nvmlDeviceGetMigMode", 2, N.NVML_ERROR_UNKNOWN))
    h = handle(0)
    N.nvmlDeviceGetMigMode(h)
    assert code_of(N.nvmlDeviceGetMigMode, h) == N.NVML_ERROR_UNKNOWN
    N.nvmlDeviceGetMigMode(h)
    assert load(h200.host_dir).faults == []


def test_fault_by_pynvml_name_hits_the_versioned_symbol(h200):
    with locked(h200.host_dir) as st:
        st.faults.append(nvml_lib_fault("nvmlDeviceGetComputeRunningProcesses", 1, N.NVML_ERROR_GPU_IS_LOST))
    assert code_of(N.nvmlDeviceGetComputeRunningProcesses, handle(0)) == N.NVML_ERROR_GPU_IS_LOST


def nvml_lib_fault(function: str, nth: int, error: int):
    from gpud.sim.state import SimFault

    return SimFault(function=function, nth=nth, error=error)


def test_every_call_is_counted_under_its_c_symbol(h200):
    before = load(h200.host_dir).calls
    N.nvmlDeviceGetCount()
    N.nvmlDeviceGetCount()
    N.nvmlDeviceGetGpuInstanceProfileInfo(handle(0), 0)
    after = load(h200.host_dir).calls
    assert after["nvmlDeviceGetCount_v2"] - before.get("nvmlDeviceGetCount_v2", 0) == 2
    assert after["nvmlDeviceGetGpuInstanceProfileInfoV"] - before.get("nvmlDeviceGetGpuInstanceProfileInfoV", 0) == 1


def test_two_processes_share_one_host(h200):
    """A GI created by another process (its own fake library, same DIR) is seen here, and ours there."""
    place(handle(0), 19, 0, 1)
    code = f"""
import pynvml as N
from ctypes import byref, c_uint
from pathlib import Path
from gpud import sim
sim.install({str(h200.host_dir)!r})
N.nvmlInit()
h = N.nvmlDeviceGetHandleByPciBusId("0000:18:00.0")
arr = (N.c_nvmlGpuInstance_t * 7)(); n = c_uint()
N.nvmlDeviceGetGpuInstances(h, 19, arr, byref(n))
pl = N.c_nvmlGpuInstancePlacement_t(4, 4)
N.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, byref(pl))
print(n.value)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1"
    n = c_uint()
    N.nvmlDeviceGetGpuInstances(handle(0), 9, (N.c_nvmlGpuInstance_t * 2)(), byref(n))
    assert n.value == 1


# --- compute-instance placements (docs/hardware/mig-ids.md) --------------------------------------


def ci_place(gi, ci_profile_id: int, start: int, size: int):
    pl = N.c_nvmlComputeInstancePlacement_t(start, size)
    return N.nvmlGpuInstanceCreateComputeInstanceWithPlacement(gi, ci_profile_id, byref(pl))


def ci_possible(gi, ci_profile_id: int) -> list[tuple[int, int]]:
    count = c_uint(0)
    N.nvmlGpuInstanceGetComputeInstancePossiblePlacements(gi, ci_profile_id, None, byref(count))
    arr = (N.c_nvmlComputeInstancePlacement_t * count.value)()
    N.nvmlGpuInstanceGetComputeInstancePossiblePlacements(gi, ci_profile_id, arr, byref(count))
    return [(arr[i].start, arr[i].size) for i in range(count.value)]


def test_ci_possible_placements_two_call_pattern(h200):
    gi = place(handle(0), 9, 0, 4)  # 3g: 3 compute slices
    assert ci_possible(gi, 0) == [(0, 1), (1, 1), (2, 1)]
    assert ci_possible(gi, 1) == [(0, 2)]
    assert ci_possible(gi, 2) == [(0, 3)]
    small = (N.c_nvmlComputeInstancePlacement_t * 2)()
    count = c_uint(2)
    assert code_of(N.nvmlGpuInstanceGetComputeInstancePossiblePlacements, gi, 0, small,
                   byref(count)) == N.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 3
    assert code_of(ci_possible, gi, 3) == N.NVML_ERROR_NOT_SUPPORTED  # a 3g has no 4c


def test_ci_create_with_placement_is_as_strict_as_nvml(h200):
    gi = place(handle(0), 9, 0, 4)
    assert code_of(ci_place, gi, 1, 1, 2) == N.NVML_ERROR_INVALID_ARGUMENT  # a 2c only sits at 0
    assert code_of(ci_place, gi, 0, 1, 2) == N.NVML_ERROR_INVALID_ARGUMENT  # wrong size
    one = ci_place(gi, 0, 1, 1)
    assert code_of(ci_place, gi, 1, 0, 2) == N.NVML_ERROR_INSUFFICIENT_RESOURCES  # overlaps the 1c at 1
    assert code_of(ci_place, gi, 0, 1, 1) == N.NVML_ERROR_INSUFFICIENT_RESOURCES  # taken
    two = ci_place(gi, 0, 2, 1)
    info = [N.nvmlComputeInstanceGetInfo(c) for c in (one, two)]
    assert [(i.id, i.placement.start, i.placement.size) for i in info] == [(0, 1, 1), (1, 2, 1)]
    assert N.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, 1) == 0
    assert N.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, 0) == 1
    with pytest.raises(TypeError, match="by value"):
        N.nvmlGpuInstanceCreateComputeInstanceWithPlacement(gi, 0, N.c_nvmlComputeInstancePlacement_t(0, 1))
    # Without a placement the lowest free slot is taken; the state file records every slot.
    N.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    (sim_gi,) = load(h200.host_dir).gpus["0000:18:00.0"].gis
    assert sorted(c.start for c in sim_gi.cis) == [0, 1, 2]


# --- the state file is written when the state changes, the counters stay exact -------------------


def _file_id(host) -> tuple[int, int, bytes]:
    p = Path(host.host_dir) / "state.json"
    st = p.stat()
    return st.st_ino, st.st_mtime_ns, p.read_bytes()


def test_a_read_leaves_the_state_file_alone_and_is_counted_for_other_processes(h200):
    """Reads change nothing on the host, so state.json is not rewritten for them (it was, on every
    call: 1.8 ms a call on 64 GPUs); `gpud-sim stats`, another process, still counts each one."""
    h = handle(0)
    N.nvmlDeviceGetMigMode(h)
    before, calls0 = _file_id(h200), load(h200.host_dir).calls
    for _ in range(5):
        N.nvmlDeviceGetMigMode(h)
        N.nvmlDeviceGetUUID(h)
    assert _file_id(h200) == before
    out = subprocess.run([sys.executable, "-m", "gpud.sim.cli", "stats", str(h200.host_dir), "--json"],
                         capture_output=True, text=True, check=True).stdout
    calls = json.loads(out)["calls"]
    assert calls["nvmlDeviceGetMigMode"] - calls0["nvmlDeviceGetMigMode"] == 5
    assert calls["nvmlDeviceGetUUID"] - calls0.get("nvmlDeviceGetUUID", 0) == 5


def test_a_change_is_written_at_once_and_another_process_s_change_is_seen(h200):
    h = handle(0)
    before = _file_id(h200)
    gi = place(h, 19, 0, 1)
    assert _file_id(h200) != before
    on_file = json.loads((Path(h200.host_dir) / "state.json").read_text())["gpus"][H200_GPUS[0]]["gis"]
    assert [(g["profile_id"], g["start"]) for g in on_file] == [(19, 0)]
    # another process destroys it: this process's library must not answer from what it read before
    subprocess.run([sys.executable, "-c", f"""
import pynvml as N
from gpud import sim
sim.install({str(h200.host_dir)!r})
N.nvmlInit()
h = N.nvmlDeviceGetHandleByPciBusId("0000:18:00.0")
N.nvmlGpuInstanceDestroy(N.nvmlDeviceGetGpuInstanceById(h, {N.nvmlGpuInstanceGetInfo(gi).id}))
"""], capture_output=True, text=True, check=True)
    n = c_uint()
    N.nvmlDeviceGetGpuInstances(h, 19, (N.c_nvmlGpuInstance_t * 7)(), byref(n))
    assert n.value == 0
    # and a change through the host lock (gpud-sim's own edits) likewise
    add_process(h200, load(h200.host_dir).gpus[H200_GPUS[1]].uuid, pid=4343)
    assert [p.pid for p in N.nvmlDeviceGetComputeRunningProcesses(handle(1))] == [4343]
