"""The layout file as a ConfigMap volume (the GPU Operator mounts mig-manager's ConfigMap; the
kubelet writes it as tests/support/configmap_volume.py does, after atomic_writer.go): an edit of
the ConfigMap only moves the volume's `..data` link, the key's own entry never changes. gpud must
follow it as it follows an editor's rename; deleted (an optional ConfigMap: the key goes), the last
good layout stays in force and status says the file is gone; projected again, it is taken."""

from __future__ import annotations

import pytest

from tests.scenarios.definitions import layout, mig
from tests.support.configmap_volume import ConfigMapVolume
from tests.support.daemon import wait_until

pytestmark = pytest.mark.daemon

EMPTY = "version: v1\nlayouts:\n  hands-off: []\n"


def test_a_configmap_edit_is_followed_through_the_data_link(daemon, tmp_path):
    volume = ConfigMapVolume(tmp_path / "cm")
    volume.write({"config.yaml": EMPTY})
    d = daemon(["h100-80gb:2"], EMPTY, "--config", str(volume.path("config.yaml")))

    def selected() -> str | None:
        return d.status()["layout"]["selected"]

    wait_until(lambda: selected() == "hands-off", what="the projected layout")
    volume.write({"config.yaml": layout(mig([0], {"3g.40gb": 2}), name="edited")})
    wait_until(lambda: selected() == "edited", 60, "the ConfigMap's edit")
    volume.write({})  # deleted (optional): the key is gone
    st = wait_until(lambda: (s := d.status())["layout"]["errors"] and s, 60, "the missing file reported")
    assert "not found" in st["layout"]["errors"][0] and st["layout"]["selected"] == "edited"
    volume.write({"config.yaml": layout(mig([1], {"7g.80gb": 1}), name="again")})
    wait_until(lambda: selected() == "again" and d.status()["layout"]["valid"], 60, "projected again")
    assert d.ctl("apply", "--wait", "--timeout", "120").returncode == 0
    gpu1 = d.sim_state()["gpus"]["0000:2a:00.0"]
    assert gpu1["mig_mode"] == 1 and [gi["profile_id"] for gi in gpu1["gis"]] == [0]  # 7g.80gb: GI profile 0
