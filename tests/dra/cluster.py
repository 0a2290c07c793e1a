"""A real kube-apiserver and a real kube-scheduler of one release (v1.36.3, scripts/install-kube-scheduler)
over the etcd of scripts/install-kube-apiserver: the scheduler allocates ResourceClaims from the
ResourceSlices gpud publishes, exactly as in a cluster (DRA structured parameters, partitionable
devices on by default since 1.36). No kubelet runs: a node is an object the test creates, and the
kubelet's side of DRA is the gRPC client of tests/dra (the generated code, no hand-made frames).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from tests.support import kube_real_server as real_server
from tests.support.kube_real_server import ADMIN_TOKEN, RealServer

DRA_VERSION = "v1.36.3"
DEVICE_CLASSES = real_server.REPO / "deploy" / "dra" / "deviceclasses.yaml"
DRA_RBAC = real_server.REPO / "deploy" / "dra" / "gpud-dra-rbac.yaml"
RESOURCE = "/apis/resource.k8s.io/v1"


def dra_binaries() -> tuple[dict[str, str], str | None]:
    """kube-apiserver and kube-scheduler (v1.36.3), etcd (install-kube-apiserver's); or the reason."""
    base, why = real_server.binaries()
    if why:
        return {}, why
    status = real_server.anchor_dir().parent / DRA_VERSION / "status.json"
    out, why = real_server.built(status, ("kube-apiserver", "kube-scheduler"), "scripts/install-kube-scheduler")
    return ({"etcd": base["etcd"], **out}, None) if not why else ({}, why)


class DraCluster:
    def __init__(self, workdir: Path, server_args: tuple[str, ...] = ()) -> None:
        bins, why = dra_binaries()
        if why:
            raise RuntimeError(why)
        self.dir = workdir
        self.server = RealServer(workdir, bins={k: bins[k] for k in ("etcd", "kube-apiserver")},
                                 extra_args=server_args)
        self.scheduler_bin = bins["kube-scheduler"]
        self.scheduler: subprocess.Popen | None = None

    def start(self) -> DraCluster:
        self.server.start()
        self.server.apply_yaml(DRA_RBAC.read_text())
        for doc in yaml.safe_load_all(DEVICE_CLASSES.read_text()):
            self.admin("POST", f"{RESOURCE}/deviceclasses", doc)
        self.start_scheduler()
        return self

    def start_scheduler(self) -> None:
        kc = self.server.admin_kubeconfig(self.dir / "scheduler.kubeconfig")
        with open(self.dir / "kube-scheduler.log", "ab") as log:  # the child has its own descriptor of it
            self.scheduler = subprocess.Popen(
                [self.scheduler_bin, f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}",
                 f"--authorization-kubeconfig={kc}", "--leader-elect=false", "--secure-port=0", "--v=2"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        real_server._stop(self.scheduler)
        self.server.stop()

    def admin(self, method: str, path: str, body: dict | None = None, **kw) -> dict:
        try:
            return self.server.admin(method, path, body, **kw)
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{method} {path}: {e.code} {e.read().decode()[:600]}") from None

    def kubeconfig(self, path: Path) -> str:
        """gpud's identity: the ServiceAccount of packaging/kube/gpud-rbac.yaml."""
        return self.server.kubeconfig(path)

    # --- objects --------------------------------------------------------------------------------
    def node(self, name: str) -> None:
        self.admin("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {
            "name": name, "labels": {"kubernetes.io/hostname": name}}})
        # the not-ready taint admission puts on a new node (TaintNodesByCondition) is the node
        # lifecycle controller's to remove once the kubelet reports Ready; no controller runs here
        self.admin("PATCH", f"/api/v1/nodes/{name}", {"spec": {"taints": None}},
                   content_type="application/merge-patch+json")
        self.admin("PATCH", f"/api/v1/nodes/{name}/status", {"status": {
            "capacity": {"cpu": "64", "memory": "512Gi", "pods": "500"},
            "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "500"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test node",
                            "lastHeartbeatTime": _now(), "lastTransitionTime": _now()}]}},
                   content_type="application/merge-patch+json")

    def claim(self, name: str, device_class: str, cel: str | None = None, *, namespace: str = "apps",
              count: int = 1) -> dict:
        exactly: dict = {"deviceClassName": device_class, "count": count}
        if cel:
            exactly["selectors"] = [{"cel": {"expression": cel}}]
        return self.admin("POST", f"{RESOURCE}/namespaces/{namespace}/resourceclaims", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}})

    def pod(self, name: str, claim: str, *, namespace: str = "apps", node: str | None = None,
            containers: int = 1) -> dict:
        spec: dict = {"containers": [{"name": f"c{i}", "image": "registry.invalid/none:1",
                                      "resources": {"claims": [{"name": "gpu"}]}} for i in range(containers)],
                      "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}]}
        if node:
            spec["nodeSelector"] = {"kubernetes.io/hostname": node}
        return self.admin("POST", f"/api/v1/namespaces/{namespace}/pods",
                          {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec})

    def get_claim(self, name: str, namespace: str = "apps") -> dict:
        return self.admin("GET", f"{RESOURCE}/namespaces/{namespace}/resourceclaims/{name}")

    def get_pod(self, name: str, namespace: str = "apps") -> dict:
        return self.admin("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")

    def delete(self, path: str) -> None:
        self.admin("DELETE", path)

    def slices(self, node: str) -> list[dict]:
        return self.admin("GET", f"{RESOURCE}/resourceslices?fieldSelector=spec.nodeName={node}")["items"]

    def watch_slices(self, node: str, until, limit: float = 60.0, what: str = "the node's slices") -> list[dict]:
        """The node's slices as the server stores them, once `until(slices)` holds: listed, then
        followed on a watch from that list's resourceVersion (each event applied; no polling).
        Bounded by `limit` (the watch's timeoutSeconds and the socket's): a clear failure after."""
        path = f"{RESOURCE}/resourceslices?fieldSelector=spec.nodeName={node}"
        listing = self.admin("GET", path)
        have = {s["metadata"]["name"]: s for s in listing["items"]}
        if until(list(have.values())):
            return list(have.values())
        url = (f"{self.server.url}{path}&watch=1&resourceVersion={listing['metadata']['resourceVersion']}"
               f"&timeoutSeconds={max(1, int(limit))}")
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        with urllib.request.urlopen(req, timeout=limit, context=self.server._ssl) as stream:
            for line in stream:
                ev = json.loads(line)
                obj = ev["object"]
                if ev["type"] in ("ADDED", "MODIFIED"):
                    have[obj["metadata"]["name"]] = obj
                elif ev["type"] == "DELETED":
                    have.pop(obj["metadata"]["name"], None)
                else:
                    raise AssertionError(f"watching {what}: {ev['type']} {obj}")
                if until(list(have.values())):
                    return list(have.values())
        raise AssertionError(f"{what}: not within {limit:.0f}s; logs in {self.dir}")

    # --- waiting on the scheduler (bounded: the condition, or a clear failure) ------------------------
    def wait(self, what: str, cond, limit: float = 60.0):
        deadline = time.monotonic() + limit
        while True:
            got = cond()
            if got:
                return got
            if self.scheduler is not None and self.scheduler.poll() is not None:
                raise AssertionError(f"kube-scheduler exited {self.scheduler.returncode}; log in {self.dir}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {limit:.0f}s; logs in {self.dir}")
            time.sleep(0.1)

    def allocated(self, claim: str, namespace: str = "apps") -> list[dict]:
        """The claim's allocated devices, once the scheduler allocated it."""
        def results():
            alloc = (self.get_claim(claim, namespace).get("status") or {}).get("allocation")
            return alloc["devices"]["results"] if alloc else None
        return self.wait(f"claim {claim} allocated", results)

    def unschedulable(self, pod: str, namespace: str = "apps") -> str:
        """The scheduler's message once it found no node for the pod."""
        def message():
            for c in (self.get_pod(pod, namespace).get("status") or {}).get("conditions") or ():
                if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("reason") == "Unschedulable":
                    return c.get("message") or "unschedulable"
            return None
        return self.wait(f"pod {pod} found unschedulable", message)


def skips() -> list:
    """The DRA tests' markers: `apiserver` (a real kube-apiserver), and skips each with its
    reason: binaries not built, gRPC code not generated, no openssl CLI."""
    import pytest

    from gpud.host.kube import kubelet_plugin

    _, why = dra_binaries()
    try:
        kubelet_plugin.proto()
        proto = None
    except kubelet_plugin.ProtoMissing as e:
        proto = str(e)
    ssl = real_server.have_openssl()
    return [pytest.mark.apiserver, pytest.mark.skipif(why is not None, reason=why or ""),
            pytest.mark.skipif(proto is not None, reason=proto or ""),
            pytest.mark.skipif(ssl is not None, reason=ssl or "")]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


__all__ = ["ADMIN_TOKEN", "DraCluster", "dra_binaries"]
