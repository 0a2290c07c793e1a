"""Node labels and advertised resources, from a simulated host observed through the real adapters.

Expected values come from outside gpud's code: GFD's and the device plugin's rules as their Go
sources state them (names, formats, which devices count), and numbers from the real H200 capture
(tests/fixtures/h200/nvml-sysfs-readonly.json: memory, SMs, engines, driver and CUDA versions).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpud.engine.observe.discovery import observe
from gpud.host.kernel.sysfs import Sysfs
from gpud.host.nvidia.nvml import Nvml
from gpud.layout.match import DEFAULT_MATCH
from gpud.plan.node_labels import (
    LabelInputs,
    advertised,
    arch_family,
    gfd_labels,
    gpud_labels,
    label_problem,
    mig_devices,
    node_labels,
    product,
    sanitise,
)
from gpud.sim import catalog
from gpud.sim import state as simstate
from gpud.sim.sysfs_tree import render

CAPTURE = json.loads((Path(__file__).parents[1] / "fixtures/h200/nvml-sysfs-readonly.json").read_text())
GPU0, GPU1, GPU2 = (catalog.gpu_address(i) for i in range(3))
MIB = 1 << 20


def _capture_profile(name: str) -> dict:
    return next(p for p in CAPTURE["gpu_instance_profiles"].values() if p.get("name") == f"MIG {name}")


def _observe(host):
    nvml = Nvml()
    nvml.open()
    try:
        obs = observe(Sysfs(host.sys_root, store=host.store), nvml, DEFAULT_MATCH)
        return obs.gpus, nvml.driver_version()
    finally:
        nvml.close()


def _mig(pci: str, layout: list[tuple[int, int, int]]) -> None:
    """Enable MIG on `pci` and create (GI profile id, start, CI slices) through the NVML adapter."""
    nvml = Nvml()
    nvml.open()
    try:
        assert nvml.set_mig_mode(pci, True) == 0
        ci_ids = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}  # NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE
        for profile_id, start, ci_slices in layout:
            gi = nvml.create_gpu_instance(pci, profile_id, start)
            nvml.create_compute_instance(pci, gi, ci_ids[ci_slices])
    finally:
        nvml.close()


def _to_vfio(host, pci: str) -> None:
    """The host as it boots with a GPU claimed by vfio-pci (udev override): a fixture, not an apply."""
    with simstate.locked(host.host_dir) as st:
        st.functions[pci].driver = "vfio-pci"
        if "vfio-pci" not in st.loaded_modules:
            st.loaded_modules.append("vfio-pci")
        render(host.host_dir, st)


def test_gfd_sanitise_and_family_follow_gfd():
    # resource.go: sanitise drops all but [A-Za-z0-9-_. ] and joins the words with "-"
    assert sanitise("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3"
    assert sanitise("  NVIDIA  A100-SXM4-40GB ") == "NVIDIA-A100-SXM4-40GB"
    assert sanitise("Quadro (R) RTX/8000") == "Quadro-R-RTX8000"
    assert product("NVIDIA H200", "MIG", "1g.18gb.me") == "NVIDIA-H200-MIG-1g.18gb.me"
    # getArchFamily
    assert [arch_family(*cc) for cc in ((7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (4, 0))] == [
        "volta", "turing", "ampere", "ampere", "ada-lovelace", "hopper", "blackwell", "blackwell", "undefined"]


def test_h200_mixed_labels_match_gfd_and_the_capture(sim_host):
    host = sim_host("h200:3")
    # GPU 0: 4 x 1g.18gb + 1 x 3g.71gb (the seed's partial-MIG shape on an H200); GPU 1 whole;
    # GPU 2 on vfio-pci (invisible to NVML, so neither GFD nor the device plugin count it).
    _mig(GPU0, [(19, 0, 1), (19, 1, 1), (19, 2, 1), (19, 3, 1), (9, 4, 3)])
    _to_vfio(host, GPU2)
    gpus, driver = _observe(host)
    inputs = LabelInputs(gpus=tuple(gpus), driver_version=driver, cuda_driver_version=CAPTURE["cuda_driver"],
                         compute={GPU0: tuple(CAPTURE["device"]["cc"]), GPU1: tuple(CAPTURE["device"]["cc"])})
    labels = gfd_labels(inputs)
    g1, g3 = _capture_profile("1g.18gb"), _capture_profile("3g.71gb")
    expected = {
        "nvidia.com/cuda.driver-version.full": "580.159.04",
        "nvidia.com/cuda.driver-version.major": "580",
        "nvidia.com/cuda.driver-version.minor": "159",
        "nvidia.com/cuda.driver-version.revision": "04",
        "nvidia.com/cuda.driver.major": "580",
        "nvidia.com/cuda.driver.minor": "159",
        "nvidia.com/cuda.driver.rev": "04",
        "nvidia.com/cuda.runtime-version.full": "13.0",
        "nvidia.com/cuda.runtime-version.major": "13",
        "nvidia.com/cuda.runtime-version.minor": "0",
        "nvidia.com/cuda.runtime.major": "13",
        "nvidia.com/cuda.runtime.minor": "0",
        "nvidia.com/gpu.compute.major": "9",
        "nvidia.com/gpu.compute.minor": "0",
        # both NVML-visible H200s count, the MIG one included (counts[name]++ for every device)
        "nvidia.com/gpu.count": "2",
        "nvidia.com/gpu.family": "hopper",
        "nvidia.com/gpu.memory": str(CAPTURE["device"]["memory"]["total"] // MIB),
        "nvidia.com/gpu.mode": "compute",
        "nvidia.com/gpu.product": "NVIDIA-H200",
        "nvidia.com/gpu.replicas": "1",  # the full GPU's labeler overrides the MIG-enabled one's 0
        "nvidia.com/gpu.sharing-strategy": "none",
        "nvidia.com/mig.capable": "true",
        "nvidia.com/mig.strategy": "mixed",
        "nvidia.com/mps.capable": "false",
        "nvidia.com/vgpu.present": "false",
    }
    for name, prof, count, ci_slices in (("1g.18gb", g1, 4, 1), ("3g.71gb", g3, 1, 3)):
        base = f"nvidia.com/mig-{name}"
        expected.update({
            f"{base}.count": str(count),
            f"{base}.product": f"NVIDIA-H200-MIG-{name}",
            f"{base}.replicas": "1",
            f"{base}.sharing-strategy": "none",
            f"{base}.memory": str(prof["memorySizeMB"]),
            f"{base}.multiprocessors": str(prof["multiprocessorCount"]),
            f"{base}.slices.gi": str(prof["sliceCount"]),
            f"{base}.slices.ci": str(ci_slices),
            f"{base}.engines.copy": str(prof["copyEngineCount"]),
            f"{base}.engines.decoder": str(prof["decoderCount"]),
            f"{base}.engines.encoder": str(prof["encoderCount"]),
            f"{base}.engines.jpeg": str(prof["jpegCount"]),
            f"{base}.engines.ofa": str(prof["ofaCount"]),
        })
    assert labels == expected
    ad = advertised(gpus)
    assert ad.resources == {"nvidia.com/gpu": 1, "nvidia.com/mig-1g.18gb": 4, "nvidia.com/mig-3g.71gb": 1}
    # kubevirt-gpu-device-plugin, utils/pci.ids 2025.07.11: "2335  GH100 [H200 SXM 141GB]"
    assert ad.sandbox == {"nvidia.com/GH100_H200_SXM_141GB": 1}
    assert ad.problems == ()


def test_seed_example_8_h100_partial_mig(sim_host):
    """The seed's example: 8 x H100 80GB, GPU 0 with 4 x 1g.10gb + 1 x 3g.40gb."""
    host = sim_host("h100-80gb:8")
    _mig(GPU0, [(19, 0, 1), (19, 1, 1), (19, 2, 1), (19, 3, 1), (9, 4, 3)])
    gpus, _ = _observe(host)
    ad = advertised(gpus)
    assert ad.resources == {"nvidia.com/gpu": 7, "nvidia.com/mig-1g.10gb": 4, "nvidia.com/mig-3g.40gb": 1}
    labels = gfd_labels(LabelInputs(gpus=tuple(gpus)))
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert labels["nvidia.com/gpu.count"] == "8"
    assert labels["nvidia.com/mig-1g.10gb.count"] == "4"
    assert labels["nvidia.com/mig-1g.10gb.product"] == "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb"


def test_a_gpus_mig_devices_are_worked_out_once_per_record(sim_host):
    """Each observation asks for every GPU's MIG devices (what the device plugin advertises); a
    record a re-read kept is the same object and gives the same devices back, a new record of the
    same GPU (its instances changed) gives its own."""
    host = sim_host("h100-80gb:2")
    _mig(GPU0, [(19, 0, 1), (19, 1, 1)])
    gpus, _ = _observe(host)
    first = mig_devices(gpus)
    again = mig_devices(tuple(gpus))
    assert [d.name for d in first] == ["1g.10gb", "1g.10gb"] and all(a is b for a, b in zip(first, again, strict=True))
    _mig(GPU0, [(9, 4, 3)])
    changed, _ = _observe(host)
    assert [d.name for d in mig_devices(changed)] == ["1g.10gb", "1g.10gb", "3g.40gb"]
    assert advertised(changed).resources == {"nvidia.com/gpu": 1, "nvidia.com/mig-1g.10gb": 2, "nvidia.com/mig-3g.40gb": 1}


def test_media_extension_profile_and_sub_divided_compute_instance(sim_host):
    host = sim_host("h200")
    # 1g.18gb+me at slice 6; a 3g.71gb split into three 1-slice compute instances at slice 0
    nvml = Nvml()
    nvml.open()
    try:
        nvml.set_mig_mode(GPU0, True)
        nvml.create_compute_instance(GPU0, nvml.create_gpu_instance(GPU0, 20, 6), 0)
        gi = nvml.create_gpu_instance(GPU0, 9, 0)
        for _ in range(3):
            nvml.create_compute_instance(GPU0, gi, 0)
    finally:
        nvml.close()
    gpus, _ = _observe(host)
    labels = gfd_labels(LabelInputs(gpus=tuple(gpus)))
    # GetName(): "+" -> "."; go-nvlib names a CI smaller than its GI "<c>c.<gi profile>"
    assert labels["nvidia.com/mig-1g.18gb.me.count"] == "1"
    assert labels["nvidia.com/mig-1g.18gb.me.engines.ofa"] == str(_capture_profile("1g.18gb+me")["ofaCount"])
    assert labels["nvidia.com/mig-1c.3g.71gb.count"] == "3"
    assert labels["nvidia.com/mig-1c.3g.71gb.slices.gi"] == "3"
    assert labels["nvidia.com/mig-1c.3g.71gb.slices.ci"] == "1"
    assert labels["nvidia.com/mig-1c.3g.71gb.memory"] == str(_capture_profile("3g.71gb")["memorySizeMB"])
    ad = advertised(gpus)
    # rm.go registers mig-<profile> only for profiles whose CI spans the GI; a 1c.3g device then
    # matches no resource pattern and buildMigDeviceMap fails the whole plugin.
    assert ad.resources == {"nvidia.com/mig-1g.18gb.me": 1}
    assert len(ad.problems) == 3 and all("1c.3g.71gb" in p and "refuses to start" in p for p in ad.problems)


def test_suffixed_blackwell_profiles_name_their_resources_as_the_device_plugin_does(sim_host):
    """RTX PRO 6000 instances of 1g.24gb+gfx, +me.all, -me and plain (profile ids 47, 65, 67, 14 of the
    capture). k8s-device-plugin internal/rm/rm.go names a MIG resource
    strings.ReplaceAll("mig-"+p.String(), "+", "."), where go-nvlib's MigProfileInfo.String() writes
    "+gfx", "+me.all" (one attribute) and "-me" (a negative one); api/config/v1 NewResourceName then
    requires a DNS subdomain, which all four are."""
    host = sim_host("rtx-pro-6000")
    _mig(GPU0, [(47, 0, 1), (65, 3, 1), (67, 6, 1), (14, 9, 1)])
    gpus, _ = _observe(host)
    ad = advertised(gpus)
    assert ad.resources == {"nvidia.com/mig-1g.24gb.gfx": 1, "nvidia.com/mig-1g.24gb.me.all": 1,
                            "nvidia.com/mig-1g.24gb-me": 1, "nvidia.com/mig-1g.24gb": 1}
    assert ad.problems == ()
    labels = gfd_labels(LabelInputs(gpus=tuple(gpus)))
    assert labels["nvidia.com/mig-1g.24gb.me.all.count"] == "1"
    assert labels["nvidia.com/mig-1g.24gb-me.engines.decoder"] == "0"  # the capture's -me row: 0 DEC
    assert labels["nvidia.com/mig-1g.24gb.me.all.engines.decoder"] == "4"  # +me.all: all four
    assert all(label_problem(k, v) is None for k, v in labels.items())


def test_single_strategy_uniform_and_invalid(sim_host):
    host = sim_host("h200:2")
    _mig(GPU0, [(19, 0, 1), (19, 1, 1)])
    _mig(GPU1, [(19, 0, 1)])
    gpus, _ = _observe(host)
    labels = gfd_labels(LabelInputs(gpus=tuple(gpus), mig_strategy="single"))
    prof = _capture_profile("1g.18gb")
    assert labels["nvidia.com/mig.strategy"] == "single"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H200-MIG-1g.18gb"
    assert labels["nvidia.com/gpu.count"] == "3"
    assert labels["nvidia.com/gpu.memory"] == str(prof["memorySizeMB"])
    assert labels["nvidia.com/gpu.multiprocessors"] == str(prof["multiprocessorCount"])
    assert not any(k.startswith("nvidia.com/mig-") for k in labels)
    assert advertised(gpus, mig_strategy="single").resources == {"nvidia.com/gpu": 3}

    _mig_more = Nvml()
    _mig_more.open()
    try:
        _mig_more.create_compute_instance(GPU1, _mig_more.create_gpu_instance(GPU1, 9, 4), 2)
    finally:
        _mig_more.close()
    gpus, _ = _observe(host)
    labels = gfd_labels(LabelInputs(gpus=tuple(gpus), mig_strategy="single"))
    # newInvalidMigStrategyLabeler
    assert {k: labels[k] for k in labels if k.startswith("nvidia.com/gpu.") and k.split(".")[-1] in
            ("product", "count", "replicas", "sharing-strategy", "memory")} == {
        "nvidia.com/gpu.product": "NVIDIA-H200-MIG-INVALID", "nvidia.com/gpu.count": "0",
        "nvidia.com/gpu.replicas": "0", "nvidia.com/gpu.sharing-strategy": "", "nvidia.com/gpu.memory": "0"}
    assert any("more than one MIG device type" in p for p in advertised(gpus, mig_strategy="single").problems)


def test_no_visible_gpu_writes_no_gfd_labels_but_gpud_labels(sim_host):
    host = sim_host("l40s:2")
    _to_vfio(host, GPU0)
    _to_vfio(host, GPU1)
    gpus, _ = _observe(host)
    inputs = LabelInputs(gpus=tuple(gpus), workloads={GPU0: "vm-passthrough", GPU1: "vm-passthrough"},
                         layout="vms", state="success")
    assert gfd_labels(inputs) == {}
    own = node_labels(inputs, gfd=True)
    assert own.labels == {
        "nvidia.com/gpud.layout": "vms",
        "nvidia.com/gpud.layout.state": "success",
        "nvidia.com/gpud.workload.container.count": "0",
        "nvidia.com/gpud.workload.vm-passthrough.count": "2",
        "nvidia.com/gpud.workload.vm-vgpu.count": "0",
    }
    # "26b9  AD102GL [L40S]" in the plugin's pci.ids
    assert advertised(gpus).sandbox == {"nvidia.com/AD102GL_L40S": 2}
    assert advertised(gpus).resources == {}


def test_workload_counts_only_gpus_whose_driver_agrees(sim_host):
    host = sim_host("h200:3")
    _to_vfio(host, GPU2)
    gpus, _ = _observe(host)
    # GPU 1 should go to passthrough but is still on nvidia (mid-change): it serves neither yet
    own = gpud_labels(LabelInputs(gpus=tuple(gpus), workloads={GPU0: "container", GPU1: "vm-passthrough",
                                                               GPU2: "vm-passthrough"}, state="pending"))
    assert own.labels["nvidia.com/gpud.workload.container.count"] == "1"
    assert own.labels["nvidia.com/gpud.workload.vm-passthrough.count"] == "1"
    assert own.labels["nvidia.com/gpud.layout.state"] == "pending"


def test_gfd_off_writes_only_gpud_labels_and_bad_names_are_left_out(sim_host):
    host = sim_host("h200")
    gpus, _ = _observe(host)
    out = node_labels(LabelInputs(gpus=tuple(gpus), layout="my layout!"), gfd=False)
    assert set(out.labels) == {"nvidia.com/gpud.layout.state", "nvidia.com/gpud.workload.container.count",
                               "nvidia.com/gpud.workload.vm-passthrough.count", "nvidia.com/gpud.workload.vm-vgpu.count"}
    assert len(out.warnings) == 1 and "my layout!" in out.warnings[0]
    with pytest.raises(ValueError, match="layout state 'done'"):
        gpud_labels(LabelInputs(gpus=tuple(gpus), state="done"))


@pytest.mark.parametrize(("key", "value", "ok"), [
    ("nvidia.com/gpu.product", "NVIDIA-H200", True),
    ("nvidia.com/gpu.sharing-strategy", "", True),
    ("nvidia.com/gpud.layout", "a" * 64, False),
    ("nvidia.com/gpud.layout", "-x", False),
    ("nvidia.com/mig-1g.10gb.engines.decoder", "1", True),
    ("Nvidia.com/x", "1", False),
])
def test_label_syntax(key, value, ok):
    assert (label_problem(key, value) is None) is ok
