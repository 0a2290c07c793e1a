"""A real gpud starts its status replica (gpud/api/status_replica.py) beside its socket, as a child
running ahead of it in the CPU scheduler; `gpudctl status` right after `gpudctl apply --wait`
shows what the simulator's state file holds; the replica and its socket go with the daemon; and
`--no-status-replica` leaves the daemon answering alone."""

from __future__ import annotations

import os

import msgpack
import pytest

from gpud.wire.frames import status_socket
from tests.scenarios.definitions import layout, mig
from tests.support.api import exchange
from tests.support.daemon import wait_until
from tests.support.proc_children import children

pytestmark = pytest.mark.daemon


def replica_pids(daemon_pid: int) -> list[int]:
    return children(daemon_pid, "gpud.api.status_replica")


def mig_uuids(sim_state: dict) -> dict[str, list[str]]:
    """PCI address -> the MIG devices' UUIDs, from the simulator's own state file."""
    return {pci: sorted(ci["uuid"] for gi in g.get("gis", []) for ci in gi.get("cis", []))
            for pci, g in sim_state["gpus"].items()}


def test_status_after_an_apply_is_the_replicas_and_shows_the_hardware(daemon):
    d = daemon(["h100-80gb:2"], layout(mig([0], {"7g.80gb": 1})))
    path = status_socket(str(d.socket))
    wait_until(lambda: os.path.exists(path) and replica_pids(d.proc.pid), what="the status replica")
    (pid,) = replica_pids(d.proc.pid)
    ours, daemons = os.stat(path), os.stat(d.socket)
    assert (ours.st_mode, ours.st_uid, ours.st_gid) == (daemons.st_mode, daemons.st_uid, daemons.st_gid)
    assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, d.proc.pid) - 5
    d.config.write_text(layout(mig([0], {"1g.10gb": 7}), mig([1], {"3g.40gb": 2})))
    assert d.ctl("apply", "--wait", "--timeout", "120", timeout=180).returncode == 0
    # at once, from the replica itself and through gpudctl (which asks it first)
    raw = msgpack.unpackb(exchange(path, {"id": 1, "op": "status", "args": {}})[4:])
    assert raw["ok"], raw
    held = mig_uuids(d.sim_state())
    assert [len(v) for _, v in sorted(held.items())] == [7, 2]
    for gpus in (raw["result"]["gpus"], d.status()["gpus"]):
        for g in gpus:
            assert sorted(i["uuid"] for i in g["mig"]["instances"] if i["uuid"]) == held[g["pci"]], g["index"]
    assert replica_pids(d.proc.pid) == [pid]
    d.stop()
    assert not os.path.exists(path)
    wait_until(lambda: not os.path.exists(f"/proc/{pid}"), what="the replica to end with gpud")


def test_without_the_replica_the_daemon_answers_status(daemon):
    d = daemon(["h100-80gb:1"], layout(mig([0], {"7g.80gb": 1})), "--no-status-replica")
    assert d.status()["phase"] in ("converged", "applying", "starting")
    assert not os.path.exists(status_socket(str(d.socket))) and not replica_pids(d.proc.pid)
