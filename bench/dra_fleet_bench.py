"""gpud's DRA pools at fleet scale on one real kube-apiserver and kube-scheduler (v1.36.3).

* N simulated nodes (default 50) x 8 dynamic H100 80GB: each node's pool is what gpud's slice
  builder (gpud.plan.dra_slices) makes for such a node, published through gpud's own adapter
  (gpud.host.kube.dra_api); slices and bytes per node are read back from the API server.
* Scheduler allocation latency of one `1g.10gb` claim (a pod using it, created; the claim's
  allocation seen by polling the server every 10 ms) with the fleet at 0%, 50% and 90% use,
  use being the share of GPUs held whole by other claims (each such claim consumes every counter
  of its GPU). p50/p99 of the samples at each level.
* API requests per node per minute at rest: real `gpud --sim --kube-node --dra` processes (8
  GPUs each) left idle for a minute after their first publish, their requests counted in the API
  server's audit log (by node name in the request).
* Republish latency per kind of change, on one real `gpud --dra` process (2 dynamic H100s): from
  just before the change (a `gpudctl lease` started, the layout file written, the simulator's
  card unplugged, an Xid logged) until a watch on the node's slices shows the pool changed as
  the server stores it. The lease includes gpudctl's start-up; the layout change includes the
  MIG reconfiguration it asks for. p50/p99 of the samples.

    .venv/bin/python -m bench.dra_fleet_bench [--nodes 50] [--samples 20] [--idle-nodes 2]
        [--republish-samples 20] [--parts fleet,idle,republish] [-o out/dra.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpud.host.kube.dra_api import DraApi  # noqa: E402
from gpud.host.kube.node_api import load_config  # noqa: E402
from gpud.layout.desired import DesiredGpu  # noqa: E402
from gpud.model import Gpu, NvmlGpu, PciFunction  # noqa: E402
from gpud.plan.dra_slices import DEFAULT_DRIVER, DraInputs, build_slices  # noqa: E402
from gpud.profiles import MODELS  # noqa: E402
from tests.dra.cluster import DraCluster  # noqa: E402

H100 = MODELS["h100-80gb"]


def node_gpus(n: int, gpus: int) -> tuple[tuple[Gpu, ...], dict[str, DesiredGpu]]:
    out = []
    for i in range(gpus):
        pci = f"0000:{0x18 + i:02x}:00.0"
        fn = PciFunction(pci, 0x10DE, H100.device, 0x10DE, H100.subsystem_device or 0, 0x030200, driver="nvidia",
                         iommu_group=10 + i)
        nv = NvmlGpu(pci, f"GPU-{n:04d}-{i}", H100.name, minor=i, memory_mb=H100.memory_mb, mig_capable=True,
                     mig_mode=0, profiles=H100.profiles, compute_capability=H100.compute_capability)
        out.append(Gpu(i, fn, nvml=nv))
    return tuple(out), {g.pci: DesiredGpu(g.pci, g.index, "layouts.d[0]", mig_enabled=True, dynamic=True) for g in out}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def publish_fleet(cluster: DraCluster, nodes: list[str], kubeconfig: str) -> None:
    config = load_config(kubeconfig)
    for k, name in enumerate(nodes):
        gpus, desired = node_gpus(k, 8)
        api = DraApi(name, DEFAULT_DRIVER, config)
        await api.publish(build_slices(DraInputs(name, gpus, desired, driver_version="570.124.06")).slices)
        await api.close()


def measure_latency(cluster: DraCluster, tag: str, samples: int) -> list[float]:
    out = []
    for i in range(samples):
        name = f"lat-{tag}-{i}"
        cluster.claim(name, "mig.gpud.io", f"device.attributes['{DEFAULT_DRIVER}'].profile == '1g.10gb'")
        t0 = time.monotonic()
        cluster.pod(name, name)
        while True:
            if (cluster.get_claim(name).get("status") or {}).get("allocation"):
                break
            if time.monotonic() - t0 > 120:
                raise RuntimeError(f"{name} not allocated in 120 s")
            time.sleep(0.01)
        out.append((time.monotonic() - t0) * 1000)
    return out


def fill(cluster: DraCluster, upto: int, have: int) -> int:
    """Whole-GPU claims until `upto` GPUs are held; waits until all are allocated."""
    for i in range(have, upto):
        cluster.claim(f"fill-{i}", "gpu.gpud.io")
        cluster.pod(f"fill-{i}", f"fill-{i}")
    for i in range(have, upto):
        cluster.allocated(f"fill-{i}")
    return upto


def idle_requests(cluster: DraCluster, tmp: Path, count: int, idle_s: float) -> tuple[float, int]:
    """(requests per node per minute at rest, nodes) from real gpud processes."""
    from tests.leases.rig import dynamic_layout
    from tests.support.daemon import Daemon, wait_until

    kubeconfig = cluster.kubeconfig(tmp / "gpud.kubeconfig")
    daemons = []
    try:
        for k in range(count):
            name = f"idle-{k}"
            cluster.node(name)
            d = tmp / name
            d.mkdir()
            daemons.append((name, Daemon(d, ["h100-80gb:8"], dynamic_layout(), extra_args=[
                "--kube-node", name, "--kubeconfig", kubeconfig, "--dra", "--kubelet-root", str(d / "kubelet"),
                "--cdi-dir", str(d / "cdi")])))
        for name, _ in daemons:
            wait_until(lambda name=name: cluster.slices(name), 120, f"{name}'s slices")
        time.sleep(5)  # the first publish's own watch events settle
        before = len(cluster.server.audit("system:serviceaccount:kube-system:gpud"))
        time.sleep(idle_s)
        events = cluster.server.audit("system:serviceaccount:kube-system:gpud")[before:]
        per_node = [sum(1 for e in events if name in e.get("requestURI", "")) for name, _ in daemons]
        return statistics.mean(per_node) * 60 / idle_s, count
    finally:
        for _, d in daemons:
            d.proc.terminate()
            d.proc.wait(30)


def republish_latency(cluster: DraCluster, tmp: Path, samples: int) -> dict[str, list[float]]:
    """Milliseconds from each change to the watch seeing the pool follow it, per kind of change."""
    from gpud.sim import kernel
    from gpud.sim import state as simstate
    from tests.dra.test_dra_follows_hardware import DYNAMIC, LAYOUT, STATIC, devices, of_gpu
    from tests.support.daemon import Daemon

    node = "republish"
    cluster.node(node)
    (tmp / node).mkdir()
    d = Daemon(tmp / node, ["h100-80gb:2"], LAYOUT.format(gpu1=DYNAMIC), extra_args=[
        "--kube-node", node, "--kubeconfig", cluster.kubeconfig(tmp / "republish.kubeconfig"), "--dra",
        "--kubelet-root", tempfile.mkdtemp(prefix="kl.", dir="/tmp"), "--cdi-dir", str(tmp / node / "cdi")])
    gpu0, gpu1 = sorted(simstate.load(d.host).gpus)
    out: dict[str, list[float]] = {"lease outside Kubernetes": [], "layout change": [], "hot-unplug": [],
                                   "Xid": []}

    def timed(kind: str, change, until) -> None:
        t0 = time.monotonic()
        change()
        cluster.watch_slices(node, until, limit=180, what=kind)
        out[kind].append((time.monotonic() - t0) * 1000)

    def profiles(s: list[dict]) -> list[str]:
        return sorted(dev["attributes"].get("profile", {}).get("string", "") for dev in of_gpu(s, 1).values())

    try:
        cluster.watch_slices(node, lambda s: "gpu-0" in devices(s) and "gpu-1" in devices(s), limit=180)
        for i in range(samples):
            taken: list = []
            timed("lease outside Kubernetes", lambda taken=taken: taken.append(
                d.ctl("lease", "1g.10gb", "--start", "0", "--gpu", "0", "--json")),
                  lambda s: "gpu-0-mig-1g-10gb-0" not in devices(s))
            assert taken[0].returncode == 0, taken[0].stderr + taken[0].stdout
            assert d.ctl("release", json.loads(taken[0].stdout)["id"]).returncode == 0
            cluster.watch_slices(node, lambda s: "gpu-0" in devices(s), limit=180)

            # static: GPU 1's two 3g.40gb published as such; back to dynamic: the instances left
            # are no lease's, so nothing overlapping them (there: nothing of GPU 1) is offered
            to = STATIC if i % 2 == 0 else DYNAMIC
            timed("layout change", lambda to=to: d.config.write_text(LAYOUT.format(gpu1=to)),
                  lambda s, to=to: (profiles(s) == ["3g.40gb", "3g.40gb"]) == (to == STATIC))

            timed("hot-unplug", lambda: kernel.unplug(d.host, gpu1), lambda s: not of_gpu(s, 1))
            kernel.plug(d.host, gpu1)
            cluster.watch_slices(node, lambda s: bool(of_gpu(s, 1)), limit=180)

            code = 79 if i % 2 == 0 else 48  # a new value each time: the taint changes
            timed("Xid", lambda code=code: kernel.xid(d.host, gpu0, code), lambda s, code=code: bool(of_gpu(s, 0))
                  and all([t.get("value") for t in dev.get("taints") or ()] == [str(code)] for dev in of_gpu(s, 0).values()))
    finally:
        d.stop()
    return out


def fleet(cluster: DraCluster, tmp: Path, args: argparse.Namespace) -> list[str]:
    nodes = [f"node-{k:03d}" for k in range(args.nodes)]
    for name in nodes:
        cluster.node(name)
    t0 = time.monotonic()
    asyncio.run(publish_fleet(cluster, nodes, cluster.kubeconfig(tmp / "publisher.kubeconfig")))
    publish_s = time.monotonic() - t0
    per_node = [cluster.slices(n) for n in nodes[:5]]
    slices = statistics.mean(len(s) for s in per_node)
    size = statistics.mean(len(json.dumps(s, separators=(",", ":"))) for s in per_node)
    devices = statistics.mean(sum(len(x["spec"].get("devices") or ()) for x in s) for s in per_node)
    gpus = args.nodes * 8
    rows = []
    held = 0
    for level in (0, 50, 90):
        held = fill(cluster, gpus * level // 100, held)
        lat = measure_latency(cluster, str(level), args.samples)
        rows.append((level, held, pct(lat, 50), pct(lat, 99)))
    return [
        f"{args.nodes} simulated nodes x 8 dynamic H100 80GB.", "",
        "| per node | value |", "|---|---|",
        f"| ResourceSlices | {slices:.0f} |", f"| devices | {devices:.0f} |",
        f"| bytes (JSON as the server returns it) | {size / 1024:.1f} KiB |",
        f"| publish, whole fleet | {publish_s:.1f} s |", "",
        f"Allocation of one 1g.10gb claim ({args.samples} samples per level; pod created -> claim allocated):", "",
        "| fleet use (GPUs held whole) | p50 | p99 |", "|---|---|---|",
        *[f"| {lv}% ({h} of {gpus}) | {p50:.0f} ms | {p99:.0f} ms |" for lv, h, p50, p99 in rows], ""]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=50)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--idle-nodes", type=int, default=2)
    ap.add_argument("--idle-seconds", type=float, default=60.0)
    ap.add_argument("--republish-samples", type=int, default=20)
    ap.add_argument("--parts", default="fleet,idle,republish", help="which parts to run (comma-separated)")
    ap.add_argument("-o", "--output", default="out/dra.md")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="dra-bench-"))
    cluster = DraCluster(tmp / "cluster")
    (tmp / "cluster").mkdir()
    cluster.start()
    lines = ["# DRA fleet bench (bench/dra_fleet_bench.py)", "",
             f"One kube-apiserver + kube-scheduler v1.36.3; {platform.node()}, {os.cpu_count()} CPUs, "
             f"Python {platform.python_version()}.", ""]
    try:
        if "fleet" in parts:
            lines += fleet(cluster, tmp, args)
        if "idle" in parts:
            rate, idle_nodes = idle_requests(cluster, tmp, args.idle_nodes, args.idle_seconds)
            lines += [f"At rest: {rate:.2f} API requests per node per minute ({idle_nodes} real gpud --dra processes, "
                      f"{args.idle_seconds:.0f} s idle, counted in the audit log; an open watch counts when "
                      "(re)opened).", ""]
        if "republish" in parts:
            lat = republish_latency(cluster, tmp, args.republish_samples)
            lines += [f"Republish latency ({args.republish_samples} samples per kind; one real gpud --dra, 2 dynamic "
                      "H100s; change -> the pool changed on a watch of the server):", "",
                      "| change | p50 | p99 |", "|---|---|---|",
                      *[f"| {kind} | {pct(xs, 50):.0f} ms | {pct(xs, 99):.0f} ms |" for kind, xs in lat.items()], ""]
    finally:
        cluster.stop()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
