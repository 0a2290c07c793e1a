"""The engine's rebooter with --kube-node: the node says `rebooting` before logind is asked, and
nothing is said when the reboot marker refuses a second reboot for the same cause."""

from __future__ import annotations

import json

from gpud.engine.kube.applier import KubeRebooter
from gpud.host.systemd.logind import REBOOT_MARKER, current_boot_id


class AgentRecorder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def before_reboot(self, reason):
        self.calls.append(f"before_reboot {reason}")

    def reboot_cancelled(self):
        self.calls.append("reboot_cancelled")


class ApplierFlag:
    reboot_requested = False


def _logind(answer: bool, calls: list[str]):
    async def reboot(state_dir, reason):
        calls.append(f"logind {reason}")
        return answer
    return reboot


async def test_rebooting_is_said_before_logind_is_asked(tmp_path):
    agent, applier = AgentRecorder(), ApplierFlag()
    rebooter = KubeRebooter(agent, applier, _logind(True, agent.calls))
    assert await rebooter(str(tmp_path), "GPU 0: mode pending") is True
    assert agent.calls == ["before_reboot GPU 0: mode pending", "logind GPU 0: mode pending"]
    assert applier.reboot_requested


async def test_a_refused_request_takes_the_rebooting_back(tmp_path):
    agent, applier = AgentRecorder(), ApplierFlag()
    rebooter = KubeRebooter(agent, applier, _logind(False, agent.calls))
    assert await rebooter(str(tmp_path), "r") is False
    assert agent.calls == ["before_reboot r", "logind r", "reboot_cancelled"]
    assert not applier.reboot_requested


async def test_after_a_reboot_for_the_same_cause_the_node_is_not_told_rebooting(tmp_path):
    (tmp_path / REBOOT_MARKER).write_text(json.dumps({
        "reason": "r", "boot_id": "a-boot-before-this-one", "requested_at": 1.0, "rebooted": False}))
    assert current_boot_id() != "a-boot-before-this-one"
    agent, applier = AgentRecorder(), ApplierFlag()
    rebooter = KubeRebooter(agent, applier, _logind(False, agent.calls))  # the real one refuses here
    assert await rebooter(str(tmp_path), "r") is False
    assert agent.calls == ["logind r"]
    assert not applier.reboot_requested


async def test_no_reboot_unless_the_node_was_told_rebooting(tmp_path):
    import pytest

    from gpud.engine.boot.reboot_policy import RebootRefused

    class Unreachable(AgentRecorder):
        async def before_reboot(self, reason):
            self.calls.append("before_reboot")
            raise ConnectionError("API server unreachable")

    agent, applier = Unreachable(), ApplierFlag()
    rebooter = KubeRebooter(agent, applier, _logind(True, agent.calls))
    with pytest.raises(RebootRefused, match="rebooting could not be written .*API server unreachable"):
        await rebooter(str(tmp_path), "r")
    assert agent.calls == ["before_reboot", "reboot_cancelled"]  # logind never asked
    assert not applier.reboot_requested
    assert not (tmp_path / REBOOT_MARKER).exists()


async def test_the_policy_reports_a_refused_reboot(tmp_path):
    from gpud.engine.boot.reboot_policy import RebootPolicy, RebootRefused
    from gpud.engine.events import EventBus
    from gpud.engine.gpu_state import GpuState
    from gpud.layout.schema import Policy

    async def refuses(state_dir, reason):
        raise RebootRefused("the node was not told")

    bus = EventBus()
    policy = RebootPolicy(rebooter=refuses, state_dir=str(tmp_path), read_only=False, bus=bus)
    st = await policy.settle("0000:18:00.0", GpuState("reboot-required", "MIG mode pending"), Policy(reboot="allow"))
    assert st.state == "reboot-required"
    assert st.message == "MIG mode pending; policy allows a reboot, but the node was not told"
