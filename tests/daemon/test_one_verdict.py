"""Issue 29 item 3: `gpudctl check` and the daemon give one verdict on the same file. A file with
one GPU the planner cannot converge (NVIDIA's MIG user guide: an A100 40GB has at most 4 x
1g.10gb) is refused whole by both, with the file and line of the entry; under
`policy.on-infeasible: skip-gpu` both take it, the daemon applies the other GPU and fails that
one in the same words. What the GPUs are is read from the simulator's own state file."""

from __future__ import annotations

import json

import pytest

from tests.scenarios.definitions import layout, mig

pytestmark = pytest.mark.daemon

GPU0, GPU1 = "0000:18:00.0", "0000:2a:00.0"


def _mig_devices_line(text: str) -> int:
    return next(n for n, ln in enumerate(text.splitlines(), 1) if ln.strip() == "mig-devices:")


def _gis(d, pci: str) -> int:
    return len(d.sim_state()["gpus"][pci]["gis"])


def test_one_infeasible_gpu_makes_the_file_invalid_for_check_and_daemon(daemon):
    d = daemon(["a100-40gb:2"], "version: v1\n")
    text = layout(mig([0], {"1g.10gb": 7}), mig([1], {"1g.10gb": 4}))
    line = _mig_devices_line(text)
    cand = d.tmp / "cand.yaml"
    cand.write_text(text)
    check = d.ctl("check", str(cand))
    assert check.returncode == 4, check.stdout + check.stderr
    want = f"{cand}:{line} layouts.test[0].mig-devices: GPU 0 {GPU0}: infeasible: 7 x 1g.10gb exceeds"
    assert want in check.stdout + check.stderr
    d.config.write_text(text)
    assert d.ctl("reload").returncode == 4
    st = d.status()
    assert st["layout"]["valid"] is False
    assert any(f"{d.config}:{line} layouts.test[0].mig-devices: GPU 0 {GPU0}: infeasible:" in e
               for e in st["layout"]["errors"]), st["layout"]
    assert "INVALID" in d.ctl("status").stdout and "INVALID" in check.stdout
    assert _gis(d, GPU0) == _gis(d, GPU1) == 0  # nothing applied, the other GPU neither
    assert d.sim_state()["gpus"][GPU1]["mig_mode"] == 0


def test_skip_gpu_policy_applies_the_others_and_both_say_valid(daemon):
    d = daemon(["a100-40gb:2"], "version: v1\n")
    text = layout(mig([0], {"1g.10gb": 7}), mig([1], {"1g.10gb": 4}), policy={"on-infeasible": "skip-gpu"})
    cand = d.tmp / "cand.yaml"
    cand.write_text(text)
    check = d.ctl("check", str(cand), "--json")
    assert check.returncode == 0, check.stdout + check.stderr
    reply = json.loads(check.stdout)
    assert reply["valid"] and len(reply["warnings"]) == 1 and "infeasible: 7 x 1g.10gb" in reply["warnings"][0]
    d.config.write_text(text)
    assert d.ctl("reload").returncode == 0
    r = d.ctl("apply", "--wait", "--timeout", "60")
    assert r.returncode == 5, r.stdout + r.stderr  # not converged: GPU 0 failed
    st = d.status()
    assert st["layout"]["valid"] is True
    rows = {g["pci"]: g for g in st["gpus"]}
    assert rows[GPU0]["state"] == "failed" and "7 x 1g.10gb exceeds" in rows[GPU0]["message"]
    assert rows[GPU1]["state"] == "converged"
    assert _gis(d, GPU1) == 4 and _gis(d, GPU0) == 0
    # The warning stays while the file is in force: a status read after a new read of the host
    # (--fresh) resolves the file again and judges it again, as the load did.
    for seen in (st, json.loads(d.ctl("status", "--fresh", "--json").stdout)):
        assert any("infeasible: 7 x 1g.10gb" in w for w in seen["layout"]["warnings"]), seen["layout"]


def test_on_infeasible_takes_only_its_two_values(daemon):
    d = daemon(["a100-40gb"], "version: v1\n")
    cand = d.tmp / "cand.yaml"
    cand.write_text("version: v1\nselected: a\nlayouts:\n  a: []\npolicy:\n  on-infeasible: maybe\n")
    r = d.ctl("check", str(cand))
    assert r.returncode == 4 and f"{cand}:6 policy.on-infeasible:" in r.stdout + r.stderr
    assert "refuse-file" in r.stdout + r.stderr and "skip-gpu" in r.stdout + r.stderr
