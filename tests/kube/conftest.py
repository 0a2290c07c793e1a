"""The Kubernetes tests' clusters: the API-emulator cluster (tests/kube/test_kube_agent.py), shared
with the operator-cluster tests that drive the agent the same way, and the real kube-apiserver (one
per session; tests that restart or compact it start their own), with a clean node on it per test."""

from __future__ import annotations

import pytest

from tests.kube.test_kube_agent import cluster  # noqa: F401 - a fixture
from tests.support.kube_cluster import NODE
from tests.support.kube_real_cluster import RealNode
from tests.support.kube_real_server import RealServer, binaries, have_openssl


def real_server_or_skip():
    _, why = binaries()
    why = why or have_openssl()
    if why:
        pytest.skip(f"no real kube-apiserver: {why}")


@pytest.fixture(scope="session")
def real_server(tmp_path_factory):
    real_server_or_skip()
    server = RealServer(tmp_path_factory.mktemp("kube-apiserver")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_real_server(tmp_path):
    """A server of the test's own (for restarts and compaction, which would disturb others);
    its watches are served by etcd itself, so a compaction reaches them."""
    real_server_or_skip()
    server = RealServer(tmp_path / "kube-apiserver", watch_cache=False).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def real_node(real_server, tmp_path):
    """A node on the session's real server, removed with its pods after the test."""
    node = RealNode(real_server, tmp_path, NODE)
    try:
        yield node
    finally:
        node.close()
