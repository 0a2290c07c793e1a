"""Issue 29 item 7: plan before apply. Under `policy.apply: manual` a saved file is taken (valid,
status shows it) but only `gpudctl apply` changes GPUs: until then each GPU says `pending: N steps`
and the simulator's own counters show no NVML mutating call; `gpudctl plan` shows the new layout's
steps with a per-GPU summary line first. A restart applies nothing either."""

from __future__ import annotations

import pytest

from tests.scenarios.definitions import layout, mig
from tests.support.daemon import wait_until

pytestmark = pytest.mark.daemon

GPU0 = "0000:18:00.0"
MANUAL = {"apply": "manual"}


def _gpu0(d) -> dict:
    return next(g for g in d.status()["gpus"] if g["pci"] == GPU0)


def test_manual_policy_waits_for_gpudctl_apply(daemon):
    d = daemon(["h100-80gb"], layout(mig([0], None), policy=MANUAL))
    assert d.ctl("apply", "--wait", "--timeout", "60").returncode == 0
    calls = d.mutating_calls()
    d.config.write_text(layout(mig([0], {"1g.10gb": 4, "3g.40gb": 1}), policy=MANUAL))
    assert d.ctl("reload").returncode == 0
    row = wait_until(lambda: (g := _gpu0(d))["state"] == "pending" and g["message"].startswith("pending: ") and g,
                     what="the pending change said")
    # MIG on, 5 GPU instances, 5 compute instances (the simulator creates each with one call)
    assert row["message"].startswith("pending: 11 steps (policy.apply: manual") and "gpudctl apply" in row["message"]
    assert d.status()["phase"] == "pending" and d.status()["layout"]["valid"]
    assert d.mutating_calls() == calls and d.sim_state()["gpus"][GPU0]["mig_mode"] == 0
    plan = d.ctl("plan")
    lines = plan.stdout.splitlines()
    assert lines[0].startswith(f"GPU 0 {GPU0}: 11 steps (") and lines[1].startswith("  1. "), plan.stdout
    assert lines[11].startswith("  11. ") and not lines[12].startswith("  12. "), plan.stdout
    # a restart applies nothing either
    assert d.stop() == 0
    d.start()
    wait_until(lambda: _gpu0(d)["state"] == "pending", what="pending after the restart")
    assert d.mutating_calls() == calls
    r = d.ctl("apply", "--wait", "--timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(d.sim_state()["gpus"][GPU0]["gis"]) == 5 and _gpu0(d)["state"] == "converged"


def test_plan_prints_a_summary_line_per_gpu_before_its_steps(daemon):
    d = daemon(["h100-80gb"], "version: v1\n")
    cand = d.tmp / "cand.yaml"
    cand.write_text(layout(mig([0], {"1g.10gb": 4, "3g.40gb": 1})))
    plan = d.ctl("plan", str(cand)).stdout.splitlines()
    # MIG on first (mode change), then the GPU and compute instances once MIG is on
    assert plan[0] == f"GPU 0 {GPU0}: 11 steps (set-mig-mode, create-gi x5, create-ci x5)", plan
    numbered = [ln for ln in plan[1:] if ln.startswith("  ") and ln.strip()[0].isdigit()]
    assert plan[0].split(": ", 1)[1].startswith(f"{len(numbered)} step"), plan
