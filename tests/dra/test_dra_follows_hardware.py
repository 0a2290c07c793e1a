"""The pool follows the hardware: a real `gpud --dra` process on a simulated host with two dynamic
H100s, the ResourceSlices watched on the real kube-apiserver (v1.36.3) as the server stores them.

After a lease made outside Kubernetes, a layout change, a hot-unplug and an Xid the nvidia driver
logs, the node's slices change to match (each waited for on a watch, with a generous bound; how
fast is bench/dra_fleet_bench.py's business), capacity used outside Kubernetes is never offered,
a GPU with a fatal Xid is tainted so that the real kube-scheduler does not allocate it, and it is
offered again once the kernel initialised it afresh. At rest gpud makes no API request (the
server's audit log)."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time

from gpud.sim import state as simstate
from tests.dra.cluster import skips
from tests.support.daemon import Daemon
from tests.support.dra_kubelet import MIG, profile_is

pytestmark = skips()
NODE = "follow-node"
GPUD = "system:serviceaccount:kube-system:gpud"

LAYOUT = """version: v1
layouts:
  d:
    - devices: [0]
      mig-enabled: true
      mig-devices: dynamic
    - devices: [1]
      mig-enabled: true
      mig-devices: {gpu1}
"""
DYNAMIC, STATIC = "dynamic", '{"3g.40gb": 2}'


def devices(slices: list[dict]) -> dict[str, dict]:
    return {d["name"]: d for s in slices for d in s["spec"].get("devices") or ()}


def of_gpu(slices: list[dict], index: int) -> dict[str, dict]:
    return {n: d for n, d in devices(slices).items() if n == f"gpu-{index}" or n.startswith(f"gpu-{index}-")}


def memory_slices(device: dict) -> set[int]:
    """The GPU memory slices a published device would take (its counters), from the server's copy."""
    return {int(c.rsplit("-", 1)[1]) for cc in device.get("consumesCounters") or ()
            for c in cc["counters"] if c.startswith("memory-slice-")}


def quiet(cluster, spell: float, limit: float) -> None:
    """Until gpud made no request for `spell` seconds (bounded by `limit`)."""
    deadline = time.monotonic() + limit
    while True:
        n = len(cluster.server.audit(GPUD))
        time.sleep(spell)
        if len(cluster.server.audit(GPUD)) == n:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"gpud never went quiet for {spell:.0f} s within {limit:.0f} s")


def test_the_pool_follows_leases_layout_unplug_and_xids(cluster, tmp_path):
    cluster.node(NODE)
    kubeconfig = cluster.kubeconfig(tmp_path / "gpud.kubeconfig")
    root = tempfile.mkdtemp(prefix="kubelet.", dir="/tmp")  # tmp_path can outgrow a Unix socket path
    d = Daemon(tmp_path, ["h100-80gb:2"], LAYOUT.format(gpu1=DYNAMIC), extra_args=[
        "--kube-node", NODE, "--kubeconfig", kubeconfig, "--dra", "--kubelet-root", str(root),
        "--cdi-dir", str(tmp_path / "cdi")])
    gpu0, gpu1 = sorted(simstate.load(d.host).gpus)
    try:
        cluster.watch_slices(NODE, lambda s: "gpu-0" in devices(s) and "gpu-1" in devices(s), what="the first pool")

        # at rest (the layout applied, the labels that follow it written, the slices' watch open, a
        # first quiet spell): no request in the next 10 s. A poller slower than the quiet spell
        # (3 s) and faster than the window is caught here; the bench counts over a minute.
        cluster.wait("gpud converged", lambda: d.status()["phase"] == "converged", limit=120)
        cluster.wait("gpud's watch on its slices", lambda: any(
            e["verb"] == "watch" and "resourceslices" in e["requestURI"] for e in cluster.server.audit(GPUD)))
        quiet(cluster, 3.0, limit=60)
        before = len(cluster.server.audit(GPUD))
        time.sleep(10)  # idle: an interval to count in, not a timing assertion
        made = [(e["verb"], e["requestURI"]) for e in cluster.server.audit(GPUD)[before:]]
        assert made == [], made

        # a lease made outside Kubernetes: its placement, what overlaps it and the whole GPU leave
        r = d.ctl("lease", "3g.40gb", "--start", "4", "--gpu", "0", "--json")
        assert r.returncode == 0, r.stderr + r.stdout
        lease = json.loads(r.stdout)
        slices = cluster.watch_slices(NODE, lambda s: "gpu-0" not in devices(s), what="the lease taken out")
        offered = of_gpu(slices, 0)
        assert offered and all(not memory_slices(dev) & {4, 5, 6, 7} for dev in offered.values()), offered
        assert "gpu-0-mig-1g-10gb-0" in offered  # the rest of the GPU stays offered
        r = d.ctl("release", lease["id"])
        assert r.returncode == 0, r.stderr + r.stdout
        cluster.watch_slices(NODE, lambda s: "gpu-0-mig-3g-40gb-4" in devices(s) and "gpu-0" in devices(s),
                             what="the released placement offered again")

        # a layout change: GPU 1 from dynamic to two static 3g.40gb
        d.config.write_text(LAYOUT.format(gpu1=STATIC))
        slices = cluster.watch_slices(
            NODE, lambda s: sorted(dev["attributes"].get("profile", {}).get("string", "") for dev in of_gpu(s, 1).values())
            == ["3g.40gb", "3g.40gb"], limit=120, what="GPU 1's static MIG devices")
        assert all("consumesCounters" not in dev for dev in of_gpu(slices, 1).values())

        # a hot-unplug: GPU 1's devices go
        assert d.sim("unplug", gpu1).returncode == 0
        cluster.watch_slices(NODE, lambda s: not of_gpu(s, 1), what="the unplugged GPU's devices gone")

        # an Xid the nvidia driver logs (79: fallen off the bus): every device of GPU 0 is tainted,
        # as the server stores it, and the real scheduler allocates none of them
        r = d.sim("xid", gpu0, "79", "--text", "GPU has fallen off the bus.")
        assert r.returncode == 0, r.stderr
        slices = cluster.watch_slices(NODE, lambda s: bool(of_gpu(s, 0)) and all(
            dev.get("taints") for dev in of_gpu(s, 0).values()), what="GPU 0's devices tainted")
        for dev in of_gpu(slices, 0).values():
            (taint,) = dev["taints"]
            assert (taint["key"], taint["value"], taint["effect"]) == ("gpu.gpud.io/xid", "79", "NoSchedule")
            assert taint.get("timeAdded")  # set by the server, kept by gpud's later writes
        cluster.claim("after-xid", MIG, profile_is("1g.10gb"))
        cluster.pod("after-xid", "after-xid", node=NODE)
        assert cluster.unschedulable("after-xid")

        # a gpud restart (it reads the kernel log from its end) keeps the taint
        d.stop()
        d.start()
        cluster.wait("the restarted gpud's first publish", lambda: re.search(
            r"published: [1-9]\d* device", d.ctl("status", "--kube").stdout))
        for dev in of_gpu(cluster.slices(NODE), 0).values():
            assert [t["value"] for t in dev.get("taints") or ()] == ["79"], dev
        shown = d.ctl("status", "--kube").stdout  # and says so
        assert f"unhealthy: GPU {gpu0}: Xid 79, its devices tainted gpu.gpud.io/xid=79:NoSchedule" in shown, shown
        assert (cluster.get_claim("after-xid").get("status") or {}).get("allocation") is None

        # initialised afresh (out and back in): the taint goes and the scheduler allocates GPU 0
        assert d.sim("unplug", gpu0).returncode == 0
        cluster.watch_slices(NODE, lambda s: not of_gpu(s, 0), what="GPU 0 unplugged")
        assert d.sim("plug", gpu0).returncode == 0
        cluster.watch_slices(NODE, lambda s: "gpu-0" in devices(s) and not any(
            dev.get("taints") for dev in of_gpu(s, 0).values()), what="GPU 0 back untainted")
        (r,) = cluster.allocated("after-xid")
        assert r["device"].startswith("gpu-0-mig-1g-10gb-")

        # the label protocol on the same node: a layout asked by node label is applied and reported
        cluster.admin("PATCH", f"/api/v1/nodes/{NODE}", {"metadata": {"labels": {"nvidia.com/mig.config": "d"}}},
                      content_type="application/merge-patch+json")
        cluster.wait("nvidia.com/mig.config.state=success", lambda: (cluster.admin(
            "GET", f"/api/v1/nodes/{NODE}")["metadata"].get("labels") or {}).get("nvidia.com/mig.config.state")
            == "success", limit=120)
        assert of_gpu(cluster.slices(NODE), 0)  # and the pool is still published
    finally:
        if d.proc.poll() is None:
            d.proc.terminate()
            d.proc.wait(30)
        shutil.rmtree(root, ignore_errors=True)
