"""gpud as users meet it: a process, its socket, the file it watches, and gpudctl."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.scenarios.definitions import SEED, layout, mig
from tests.support.daemon import ROOT, wait_until
from tests.support.present import present

pytestmark = pytest.mark.daemon

EMPTY = "version: v1\nlayouts:\n  hands-off: []\n"


def _selected(d) -> str | None:
    return d.status()["layout"]["selected"]


def test_seed_layout_applied_and_status_shape(daemon):
    d = daemon(["h100-80gb:8"], SEED)
    r = d.ctl("apply", "--wait", "--timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    st = d.status()
    assert st["phase"] == "converged"
    assert st["layout"] == {"path": str(d.config), "selected": "test", "chosen": False, "valid": True, "errors": [],
                            "warnings": [], "errors_omitted": 0, "warnings_omitted": 0}
    assert [g["index"] for g in st["gpus"]] == list(range(8))
    g0 = st["gpus"][0]
    for key in ("index", "pci", "uuid", "model", "pci_id", "driver", "workload", "iommu_group", "mig",
                "converged", "message"):
        assert key in g0
    assert g0["model"] == "NVIDIA H100 80GB HBM3" and g0["pci_id"] == "10de:2330" and g0["driver"] == "nvidia"
    assert g0["mig"]["capable"] and g0["mig"]["mode"] == "enabled"
    profiles = sorted(i["profile"] for i in g0["mig"]["instances"])
    assert profiles == ["1g.10gb"] * 4 + ["3g.40gb"]
    assert all(i["uuid"].startswith("MIG-") and {"start", "size"} <= set(i["placement"]) for i in g0["mig"]["instances"])
    assert sorted(i["placement"]["start"] for i in g0["mig"]["instances"]) == [0, 1, 2, 3, 4]
    assert all(g["mig"]["mode"] == "disabled" and g["converged"] for g in st["gpus"][1:])
    table = d.ctl("status").stdout
    assert "4x1g.10gb" in table and "MIG 3g.40gb" in table and "UUID: MIG-" in table


def test_bad_file_is_refused_and_changes_nothing(daemon):
    d = daemon(["h200:2"], EMPTY)
    assert d.ctl("apply", "--wait").returncode == 0
    calls = d.mutating_calls()
    bad = "version: v1\nlayouts:\n  x:\n    - devices: [0]\n      mig-enabled: true\n      mig-devices: {\"1g.10gb\": 2}\n"
    d.config.write_text(bad)
    st = wait_until(lambda: (s := d.status())["layout"]["errors"] and s, what="the error in status")
    assert st["layout"]["valid"] is False
    err = st["layout"]["errors"][0]
    assert f"{d.config}:6" in err and "1g.10gb is not a MIG profile of NVIDIA H200" in err and "1g.18gb" in err
    assert st["layout"]["selected"] == "hands-off"  # the last good layout stays in force
    r = d.ctl("apply", "--wait")
    assert r.returncode == 4, r.stdout + r.stderr
    assert d.mutating_calls() == calls
    chk = d.ctl("check", str(d.config))
    assert chk.returncode == 4 and "1g.10gb is not a MIG profile" in chk.stdout + chk.stderr


def test_inotify_follows_in_place_edit_rename_delete_and_recreate(daemon):
    d = daemon(["h100-80gb:2"], EMPTY)
    wait_until(lambda: _selected(d) == "hands-off", what="initial layout")
    # in-place edit
    d.config.write_text(layout(mig([0], {"7g.80gb": 1}), name="edited"))
    wait_until(lambda: _selected(d) == "edited", what="in-place edit")
    # an editor's atomic rename
    tmp = d.config.with_name(".layout.yaml.swp")
    tmp.write_text(layout(mig([0], None), name="renamed"))
    os.replace(tmp, d.config)
    wait_until(lambda: _selected(d) == "renamed", what="atomic rename")
    # deletion keeps the last good layout and says so
    d.config.unlink()
    st = wait_until(lambda: (s := d.status())["layout"]["errors"] and s, what="missing file reported")
    assert "not found" in st["layout"]["errors"][0] and st["layout"]["selected"] == "renamed"
    # re-creation is picked up
    d.config.write_text(layout(mig([1], {"3g.40gb": 2}), name="recreated"))
    wait_until(lambda: _selected(d) == "recreated" and d.status()["layout"]["valid"], what="re-created file")
    assert d.ctl("apply", "--wait").returncode == 0
    g1 = d.status()["gpus"][1]
    assert sorted(i["profile"] for i in g1["mig"]["instances"]) == ["3g.40gb", "3g.40gb"]


def test_plan_shows_steps_without_changing_anything(daemon, tmp_path):
    d = daemon(["h100-80gb:2"], EMPTY)
    assert d.ctl("apply", "--wait").returncode == 0
    calls = d.mutating_calls()
    cand = tmp_path / "candidate.yaml"
    cand.write_text(layout(mig([0], {"3g.40gb": 1, "1g.10gb": 4})))
    r = d.ctl("plan", "--json", str(cand))
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    steps = plan["gpus"][0]["steps"]
    assert steps[0]["action"] == "set-mig-mode"
    gis = sorted((s["profile"], s["placement"]["start"]) for s in steps if s["action"] == "create-gi")
    assert gis == [("1g.10gb", 0), ("1g.10gb", 1), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4)]
    assert plan["disruption"]["mode_changes"] == [d.status()["gpus"][0]["pci"]]
    assert d.mutating_calls() == calls
    cand.write_text(layout(mig([0], {"4g.40gb": 1, "3g.40gb": 2})))
    r = d.ctl("plan", str(cand))
    assert r.returncode == 4 and "needs 12 of 8 memory slices" in r.stdout + r.stderr


def test_busy_instance_blocks_apply_and_names_the_holder(daemon):
    d = daemon(["h100-80gb:1"], layout(mig([0], {"3g.40gb": 2})))
    assert d.ctl("apply", "--wait").returncode == 0
    uuid = d.status()["gpus"][0]["mig"]["instances"][0]["uuid"]
    assert d.sim("hold", uuid, "--pid", "4121", "--name", "train.py").returncode == 0
    d.config.write_text(layout(mig([0], {"7g.80gb": 1})))
    wait_until(lambda: d.status()["layout"]["selected"] == "test" and
               d.status()["gpus"][0]["state"] == "waiting", what="waiting")
    r = d.ctl("apply", "--wait", "--timeout", "30")
    assert r.returncode == 5 and "4121" in r.stdout + r.stderr
    g = d.status()["gpus"][0]
    assert g["state"] == "waiting" and g["holders"][0]["pid"] == 4121 and g["holders"][0]["name"] == "train.py"
    assert "pid 4121" in d.ctl("status").stdout
    # the release reaches the daemon as a device event: it proceeds by itself
    assert d.sim("release", uuid, "--pid", "4121").returncode == 0
    wait_until(lambda: d.status()["gpus"][0]["state"] == "converged", what="converged after release")
    assert [i["profile"] for i in d.status()["gpus"][0]["mig"]["instances"]] == ["7g.80gb"]


def test_events_follow_shows_steps(daemon):
    d = daemon(["h100-80gb:1"], EMPTY)
    assert d.ctl("apply", "--wait").returncode == 0
    follower = subprocess.Popen([sys.executable, "-m", "gpud.cli.gpudctl", "--socket", str(d.socket), "events", "-f"],
                                stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        d.config.write_text(layout(mig([0], {"1g.10gb": 2})))
        seen = []
        for line in present(follower.stdout):
            seen.append(line)
            if "converged" in line:
                break
        text = "".join(seen)
        assert "create-gi" in text and "1g.10gb" in text
    finally:
        follower.kill()
        follower.wait()
        present(follower.stdout).close()


def test_read_only_daemon_plans_but_never_mutates(daemon):
    d = daemon(["h100-80gb:2"], layout(mig([0], {"7g.80gb": 1})), "--read-only")
    r = d.ctl("apply", "--wait")
    assert r.returncode == 5
    st = d.status()
    assert st["read_only"] is True and st["gpus"][0]["state"] == "read-only"
    assert "would apply" in st["gpus"][0]["message"]
    assert d.mutating_calls() == 0


def test_unplug_and_plug(daemon):
    d = daemon(["h100-80gb:2"], layout(mig([1], {"7g.80gb": 1}), mig([0], None)))
    assert d.ctl("apply", "--wait").returncode == 0
    pci = d.status()["gpus"][1]["pci"]
    assert d.sim("unplug", pci).returncode == 0
    wait_until(lambda: (g := d.status()["gpus"][1])["state"] == "gone" and g["pci"] == pci, what="GPU gone")
    assert d.sim("plug", pci).returncode == 0
    wait_until(lambda: (g := d.status()["gpus"][1])["pci"] == pci and g["converged"], what="re-added GPU converged")


def test_mig_profiles_like_nvidia_smi(daemon):
    d = daemon(["h200:1"], layout(mig([0], {"3g.71gb": 1})))
    assert d.ctl("apply", "--wait").returncode == 0
    out = d.ctl("mig", "profiles").stdout
    assert "3g.71gb" in out and "7g.141gb" in out and "1g.18gb+me" in out


def test_stop_leaves_hardware_as_it_is(daemon):
    d = daemon(["h100-80gb:1"], layout(mig([0], {"3g.40gb": 2})))
    assert d.ctl("apply", "--wait").returncode == 0
    before = d.sim("show", "--json").stdout
    assert d.stop() == 0
    assert d.sim("show", "--json").stdout == before


def test_metrics_textfile(daemon, tmp_path):
    prom = tmp_path / "gpud.prom"
    d = daemon(["h100-80gb:2"], layout(mig([0], {"1g.10gb": 4, "3g.40gb": 1}), mig([1], None)),
               "--metrics-textfile", str(prom))
    assert d.ctl("apply", "--wait").returncode == 0
    pci = d.status()["gpus"][0]["pci"]
    text = wait_until(lambda: prom.exists() and 'profile="3g.40gb"' in (t := prom.read_text()) and t, what="metrics")
    assert f'gpud_mig_devices{{pci="{pci}",profile="1g.10gb"}} 4.0' in text
    assert "gpud_layout_valid 1.0" in text
    assert f'gpud_gpu_state{{index="0",model="NVIDIA H100 80GB HBM3",pci="{pci}",state="converged"}} 1.0' in text
