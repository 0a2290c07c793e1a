"""MIG on demand through the real daemon and gpudctl, on a simulated host: exit codes, the JSON a
Slurm prolog reads, and every outcome checked in the simulator's own state file."""

from __future__ import annotations

import grp
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import gpud
from tests.leases.rig import dynamic_layout
from tests.support.daemon import Daemon, wait_until

pytestmark = pytest.mark.daemon


def gis(d) -> list[tuple[int, int, list[str]]]:
    """(start, size, CI UUIDs) of every GI in the simulator's state file, first GPU."""
    g = d.sim_state()["gpus"][sorted(d.sim_state()["gpus"])[0]]
    return sorted((gi["start"], gi["size"], [c["uuid"] for c in gi["cis"]]) for gi in g["gis"])


def test_lease_release_and_no_room_through_gpudctl(daemon):
    d = daemon(["h100-80gb:1"], dynamic_layout())
    r = d.ctl("lease", "3g.40gb", "--owner", "slurm-17", "--json")
    assert r.returncode == 0, r.stderr
    lease = json.loads(r.stdout)
    assert lease["profile"] == "3g.40gb" and lease["placement"] == "4:4" and lease["uuid"].startswith("MIG-")
    assert lease["devices"][0].startswith("/dev/nvidia") and lease["owner"] == "slurm-17"
    assert gis(d) == [(4, 4, [lease["uuid"]])]

    assert d.ctl("lease", "3g.40gb").returncode == 0
    before, calls = gis(d), d.mutating_calls()
    r = d.ctl("lease", "1g.10gb")
    assert r.returncode == 4 and "no dynamic GPU has room for 1g.10gb" in r.stderr and "free memory slices" in r.stderr
    assert gis(d) == before and d.mutating_calls() == calls  # nothing changed

    listed = json.loads(d.ctl("leases", "--json").stdout)["leases"]
    assert {x["id"] for x in listed} >= {lease["id"]} and len(listed) == 2
    gpu = d.status()["gpus"][0]
    assert gpu["dynamic"] and {x["id"] for x in gpu["leases"]} == {x["id"] for x in listed}
    assert "slurm-17" in d.ctl("status").stdout

    r = d.ctl("release", lease["id"])
    assert r.returncode == 0, r.stderr
    assert [g[:2] for g in gis(d)] == [(0, 4)]
    calls = d.mutating_calls()
    r = d.ctl("release", "l-nosuchlease")
    assert r.returncode == 4 and "no lease" in r.stderr and d.mutating_calls() == calls
    kinds = [e["kind"] for e in d.events()]
    assert kinds.count("lease") == 2 and kinds.count("release") == 1


def test_leases_survive_kill_9_of_the_daemon(daemon):
    d = daemon(["h100-80gb:1"], dynamic_layout())
    lease = json.loads(d.ctl("lease", "2g.20gb", "--json").stdout)
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    calls = d.mutating_calls()
    d.start()
    assert [x["id"] for x in json.loads(d.ctl("leases", "--json").stdout)["leases"]] == [lease["id"]]
    assert gis(d) == [(0, 2, [lease["uuid"]])] and d.mutating_calls() == calls
    assert d.ctl("release", lease["id"]).returncode == 0 and gis(d) == []


def test_whole_gpu_lease_needs_a_gpu_and_excludes_mig(daemon):
    d = daemon(["h100-80gb:1"], dynamic_layout())
    assert d.ctl("lease", "gpu").returncode != 0
    whole = json.loads(d.ctl("lease", "gpu", "--gpu", "0", "--json").stdout)
    assert whole["profile"] == "gpu" and whole["uuid"].startswith("GPU-")
    r = d.ctl("lease", "1g.10gb")
    assert r.returncode == 4 and "leased whole" in r.stderr and gis(d) == []


def test_metrics_count_leases_and_free_capacity(daemon, tmp_path):
    prom = tmp_path / "gpud.prom"
    d = daemon(["h100-80gb:1"], dynamic_layout(), "--metrics-textfile", str(prom))
    assert d.ctl("lease", "3g.40gb").returncode == 0
    pci = sorted(d.sim_state()["gpus"])[0]
    text = wait_until(lambda: prom.exists() and "gpud_leases{" in prom.read_text() and prom.read_text(),
                      what="metrics with the lease")
    assert f'gpud_leases{{pci="{pci}",profile="3g.40gb"}} 1.0' in text
    assert f'gpud_lease_free{{pci="{pci}",profile="3g.40gb"}} 1.0' in text
    assert f'gpud_lease_free{{pci="{pci}",profile="4g.40gb"}} 1.0' in text  # 3g at 4:4 leaves 4g at 0 free
    assert f'gpud_lease_free{{pci="{pci}",profile="7g.80gb"}} 0.0' in text


def test_nfd_labels_follow_leases(daemon, tmp_path):
    features = tmp_path / "features.d"
    features.mkdir()
    d = daemon(["h100-80gb:1"], dynamic_layout(), "--nfd-features", str(features / "gpud"))
    read = lambda: (features / "gpud").read_text() if (features / "gpud").exists() else ""  # noqa: E731
    lease = json.loads(d.ctl("lease", "3g.40gb", "--json").stdout)
    wait_until(lambda: "nvidia.com/mig-3g.40gb.count=1" in read(), what="the lease's MIG device labelled")
    # the device plugin's view: one resource per MIG device on the simulator's state file
    advertised = lambda: d.status()["kubernetes"]["advertised"]["resources"]  # noqa: E731
    assert gis(d) == [(4, 4, [lease["uuid"]])]
    wait_until(lambda: advertised().get("nvidia.com/mig-3g.40gb") == 1, what="the MIG device advertised")
    assert d.ctl("release", lease["id"]).returncode == 0
    wait_until(lambda: "nvidia.com/mig-3g.40gb.count" not in read(), what="the label gone with the release")
    assert gis(d) == [] and "nvidia.com/mig-3g.40gb" not in advertised()


def test_check_and_plan_explain_a_dynamic_gpu_and_refuse_a_static_one_over_leases(daemon, tmp_path):
    d = daemon(["h100-80gb:1"], dynamic_layout())
    lease = json.loads(d.ctl("lease", "3g.40gb", "--owner", "slurm-3", "--json").stdout)
    before, calls = gis(d), d.mutating_calls()
    chk = d.ctl("check", str(d.config))
    assert chk.returncode == 0, chk.stdout + chk.stderr
    assert "note: GPU 0" in chk.stdout and "MIG on demand (mig-devices: dynamic)" in chk.stdout
    plan = d.ctl("plan")
    assert plan.returncode == 0 and "nothing to do" in plan.stdout and "MIG on demand" in plan.stdout
    static = tmp_path / "static.yaml"
    static.write_text("version: v1\nlayouts:\n  s:\n    - devices: all\n      mig-enabled: true\n"
                      "      mig-devices: {\"1g.10gb\": 7}\n")
    refused = d.ctl("check", str(static))
    assert refused.returncode == 4 and lease["id"] in refused.stdout and "slurm-3" in refused.stdout
    assert gis(d) == before == [(4, 4, [lease["uuid"]])] and d.mutating_calls() == calls  # nothing changed


# A real non-root client: started as root (to import from root's Python), it drops to uid/gid
# 65534 (nobody/nogroup) and the given supplementary groups, then sends one `lease`.
AS_NOBODY = textwrap.dedent("""
    import json, os, socket, sys
    from gpud.wire import protocol as wire
    path, groups = sys.argv[1], json.loads(sys.argv[2])
    os.setgroups(groups); os.setgid(65534); os.setuid(65534)
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.sendall(wire.encode_frame(wire.Request(id=1, op="lease", args={"profile": "2g.20gb", "owner": "nobody"})))
    r = wire.decode_message(wire.FrameReader().read_sync(s))
    print(json.dumps("ok" if r.ok else r.error.code))
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to change uid")
def test_only_the_lease_group_may_lease_and_a_refusal_changes_nothing(tmp_path):
    """Socket group nogroup (read-only, as `gpud`), `policy.lease-group: daemon`: nobody without
    `daemon` is refused and the simulator's state file is unchanged; with it, the lease is made."""
    shared = Path(tempfile.mkdtemp(prefix="gpud-lease-sock-"))
    os.chmod(shared, 0o755)  # the socket itself is 0660 root:nogroup

    class OnSharedSocket(Daemon):
        def start(self, mode: str = "a", notify_socket: str | None = None) -> None:
            self.socket = shared / "gpud.sock"
            super().start(mode, notify_socket)

    d = OnSharedSocket(tmp_path, ["h100-80gb:1"], dynamic_layout(**{"lease-group": "daemon"}),
                       ["--socket-group", grp.getgrgid(65534).gr_name])
    try:
        def as_nobody(groups: list[int]) -> str:
            done = subprocess.run([sys.executable, "-c", AS_NOBODY, str(d.socket), json.dumps(groups)],
                                  capture_output=True, text=True, timeout=60, cwd=os.path.dirname(gpud.__file__) + "/..")
            assert done.returncode == 0, done.stderr
            return json.loads(done.stdout)

        calls = d.mutating_calls()
        assert as_nobody([]) == "forbidden"
        assert gis(d) == [] and d.mutating_calls() == calls  # refused: nothing changed
        assert as_nobody([1]) == "ok"  # a member of policy.lease-group
        leases = json.loads(d.ctl("leases", "--json").stdout)["leases"]
        assert [(x["owner"], x["uid"]) for x in leases] == [("nobody", 65534)]
        assert gis(d) == [(0, 2, [leases[0]["uuid"]])]
    finally:
        d.stop()
        shutil.rmtree(shared, ignore_errors=True)
