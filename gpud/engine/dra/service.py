"""`gpud --kube-node NODE --dra`: the DRA driver wired into the daemon.

Republishes the pool after every change the engine makes or hears of (a pass, a lease, a device
event: the engine's change callback), coalesced so a burst costs one publish, and when the pool's
slices are changed or deleted by someone else (a watch on them: at rest no request is made but
that open watch). Its client libraries (lightkube, grpcio) are imported only here.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from gpud.engine.boot.rebuild import boot_id
from gpud.engine.dra.driver import DEFAULT_CDI_DIR, DraDriver
from gpud.engine.dra.health import XID_FILE, XidHealth
from gpud.engine.engine import Engine
from gpud.engine.events import EventBus
from gpud.host.kernel.kmsg import follow, parse_xid
from gpud.host.kernel.sysfs import pcie_root
from gpud.host.nvidia.nvml import NvmlError
from gpud.plan.dra_slices import NVIDIA_DRIVER

if TYPE_CHECKING:  # imported with --dra only (they need gpud[dra])
    from gpud.host.kube.dra_api import DraApi
    from gpud.host.kube.kubelet_plugin import KubeletPlugin

log = logging.getLogger(__name__)


class DraService:
    def __init__(self, engine: Engine, bus: EventBus, *, node: str, driver: str, kubelet_root: str,
                 kubeconfig: str | None, state_dir: str | None, cdi_dir: str | None, root: str | None,
                 boot_id_path: str | None = None) -> None:
        """`state_dir` None: no checkpoint (read-only); `root`: the simulated host's directory."""
        self.engine, self.bus = engine, bus
        self.node, self.name, self.kubelet_root, self.kubeconfig = node, driver, kubelet_root, kubeconfig
        self.state_dir = state_dir
        self.cdi_dir = cdi_dir or (os.path.join(root, DEFAULT_CDI_DIR.lstrip("/")) if root else DEFAULT_CDI_DIR)
        self.sys_root = os.path.join(root, "sys") if root else "/sys"
        self.kmsg = os.path.join(root, "dev", "kmsg") if root else "/dev/kmsg"
        self.health = XidHealth(os.path.join(state_dir, XID_FILE) if state_dir else None, boot_id(boot_id_path))
        self.driver: DraDriver | None = None
        self.plugin: KubeletPlugin | None = None
        self.api: DraApi | None = None
        self._dirty = asyncio.Event()

    async def start(self) -> None:
        try:
            from gpud.host.kube.dra_api import DraApi
            from gpud.host.kube.kubelet_plugin import KubeletPlugin, ProtoMissing, other_plugin_registered, paths, proto
            from gpud.host.kube.node_api import KubeError, load_config
        except ImportError as e:
            raise RuntimeError(f"--dra needs the DRA client libraries: pip install 'gpud[dra]' ({e})") from e
        try:
            proto()
        except ProtoMissing as e:
            raise RuntimeError(f"--dra: {e}") from e
        name, root = self.name, self.kubelet_root
        if name == NVIDIA_DRIVER:
            other = other_plugin_registered(root, name, paths(root, name)[0])
            if other is not None:
                raise RuntimeError(f"--dra-driver {name}: NVIDIA's DRA kubelet plugin is registered on this node "
                                   f"({other}); two drivers of one name would hand out the same GPUs. Remove NVIDIA's "
                                   "plugin (its DaemonSet) or publish under gpud's own name")
        try:
            self.api = DraApi(self.node, name, load_config(self.kubeconfig))
        except KubeError as e:
            raise RuntimeError(f"--dra: {e}") from e
        self.driver = DraDriver(self.api, self.engine.leases, lambda: self.engine.view,
                                state_dir=self.state_dir,
                                cdi_dir=self.cdi_dir, driver_version=self._driver_version,
                                cuda_version=self._cuda_version,
                                pcie_root=self._pcie_root, taints=self._taints, refresh=self.engine.refresh,
                                metadata_dir=os.path.join(os.path.dirname(paths(root, name)[1]), "dra-device-metadata"))
        for message in await self.driver.start():
            self.bus.publish("dra", message)
        self.plugin = KubeletPlugin(name, self.driver, root=root)
        await self.plugin.start()
        self.engine.subscribe(self._dirty.set)
        self._dirty.set()

    def _taints(self) -> Mapping[str, tuple[dict, ...]]:
        for m in self.health.observe(self.engine.view.observation.gpus):
            self.bus.publish("dra", f"GPU {m.pci}: initialised afresh since its Xid {m.code}; its devices are "
                             "offered untainted again")
        return self.health.taints(self.name)

    async def _follow_xids(self) -> None:
        """The nvidia driver's Xid reports, as the kernel logs them: each marks its GPU's devices."""
        try:
            async for text in follow(self.kmsg):
                xid = parse_xid(text)
                if xid is None:
                    continue
                mark = self.health.record(xid, self.engine.view.observation.gpus)
                if mark is not None:
                    what = "not scheduled" if mark.fatal else "marked (an application's error)"
                    self.bus.publish("dra", f"GPU {mark.pci}: Xid {mark.code} ({mark.text}): its devices are "
                                     f"tainted {self.name}/xid={mark.code} and {what} until the GPU is "
                                     "initialised afresh")
                    self._dirty.set()
        except OSError as e:
            self.bus.publish("dra", f"{self.kmsg}: {e.strerror or e}: Xids are not followed, GPU health is "
                             "not published")

    def _pcie_root(self, pci: str) -> str | None:
        """The GPU's root complex; None (the attribute left out) where sysfs does not say."""
        try:
            return pcie_root(pci, self.sys_root)
        except ValueError as e:
            log.debug("DRA: no pcieRoot for %s: %s", pci, e)
            return None

    def _cuda_version(self) -> int | None:
        try:
            return self.engine.versions.cuda()
        except NvmlError:
            return None

    def _driver_version(self) -> str | None:
        try:
            return self.engine.versions.driver()
        except NvmlError:
            return None

    async def run(self) -> None:
        """Publish after each change; watch the pool so others' changes are put right."""
        assert self.api is not None
        watch = asyncio.create_task(self._watch(), name="dra-watch")
        xids = asyncio.create_task(self._follow_xids(), name="dra-xids")
        try:
            while True:
                await self._dirty.wait()
                self._dirty.clear()
                await self._publish()
        finally:
            watch.cancel()
            xids.cancel()

    async def _publish(self) -> None:
        from gpud.host.kube.node_api import KubeError

        assert self.driver is not None
        try:
            writes = await self.driver.publish()
        except KubeError as e:
            self.bus.publish("dra", f"publishing the node's ResourceSlices failed: {e}")
            await asyncio.sleep(1.0)  # the API server is away: the next change or this retry republishes
            self._dirty.set()
            return
        if writes:
            log.info("DRA: %d slice write(s), pool generation %d", writes, self.driver.generation)

    async def _watch(self) -> None:
        from gpud.host.kube.node_api import KubeError

        assert self.api is not None and self.driver is not None
        while True:
            try:
                _, rv = await self.api.slices()
                async for kind, _name in self.api.watch_slices(rv):
                    if kind in ("DELETED", "MODIFIED"):
                        self.driver.published = None  # compare with the server again
                        self._dirty.set()
            except KubeError as e:
                log.warning("DRA: watching the node's slices: %s", e)
                await asyncio.sleep(1.0)

    def status(self) -> dict | None:
        """The driver's state for `gpudctl status --kube` (None before it started)."""
        if self.driver is None:
            return None
        out = self.driver.status()
        out["registered"] = self.plugin.registered if self.plugin is not None else None
        out["xids"] = [{"pci": m.pci, "xid": m.code, "effect": "NoSchedule" if m.fatal else "None", "text": m.text}
                       for m in sorted(self.health.marks.values(), key=lambda m: m.pci)]
        out["taints_dropped"] = self.api.taints_dropped if self.api is not None else False
        return out

    async def stop(self) -> None:
        if self.plugin is not None:
            await self.plugin.stop()
        if self.api is not None:
            await self.api.close()
