"""What the tests need around a real kube-apiserver (tests/support/kube_real_server.py): the node's versions
as the server streamed them, the kubelet's one part in pod deletion, and one sync view shared by
the emulator and the real server so a scenario runs against both.

The history comes from an admin watch of the node (a watch delivers every version of an object, in
order); reads for assertions are fresh GETs and LISTs (quorum reads from etcd), never the
recorder's copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import urllib.error
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx2
from lightkube import ApiError, Client, KubeConfig
from lightkube.resources.core_v1 import Node, Pod

from tests.support.kube_real_server import RealServer
from tests.support.present import present


class LoopThread:
    """An asyncio loop in a thread, for async helpers (the DaemonSet controller stand-in) in
    synchronous tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class _Watcher:
    """A thread that follows a watch through server restarts and 410s (relisting), as an informer does."""

    def __init__(self, kubeconfig: str) -> None:
        self.client = Client(config=KubeConfig.from_file(kubeconfig), timeout=httpx2.Timeout(30))
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def start(self):
        self.thread.start()
        return self

    # what a watcher of one kind provides
    def relist(self) -> str:
        """List the objects (each told through `event`); returns the list's resourceVersion."""
        raise NotImplementedError

    def watch(self, rv: str) -> Iterator[tuple[str, Any]]:
        raise NotImplementedError

    def event(self, kind: str, obj: Any) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        try:
            self._follow()
        finally:
            self.client.close()  # here, never from another thread: a socket closed under a blocked
            # read frees its descriptor for the next socket opened, and the read then eats that one's bytes

    def _follow(self) -> None:
        rv = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    rv = self.relist()
                for kind, obj in self.watch(rv):
                    if self._stop.is_set():  # a stopped watcher must not act on a later test's objects
                        return
                    rv = obj.metadata.resourceVersion
                    self.event(kind, obj)
            except ApiError as e:
                if e.status.code == 410:
                    rv = None
                else:
                    time.sleep(0.2)
            except Exception:  # noqa: BLE001 - the server is restarting: resume from the last version
                if self._stop.is_set():
                    return
                time.sleep(0.2)

    def stop(self) -> None:
        """The thread ends at its watch's next event or server-side timeout (a few seconds)."""
        self._stop.set()


class NodeRecorder(_Watcher):
    """Every version of one node's labels, in the order the server streamed them; None marks a deletion."""

    def __init__(self, kubeconfig: str, node: str) -> None:
        super().__init__(kubeconfig)
        self.node = node
        self.versions: list[dict[str, str] | None] = []
        self.cond = threading.Condition()

    def relist(self) -> str:
        listing = self.client.list(Node, fields={"metadata.name": self.node})
        items = list(listing)
        with self.cond:
            now = dict(present(items[0].metadata).labels or {}) if items else None
            if not self.versions or self.versions[-1] != now:
                self.versions.append(now)
            self.cond.notify_all()
        return listing.resourceVersion

    def watch(self, rv):
        return self.client.watch(Node, fields={"metadata.name": self.node}, resource_version=rv, server_timeout=5)

    def event(self, kind, obj) -> None:
        with self.cond:
            self.versions.append(None if kind == "DELETED" else dict(obj.metadata.labels or {}))
            self.cond.notify_all()

    def history(self) -> list[dict[str, str]]:
        with self.cond:
            return [dict(v) for v in self.versions if v is not None]

    def wait(self, predicate: Callable[[dict[str, str]], bool], what: str, timeout: float = 60.0) -> None:
        """Until the newest version the server streamed satisfies `predicate`."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not (self.versions and self.versions[-1] is not None and predicate(self.versions[-1])):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out waiting for {what}; node labels: {self.versions[-1:]}")
                self.cond.wait(min(left, 0.1))  # the predicate may look beyond the node too


class Kubelet(_Watcher):
    """The kubelet's part of deleting a pod bound to its node: a graceful delete only marks the pod
    (deletionTimestamp); the kubelet stops its containers and then deletes it with grace 0. Without
    this no pod on a node ever goes away on a real server."""

    def __init__(self, kubeconfig: str, node: str) -> None:
        super().__init__(kubeconfig)
        self.node = node
        self.finalized: list[str] = []
        self.hold = threading.Event()  # cleared: pods stay terminating (a pod that will not stop)
        self.hold.set()

    def relist(self) -> str:
        listing = self.client.list(Pod, namespace="*", fields={"spec.nodeName": self.node})
        for pod in list(listing):
            self.event("MODIFIED", pod)
        return listing.resourceVersion

    def watch(self, rv):
        return self.client.watch(Pod, namespace="*", fields={"spec.nodeName": self.node}, resource_version=rv,
                                 server_timeout=5)

    def event(self, kind, pod) -> None:
        if kind == "DELETED" or pod.metadata.deletionTimestamp is None:
            return
        self.hold.wait()
        with contextlib.suppress(ApiError):
            self.client.delete(Pod, pod.metadata.name, namespace=pod.metadata.namespace, grace_period=0)
            self.finalized.append(f"{pod.metadata.namespace}/{pod.metadata.name}")


class RealNode:
    """One node on the real server, seen the way the tests check it."""

    def __init__(self, server: RealServer, workdir: Path, node: str) -> None:
        self.server, self.node = server, node
        self.admin_kubeconfig = server.admin_kubeconfig(workdir / "admin.kubeconfig")
        self.kubeconfig = server.kubeconfig(workdir / "gpud.kubeconfig")
        self.recorder = NodeRecorder(self.admin_kubeconfig, node).start()
        self.kubelet = Kubelet(self.admin_kubeconfig, node).start()

    def close(self) -> None:
        self.recorder.stop()
        self.kubelet.stop()
        self.wipe()

    # --- writes, as an administrator or a controller ------------------------------------------
    def put_node(self, labels: dict[str, str]) -> None:
        """Create the node with `labels`, or merge them into its labels."""
        try:
            self.server.admin("POST", "/api/v1/nodes",
                              {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node, "labels": labels}})
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise
            self.merge_labels(labels)

    def merge_labels(self, labels: Mapping[str, str | None]) -> None:
        self.server.admin("PATCH", f"/api/v1/nodes/{self.node}", {"metadata": {"labels": labels}},
                          content_type="application/merge-patch+json")

    def delete_node(self) -> None:
        self.server.admin("DELETE", f"/api/v1/nodes/{self.node}")

    def put_pod(self, pod: dict) -> None:
        ns = pod["metadata"]["namespace"]
        self.server.admin("POST", f"/api/v1/namespaces/{ns}/pods", {"apiVersion": "v1", "kind": "Pod", **pod})

    def wipe(self) -> None:
        """Remove the node and every pod bound to it (grace 0), so the next test starts clean."""
        for key in self.pods():
            ns, name = key.split("/")
            with contextlib.suppress(urllib.error.HTTPError):
                self.server.admin("DELETE", f"/api/v1/namespaces/{ns}/pods/{name}",
                                  {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
        with contextlib.suppress(urllib.error.HTTPError):
            self.delete_node()

    # --- fresh reads ---------------------------------------------------------------------------
    def labels(self) -> dict[str, str]:
        return self.server.admin("GET", f"/api/v1/nodes/{self.node}")["metadata"].get("labels") or {}

    def pods(self, *, terminating: bool = True) -> list[str]:
        items = self.server.admin("GET", f"/api/v1/pods?fieldSelector=spec.nodeName%3D{self.node}")["items"]
        return sorted(f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in items
                      if terminating or not p["metadata"].get("deletionTimestamp"))

    def history(self) -> list[dict[str, str]]:
        return self.recorder.history()

    def wait(self, predicate: Callable[[dict[str, str]], bool], what: str, timeout: float = 120.0) -> None:
        self.recorder.wait(predicate, what, timeout)

    def settle(self, timeout: float = 30.0) -> None:
        """Until the recorder has the node's current version (call when nothing else writes)."""
        now = self.labels()
        self.wait(lambda labels: labels == now, "the node's history to catch up", timeout)

    async def until(self, predicate: Callable[[dict[str, str]], bool], what: str, timeout: float = 60.0) -> None:
        await asyncio.to_thread(self.wait, predicate, what, timeout)


class KmockNode:
    """The same view over the API emulator in its thread (tests/support/kube_cluster.py EmulatorThread)."""

    def __init__(self, emu, kubeconfig: str, node: str) -> None:
        self.emu, self.kubeconfig, self.node = emu, kubeconfig, node

    def put_node(self, labels: dict[str, str]) -> None:
        self.emu.call(self.emu.api.put_object("nodes", {"metadata": {"name": self.node, "labels": labels}}))

    merge_labels = put_node

    def settle(self) -> None:
        """The emulator's history is its own log: always current."""

    def labels(self) -> dict[str, str]:
        return self.emu.read(lambda: self.emu.api.get("nodes", self.node)["metadata"]["labels"])

    def pods(self, *, terminating: bool = True) -> list[str]:
        return self.emu.read(lambda: sorted(f"{ns}/{n}" for (p, ns, n), o in self.emu.api._store.items()
                                            if p == "pods" and o["spec"].get("nodeName") == self.node))

    def history(self) -> list[dict[str, str]]:
        return self.emu.read(lambda: self.emu.api.node_history(self.node))

    def wait(self, predicate: Callable[[dict[str, str]], bool], what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(self.labels()):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; node labels: {self.labels()}")
            time.sleep(0.05)
