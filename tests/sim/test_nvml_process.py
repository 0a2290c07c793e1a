"""The simulated NVML library served from a child process (gpud.sim.nvml_process): what gpud reads
through it equals what the same simulator answers in-process, what it changes is in the host's own
state file, its session is the caller's, and the child goes with the caller.

Compared with the simulator's state file (`DIR/state.json`, written by the child) and with the
in-process library's answers on the same host: the child must not change what the simulator says,
only where it runs.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import time

import pynvml as N
import pytest

from gpud import sim
from gpud.host.nvidia.nvml import Nvml
from gpud.sim.cli import create
from gpud.sim.nvml_process import RemoteNvmlLib, _pack
from gpud.sim.state import load
from tests.support.processes import reap

GPU0 = "0000:18:00.0"


@pytest.fixture
def host(tmp_path):
    d = tmp_path / "host"
    create(d, ["h100-80gb:2"], mig_on=[0])
    return d


@pytest.fixture
def served(host):
    """The host's simulated NVML served from a child process, for this test."""
    sim.install(host, process=True)
    yield host
    sim.uninstall()


def _read(host, *, process: bool):
    sim.install(host, process=process)
    try:
        with Nvml() as nvml:
            return nvml.gpus()
    finally:
        sim.uninstall()


def test_reads_equal_the_in_process_simulator(host):
    assert _read(host, process=True) == _read(host, process=False)


def test_changes_land_in_the_state_file_and_answers_come_back(served):
    assert isinstance(N.nvmlLib, RemoteNvmlLib)
    with Nvml() as nvml:
        gi = nvml.create_gpu_instance(GPU0, 19, 0)  # 1g.10gb at slot 0
        nvml.create_compute_instance(GPU0, gi, 0)
        read = {g.pci: g for g in nvml.gpus()}[GPU0]
    gis = load(served).gpus[GPU0].gis
    assert [(g.id, g.profile_id, g.start) for g in gis] == [(gi, 19, 0)]
    assert [ci.uuid for ci in gis[0].cis] == [ci.uuid for g in read.instances for ci in g.cis]


def test_the_session_is_the_callers(served):
    N.nvmlInit()
    assert [s.pid for s in load(served).sessions] == [os.getpid()]
    # DIR/proc shows this process holding the device nodes, not the child
    assert os.listdir(served / "proc" / str(os.getpid()) / "fd")
    N.nvmlShutdown()
    assert load(served).sessions == []


def test_an_error_code_and_a_raised_error_cross(served):
    N.nvmlInit()
    with pytest.raises(N.NVMLError_InvalidArgument):
        N.nvmlDeviceGetHandleByIndex(7)
    handle = N.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(TypeError, match="placement passed by value"):
        # the trap the in-process library reports: a placement passed by value, raised here too
        N.nvmlLib.nvmlDeviceCreateGpuInstanceWithPlacement(
            handle, ctypes.c_uint(19), N.c_nvmlGpuInstancePlacement_t(0, 1), ctypes.byref(N.c_nvmlGpuInstance_t()))
    N.nvmlShutdown()


def test_a_structure_pointing_into_the_callers_memory_is_refused():
    # nvmlDeviceGetRunningProcessesDetailList's list holds a pointer to the caller's array: the
    # child could not follow it, so the call is refused before it leaves (gpud makes none such)
    with pytest.raises(TypeError, match="procArray points into the caller's memory"):
        _pack(ctypes.byref(N.c_nvmlProcessDetailList_v1_t()))
    assert _pack(ctypes.byref(N.c_nvmlDevice_t()))[0][0] == "ref"  # a handle's slot: opaque, it crosses


CALLER = textwrap.dedent("""
    import sys, pynvml
    from gpud import sim
    sim.install(sys.argv[1], process=True)
    pynvml.nvmlInit()
    print(pynvml.nvmlLib._child.pid, flush=True)
    sys.stdin.readline()
""")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_child_ends_with_its_caller_killed(host):
    caller = subprocess.Popen([sys.executable, "-c", CALLER, str(host)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout is not None
        child = int(caller.stdout.readline())
        assert not _gone(child)
        caller.send_signal(signal.SIGKILL)
        caller.wait()
        deadline = time.monotonic() + 30
        while not _gone(child):  # its standard input closes with the caller: it exits
            assert time.monotonic() < deadline, "the simulated NVML process outlived its caller"
            time.sleep(0.05)
    finally:
        reap(caller)
