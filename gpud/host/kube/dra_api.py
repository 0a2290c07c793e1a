"""The Kubernetes API as gpud's DRA driver uses it: its node's ResourceSlices, and the claims the
kubelet asks it to prepare (resource.k8s.io/v1, GA since Kubernetes 1.34).

An adapter over lightkube's asyncio client (the `[dra]` extra), imported only with `--dra`. RBAC
(packaging/kube/gpud-rbac.yaml): resourceslices get, list, watch, create, update, delete;
resourceclaims get. Slices are compared with what the server holds and written only where they
differ, so a republish of an unchanged pool makes no write.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

import httpx2
from lightkube import AsyncClient, KubeConfig
from lightkube.codecs import from_dict
from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice

from gpud.host.kube.node_api import FIELD_MANAGER, KubeError, _translated


def _spec(obj: dict) -> dict:
    return obj.get("spec") or {}


def _plain(model: Any) -> dict:
    return cast(dict, model.to_dict())


def _devices(obj: dict) -> list[dict]:
    return _spec(obj).get("devices") or []


def _tainted(obj: dict) -> bool:
    return any(d.get("taints") for d in _devices(obj))


def _taint_times_kept(obj: dict, old: dict) -> dict:
    """`obj` with each taint's timeAdded as the server stored it for the same device and taint:
    the server sets it on create and update where it is not given (resource/v1 DeviceTaint), so
    a taint sent again without it would differ at every comparison and be rewritten."""
    stored = {d["name"]: {(t.get("key"), t.get("value"), t.get("effect")): t.get("timeAdded")
                          for t in d.get("taints") or ()} for d in _devices(old)}
    if not any(stored.values()):
        return obj
    devices = []
    for d in _devices(obj):
        times = stored.get(d["name"], {})
        if d.get("taints") and times:
            d = dict(d, taints=[dict(t, timeAdded=times[k]) if (k := (t.get("key"), t.get("value"), t.get("effect")))
                                in times and times[k] and "timeAdded" not in t else t for t in d["taints"]])
        devices.append(d)
    return dict(obj, spec=dict(obj["spec"], devices=devices))


class DraApi:
    """One driver's pool on one node, and the claims it prepares."""

    def __init__(self, node: str, driver: str, config: KubeConfig, *, timeout: float = 30.0) -> None:
        self.node, self.driver = node, driver
        self._client = AsyncClient(config=config, timeout=httpx2.Timeout(timeout), field_manager=FIELD_MANAGER)
        self.writes = 0  # creates, updates and deletes made (status --kube, the bench)
        # the server stored devices without the taints sent: DRADeviceTaints is off there (beta and
        # on by default since 1.36, alpha and off in 1.33-1.35: k8s.io/kubernetes pkg/features)
        self.taints_dropped = False

    async def close(self) -> None:
        await self._client.close()

    def _fields(self) -> dict[str, Any]:
        return {"spec.nodeName": self.node, "spec.driver": self.driver}

    async def slices(self) -> tuple[dict[str, dict], str]:
        """This node's slices of this driver by name, and the list's resourceVersion."""
        with _translated():
            listing = self._client.list(ResourceSlice, fields=self._fields())
            out = {}
            async for s in listing:
                d = _plain(s)
                out[d["metadata"]["name"]] = d
            return out, listing.resourceVersion

    async def publish(self, wanted: list[dict]) -> int:
        """Make the pool exactly `wanted`: create what is missing, update what differs, delete the
        rest (a GPU gone, a smaller pool). Returns how many writes it took."""
        have, _ = await self.slices()
        writes = 0
        with _translated():
            for obj in wanted:
                name = obj["metadata"]["name"]
                old = have.pop(name, None)
                if old is None:
                    stored = await self._client.create(cast(ResourceSlice, from_dict(obj)))
                else:
                    obj = _taint_times_kept(obj, old)
                    if _spec(old) == _plain(from_dict(obj)).get("spec"):
                        continue
                    new = dict(obj, metadata=dict(obj["metadata"], resourceVersion=old["metadata"]["resourceVersion"]))
                    stored = await self._client.replace(cast(ResourceSlice, from_dict(new)))
                writes += 1
                if _tainted(obj) and not _tainted(_plain(stored)):
                    self.taints_dropped = True
            for name in have:
                await self._client.delete(ResourceSlice, name)
                writes += 1
        self.writes += writes
        return writes

    async def withdraw(self) -> int:
        """Delete every slice of this pool (the driver stops publishing)."""
        return await self.publish([])

    async def watch_slices(self, resource_version: str, *, server_timeout: int = 300) -> AsyncIterator[tuple[str, str]]:
        """(event type, slice name) for every change to this pool's slices after `resource_version`:
        someone else's write or delete is put right by republishing."""
        with _translated():
            async for kind, obj in self._client.watch(ResourceSlice, fields=self._fields(),
                                                      resource_version=resource_version,
                                                      server_timeout=server_timeout):
                meta = obj.metadata
                yield kind, (meta.name if meta is not None and meta.name else "")

    async def claim(self, namespace: str, name: str) -> dict:
        """The claim as the API server holds it (its allocation names the devices to prepare)."""
        with _translated():
            return _plain(await self._client.get(ResourceClaim, name, namespace=namespace))


__all__ = ["DraApi", "KubeError"]
