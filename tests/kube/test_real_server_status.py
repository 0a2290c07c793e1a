"""The real-server tests skip only with the reason scripts/install-kube-apiserver recorded."""

from __future__ import annotations

import json

from tests.support import kube_real_server as real_server
from tests.support.present import present


def test_a_failed_build_is_the_skip_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUD_ANCHORS", str(tmp_path))
    d = tmp_path / "kube" / real_server.KUBE_VERSION
    d.mkdir(parents=True)
    why = "building etcd v3.6.4 failed: go: go.etcd.io/etcd/server/v3@v3.6.4: 403 Forbidden"
    (d / "status.json").write_text(json.dumps({
        "kube-apiserver": {"binary": "/bin/true", "version": "v1.34.12"},
        "etcd": {"unavailable": why, "version": "v3.6.4"}}))
    assert real_server.binaries() == ({}, f"etcd: {why}")


def test_no_status_file_names_the_script(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUD_ANCHORS", str(tmp_path))
    bins, why = real_server.binaries()
    assert bins == {} and "scripts/install-kube-apiserver has not run" in present(why)


def test_a_recorded_binary_that_is_gone_is_not_taken(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUD_ANCHORS", str(tmp_path))
    d = tmp_path / "kube" / real_server.KUBE_VERSION
    d.mkdir(parents=True)
    (d / "status.json").write_text(json.dumps({
        "kube-apiserver": {"binary": str(d / "bin" / "kube-apiserver")}, "etcd": {"binary": "/bin/true"}}))
    bins, why = real_server.binaries()
    assert bins == {} and present(why).startswith("kube-apiserver: not built")
