"""The textfile metrics against the engine's own vocabulary of GPU states, read back with
prometheus_client's text parser (not with the code that wrote them)."""

from __future__ import annotations

import os
from typing import get_args

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpud.api import metrics
from gpud.engine.gpu_state import GpuStateName
from gpud.wire import replies as wire_replies

PCI = "0000:18:00.0"


def _samples(path) -> dict[str, list]:
    families = text_string_to_metric_families(path.read_text())
    return {f.name: f.samples for f in families}


@pytest.mark.parametrize("state", get_args(GpuStateName))
def test_each_gpu_state_is_exported_as_the_one_set_state(state, tmp_path):
    gpu = wire_replies.GpuStatus(index=0, pci=PCI, uuid="GPU-0", model="NVIDIA H100 80GB HBM3", pci_id="10de:2330",
                                 driver="nvidia", workload="container", state=state, message="")
    status = wire_replies.StatusReply(phase="converged", layout=wire_replies.LayoutStatus(path="/etc/gpud/layout.yaml",
                                                                                          selected="all", valid=True), gpus=[gpu])
    prom = tmp_path / "gpud.prom"
    metrics.render(status, passes=1, path=str(prom))
    rows = [s for s in _samples(prom)["gpud_gpu_state"] if s.labels["pci"] == PCI]
    assert [s.labels["state"] for s in rows if s.value == 1.0] == [state]
    assert sorted(s.labels["state"] for s in rows) == sorted(get_args(GpuStateName))


def _status() -> wire_replies.StatusReply:
    gpu = wire_replies.GpuStatus(index=0, pci=PCI, uuid="GPU-0", model="NVIDIA H100 80GB HBM3", pci_id="10de:2330",
                                 driver="nvidia", workload="container", state="converged", message="")
    return wire_replies.StatusReply(phase="converged", layout=wire_replies.LayoutStatus(path="/etc/gpud/layout.yaml",
                                                                                        selected="all", valid=True), gpus=[gpu])


def test_a_link_at_prometheus_clients_temp_name_does_not_aim_roots_write(tmp_path):
    """prometheus_client's write_to_textfile writes PATH.<pid>.<thread id> through open(); a user
    who can write the textfile directory plants a link there. The root-only file stays as it was."""
    import threading

    secret = tmp_path / "shadow"
    secret.write_bytes(b"root:hash:1::::::\n")
    secret.chmod(0o600)
    d = tmp_path / "textfiles"
    d.mkdir()
    prom = d / "gpud.prom"
    (d / f"gpud.prom.{os.getpid()}.{threading.current_thread().ident}").symlink_to(secret)
    metrics.render(_status(), passes=1, path=str(prom))
    assert secret.read_bytes() == b"root:hash:1::::::\n"
    assert "gpud_gpu_state" in _samples(prom)


def test_a_textfile_directory_others_may_write_is_refused(tmp_path):
    d = tmp_path / "textfiles"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(OSError, match="not sticky"):
        metrics.render(_status(), passes=1, path=str(d / "gpud.prom"))
    assert os.listdir(d) == []
