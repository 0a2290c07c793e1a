"""`gpud-sim exec DIR -- CMD`: the environment and, as root, the simulated files where NVIDIA's
tools read them, read-only; CMD's exit status is exec's. Checked against DIR's own files and the
real H200's (nvml-and-files.json) for the formats."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpud.sim import pci_files
from gpud.sim.state import load
from tests.support.nvmlc import gpud_sim_exec

REAL = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "h200" / "nvml-and-files.json").read_text())
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the mount namespace needs root")


@pytest.mark.tools
def test_exit_status_path_and_library_path(sim_dir, nvml_so):
    host = sim_dir("h200")
    res = gpud_sim_exec(host, "sh", "-c", 'echo "$PATH"; echo "$LD_LIBRARY_PATH"; echo "$GPUD_SIM_DIR"; '
                        'command -v nvidia-smi; exit 7')
    assert res.returncode == 7
    path, ld, sim, smi = res.stdout.splitlines()
    assert path.split(":")[0] == str(host / "bin") and smi == str(host / "bin" / "nvidia-smi")
    assert ld.split(":")[0] == str(nvml_so.parent) and sim == str(host)


@pytest.mark.tools
def test_a_missing_command_is_127(sim_dir, nvml_so):
    res = gpud_sim_exec(sim_dir("h200"), "/nonexistent/tool")
    assert res.returncode == 127 and "/nonexistent/tool" in res.stderr


@root_only
@pytest.mark.tools
def test_the_simulated_files_stand_where_the_tools_read_them(sim_dir, nvml_so):
    host = sim_dir("h200:2", mig_on=[1])
    script = ("ls /sys/bus/pci/devices; echo ==; cat /sys/bus/pci/devices/0000:18:00.0/resource; echo ==; "
              "readlink -f /sys/bus/pci/devices/0000:18:00.0/driver; readlink -f /sys/bus/pci/devices/0000:18:00.0/iommu_group; "
              "ls /sys/kernel/iommu_groups/10/devices; test -d /sys/devices/system && echo system-kept; "
              "head -3 /proc/driver/nvidia-caps/mig-minors; echo ==; "
              "od -An -tx1 -N4 /sys/bus/pci/devices/0000:18:00.0/config; "
              "echo 1 > /sys/bus/pci/devices/0000:18:00.0/remove 2>/dev/null || echo read-only")
    res = gpud_sim_exec(host, "sh", "-c", script)
    assert res.returncode == 0, res.stderr
    devices, resource, rest = res.stdout.split("==\n", 2)
    assert devices.split() == sorted(os.listdir(host / "sys/bus/pci/devices"))
    assert resource == (host / "sys/bus/pci/devices/0000:18:00.0/resource").read_text()
    real = REAL["sysfs"]["/sys/bus/pci/devices/0000:00:06.0"]["resource"].splitlines()
    assert len(resource.splitlines()) == len(real)
    assert [line.split()[2] for line in resource.splitlines()] == [line.split()[2] for line in real]  # flags
    lines = rest.splitlines()
    assert lines[0] == "/sys/bus/pci/drivers/nvidia" and lines[1] == "/sys/kernel/iommu_groups/10"
    assert lines[2] == "0000:18:00.0" and lines[3] == "system-kept"
    assert lines[4:7] == REAL["nvidia_caps_content"]["/proc/driver/nvidia-caps/mig-minors"].splitlines()[:3]
    assert lines[8].split() == ["de", "10", "35", "23"] and lines[9] == "read-only"


def test_config_space_is_laid_out_as_the_real_h200s(sim_dir):
    """Every byte of the header's first 64 but the BAR addresses equals the real H200's."""
    host = sim_dir("h200")
    ours = (host / "sys/bus/pci/devices/0000:18:00.0/config").read_bytes()
    real = bytes.fromhex(REAL["sysfs"]["/sys/bus/pci/devices/0000:00:06.0"]["config_head_hex"])
    assert len(ours) == REAL["sysfs"]["/sys/bus/pci/devices/0000:00:06.0"]["config_len"] == pci_files.CONFIG_SIZE
    bar_high = {0x14, 0x15, 0x1C, 0x1D, 0x24, 0x25}  # the upper halves of the 64-bit BAR addresses
    assert [b for i, b in enumerate(ours[:64]) if i not in bar_high] == \
        [b for i, b in enumerate(real) if i not in bar_high]


def test_proc_modules_lists_nvidia_as_the_real_host_does(sim_dir):
    host = sim_dir("h200")
    line = next(x for x in (host / "proc/modules").read_text().splitlines() if x.split()[0] == "nvidia")
    real = next(x for x in REAL["proc_modules_nvidia"] if x.split()[0] == "nvidia").split()
    assert line.split()[:5] == real[:5] and line.split()[-1] == real[-1]


@pytest.mark.skipif(os.geteuid() != 0, reason="the mount namespace needs root")
@pytest.mark.tools
def test_a_program_under_exec_reads_the_hosts_proc_modules_and_its_own_proc(sim_dir, nvml_so):
    """mig-parted refuses to apply unless /proc/modules lists nvidia. On a kernel without module
    support (no /proc/modules at all, as on this project's CI machine) nothing can be bound over
    it, so exec serves /proc as links into the real procfs plus the file; each process must still
    see its own /proc/self."""
    host = sim_dir("h200")
    res = gpud_sim_exec(host, "sh", "-c", "cat /proc/modules; echo ---; cat /proc/self/comm; ls /proc/driver")
    assert res.returncode == 0, res.stderr
    modules, rest = res.stdout.split("---\n")
    assert modules == (host / "proc/modules").read_text()
    comm, *driver = rest.split()
    assert comm == "cat"
    assert "nvidia-caps" in driver


@pytest.mark.tools
def test_without_the_namespace_the_real_sys_stays(sim_dir, nvml_so):
    host = sim_dir("h200")
    res = gpud_sim_exec(host, "sh", "-c", "ls /sys/bus/pci/devices", namespace=False)
    assert res.returncode == 0 and "no mount namespace" in res.stderr
    assert sorted(res.stdout.split()) == sorted(os.listdir("/sys/bus/pci/devices"))


@pytest.mark.tools
def test_a_tools_nvml_calls_are_counted(goprobe, sim_dir, nvml_so):
    from gpud.sim.host_exec import run_counted

    host = sim_dir("h100-80gb", mig_on=[0])
    res, calls = run_counted(host, [str(goprobe), "create", "0", "0"])
    assert res.returncode == 0, res.stderr
    assert calls["nvmlDeviceCreateGpuInstance"] == 1 and calls["nvmlGpuInstanceCreateComputeInstance"] == 1
    assert calls["nvmlInit_v2"] == 1 and len(load(host).gpus["0000:18:00.0"].gis) == 1
