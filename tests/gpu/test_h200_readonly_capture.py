"""gpud replayed on what a real H200 answered, compared with what gpud printed on that hardware.

Two real captures, both read-only, both one H200 at PCI 0000:00:06.0 with driver 580.159.04:
- tests/fixtures/h200/nvml-sysfs-readonly.json: the raw NVML and sysfs answers of a probe. It is
  served, value for value, by gpud.sim.replay_nvml (the seam the simulator uses: pynvml's library
  object), and the sysfs tree is laid out from its sysfs read-out.
- tests/fixtures/h200-gpud-readonly: what `gpud --read-only` printed on the real NVML
  (scripts/gpu-readonly-capture): `gpudctl status --json`, `mig profiles`, `plan --json`, and the
  read-only refusals.
A gpud daemon on the replay must print what the real run printed. The two captures were taken on
different GPUs of the same kind, so the GPU UUID is checked against the probe's own nvidia-smi -L
instead; per-run values (temporary paths) are left out; fields added to the replies since the
real run are not compared, every field the real run printed is.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from gpud.host.kernel.sysfs import Sysfs
from gpud.host.nvidia.nvml import Nvml, NvmlError
from gpud.host.readonly import ReadOnlyError
from gpud.sim import replay_nvml
from tests.scenarios.definitions import layout, mig
from tests.support.daemon import Daemon, wait_until
from tests.support.present import present

ROOT = Path(__file__).resolve().parents[2]
CAP = ROOT / "tests" / "fixtures" / "h200-gpud-readonly"
PROBE_DIR = ROOT / "tests" / "fixtures" / "h200"
PROBE = PROBE_DIR / "nvml-sysfs-readonly.json"
# The two layouts scripts/gpu-readonly-capture gave the real daemon.
HANDS_OFF = "version: v1\nlayouts:\n  hands-off: []\n"
CANDIDATE = ('version: v1\nlayouts:\n  candidate:\n    - devices: [0]\n      mig-enabled: true\n'
             '      mig-devices: {"3g.71gb": 1, "1g.18gb": 4}\n')


class ReplayedDaemon:
    """`gpud --sim DIR --replay PROBE --read-only`, as the capture script ran gpud on the real host."""

    def __init__(self, tmp: Path) -> None:
        self.host = replay_nvml.host(PROBE, tmp / "host")
        self.config = tmp / "layout.yaml"
        self.config.write_text(HANDS_OFF)
        self.candidate = tmp / "candidate.yaml"
        self.candidate.write_text(CANDIDATE)
        self.socket = tmp / "gpud.sock"
        self.log = tmp / "gpud.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("NOTIFY_SOCKET", None)
        with self.log.open("w") as log:  # the child has its own descriptor of it
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpud.daemon", "--sim", str(self.host), "--replay", str(PROBE), "--read-only",
                 "--config", str(self.config), "--socket", str(self.socket), "--state-dir", str(tmp / "state")],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        wait_until(lambda: self.ctl("version").returncode == 0 or self.proc.poll() is not None, what="gpud to answer")
        if self.proc.poll() is not None:
            raise AssertionError("gpud exited:\n" + self.log.read_text())
        # gpud answers before its first pass has concluded (phase `starting`); the real run's outputs
        # were taken after it, as every output compared here is
        wait_until(lambda: json.loads(self.ok("status", "--json"))["phase"] != "starting",
                   what="gpud's first pass to conclude")

    def ctl(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gpud.cli.gpudctl", "--socket", str(self.socket), *args],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)

    def ok(self, *args: str) -> str:
        r = self.ctl(*args)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    d = ReplayedDaemon(tmp_path_factory.mktemp("replay"))
    try:
        yield d
    finally:
        d.stop()


def assert_has(real, got, where: str = "") -> None:
    """Every field the real run printed is in `got` with the same value (new fields may be added)."""
    if isinstance(real, dict):
        assert isinstance(got, dict), f"{where}: expected an object, got {got!r}"
        for key, value in real.items():
            assert key in got, f"{where}.{key}: missing"
            assert_has(value, got[key], f"{where}.{key}")
    elif isinstance(real, list):
        assert isinstance(got, list) and len(got) == len(real), f"{where}: {got!r} != {real!r}"
        for i, (r, g) in enumerate(zip(real, got, strict=True)):
            assert_has(r, g, f"{where}[{i}]")
    else:
        assert got == real, f"{where}: replay printed {got!r}, the real run {real!r}"


@pytest.mark.daemon
def test_status_equals_the_real_runs(replayed):
    real = json.loads((CAP / "gpudctl-status.json").read_text())
    got = json.loads(replayed.ok("status", "--json"))
    # Per run: the layout's temporary path (also inside the warning text).
    real_path, got_path = real["layout"].pop("path"), got["layout"].pop("path")
    real["layout"]["warnings"] = [w.replace(real_path, "LAYOUT") for w in real["layout"]["warnings"]]
    got["layout"]["warnings"] = [w.replace(got_path, "LAYOUT") for w in got["layout"]["warnings"]]
    # Per GPU: the probe's GPU is not the run's, so its UUID is the one nvidia-smi listed on the probe's host.
    real_uuid, got_uuid = real["gpus"][0].pop("uuid"), got["gpus"][0].pop("uuid")
    assert got_uuid in (PROBE_DIR / "nvidia-smi-L.txt").read_text()
    assert real_uuid in (CAP / "nvidia-smi-L.txt").read_text()
    assert_has(real, got, "status")


@pytest.mark.daemon
def test_mig_profiles_equal_the_real_run_and_nvidia_smi(replayed):
    got = replayed.ok("mig", "profiles")
    assert got == (CAP / "gpudctl-mig-profiles.txt").read_text()
    # ... and what nvidia-smi printed on the probe's own host.
    assert got == (PROBE_DIR / "nvidia-smi-mig-lgip.txt").read_text() + (PROBE_DIR / "nvidia-smi-mig-lgipp.txt").read_text()


@pytest.mark.daemon
def test_plan_equals_the_real_runs(replayed):
    real = json.loads((CAP / "gpudctl-plan.json").read_text())
    got = json.loads(replayed.ok("plan", "--json", str(replayed.candidate)))
    assert_has(real, got, "plan")


@pytest.mark.daemon
def test_version_names_the_captured_driver(replayed):
    assert json.loads(replayed.ok("version", "--json"))["driver"] == \
        json.loads((CAP / "gpudctl-version.json").read_text())["driver"]


@pytest.fixture
def replay_session(tmp_path):
    host = replay_nvml.host(PROBE, tmp_path / "host")
    lib = replay_nvml.install(PROBE)
    try:
        yield host, lib
    finally:
        replay_nvml.uninstall()


def test_read_only_refusals_equal_the_real_runs(replay_session):
    """scripts/gpu-readonly-capture's refusal probe, on the replay: the same lines as on the H200."""
    host, _ = replay_session
    nv = Nvml(read_only=True)
    nv.open()
    try:
        g = nv.gpus()[0]
        before = (g.mig_mode, g.mig_pending, len(g.instances))
        sysfs = Sysfs(str(host / "sys"), read_only=True)
        lines = []
        for name, call in [("set_mig_mode", lambda: nv.set_mig_mode(g.pci, True)),
                           ("create_gpu_instance", lambda: nv.create_gpu_instance(g.pci, 9, 0)),
                           ("destroy_gpu_instance", lambda: nv.destroy_gpu_instance(g.pci, 1)),
                           ("sysfs unbind", lambda: sysfs.write(f"bus/pci/devices/{g.pci}/driver/unbind", g.pci)),
                           ("sysfs reset", lambda: sysfs.reset(g.pci))]:
            try:
                call()
                lines.append(f"{name} NOT REFUSED")
            except ReadOnlyError as e:
                lines.append(f"{name} refused: {e}")
        g2 = nv.gpu(g.pci)
        lines.append(f"unchanged: {before == (present(g2).mig_mode, present(g2).mig_pending, len(present(g2).instances))} {before}")
    finally:
        nv.close()
    assert lines == (CAP / "readonly-refusals.txt").read_text().splitlines()


def test_replay_refuses_what_it_has_no_capture_for(replay_session):
    nv = Nvml()  # not read-only: the replay library itself must refuse
    nv.open()
    try:
        pci = nv.gpus()[0].pci
        with pytest.raises(NvmlError) as e:
            nv.set_mig_mode(pci, True)
        assert e.value.code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
        with pytest.raises(NvmlError) as e:
            nv.create_gpu_instance(pci, 9, 0)
        assert e.value.code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
        assert nv.gpu("0000:18:00.0") is None  # no such bus id on the captured host: NOT_FOUND
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(pynvml.NVMLError) as err:  # the probe read no serial number
            pynvml.nvmlDeviceGetSerial(handle)
        assert err.value.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
        with pytest.raises(pynvml.NVMLError) as err:  # the real H200 refused this index: replayed
            pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, pynvml.NVML_GPU_INSTANCE_PROFILE_8_SLICE)
        assert err.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED
        with pytest.raises(pynvml.NVMLError) as err:
            pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX)
        assert err.value.value == pynvml.NVML_ERROR_INVALID_ARGUMENT
        with pytest.raises(pynvml.NVMLError) as err:  # a handle the library never gave out
            pynvml.nvmlDeviceGetUUID(ctypes.cast(ctypes.c_void_p(8), pynvml.c_nvmlDevice_t))
        assert err.value.value == pynvml.NVML_ERROR_INVALID_ARGUMENT
        with pytest.raises(pynvml.NVMLError) as err:
            pynvml.nvmlDeviceGetHandleByIndex(1)
        assert err.value.value == pynvml.NVML_ERROR_INVALID_ARGUMENT
    finally:
        nv.close()
    with pytest.raises(pynvml.NVMLError) as err:  # after the last nvmlShutdown
        pynvml.nvmlSystemGetDriverVersion()
    assert err.value.value == pynvml.NVML_ERROR_UNINITIALIZED


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["gpu_instances_existing"].update({"9": 1}), "gpu_instances_existing"),
    (lambda d: d["device"].pop("uuid"), "device.uuid: missing"),
    (lambda d: d["device"].update(procs=[{"pid": 1}]), "device.procs"),
    (lambda d: d["gpu_instance_possible_placements"]["9"][0].pop("size"),
     "gpu_instance_possible_placements.9.size: missing"),
    (lambda d: d["gpu_instance_profiles"]["NVML_GPU_INSTANCE_PROFILE_1_SLICE"].pop("memorySizeMB"),
     "gpu_instance_profiles.NVML_GPU_INSTANCE_PROFILE_1_SLICE.memorySizeMB: missing"),
])
def test_a_capture_that_would_need_invented_values_is_refused(tmp_path, edit, message):
    data = json.loads(PROBE.read_text())
    edit(data)
    bad = tmp_path / "capture.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(replay_nvml.CaptureError, match=message) as e:
        replay_nvml.Capture(bad)
    assert str(bad) in str(e.value)


@pytest.mark.daemon
def test_simulated_h200_serves_what_the_real_one_did(tmp_path):
    d = Daemon(tmp_path, ["h200"], layout(mig([0], None)))
    try:
        r = d.ctl("mig", "profiles")
        assert r.returncode == 0, r.stderr
        assert r.stdout == (CAP / "gpudctl-mig-profiles.txt").read_text()
    finally:
        d.stop()
