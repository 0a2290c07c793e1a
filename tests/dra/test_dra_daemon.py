"""A gpud process with `--kube-node NODE --dra` on a simulated host, against the real kube-apiserver
and kube-scheduler (v1.36.3): it publishes its pool, the scheduler allocates from it, the kubelet's
side (the generated gRPC client) prepares and unprepares, and gpud is killed with SIGKILL between
allocation and prepare and between prepare and unprepare. What was made is read from the
simulator's state file."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from pathlib import Path

from gpud.host.kube.kubelet_plugin import paths
from gpud.model import Placement
from gpud.plan.dra_slices import DEFAULT_DRIVER
from gpud.profiles import MODELS
from gpud.sim import gpu_rules
from gpud.sim import state as simstate
from tests.dra.cluster import skips
from tests.leases.rig import dynamic_layout
from tests.support.daemon import Daemon, wait_until
from tests.support.dra_kubelet import MIG, Kubelet, profile_is
from tests.support.pci_oracle import realpath_root
from tests.support.present import present

pytestmark = skips()
NODE = "daemon-node"


def gis(host) -> list[tuple[str, Placement]]:
    """(GI profile name, placement) on the first GPU, from the simulator's state file."""
    state = simstate.load(host)
    g = state.gpus[sorted(state.gpus)[0]]
    model = MODELS[g.model]
    return sorted((present(gpu_rules.profile_of(model, gi.profile_id)).name, Placement(gi.start, gi.size)) for gi in g.gis)


class Plugin:
    """What the kubelet's plugin watcher sees: the sockets under the kubelet root."""

    def __init__(self, root) -> None:
        self.registration_socket, self.dra_socket = paths(str(root), DEFAULT_DRIVER)


def kill_9(d: Daemon) -> None:
    os.kill(d.proc.pid, signal.SIGKILL)
    d.proc.wait(30)


async def test_gpud_killed_between_allocate_prepare_and_unprepare(cluster, tmp_path):
    cluster.node(NODE)
    kubeconfig = cluster.kubeconfig(tmp_path / "gpud.kubeconfig")
    root = tempfile.mkdtemp(prefix="kubelet.", dir="/tmp")  # tmp_path can outgrow a Unix socket path
    d = Daemon(tmp_path, ["h100-80gb:1"], dynamic_layout(), extra_args=[
        "--kube-node", NODE, "--kubeconfig", kubeconfig, "--dra", "--kubelet-root", str(root),
        "--cdi-dir", str(tmp_path / "cdi")])
    try:
        slices = wait_until(lambda: [s for s in cluster.slices(NODE) if s["spec"].get("devices")], 60,
                            "gpud's slices on the API server")
        names = {dev["name"] for s in slices for dev in s["spec"]["devices"]}
        assert "gpu-0" in names and "gpu-0-mig-1g-10gb-0" in names
        # the standard pcieRoot as the server stores it: where the simulated kernel's link leads
        (pci,) = simstate.load(d.host).gpus
        roots = {dev["attributes"]["resource.kubernetes.io/pcieRoot"]["string"]
                 for s in slices for dev in s["spec"]["devices"]}
        assert roots == {realpath_root(Path(d.host) / "sys", pci)}, roots
        # the versions as NVIDIA's driver publishes them, from the simulator's own record
        st = simstate.load(d.host)
        major, rest = divmod(st.cuda_version, 1000)
        versions = {(dev["attributes"]["driverVersion"]["version"], dev["attributes"]["cudaDriverVersion"]["version"])
                    for s in slices for dev in s["spec"]["devices"]}
        assert versions == {(".".join(str(int(p)) for p in st.driver_version.split(".")), f"{major}.{rest // 10}.0")}

        cluster.claim("k9", MIG, profile_is("1g.10gb"))
        cluster.pod("k9", "k9", node=NODE)
        (r,) = cluster.allocated("k9")
        dev = next(dev for s in slices for dev in s["spec"]["devices"] if dev["name"] == r["device"])
        at = Placement(dev["attributes"]["placementStart"]["int"], dev["attributes"]["placementSize"]["int"])
        claim = cluster.get_claim("k9")

        kill_9(d)  # between allocation and prepare
        d.start()
        plugin = Plugin(root)
        wait_until(lambda: os.path.exists(plugin.dra_socket), 30, "the DRA socket")
        kubelet = Kubelet(plugin)
        got = await kubelet.prepare(claim)
        await kubelet.close()
        assert got.error == "" and gis(d.host) == [("1g.10gb", at)]
        shown = d.ctl("status", "--kube").stdout  # what is published (as the server holds it) and prepared
        on_server = sum(len(s["spec"].get("devices") or ()) for s in cluster.slices(NODE))
        assert f"published: {on_server} device(s)" in shown, shown
        assert f"prepared: apps/k9 ({claim['metadata']['uid']}): {r['device']}" in shown, shown

        kill_9(d)  # between prepare and unprepare
        assert gis(d.host) == [("1g.10gb", at)]  # the instance outlives gpud
        d.start()
        wait_until(lambda: os.path.exists(plugin.dra_socket), 30, "the DRA socket")
        kubelet = Kubelet(plugin)
        again = await kubelet.prepare(claim)  # answered from the checkpoint, nothing made twice
        assert list(again.devices) == list(got.devices) and gis(d.host) == [("1g.10gb", at)]
        assert (await kubelet.unprepare(claim)).error == ""
        await kubelet.close()
        assert gis(d.host) == []

        # a lease made outside Kubernetes: its placement and the whole GPU leave the pool
        r = d.ctl("lease", "3g.40gb", "--start", "4", "--gpu", "0", "--json")
        assert r.returncode == 0, r.stderr + r.stdout

        def devices_now() -> set[str]:
            return {dev["name"] for s in cluster.slices(NODE) for dev in s["spec"].get("devices") or ()}
        wait_until(lambda: "gpu-0" not in devices_now(), 30, "the pool to drop what the lease holds")
        left = devices_now()
        assert "gpu-0-mig-1g-10gb-0" in left and not any(n.endswith("-4") or n.endswith("-5") or n.endswith("-6")
                                                         for n in left if "mig" in n), left
    finally:
        if d.proc.poll() is None:
            d.proc.terminate()
            d.proc.wait(30)
        shutil.rmtree(root, ignore_errors=True)


def test_publishing_as_gpu_nvidia_com_is_refused_while_nvidias_plugin_is_registered(cluster, tmp_path):
    """`--dra-driver gpu.nvidia.com` beside NVIDIA's kubelet plugin (its registration socket in the
    kubelet's plugins_registry): gpud refuses to start and says why; NVIDIA's socket is left alone.
    Once NVIDIA's plugin is gone, gpud starts and registers under that name itself."""
    import socket

    cluster.node("nvidia-named")
    kubeconfig = cluster.kubeconfig(tmp_path / "gpud.kubeconfig")
    root = tempfile.mkdtemp(prefix="kubelet.", dir="/tmp")
    theirs = os.path.join(root, "plugins_registry", "gpu.nvidia.com-reg.sock")
    os.makedirs(os.path.dirname(theirs))
    nvidia = socket.socket(socket.AF_UNIX)
    nvidia.bind(theirs)
    nvidia.listen()
    args = ["--kube-node", "nvidia-named", "--kubeconfig", kubeconfig, "--dra", "--dra-driver", "gpu.nvidia.com",
            "--kubelet-root", root, "--cdi-dir", str(tmp_path / "cdi")]
    d = None
    try:
        try:
            d = Daemon(tmp_path, ["h100-80gb:1"], dynamic_layout(), extra_args=args)
        except AssertionError as e:
            assert "NVIDIA's DRA kubelet plugin is registered on this node" in str(e) and theirs in str(e), str(e)
        else:
            raise AssertionError("gpud started beside NVIDIA's kubelet plugin under its driver name")
        assert os.path.exists(theirs) and not cluster.slices("nvidia-named")
        nvidia.close()
        os.unlink(theirs)
        d = Daemon(tmp_path / "again", ["h100-80gb:1"], dynamic_layout(), extra_args=args)
        wait_until(lambda: any(s["spec"]["driver"] == "gpu.nvidia.com" for s in cluster.slices("nvidia-named")), 60,
                   "the pool published as gpu.nvidia.com")
        assert os.path.exists(paths(root, "gpu.nvidia.com")[0])
    finally:
        nvidia.close()
        if d is not None and d.proc.poll() is None:
            d.proc.terminate()
            d.proc.wait(30)
        shutil.rmtree(root, ignore_errors=True)




async def test_vgpus_are_published_as_kubevirt_takes_them_and_prepared(cluster, tmp_path):
    """A vm-vgpu node (an L40S with vendor-VFIO vGPUs, a T4 with mdevs): every vGPU the simulator
    made is one `type: vgpu` device on the server, the VF's address as its pciBusID or the mdev's
    UUID as mDevUUID (KubeVirt VEP 10); a claim for one is allocated by the real scheduler and
    prepare hands over the VF's /dev/vfio group as the simulated kernel lists it."""
    from tests.support.vgpu_host import sim_vgpus
    from tests.support.vgpu_layouts import L40S, T4
    from tests.support.vgpu_layouts import L40S_AND_T4 as LAYOUT

    cluster.node("vgpu-node")
    kubeconfig = cluster.kubeconfig(tmp_path / "gpud.kubeconfig")
    root = tempfile.mkdtemp(prefix="kubelet.", dir="/tmp")
    d = Daemon(tmp_path, ["l40s", "t4"], LAYOUT, vgpu="vfio", extra_args=[
        "--kube-node", "vgpu-node", "--kubeconfig", kubeconfig, "--dra", "--kubelet-root", root,
        "--cdi-dir", str(tmp_path / "cdi")])
    try:
        r = d.ctl("apply", "--wait", "--timeout", "120")
        assert r.returncode == 0, r.stdout + r.stderr
        want = sorted([(t, ("pci", vf)) for t, vf in sim_vgpus(d.host, L40S)]
                      + [(t, ("mdev", u)) for t, u in sim_vgpus(d.host, T4)])
        assert len(want) == 6

        def published(slices):
            out = []
            for s in slices:
                for dev in s["spec"].get("devices") or ():
                    a = dev["attributes"]
                    assert a["type"]["string"] == "vgpu"
                    ident = ("mdev", a["mDevUUID"]["string"]) if "mDevUUID" in a else (
                        "pci", a["resource.kubernetes.io/pciBusID"]["string"])
                    out.append((a["profile"]["string"], ident))
            return sorted(out)
        cluster.watch_slices("vgpu-node", lambda s: published(s) == want, limit=120, what="the six vGPUs")

        cluster.claim("vm-vgpu", "vgpu.gpud.io", "device.attributes['gpu.gpud.io'].profile == 'L40S-12Q'")
        cluster.pod("vm-vgpu", "vm-vgpu", node="vgpu-node")
        (alloc,) = cluster.allocated("vm-vgpu")
        dev = next(x for s in cluster.slices("vgpu-node") for x in s["spec"]["devices"] if x["name"] == alloc["device"])
        vf = dev["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
        claim = cluster.get_claim("vm-vgpu")
        plugin = Plugin(root)
        wait_until(lambda: os.path.exists(plugin.dra_socket), 30, "the DRA socket")
        kubelet = Kubelet(plugin)
        try:
            got = await kubelet.prepare(claim)
        finally:
            await kubelet.close()
        assert got.error == "", got.error
        spec = json.loads((tmp_path / "cdi" / f"{DEFAULT_DRIVER}-claim_{claim['metadata']['uid']}.json").read_text())
        (edits,) = [x["containerEdits"] for x in spec["devices"]]
        group = os.path.basename(os.readlink(d.host / "sys" / "bus" / "pci" / "devices" / vf / "iommu_group"))
        assert {"path": f"/dev/vfio/{group}"} in edits["deviceNodes"]
        assert f"PCI_RESOURCE_GPUD_IO={vf}" in edits["env"]
        # what KubeVirt's virt-launcher reads (KEP-5304 metadata, VEP 10): the VF's address
        (mount,) = edits["mounts"]
        assert mount["hostPath"].startswith(os.path.join(root, "plugins", DEFAULT_DRIVER) + "/")
        ((dev_meta,),) = [r["devices"] for r in json.loads(Path(mount["hostPath"]).read_text())["requests"]]
        assert dev_meta["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": vf}
        assert "mDevUUID" not in dev_meta["attributes"]
    finally:
        if d.proc.poll() is None:
            d.proc.terminate()
            d.proc.wait(30)
        shutil.rmtree(root, ignore_errors=True)
