"""NVIDIA Container Toolkit's own `nvidia-ctk cdi generate` (v1.20.2, NVML mode; installed by
scripts/install-anchors, make test runs it) on a simulated host with MIG devices, under `gpud-sim
exec`, the host's directory as its driver root.

The oracle for what the spec must hold is the simulator's state file (GPUs, their minors, GPU and
compute instances with their UUIDs) and the simulated host's own files: the capability minors in
/proc/driver/nvidia-caps/mig-minors and the major and minor of each node under DIR/dev, read with
stat. Each node's major must be one no driver of this machine holds (docs/hardware/dev-nodes.md).
Then gpud's CDI refresh (`--nvidia-ctk`) runs the same tool after a MIG change and its spec names
exactly the MIG devices the state file holds.
"""

from __future__ import annotations

import os
import stat

import pynvml
import pytest
import yaml

from gpud.sim import dev_nodes, nvml_lib
from gpud.sim.host_exec import run_counted
from gpud.sim.state import load
from tests.support.anchors import anchor
from tests.support.daemon import DaemonOn, wait_until

pytestmark = pytest.mark.tools


def _make_mig_devices(host) -> None:
    """GPU 0: a 1g GI with its full CI, and a 3g GI split into two 1c CIs (H100 80GB profile ids,
    docs/hardware/mig-profiles.md)."""
    nvml_lib.install(str(host))
    try:
        pynvml.nvmlInit()
        dev = pynvml.nvmlDeviceGetHandleByIndex(0)
        def gi(index: int):
            return pynvml.nvmlDeviceCreateGpuInstance(dev, pynvml.nvmlDeviceGetGpuInstanceProfileInfo(dev, index).id)

        small = gi(pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
        info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            small, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        pynvml.nvmlGpuInstanceCreateComputeInstance(small, info.id)
        big = gi(pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
        for _ in range(2):
            pynvml.nvmlGpuInstanceCreateComputeInstance(big, info.id)
        pynvml.nvmlShutdown()
    finally:
        nvml_lib.uninstall()


def _mig_minors(host) -> dict[str, int]:
    lines = (host / "proc/driver/nvidia-caps/mig-minors").read_text().splitlines()
    return {cap: int(minor) for cap, minor in (line.split() for line in lines)}


def _node(host, path: str) -> tuple[str, str, int, int]:
    st = os.stat(host / path.lstrip("/"))
    assert stat.S_ISCHR(st.st_mode), f"{path}: not a character node"
    return path, str(host / path.lstrip("/")), os.major(st.st_rdev), os.minor(st.st_rdev)


def _expected(host) -> dict[str, set]:
    """CDI device name (UUID) -> its device nodes, from the state file and the host's files."""
    st = load(host)
    minors = _mig_minors(host)
    out: dict[str, set] = {}
    for address in sorted(st.gpus):
        g = st.gpus[address]
        gpu = f"/dev/nvidia{g.minor}"
        if not g.mig_mode:
            out[g.uuid] = {_node(host, gpu)}
            continue
        for gi in g.gis:
            for ci in gi.cis:
                out[ci.uuid] = {
                    _node(host, gpu),
                    _node(host, f"/dev/nvidia-caps/nvidia-cap{minors[f'gpu{g.minor}/gi{gi.id}/access']}"),
                    _node(host, f"/dev/nvidia-caps/nvidia-cap{minors[f'gpu{g.minor}/gi{gi.id}/ci{ci.id}/access']}"),
                }
    return out


def _listed(spec: dict) -> dict[str, set]:
    return {d["name"]: {(n["path"], n.get("hostPath", n["path"]), n.get("major", 0), n.get("minor", 0))
                        for n in d["containerEdits"]["deviceNodes"]}
            for d in spec["devices"] if d["name"].startswith(("GPU-", "MIG-"))}


def test_cdi_spec_lists_every_gpu_and_mig_device_with_the_hosts_nodes(tmp_path, sim_dir):
    ctk = anchor("nvidia-ctk")
    host = sim_dir("h100-80gb:2", mig_on=[0])
    _make_mig_devices(host)
    spec_path = tmp_path / "nvidia.yaml"
    res, calls = run_counted(host, [str(ctk), "cdi", "generate", f"--driver-root={host}", f"--output={spec_path}"],
                             timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    spec = yaml.safe_load(spec_path.read_text())
    want = _expected(host)
    assert len(want) == 4  # GPU 1 whole, three MIG devices on GPU 0 (a MIG-enabled GPU is not a device)
    assert _listed(spec) == want
    majors = {n[2] for nodes in want.values() for n in nodes}
    assert majors <= set(dev_nodes.LOCAL_MAJORS) and not majors & dev_nodes.registered_char_majors()
    # every NVML call the tool made is one the simulator serves (unserved ones count too: gpud-sim stats)
    assert calls and set(calls) <= set(nvml_lib.function_names()), sorted(set(calls) - set(nvml_lib.function_names()))


MIG = """version: v1
layouts:
  l:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"1g.10gb": 2, "2g.20gb": 1}
    - devices: [1]
      mig-enabled: false
"""


def test_gpud_cdi_refresh_runs_nvidia_ctk_on_the_simulated_host(tmp_path, sim_dir):
    ctk = anchor("nvidia-ctk")
    host = sim_dir("h100-80gb:2")
    spec_path = tmp_path / "cdi" / "nvidia.yaml"
    d = DaemonOn(tmp_path / "gpud", host, MIG, ["--nvidia-ctk", str(ctk), "--cdi-spec", str(spec_path)])
    try:
        r = d.ctl("apply", "--wait")
        assert r.returncode == 0, r.stdout + r.stderr
        wait_until(lambda: any(e["message"].startswith(("CDI spec regenerated", "CDI spec not regenerated"))
                               for e in d.events()), timeout=300, what="gpud's CDI refresh")
        assert any(e["message"].startswith("CDI spec regenerated") for e in d.events()), d.events()
    finally:
        d.stop()
    st = load(host)
    migs = {ci.uuid for g in st.gpus.values() for gi in g.gis for ci in gi.cis}
    assert len(migs) == 3
    names = {dev["name"] for dev in yaml.safe_load(spec_path.read_text())["devices"]}
    assert {n for n in names if n.startswith("MIG-")} == migs
    assert {n for n in names if n.startswith("GPU-")} == {g.uuid for g in st.gpus.values() if not g.mig_mode}
