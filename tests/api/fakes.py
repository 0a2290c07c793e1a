"""A fake gpud handler with realistic replies (an H200 host), and a server running in a thread
so that blocking clients (gpudctl subprocesses) can be tested against it."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from typing import Any

from gpud.api.peers import Peer
from gpud.api.server import ApiError, ApiServer, serve
from gpud.wire import replies as wire_replies
from gpud.wire import tables as wire_tables

P = wire_replies.Placement
H = wire_replies.HolderInfo

GPU0_UUID = "GPU-d187104d-6f24-f22c-6f22-72835236781d"
MIG_UUIDS = [f"MIG-0b7d1c2e-0000-5000-8000-00000000000{i}" for i in range(8)]


def status_reply() -> wire_replies.StatusReply:
    small = [
        wire_replies.InstanceStatus(profile="1g.18gb", placement=P(start=s, size=1), gi=7 + s, ci=0, uuid=MIG_UUIDS[s])
        for s in range(4, 7)
    ] + [wire_replies.InstanceStatus(profile="1g.18gb", placement=P(start=3, size=1), gi=10, ci=0, uuid=MIG_UUIDS[3],
                                     holders=[H(pid=777, name="trainer", device=MIG_UUIDS[3])])]
    big = wire_replies.InstanceStatus(profile="3g.71gb", placement=P(start=0, size=4), gi=2, ci=0, uuid=MIG_UUIDS[0])
    gpu0 = wire_replies.GpuStatus(
        index=0, pci="0000:3b:00.0", uuid=GPU0_UUID, model="NVIDIA H200", pci_id="10de:2335",
        driver="nvidia", workload="container", iommu_group=17, numa_node=0,
        mig=wire_replies.MigStatus(capable=True, mode="enabled", instances=[*small, big]),
        converged=True, state="converged",
        group=[wire_replies.GroupMember(pci="0000:3b:00.0", driver="nvidia", class_="0x030200")],
    )
    gpu1 = wire_replies.GpuStatus(
        index=1, pci="0000:5c:00.0", uuid="GPU-11111111-2222-3333-4444-555555555555", model="NVIDIA H200",
        pci_id="10de:2335", driver="nvidia", workload="vm-passthrough", iommu_group=42, numa_node=1,
        mig=wire_replies.MigStatus(capable=True, mode="disabled"), converged=False, state="waiting",
        message="waiting for holders of /dev/nvidia1",
        holders=[H(pid=4121, name="python", device="/dev/nvidia1")],
        group=[wire_replies.GroupMember(pci="0000:5c:00.0", driver="nvidia", class_="0x030200")],
    )
    gpu2 = wire_replies.GpuStatus(
        index=2, pci="0000:9a:00.0", model="NVIDIA H200", pci_id="10de:2335", driver="vfio-pci",
        workload="vm-passthrough", iommu_group=88, numa_node=1,
        mig=wire_replies.MigStatus(capable=True, mode=None), converged=True, state="converged",
        vfio_device="/dev/vfio/88",
    )
    return wire_replies.StatusReply(
        phase="waiting",
        layout=wire_replies.LayoutStatus(path="/etc/gpud/layout.yaml", selected="partial-mig", valid=True,
                                         warnings=["/etc/gpud/layout.yaml:9 layouts.partial-mig[1]: matches no GPU"]),
        gpus=[gpu0, gpu1, gpu2], read_only=False, version="0.1.0",
    )


def h200_profiles() -> list[wire_tables.ProfileInfo]:
    rows = [  # id, name, count, MiB, SMs, dec, enc, ce, jpg, ofa, starts, size
        (19, "1g.18gb", 7, 16384, 16, 1, 0, 1, 1, 0, [0, 1, 2, 3, 4, 5, 6], 1),
        (20, "1g.18gb+me", 1, 16384, 16, 1, 0, 1, 1, 1, [0, 1, 2, 3, 4, 5, 6], 1),
        (15, "1g.35gb", 4, 33280, 26, 1, 0, 1, 1, 0, [0, 2, 4, 6], 2),
        (14, "2g.35gb", 3, 33280, 32, 2, 0, 2, 2, 0, [0, 2, 4], 2),
        (9, "3g.71gb", 2, 71424, 60, 3, 0, 3, 3, 0, [0, 4], 4),
        (5, "4g.71gb", 1, 71424, 64, 4, 0, 4, 4, 0, [0], 4),
        (0, "7g.141gb", 1, 143360, 132, 7, 0, 8, 7, 1, [0], 8),
    ]
    return [
        wire_tables.ProfileInfo(id=i, name=n, memory_mb=m, sms=sm, slices=int(n[0]), free=c, total=c,
                                 placements=[P(start=s, size=z) for s in st], ce=ce, dec=dec, enc=enc, jpg=j, ofa=o)
        for i, n, c, m, sm, dec, enc, ce, j, o, st, z in rows
    ]


def plan_reply() -> wire_replies.PlanReply:
    return wire_replies.PlanReply(
        gpus=[
            wire_replies.GpuPlanInfo(index=0, pci="0000:3b:00.0", steps=[
                wire_replies.StepInfo(action="destroy-ci", profile="1g.18gb", placement=P(start=6, size=1), gi=13,
                                      ci=0, uuid=MIG_UUIDS[6]),
                wire_replies.StepInfo(action="destroy-gi", profile="1g.18gb", placement=P(start=6, size=1), gi=13),
                wire_replies.StepInfo(action="create-gi", profile="1g.35gb", placement=P(start=6, size=2)),
                wire_replies.StepInfo(action="create-ci", profile="1g.35gb", gi=14, ci=0),
            ]),
            wire_replies.GpuPlanInfo(index=1, pci="0000:5c:00.0", steps=[
                wire_replies.StepInfo(action="set-mig-mode", enabled=True),
                wire_replies.StepInfo(action="reset"),
            ]),
            wire_replies.GpuPlanInfo(index=2, pci="0000:9a:00.0"),
        ],
        disruption=wire_replies.Disruption(
            destroyed=[wire_replies.DestroyedInfo(pci="0000:3b:00.0", profile="1g.18gb", placement=P(start=6, size=1),
                                                  uuid=MIG_UUIDS[6], holders=[H(pid=31337, name="jupyter")])],
            mode_changes=["0000:5c:00.0"], resets=["0000:5c:00.0"],
        ),
    )


class FakeHandler:
    """Records calls; replies from `replies` (value or callable(args)); raises from `errors`.
    Events are dicts like gpud.engine.events.EventBus publishes, fanned out to unbounded queues."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any], Peer]] = []
        self.replies: dict[str, Any] = {
            "status": status_reply(),
            "check": wire_replies.CheckReply(valid=True, selected="partial-mig"),
            "plan": plan_reply(),
            "apply": wire_replies.ApplyReply(phase="converged", converged=True, message="all GPUs converged"),
            "reload": wire_replies.LayoutStatus(path="/etc/gpud/layout.yaml", selected="partial-mig", valid=True),
            "version": wire_replies.VersionReply(version="0.1.0", driver="550.90.07", nvml="12.550.90.07"),
            "mig-profiles": wire_tables.MigProfilesReply(gpus=[wire_tables.GpuProfiles(
                index=0, pci="0000:3b:00.0", model="NVIDIA H200", profiles=h200_profiles())]),
            "passthrough": wire_tables.PassthroughReply(devices=[wire_tables.PassthroughDevice(
                pci="0000:9a:00.0", vendor_device="10de:2335", resource_name="nvidia.com/GH100_H200_SXM_141GB",
                iommu_group=88, vfio_device="/dev/vfio/88", numa_node=1,
                libvirt_hostdev=("<hostdev mode='subsystem' type='pci' managed='no'>\n  <source>\n"
                                 "    <address domain='0x0000' bus='0x9a' slot='0x00' function='0x0'/>\n"
                                 "  </source>\n</hostdev>"),
                kubevirt={"pciVendorSelector": "10DE:2335", "resourceName": "nvidia.com/GH100_H200_SXM_141GB",
                          "externalResourceProvider": True})]),
        }
        self.errors: dict[str, Exception] = {}
        self.history: list[dict[str, Any]] = []
        self.subscribers: set[asyncio.Queue] = set()
        self.unsubscribed = 0
        self.gone = asyncio.Event()  # set when a follower has been unsubscribed

    async def handle(self, op: str, args: dict[str, Any], peer: Peer) -> Any:
        self.calls.append((op, args, peer))
        if op in self.errors:
            raise self.errors[op]
        reply = self.replies[op]
        return reply(args) if callable(reply) else reply

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self.subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self.subscribers.discard(q)
        self.unsubscribed += 1
        self.gone.set()

    def recent_events(self) -> list[dict[str, Any]]:
        return list(self.history)

    def publish(self, kind: str, message: str, gpu: str | None = None, **data: Any) -> dict[str, Any]:
        ev = {"time": time.time(), "kind": kind, "gpu": gpu, "message": message, "data": data}
        self.history.append(ev)
        for q in self.subscribers:
            q.put_nowait(ev)
        return ev


class ThreadedServer:
    """serve() on its own event loop in a thread, for blocking clients."""

    def __init__(self, handler: Any = None, **kwargs: Any) -> None:
        self.handler = handler or FakeHandler()
        self.dir = tempfile.mkdtemp(prefix="gpud-t", dir="/tmp")
        self.path = f"{self.dir}/gpud.sock"
        self.kwargs = kwargs
        self.loop = asyncio.new_event_loop()
        self.server: ApiServer | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.server = self.loop.run_until_complete(serve(self.handler, self.path, **self.kwargs))
        except BaseException as e:  # noqa: BLE001 - surfaced by start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    def start(self) -> ThreadedServer:
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error
        return self

    def call(self, fn: Any, *args: Any) -> Any:
        """Run fn(*args) on the server's loop and return its result."""
        async def run() -> Any:
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def stop(self) -> None:
        if self.server is not None:
            asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def raise_error(code: str, message: str) -> ApiError:
    return ApiError(code, message)
