"""A pending MIG mode is settled the way the driver supports: gpud closes its NVML session, runs
`nvidia-smi -r -i <PCI>` (the simulator's, which refuses exactly where the real tool does), opens
NVML again and re-reads. Outcomes are read from the simulator's own state file (resets per
method, MIG modes), not through gpud's adapters."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from gpud.sim.state import load
from tests.scenarios.definitions import layout, mig
from tests.support.present import present
from tests.support.processes import reap
from tests.support.simrig import SimRig

GPU0, GPU1 = "0000:18:00.0", "0000:2a:00.0"
MIG_ON = layout(mig([0], {"7g.80gb": 1}))


def resets(rig) -> dict:
    return {pci: dict(m) for pci, m in load(rig.dir).resets.items()}


async def test_ampere_mode_change_resets_through_nvidia_smi_with_nvml_closed(tmp_path):
    rig = SimRig(tmp_path, ("a100-80gb:2",))
    try:
        assert await rig.apply(MIG_ON)
        st = rig.rec.gpu_states[GPU0]
        assert st.state == "converged", st.message
        assert resets(rig) == {GPU0: {"nvidia-smi": 1}}  # never sysfs, never the other GPU
        assert load(rig.dir).gpus[GPU0].mig_mode == 1 and rig.mig_devices()[0]
        # gpud's session is open again (the GPU was re-read after the reset), and it is the only one
        assert [s.pid for s in load(rig.dir).sessions] == [os.getpid()]
    finally:
        rig.close()


async def test_reset_with_gpuds_own_session_open_is_refused_by_nvidia_smi(tmp_path):
    """What proves the order by behaviour: keep NVML open across the reset and the simulated
    nvidia-smi refuses ("In use by another client"), as the real one does."""
    rig = SimRig(tmp_path, ("a100-80gb",))
    rig.hw.nvml.suspend = lambda: None  # type: ignore[method-assign]  # a gpud that forgets to close its session
    rig.hw.nvml.resume = lambda: None  # type: ignore[method-assign]
    try:
        assert await rig.apply(MIG_ON)
        st = rig.rec.gpu_states[GPU0]
        assert st.state == "failed" and "In use by another client" in st.message, st.message
        assert resets(rig) == {} and load(rig.dir).gpus[GPU0].mig_mode == 0
    finally:
        rig.close()


HOSTENGINE = textwrap.dedent("""
    import sys, pynvml
    from gpud import sim
    sim.install(sys.argv[1])
    pynvml.nvmlInit()
    print("open", flush=True)
    sys.stdin.readline()
""")


async def test_another_processes_nvml_session_is_named_and_waited_for(tmp_path):
    """DCGM's nv-hostengine (here: a process with NVML open) holds the GPU's node: gpud names it
    and waits (on-busy: wait), never kills; once it exits the pass resets and converges."""
    rig = SimRig(tmp_path, ("a100-80gb",))
    p = subprocess.Popen([sys.executable, "-c", HOSTENGINE, str(rig.dir)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert present(p.stdout).readline().strip() == "open"
        assert await rig.apply(MIG_ON)
        st = rig.rec.gpu_states[GPU0]
        assert st.state == "waiting", st.message
        assert [h.pid for h in st.holders] == [p.pid] and f"pid {p.pid}" in st.message
        assert resets(rig) == {} and p.poll() is None  # nothing reset, nothing killed
        present(p.stdin).close()
        p.wait(30)
        await rig.rec.converge()
        assert rig.rec.gpu_states[GPU0].state == "converged", rig.rec.gpu_states[GPU0].message
        assert resets(rig) == {GPU0: {"nvidia-smi": 1}}
    finally:
        reap(p)
        rig.close()


async def test_nvswitch_system_refusing_a_single_gpu_reset_leaves_reset_required(tmp_path):
    rig = SimRig(tmp_path, ("a100-80gb:2",), nvswitch=True, fabric_manager="stopped")
    try:
        assert await rig.apply(MIG_ON)
        st = rig.rec.gpu_states[GPU0]
        assert st.state == "reset-required" and "NVSwitch" in st.message, st.message
        assert "00000000:2A:00.0" in st.message
        assert resets(rig) == {} and load(rig.dir).gpus[GPU0].mig_pending == 1
        assert load(rig.dir).gpus[GPU1].mig_mode == 0  # the other GPU of the fabric is left alone
    finally:
        rig.close()


async def test_nvswitch_refusal_under_reboot_allow_is_left_to_the_reboot_policy(tmp_path):
    rig = SimRig(tmp_path, ("a100-80gb:2",), nvswitch=True, fabric_manager="stopped")
    try:
        assert await rig.apply(layout(mig([0], {"7g.80gb": 1}), policy={"reboot": "allow"}))
        st = rig.rec.gpu_states[GPU0]
        # the reboot policy took it (here it cannot reach logind, and says so)
        assert st.state == "reboot-required" and "NVSwitch" in st.message, st.message
        assert "policy allows a reboot" in st.message
        assert resets(rig) == {}
    finally:
        rig.close()


async def test_a_reset_that_claims_success_but_changes_nothing_asks_for_a_reboot(tmp_path):
    """mig-parted #9/#18: a reset that 'worked' and left the mode pending. Here a stand-in tool that
    exits 0 with the success words and touches nothing; gpud re-reads and says reboot-required."""
    rig = SimRig(tmp_path, ("a100-80gb",))
    inert = tmp_path / "inert-nvidia-smi"
    inert.write_text("#!/bin/sh\necho \"GPU 00000000:18:00.0 was successfully reset.\"\n")
    inert.chmod(0o755)
    present(rig.hw.reset).command = [str(inert)]
    try:
        assert await rig.apply(MIG_ON)
        st = rig.rec.gpu_states[GPU0]
        assert st.state == "reboot-required" and "did not apply" in st.message, st.message
        assert load(rig.dir).gpus[GPU0].mig_mode == 0 and resets(rig) == {}
    finally:
        rig.close()


async def test_policy_reset_never_leaves_the_reset_to_the_operator(tmp_path):
    rig = SimRig(tmp_path, ("a100-80gb",))
    try:
        assert await rig.apply(layout(mig([0], {"7g.80gb": 1}), policy={"reset": "never"}))
        st = rig.rec.gpu_states[GPU0]
        assert st.state == "reset-required" and "policy reset is 'never'" in st.message, st.message
        assert resets(rig) == {}
    finally:
        rig.close()
