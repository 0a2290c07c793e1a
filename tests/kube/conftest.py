"""The kube agent tests' API-emulator cluster (tests/kube/test_kube_agent.py), shared with the
operator-cluster tests that drive the agent the same way."""

from tests.kube.test_kube_agent import cluster  # noqa: F401 - a fixture
