"""Fidelity: what gpud reads from a simulated H200 equals what a real H200 reported.

The references are the read-only captures of one real H200 host (tests/fixtures/h200): the NVML
probe (nvml-sysfs-readonly.json) and `nvidia-smi mig -lgip` / `-lgipp`.
"""

from __future__ import annotations

import json
import re
from ctypes import byref, c_uint
from pathlib import Path

import pynvml as N
import pytest

from gpud.host.nvidia.nvml import Nvml
from tests.support.smi_mig_tables import lgip_by_id, read_lgipp

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "h200"
PROBE = json.loads((FIX / "nvml-sysfs-readonly.json").read_text())
GPU = "0000:18:00.0"


@pytest.fixture
def gpu(sim_host):
    sim_host("h200")
    nvml = Nvml()
    g = nvml.gpu(GPU)
    nvml.close()
    return g


def test_parsers_read_every_profile():
    assert len(lgip_by_id((FIX / "nvidia-smi-mig-lgip.txt").read_text())) == 7
    assert len(read_lgipp((FIX / "nvidia-smi-mig-lgipp.txt").read_text())) == 7


def test_device_identity(gpu):
    dev = PROBE["device"]
    assert gpu.name == dev["name"]
    assert gpu.memory_mb * 2**20 == dev["memory"]["total"]
    assert [gpu.mig_mode, gpu.mig_pending] == dev["mig_mode"]
    assert gpu.minor == dev["minor"]
    assert gpu.instances == () and gpu.processes == ()


def test_profiles_match_the_nvml_probe(gpu):
    ours = {p.id: p for p in gpu.profiles}
    probed = {v["id"]: v for v in PROBE["gpu_instance_profiles"].values() if "id" in v}
    assert set(ours) == set(probed)
    for pid, v in probed.items():
        p = ours[pid]
        assert "MIG " + p.name == v["name"]
        assert (p.slices, p.instance_count, p.sms, p.memory_mb) == (
            v["sliceCount"], v["instanceCount"], v["multiprocessorCount"], v["memorySizeMB"])
        assert (p.copy_engines, p.decoders, p.encoders, p.jpegs, p.ofas) == (
            v["copyEngineCount"], v["decoderCount"], v["encoderCount"], v["jpegCount"], v["ofaCount"])
        assert [(pl.start, pl.size) for pl in p.placements] == [
            (x["start"], x["size"]) for x in PROBE["gpu_instance_possible_placements"][str(pid)]]


def test_profiles_match_nvidia_smi(gpu):
    lgip = lgip_by_id((FIX / "nvidia-smi-mig-lgip.txt").read_text())
    lgipp = read_lgipp((FIX / "nvidia-smi-mig-lgipp.txt").read_text())
    ours = {p.id: p for p in gpu.profiles}
    assert set(ours) == set(lgip) == set(lgipp)
    for pid, row in lgip.items():
        p = ours[pid]
        assert p.name == row["name"]
        assert f"{p.memory_mb / 1024:.2f}" == row["gib"]
        assert (p.instance_count, p.sms, p.decoders, p.encoders, p.copy_engines, p.jpegs, p.ofas) == (
            row["total"], row["sm"], row["dec"], row["enc"], row["ce"], row["jpeg"], row["ofa"])
        assert [(pl.start, pl.size) for pl in p.placements] == lgipp[pid]


def test_raw_nvml_answers_match_the_probe(sim_host):
    """Per index constant, the same id or the same error code; remaining capacity; PCI ids."""
    sim_host("h200")
    N.nvmlInit()
    try:
        h = N.nvmlDeviceGetHandleByIndex(0)
        for const, v in PROBE["gpu_instance_profiles"].items():
            index = getattr(N, const)
            if "id" in v:
                assert N.nvmlDeviceGetGpuInstanceProfileInfo(h, index).id == v["id"], const
            else:
                with pytest.raises(N.NVMLError) as e:
                    N.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
                assert (e.value.value, str(e.value)) == (v["code"], v["nvml_error"]), const
        for const, cap in PROBE["remaining_capacity"].items():
            pid = PROBE["gpu_instance_profiles"][const]["id"]
            assert N.nvmlDeviceGetGpuInstanceRemainingCapacity(h, pid) == cap, const
        for pid, existing in PROBE["gpu_instances_existing"].items():
            count = c_uint(99)  # MIG is disabled on the probe host; listing still answers
            N.nvmlDeviceGetGpuInstances(h, int(pid), (N.c_nvmlGpuInstance_t * 8)(), byref(count))
            assert count.value == existing, pid
        pci = N.nvmlDeviceGetPciInfo(h)
        assert (pci.pciDeviceId, pci.pciSubSystemId) == (PROBE["device"]["pci"]["pciDeviceId"],
                                                         PROBE["device"]["pci"]["pciSubSystemId"])
        assert re.fullmatch(r"[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.\d", pci.busId)
        assert N.nvmlDeviceGetMaxMigDeviceCount(h) == PROBE["device"]["max_mig"]
        assert N.nvmlSystemGetDriverVersion() == PROBE["driver"]
        assert N.nvmlSystemGetNVMLVersion() == PROBE["nvml_version"]
        assert N.nvmlSystemGetCudaDriverVersion() == PROBE["cuda_driver"]
    finally:
        N.nvmlShutdown()


def test_compute_capability_and_cuda_version_as_captured(sim_host):
    """GFD's gpu.family / compute labels and CUDA version labels come from these two calls."""
    sim_host("h200")
    N.nvmlInit()
    try:
        h = N.nvmlDeviceGetHandleByIndex(0)
        assert list(N.nvmlDeviceGetCudaComputeCapability(h)) == PROBE["device"]["cc"]
        assert N.nvmlSystemGetCudaDriverVersion() == PROBE["cuda_driver"]
    finally:
        N.nvmlShutdown()
