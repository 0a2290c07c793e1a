"""The simulated host's NVIDIA device nodes are character nodes on majors no driver of this machine
holds (docs/hardware/dev-nodes.md: a node with a real driver's major reaches the real device),
and the simulated /proc/devices agrees with them. The oracle for "held" is this machine's own
/proc/devices, read here independently of gpud.sim.dev_nodes."""

from __future__ import annotations

import os
import stat

import pytest

from gpud.sim import dev_nodes
from gpud.sim.cli import create
from gpud.sim.state import locked
from gpud.sim.sysfs_tree import render

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root (without it the nodes are plain files)")


def _read(path) -> str:
    with open(path) as f:
        return f.read()


def _real_char_majors() -> set[int]:
    text = _read("/proc/devices").split("Block devices")[0]
    return {int(line.split()[0]) for line in text.splitlines()[1:] if line.strip()}


def _nodes(host) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, _, files in os.walk(host / "dev"):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            if name.startswith("nvidia"):
                assert stat.S_ISCHR(st.st_mode), f"{name}: not a character node"
                out[os.path.relpath(os.path.join(dirpath, name), host)] = (os.major(st.st_rdev), os.minor(st.st_rdev))
    return out


def _sim_proc_devices(host) -> dict[str, int]:
    text = (host / "proc/devices").read_text().split("Block devices")[0]
    return {line.split()[1]: int(line.split()[0]) for line in text.splitlines()[1:] if line.strip()}


def test_nodes_are_char_devices_on_free_majors_and_proc_devices_agrees(tmp_path):
    host = tmp_path / "host"
    create(host, ["h100-80gb:2"], [0])
    nodes = _nodes(host)
    assert nodes["dev/nvidia1"][1] == 1 and nodes["dev/nvidiactl"][1] == 255
    assert nodes["dev/nvidia-caps/nvidia-cap1"][1] == 1
    majors = {m for m, _ in nodes.values()}
    assert not majors & _real_char_majors() and 195 not in majors
    sim = _sim_proc_devices(host)
    assert nodes["dev/nvidia0"][0] == sim["nvidia"] and nodes["dev/nvidia-caps/nvidia-cap2"][0] == sim["nvidia-caps"]
    assert {m for n, m in sim.items() if n not in ("nvidia", "nvidia-caps")} == _real_char_majors()


def test_a_major_a_driver_takes_later_moves_the_nodes(tmp_path, monkeypatch):
    host = tmp_path / "host"
    create(host, ["h100-80gb:1"], [])
    before = _nodes(host)["dev/nvidia0"][0]
    fake = tmp_path / "devices"
    fake.write_text(_read("/proc/devices").replace("Character devices:\n",
                                                         f"Character devices:\n{before} somedriver\n"))
    monkeypatch.setattr(dev_nodes, "REAL_PROC_DEVICES", str(fake))
    with locked(host) as st:
        render(host, st)
    after = _nodes(host)
    assert before not in {m for m, _ in after.values()}
    assert _sim_proc_devices(host)["nvidia"] == after["dev/nvidia0"][0]


def test_no_free_local_major_is_refused():
    with pytest.raises(dev_nodes.DevNodeError, match="refusing"):
        dev_nodes.majors(set(dev_nodes.LOCAL_MAJORS) - {120})
    assert dev_nodes.majors({120, 121}) == {"nvidia": 122, "nvidia-caps": 123}
    with pytest.raises(dev_nodes.DevNodeError, match="would reach a real driver"):
        dev_nodes.check_safe({122}, {122})


def test_the_simulated_lines_are_not_taken_for_a_drivers(tmp_path):
    """Under `gpud-sim exec` /proc/devices is the simulated file: its own lines must not push the
    nodes to other majors (a re-render inside the namespace would otherwise move them)."""
    host = tmp_path / "host"
    create(host, ["h100-80gb:1"], [])
    sim = host / "proc/devices"
    assert dev_nodes.registered_char_majors(str(sim)) == _real_char_majors()


def test_where_a_device_cgroup_refuses_nodes_they_are_plain_files(tmp_path, monkeypatch):
    """systemd-nspawn's device cgroup refuses mknod of devices it does not list (EPERM)."""
    def refused(*_a, **_k):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(dev_nodes, "_mknod_works", {})
    monkeypatch.setattr(os, "mknod", refused)
    host = tmp_path / "host"
    create(host, ["h100-80gb:1"], [])
    assert stat.S_ISREG(os.lstat(host / "dev/nvidia0").st_mode)
    assert not (host / "proc/devices").exists()
