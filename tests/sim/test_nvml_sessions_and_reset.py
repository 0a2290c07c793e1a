"""NVML sessions as holders, and the simulated `nvidia-smi -r` (issue 9).

Checked against the simulator's own state file (`DIR/state.json`: sessions, resets per method,
MIG modes) and against the real tool's words as captured in public reports (NVSentinel#1690,
mig-parted#181: "The following GPUs could not be reset: ... In use by another client", exit 255;
"GPU 00000000:1A:00.0 was successfully reset.", exit 0), not against the simulator's tables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pynvml as N
import pytest

from gpud.sim.cli import create, hold
from gpud.sim.cli import main as sim_main
from gpud.sim.kernel import Store
from gpud.sim.state import load, locked
from tests.support.present import present
from tests.support.processes import reap

GPU0, GPU1 = "0000:18:00.0", "0000:2a:00.0"

# A second process that opens NVML on the simulated host and keeps it open until told to stop.
HOLDER = textwrap.dedent("""
    import sys, pynvml
    from gpud import sim
    sim.install(sys.argv[1])
    pynvml.nvmlInit()
    print("open", flush=True)
    if sys.stdin.readline().strip() == "shutdown":
        pynvml.nvmlShutdown()
        print("closed", flush=True)
    sys.stdin.readline()
""")


@pytest.fixture
def nvml_holder():
    """Start a process holding an NVML session on DIR; yields (process, shutdown())."""
    started = []

    def start(host_dir):
        p = subprocess.Popen([sys.executable, "-c", HOLDER, str(host_dir)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert present(p.stdout).readline().strip() == "open"
        started.append(p)
        return p

    yield start
    for p in started:
        reap(p)


def nvidia_smi(host_dir, *args: str) -> subprocess.CompletedProcess:
    """The wrapper gpud-sim create wrote: what the daemon runs."""
    return subprocess.run([str(host_dir / "bin" / "nvidia-smi"), *args], capture_output=True, text=True, timeout=60)


def resets(host_dir) -> dict:
    return {pci: dict(m) for pci, m in load(host_dir).resets.items()}


# --- sessions ---------------------------------------------------------------------------------


def test_init_opens_a_session_on_the_gpus_on_nvidia_and_shutdown_closes_it(sim_host):
    host = sim_host("h100-80gb:2")
    Store(host.host_dir)(host.host_dir / "sys/bus/pci/drivers/nvidia/unbind", GPU1.encode())
    N.nvmlInit()
    try:
        [s] = load(host.host_dir).sessions
        assert s.pid == os.getpid() and s.gpus == [GPU0]  # the GPU off nvidia is not opened
        N.nvmlInit()  # NVML counts inits: still one session
        N.nvmlShutdown()
        assert len(load(host.host_dir).sessions) == 1
    finally:
        N.nvmlShutdown()
    assert load(host.host_dir).sessions == []


def test_a_dead_processes_session_is_gone(sim_host, nvml_holder):
    host = sim_host("h100-80gb")
    p = nvml_holder(host.host_dir)
    assert [s.pid for s in load(host.host_dir).sessions] == [p.pid]
    p.kill()
    p.wait()
    with locked(host.host_dir, write=False) as st:  # the kernel closed its files
        assert st.sessions == []


def test_unbind_lock_refused_while_a_session_is_open(sim_host, nvml_holder):
    host = sim_host("h100-80gb")
    lock = host.host_dir / f"proc/driver/nvidia/gpus/{GPU0}/unbindLock"
    p = nvml_holder(host.host_dir)
    Store(host.host_dir)(lock, b"1")
    assert lock.read_text().strip() == "0"
    p.stdin.write("shutdown\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "closed"
    Store(host.host_dir)(lock, b"1")
    assert lock.read_text().strip() == "1"


def test_unbind_of_nvidia_waits_while_a_session_is_open(sim_host, nvml_holder):
    host = sim_host("h100-80gb")
    p = nvml_holder(host.host_dir)
    waited = []

    def on_block(address):
        waited.append(address)
        if len(waited) == 3:  # the unbind has waited a while: now the session closes
            p.stdin.write("shutdown\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == "closed"

    Store(host.host_dir, poll_interval=0.01, on_block=on_block)(
        host.host_dir / "sys/bus/pci/drivers/nvidia/unbind", GPU0.encode())
    assert len(waited) >= 3 and load(host.host_dir).functions[GPU0].driver is None


# --- nvidia-smi -r ----------------------------------------------------------------------------


def pend_mig_on(host_dir, address):
    with locked(host_dir) as st:
        st.gpus[address].mig_pending = 1


def test_reset_settles_a_pending_mode_and_is_counted_per_method(tmp_path):
    d = tmp_path / "host"
    create(d, ["a100-80gb:2"], persistence="off")
    pend_mig_on(d, GPU0)
    r = nvidia_smi(d, "-r", "-i", GPU0)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "GPU 00000000:18:00.0 was successfully reset."
    st = load(d)
    assert (st.gpus[GPU0].mig_mode, st.gpus[GPU0].mig_pending) == (1, 1)
    assert st.gpus[GPU1].mig_mode == 0
    Store(d)(d / f"sys/bus/pci/devices/{GPU1}/reset", b"1")
    assert resets(d) == {GPU0: {"nvidia-smi": 1}, GPU1: {"sysfs": 1}}
    assert sim_main(["stats", str(d), "--json"]) == 0


def test_stats_json_reports_resets_per_method(tmp_path, capsys):
    d = tmp_path / "host"
    create(d, ["h100-80gb"], persistence="off")
    assert nvidia_smi(d, "-r", "-i", "0").returncode == 0
    assert nvidia_smi(d, "-r", "-i", load(d).gpus[GPU0].uuid).returncode == 0
    capsys.readouterr()
    assert sim_main(["stats", str(d), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["resets"] == {GPU0: {"nvidia-smi": 2}}


IN_USE = ("The following GPUs could not be reset:\n"
          "  GPU 00000000:18:00.0: In use by another client\n\n"
          "1 device is currently being used by one or more other processes (e.g., Fabric Manager, CUDA "
          "application, graphics application such as an X server, or a monitoring application such as "
          "another instance of nvidia-smi). Please first kill all processes using this device and all "
          "compute applications running in the system.")


def test_reset_refused_while_another_process_has_nvml_open(tmp_path, nvml_holder):
    d = tmp_path / "host"
    create(d, ["a100-80gb"], persistence="off")
    pend_mig_on(d, GPU0)
    p = nvml_holder(d)
    r = nvidia_smi(d, "-r", "-i", GPU0)
    assert (r.returncode, r.stdout.strip()) == (255, IN_USE)
    assert load(d).gpus[GPU0].mig_mode == 0 and resets(d) == {}
    p.stdin.write("shutdown\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "closed"
    assert nvidia_smi(d, "-r", "-i", GPU0).returncode == 0
    assert load(d).gpus[GPU0].mig_mode == 1


def test_reset_refused_while_a_process_holds_the_gpu(tmp_path):
    d = tmp_path / "host"
    create(d, ["a100-80gb"], persistence="off")
    hold(d, GPU0, 4121, "nvidia-persistenced")
    r = nvidia_smi(d, "-r", "-i", GPU0)
    assert (r.returncode, r.stdout.strip()) == (255, IN_USE)
    assert resets(d) == {}


def test_legacy_persistence_alone_refuses_no_reset(tmp_path):
    """Legacy persistence (`-pm 1`, no daemon), the default as on the lent H200: no source shows it
    refusing a reset (docs/hardware/persistence.md), so the simulator takes the kinder rule. `-pm
    0|1 -i` and the query still work per GPU."""
    d = tmp_path / "host"
    create(d, ["a100-80gb:2"])
    assert load(d).persistence == "legacy" and load(d).persistent == [GPU0, GPU1]
    query = ("--query-gpu=persistence_mode", "--format=csv,noheader", "-i", GPU0)
    assert nvidia_smi(d, *query).stdout == "Enabled\n"
    assert nvidia_smi(d, "-r", "-i", GPU0).returncode == 0 and resets(d) == {GPU0: {"nvidia-smi": 1}}
    r = nvidia_smi(d, "-pm", "0", "-i", GPU0)
    assert r.returncode == 0 and r.stdout == "Disabled persistence mode for GPU 00000000:18:00.0.\nAll done.\n"
    assert nvidia_smi(d, *query).stdout == "Disabled\n" and load(d).persistent == [GPU1]
    assert nvidia_smi(d, "-pm", "1", "-i", GPU0).returncode == 0 and load(d).persistent == [GPU1, GPU0]
    assert load(d).persistent == [GPU1, GPU0]  # the reset left persistence as it was


def test_persistence_daemon_holds_the_device_nodes_and_nvidia_smi_handles_it_when_it_reaches_the_socket(tmp_path):
    """NVSentinel#1243: nvidia-smi --gpu-reset turns persistence off and on around the reset when it
    reaches nvidia-persistenced's socket: the reset goes through and the daemon holds the GPU again."""
    d = tmp_path / "host"
    create(d, ["a100-80gb:2"], persistence="daemon")
    fd = d / "proc" / "870" / "fd"
    assert (d / "proc" / "870" / "comm").read_text() == "nvidia-persiste\n"
    assert sorted(os.path.basename(os.readlink(fd / n)) for n in os.listdir(fd)) == ["nvidia0", "nvidia1", "nvidiactl"]
    assert nvidia_smi(d, "-r", "-i", GPU0).returncode == 0 and resets(d) == {GPU0: {"nvidia-smi": 1}}
    assert sorted(os.path.basename(os.readlink(fd / n)) for n in os.listdir(fd)) == ["nvidia0", "nvidia1", "nvidiactl"]
    assert nvidia_smi(d, "-pm", "0", "-i", GPU0).returncode == 0  # through the daemon: it lets go of GPU0
    assert sorted(os.path.basename(os.readlink(fd / n)) for n in os.listdir(fd)) == ["nvidia1", "nvidiactl"]


def test_persistence_daemon_out_of_sight_holds_the_gpu_against_a_reset(tmp_path):
    """gpu-operator#118: nvidia-persistenced started where nvidia-smi cannot reach its socket kept
    its handle and blocked --gpu-reset ("In use by another client", NVSentinel#1690); out of sight
    of the socket nvidia-smi reports persistence Off (dgx-selinux#3), so `-pm 0` has nothing to do."""
    d = tmp_path / "host"
    create(d, ["a100-80gb:2"], persistence="daemon", persistenced_socket="hidden")
    r = nvidia_smi(d, "-r", "-i", GPU0)
    assert (r.returncode, r.stdout.strip()) == (255, IN_USE) and resets(d) == {}
    assert nvidia_smi(d, "--query-gpu=persistence_mode", "--format=csv,noheader", "-i", GPU0).stdout == "Disabled\n"
    r = nvidia_smi(d, "-pm", "0", "-i", GPU0)
    assert r.stdout == "Persistence mode is already Disabled for GPU 00000000:18:00.0.\nAll done.\n"
    assert nvidia_smi(d, "-r", "-i", GPU0).returncode == 255 and resets(d) == {}  # still held


def test_reset_of_a_gpu_off_nvidia_is_not_found(tmp_path):
    d = tmp_path / "host"
    create(d, ["a100-80gb"], persistence="off")
    Store(d)(d / "sys/bus/pci/drivers/nvidia/unbind", GPU0.encode())
    r = nvidia_smi(d, "-r", "-i", GPU0)
    assert r.returncode == 6 and resets(d) == {}


def test_ampere_nvswitch_system_without_fabric_manager_refuses_a_single_gpu_reset(tmp_path):
    d = tmp_path / "host"
    create(d, ["a100-80gb:2"], nvswitch=True, persistence="off", fabric_manager="stopped")
    switches = [f for f in load(d).functions.values() if f.class_code == 0x068000]
    assert len(switches) == 6 and {f.device for f in switches} == {0x1AF1}  # pci.ids: GA100 [A100 NVSwitch]
    pend_mig_on(d, GPU0)
    r = nvidia_smi(d, "-r", "-i", GPU0)
    assert r.returncode == 3 and "00000000:2A:00.0" in r.stdout
    assert load(d).gpus[GPU0].mig_mode == 0 and resets(d) == {}
    r = nvidia_smi(d, "-r")  # every GPU of the fabric at once is allowed
    assert r.returncode == 0 and load(d).gpus[GPU0].mig_mode == 1
    assert resets(d) == {GPU0: {"nvidia-smi": 1}, GPU1: {"nvidia-smi": 1}}



@pytest.mark.parametrize(("model", "fm"), [("a100-80gb", "running"), ("h100-80gb", "running"), ("h100-80gb", "stopped")])
def test_nvswitch_gpu_resets_alone_with_fabric_manager_or_on_hopper(tmp_path, model, fm):
    """nvidia-smi(1) -r: Ampere with Fabric Manager running, and Hopper whatever it does."""
    d = tmp_path / "host"
    create(d, [f"{model}:2"], nvswitch=True, persistence="off", fabric_manager=fm)
    comm = d / "proc" / "871" / "comm"
    assert (comm.exists() and comm.read_text() == "nv-fabricmanage\n") == (fm == "running")
    pend_mig_on(d, GPU0)
    r = nvidia_smi(d, "-r", "-i", GPU0)
    assert r.returncode == 0, r.stdout
    assert resets(d) == {GPU0: {"nvidia-smi": 1}} and load(d).gpus[GPU0].mig_mode == 1


@pytest.mark.parametrize("persistence,socket", [("off", "reachable"), ("legacy", "reachable"),
                                                 ("daemon", "reachable"), ("daemon", "hidden")])
def test_nvml_persistence_mode_answers_what_nvidia_smi_reports(tmp_path, persistence, socket):
    """gpud reads persistence mode through its own NVML session before a reset instead of starting
    `nvidia-smi --query-gpu=persistence_mode` (nvidia-smi is built on NVML): the two must agree
    in every persistence setup the simulator has, before and after `-pm 0`."""
    from gpud import sim
    from gpud.host.nvidia.nvml import Nvml

    d = tmp_path / "host"
    create(d, ["a100-80gb:2"], persistence=persistence, persistenced_socket=socket)
    sim.install(d)
    try:
        for _ in range(2):
            said = nvidia_smi(d, "--query-gpu=persistence_mode", "--format=csv,noheader", "-i", GPU0).stdout.strip()
            with Nvml() as nvml:
                assert nvml.persistence_mode(GPU0) == {"Enabled": True, "Disabled": False}[said]
            nvidia_smi(d, "-pm", "0", "-i", GPU0)
    finally:
        sim.uninstall()
