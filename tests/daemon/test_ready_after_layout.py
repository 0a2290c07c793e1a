"""Issue 29 item 13: gpud.service is ordered Before=kubelet.service, and READY=1 (what lets units
ordered after gpud start) comes only once the first pass put the layout in place: after a reboot
(`gpud-sim reboot`: Hopper loses its MIG mode and instances) the MIG instances exist, by the
simulator's own state file, when the READY datagram arrives."""

from __future__ import annotations

import pytest

from tests.scenarios.definitions import layout, mig
from tests.support.daemon import start_until_ready

pytestmark = pytest.mark.daemon

GPU0 = "0000:18:00.0"


def test_ready_waits_for_the_mig_layout_a_reboot_took(daemon):
    d = daemon(["h100-80gb:2"], layout(mig([0], {"1g.10gb": 4, "3g.40gb": 1})))
    assert d.ctl("apply", "--wait", "--timeout", "60").returncode == 0
    assert d.stop() == 0
    assert d.sim("reboot").returncode == 0
    assert d.sim_state()["gpus"][GPU0]["gis"] == []  # Hopper: gone with the reboot
    messages = start_until_ready(d)
    assert len(d.sim_state()["gpus"][GPU0]["gis"]) == 5, messages
    assert any("STATUS=converging 1 GPU(s) before ready" in m for m in messages), messages


def test_a_restart_with_nothing_to_do_is_ready_at_once(daemon):
    d = daemon(["h100-80gb"], layout(mig([0], {"1g.10gb": 7})))
    assert d.ctl("apply", "--wait", "--timeout", "60").returncode == 0
    assert d.stop() == 0
    messages = start_until_ready(d)
    assert not any("before ready" in m for m in messages), messages
