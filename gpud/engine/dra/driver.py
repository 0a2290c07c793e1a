"""gpud as its node's DRA driver: publishes the pool, prepares and unprepares claims.

Publishing: after every engine pass, lease change and device event the daemon calls `publish()`;
it builds the pool from the engine's view (gpud.plan.dra_slices, pure) and writes only what
differs from what the API server holds (gpud.host.kube.dra_api), so at rest nothing is written. A
watch on the pool's slices puts right what someone else changed or deleted.

Prepare (the kubelet's NodePrepareResources): the claim is read from the API server (its
allocation names pool and device); for each device of this driver and pool:
* a dynamic MIG device: a lease at exactly the allocated placement (gpud.engine.leases, owner
  `dra:<claim uid>`), which makes the GI and CI; a lease already held by that owner at that
  placement is taken as it is (a repeated prepare, a gpud killed after the lease and before the
  checkpoint);
* a dynamic whole GPU: a whole-GPU lease (refused while any instance is on it);
* a vfio device: the GPU and every function of its IOMMU group must be on vfio-pci (the layout
  binds them, a claim never does); the group's /dev/vfio node is handed over;
* whole GPUs, static MIG devices and vGPUs exist already: nothing is made.
Then a CDI spec for the claim is written (`<cdi dir>/<driver>-claim_<uid>.json`, kind
`<driver>/claim`) and the claim is checkpointed (`STATE_DIR/dra-claims.json`) with the leases it
holds. A claim already in the checkpoint is answered from it: a claim shared by two containers
(or asked again after a kubelet restart) is prepared once.

Unprepare releases the claim's leases (never while busy: the kubelet retries), removes its CDI
spec and checkpoint entry. At start the checkpoint is reconciled with the lease records: an entry
whose lease is gone is dropped, so the kubelet's next prepare makes it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import msgspec

from gpud.engine.leases.engine import LeaseEngine, LeaseRefused
from gpud.engine.leases.records import LeaseRecord
from gpud.engine.view import EngineView
from gpud.host.files import state_files
from gpud.host.kube.kubelet_plugin import ClaimRef, Prepared, PreparedDevice
from gpud.model import Gpu, Placement
from gpud.pci import is_vfio
from gpud.plan.dra_slices import DraInputs, DraSlices, SliceDevice, build_slices

log = logging.getLogger(__name__)

CHECKPOINT = "dra-claims.json"
OWNER_PREFIX = "dra:"
DEFAULT_CDI_DIR = "/var/run/cdi"
METADATA_CONTAINER_DIR = "/var/run/kubernetes.io/dra-device-attributes"  # api/metadata ContainerDir
POD_CLAIM_ANNOTATION = "resource.kubernetes.io/pod-claim-name"  # resource/v1 PodResourceClaimAnnotation


class ClaimsApi(Protocol):
    node: str
    driver: str
    taints_dropped: bool  # the server stored devices without the taints sent (DRADeviceTaints off)

    async def publish(self, wanted: list[dict]) -> int: ...
    async def claim(self, namespace: str, name: str) -> dict: ...


class PreparedClaim(msgspec.Struct, frozen=True):
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]
    leases: tuple[str, ...] = ()  # lease ids this claim holds


def foreign_placements(view: EngineView) -> dict[str, tuple[Placement, ...]]:
    """Per dynamic GPU, what is used by anything but a DRA claim: instances no claim's lease made
    (gpudctl leases, someone's nvidia-smi) and whole-GPU leases of others (the GPU's every slice)."""
    claimed = {(r.gpu, r.placement) for r in view.leases if r.owner.startswith(OWNER_PREFIX) and r.placement}
    whole_claimed = {r.gpu for r in view.leases if r.owner.startswith(OWNER_PREFIX) and r.kind == "gpu"}
    out: dict[str, list[Placement]] = {}
    for gpu in view.observation.gpus:
        if gpu.nvml is None:
            continue
        for gi in gpu.nvml.instances:
            if (gpu.pci, gi.placement) not in claimed:
                out.setdefault(gpu.pci, []).append(gi.placement)
    for r in view.leases:
        if r.owner.startswith(OWNER_PREFIX) or r.state == "vanished":
            continue
        if r.placement is not None:
            out.setdefault(r.gpu, []).append(r.placement)
        elif r.kind == "gpu" and r.gpu not in whole_claimed:
            out.setdefault(r.gpu, []).append(Placement(0, 64))  # every slice
    return {k: tuple(v) for k, v in out.items()}


UNHEALTHY_STATES = ("stuck", "gone")  # a driver write that never returned; the GPU left the bus


def inputs_of(view: EngineView, node: str, driver: str, *, driver_version: str | None,
              cuda_version: int | None = None,
              unhealthy: frozenset[str] = frozenset(),
              pcie_root: Callable[[str], str | None] = lambda pci: None,
              taints: Mapping[str, tuple[dict, ...]] | None = None) -> DraInputs:
    """The builder's inputs from the engine's view. Unhealthy: GPUs whose last state is stuck or
    gone, beside what the caller adds (gpud reads no XIDs itself)."""
    desired = view.resolution.desired if view.resolution is not None else {}
    unhealthy = unhealthy | {pci for pci, st in view.gpu_states.items() if st.state in UNHEALTHY_STATES}
    roots = {g.pci: r for g in view.observation.gpus if g.present and (r := pcie_root(g.pci))}
    return DraInputs(node, view.observation.gpus, desired, driver=driver, driver_version=driver_version,
                     cuda_version=cuda_version,
                     unhealthy=unhealthy, foreign=foreign_placements(view), pcie_roots=roots,
                     taints=taints or {})


class DraDriver:
    def __init__(self, api: ClaimsApi, leases: LeaseEngine, view: Callable[[], EngineView], *,
                 state_dir: str | None, cdi_dir: str = DEFAULT_CDI_DIR,
                 driver_version: Callable[[], str | None] = lambda: None,
                 cuda_version: Callable[[], int | None] = lambda: None,
                 unhealthy: Callable[[], frozenset[str]] = frozenset,
                 pcie_root: Callable[[str], str | None] = lambda pci: None,
                 taints: Callable[[], Mapping[str, tuple[dict, ...]]] = dict,
                 metadata_dir: str | None = None,
                 refresh: Callable[[], Awaitable[object]] | None = None) -> None:
        self.api, self.leases, self._view = api, leases, view
        self._pcie_root, self._taints = pcie_root, taints
        self.node, self.driver = api.node, api.driver
        self.cdi_dir = cdi_dir
        self.metadata_dir = metadata_dir  # KEP-5304 device metadata files (None: not written)
        self._refresh = refresh  # re-read the host (the engine's refresh)
        self.path = os.path.join(state_dir, CHECKPOINT) if state_dir else None
        self._driver_version, self._cuda_version, self._unhealthy = driver_version, cuda_version, unhealthy
        self.claims: dict[str, PreparedClaim] = {}
        self.published: DraSlices | None = None
        self.generation = 0
        self._publishing = asyncio.Lock()
        self._claim_locks: dict[str, asyncio.Lock] = {}

    # ---- the pool ------------------------------------------------------------------------------
    def build(self) -> DraSlices:
        view = self._view()
        unhealthy, taints = self._unhealthy(), dict(self._taints())
        if self.api.taints_dropped:  # a server without DRADeviceTaints: what would not be scheduled goes
            unhealthy |= {pci for pci, ts in taints.items() if any(t["effect"] == "NoSchedule" for t in ts)}
            taints = {}
        inputs = inputs_of(view, self.node, self.driver, driver_version=self._driver_version(),
                           cuda_version=self._cuda_version(),
                           unhealthy=unhealthy, pcie_root=self._pcie_root, taints=taints)
        return build_slices(msgspec.structs.replace(inputs, generation=max(self.generation, 1)))

    async def publish(self) -> int:
        """Write the pool as the hardware is now; a changed pool gets the next generation."""
        async with self._publishing:
            built = self.build()
            if self.published is not None and built.slices == self.published.slices:
                return 0
            if self.published is not None:
                self.generation = max(self.generation, 1) + 1
                built = self.build()
            else:
                self.generation = max(self.generation, 1)
            dropped = self.api.taints_dropped
            writes = await self.api.publish(built.slices)
            if self.api.taints_dropped and not dropped:  # learnt just now: publish without them
                log.warning("DRA: the API server dropped the devices' taints (DRADeviceTaints off); "
                            "devices of GPUs with a fatal Xid are withdrawn instead")
                built = self.build()
                writes += await self.api.publish(built.slices)
            self.published = built
            return writes

    def device(self, name: str) -> SliceDevice | None:
        """What a published device stands for: from the pool last published, else as built now
        (a restarted gpud before its first publish; a device the scheduler allocated just before a
        change and still on the hardware)."""
        if self.published is not None and name in self.published.devices:
            return self.published.devices[name]
        return self.build().devices.get(name)

    # ---- checkpoint ----------------------------------------------------------------------------
    def load(self) -> None:
        if self.path is None:
            return
        got = state_files.load(self.path, lambda b: msgspec.json.decode(b, type=dict[str, PreparedClaim]),
                               what="DRA claim checkpoint")
        self.claims = got or {}

    def _save(self) -> None:
        if self.path is not None:
            state_files.save(self.path, msgspec.json.encode(self.claims), mode=0o600)

    async def start(self) -> list[str]:
        """Checkpoint against the lease records: entries whose leases are gone are dropped (the
        kubelet prepares them again). Returns what was said."""
        self.load()
        have = {r.id for r in self.leases.leases() if r.state != "vanished"}
        said = []
        for uid, c in list(self.claims.items()):
            lost = [lid for lid in c.leases if lid not in have]
            if lost:
                said.append(f"claim {c.namespace}/{c.name} ({uid}): lease(s) {', '.join(lost)} gone; prepared again "
                            "when the kubelet asks")
                del self.claims[uid]
        if said:
            self._save()
        return said

    # ---- prepare -------------------------------------------------------------------------------
    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, Prepared]:
        out: dict[str, Prepared] = {}
        refused = False
        for c in claims:
            lock = self._claim_locks.setdefault(c.uid, asyncio.Lock())
            async with lock:
                try:
                    out[c.uid] = await self._prepare(c)
                except (LeaseRefused, OSError, ValueError, KeyError) as e:
                    log.warning("prepare %s/%s: %s", c.namespace, c.name, e)
                    refused = refused or isinstance(e, LeaseRefused)
                    out[c.uid] = Prepared(error=f"{type(e).__name__}: {e}" if not isinstance(e, LeaseRefused) else str(e))
        if refused and self._refresh is not None:
            # the hardware was not as the pool said (an instance made behind gpud, which raises
            # no event): read it again so the pool stops offering what is taken
            await self._refresh()
        if refused or any(not p.error for p in out.values()):
            await self.publish()
        return out

    async def _prepare(self, c: ClaimRef) -> Prepared:
        done = self.claims.get(c.uid)
        if done is not None:
            return Prepared(done.devices)
        claim = await self.api.claim(c.namespace, c.name)
        if claim["metadata"].get("uid") != c.uid:
            raise ValueError(f"claim {c.namespace}/{c.name} has uid {claim['metadata'].get('uid')}, not {c.uid}")
        results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []
        mine = [r for r in results if r.get("driver") == self.driver and r.get("pool") == self.node]
        if not mine:
            raise ValueError(f"claim {c.namespace}/{c.name} allocates no device of {self.driver} on {self.node}")
        owner = OWNER_PREFIX + c.uid
        gpus = {g.pci: g for g in self._view().observation.gpus}
        leases: list[str] = []
        devices: list[PreparedDevice] = []
        edits: list[dict] = []
        try:
            for r in mine:
                sd = self.device(r["device"])
                if sd is None:
                    raise ValueError(f"device {r['device']} is not published by this node (any more)")
                nodes, env, lease = await self._make(sd, gpus.get(sd.pci), owner)
                if lease is not None:
                    leases.append(lease.id)
                cdi_name = f"{c.uid}-{sd.name}"
                edits.append({"name": cdi_name, "containerEdits": {
                    "deviceNodes": [{"path": n} for n in nodes], "env": env}})
                devices.append(PreparedDevice((r["request"],), self.node, sd.name,
                                              (f"{self.driver}/claim={cdi_name}",), r.get("shareID")))
        except BaseException:
            for lid in leases:  # nothing half-prepared: what this call made goes again
                with contextlib.suppress(LeaseRefused):
                    await self.leases.release(lid, why="released (its claim's prepare failed)", wait=False)
            raise
        self._write_metadata(claim, mine, edits)
        self._write_cdi(c.uid, edits)
        self.claims[c.uid] = PreparedClaim(c.namespace, c.name, tuple(devices), tuple(leases))
        self._save()
        return Prepared(tuple(devices))

    async def _make(self, sd: SliceDevice, gpu: Gpu | None, owner: str) -> tuple[list[str], list[str], LeaseRecord | None]:
        """(device nodes, environment, the lease made or found) for one allocated device."""
        if gpu is None:
            raise ValueError(f"GPU {sd.pci} of device {sd.name} is gone")
        ctl = ["/dev/nvidiactl"]
        if sd.kind == "vfio":
            group = gpu.function.iommu_group
            off = [f.address for f in (gpu.function, *gpu.companions) if not is_vfio(f.driver)]
            if off:
                raise ValueError(f"{sd.name}: {', '.join(off)} not on vfio-pci (the layout binds the group, "
                                 "a claim does not)")
            nodes = ["/dev/vfio/vfio"] + ([f"/dev/vfio/{group}"] if group is not None else [])
            return nodes, [f"PCI_RESOURCE_GPUD_IO={','.join(sd.group)}"], None
        if sd.dynamic:
            profile = sd.profile if sd.kind == "mig" and sd.profile else "gpu"
            rec = next((r for r in self.leases.on(sd.pci) if r.owner == owner and r.profile == profile
                        and r.placement == sd.placement and r.state == "held"), None)
            if rec is None:
                rec = await self.leases.lease(profile, gpu=sd.pci, owner=owner,
                                              start=sd.placement.start if sd.placement is not None else None)
            return [*ctl, *rec.devices], [f"NVIDIA_VISIBLE_DEVICES={rec.uuid}"], rec
        if sd.kind == "vgpu":
            return self._vgpu(sd, gpu), [f"MDEV_UUID={sd.vgpu_uuid}" if sd.vgpu_uuid else
                                         f"PCI_RESOURCE_GPUD_IO={','.join(sd.group)}"], None
        minor = gpu.nvml.minor if gpu.nvml is not None else None
        nodes = [*ctl] + ([f"/dev/nvidia{minor}"] if minor is not None else [])
        uuid = sd.mig_uuid or (gpu.uuid or "")
        return nodes, [f"NVIDIA_VISIBLE_DEVICES={uuid}"], None

    @staticmethod
    def _vgpu(sd: SliceDevice, gpu: Gpu) -> list[str]:
        """The vfio nodes a VM opens for the vGPU as the hardware shows it now: refused where it
        is gone or a VM holds it already (nothing is taken from a running VM)."""
        vf = sd.group[0] if sd.group else None
        found = next((v for v in (gpu.vgpu.devices if gpu.vgpu is not None else ())
                      if (sd.vgpu_uuid and v.uuid == sd.vgpu_uuid) or (vf and v.vf == vf)), None)
        if found is None:
            raise ValueError(f"{sd.name}: vGPU {sd.vgpu_uuid or vf} is gone from {gpu.pci}")
        if found.holders:
            raise ValueError(f"{sd.name}: vGPU {sd.vgpu_uuid or vf} is held by "
                             f"{', '.join(f'{h.name} (pid {h.pid})' for h in found.holders)}")
        return ["/dev/vfio/vfio"] + ([f"/dev/vfio/{found.vfio_group}"] if found.vfio_group is not None else [])

    def _write_metadata(self, claim: dict, results: list[dict], edits: list[dict]) -> None:
        """The device metadata of KEP-5304 (k8s.io/dynamic-resource-allocation api/metadata
        v1alpha1, written as its kubeletplugin helper writes it): per request one file
        `<metadata dir>/<namespace>_<claim>/<request>/metadata.json` holding a DeviceMetadata
        with each allocated device's published attributes, bind-mounted read-only into the
        container at /var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/
        <driver>-metadata.json (resourceclaimtemplates/<pod claim name>/... for a claim made from a
        template). KubeVirt's virt-launcher reads a VM's device (pciBusID, mDevUUID) from it."""
        if self.metadata_dir is None:
            return
        meta = claim["metadata"]
        pod_claim = (meta.get("annotations") or {}).get(POD_CLAIM_ANNOTATION)
        published = self.published if self.published is not None else self.build()
        by_request: dict[str, list[tuple[int, dict]]] = {}
        for k, r in enumerate(results):
            request = r["request"].split("/", 1)[0]  # a subrequest's file is its request's
            by_request.setdefault(request, []).append((k, r))
        for request, got in by_request.items():
            doc = {"apiVersion": "metadata.resource.k8s.io/v1alpha1", "kind": "DeviceMetadata",
                   "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"],
                                "generation": 1},
                   **({"podClaimName": pod_claim} if pod_claim else {}),
                   "requests": [{"name": request, "devices": [
                       {"driver": self.driver, "pool": r["pool"], "name": r["device"],
                        "attributes": published.attributes(r["device"])} for _, r in got]}]}
            host = os.path.join(self.metadata_dir, f"{meta['namespace']}_{meta['name']}", request, "metadata.json")
            os.makedirs(os.path.dirname(host), mode=0o755, exist_ok=True)
            state_files.save(host, json.dumps(doc).encode(), mode=0o644)
            where = ("resourceclaimtemplates", pod_claim) if pod_claim else ("resourceclaims", meta["name"])
            container = "/".join((METADATA_CONTAINER_DIR, *where, request, f"{self.driver}-metadata.json"))
            first = edits[got[0][0]]["containerEdits"]
            first.setdefault("mounts", []).append({"hostPath": host, "containerPath": container,
                                                   "options": ["ro", "bind"]})

    def cdi_path(self, uid: str) -> str:
        return os.path.join(self.cdi_dir, f"{self.driver}-claim_{uid}.json")

    def _write_cdi(self, uid: str, devices: list[dict]) -> None:
        spec = {"cdiVersion": "0.6.0", "kind": f"{self.driver}/claim", "devices": devices}
        state_files.save(self.cdi_path(uid), json.dumps(spec, indent=1).encode())

    # ---- unprepare -----------------------------------------------------------------------------
    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        out: dict[str, str] = {}
        for c in claims:
            lock = self._claim_locks.setdefault(c.uid, asyncio.Lock())
            async with lock:
                out[c.uid] = await self._unprepare(c)
        await self.publish()
        return out

    async def _unprepare(self, c: ClaimRef) -> str:
        done = self.claims.get(c.uid)
        owner = OWNER_PREFIX + c.uid
        ids = set(done.leases if done is not None else ()) | {r.id for r in self.leases.leases() if r.owner == owner}
        for lid in sorted(ids):
            try:
                await self.leases.release(lid, why=f"released (claim {c.namespace}/{c.name} unprepared)", wait=False)
            except LeaseRefused as e:
                if e.code != "not-found":
                    return str(e)  # busy: the kubelet asks again; nothing was killed
        with contextlib.suppress(FileNotFoundError):
            state_files.remove(self.cdi_path(c.uid))
        if self.metadata_dir is not None:
            shutil.rmtree(os.path.join(self.metadata_dir, f"{c.namespace}_{c.name}"), ignore_errors=True)
        if self.claims.pop(c.uid, None) is not None:
            self._save()
        return ""

    def status(self) -> dict[str, Any]:
        """What `gpudctl status --kube` shows: the pool published and the claims prepared."""
        pub = self.published
        return {"driver": self.driver, "node": self.node, "generation": self.generation,
                "slices": len(pub.slices) if pub else 0, "devices": len(pub.devices) if pub else 0,
                "claims": [{"uid": uid, "claim": f"{c.namespace}/{c.name}", "devices": [d.device for d in c.devices],
                            "leases": list(c.leases)} for uid, c in sorted(self.claims.items())]}
