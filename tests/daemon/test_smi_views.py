"""Issue 29 item 9: nvidia-smi's listings in gpudctl, compared with the simulator's own state file:
`gpudctl list` (nvidia-smi -L: whole GPUs with UUIDs, a vfio-pci one too, and their MIG devices),
`gpudctl mig instances` (-lgi) and `gpudctl mig compute` (-lci); `gpudctl --version` without a daemon."""

from __future__ import annotations

import json
import subprocess
import sys
from ctypes import byref, c_uint

import pytest

from gpud import VERSION
from gpud.wire import protocol as wire
from tests.scenarios.definitions import layout, mig
from tests.support.daemon import ROOT

pytestmark = pytest.mark.daemon

GPU0, GPU1 = "0000:18:00.0", "0000:2a:00.0"


def test_list_and_mig_views_match_the_simulator(daemon):
    d = daemon(["h100-80gb:2"], layout(mig([0], {"1g.10gb": 2, "1c.3g.40gb": 2}),
                                       {"devices": [1], "workload": "vm-passthrough"}))
    uuid1 = d.sim_state()["gpus"][GPU1]["uuid"]
    assert d.ctl("apply", "--wait", "--timeout", "60").returncode == 0
    truth = d.sim_state()["gpus"][GPU0]
    cis = [(gi["id"], ci["id"], ci["uuid"]) for gi in truth["gis"] for ci in gi["cis"]]
    listing = d.ctl("list").stdout.splitlines()
    assert listing[0] == f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {truth['uuid']}) [{GPU0}]"
    gpu1 = next(ln for ln in listing if ln.startswith("GPU 1: "))
    assert gpu1 == f"GPU 1: NVIDIA H100 80GB HBM3 (UUID: {uuid1}) [{GPU1}, vfio-pci]", gpu1
    mig_lines = [ln for ln in listing if ln.startswith("  MIG ")]
    assert sorted(ln.split("(UUID: ")[1].rstrip(")") for ln in mig_lines) == sorted(u for _, _, u in cis)
    gis = d.ctl("mig", "instances").stdout.splitlines()
    assert gis[0].split() == ["GPU", "GI", "PROFILE", "PLACEMENT", "COMPUTE", "INSTANCES"]
    rows = sorted((int(r.split()[1]), r.split()[2], int(r.split()[4])) for r in gis[1:])
    assert rows == sorted((gi["id"], "1g.10gb" if len(gi["cis"]) == 1 and gi["size"] == 1 else "3g.40gb", len(gi["cis"]))
                          for gi in truth["gis"])
    compute = d.ctl("mig", "compute", "--gpu", "0").stdout.splitlines()
    assert sorted((int(r.split()[1]), int(r.split()[2]), r.split()[-1]) for r in compute[1:]) == sorted(cis)


def test_version_flag_needs_no_daemon(tmp_path):
    r = subprocess.run([sys.executable, "-m", "gpud.cli.gpudctl", "--socket", str(tmp_path / "none"), "--version"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == f"gpudctl {VERSION} (protocol {wire.PROTOCOL})", r


def _nvml_lcip(host) -> list[tuple[int, int, int, int, int, int]]:
    """What `nvidia-smi mig -lcip` asks NVML, asked of the simulator's NVML in this process:
    (GPU index, GI id, CI profile id, free, total, SMs) of every CI profile of every GI."""
    import pynvml as N

    from gpud import sim

    sim.install(host)
    N.nvmlInit()
    try:
        rows = []
        h = N.nvmlDeviceGetHandleByIndex(0)
        for gi_profile in range(N.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = N.nvmlDeviceGetGpuInstanceProfileInfo(h, gi_profile)
            except N.NVMLError:
                continue
            count = c_uint(0)
            arr = (N.c_nvmlGpuInstance_t * info.instanceCount)()
            N.nvmlDeviceGetGpuInstances(h, info.id, arr, byref(count))
            for gi in arr[:count.value]:
                gi_id = N.nvmlGpuInstanceGetInfo(gi).id
                for index in range(N.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
                    try:
                        ci = N.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                            gi, index, N.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
                    except N.NVMLError:
                        continue
                    free = N.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, ci.id)
                    rows.append((0, gi_id, ci.id, free, ci.instanceCount, ci.multiprocessorCount))
        return sorted(set(rows))
    finally:
        N.nvmlShutdown()
        sim.uninstall()


def test_compute_profiles_match_the_simulators_nvml(daemon):
    """`gpudctl mig compute-profiles` (-lcip): per GI, every CI profile with free/total and SMs, as
    the simulator's NVML answers nvidia-smi's own calls; a GI whose 1c CIs leave one slot free
    offers one more 1c and no 2c."""
    d = daemon(["h100-80gb:1"], layout(mig([0], {"1g.10gb": 1, "1c.3g.40gb": 2})))
    assert d.ctl("apply", "--wait", "--timeout", "60").returncode == 0
    r = d.ctl("mig", "compute-profiles", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["gpus"]
    shown = sorted((g["index"], gi["gi"], p["id"], p["free"], p["total"], p["sms"])
                   for g in got for gi in g["instances"] for p in gi["profiles"])
    assert shown == _nvml_lcip(d.host)
    three_g = next(gi for g in got for gi in g["instances"] if gi["profile"] == "3g.40gb")
    by_name = {p["name"]: p for p in three_g["profiles"]}
    assert (by_name["1c.3g.40gb"]["free"], by_name["2c.3g.40gb"]["free"], by_name["3g.40gb"]["free"]) == (1, 0, 0)
    assert [p["name"] for p in three_g["profiles"] if p["default"]] == ["3g.40gb"]
    table = d.ctl("mig", "compute-profiles", "--gpu", "0").stdout.splitlines()
    assert table[0].split()[:4] == ["GPU", "GI", "NAME", "ID"]
    row = next(ln.split() for ln in table if "MIG 3g.40gb" in ln)
    assert row[4].endswith("*") and row[5] == "0/1", row
