"""The simulated H200 answers NVML as the real one does, through the C library a Go or C program
loads (gpud/sim/nvmlc), for every one of the 533 read-only calls captured on a real H200
(tests/fixtures/h200/2026-12-04/nvml-real.json, made with tests/nvmlc/nvml_diff.py `probe`).

The probe runs under `gpud-sim exec`, so nvidia-ml-py inside it loads the simulator's
libnvidia-ml.so.1, exactly as it loaded the real one. What still differs is listed, function by
function and with its reason, in docs/hardware/nvml-h200-diff.md; the test holds the two equal, so
a new difference fails here and a fixed one must leave the list."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.nvmlc import nvml_diff
from tests.support.nvmlc import gpud_sim_exec

pytestmark = pytest.mark.tools

ROOT = Path(__file__).resolve().parents[2]
REAL = ROOT / "tests/fixtures/h200/2026-12-04/nvml-real.json"
DOC = ROOT / "docs/hardware/nvml-h200-diff.md"
CLASSES = {"identity", "vm", "topology", "unserved"}


def listed() -> dict[str, str]:
    """function -> class, from the doc's table rows "| `nvmlX` | class | why |"."""
    rows = re.findall(r"^\| `(nvml\w+)` \| (\w+) \|", DOC.read_text(), re.M)
    assert rows, f"{DOC}: no table of differences"
    return dict(rows)


def own_pid1_name() -> str | None:
    try:
        return Path("/proc/1/cmdline").read_bytes().split(b"\0", 1)[0].decode() or None
    except OSError:
        return None


@pytest.fixture(scope="module")
def sim_answers(nvml_so, tmp_path_factory):
    from gpud.sim.cli import create

    host = tmp_path_factory.mktemp("h200") / "host"
    create(host, ["h200"], [])
    out = host.parent / "sim.json"
    res = gpud_sim_exec(host, sys.executable, str(Path(nvml_diff.__file__)), "probe", "-o", str(out))
    assert res.returncode == 0, res.stderr
    sim = json.loads(out.read_text())
    assert sim["meta"]["mode"] == "real"  # nvidia-ml-py loaded a libnvidia-ml.so.1: the simulator's
    return sim


def test_every_remaining_difference_is_listed_and_none_is_meaningful(sim_answers):
    real = json.loads(REAL.read_text())
    d = nvml_diff.diff(real, sim_answers, None, None)
    found: dict[str, list[dict]] = {}
    for x in d["diffs"]:
        found.setdefault(x["call"].split("(", 1)[0], []).append(x)
    # Process names: the real answer for pid 1 is that machine's pid 1 ("/process_api"); the
    # simulator answers this machine's, so the oracle for it is this machine's /proc.
    own = own_pid1_name()
    for x in found.pop("nvmlSystemGetProcessName", []):
        assert x["sim"] == ({"ok": own} if own else {"err": 6, "str": "Not Found"}), x
    doc = listed()
    assert set(doc.values()) <= CLASSES, doc
    assert sorted(found) == sorted(doc), "docs/hardware/nvml-h200-diff.md is out of step with the simulator"
    for fn, xs in found.items():
        if doc[fn] == "unserved":  # the C library's answer for a function FakeNvmlLib does not serve
            assert all(x["sim"].get("err") == 3 for x in xs), xs
    assert d["same"] >= 450, d["same"]


def test_the_gi_profile_struct_is_answered_as_the_driver_writes_it(sim_answers):
    """The rows issue #31 names, one by one, equal to the capture (not only "listed")."""
    real = {nvml_diff.key(r): nvml_diff.answer(r) for r in json.loads(REAL.read_text())["calls"]}
    sim = {nvml_diff.key(r): nvml_diff.answer(r) for r in sim_answers["calls"]}
    for call in (
        "nvmlDeviceGetGpuInstanceProfileInfoV(dev0,v2 struct reused for index 0 then 1, version set once)",
        "nvmlDeviceGetGpuInstanceProfileInfoV(dev0,index=0,v3 struct with name/capabilities pre-filled)",
        "nvmlDeviceGetGpuInstanceProfileInfoV(dev0,index=0,v3 struct)",
        "nvmlDeviceGetGpuInstanceProfileInfoV(dev0,index=0,version=0)",
        "nvmlDeviceGetGpuInstanceProfileInfoV(dev0,index=0,version=v1-size|1<<24)",
        "nvmlDeviceGetGpuInstancePossiblePlacements_v2(dev0,id=19,array 32,count 1 (short))",
        "nvmlDeviceGetGpuInstancePossiblePlacements(dev0,id=20,v1 symbol,array 32)",
        "nvmlDeviceGetGpuInstanceProfileInfoByIdV(dev0,id=6,v2)",
        "nvmlDeviceGetGpuInstanceRemainingCapacity(dev0,id=6)",
        "nvmlDeviceGetGpuInstancePossiblePlacements_v2(dev0,id=32,NULL array (count query))",
        "nvmlDeviceGetGpuInstances(dev0,id=21,array 16)",
        "nvmlDeviceGetGpuInstanceProfileInfoByIdV(dev0,id=1,v2)",
        "nvmlDeviceGetMemoryInfo_v2(dev0,version=0)",
        "nvmlDeviceGetMemoryInfo(dev0,v1)",
        "nvmlDeviceGetMemoryInfo_v2(dev0,v2)",
        "nvmlDeviceGetPersistenceMode(dev0)",
        "nvmlDeviceGetArchitecture(dev0)",
        "nvmlDeviceGetComputeMode(dev0)",
        "nvmlDeviceGetEccMode(dev0)",
        "nvmlDeviceGetGraphicsRunningProcesses_v3(dev0)",
        "nvmlDeviceGetMPSComputeRunningProcesses_v3(dev0)",
        "nvmlDeviceGetGpuFabricInfoV(dev0,v2)",
        "nvmlDeviceGetGpuFabricInfoV(dev0,v3)",
        "nvmlGetExcludedDeviceCount()",
        "nvmlErrorString(code=16)",
    ):
        assert call in real, call
        assert sim.get(call) == real[call], call
