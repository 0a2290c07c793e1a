"""`status` answers from the daemon's observation in memory: what gpud does or hears of is in it
without `--fresh`, a change nothing announces is not (until `--fresh`, or the bounded re-read while
clients ask), and every answer says how old it is.

The daemons here run with `--status-max-age 3600` unless the test is about the bounded re-read:
nothing but the event-driven updates under test can then refresh what status shows, so each test
fails if its update path is missing. Expected states come from the simulator's own state file
(DIR/state.json), never from gpud's reading of it.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.scenarios.definitions import layout, mig
from tests.support.daemon import wait_until

pytestmark = pytest.mark.daemon

NO_BACKGROUND_READ = ("--status-max-age", "3600")


def _sim_instances(d) -> dict[str, list[str]]:
    """PCI -> MIG device UUIDs, as the simulator itself holds them."""
    state = json.loads((d.host / "state.json").read_text())
    return {pci: sorted(ci["uuid"] for gi in g["gis"] for ci in gi["cis"]) for pci, g in state["gpus"].items()}


def _status_instances(st: dict) -> dict[str, list[str]]:
    return {g["pci"]: sorted(i["uuid"] for i in g["mig"]["instances"] if i["uuid"]) for g in st["gpus"]}


def _fresh(d) -> dict:
    r = d.ctl("status", "--fresh", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _holder_pids(st: dict) -> set[int]:
    return {h["pid"] for g in st["gpus"] for i in g["mig"]["instances"] for h in i["holders"]}


def test_status_after_an_apply_shows_what_was_applied_without_fresh(daemon):
    d = daemon(["h100-80gb:2"], layout(mig([0, 1], None)), *NO_BACKGROUND_READ)
    assert d.ctl("apply", "--wait").returncode == 0
    d.config.write_text(layout(mig([0], {"3g.40gb": 2}), mig([1], {"1g.10gb": 3})))
    wait_until(lambda: d.status()["layout"]["selected"] == "test", what="the edited layout loaded")
    assert d.ctl("apply", "--wait").returncode == 0
    st = d.status()
    expected = _sim_instances(d)
    assert [len(v) for v in expected.values()] == [2, 3]
    assert _status_instances(st) == expected
    assert st["observed_at"] > 0 and st["observation_age"] >= 0


def test_udev_event_reaches_status_without_fresh(daemon):
    d = daemon(["h100-80gb:2"], layout(mig([0, 1], None)), *NO_BACKGROUND_READ)
    assert d.ctl("apply", "--wait").returncode == 0
    pci = d.status()["gpus"][1]["pci"]
    assert d.sim("unplug", pci).returncode == 0
    def state_of(st: dict) -> str | None:
        return next((g["state"] for g in st["gpus"] if g["pci"] == pci), None)

    # a removed GPU keeps its row (and its index), marked `gone`
    wait_until(lambda: state_of(d.status()) == "gone", what="the unplugged GPU shown gone in status")
    assert d.sim("plug", pci).returncode == 0
    wait_until(lambda: state_of(d.status()) not in (None, "gone"), what="the plugged GPU back in status")


def test_holder_exit_reaches_status_without_fresh(daemon):
    d = daemon(["h100-80gb:1"], layout(mig([0], {"3g.40gb": 2})), *NO_BACKGROUND_READ)
    assert d.ctl("apply", "--wait").returncode == 0
    uuid = d.status()["gpus"][0]["mig"]["instances"][0]["uuid"]
    holder = subprocess.Popen(["sleep", "600"])
    try:
        assert d.sim("hold", uuid, "--pid", str(holder.pid), "--name", "train.py").returncode == 0
        d.config.write_text(layout(mig([0], {"7g.80gb": 1})))
        wait_until(lambda: d.status()["gpus"][0]["state"] == "waiting", what="waiting for the holder")
        assert d.status()["gpus"][0]["holders"][0]["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()
    # no device event: gpud's pidfd on the holder wakes the pass, which re-reads the host
    wait_until(lambda: d.status()["gpus"][0]["state"] == "converged", what="converged after the exit")
    assert _status_instances(d.status()) == _sim_instances(d)
    assert [i["profile"] for i in d.status()["gpus"][0]["mig"]["instances"]] == ["7g.80gb"]


def test_fresh_reads_what_no_event_announced_and_plain_status_answers_from_memory(daemon):
    d = daemon(["h100-80gb:1"], layout(mig([0], {"3g.40gb": 2})), *NO_BACKGROUND_READ)
    assert d.ctl("apply", "--wait").returncode == 0
    uuid = d.status()["gpus"][0]["mig"]["instances"][0]["uuid"]
    holder = subprocess.Popen(["sleep", "600"])
    try:
        assert d.sim("hold", uuid, "--pid", str(holder.pid)).returncode == 0  # announced: a change event
        wait_until(lambda: holder.pid in _holder_pids(d.status()), what="the holder in status")
        assert d.ctl("apply", "--wait").returncode == 0  # every pass that event started is over
        assert holder.pid in _holder_pids(d.status())
    finally:
        holder.kill()
        holder.wait()
    # The process is gone and NVML no longer lists it, but nothing announces that: status keeps
    # answering from the observation it has, and says how old it is.
    before = d.status()
    assert holder.pid in _holder_pids(before)
    again = d.status()
    assert again["observed_at"] == before["observed_at"]
    assert again["observation_age"] >= before["observation_age"]
    fresh = _fresh(d)
    assert fresh["observed_at"] > before["observed_at"]
    assert holder.pid not in _holder_pids(fresh)
    assert _status_instances(fresh) == _sim_instances(d)
    # what --fresh read is what everyone is answered from now
    assert d.status()["observed_at"] == fresh["observed_at"] and holder.pid not in _holder_pids(d.status())


def test_status_is_re_read_at_a_bounded_rate_while_clients_ask(daemon):
    d = daemon(["h100-80gb:1"], layout(mig([0], {"3g.40gb": 2})), "--status-max-age", "0.2")
    assert d.ctl("apply", "--wait").returncode == 0
    uuid = d.status()["gpus"][0]["mig"]["instances"][0]["uuid"]
    holder = subprocess.Popen(["sleep", "600"])
    try:
        assert d.sim("hold", uuid, "--pid", str(holder.pid)).returncode == 0
        wait_until(lambda: holder.pid in _holder_pids(d.status()), what="the holder in status")
    finally:
        holder.kill()
        holder.wait()
    # nothing announces the exit; asking is enough once the observation is older than 0.2 s
    wait_until(lambda: holder.pid not in _holder_pids(d.status()), what="the exit seen without --fresh")
