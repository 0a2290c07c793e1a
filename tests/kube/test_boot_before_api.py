"""Item: after a reboot the layout the node's label selected is rebuilt before the API server
answers (gpud keeps the label's choice in its state dir).

Oracle: the simulator's own state file (what the hardware holds), with the API server gone.
"""

from __future__ import annotations

import pytest

from tests.support.daemon import Daemon, wait_until
from tests.support.kube_cluster import NODE, EmulatorThread, write_kubeconfig
from tests.support.present import present

pytestmark = pytest.mark.daemon

CONFIG, STATE = "nvidia.com/mig.config", "nvidia.com/mig.config.state"
GPU0 = "0000:18:00.0"
LAYOUT = """version: v1
layouts:
  whole:
    - devices: all
      mig-enabled: false
  partial-mig:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"1g.10gb": 4, "3g.40gb": 1}
    - devices: [1]
      mig-enabled: false
"""


def _gis(d: Daemon) -> list[int]:
    return sorted(gi["profile_id"] for gi in d.sim_state()["gpus"][GPU0]["gis"])


def test_the_labels_layout_is_rebuilt_after_a_reboot_with_the_api_server_down(tmp_path):
    emu = EmulatorThread()
    emu.call(emu.api.put_object("nodes", {"metadata": {"name": NODE, "labels": {CONFIG: "partial-mig"}}}))
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", emu.url)
    d = Daemon(tmp_path / "d", ["h100-80gb:2"], LAYOUT, ["--kube-node", NODE, "--kubeconfig", kubeconfig,
                                                         "--nfd-features", str(tmp_path / "none" / "gpud")])
    try:
        wait_until(lambda: emu.read(lambda: present(emu.api.get("nodes", NODE))["metadata"]["labels"]).get(STATE) == "success",
                   timeout=120, what="partial-mig applied")
        assert _gis(d) == [9, 19, 19, 19, 19]
    finally:
        d.stop()
        emu.close()  # the API server is gone from here on
    assert d.sim("reboot").returncode == 0
    assert _gis(d) == [] and d.sim_state()["gpus"][GPU0]["mig_mode"] == 0  # Hopper: all gone at a reboot
    d.start()
    try:
        wait_until(lambda: _gis(d) == [9, 19, 19, 19, 19] and d.status()["phase"] == "converged", timeout=120,
                   what="the label's layout rebuilt without the API server")
        status = d.status()
        assert status["layout"]["selected"] == "partial-mig"
        assert status["kubernetes"]["agent"]["connected"] is False
        assert any("before this start" in e["message"] for e in d.events())
    finally:
        d.stop()
    assert d.proc.returncode == 0, d.log.read_text()
