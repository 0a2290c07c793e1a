"""Issue 29 items 6-8: mig-parted files and workflows as they are. A mig-parted file without
`selected` is used unchanged: `gpudctl select NAME` / `gpudctl apply -c NAME` (nvidia-mig-parted
apply -c NAME) choose its entry without editing it, and the choice survives a restart; `check
--all-layouts` checks such a file. What the GPUs are is read from the simulator's own state file."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.daemon

GPU0 = "0000:18:00.0"
# NVIDIA's own config format (mig-parted examples/config.yaml shape): no `selected`
MIG_PARTED = """version: v1
mig-configs:
  all-disabled:
    - devices: all
      mig-enabled: false
  all-1g.10gb:
    - devices: all
      mig-enabled: true
      mig-devices:
        "1g.10gb": 7
  all-3g.40gb:
    - devices: all
      mig-enabled: true
      mig-devices:
        "3g.40gb": 2
"""


def _gis(d) -> list[int]:
    return sorted(gi["profile_id"] for gi in d.sim_state()["gpus"][GPU0]["gis"])


def test_a_mig_parted_file_without_selected_is_chosen_by_name_and_kept(daemon):
    d = daemon(["h100-80gb"], MIG_PARTED)
    st = d.status()
    assert not st["layout"]["valid"] and "selected" in st["layout"]["errors"][0]  # nothing is guessed
    assert d.sim_state()["gpus"][GPU0]["mig_mode"] == 0
    r = d.ctl("apply", "-c", "all-1g.10gb", "--wait", "--timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(d.sim_state()["gpus"][GPU0]["gis"]) == 7
    st = d.status()
    assert st["layout"]["valid"] and st["layout"]["selected"] == "all-1g.10gb" and st["layout"]["chosen"]
    assert "selected: all-1g.10gb (gpudctl select)" in d.ctl("status").stdout
    assert d.config.read_text() == MIG_PARTED  # the file is not edited
    # kept across a restart
    assert d.stop() == 0
    d.start()
    assert d.ctl("apply", "--wait", "--timeout", "60").returncode == 0
    assert d.status()["layout"]["selected"] == "all-1g.10gb" and len(d.sim_state()["gpus"][GPU0]["gis"]) == 7
    # select another; a name the file lacks changes nothing
    r = d.ctl("select", "no-such")
    assert r.returncode == 4 and "no-such" in r.stderr and "all-3g.40gb" in r.stderr, r.stderr
    assert d.status()["layout"]["selected"] == "all-1g.10gb" and d.status()["layout"]["valid"]
    assert d.ctl("select", "all-3g.40gb").returncode == 0
    assert d.ctl("apply", "--wait", "--timeout", "60").returncode == 0
    assert len(d.sim_state()["gpus"][GPU0]["gis"]) == 2
    assert json.loads((d.state_dir / "layout-choice.json").read_text()) == {"layout": "all-3g.40gb"}
    # back to the file's own: it has none, so that is refused and the choice stays
    r = d.ctl("select", "--file")
    assert r.returncode == 4 and "must name one of" in r.stderr, r.stderr
    st = d.status()["layout"]
    assert st["valid"] and st["selected"] == "all-3g.40gb" and len(d.sim_state()["gpus"][GPU0]["gis"]) == 2
    d.config.write_text(MIG_PARTED.replace("version: v1\n", "version: v1\nselected: all-disabled\n"))
    assert d.ctl("select", "--file").returncode == 0
    assert d.ctl("apply", "--wait", "--timeout", "60").returncode == 0
    assert d.status()["layout"]["selected"] == "all-disabled" and d.sim_state()["gpus"][GPU0]["mig_mode"] == 0
    assert not (d.state_dir / "layout-choice.json").exists()


def test_check_all_layouts_works_without_selected(daemon):
    d = daemon(["a100-40gb"], "version: v1\n")
    cand = d.tmp / "config.yaml"
    cand.write_text(MIG_PARTED.replace('"3g.40gb": 2', '"3g.20gb": 2'))
    r = d.ctl("check", "--all-layouts", str(cand), "--json")
    reply = json.loads(r.stdout)
    # an A100 40GB has 4 x 1g.10gb at most (NVIDIA MIG user guide): that layout alone is infeasible
    assert r.returncode == 4 and reply["checked"] == ["all-disabled", "all-1g.10gb", "all-3g.40gb"], reply
    assert len(reply["errors"]) == 1 and "infeasible: 7 x 1g.10gb" in reply["errors"][0], reply["errors"]
    cand.write_text(MIG_PARTED.replace('"1g.10gb": 7', '"1g.10gb": 4').replace('"3g.40gb": 2', '"3g.20gb": 2'))
    r = d.ctl("check", "--all-layouts", str(cand))
    assert r.returncode == 0, r.stdout + r.stderr
