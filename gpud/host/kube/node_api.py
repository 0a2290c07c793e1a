"""The Kubernetes API as `gpud --kube-node NAME` uses it: one node's labels, the pods on it.

An adapter over lightkube's asyncio client (the optional `[kube]` extra): only the daemon's
--kube-node mode imports this module, so a host without the extra runs gpud unchanged. What it
needs from the API server (RBAC): nodes get, watch, patch; pods list, watch, delete; events create.

Writes are JSON merge patches of `metadata.labels`; one carrying the resourceVersion it was
computed from fails with Conflict (409) when the node changed since, which is how the protocol
pauses and restores operand labels without overwriting a concurrent change by someone else.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import AsyncGenerator, Iterator, Mapping
from typing import cast

import httpx2
from lightkube import ALL_NS, ApiError, AsyncClient, ConfigError, KubeConfig
from lightkube.resources.core_v1 import Event, Node, Pod
from lightkube.types import PatchType
from msgspec import Struct

FIELD_MANAGER = "gpud"


class KubeError(Exception):
    """The API server refused or could not be reached: status (None when unreachable), reason, message."""

    def __init__(self, status: int | None, reason: str, message: str) -> None:
        super().__init__(f"{status or 'unreachable'} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


class Conflict(KubeError):
    """409: the object changed since the resourceVersion the write was computed from."""


class Gone(KubeError):
    """410: a watch asked for a resourceVersion the server no longer keeps; list again."""


class NodeView(Struct, frozen=True):
    name: str
    labels: dict[str, str]
    resource_version: str
    uid: str = ""  # a node deleted and created again under the same name is another object
    annotations: dict[str, str] = {}


class PodView(Struct, frozen=True):
    namespace: str
    name: str
    labels: dict[str, str]
    node_selector: dict[str, str]
    controller_kind: str | None  # kind of the controlling owner ("DaemonSet"), if any


def load_config(kubeconfig: str | None = None) -> KubeConfig:
    """A kubeconfig file when given; else in-cluster service account, $KUBECONFIG, ~/.kube/config."""
    try:
        return KubeConfig.from_file(kubeconfig) if kubeconfig else KubeConfig.from_env()
    except ConfigError as e:
        where = kubeconfig or "in-cluster service account, $KUBECONFIG or ~/.kube/config"
        raise KubeError(None, "no credentials", f"{where}: {e}") from None


def _error(e: Exception) -> KubeError:
    if isinstance(e, ApiError):
        st = e.status
        cls = {409: Conflict, 410: Gone}.get(st.code or 0, KubeError)
        return cls(st.code, st.reason or "", st.message or "")
    if isinstance(e, httpx2.HTTPStatusError):
        # A watch refused before it streamed (lightkube raises the bare HTTP error, its body
        # unread): say what was refused, in the API server's words for RBAC.
        code = e.response.status_code
        url = e.request.url
        parts = [p for p in url.path.split("/") if p]
        resource = parts[-1] if parts else str(url)
        verb = "watch" if url.params.get("watch") in ("true", "1") else e.request.method.lower()
        cls = {409: Conflict, 410: Gone}.get(code, KubeError)
        what = f'cannot {verb} resource "{resource}"' if code == 403 else f"{verb} {resource}"
        return cls(code, e.response.reason_phrase or "", f"{what} ({url.path})")
    return KubeError(None, type(e).__name__, str(e) or repr(e))


@contextlib.contextmanager
def _translated() -> Iterator[None]:
    try:
        yield
    except (ApiError, httpx2.HTTPError, OSError) as e:
        raise _error(e) from e


def _node(obj: Node) -> NodeView:
    meta = obj.metadata
    assert meta is not None and meta.name is not None  # the API server names every object it returns
    return NodeView(name=meta.name, labels=dict(meta.labels or {}), resource_version=meta.resourceVersion or "",
                    uid=meta.uid or "", annotations=dict(meta.annotations or {}))


def _pod(obj: Pod) -> PodView:
    meta = obj.metadata
    assert meta is not None and meta.name is not None  # the API server names every object it returns
    owner = next((o.kind for o in meta.ownerReferences or () if o.controller), None)
    selector = obj.spec.nodeSelector if obj.spec is not None else None
    return PodView(namespace=meta.namespace or "", name=meta.name, labels=dict(meta.labels or {}),
                   node_selector=dict(selector or {}), controller_kind=owner)


class KubeApi:
    """One node of one cluster, seen and changed through the API server."""

    def __init__(self, node: str, config: KubeConfig, *, timeout: float = 30.0) -> None:
        self.node_name = node
        self._client = AsyncClient(config=config, timeout=httpx2.Timeout(timeout), field_manager=FIELD_MANAGER)

    async def close(self) -> None:
        await self._client.close()

    async def node(self) -> NodeView:
        with _translated():
            return _node(await self._client.get(Node, self.node_name))

    async def patch_labels(self, labels: Mapping[str, str | None], *, resource_version: str | None = None) -> NodeView:
        """Merge `labels` into the node's (None removes one). With `resource_version`, only if the
        node is still at that version (else Conflict)."""
        meta: dict = {"labels": dict(labels)}
        if resource_version is not None:
            meta["resourceVersion"] = resource_version
        with _translated():
            return _node(await self._client.patch(Node, self.node_name, {"metadata": meta},
                                                  patch_type=PatchType.MERGE))

    async def patch_annotations(self, annotations: Mapping[str, str | None]) -> NodeView:
        """Merge `annotations` into the node's (None removes one)."""
        with _translated():
            return _node(await self._client.patch(Node, self.node_name, {"metadata": {"annotations": dict(annotations)}},
                                                  patch_type=PatchType.MERGE))

    async def node_event(self, reason: str, message: str, *, warning: bool = True, uid: str = "") -> None:
        """An Event about the node, where `kubectl describe node` lists it (core/v1 Event in the
        `default` namespace, involvedObject the Node, as the kubelet records node events)."""
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = cast(Event, Event.from_dict({
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{self.node_name}.gpud-", "namespace": "default"},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": uid or None},
            "reason": reason, "message": message[:1024], "type": "Warning" if warning else "Normal",
            "source": {"component": FIELD_MANAGER, "host": self.node_name}, "reportingComponent": FIELD_MANAGER,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }))
        with _translated():
            await self._client.create(event)  # namespaced by its metadata

    async def watch_node(self, resource_version: str | None = None, *,
                         server_timeout: int = 300) -> AsyncGenerator[NodeView, None]:
        """The node's versions after `resource_version`; None: the node as it is now (the server's
        first event), then each change. The client re-opens the watch from the last version seen
        whenever the server ends it. Raises Gone when that version is older than the server keeps
        (an etcd compaction, a restarted API server's fresh watch cache)."""
        with _translated():
            async for _, obj in self._client.watch(Node, fields={"metadata.name": self.node_name},
                                                   resource_version=resource_version,
                                                   server_timeout=server_timeout):
                yield _node(obj)

    async def pods(self) -> tuple[list[PodView], str]:
        """Every pod on the node, in every namespace, and the list's resourceVersion."""
        with _translated():
            listing = self._client.list(Pod, namespace=ALL_NS, fields={"spec.nodeName": self.node_name})
            pods = [_pod(p) async for p in listing]
            return pods, listing.resourceVersion

    async def watch_pods(self, resource_version: str, *,
                         server_timeout: int = 60) -> AsyncGenerator[tuple[str, PodView], None]:
        with _translated():
            async for kind, obj in self._client.watch(Pod, namespace=ALL_NS, fields={"spec.nodeName": self.node_name},
                                                      resource_version=resource_version,
                                                      server_timeout=server_timeout):
                yield kind, _pod(obj)

    async def delete_pod(self, namespace: str, name: str) -> bool:
        """False when it was already gone."""
        try:
            with _translated():
                await self._client.delete(Pod, name, namespace=namespace)
            return True
        except KubeError as e:
            if e.status == 404:
                return False
            raise
