"""`gpud-sim`: the command other tools script against."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pynvml as N
import pytest

from gpud import sim
from gpud.sim.cli import main, parse_error_code
from gpud.sim.state import load

GPU0, GPU1 = "0000:18:00.0", "0000:2a:00.0"


@pytest.fixture
def host(tmp_path) -> Path:
    d = tmp_path / "h"
    assert main(["create", str(d), "--gpu", "h200:2", "--gpu", "rtx6000-ada", "--mig-on", "0"]) == 0
    return d


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_create_builds_a_deterministic_host(host, tmp_path):
    st = load(host)
    assert sorted(st.gpus) == [GPU0, GPU1, "0000:3a:00.0"]
    assert (st.gpus[GPU0].mig_mode, st.gpus[GPU1].mig_mode) == (1, 0)
    f = st.functions
    assert f[GPU0].class_code == 0x030200 and f["0000:3a:00.0"].class_code == 0x030000
    audio = f["0000:3a:00.1"]
    assert (audio.class_code, audio.native_driver, audio.iommu_group) == (0x040300, "snd_hda_intel",
                                                                         f["0000:3a:00.0"].iommu_group)
    assert len({f[a].iommu_group for a in st.gpus}) == 3
    assert [f[a].numa_node for a in sorted(st.gpus)] == [0, 0, 1]
    nic = [x for x in f.values() if x.vendor == 0x15B3]
    assert nic and nic[0].driver == "mlx5_core"
    assert "vfio-pci" not in st.loaded_modules and "nvidia" in st.loaded_modules
    assert [g.minor for g in st.gpus.values()] == [0, 1, 2]
    # sysfs rendered, and a second host made elsewhere has the same UUIDs
    assert (host / "sys" / "bus" / "pci" / "devices" / GPU0).exists()
    other = tmp_path / "again"
    main(["create", str(other), "--gpu", "h200:2", "--gpu", "rtx6000-ada"])
    assert [g.uuid for g in load(other).gpus.values()] == [g.uuid for g in st.gpus.values()]


def test_create_rejects_bad_input(tmp_path, capsys):
    assert run(capsys, "create", tmp_path / "a", "--gpu", "h300")[0] == 2
    assert run(capsys, "create", tmp_path / "b", "--gpu", "l40s", "--mig-on", "0")[0] == 2
    assert run(capsys, "create", tmp_path / "c", "--gpu", "h200:0")[0] == 2
    assert not (tmp_path / "a" / "state.json").exists()


def test_create_refuses_an_existing_host(host, capsys):
    rc, _, err = run(capsys, "create", host, "--gpu", "h200")
    assert rc == 1 and "already" in err


def test_hold_and_release_render_and_emit(host, capsys):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(os.fspath(host / "run" / "uevent.sock"))
    listener.settimeout(5)
    try:
        uuid = load(host).gpus[GPU1].uuid
        assert run(capsys, "hold", host, uuid, "--pid", 4321, "--name", "trainer")[0] == 0
        (p,) = load(host).processes
        assert (p.pid, p.name, p.device) == (4321, "trainer", uuid)
        assert (host / "proc" / "4321" / "comm").read_text() == "trainer\n"
        event = json.loads(listener.recv(65536))
        assert (event["action"], event["subsystem"], event["address"]) == ("change", "pci", GPU1)
        assert run(capsys, "hold", host, "2A:00.0", "--pid", 99)[0] == 0
        assert load(host).processes[1].device == GPU1
        json.loads(listener.recv(65536))
        assert run(capsys, "release", host, uuid, "--pid", 4321)[0] == 0
        assert [p.pid for p in load(host).processes] == [99]
        assert not (host / "proc" / "4321").exists()
        assert json.loads(listener.recv(65536))["action"] == "change"
        rc, _, err = run(capsys, "release", host, uuid, "--pid", 4321)
        assert rc == 1 and "does not hold" in err
        assert run(capsys, "hold", host, "GPU-nope", "--pid", 1)[0] == 1
    finally:
        listener.close()


def test_hold_a_mig_device_blocks_its_destroy(host, capsys):
    sim.install(host)
    try:
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        gi = N.nvmlDeviceCreateGpuInstance(h, 19)
        ci = N.nvmlGpuInstanceCreateComputeInstance(gi, 0)
        mig = N.nvmlDeviceGetUUID(N.nvmlDeviceGetMigDeviceHandleByIndex(h, 0))
        assert run(capsys, "hold", host, mig, "--pid", 7)[0] == 0
        with pytest.raises(N.NVMLError_InUse):
            N.nvmlComputeInstanceDestroy(ci)
        assert run(capsys, "release", host, mig, "--pid", 7)[0] == 0
        N.nvmlComputeInstanceDestroy(ci)
        N.nvmlShutdown()
    finally:
        sim.uninstall()


def test_fault_and_stats(host, capsys):
    assert run(capsys, "fault", host, "nvmlDeviceGetMigMode", "--nth", 2, "--error", "NVML_ERROR_IN_USE")[0] == 0
    assert run(capsys, "fault", host, "nvmlDeviceGetCount", "--error", "gpu_is_lost")[0] == 0
    rc, _, err = run(capsys, "fault", host, "nvmlNoSuchThing", "--error", "1")
    assert rc == 1 and "no function" in err
    assert run(capsys, "fault", host, "nvmlDeviceGetMigMode", "--error", "NOPE")[0] == 1
    sim.install(host)
    try:
        N.nvmlInit()
        with pytest.raises(N.NVMLError_GpuIsLost):  # the bare name hits nvmlDeviceGetCount_v2
            N.nvmlDeviceGetCount()
        h = N.nvmlDeviceGetHandleByIndex(0)
        N.nvmlDeviceGetMigMode(h)
        with pytest.raises(N.NVMLError_InUse):
            N.nvmlDeviceGetMigMode(h)
        N.nvmlDeviceGetMigMode(h)
        N.nvmlShutdown()
    finally:
        sim.uninstall()
    rc, out, _ = run(capsys, "stats", host, "--json")
    calls = json.loads(out)["calls"]
    assert rc == 0 and calls["nvmlDeviceGetMigMode"] == 3 and calls["nvmlDeviceGetCount_v2"] == 1
    rc, out, _ = run(capsys, "stats", host)
    assert "nvmlDeviceGetMigMode" in out


def test_parse_error_code():
    assert parse_error_code("19") == parse_error_code("IN_USE") == parse_error_code("NVML_ERROR_IN_USE") == 19
    assert parse_error_code("insufficient-resources") == 23


def test_show(host, capsys):
    rc, out, _ = run(capsys, "show", host, "--json")
    s = json.loads(out)
    assert rc == 0
    assert [g["pci"] for g in s["gpus"]] == [GPU0, GPU1, "0000:3a:00.0"]
    assert s["gpus"][0]["mig"] == {"current": 1, "pending": 1, "gi_id_order": "tree"} and s["gpus"][2]["mig"] is None
    assert s["gpus"][1]["mig"]["gi_id_order"] == "tree-halves-swapped"  # odd ordinals: the other numbering
    rc, out, _ = run(capsys, "show", host)
    assert rc == 0 and "NVIDIA H200" in out and "mlx5_core" in out


def test_hardware_events_go_to_the_kernel_model(host, capsys):
    assert run(capsys, "hang", host, GPU1)[0] == 0
    assert GPU1 in load(host).hangs
    assert run(capsys, "unplug", host, GPU1)[0] == 0
    assert load(host).functions[GPU1].present is False
    assert run(capsys, "plug", host, GPU1)[0] == 0
    assert load(host).functions[GPU1].present is True
    assert run(capsys, "unplug", host, "0000:77:00.0")[0] == 1


def test_missing_host_dir_is_a_clean_error(tmp_path, capsys):
    rc, _, err = run(capsys, "stats", tmp_path / "none", "--json")
    assert rc == 1 and "not a simulated host" in err


def test_console_script(tmp_path):
    exe = Path(sys.executable).with_name("gpud-sim")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "gpud.sim.cli"]
    d = tmp_path / "h"
    subprocess.run([*cmd, "create", str(d), "--gpu", "l40s:2"], check=True)
    out = subprocess.run([*cmd, "stats", str(d), "--json"], check=True, capture_output=True, text=True).stdout
    assert json.loads(out) == {"calls": {}, "resets": {}, "services": {"calls": {}, "units": {}, "reboots": []}}
