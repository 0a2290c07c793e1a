"""gpud: wiring. Picks the real host or the simulator once, then runs the event sources (the
config file via inotify, device events via udev, the socket, signals) around the reconciler.

Nothing here polls hardware in a loop: passes run on start, on a valid change of the file, on a
device event, on a holder's exit, and on request.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # `python -m gpud.daemon`: asyncio as gpud.main imports it, before the imports below
    from gpud.asyncio_tls import daemon_needs_tls, import_asyncio_without_tls

    if not daemon_needs_tls(sys.argv[1:]):
        import_asyncio_without_tls()

import argparse
import asyncio
import faulthandler
import gc
import logging
import os
import signal
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpud import VERSION
from gpud.api.handlers import RequestHandler
from gpud.device_events import DeviceEvent, describe_device_event
from gpud.engine import status_line
from gpud.engine.apply_lock import ApplyLock
from gpud.engine.binding.udev_rules import UdevRules
from gpud.engine.engine import build_engine
from gpud.engine.events import EventBus
from gpud.engine.gpu_state import SETTLING_PHASES
from gpud.engine.kube.node_labels_out import LabelsOut, Versions, from_cluster, layout_state
from gpud.engine.observe.observer import DEFAULT_MAX_AGE
from gpud.hardware import HostConfig, build_hardware
from gpud.host.nvidia.nvml import NvmlError
from gpud.host.nvidia.sriov_manage import DEFAULT_PATH as SRIOV_MANAGE
from gpud.host.systemd.early_signals import hold_sighup, take_sighup
from gpud.loop_lag import LoopLagProbe
from gpud.wire.frames import status_socket

PERSISTENCE_INTENT = "persistence-restore.json"  # in the state dir: GPUs whose persistence a reset left off

if TYPE_CHECKING:  # imported with --kube-node only (they need gpud[kube])
    from gpud.engine.dra.service import DraService
    from gpud.engine.kube.agent import KubeAgent
    from gpud.engine.kube.applier import ReconcilerApplier
    from gpud.engine.observe.discovery import Observation
    from gpud.engine.ports import Rebooter
    from gpud.host.nvidia.cdi import CdiGenerator

log = logging.getLogger("gpud")
# Seconds a worker thread may keep the GIL while the loop wants it. Each answer takes the GIL back
# several times (after epoll, recv, send), each time after a worker that took it meanwhile was made
# to drop it; with many CPUs the workers are always running and ready to take it. Measured with
# scale_bench at 64 GPUs during an apply (status p99, alternating runs; docs/internals.md): on the
# lent 16-CPU machine 20-40 ms at 0.5 ms and 1 ms, 3.6-12 ms at 0.05 ms; on this project's 2-CPU
# machine 5.1-5.9 ms at 0.5 ms, 6.4-10 ms at 0.05 ms (there the waiting threads are off the CPUs).
MANY_CPUS_SWITCH_INTERVAL = 0.00005
FEW_CPUS_SWITCH_INTERVAL = 0.0005


def switch_interval(cpus: int) -> float:
    """The GIL switch interval for a daemon that may run on `cpus` CPUs."""
    return MANY_CPUS_SWITCH_INTERVAL if cpus > 2 else FEW_CPUS_SWITCH_INTERVAL


@dataclass(frozen=True)
class DaemonConfig:
    """What the daemon runs with, fixed at start: the command line (`parse_args`, the fields named
    as its options) and the daemon's own timings, documented here once."""

    config: str = "/etc/gpud/layout.yaml"
    socket: str = "/run/gpud/gpud.sock"
    state_dir: str = "/var/lib/gpud"
    sim: str | None = None
    read_only: bool = False
    replay: str | None = None
    lock: str | None = None
    socket_group: str = "gpud"
    status_replica: bool = True  # answer plain `status` from a process of its own (gpud.api.status_replica)
    udev_rules: str | None = None
    metrics_textfile: str | None = None
    unbind_timeout: float = 30.0  # seconds before an unbind is declared stuck
    nvidia_smi: str | None = None
    sriov_manage: str | None = None
    status_max_age: float = DEFAULT_MAX_AGE  # re-read the host for status when older than this
    nfd_features: str | None = None
    nfd_labels: str | None = None
    mig_strategy: str | None = None
    nvidia_ctk: str | None = None
    cdi_spec: str | None = None
    kube_node: str | None = None
    kubeconfig: str | None = None
    kube_namespace: str = "gpu-operator"
    default_vgpu_config: str = "default"
    dra: bool = False  # be the node's DRA driver (gpud.engine.dra)
    dra_driver: str = "gpu.gpud.io"
    kubelet_root: str = "/var/lib/kubelet"
    cdi_dir: str | None = None
    log_level: str = "INFO"
    # timings (no options)
    reload_delay: float = 0.3  # a file event waits this long for the editor's next write before a reload
    pass_debounce: float = 0.2  # requests for a pass within this long of each other share one pass
    first_pass_wait_s: float = 60.0  # at most this long READY=1 waits for the first pass's changes (TimeoutStartSec=90s)
    stop_step_wait_s: float = 60.0  # at a stop, how long a hardware step in flight is waited for
    stuck_writer_wait_s: float = 5.0  # at a stop, how long killed sysfs writers are waited for


def parse_args(argv: list[str] | None = None) -> DaemonConfig:
    ap = argparse.ArgumentParser(prog="gpud", description="Converge NVIDIA GPUs to /etc/gpud/layout.yaml.")
    ap.add_argument("--config", default="/etc/gpud/layout.yaml")
    ap.add_argument("--socket", default="/run/gpud/gpud.sock")
    ap.add_argument("--state-dir", default="/var/lib/gpud")
    ap.add_argument("--sim", metavar="DIR", help="drive the simulated host in DIR (made by gpud-sim create)")
    ap.add_argument("--read-only", action="store_true", help="observe and plan; refuse every mutating call")
    ap.add_argument("--replay", metavar="CAPTURE", help="with --sim DIR --read-only: NVML answers from a real "
                    "GPU's capture (DIR laid out by python -m gpud.sim.replay_nvml CAPTURE DIR)")
    ap.add_argument("--lock", help="host-wide apply lock (default /run/gpud/apply.lock, or DIR/apply.lock with --sim; "
                    "its directory must be writable only by gpud's user)")
    ap.add_argument("--socket-group", default="gpud", help="group allowed to read status (default gpud)")
    ap.add_argument("--no-status-replica", dest="status_replica", action="store_false",
                    help="answer every `status` in the daemon itself, not from the status replica beside the "
                    "socket (SOCKET without .sock + -status.sock), a process that answers from the daemon's last "
                    "snapshot while the daemon's own interpreter is busy with an apply")
    ap.add_argument("--udev-rules", help="udev rules file that keeps passthrough GPUs off nvidia at boot "
                    "(default /etc/udev/rules.d/70-gpud-vfio.rules, or DIR/etc/udev/rules.d/... with --sim)")
    ap.add_argument("--metrics-textfile", help="write Prometheus metrics to this file (node exporter's "
                    "textfile collector, e.g. /var/lib/prometheus/node-exporter/gpud.prom)")
    ap.add_argument("--unbind-timeout", type=float, default=30.0, help="seconds before an unbind is declared stuck")
    ap.add_argument("--nvidia-smi", metavar="PATH", help="the nvidia-smi that resets a GPU bound to nvidia "
                    "(`-r -i <PCI>`; default nvidia-smi from PATH, or DIR/bin/nvidia-smi with --sim)")
    ap.add_argument("--sriov-manage", metavar="PATH", help="NVIDIA's tool that enables and disables a GPU's "
                    f"SR-IOV VFs (`-e|-d <PCI>`; default {SRIOV_MANAGE}, or DIR/bin/sriov-manage with --sim)")
    ap.add_argument("--status-max-age", type=float, default=DEFAULT_MAX_AGE, metavar="S",
                    help="while clients ask for status, re-read the host when the observation is older "
                    f"than S seconds (default {DEFAULT_MAX_AGE:g}); changes gpud makes or hears of are "
                    "read at once whatever S")
    k8s = ap.add_argument_group("Kubernetes")
    k8s.add_argument("--nfd-features", metavar="PATH", help="node labels for Node Feature Discovery, written after "
                     "every pass when the directory exists (default /etc/kubernetes/node-feature-discovery/"
                     "features.d/gpud, or DIR/etc/kubernetes/... with --sim)")
    k8s.add_argument("--nfd-labels", choices=("all", "gpud"),
                     help="all: GFD's labels and gpud's own; gpud: only gpud's (a cluster that keeps running GFD). "
                     "Default all; with --kube-node gpud, unless the node has "
                     "nvidia.com/gpu.deploy.gpu-feature-discovery=false")
    k8s.add_argument("--mig-strategy", choices=("mixed", "single"),
                     help="the device plugin's and GFD's MIG strategy in this cluster (labels, advertised resources). "
                     "Default mixed; with --kube-node the node's nvidia.com/mig.strategy where set")
    k8s.add_argument("--nvidia-ctk", metavar="PATH", help="NVIDIA Container Toolkit's nvidia-ctk: after MIG devices "
                     "changed, `nvidia-ctk cdi generate --output=SPEC` when nvidia-cdi-refresh.service is not installed "
                     "(default: nvidia-ctk from PATH; with --sim none unless given; '' for none)")
    k8s.add_argument("--cdi-spec", metavar="SPEC", help="the CDI spec nvidia-ctk writes (default /var/run/cdi/nvidia.yaml, "
                     "or DIR/var/run/cdi/nvidia.yaml with --sim)")
    k8s.add_argument("--kube-node", metavar="NAME", help="follow the GPU Operator's node-label protocol for this "
                     "node (nvidia.com/mig.config selects the layout); needs gpud[kube]")
    k8s.add_argument("--kubeconfig", metavar="PATH", help="with --kube-node: credentials (default: in-cluster "
                     "service account, $KUBECONFIG, ~/.kube/config)")
    k8s.add_argument("--kube-namespace", default="gpu-operator", help="the GPU Operator's namespace (its operand pods)")
    k8s.add_argument("--default-vgpu-config", metavar="NAME", default="default",
                     help="with --kube-node: the layout a nvidia.com/gpu.workload.config=vm-vgpu node without "
                     "nvidia.com/vgpu.config gets, when the file has it (vgpu-device-manager's DEFAULT_VGPU_CONFIG; "
                     "default: default; '' for none)")
    dra = ap.add_argument_group("Kubernetes DRA (with --kube-node)")
    dra.add_argument("--dra", action="store_true", help="be this node's DRA driver: publish every GPU gpud manages "
                     "as ResourceSlices and prepare the claims the kubelet hands over; needs gpud[dra]")
    dra.add_argument("--dra-driver", default="gpu.gpud.io", help="the driver name published (default gpu.gpud.io; "
                     "gpu.nvidia.com makes NVIDIA's DeviceClasses select gpud's devices, and gpud then refuses to "
                     "start while NVIDIA's kubelet plugin is registered)")
    dra.add_argument("--kubelet-root", default="/var/lib/kubelet", help="the kubelet's directory: the plugin "
                     "registers in ROOT/plugins_registry and serves in ROOT/plugins/DRIVER (default /var/lib/kubelet)")
    dra.add_argument("--cdi-dir", help="where prepared claims' CDI specs go (default /var/run/cdi, or "
                     "DIR/var/run/cdi with --sim)")
    ap.add_argument("--log-level", default=os.environ.get("GPUD_LOG_LEVEL", DaemonConfig.log_level))
    ap.add_argument("--version", action="version", version=f"gpud {VERSION}")
    args = ap.parse_args(argv)
    if args.replay and not (args.sim and args.read_only):
        ap.error("--replay needs --sim DIR and --read-only: a capture can be read, not changed")
    if args.dra and not args.kube_node:
        ap.error("--dra needs --kube-node NAME: the pool it publishes is that node's")
    return DaemonConfig(**vars(args))


def host_config(args: DaemonConfig) -> HostConfig:
    """The host the command line names; the daemon's arguments themselves stay as parsed."""
    return HostConfig(sim=args.sim, replay=args.replay, read_only=args.read_only, sim_nvml_process=True, lock=args.lock,
                      udev_rules=args.udev_rules, nfd_features=args.nfd_features, nvidia_smi=args.nvidia_smi,
                      sriov_manage=args.sriov_manage, state_dir=args.state_dir, unbind_timeout=args.unbind_timeout)


class Daemon:
    def __init__(self, args: DaemonConfig) -> None:
        from gpud.host.systemd.sd_notify import Notifier

        self.args = args
        self.notifier = Notifier()
        self.bus = EventBus()
        self.host = build_hardware(host_config(args))
        self.hw, self.device_events = self.host.hw, self.host.device_events
        Path(args.state_dir).mkdir(parents=True, exist_ok=True)
        self._state_lock = hold_state_dir(args.state_dir)  # before anything reads or writes it
        if self.hw.reset is not None and not args.read_only:
            # persistence mode a previous gpud turned off for a reset and did not live to turn on again
            self.hw.reset.intent_path = str(Path(args.state_dir) / PERSISTENCE_INTENT)
            for pci in self.hw.reset.restore_pending():
                self.bus.publish("persistence", f"persistence mode on again for {pci} (left off by an "
                                                "interrupted reset)", gpu=pci)
        reboot = self.host.rebooter
        self.kube: KubeAgent | None = None  # with --kube-node
        self.kube_applier: ReconcilerApplier | None = None
        rebooter = self._start_kube(args.kube_node, reboot) if args.kube_node else reboot
        self.engine = build_engine(
            self.hw, config_path=args.config, apply_lock=ApplyLock(self.host.lock_path), bus=self.bus,
            read_only=args.read_only, binder_timeout=args.unbind_timeout,
            udev_rules=UdevRules(self.host.udev_rules, read_only=args.read_only),
            state_dir=args.state_dir, rebooter=rebooter, max_status_age=args.status_max_age,
            boot_id_path=self.host.boot_id_path, cdi_generate=self._cdi_generator(args),
            # the host's unit manager: on a real host D-Bus is imported and connected only when a
            # layout first drains units or MIG changes; a simulated host's never leaves the simulator
            drainer=self.host.drainer(lambda m: self._publish("drain", str(m))),
            operand_guard=self.kube, label_selects=bool(args.kube_node),
        )
        if self.kube_applier is not None:
            self.kube_applier.bind(self.engine)
        self.stopping = asyncio.Event()
        self._reload_timer: asyncio.TimerHandle | None = None
        self._metrics_key: tuple | None = None
        self._background: set[asyncio.Future] = set()  # tasks nothing else references
        self.loop_lag = LoopLagProbe()
        label_set, strategy = args.nfd_labels or "all", args.mig_strategy or "mixed"
        if args.kube_node:  # until the node is read: as if GFD runs there
            label_set, strategy = from_cluster({}, label_set=args.nfd_labels, mig_strategy=args.mig_strategy)
        self.labels = LabelsOut(self.host.nfd_features, label_set=label_set, mig_strategy=strategy,
                                exclude=("nvidia.com/mig.capable",) if args.kube_node else (),
                                on_event=self._publish)
        self._versions: Versions | None = None
        self._kube_passes = 0
        self.dra: DraService | None = None  # with --dra
        self._labels_passes: tuple[int, tuple[str, ...]] | None = None
        self._labels_seen: Observation | None = None  # the observation the labels were last written from

    def _start_kube(self, node: str, reboot: Rebooter) -> Rebooter:
        """--kube-node: the operator's label protocol, before the engine it guards (the applier is
        bound to the engine once that is built); the engine's rebooter. Its client library is
        imported here only."""
        try:
            from gpud.engine.kube.agent import KubeAgent
            from gpud.engine.kube.applier import KubeRebooter, ReconcilerApplier
            from gpud.host.kube.node_api import KubeApi, KubeError, load_config
        except ImportError as e:
            raise RuntimeError(f"--kube-node needs the Kubernetes client: pip install 'gpud[kube]' ({e})") from e
        try:
            api = KubeApi(node, load_config(self.args.kubeconfig))
        except KubeError as e:
            raise RuntimeError(f"--kube-node {node}: {e}") from e
        applier = ReconcilerApplier(None if self.args.read_only else self.args.state_dir)
        agent = KubeAgent(api, applier, namespace=self.args.kube_namespace,
                          default_vgpu=self.args.default_vgpu_config or None, on_node=self._on_node_labels,
                          on_event=self._publish)
        self.kube, self.kube_applier = agent, applier
        return KubeRebooter(agent, applier, reboot)

    def _cdi_generator(self, args: DaemonConfig) -> CdiGenerator | None:
        """`nvidia-ctk cdi generate` after MIG changes (gpud.host.nvidia.cdi): the toolkit from PATH on a
        real host, only the one given on a simulated host (never the real host's from a test), run
        there as the host runs NVIDIA's programs (Host.tool_prefix, Host.driver_root)."""
        from gpud.host.nvidia.cdi import DEFAULT_SPEC, CdiGenerator

        root = self.host.root
        ctk = args.nvidia_ctk
        if ctk is None:
            import shutil

            ctk = "" if root else (shutil.which("nvidia-ctk") or "")
        spec = args.cdi_spec or (str(Path(root) / DEFAULT_SPEC.lstrip("/")) if root else DEFAULT_SPEC)
        if not ctk or args.read_only:
            return None
        return CdiGenerator(ctk, spec, prefix=self.host.tool_prefix, driver_root=self.host.driver_root)

    def _publish(self, kind: str, message: str) -> None:
        self.bus.publish(kind, message)

    def _on_node_labels(self, labels: dict[str, str]) -> None:
        """--kube-node: the cluster decides the label set and MIG strategy the flags left open."""
        mode = from_cluster(labels, label_set=self.args.nfd_labels, mig_strategy=self.args.mig_strategy)
        if self.labels.set_mode(*mode):
            self.bus.publish("labels", f"node labels: {mode[0]} set, mig-strategy {mode[1]} (from the node's labels)")
            self._write_labels()

    # ---- event sources ---------------------------------------------------------------------
    async def watch_config(self) -> None:
        """Editors save in place, by atomic rename, or delete and re-create: watch the directory.
        A ConfigMap volume (the GPU Operator's way to hand mig-manager its file) is the file as a
        link `config.yaml -> ..data/config.yaml`; the kubelet's edit renames a new `..data` link
        over the old one and never touches the file's own entry, so the link's first component
        in the same directory counts as the file too."""
        from asyncinotify import Inotify, Mask

        path = Path(self.args.config).absolute()
        mask = Mask.CLOSE_WRITE | Mask.MOVED_TO | Mask.MOVED_FROM | Mask.CREATE | Mask.DELETE
        with Inotify() as ino:
            ino.add_watch(path.parent, mask)
            async for event in ino:
                if event.name is not None and str(event.name) in _names_of(path):
                    self._schedule_reload(f"{event.name}: {event.mask!r}")

    def _schedule_reload(self, why: str) -> None:
        loop = asyncio.get_running_loop()
        delay = self.args.reload_delay
        if self._reload_timer is not None:
            self._reload_timer.cancel()
        self._reload_timer = loop.call_later(delay, lambda: self._spawn(self._reload(why)))

    def _spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)  # kept until done: the loop holds tasks only weakly
        task.add_done_callback(self._background.discard)

    async def _reload(self, why: str) -> None:
        log.info("config changed (%s)", why)
        if not await self.engine.reload("layout changed"):
            await self.engine.refresh()  # a refused file: status shows its errors at once

    def on_device_event(self, event: DeviceEvent) -> None:
        """A hint that a managed device (or the set of devices) changed: re-read and converge.
        Events of unrelated devices are ignored."""
        log.debug("device event %s", event)
        obs = self.engine.view.observation
        ours = {g.pci for g in obs.gpus} | {c.address for g in obs.gpus for c in g.companions}
        if event.action not in ("add", "remove", "rescan") and event.subsystem != "vfio" and event.address not in ours:
            return
        gpu, text = describe_device_event(event, obs.gpus)
        self.bus.publish("device", text, gpu=gpu)
        self.engine.kick(f"udev {event.action}")

    def _update_status(self) -> None:
        view = self.engine.view
        self.notifier.status(status_line.of(view))
        leased = tuple(r.id for r in view.leases)  # a lease or release changes what both show
        key = (view.passes, view.phase, view.layout_errors, leased)
        if self.args.metrics_textfile and key != self._metrics_key:  # after a pass or a layout change
            self._metrics_key = key
            from gpud.api.metrics import render
            from gpud.api.replies import status_reply

            try:
                render(status_reply(view), view.passes, self.args.metrics_textfile)
            except OSError as e:
                log.warning("metrics not written to %s: %s", self.args.metrics_textfile, e)
        done = view.completed_passes
        # after every pass (and once at start), each lease, and, while no pass is running, each new
        # observation: a lease's instance is read after its record changed, not before. A pass
        # re-reads each GPU after each step while `phase` still says how the last one ended: its
        # observations wait for its end (at 64 GPUs, labels cost milliseconds on the loop each)
        running = view.passes != view.completed_passes
        settled = view.observation if view.phase not in SETTLING_PHASES and not running else None
        if (done, leased) != self._labels_passes or (settled is not None and settled is not self._labels_seen):
            self._labels_passes = (done, leased)
            self._labels_seen = settled
            self._write_labels()
        if self.kube is not None and done != self._kube_passes and view.phase not in SETTLING_PHASES:
            self._kube_passes = done  # report a pass the agent did not start itself on the node
            assert self.kube_applier is not None  # made with the agent
            self._spawn(self.kube.settled(self.kube_applier.outcome()))
            self._spawn(self.kube.publish_workloads(view.workloads()))

    def _write_labels(self) -> None:
        """The node's labels after every pass (the writer leaves an unchanged file alone)."""
        view = self.engine.view
        if self._versions is None:
            try:
                self._versions = Versions(driver=self.engine.versions.driver(), cuda=self.engine.versions.cuda())
            except NvmlError:  # no driver yet, or closed during a rebind: the next pass asks again
                pass
        rebooting = self.kube_applier.reboot_requested if self.kube_applier is not None else False
        state = layout_state(view.phase, rebooting=rebooting)
        self.labels.write(self.labels.inputs(view.observation.gpus, workloads=view.workloads(),
                                             layout=view.selected, state=state, versions=self._versions or Versions()))

    async def _start_with_remembered_layout(self) -> bool:
        """--kube-node: the layout the node's label selected before this start is put in force at
        once, so a reboot's MIG instances and vGPUs are rebuilt before the API server answers; the
        label, once read, decides again (the same name: nothing to do)."""
        assert self.kube is not None and self.kube_applier is not None  # --kube-node
        name = self.kube_applier.remembered()
        if name is None:
            return False
        if not await self.engine.choose_layout(name):
            await self.engine.choose_layout(None)
            self.bus.publish("kube", f"the node label's last layout {name!r} is not valid now; waiting for the label")
            return False
        self.kube.selected_once.set()
        self.kube.boot_window = self.engine.after_boot
        self.bus.publish("kube", f"layout {name!r} (the node label's before this start) in force until the label is read")
        return True

    async def _run_after_selection(self) -> None:
        """--kube-node: no pass before the node's label has chosen the layout (a file edit or a
        device event meanwhile is remembered and runs then)."""
        assert self.kube is not None  # only with --kube-node
        await self.kube.selected_once.wait()
        await self.engine.run(self.args.pass_debounce)

    def _reload_on_sighup(self, handler: RequestHandler) -> None:
        """`kill -HUP`: re-read the file. The loop keeps only weak references to tasks, so the
        reload task is held here until it ends, or it could be collected half-way."""
        self._spawn(handler.op_reload())

    async def watchdog(self, interval: float) -> None:
        """Pinged from the loop itself, so a stuck loop stops the pings and systemd restarts us."""
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    # ---- life cycle --------------------------------------------------------------------------
    async def run(self) -> int:
        from gpud.api.server import serve
        from gpud.host.systemd.sd_notify import listen_socket

        loop = asyncio.get_running_loop()
        self.engine.subscribe(self._update_status)
        try:
            self.hw.nvml.open()
        except NvmlError as e:  # no nvidia driver (every GPU on vfio-pci, or none yet): serve anyway
            log.warning("NVML not available: %s", e)
        if not self.args.read_only:  # no write of ours races a helper an earlier gpud left writing
            from gpud.host.kernel.writer_leftovers import end_leftovers

            for left in await asyncio.to_thread(end_leftovers, self.hw.sysfs.root):
                what = f"the writer of {left.value} to {left.relpath} (pid {left.pid}) left by an earlier gpud"
                fate = "ended" if left.ended else "still blocked in the kernel; its device waits for it"
                self.bus.publish("warning", f"{what}: {fate}", gpu=left.pci)
        await self.engine.load()
        await self.engine.start_leases()  # lease records against NVML before anyone can ask (engine.leases.startup)
        if self.args.dra:
            from gpud.engine.dra.service import DraService

            a = self.args
            self.dra = DraService(self.engine, self.bus, node=a.kube_node or "", driver=a.dra_driver,
                                  kubelet_root=a.kubelet_root, kubeconfig=a.kubeconfig,
                                  state_dir=None if a.read_only else a.state_dir, cdi_dir=a.cdi_dir,
                                  root=self.host.root, boot_id_path=self.host.boot_id_path)
            await self.dra.start()
        handler = RequestHandler(self.engine, notifier=self.notifier, dev_root=self.host.dev_root,
                                 loop_lag=self.loop_lag, labels=self.labels, kube_agent=self.kube,
                                 dra=self.dra)
        try:
            server = await serve(handler, self.args.socket, sock=listen_socket(), group=self.args.socket_group)
        except OSError as e:
            raise RuntimeError(f"cannot serve on {self.args.socket}: {e.strerror or e}") from e
        feed = None
        if self.args.status_replica:
            feed = handler.status_feed(status_socket(self.args.socket), server.gpud_gid, like=self.args.socket)
            self.engine.subscribe(feed.changed)
        events = self.device_events(self.on_device_event)
        try:
            events.start(loop)
        except Exception as e:  # noqa: BLE001 - no libudev, no netlink (some containers): serve anyway, say so
            log.warning("device events unavailable (%s): hardware changes are seen on the next request", e)
            self.bus.publish("warning", f"device events unavailable: {e}")
        self.engine.refresh_now()  # the first state, before READY
        tasks = [
            asyncio.create_task(self.engine.run(self.args.pass_debounce) if self.kube is None
                                else self._run_after_selection(),
                                name="reconciler"),
            asyncio.create_task(self.watch_config(), name="inotify"),
            asyncio.create_task(self.loop_lag.run(), name="loop-lag"),
        ]
        if self.kube is not None:
            tasks.append(asyncio.create_task(self.kube.run(), name="kube"))
        if feed is not None:
            tasks.append(asyncio.create_task(feed.run(), name="status-replica"))
        if self.dra is not None:
            tasks.append(asyncio.create_task(self.dra.run(), name="dra"))
        interval = self.notifier.watchdog_interval()
        if interval:
            tasks.append(asyncio.create_task(self.watchdog(interval), name="watchdog"))
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        if self.args.sim:
            # Fault injection for the simulated host only: a stalled event loop, as a hung driver
            # call would cause, so the systemd watchdog can be seen to restart us.
            loop.add_signal_handler(signal.SIGUSR2, _stall_forever)
        loop.add_signal_handler(signal.SIGHUP, self._reload_on_sighup, handler)
        if take_sighup():  # one came during start-up (gpud.host.systemd.early_signals): honour it now
            log.info("SIGHUP during start-up: re-reading the layout")
            self._reload_on_sighup(handler)
        if self.kube is None or await self._start_with_remembered_layout():
            ticket = self.engine.kick("start")  # with --kube-node, the node's label picks the layout first
            await self._converge_before_ready(ticket)
        self._update_status()
        self.notifier.ready()
        log.info("gpud %s ready: socket %s, %d GPU(s)%s", VERSION, self.args.socket,
                 len(self.engine.view.observation.gpus), " (read-only)" if self.args.read_only else "")
        stopped = await self._wait_stop_or_failure(tasks)
        # A stop is not a rollback: the hardware stays as it is.
        self.notifier.stopping()
        events.stop()
        for t in tasks:
            t.cancel()
        if not await self.engine.finish(timeout=self.args.stop_step_wait_s):
            log.warning("a hardware step is still running; NVML is left open for it")
        else:
            self.hw.nvml.close()
        # The helpers of stuck unbinds were abandoned, not forgotten: none may outlive the daemon.
        from gpud.host.kernel.deadline_write import end_stuck_writes

        for sw in await asyncio.to_thread(end_stuck_writes, self.args.stuck_writer_wait_s):
            log.warning("the writer of %s (pid %d) is still blocked in the kernel; killed, it ends when "
                        "the kernel lets its write return", sw.path, sw.pid)
        if feed is not None:
            await feed.close()
        await server.close()
        if self.dra is not None:
            await self.dra.stop()
        self.labels.remove()  # labels describe a running gpud's work: they go with it
        if self.kube is not None:
            await self.kube.api.close()
        log.info("gpud stopped; hardware left as it is")
        return 0 if stopped else 1

    async def _converge_before_ready(self, ticket: int) -> None:
        """When the first pass has anything to change (after a reboot: MIG instances, VFs, vGPUs
        and driver overrides are gone; or a file edited while gpud was stopped), READY=1 waits for
        it (at most `first_pass_wait_s`, the start timeout extended meanwhile), so the units ordered after
        gpud.service (Before= in the unit: kubelet, whose device plugin and DRA driver advertise
        the MIG devices; libvirtd, whose domains name mdev UUIDs and VFs) start on the layout in
        place. The socket answers meanwhile."""
        pending = self.engine.changes_at_start()
        if not pending:
            return
        short = self.engine.vgpus_missing()
        what = f"rebuilding vGPUs of {len(short)} GPU(s)" if short and set(short) == set(pending) \
            else f"converging {len(pending)} GPU(s) before ready"
        log.info("%s: %s", what, ", ".join(pending))
        self.notifier.status(what)
        limit = self.args.first_pass_wait_s
        self.notifier.extend_timeout(int((limit + 30) * 1e6))
        done = asyncio.ensure_future(self.engine.wait(ticket, limit))
        stop = asyncio.ensure_future(self.stopping.wait())  # a stop meanwhile is not held up
        await asyncio.wait({done, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not done.done():
            done.cancel()
            return
        if not done.result():
            # READY promises each GPU's boot work done or failed and said: those still at it are named
            view = self.engine.view
            index = {g.pci: g.index for g in view.observation.gpus}
            unfinished = [f"GPU {index.get(pci, '?')} ({pci}) {st.state if st else 'starting'}"
                          for pci in pending
                          if (st := view.gpu_states.get(pci)) is None or st.state in SETTLING_PHASES]
            still = f"; still at work: {', '.join(unfinished)}" if unfinished else ""
            log.warning("the first pass did not end within %g s; ready anyway, it goes on%s", limit, still)
            self.bus.publish("warning", f"the first pass did not end within {limit:g} s of start; ready anyway{still}")

    async def _wait_stop_or_failure(self, tasks: list[asyncio.Task]) -> bool:
        """True on a requested stop; False when an event source died (systemd then restarts us,
        rather than gpud running on deaf to file edits or device events)."""
        stop = asyncio.ensure_future(self.stopping.wait())
        done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
        if stop in done:
            return True
        stop.cancel()
        for t in done:
            exc = t.exception() if not t.cancelled() else None
            log.error("%s stopped unexpectedly: %r", t.get_name(), exc)
        return False


def _names_of(path: Path) -> set[str]:
    """The entries of `path`'s directory whose change changes what `path` reads: its own name and,
    when it is a relative link through an entry of the same directory (`..data/config.yaml`), that
    entry's name."""
    names = {path.name}
    try:
        target = os.readlink(path)
    except OSError:  # not a link, or gone
        return names
    first = Path(target).parts[0] if target and not os.path.isabs(target) else None
    if first not in (None, ".", ".."):
        names.add(first)
    return names


STATE_LOCK = "gpud.pid"  # in the state dir: held (flock) by the one gpud that uses it, its pid inside


def hold_state_dir(state_dir: str) -> int:
    """Take the state dir for this process, or RuntimeError naming the gpud that has it: two
    daemons on one state dir would each trust files the other rewrites under it. The lock is the
    kernel's (flock, released when the holder dies, however it dies); the pid is only for the
    message. Returns the descriptor, to be kept open for the daemon's life."""
    import fcntl

    path = os.path.join(state_dir, STATE_LOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    except OSError as e:
        raise RuntimeError(f"cannot take the state dir {state_dir}: {path}: {e.strerror}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        who = f"pid {held}" if held.isdigit() else "another process"
        raise RuntimeError(f"another gpud ({who}) is running on the state dir {state_dir} ({path} is locked); "
                           "one state dir serves one daemon") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _stall_forever() -> None:
    log.warning("SIGUSR2 under --sim: stalling the event loop (watchdog test)")
    threading.Event().wait()


def main(argv: list[str] | None = None) -> int:
    hold_sighup()  # `python -m gpud.daemon` comes here first; gpud.main has done it already
    args = parse_args(sys.argv[1:] if argv is None else argv)
    faulthandler.enable()  # a watchdog SIGABRT then prints every thread's stack to the journal
    # Host reads and hardware steps run in worker threads; while one runs Python code (pynvml's
    # wrappers, the simulator's NVML), the loop thread waits for the GIL up to the switch
    # interval after every system call it makes (5 ms by default), which every client would feel.
    sys.setswitchinterval(switch_interval(len(os.sched_getaffinity(0))))
    # What start-up made (every module, its tables, the parsed arguments) lives as long as the
    # process: moved out of the collector's reach (gc.freeze, Python's docs), a full collection no
    # longer walks it. A full collection holds the GIL from start to end, however short the switch
    # interval: at 64 GPUs each took up to 25 ms, and the status p99 during an apply fell from
    # 10.5-11.1 to 6.5-7.3 ms with the freeze (bench/scale_bench.py, alternating runs).
    gc.freeze()
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(Daemon(args).run())
    except KeyboardInterrupt:
        return 0
    except (OSError, RuntimeError) as e:
        log.error("%s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
