"""Fixtures for the real-systemd tests: one booted container per session (with a writable /usr
and a copy of the host's dpkg database, so the .deb can be installed), and the .deb itself."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.present import present
from tests.systemd.nspawn import REPO, Container, missing_prerequisites, python_binds


@pytest.fixture(scope="session")
def nspawn_ok():
    why = missing_prerequisites()
    if why:
        pytest.skip(f"nspawn tests: {why}")


@pytest.fixture(scope="session")
def deb_path(nspawn_ok, tmp_path_factory) -> Path:
    """The package built from this tree by packaging/build-deb.sh (needs PyPI at build time)."""
    if shutil.which("dpkg-deb") is None:
        pytest.skip("dpkg-deb not installed")
    out = tmp_path_factory.mktemp("deb")
    r = subprocess.run([str(REPO / "packaging" / "build-deb.sh")], env=dict(os.environ, OUT=str(out)),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"build-deb.sh failed:\n{r.stdout}\n{r.stderr}"
    debs = list(out.glob("gpud_*.deb"))
    assert len(debs) == 1, debs
    return debs[0]


@pytest.fixture(scope="session")
def container(nspawn_ok, tmp_path_factory):
    """A booted systemd. /usr is the host's under a tmpfs overlay (dpkg may write to it, nothing
    reaches the host), /var/lib/dpkg a throw-away copy of the host's database."""
    work = tmp_path_factory.mktemp("nspawn")
    dpkg = work / "dpkg"
    shutil.copytree("/var/lib/dpkg", dpkg, symlinks=True)
    (dpkg / "statoverride").write_text("")  # its groups do not exist in the fresh /etc
    (work / "share").mkdir()
    c = Container(binds_ro=python_binds(), binds=[f"{dpkg}:/var/lib/dpkg", f"{work / 'share'}:/share"],
                  overlay_usr=True)
    c.start()
    c.share = work / "share"  # host side of /share in the container
    yield c
    c.stop()
    shutil.rmtree(c.workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def installed(container, deb_path):
    """gpud installed in the container from the .deb, as on a fresh Debian 12."""
    dest = present(container.share) / deb_path.name
    shutil.copy(deb_path, dest)
    r = container.run(["dpkg", "-i", f"/share/{deb_path.name}"], check=False, timeout=300)
    assert r.returncode == 0, f"dpkg -i failed:\n{r.stdout}\n{r.stderr}"
    return container
