"""Item: gpud's node labels do not outlive it. The feature file goes when gpud stops and when the
package is removed (GFD deletes its own file on exit; nfd-worker drops a vanished file's labels).

Oracle: the file system, and the file read the way nfd-worker reads it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from gpud.host.kube import nfd
from tests.support.daemon import Daemon, wait_until
from tests.support.nfd import nfd_read

pytestmark = pytest.mark.daemon

REPO = Path(__file__).resolve().parents[2]
LAYOUT = "version: v1\nlayouts:\n  whole:\n    - devices: all\n      mig-enabled: false\n"


def test_stop_removes_the_feature_file(tmp_path):
    features = tmp_path / "features.d"
    features.mkdir()
    (features / "gfd").write_text("nvidia.com/gfd.timestamp=1\n")  # another writer's file stays
    d = Daemon(tmp_path / "d", ["h100-80gb:2"], LAYOUT, ["--nfd-features", str(features / "gpud")])
    try:
        wait_until(lambda: nfd_read(str(features)).get("nvidia.com/gpud.layout") == "whole", timeout=120,
                   what="labels written")
    finally:
        d.stop()
    assert d.proc.returncode == 0, d.log.read_text()
    assert sorted(os.listdir(features)) == ["gfd"]
    assert "nvidia.com/gpud.layout" not in nfd_read(str(features))


def test_remove_leaves_what_is_not_a_regular_file(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("x=1\n")
    (tmp_path / "gpud").symlink_to(target)
    assert nfd.remove_features(str(tmp_path / "gpud")) is False
    assert target.read_text() == "x=1\n" and (tmp_path / "gpud").is_symlink()
    assert nfd.remove_features(str(tmp_path / "absent")) is False


def test_package_removal_removes_the_feature_file(tmp_path):
    root = tmp_path / "root"
    features = root / "etc/kubernetes/node-feature-discovery/features.d"
    features.mkdir(parents=True)
    (features / "gpud").write_text("nvidia.com/gpud.layout=whole\n")
    (features / "gfd").write_text("nvidia.com/gpu.count=2\n")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "systemctl").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/systemctl.log\n")  # never the host's
    (fake / "systemctl").chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "DPKG_ROOT": str(root)}
    r = subprocess.run(["sh", str(REPO / "packaging/debian/postrm"), "remove"], env=env, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(features)) == ["gfd"]
    r = subprocess.run(["sh", str(REPO / "packaging/debian/postrm"), "remove"], env=env, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr  # again, with the file gone: still fine
