"""Item: after MIG devices change, the CDI spec is regenerated with `nvidia-ctk cdi generate`, as
mig-manager does under the operator's default cdi.enabled=true, when the toolkit's refresh unit
is not there.

Here a stand-in executable records the arguments it was called with and writes the spec file, so
what is checked is the exact command line gpud runs (on the simulated host: under `gpud-sim exec`,
with the host's directory as the driver root), and that it runs only after a pass that changed MIG
devices. NVIDIA's real nvidia-ctk runs in tests/nvmlc/test_nvidia_ctk.py.
"""

from __future__ import annotations

import json

import pytest

from tests.support.daemon import Daemon, wait_until

pytestmark = pytest.mark.daemon

WHOLE = "version: v1\nlayouts:\n  l:\n    - devices: all\n      mig-enabled: false\n"
MIG = """version: v1
layouts:
  l:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"1g.10gb": 2}
    - devices: [1]
      mig-enabled: false
"""


def _fake_ctk(tmp_path):
    calls = tmp_path / "calls.jsonl"
    ctk = tmp_path / "bin" / "nvidia-ctk"
    ctk.parent.mkdir()
    ctk.write_text(f"""#!/usr/bin/env python3
import json, sys
with open({str(calls)!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
out = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--output=")]
if out:
    open(out[0], "w").write("cdiVersion: 0.5.0\\nkind: nvidia.com/gpu\\ndevices: []\\n")
""")
    ctk.chmod(0o755)
    return ctk, calls


def _calls(calls) -> list[list[str]]:
    return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []


def test_nvidia_ctk_regenerates_the_spec_after_a_mig_change_only(tmp_path):
    ctk, calls = _fake_ctk(tmp_path)
    spec = tmp_path / "cdi" / "nvidia.yaml"
    d = Daemon(tmp_path / "d", ["h100-80gb:2"], WHOLE, ["--nvidia-ctk", str(ctk), "--cdi-spec", str(spec)])
    try:
        assert d.ctl("apply", "--wait").returncode == 0
        assert _calls(calls) == []  # nothing about MIG changed
        d.config.write_text(MIG)
        r = d.ctl("apply", "--wait")
        assert r.returncode == 0, r.stdout + r.stderr
        wait_until(lambda: _calls(calls), timeout=60, what="nvidia-ctk called")
        assert _calls(calls) == [["cdi", "generate", f"--driver-root={d.host.resolve()}", f"--output={spec}"]]
        assert spec.read_text().startswith("cdiVersion")
        assert any(e["message"].startswith("CDI spec regenerated: ") for e in d.events())
        assert d.ctl("apply", "--wait").returncode == 0  # converged: no second call
        assert len(_calls(calls)) == 1
    finally:
        d.stop()
    assert d.proc.returncode == 0, d.log.read_text()


def test_a_failing_nvidia_ctk_is_reported_and_the_apply_stands(tmp_path):
    ctk = tmp_path / "nvidia-ctk"
    ctk.write_text("#!/bin/sh\necho 'failed to initialize NVML: permission denied' >&2\nexit 1\n")
    ctk.chmod(0o755)
    d = Daemon(tmp_path / "d", ["h100-80gb:2"], MIG, ["--nvidia-ctk", str(ctk), "--cdi-spec",
                                                      str(tmp_path / "nvidia.yaml")])
    try:
        assert d.ctl("apply", "--wait").returncode == 0
        wait_until(lambda: any("CDI spec not regenerated" in e["message"] for e in d.events()), timeout=60,
                   what="failure reported")
        message = next(e["message"] for e in d.events() if "CDI spec not regenerated" in e["message"])
        assert "exited 1" in message and "permission denied" in message
        assert d.status()["phase"] == "converged"
    finally:
        d.stop()
