"""`gpud qualify --mutate GPU` on the simulator: every path exercised, every result as gpud predicts,
the GPU restored, the other GPUs untouched, and a busy or non-idle GPU refused with nothing changed.

Compared with the simulator's own state file (DIR/state.json: modes, drivers, overrides, instances,
resets and every NVML call it served) and with the real H200's `nvidia-smi mig -lgipp` / `-lgip`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.qualify.capture_oracle import names, placements
from tests.support.qualify import CONFIRM, MUTATING, ROOT, checks, hardware_state, qualify, sim, state

pytestmark = pytest.mark.daemon

H200 = ROOT / "tests" / "fixtures" / "h200"


def _nvml_on(host: Path, pci: str, code: str) -> None:
    prog = ("import sys; from gpud import sim; sim.install(sys.argv[1]); from gpud.host.nvidia.nvml import Nvml; "
            "n = Nvml(); n.open(); pci = sys.argv[2]; " + code + "; n.close()")
    subprocess.run([sys.executable, "-c", prog, str(host), pci], check=True, cwd=ROOT, timeout=120)


def _mutating_calls(before: dict, after: dict) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0) and any(m in k for m in MUTATING)}


def test_refused_without_the_confirmation_flag(tmp_path):
    host = tmp_path / "host"
    sim("create", str(host), "--gpu", "h100-80gb:1")
    before = state(host)
    r = qualify("--sim", str(host), "--mutate", "0")
    assert r.returncode == 2 and CONFIRM in r.stderr
    assert state(host) == before  # not even NVML was opened


def _bound(functions: dict) -> dict:
    """The PCI functions as the restore must leave them; `nvidia_probes` and `binds` count the
    driver's probes and binds of a function (the vfio-pci round trip adds to both, as a real rebind
    does)."""
    return {pci: {k: v for k, v in f.items() if k not in ("nvidia_probes", "binds")} for pci, f in functions.items()}


def test_h200_every_path_as_predicted_and_restored(tmp_path):
    host = tmp_path / "host"
    sim("create", str(host), "--gpu", "h200:2")
    gpus = sorted(state(host)["gpus"])
    target, other = gpus[1], gpus[0]
    before = hardware_state(host)
    calls_before = dict(state(host)["calls"])
    r = qualify("--sim", str(host), "--mutate", target, CONFIRM, "--json")
    report = json.loads(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert report["verdict"]["status"] == "ok", report
    got = checks(report, f"exercise GPU 1 {target}")
    for name in ("MIG on", "MIG off", "reset", "to vfio-pci", "back to nvidia", "restored"):
        assert got[name]["status"] == "ok", got[name]

    # every profile was created at exactly the placements the real H200 lists, and refused elsewhere
    real = placements(H200 / "nvidia-smi-mig-lgipp.txt")
    by_name = names(H200 / "nvidia-smi-mig-lgip.txt")
    for name, pid in by_name.items():
        c = got[f"{name} placements"]
        assert c["observed"] == f"created, CI made, destroyed at {','.join(real[pid])}; refused elsewhere"
    after = state(host)
    # the simulator's own record: one GI per placement (plus the two planned layouts), one reset by gpud
    created = _mutating_calls(calls_before, after["calls"])
    assert created.get("nvmlDeviceCreateGpuInstanceWithPlacement", 0) >= sum(len(v) for v in real.values())
    assert after["resets"].get(target) and not after["resets"].get(other)
    # restored: drivers, overrides, MIG modes and instances as before, on both GPUs
    assert after["gpus"] == before["gpus"]
    assert _bound(after["functions"]) == _bound(before["functions"])
    assert after["processes"] == before["processes"]


def test_starting_mig_mode_is_restored_and_other_gpus_are_untouched(tmp_path):
    host = tmp_path / "host"
    sim("create", str(host), "--gpu", "h100-80gb:2")
    gpus = sorted(state(host)["gpus"])
    _nvml_on(host, gpus[0], "n.set_mig_mode(pci, True)")  # Hopper applies it at once when idle
    assert state(host)["gpus"][gpus[0]]["mig_mode"] == 1
    before = hardware_state(host)
    r = qualify("--sim", str(host), "--mutate", "0", CONFIRM, "--json")
    report = json.loads(r.stdout)
    assert r.returncode == 0 and report["verdict"]["status"] == "ok", r.stdout + r.stderr
    after = state(host)
    assert after["gpus"] == before["gpus"] and _bound(after["functions"]) == _bound(before["functions"])
    assert after["gpus"][gpus[0]]["mig_mode"] == 1 and after["gpus"][gpus[0]]["gis"] == []


def test_busy_gpu_is_refused_and_nothing_changes(tmp_path):
    host = tmp_path / "host"
    sim("create", str(host), "--gpu", "a100-40gb:1")
    pci = sorted(state(host)["gpus"])[0]
    sim("hold", str(host), pci, "--pid", "777", "--name", "train.py")
    before = hardware_state(host)
    calls = dict(state(host)["calls"])
    r = qualify("--sim", str(host), "--mutate", pci, CONFIRM, "--json")
    assert r.returncode == 3, r.stdout + r.stderr
    report = json.loads(r.stdout)
    refused = checks(report, "exercise")["refused"]
    assert refused["status"] == "fail" and "busy: pid 777 train.py" in refused["reason"]
    assert hardware_state(host) == before
    assert _mutating_calls(calls, state(host)["calls"]) == {}


def test_gpu_with_instances_is_not_idle_and_refused(tmp_path):
    host = tmp_path / "host"
    sim("create", str(host), "--gpu", "h100-80gb:1")
    pci = sorted(state(host)["gpus"])[0]
    _nvml_on(host, pci, "n.set_mig_mode(pci, True); n.create_gpu_instance(pci, 0, 0)")
    before = hardware_state(host)
    r = qualify("--sim", str(host), "--mutate", pci, CONFIRM, "--json")
    assert r.returncode == 3
    refused = checks(json.loads(r.stdout), "exercise")["refused"]
    assert "not idle: 1 GPU instance(s) exist" in refused["reason"]
    assert hardware_state(host) == before


def test_a_hardware_answer_gpud_did_not_predict_fails_the_run_and_the_gpu_is_restored(tmp_path):
    host = tmp_path / "host"
    sim("create", str(host), "--gpu", "a100-40gb:1")
    pci = sorted(state(host)["gpus"])[0]
    before = hardware_state(host)
    # the 3rd GI creation fails as if the hardware refused a placement NVML had listed
    sim("fault", str(host), "nvmlDeviceCreateGpuInstanceWithPlacement", "--nth", "3",
        "--error", "INSUFFICIENT_RESOURCES")
    r = qualify("--sim", str(host), "--mutate", pci, CONFIRM, "--json")
    assert r.returncode == 3, r.stdout + r.stderr
    report = json.loads(r.stdout)
    got = checks(report, "exercise")
    assert got["MIG on"]["status"] == "ok"  # Ampere: MIG on went through gpud's reset
    assert got["stopped"]["status"] == "fail" and "nvmlDeviceCreateGpuInstanceWithPlacement" in got["stopped"]["reason"]
    assert got["restored"]["status"] == "ok", got["restored"]
    after = state(host)
    assert after["gpus"] == before["gpus"] and _bound(after["functions"]) == _bound(before["functions"])
    assert report["verdict"]["status"] == "fail"


def test_refused_while_a_gpud_holds_the_apply_lock(tmp_path):
    import fcntl
    import os

    from gpud.engine.apply_lock import holder_record, open_lock_file

    host = tmp_path / "host"
    sim("create", str(host), "--gpu", "h100-80gb:1")
    fd = open_lock_file(host / "apply.lock")  # where `gpud --sim DIR` takes it
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.pwrite(fd, holder_record(4321), 0)
    try:
        before = hardware_state(host)
        r = qualify("--sim", str(host), "--mutate", "0", CONFIRM, "--json")
    finally:
        os.close(fd)
    assert r.returncode == 3, r.stdout + r.stderr
    lock = checks(json.loads(r.stdout), "exercise")["apply lock"]
    assert "another gpud (pid 4321) holds" in lock["reason"]
    assert hardware_state(host) == before


def test_refused_when_the_lock_directory_is_writable_by_others(tmp_path):
    """The daemon's own lock code decides: a lock in a directory others can write is refused
    before any GPU is touched, and no lock file is made there."""
    host = tmp_path / "host"
    sim("create", str(host), "--gpu", "h100-80gb:1")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    before = hardware_state(host)
    r = qualify("--sim", str(host), "--mutate", "0", CONFIRM, "--json", "--lock", str(shared / "apply.lock"))
    assert r.returncode == 3, r.stdout + r.stderr
    lock = checks(json.loads(r.stdout), "exercise")["apply lock"]
    assert lock["status"] == "fail" and "writable by others" in lock["reason"]
    assert not (shared / "apply.lock").exists()
    assert hardware_state(host) == before
