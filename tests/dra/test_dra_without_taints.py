"""A kube-apiserver without device taints (DRADeviceTaints off: alpha and off in 1.33-1.35, here
v1.36.3 with the gate turned off) drops a device's `taints` silently; gpud must notice and keep
the unhealthy GPU from being scheduled another way."""

from __future__ import annotations

from gpud.engine.dra.driver import DraDriver
from gpud.engine.dra.health import XidHealth
from gpud.host.kernel.kmsg import parse_xid
from gpud.host.kube.dra_api import DraApi
from gpud.host.kube.node_api import load_config
from tests.dra.cluster import DraCluster, skips
from tests.leases.rig import dynamic_rig
from tests.support.present import present

pytestmark = skips()


async def test_a_server_without_device_taints_gets_the_gpu_withdrawn(tmp_path):
    """kube-apiserver v1.36.3 with DRADeviceTaints off drops `taints` silently: gpud sees the
    stored slice without them and withdraws the devices of the GPU with a fatal Xid instead (as
    the server stores the pool), keeping the other GPU's; nothing is rewritten at rest."""
    (tmp_path / "c").mkdir()
    cluster = DraCluster(tmp_path / "c", server_args=("--feature-gates=DRADeviceTaints=false",)).start()
    rig = None
    api = None
    try:
        cluster.node("no-taints")
        rig = await dynamic_rig(tmp_path, ("h100-80gb:2",))
        bad, good = sorted(g.pci for g in rig.rec.view().observation.gpus)
        health = XidHealth()
        health.record(present(parse_xid(f"NVRM: Xid (PCI:{bad.rsplit('.', 1)[0]}): 79, x")),
                      rig.rec.view().observation.gpus)
        api = DraApi("no-taints", "gpu.gpud.io", load_config(cluster.kubeconfig(tmp_path / "k")))
        driver = DraDriver(api, rig.rec.leases, rig.rec.view, state_dir=None, cdi_dir=str(tmp_path / "cdi"),
                           taints=lambda: health.taints("gpu.gpud.io"))
        await driver.publish()
        assert api.taints_dropped
        stored = [d for s in cluster.slices("no-taints") for d in s["spec"].get("devices") or ()]
        assert stored and not any(d.get("taints") for d in stored)
        pcis = {d["attributes"]["resource.kubernetes.io/pciBusID"]["string"] for d in stored}
        assert pcis == {good}
        assert await driver.publish() == 0 and await api.publish(present(driver.published).slices) == 0
    finally:
        if api is not None:
            await api.close()
        if rig is not None:
            rig.close()
        cluster.stop()
