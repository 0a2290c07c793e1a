"""The simulator's libnvidia-ml.so.1 as programs that are not Python see it.

Independent sources: the symbols go-nvml itself calls (NVIDIA's binding, the one mig-parted, GFD
and the device plugin vendor), NVML's header, the real H200's answers (nvml-and-files.json,
`nvidia-smi mig -lgip`), go-nvlib's own MIG profile naming, and the host's DIR/state.json.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pynvml
import pytest

from gpud.sim.nvmlc import build
from gpud.sim.state import load
from tests.support.nvmlc import probe
from tests.support.present import present
from tests.support.smi_mig_tables import lgip_by_id

pytestmark = pytest.mark.tools

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "h200"
REAL = json.loads((FIX / "nvml-and-files.json").read_text())


def _exported(so: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(so)], check=True, capture_output=True, text=True).stdout
    return {line.split()[-1] for line in out.splitlines() if " T " in line}


def test_every_function_go_nvml_calls_is_exported(nvml_so):
    go_nvml = Path(build.header_from_go_proxy()).parent
    called = {m for f in go_nvml.glob("*.go") for m in re.findall(r"\bC\.(nvml\w+)\(", f.read_text())}
    assert len(called) > 400
    assert called - _exported(nvml_so) == set()


def test_every_header_prototype_is_exported_and_nothing_else(nvml_so):
    header = build.header_from_go_proxy().read_text()
    declared = set(re.findall(r"DECLDIR\s+(?:char\s*\*\s*)?(nvml\w+)\s*\(", header))
    assert declared and _exported(nvml_so) == declared
    out = subprocess.run(["readelf", "-d", str(nvml_so)], check=True, capture_output=True, text=True).stdout
    assert "Library soname: [libnvidia-ml.so.1]" in out


_CTYPES_CHECK = r"""
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
out = {"init": lib.nvmlInit_v2()}
dev = ctypes.c_void_p()
out["handle"] = lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev))
buf = ctypes.create_string_buffer(64)
out["vbios"] = lib.nvmlDeviceGetVbiosVersion(dev, buf, 64)          # not implemented by the simulator
lib.nvmlErrorString.restype = ctypes.c_char_p
out["vbios_str"] = lib.nvmlErrorString(out["vbios"]).decode()
first, second = lib.nvmlErrorString(3), lib.nvmlErrorString(3)
out["stable"] = ctypes.cast(lib.nvmlErrorString(3), ctypes.c_void_p).value == ctypes.cast(lib.nvmlErrorString(3), ctypes.c_void_p).value
out["name"] = lib.nvmlDeviceGetName(dev, buf, 64)
out["name_str"] = buf.value.decode()
out["short"] = lib.nvmlDeviceGetName(dev, buf, 4)
from gpud.sim.nvmlc import bridge
out["mismatches"] = bridge.mismatches()
out["shutdown"] = lib.nvmlShutdown()
print(json.dumps(out))
"""


def test_unserved_functions_answer_not_supported_and_structs_match_the_header(nvml_so, sim_dir):
    """A Python process loading the library uses its own interpreter; every struct a served
    function takes has nvidia-ml-py's size equal to the header's (else the bridge refuses it)."""
    host = sim_dir("h200")
    env = {**os.environ, "GPUD_SIM_DIR": str(host)}
    res = subprocess.run([sys.executable, "-c", _CTYPES_CHECK, str(nvml_so)], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["mismatches"] == {}
    assert (out["init"], out["handle"], out["name"], out["shutdown"]) == (0, 0, 0, 0)
    assert out["name_str"] == "NVIDIA H200" == REAL["nvmlDeviceGetName"]["ok"]
    assert out["short"] == 7  # INSUFFICIENT_SIZE
    assert (out["vbios"], out["vbios_str"], out["stable"]) == (3, "Not Supported", True)
    assert load(host).calls["nvmlDeviceGetVbiosVersion"] == 1  # counted for `gpud-sim stats`


def test_go_nvml_sees_the_host_as_state_json_says(goprobe, sim_dir):
    host = sim_dir("h200:2", "l40s", mig_on=[1])
    probe(goprobe, host, "create", "1", "0")  # NVML_GPU_INSTANCE_PROFILE_1_SLICE
    probe(goprobe, host, "create", "1", "2")  # 3 slices
    dump = probe(goprobe, host, "dump")
    state = load(host)
    assert (dump["driver"], dump["cuda"]) == (REAL["nvmlSystemGetDriverVersion"]["ok"],
                                              REAL["nvmlSystemGetCudaDriverVersion"]["ok"])
    assert dump["nvml"] == REAL["nvmlSystemGetNVMLVersion"]["ok"]
    gpus = sorted(a for a, g in state.gpus.items())
    assert [g["bus_id"] for g in dump["gpus"]] == [f"0000{a.upper()}" for a in gpus]
    assert [g["uuid"] for g in dump["gpus"]] == [state.gpus[a].uuid for a in gpus]
    h200 = dump["gpus"][0]
    assert (h200["name"], h200["cuda_cc"]) == ("NVIDIA H200", "9.0")
    assert h200["pci_device_id"] == REAL["nvmlDeviceGetPciInfo_v3"]["ok"]["pciDeviceId"]
    assert (h200["mig_capable"], h200["mig_enabled"], h200["max_mig_devices"], h200["mig_devices"]) == \
        (True, False, REAL["nvmlDeviceGetMaxMigDeviceCount"]["ok"], [])
    # go-nvlib names each GI profile from its memory and the GPU's: the real H200's names
    lgip = lgip_by_id((FIX / "nvidia-smi-mig-lgip.txt").read_text())
    assert {p for p in h200["profiles"] if "c." not in p} == {row["name"] for row in lgip.values()}
    l40s = dump["gpus"][2]
    assert (l40s["mig_capable"], l40s["profiles"], l40s["mig_devices"]) == (False, None, [])
    mig = dump["gpus"][1]
    gis = {gi.id: gi for gi in state.gpus[gpus[1]].gis}
    assert [(m["gi"], m["ci"], m["uuid"]) for m in mig["mig_devices"]] == \
        sorted((gi.id, ci.id, ci.uuid) for gi in gis.values() for ci in gi.cis)
    by_gi = {m["gi"]: m for m in mig["mig_devices"]}
    one, three = (next(m for m in mig["mig_devices"] if m["gi_slices"] == n) for n in (1, 3))
    assert (one["profile"], three["profile"]) == ("1g.18gb", "3g.71gb")  # go-nvlib's names
    assert one["name"] == "NVIDIA H200 MIG 1g.18gb"
    assert (one["sms"], three["sms"]) == (lgip[19]["sm"], lgip[9]["sm"])
    assert all(m["parent_uuid"] == state.gpus[gpus[1]].uuid for m in by_gi.values())


def test_error_codes_are_the_real_h200s(goprobe, sim_dir):
    host = sim_dir("h200")
    got = probe(goprobe, host, "errors")
    for key, value in got.items():
        if key == "nvmlDeviceGetHandleByPciBusId_v2(bad)":
            # the capture's string is not recorded; goprobe's (function 7) is compared with the
            # probe's own run on the real H200 below, and every form in tests/sim/test_handle_lookups_real.py
            continue
        if key == "nvmlDeviceGetHandleByIndex(1) (one GPU)":  # goprobe asks index 1024 of a 1-GPU host
            assert value == REAL[key]["error"]
            continue
        real = REAL[key]
        want = real["error"] if "error" in real else real["ok"]
        if key == "nvmlDeviceIsMigDeviceHandle":
            want = 0 if real["ok"] == "c_uint(0)" else 1
        assert value == want, key


def test_many_threads_and_processes_at_once(goprobe, sim_dir):
    """16 OS threads in one Go process, and three processes creating GPU instances at once: every
    call answered, every instance in state.json with its own id."""
    host = sim_dir("h200", mig_on=[0])
    assert probe(goprobe, host, "threads", "16") == {"threads": 16, "errors": None}
    procs = [subprocess.Popen([sys.executable, "-m", "gpud.sim.cli", "exec", str(host), "--", str(goprobe),
                               "create", "0", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    ids = sorted(json.loads(o)["gi"] for o, _ in outs)
    assert ids == sorted(gi.id for gi in load(host).gpus["0000:18:00.0"].gis) and len(set(ids)) == 3


def test_an_open_session_of_a_go_program_blocks_the_reset_until_it_exits(goprobe, sim_dir):
    host = sim_dir("a100-40gb")
    # Persistence mode (on by default, as on most hosts) refuses a reset by itself: off first, so
    # the refusal below comes from the session alone.
    off = subprocess.run([str(host / "bin" / "nvidia-smi"), "-pm", "0", "-i", "0000:18:00.0"], capture_output=True, text=True)
    assert off.returncode == 0 and load(host).persistent == [], off.stdout
    holder = subprocess.Popen([sys.executable, "-m", "gpud.sim.cli", "exec", str(host), "--", str(goprobe), "hold"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert present(holder.stdout).readline().strip() == "open"
        session = load(host).sessions
        assert [(s.pid, s.name) for s in session] == [(holder.pid, "goprobe")]
        refused = subprocess.run([str(host / "bin" / "nvidia-smi"), "-r", "-i", "0000:18:00.0"],
                                 capture_output=True, text=True)
        assert refused.returncode == 255 and "In use by another client" in refused.stdout
    finally:
        present(holder.stdin).close()
        holder.wait(timeout=60)
        present(holder.stdout).close()
        present(holder.stderr).close()
    assert load(host).sessions == []
    ok = subprocess.run([str(host / "bin" / "nvidia-smi"), "-r", "-i", "0000:18:00.0"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout


def test_mode_change_through_go_nvml_follows_the_driver(goprobe, sim_dir):
    """Hopper applies MIG mode at once when idle; Ampere keeps it pending (RESET_REQUIRED) until the
    reset mig-parted runs."""
    host = sim_dir("h100-80gb", "a100-40gb")
    assert probe(goprobe, host, "mig", "0", "1") == {"activation": 0}
    assert probe(goprobe, host, "mig", "1", "1") == {"activation": pynvml.NVML_ERROR_RESET_REQUIRED}
    state = load(host)
    assert (state.gpus["0000:18:00.0"].mig_mode, state.gpus["0000:2a:00.0"].mig_mode,
            state.gpus["0000:2a:00.0"].mig_pending) == (1, 0, 1)


def test_event_wait_blocks_for_its_timeout(goprobe, sim_dir):
    """No event ever happens on a simulated GPU: the wait ends with NVML_ERROR_TIMEOUT, not before
    the timeout has passed."""
    host = sim_dir("h200")
    t0 = time.monotonic()
    assert probe(goprobe, host, "wait", "1500") == {"wait": 10}
    assert time.monotonic() - t0 >= 1.5


REAL_PROBE = Path(__file__).resolve().parents[1] / "fixtures" / "h200-goprobe"


def test_the_probe_reads_a_simulated_h200_as_it_read_the_real_one(goprobe, sim_dir):
    """The same Go program, through NVIDIA's go-nvml and go-nvlib, on the real H200 (captured,
    tests/fixtures/h200-goprobe) and on a simulated one: equal but for the host's own identity."""
    real = json.loads((REAL_PROBE / "goprobe-dump.json").read_text())
    host = sim_dir("h200")
    sim = probe(goprobe, host, "dump")
    assert {k: v for k, v in sim.items() if k != "gpus"} == {k: v for k, v in real.items() if k != "gpus"}
    assert len(sim["gpus"]) == len(real["gpus"]) == 1
    state = load(host)
    (address,) = state.gpus
    own = {"uuid": state.gpus[address].uuid, "bus_id": f"0000{address.upper()}"}
    assert sim["gpus"][0] == {**real["gpus"][0], **own}
    assert probe(goprobe, host, "errors") == json.loads((REAL_PROBE / "goprobe-errors.json").read_text())
