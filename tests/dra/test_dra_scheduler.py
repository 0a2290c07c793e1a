"""gpud's DRA driver against a real kube-apiserver and kube-scheduler (v1.36.3) on simulated nodes.

The scheduler allocates from the slices gpud publishes; the kubelet's side is a client of the
generated gRPC code (gpud.kube_proto) on gpud's plugin sockets; what a prepare made is read from
the simulator's own state file (tests/leases/rig.sim_gis), never from gpud.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gpud.engine.dra.driver import DraDriver
from gpud.host.kube.kubelet_plugin import KubeletPlugin
from gpud.model import Placement
from gpud.plan.dra_slices import DEFAULT_DRIVER
from gpud.sim import state as simstate
from tests.dra.cluster import DraCluster, skips
from tests.leases.rig import dynamic_rig, restarted, sim_gis
from tests.support.dra_kubelet import GPU, MIG, Kubelet, profile_is
from tests.support.present import present
from tests.support.simrig import SimRig

if TYPE_CHECKING:
    from gpud.host.kube.dra_api import DraApi

pytestmark = skips()


class SimNode:
    """One simulated node: gpud's reconciler and lease engine (a SimRig), its DRA driver publishing
    to the real API server, its kubelet plugin serving on sockets under `root`."""

    def __init__(self, tmp: Path, cluster: DraCluster, name: str) -> None:
        self.tmp, self.cluster, self.name = tmp, cluster, name
        # the kubelet's sockets live here: pytest's tmp_path can outgrow a Unix socket path (107 bytes)
        self.kubelet = Path(tempfile.mkdtemp(prefix="kubelet.", dir="/tmp"))
        self.rig: SimRig | None = None
        self.driver: DraDriver | None = None
        self.plugin: KubeletPlugin | None = None
        self.api: DraApi | None = None

    async def start(self, gpus: tuple[str, ...] = ("h100-80gb:1",), layout: str | None = None) -> SimNode:
        from gpud.host.kube.dra_api import DraApi
        from gpud.host.kube.node_api import load_config

        self.cluster.node(self.name)
        if layout is None:
            self.rig = await dynamic_rig(self.tmp, gpus)
        else:
            rig = self.rig = SimRig(self.tmp, gpus, state_dir=str(self.tmp / "state"))
            assert await rig.apply(layout)
            await rig.rec.leases.start()
        self.api = DraApi(self.name, DEFAULT_DRIVER, load_config(self.cluster.kubeconfig(self.tmp / "gpud.kubeconfig")))
        await self.boot()
        return self

    async def boot(self) -> None:
        assert self.rig is not None and self.api is not None
        self.driver = DraDriver(self.api, self.rig.rec.leases, self.rig.rec.view, state_dir=str(self.tmp / "state"),
                                cdi_dir=str(self.tmp / "cdi"), metadata_dir=str(self.tmp / "meta"),
                                refresh=self.rig.rec.refresh_async)
        await self.driver.start()
        await self.driver.publish()
        self.plugin = KubeletPlugin(DEFAULT_DRIVER, self.driver, root=str(self.kubelet))
        await self.plugin.start()

    async def close(self) -> None:
        if self.plugin is not None:
            await self.plugin.stop()
        if self.api is not None:
            await self.api.withdraw()
            await self.api.close()
        if self.rig is not None:
            self.rig.close()
        shutil.rmtree(self.kubelet, ignore_errors=True)

    def placement(self, results: list[dict]) -> Placement:
        assert self.driver is not None and self.driver.published is not None
        (r,) = results
        sd = self.driver.published.devices[r["device"]]
        assert r["pool"] == self.name and r["driver"] == DEFAULT_DRIVER and sd.placement is not None
        return sd.placement


@pytest.fixture
async def node(tmp_path, cluster, request):
    n = await SimNode(tmp_path, cluster, request.node.name.replace("_", "-")[:40].strip("-").lower()).start()
    yield n
    await n.close()


async def test_seven_1g_claims_get_seven_placements_and_an_eighth_stays_unallocated(cluster, node):
    ns = node.name[:20]
    for i in range(8):
        cluster.claim(f"{ns}-c{i}", MIG, profile_is("1g.10gb"))
        cluster.pod(f"{ns}-p{i}", f"{ns}-c{i}", node=node.name)

    def outcome():
        done, waiting = {}, []
        for i in range(8):
            alloc = (cluster.get_claim(f"{ns}-c{i}").get("status") or {}).get("allocation")
            if alloc:
                done[i] = alloc["devices"]["results"]
                continue
            conds = (cluster.get_pod(f"{ns}-p{i}").get("status") or {}).get("conditions") or ()
            if any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conds):
                waiting.append(i)
        return (done, waiting) if len(done) + len(waiting) == 8 else None

    done, waiting = cluster.wait("every pod scheduled or found unschedulable", outcome, limit=90)
    assert len(done) == 7 and len(waiting) == 1
    placements = {node.placement(r) for r in done.values()}
    assert placements == {Placement(s, 1) for s in range(7)}


async def test_whole_gpu_stays_unallocated_while_a_mig_claim_holds_it(cluster, node):
    ns = node.name[:20]
    cluster.claim(f"{ns}-mig", MIG, profile_is("3g.40gb"))
    cluster.pod(f"{ns}-mig", f"{ns}-mig", node=node.name)
    mig = cluster.allocated(f"{ns}-mig")
    assert node.placement(mig).size == 4
    cluster.claim(f"{ns}-whole", GPU)
    cluster.pod(f"{ns}-whole", f"{ns}-whole", node=node.name)
    assert cluster.unschedulable(f"{ns}-whole")
    assert (cluster.get_claim(f"{ns}-whole").get("status") or {}).get("allocation") is None


async def test_prepare_makes_the_allocated_placement_and_unprepare_destroys_it(cluster, node):
    ns = node.name[:20]
    kubelet = Kubelet(present(node.plugin))
    try:
        info = await kubelet.register()
        assert (info.type, info.name, info.endpoint) == ("DRAPlugin", DEFAULT_DRIVER, node.plugin.dra_socket)
        assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
        assert node.plugin.registered is True

        cluster.claim(f"{ns}-a", MIG, profile_is("1g.10gb"))
        cluster.pod(f"{ns}-a", f"{ns}-a", node=node.name, containers=2)  # one claim, two containers
        at = node.placement(cluster.allocated(f"{ns}-a"))
        claim = cluster.get_claim(f"{ns}-a")
        assert sim_gis(node.rig) == []  # allocation alone makes nothing

        got = await kubelet.prepare(claim)
        assert got.error == ""
        gis = sim_gis(node.rig)
        assert [(name, pl) for name, pl, _ in gis] == [("1g.10gb", at)]
        (dev,) = got.devices
        uid = claim["metadata"]["uid"]
        assert list(dev.cdi_device_ids) == [f"{DEFAULT_DRIVER}/claim={uid}-{dev.device_name}"]
        spec = (node.tmp / "cdi" / f"{DEFAULT_DRIVER}-claim_{uid}.json").read_text()
        assert gis[0][2][0] in spec  # the MIG device's UUID, from the simulator's state file

        # KEP-5304's device metadata, mounted where KubeVirt's virt-launcher reads it, holding the
        # device's attributes as the server stores them in the slice
        (mount,) = json.loads(spec)["devices"][0]["containerEdits"]["mounts"]
        name = claim["metadata"]["name"]
        assert mount["containerPath"] == (f"/var/run/kubernetes.io/dra-device-attributes/resourceclaims/{name}/gpu/"
                                          f"{DEFAULT_DRIVER}-metadata.json") and mount["options"] == ["ro", "bind"]
        meta = json.loads(Path(mount["hostPath"]).read_text())
        assert (meta["apiVersion"], meta["kind"]) == ("metadata.resource.k8s.io/v1alpha1", "DeviceMetadata")
        assert (meta["metadata"]["name"], meta["metadata"]["uid"]) == (name, uid)
        ((req,),) = [meta["requests"]]
        on_server = next(d for s in cluster.slices(node.name) for d in s["spec"].get("devices") or ()
                         if d["name"] == dev.device_name)
        assert req["name"] == "gpu" and req["devices"] == [{"driver": DEFAULT_DRIVER, "pool": node.name,
                                                            "name": dev.device_name,
                                                            "attributes": on_server["attributes"]}]

        again = await kubelet.prepare(claim)  # the second container, or a kubelet retry: prepared once
        assert list(again.devices) == list(got.devices) and len(sim_gis(node.rig)) == 1

        assert (await kubelet.unprepare(claim)).error == ""
        assert sim_gis(node.rig) == []
        assert not (node.tmp / "cdi" / f"{DEFAULT_DRIVER}-claim_{uid}.json").exists()
        assert not Path(mount["hostPath"]).exists()
    finally:
        await kubelet.close()


async def test_a_claim_survives_a_gpud_restart_between_prepare_and_unprepare(cluster, node):
    ns = node.name[:20]
    cluster.claim(f"{ns}-r", MIG, profile_is("3g.40gb"))
    cluster.pod(f"{ns}-r", f"{ns}-r", node=node.name)
    at = node.placement(cluster.allocated(f"{ns}-r"))
    claim = cluster.get_claim(f"{ns}-r")
    kubelet = Kubelet(present(node.plugin))
    got = await kubelet.prepare(claim)
    assert got.error == ""
    await kubelet.close()
    # a new gpud process: its own NVML session, reconciler and lease records read from the state dir
    await node.plugin.stop()
    await restarted(node.rig, node.tmp)
    await node.boot()
    kubelet = Kubelet(present(node.plugin))
    try:
        assert list((await kubelet.prepare(claim)).devices) == list(got.devices)  # from the checkpoint
        assert [(n, pl) for n, pl, _ in sim_gis(node.rig)] == [("3g.40gb", at)]
        assert (await kubelet.unprepare(claim)).error == ""
        assert sim_gis(node.rig) == []
    finally:
        await kubelet.close()


PASSTHROUGH = """version: v1
layouts:
  d:
    - devices: all
      workload: vm-passthrough
"""


async def test_a_vfio_claim_is_handed_the_whole_iommu_group(cluster, tmp_path):
    node = await SimNode(tmp_path, cluster, "vfio-node").start(("rtx6000-ada:1",), PASSTHROUGH)
    kubelet = Kubelet(present(node.plugin))
    try:
        cluster.claim("vm-gpu", "vfio.gpud.io")
        cluster.pod("vm", "vm-gpu", node=node.name)
        (r,) = cluster.allocated("vm-gpu")
        assert r["device"].endswith("-vfio")
        claim = cluster.get_claim("vm-gpu")
        got = await kubelet.prepare(claim)
        assert got.error == ""
        spec = json.loads((node.tmp / "cdi" / f"{DEFAULT_DRIVER}-claim_{claim['metadata']['uid']}.json").read_text())
        (dev,) = spec["devices"]
        # the group as the simulated kernel lists it: sys/kernel/iommu_groups/<n>/devices
        groups = present(node.rig).dir / "sys" / "kernel" / "iommu_groups"
        (group,) = [g for g in groups.iterdir() if (g / "devices" / present(present(node.driver).published).devices[r["device"]].pci).exists()]
        members = sorted(p.name for p in (group / "devices").iterdir())
        assert len(members) == 2  # the GPU and its HD-audio function
        assert {"path": f"/dev/vfio/{group.name}"} in dev["containerEdits"]["deviceNodes"]
        listed = next(e for e in dev["containerEdits"]["env"] if e.startswith("PCI_RESOURCE_GPUD_IO="))
        assert sorted(listed.split("=", 1)[1].split(",")) == members
        assert (await kubelet.unprepare(claim)).error == ""
    finally:
        await kubelet.close()
        await node.close()


async def test_a_placement_overlapping_an_allocated_one_is_never_allocated(cluster, node):
    """A 4g.40gb holds memory slices 0-3; a 1g.10gb asked inside them stays unallocated although
    every sum (compute, multiprocessors, memory) would fit; one asked beside them is allocated."""
    ns = node.name[:20]
    cluster.claim(f"{ns}-4g", MIG, profile_is("4g.40gb"))
    cluster.pod(f"{ns}-4g", f"{ns}-4g", node=node.name)
    assert node.placement(cluster.allocated(f"{ns}-4g")) == Placement(0, 4)
    inside = f"{profile_is('1g.10gb')} && device.attributes['{DEFAULT_DRIVER}'].placementStart < 4"
    cluster.claim(f"{ns}-in", MIG, inside)
    cluster.pod(f"{ns}-in", f"{ns}-in", node=node.name)
    assert cluster.unschedulable(f"{ns}-in")
    beside = f"{profile_is('1g.10gb')} && device.attributes['{DEFAULT_DRIVER}'].placementStart >= 4"
    cluster.claim(f"{ns}-out", MIG, beside)
    cluster.pod(f"{ns}-out", f"{ns}-out", node=node.name)
    assert node.placement(cluster.allocated(f"{ns}-out")).start >= 4


async def test_the_seed_layout_is_reachable_through_claims_and_prepared(cluster, node):
    """3g.40gb at slice 4 (a claim may select the placement attribute), then four 1g.10gb:
    allocated by the scheduler, prepared by gpud; the simulator's state file then holds the seed's
    layout."""
    ns = node.name[:20]
    names = [f"{ns}-3g"] + [f"{ns}-1g{i}" for i in range(4)]
    kubelet = Kubelet(present(node.plugin))
    try:
        for name in names:
            cel = (f"{profile_is('3g.40gb')} && device.attributes['{DEFAULT_DRIVER}'].placementStart == 4"
                   if name.endswith("3g") else profile_is("1g.10gb"))
            cluster.claim(name, MIG, cel)
            cluster.pod(name, name, node=node.name)
            cluster.allocated(name)
            assert (await kubelet.prepare(cluster.get_claim(name))).error == ""
        made = sorted(name for name, _, _ in sim_gis(node.rig))
        assert made == ["1g.10gb"] * 4 + ["3g.40gb"]
        for name in names:
            assert (await kubelet.unprepare(cluster.get_claim(name))).error == ""
        assert sim_gis(node.rig) == []
    finally:
        await kubelet.close()


async def test_unprepare_of_a_busy_claim_is_refused_and_nothing_is_killed(cluster, node):
    """A process still on the claim's MIG device: unprepare answers an error (the kubelet asks
    again), the instance and the process stay; once the process is gone, unprepare destroys it.
    Holder and instance are the simulator's own records."""
    from gpud.sim import cli as simcli

    ns = node.name[:20]
    cluster.claim(f"{ns}-b", MIG, profile_is("2g.20gb"))
    cluster.pod(f"{ns}-b", f"{ns}-b", node=node.name)
    at = node.placement(cluster.allocated(f"{ns}-b"))
    claim = cluster.get_claim(f"{ns}-b")
    kubelet = Kubelet(present(node.plugin))
    try:
        assert (await kubelet.prepare(claim)).error == ""
        ((_, _, (mig_uuid,)),) = sim_gis(node.rig)
        simcli.hold(node.rig.dir, mig_uuid, 4242, "trainer")
        got = await kubelet.unprepare(claim)
        assert got.error and "4242" in got.error, got.error
        assert [(n, pl) for n, pl, _ in sim_gis(node.rig)] == [("2g.20gb", at)]
        assert any(p.pid == 4242 for p in simstate.load(node.rig.dir).processes)
        simcli.release(node.rig.dir, mig_uuid, 4242)
        assert (await kubelet.unprepare(claim)).error == ""
        assert sim_gis(node.rig) == []
    finally:
        await kubelet.close()


STATIC_AND_WHOLE = """version: v1
layouts:
  d:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"3g.40gb": 2}
    - devices: [1]
      mig-enabled: false
"""


async def test_static_mig_and_whole_gpus_are_prepared_without_making_anything(cluster, tmp_path):
    """A static MIG device and a whole GPU exist already: prepare creates and destroys nothing
    (the simulator's state file before and after) and hands over what the simulator says they
    are: the MIG device's UUID, the GPU's UUID and its /dev/nvidia<minor>."""
    node = await SimNode(tmp_path, cluster, "static-node").start(("h100-80gb:2",), STATIC_AND_WHOLE)
    kubelet = Kubelet(present(node.plugin))
    try:
        before = simstate.load(present(node.rig).dir)
        whole_pci = sorted(before.gpus)[1]
        cluster.claim("static-mig", MIG, profile_is("3g.40gb"))
        cluster.pod("static-mig", "static-mig", node=node.name)
        cluster.claim("whole", GPU)
        cluster.pod("whole", "whole", node=node.name)
        cluster.allocated("static-mig")
        cluster.allocated("whole")
        got = {}
        for name in ("static-mig", "whole"):
            claim = cluster.get_claim(name)
            assert (await kubelet.prepare(claim)).error == ""
            got[name] = json.loads((node.tmp / "cdi" / f"{DEFAULT_DRIVER}-claim_{claim['metadata']['uid']}.json")
                                   .read_text())["devices"][0]["containerEdits"]
        after = simstate.load(present(node.rig).dir)
        assert after.gpus == before.gpus  # nothing created or destroyed
        mig_uuids = {ci.uuid for gi in after.gpus[sorted(after.gpus)[0]].gis for ci in gi.cis}
        (env,) = [e for e in got["static-mig"]["env"] if e.startswith("NVIDIA_VISIBLE_DEVICES=")]
        assert env.split("=", 1)[1] in mig_uuids and len(mig_uuids) == 2
        whole = after.gpus[whole_pci]
        assert f"NVIDIA_VISIBLE_DEVICES={whole.uuid}" in got["whole"]["env"]
        assert {"path": f"/dev/nvidia{whole.minor}"} in got["whole"]["deviceNodes"]
        for name in ("static-mig", "whole"):
            assert (await kubelet.unprepare(cluster.get_claim(name))).error == ""
        assert simstate.load(present(node.rig).dir).gpus == before.gpus
    finally:
        await kubelet.close()
        await node.close()


async def test_unprepare_never_touches_an_instance_made_outside_kubernetes(cluster, node):
    """A lease made outside Kubernetes beside a claim's instance on one GPU: the claim's
    unprepare destroys its own instance only."""
    ns = node.name[:20]
    outside = await node.rig.rec.leases.lease("3g.40gb", start=4, owner="job")
    await node.driver.publish()
    cluster.claim(f"{ns}-own", MIG, profile_is("1g.10gb"))
    cluster.pod(f"{ns}-own", f"{ns}-own", node=node.name)
    at = node.placement(cluster.allocated(f"{ns}-own"))
    assert not at.slices & {4, 5, 6, 7}  # what the lease holds was never offered
    claim = cluster.get_claim(f"{ns}-own")
    kubelet = Kubelet(present(node.plugin))
    try:
        assert (await kubelet.prepare(claim)).error == ""
        assert sorted((n, pl) for n, pl, _ in sim_gis(node.rig)) == sorted(
            [("1g.10gb", at), ("3g.40gb", Placement(4, 4))])
        assert (await kubelet.unprepare(claim)).error == ""
        assert [(n, pl) for n, pl, _ in sim_gis(node.rig)] == [("3g.40gb", Placement(4, 4))]
        assert outside.id in {r.id for r in node.rig.rec.leases.leases()}
    finally:
        await kubelet.close()


async def test_a_vfio_claim_is_refused_while_its_group_is_not_all_on_vfio_pci(cluster, tmp_path):
    """The layout binds the IOMMU group, a claim never does: with the GPU's audio function taken
    off vfio-pci after allocation, prepare answers an error naming it, writes no CDI spec and
    binds nothing (the simulator's state file)."""
    node = await SimNode(tmp_path, cluster, "vfio-off-node").start(("rtx6000-ada:1",), PASSTHROUGH)
    kubelet = Kubelet(present(node.plugin))
    try:
        cluster.claim("vm-gpu-off", "vfio.gpud.io")
        cluster.pod("vm-off", "vm-gpu-off", node=node.name)
        cluster.allocated("vm-gpu-off")
        claim = cluster.get_claim("vm-gpu-off")
        (gpu_pci,) = simstate.load(present(node.rig).dir).gpus
        audio = next(a for a, f in simstate.load(present(node.rig).dir).functions.items()
                     if a != gpu_pci and a.rsplit(".", 1)[0] == gpu_pci.rsplit(".", 1)[0])
        present(node.rig).hw.sysfs.write("bus/pci/drivers/vfio-pci/unbind", audio)
        await present(node.rig).rec.refresh_async()
        got = await kubelet.prepare(claim)
        assert audio in got.error and "not on vfio-pci" in got.error, got.error
        assert not (node.tmp / "cdi" / f"{DEFAULT_DRIVER}-claim_{claim['metadata']['uid']}.json").exists()
        assert simstate.load(present(node.rig).dir).functions[audio].driver is None
    finally:
        await kubelet.close()
        await node.close()


async def test_an_instance_made_behind_gpud_leaves_the_pool_once_a_prepare_meets_it(cluster, node):
    """Someone's `nvidia-smi mig -cgi` raises no event gpud hears: the pool still offers that
    placement and the scheduler may allocate it. Prepare then makes nothing (NVML refuses the
    overlap), answers an error, reads the hardware again and republishes without it."""
    from tests.leases.rig import foreign_gi

    ns = node.name[:20]
    at = f"device.attributes['{DEFAULT_DRIVER}'].placementStart"
    kubelet = Kubelet(node.plugin)
    try:
        # a claim's instance at 0 first: MIG on (it follows the leases), as another tool needs it
        cluster.claim(f"{ns}-a", MIG, f"{profile_is('1g.10gb')} && {at} == 0")
        cluster.pod(f"{ns}-a", f"{ns}-a", node=node.name)
        cluster.allocated(f"{ns}-a")
        assert (await kubelet.prepare(cluster.get_claim(f"{ns}-a"))).error == ""
        foreign_gi(node.rig, "3g.40gb", 4)
        cluster.claim(f"{ns}-x", MIG, f"{profile_is('1g.10gb')} && {at} == 4")
        cluster.pod(f"{ns}-x", f"{ns}-x", node=node.name)
        assert node.placement(cluster.allocated(f"{ns}-x")) == Placement(4, 1)
        got = await kubelet.prepare(cluster.get_claim(f"{ns}-x"))
        assert got.error
        # nothing made
        assert sorted((n, pl) for n, pl, _ in sim_gis(node.rig)) == [("1g.10gb", Placement(0, 1)),
                                                                    ("3g.40gb", Placement(4, 4))]
    finally:
        await kubelet.close()
    slices = cluster.watch_slices(node.name, lambda s: "gpu-0" not in {d["name"] for x in s
                                                                         for d in x["spec"].get("devices") or ()})
    starts = {d["attributes"]["placementStart"]["int"] for x in slices for d in x["spec"].get("devices") or ()
              if "placementStart" in d["attributes"]}
    assert starts and not starts & {4, 5, 6}
