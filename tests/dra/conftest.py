from __future__ import annotations

import pytest

from tests.dra.cluster import DraCluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """One real kube-apiserver + kube-scheduler for every DRA test (each test uses nodes of its own)."""
    c = DraCluster(tmp_path_factory.mktemp("dra-cluster")).start()
    yield c
    c.stop()
