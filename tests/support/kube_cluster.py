"""A small cluster around the API emulator: a kubeconfig for the real client, the DaemonSet
controller's one behaviour the protocol depends on, and a bounded wait on the server's state."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import cast

import yaml
from lightkube import AsyncClient, KubeConfig
from lightkube.resources.core_v1 import Node, Pod

from tests.support.kube_emulator import ApiServer
from tests.support.present import present

NODE = "gpu-node-1"
OPERATOR_NS = "gpu-operator"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"  # never pulled (no kubelet); the API server requires an image


def write_kubeconfig(path, server_url: str) -> str:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "emulator", "cluster": {"server": server_url}}],
        "contexts": [{"name": "test", "context": {"cluster": "emulator", "user": "gpud"}}],
        "users": [{"name": "gpud", "user": {"token": "test-token"}}],
    }))
    return str(path)


async def until(api: ApiServer, predicate: Callable[[], bool], what: str, limit: float = 20.0) -> None:
    """Wait for a state of the emulator (re-checked on every write). Fails only if it never comes."""
    async def wait() -> None:
        cond = api._cond()
        async with cond:
            while not predicate():
                await cond.wait()

    try:
        await asyncio.wait_for(wait(), limit)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


class DaemonSet:
    def __init__(self, name: str, namespace: str, app: str, selector: dict[str, str]) -> None:
        self.name, self.namespace, self.app, self.selector = name, namespace, app, selector

    def pod(self, node: str) -> dict:
        return {
            "metadata": {"name": f"{self.name}-{node}", "namespace": self.namespace, "labels": {"app": self.app},
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": self.name,
                                              "uid": f"uid-{self.name}", "controller": True}]},
            "spec": {"nodeName": node, "nodeSelector": dict(self.selector), "containers": [{"name": "main", "image": PAUSE_IMAGE}]},
        }


class DaemonSetController:
    """Runs each DaemonSet's pod on the node exactly while the node's labels match its selector,
    watching the node through the real client as kube-controller-manager does. A pod's
    termination waits for `terminating` to be set, when a test wants to hold it."""

    def __init__(self, client: AsyncClient, node: str, sets: list[DaemonSet]) -> None:
        self.client, self.node, self.sets = client, node, sets
        self.terminating = asyncio.Event()
        self.terminating.set()
        self._task: asyncio.Task | None = None

    async def _sync(self, labels: dict[str, str]) -> None:
        for ds in self.sets:
            want = all(labels.get(k) == v for k, v in ds.selector.items())
            name = f"{ds.name}-{self.node}"
            try:
                await self.client.get(Pod, name, namespace=ds.namespace)
                have = True
            except Exception:  # noqa: BLE001 - 404
                have = False
            if want and not have:
                # namespaced by its metadata (ds.namespace)
                await self.client.create(cast(Pod, Pod.from_dict({"apiVersion": "v1", "kind": "Pod", **ds.pod(self.node)})))
            elif have and not want:
                await self.terminating.wait()
                await self.client.delete(Pod, name, namespace=ds.namespace)

    async def _run(self) -> None:
        while True:
            try:
                node = await self.client.get(Node, self.node)
                await self._sync(present(node.metadata).labels or {})
                async for _, changed in self.client.watch(Node, fields={"metadata.name": self.node},
                                                          resource_version=present(node.metadata).resourceVersion):
                    await self._sync(present(changed.metadata).labels or {})
            except Exception:  # noqa: BLE001 - the API server restarting: read again, as an informer does
                await asyncio.sleep(0.2)

    async def __aenter__(self):
        node = await self.client.get(Node, self.node)
        await self._sync(present(node.metadata).labels or {})
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc):
        task = present(self._task, "a started controller")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def client_for(kubeconfig: str) -> AsyncClient:
    return AsyncClient(config=KubeConfig.from_file(kubeconfig))


class EmulatorThread:
    """The API emulator on its own event loop in a thread, for tests that drive a gpud process
    (synchronous test code, a server the daemon reaches over 127.0.0.1)."""

    def __init__(self) -> None:
        import threading

        import kmock

        self.loop = asyncio.new_event_loop()
        self.api = ApiServer()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None

        async def serve() -> None:
            self._stop = asyncio.Event()
            async with self.api, kmock.Server(self.api):
                self._ready.set()
                await self._stop.wait()
                await self.api.end_watches()

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(serve(),), daemon=True)
        self.thread.start()
        if not self._ready.wait(30):
            raise AssertionError("API emulator did not start")

    @property
    def url(self) -> str:
        return str(self.api.url)

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def read(self, fn):
        """Run a read of the emulator's state on its loop (no torn reads while it serves)."""
        async def read():
            return fn()

        return self.call(read())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(present(self._stop).set)
        self.thread.join(30)
        if not self.thread.is_alive():
            self.loop.close()
