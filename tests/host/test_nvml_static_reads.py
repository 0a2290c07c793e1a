"""gpud.host.nvidia.nvml reads a GPU's fixed facts once per session (gpud.host.nvidia.nvml_static) and drops
them whenever the session closes: re-init, reset, rebind, hot-plug. The simulator's own call
counters (its state file, what `gpud-sim stats` prints) say which NVML calls were made; its state
file says what the GPUs hold."""

from __future__ import annotations

from collections import Counter

import pytest

from gpud.host.nvidia.nvml import Nvml
from gpud.profiles import MODELS
from gpud.sim import kernel
from gpud.sim.state import SimProcess, load, locked

GPU0, GPU1 = "0000:18:00.0", "0000:2a:00.0"
# Calls whose answers are fixed for a session: asked again only after the session closed.
# What a MIG device seen before need not be asked again (its UUID names them while it exists).
MIG_DEVICE_FIXED = ("nvmlDeviceGetGpuInstanceId", "nvmlDeviceGetComputeInstanceId",
                    "nvmlGpuInstanceGetComputeInstances", "nvmlComputeInstanceGetInfo")
STATIC = ("nvmlDeviceGetGpuInstanceProfileInfoV", "nvmlDeviceGetGpuInstancePossiblePlacements_v2",
          "nvmlGpuInstanceGetComputeInstanceProfileInfoV", "nvmlGpuInstanceGetComputeInstancePossiblePlacements",
          "nvmlDeviceGetName", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex")


def _calls(host) -> Counter[str]:
    return Counter(load(host.host_dir).calls)


def _static_calls(before: Counter[str], after: Counter[str]) -> dict[str, int]:
    return {f: after[f] - before[f] for f in STATIC if after[f] - before[f]}


def _layout(host, pci: str) -> list[tuple[int, int, int, list[tuple[int, int, str]]]]:
    """The GPU's GIs and CIs as the simulator's state file holds them."""
    g = load(host.host_dir).gpus[pci]
    return sorted((gi.id, gi.profile_id, gi.start, sorted((c.id, c.profile_id, c.uuid) for c in gi.cis))
                  for gi in g.gis)


def _read_layout(nvml: Nvml, pci: str) -> list[tuple[int, int, int, list[tuple[int, int, str]]]]:
    g = nvml.gpu(pci)
    assert g is not None
    return sorted((gi.id, gi.profile_id, gi.placement.start, sorted((c.id, c.profile_id, c.uuid) for c in gi.cis))
                  for gi in g.instances)


@pytest.fixture
def mig_host(sim_host):
    """Two H100s with MIG on, GPU 0 holding a 3g (one CI) and two 1g (one CI each)."""
    host = sim_host("h100-80gb:2", mig_on=[0, 1])
    n = Nvml()
    for profile, start in ((9, 4), (19, 0), (19, 1)):
        gi = n.create_gpu_instance(GPU0, profile, start)
        n.create_compute_instance(GPU0, gi, 2 if profile == 9 else 0)
    n.close()
    return host


def test_a_second_read_asks_only_what_changes_and_sees_the_same(mig_host):
    with Nvml() as nvml:
        first = nvml.gpus()
        c1 = _calls(mig_host)
        second = nvml.gpus()
        c2 = _calls(mig_host)
    assert second == first
    assert _static_calls(c1, c2) == {}
    assert not {f: c2[f] - c1[f] for f in MIG_DEVICE_FIXED if c2[f] - c1[f]}  # the MIG devices were seen
    assert c2["nvmlDeviceGetMigMode"] - c1["nvmlDeviceGetMigMode"] == 2  # what changes is asked each time
    with Nvml() as fresh:  # a new session reads everything and agrees
        assert fresh.gpus() == first


def test_a_change_by_someone_else_is_seen_by_the_next_read(mig_host):
    """Instances are never cached: what another NVML client creates or destroys shows at once."""
    with Nvml() as nvml, Nvml() as other:
        assert _read_layout(nvml, GPU0) == _layout(mig_host, GPU0)
        gi = other.create_gpu_instance(GPU0, 19, 2)
        other.create_compute_instance(GPU0, gi, 0)
        assert _read_layout(nvml, GPU0) == _layout(mig_host, GPU0)
        assert len(_layout(mig_host, GPU0)) == 4
        other.destroy_compute_instance(GPU0, gi, 0)
        other.destroy_gpu_instance(GPU0, gi)
        assert _read_layout(nvml, GPU0) == _layout(mig_host, GPU0)


def test_reinit_reads_the_static_again(mig_host):
    with Nvml() as nvml:
        nvml.gpus()
        c1 = _calls(mig_host)
        nvml.close()
        nvml.open()
        nvml.gpus()
        c2 = _calls(mig_host)
    asked = _static_calls(c1, c2)
    assert asked["nvmlDeviceGetGpuInstanceProfileInfoV"] > 0 and asked["nvmlDeviceGetName"] == 2


def test_a_reset_goes_through_a_closed_session_and_the_static_is_read_again(sim_host):
    """A pending MIG mode takes effect at the reset (GPU 1): the read after it shows the new mode,
    and the fixed facts are asked again (a reset may follow a driver or firmware change)."""
    host = sim_host("a100-40gb:2")
    with Nvml() as nvml:
        nvml.gpus()
        nvml.set_mig_mode(GPU1, True)
        assert load(host.host_dir).gpus[GPU1].mig_pending == 1 and load(host.host_dir).gpus[GPU1].mig_mode == 0
        nvml.suspend()  # what gpud's reset does (gpud.engine.steps): NVML closed across the reset
        try:
            kernel.Store(host.host_dir)(str(host.sys_root / f"bus/pci/devices/{GPU1}/reset"), b"1")
        finally:
            nvml.resume()
        c1 = _calls(host)
        (g0, g1) = nvml.gpus()
        c2 = _calls(host)
    assert (g1.mig_mode, g1.mig_pending) == (1, 1) == (load(host.host_dir).gpus[GPU1].mig_mode, 1)
    assert _static_calls(c1, c2)["nvmlDeviceGetName"] == 2


def test_a_rebind_suspends_the_session_and_the_static_is_read_again(mig_host):
    with Nvml() as nvml:
        nvml.gpus()
        nvml.suspend()
        kernel.Store(mig_host.host_dir)(str(mig_host.sys_root / "bus/pci/drivers/nvidia/unbind"), GPU1.encode())
        nvml.resume()
        c1 = _calls(mig_host)
        gpus = nvml.gpus(on_nvidia=[GPU0])
        c2 = _calls(mig_host)
    assert [g.pci for g in gpus] == [GPU0]
    assert _static_calls(c1, c2)["nvmlDeviceGetName"] == 1


def test_a_gpu_swapped_by_hot_plug_is_read_as_the_new_card(sim_host):
    """GPU 1 (an H100) is unplugged and an A100 plugged into the same slot: the next read must show
    the A100's name and profile table, not the H100's the session had kept."""
    host = sim_host("h100-80gb", "a100-40gb")
    a100 = load(host.host_dir).gpus[GPU1]
    with locked(host.host_dir) as st:  # the same slot first holds an H100 too
        st.gpus[GPU1].model = "h100-80gb"
    with Nvml() as nvml:
        before = {g.pci: g for g in nvml.gpus(on_nvidia=[GPU0, GPU1])}
        assert before[GPU1].name == before[GPU0].name
        kernel.unplug(host.host_dir, GPU1)
        with locked(host.host_dir) as st:
            st.gpus[GPU1].model = a100.model
        kernel.plug(host.host_dir, GPU1)
        after = {g.pci: g for g in nvml.gpus(on_nvidia=[GPU0, GPU1])}
    assert after[GPU1].name == MODELS["a100-40gb"].name != before[GPU1].name
    assert {p.name for p in after[GPU1].profiles} == {p.name for p in MODELS["a100-40gb"].profiles}
    assert after[GPU1].memory_mb < before[GPU1].memory_mb


def test_a_mig_mode_change_asks_that_gpus_memory_again_and_keeps_its_tables(sim_host):
    host = sim_host("h100-80gb:2")
    with Nvml() as nvml:
        nvml.gpus()
        nvml.set_mig_mode(GPU0, True)
        c1 = _calls(host)
        after = {g.pci: g for g in nvml.gpus()}
        c2 = _calls(host)
    assert _static_calls(c1, c2) == {"nvmlDeviceGetMemoryInfo": 1}
    assert after[GPU0].mig_mode == load(host.host_dir).gpus[GPU0].mig_mode == 1
    with Nvml() as fresh:  # a new session reads everything and agrees
        assert {g.pci: g for g in fresh.gpus()} == after


def _read_cis(nvml: Nvml, pci: str) -> list[tuple[int, int, list[tuple[int, int, int | None, str]]]]:
    g = nvml.gpu(pci)
    assert g is not None
    return sorted((gi.id, gi.profile_id, sorted((c.id, c.profile_id, c.start, c.uuid) for c in gi.cis))
                  for gi in g.instances)


def _state_cis(host, pci: str) -> list[tuple[int, int, list[tuple[int, int, int | None, str]]]]:
    g = load(host.host_dir).gpus[pci]
    return sorted((gi.id, gi.profile_id, sorted((c.id, c.profile_id, c.start, c.uuid) for c in gi.cis))
                  for gi in g.gis)


def test_a_ci_made_again_under_the_same_ids_is_read_as_the_new_one(mig_host):
    """The 3g GI's one CI (3 slices) is destroyed and another client makes a 1-slice CI in its place,
    under the same ids: the next read shows the new CI's profile, placement and UUID as the
    simulator's state file holds them, not what was known of the old MIG device; gpud's own
    destroy likewise."""
    with Nvml() as nvml, Nvml() as other:
        before = _read_cis(nvml, GPU0)
        assert before == _state_cis(mig_host, GPU0)
        gi3 = next(gi for gi in load(mig_host.host_dir).gpus[GPU0].gis if gi.profile_id == 9)
        other.destroy_compute_instance(GPU0, gi3.id, gi3.cis[0].id)
        assert other.create_compute_instance(GPU0, gi3.id, 0, start=1) == gi3.cis[0].id
        after = _read_cis(nvml, GPU0)
        assert after == _state_cis(mig_host, GPU0) != before
        nvml.destroy_compute_instance(GPU0, gi3.id, gi3.cis[0].id)
        nvml.create_compute_instance(GPU0, gi3.id, 1, start=0)
        assert _read_cis(nvml, GPU0) == _state_cis(mig_host, GPU0) != after


def test_the_processes_in_mig_devices_come_from_one_list_per_gpu(mig_host):
    """As root, the GPU's own process list (NVML's aggregate in MIG mode, with GI and CI ids) gives
    every MIG device's holders: one process query per GPU, the holders where the state file puts them."""
    st = load(mig_host.host_dir)
    cis = [ci for gi in st.gpus[GPU0].gis for ci in gi.cis]
    with locked(mig_host.host_dir) as s:
        s.processes.append(SimProcess(pid=4242, name="trainer", device=cis[1].uuid))
        s.processes.append(SimProcess(pid=4243, name="whole", device=st.gpus[GPU1].uuid))
    with Nvml() as nvml:
        nvml.gpus()
        c1 = _calls(mig_host)
        gpus = {g.pci: g for g in nvml.gpus()}
        c2 = _calls(mig_host)
    held = {ci.uuid: [h.pid for h in ci.holders] for gi in gpus[GPU0].instances for ci in gi.cis}
    assert held == {ci.uuid: [4242] if ci is cis[1] else [] for ci in cis}
    assert [h.pid for h in gpus[GPU1].processes] == [4243] and gpus[GPU0].processes == ()
    # one query per GPU, which nvidia-ml-py makes as two C calls when there are processes (size, then list)
    assert c2["nvmlDeviceGetComputeRunningProcesses_v3"] - c1["nvmlDeviceGetComputeRunningProcesses_v3"] == 2 * 2


# A packed GPU: 7 x 1g.10gb (GI profile 19, one 1-slice CI each) use every memory slice a GI could
# take, so a read that finds the same MIG devices lists no GI (MigReader._unchanged).
GI_LISTING = ("nvmlDeviceGetGpuInstances", "nvmlGpuInstanceGetInfo")


@pytest.fixture
def packed_host(sim_host):
    host = sim_host("h100-80gb:2", mig_on=[0, 1])
    n = Nvml()
    for start in range(7):
        n.create_compute_instance(GPU0, n.create_gpu_instance(GPU0, 19, start), 0)
    n.close()
    return host


def _asked(before: Counter[str], after: Counter[str], names: tuple[str, ...]) -> dict[str, int]:
    return {f: after[f] - before[f] for f in names if after[f] - before[f]}


def test_an_unchanged_packed_gpu_is_read_through_its_mig_devices_alone(packed_host):
    """The read after one that found the same MIG devices lists no GI and no CI: one handle and one
    UUID per MIG device, and shows what the state file holds."""
    with Nvml() as nvml:
        first = _read_cis(nvml, GPU0)
        c1 = _calls(packed_host)
        second = _read_cis(nvml, GPU0)
        c2 = _calls(packed_host)
    assert second == first == _state_cis(packed_host, GPU0)
    assert _asked(c1, c2, GI_LISTING + MIG_DEVICE_FIXED) == {}
    assert c2["nvmlDeviceGetUUID"] - c1["nvmlDeviceGetUUID"] == 7


def test_a_gi_made_again_in_the_same_place_by_someone_else_shows_its_new_mig_device(packed_host):
    """Another client destroys a 1g GI with its CI and makes it again, same profile and placement
    (and, by the simulator's lowest free id, the same GI and CI ids): only the MIG device's UUID
    tells, and the next read shows the new one."""
    with Nvml() as nvml, Nvml() as other:
        before = _read_cis(nvml, GPU0)
        _read_cis(nvml, GPU0)
        gi = next(g for g in load(packed_host.host_dir).gpus[GPU0].gis if g.start == 3)
        other.destroy_compute_instance(GPU0, gi.id, gi.cis[0].id)
        other.destroy_gpu_instance(GPU0, gi.id)
        again = other.create_gpu_instance(GPU0, 19, 3)
        other.create_compute_instance(GPU0, again, 0)
        after = _read_cis(nvml, GPU0)
    assert after == _state_cis(packed_host, GPU0)
    assert {u for *_, cis in before for *_, u in cis} != {u for *_, cis in after for *_, u in cis}


def test_a_ci_made_again_under_a_kept_gi_shows_its_new_mig_device(packed_host):
    with Nvml() as nvml, Nvml() as other:
        _read_cis(nvml, GPU0)
        before = _read_cis(nvml, GPU0)
        gi = load(packed_host.host_dir).gpus[GPU0].gis[0]
        other.destroy_compute_instance(GPU0, gi.id, gi.cis[0].id)
        other.create_compute_instance(GPU0, gi.id, 0)
        after = _read_cis(nvml, GPU0)
    assert after == _state_cis(packed_host, GPU0) != before


def test_a_ci_destroyed_by_someone_else_leaves_its_gi_shown_empty(packed_host):
    with Nvml() as nvml, Nvml() as other:
        _read_cis(nvml, GPU0)
        _read_cis(nvml, GPU0)
        gi = load(packed_host.host_dir).gpus[GPU0].gis[2]
        other.destroy_compute_instance(GPU0, gi.id, gi.cis[0].id)
        after = _read_cis(nvml, GPU0)
        assert after == _state_cis(packed_host, GPU0)
        assert (gi.id, gi.profile_id, []) in after
        other.create_compute_instance(GPU0, gi.id, 0)
        assert _read_cis(nvml, GPU0) == _state_cis(packed_host, GPU0)


def test_a_gi_reshaped_in_freed_slices_by_someone_else_is_read_as_the_new_one(packed_host):
    """The 1g at slice 6 gives way to a 1g.20gb (profile 15) at 6-7: the set of memory slices in use
    grows, the MIG device is new; the next read shows the new GI's profile and placement."""
    with Nvml() as nvml, Nvml() as other:
        _read_cis(nvml, GPU0)
        _read_cis(nvml, GPU0)
        gi = next(g for g in load(packed_host.host_dir).gpus[GPU0].gis if g.start == 6)
        other.destroy_compute_instance(GPU0, gi.id, gi.cis[0].id)
        other.destroy_gpu_instance(GPU0, gi.id)
        other.create_compute_instance(GPU0, other.create_gpu_instance(GPU0, 15, 6), 0)
        assert _read_layout(nvml, GPU0) == _layout(packed_host, GPU0)


def test_an_empty_gi_made_in_free_memory_by_someone_else_is_seen(mig_host):
    """GPU 0 leaves memory slices 2-3 free: a GI made there without a CI has no MIG device, and the
    next read lists it all the same."""
    with Nvml() as nvml, Nvml() as other:
        _read_cis(nvml, GPU0)
        _read_cis(nvml, GPU0)
        other.create_gpu_instance(GPU0, 19, 2)
        after = _read_layout(nvml, GPU0)
    assert after == _layout(mig_host, GPU0) and len(after) == 4


def test_a_process_started_in_an_unchanged_mig_device_is_seen(packed_host):
    with Nvml() as nvml:
        _read_cis(nvml, GPU0)
        _read_cis(nvml, GPU0)
        ci = load(packed_host.host_dir).gpus[GPU0].gis[4].cis[0]
        with locked(packed_host.host_dir) as s:
            s.processes.append(SimProcess(pid=5151, name="job", device=ci.uuid))
        g = nvml.gpu(GPU0)
    assert g is not None
    assert {c.uuid: [h.pid for h in c.holders] for gi in g.instances for c in gi.cis if c.holders} == {ci.uuid: [5151]}
