"""The kube agent against a real kube-apiserver (tests/support/kube_real_cluster.RealNode): an
engine stand-in that reads the node from the server, the node seeded as the operator leaves it,
and the agent built and run as the emulator tests do (tests/support/kube_agent), its API client
closed after each run."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from gpud.engine.kube.agent import Impact, KubeAgent
from gpud.host.kube.node_api import KubeApi
from tests.support import kube_agent
from tests.support.kube_agent import VALIDATORS, EngineStandIn
from tests.support.kube_cluster import NODE, OPERATOR_NS, PAUSE_IMAGE
from tests.support.kube_real_cluster import RealNode


class RealEngine(EngineStandIn):
    def __init__(self, node: RealNode, impacts: dict[str, Impact], **kw: Any) -> None:
        super().__init__(None, impacts, **kw)  # the node is read through `node`, not an emulator
        self.node = node

    def snapshot(self) -> tuple[list[str], dict[str, str]]:
        return self.node.pods(), self.node.labels()


def seed(node: RealNode, labels: dict[str, str]) -> None:
    """The node with `labels` and the operator's validator pods on it."""
    node.put_node(labels)
    for app in VALIDATORS:
        node.put_pod({"metadata": {"name": f"{app}-x1", "namespace": OPERATOR_NS, "labels": {"app": app}},
                      "spec": {"nodeName": NODE, "containers": [{"name": "v", "image": PAUSE_IMAGE}]}})


def agent(kubeconfig: str, engine: EngineStandIn, api_cls: type[KubeApi] = KubeApi, **kw: Any) -> KubeAgent:
    """The agent, retrying after 0.2 s (a real server answers a retried call at once)."""
    return kube_agent._agent(kubeconfig, engine, api_cls, retry_delay=0.2, **kw)


@contextlib.asynccontextmanager
async def running(a: KubeAgent) -> AsyncIterator[asyncio.Task]:
    async with kube_agent.running(a, close_api=True) as task:
        yield task


async def until_true(predicate: Callable[[], bool], what: str, limit: float = 60.0) -> None:
    """Poll a fresh read of the server until `predicate` holds (fails only if it never does)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not await asyncio.to_thread(predicate):
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
