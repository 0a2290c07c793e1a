"""gpud: wiring. Picks the real host or the simulator once, then runs the event sources (the
config file via inotify, device events via udev, the socket, signals) around the reconciler.

Nothing here polls hardware in a loop: passes run on start, on a valid change of the file, on a
device event, on a holder's exit, and on request.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
import sys
import threading
from functools import partial
from pathlib import Path

from gpud import VERSION
from gpud.api.handlers import RequestHandler
from gpud.engine.apply_lock import ApplyLock
from gpud.device_events import DeviceEventSourceFactory
from gpud.engine.events import EventBus
from gpud.engine.reconciler import Hardware, Reconciler
from gpud.engine.udev_rules import UdevRules
from gpud.host.nvml import Nvml, NvmlError
from gpud.host.procs import Procs
from gpud.host.sysfs import Sysfs

log = logging.getLogger("gpud")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gpud", description="Converge NVIDIA GPUs to /etc/gpud/layout.yaml.")
    ap.add_argument("--config", default="/etc/gpud/layout.yaml")
    ap.add_argument("--socket", default="/run/gpud/gpud.sock")
    ap.add_argument("--state-dir", default="/var/lib/gpud")
    ap.add_argument("--sim", metavar="DIR", help="drive the simulated host in DIR (made by gpud-sim create)")
    ap.add_argument("--read-only", action="store_true", help="observe and plan; refuse every mutating call")
    ap.add_argument("--replay", metavar="CAPTURE", help="with --sim DIR --read-only: NVML answers from a real "
                    "GPU's capture (DIR laid out by python -m gpud.sim.replay_nvml CAPTURE DIR)")
    ap.add_argument("--lock", help="host-wide apply lock (default /run/lock/gpud-apply.lock, or DIR/apply.lock with --sim)")
    ap.add_argument("--socket-group", default="gpud", help="group allowed to read status (default gpud)")
    ap.add_argument("--udev-rules", help="udev rules file that keeps passthrough GPUs off nvidia at boot "
                    "(default /etc/udev/rules.d/70-gpud-vfio.rules, or DIR/etc/udev/rules.d/... with --sim)")
    ap.add_argument("--metrics-textfile", help="write Prometheus metrics to this file (node exporter's "
                    "textfile collector, e.g. /var/lib/prometheus/node-exporter/gpud.prom)")
    ap.add_argument("--unbind-timeout", type=float, default=30.0, help="seconds before an unbind is declared stuck")
    ap.add_argument("--log-level", default=os.environ.get("GPUD_LOG_LEVEL", "INFO"))
    ap.add_argument("--version", action="version", version=f"gpud {VERSION}")
    args = ap.parse_args(argv)
    if args.replay and not (args.sim and args.read_only):
        ap.error("--replay needs --sim DIR and --read-only: a capture can be read, not changed")
    return args


def build_hardware(args: argparse.Namespace) -> tuple[Hardware, DeviceEventSourceFactory, str]:
    """The one seam between a real host and the simulator: returns the adapters, the device event
    source to start (udev, or the simulator's datagram socket) and the lock path; fills in the
    defaults that differ between a real host and the simulator."""
    if args.sim:
        from gpud import sim
        from gpud.sim.uevents import SimEvents

        host = sim.install(args.sim)
        if args.replay:
            from gpud.sim import replay_nvml

            replay_nvml.install(args.replay)
        hw = Hardware(
            sysfs=Sysfs(str(host.sys_root), read_only=args.read_only, store=host.store, modprobe=host.modprobe),
            nvml=Nvml(read_only=args.read_only, proc_root=str(host.proc_root)),
            procs=Procs(str(host.proc_root), str(host.dev_root), read_only=args.read_only, store=host.store),
        )
        args.udev_rules = args.udev_rules or str(Path(args.sim) / "etc/udev/rules.d/70-gpud-vfio.rules")
        args.dev_root = str(host.dev_root)
        return hw, partial(SimEvents, socket_path=host.uevent_socket), args.lock or str(Path(args.sim) / "apply.lock")
    args.udev_rules = args.udev_rules or "/etc/udev/rules.d/70-gpud-vfio.rules"
    args.dev_root = "/dev"
    hw = Hardware(sysfs=Sysfs("/sys", read_only=args.read_only), nvml=Nvml(read_only=args.read_only), procs=Procs(read_only=args.read_only))
    from gpud.host.udev import UdevEvents

    return hw, UdevEvents, args.lock or "/run/lock/gpud-apply.lock"


class Daemon:
    def __init__(self, args: argparse.Namespace) -> None:
        from gpud.host.logind import request_reboot
        from gpud.host.sd_notify import Notifier

        self.args = args
        self.notifier = Notifier()
        self.bus = EventBus()
        self.hw, self.device_events, lock_path = build_hardware(args)
        self.rec = Reconciler(
            self.hw, config_path=args.config, apply_lock=ApplyLock(lock_path), bus=self.bus,
            read_only=args.read_only, binder_timeout=args.unbind_timeout,
            udev_rules=UdevRules(args.udev_rules, modules_load_path=None, read_only=args.read_only),
            state_dir=args.state_dir, rebooter=request_reboot,
        )
        Path(args.state_dir).mkdir(parents=True, exist_ok=True)
        self.stopping = asyncio.Event()
        self._reload_timer: asyncio.TimerHandle | None = None
        self._metrics_key: tuple | None = None
        self._background: set[asyncio.Future] = set()  # tasks nothing else references

    # ---- event sources ---------------------------------------------------------------------
    async def watch_config(self) -> None:
        """Editors save in place, by atomic rename, or delete and re-create: watch the directory."""
        from asyncinotify import Inotify, Mask

        path = Path(self.args.config).absolute()
        mask = Mask.CLOSE_WRITE | Mask.MOVED_TO | Mask.MOVED_FROM | Mask.CREATE | Mask.DELETE
        with Inotify() as ino:
            ino.add_watch(path.parent, mask)
            async for event in ino:
                if event.name is not None and str(event.name) == path.name:
                    self._schedule_reload(f"{path.name}: {event.mask!r}")

    def _schedule_reload(self, why: str, delay: float = 0.3) -> None:
        loop = asyncio.get_running_loop()
        if self._reload_timer is not None:
            self._reload_timer.cancel()
        self._reload_timer = loop.call_later(delay, self._reload, why)

    def _reload(self, why: str) -> None:
        log.info("config changed (%s)", why)
        if not self.rec.reload("layout changed"):
            self.rec.refresh()  # status shows the errors at once

    def on_device_event(self, event) -> None:
        """A hint that a managed device (or the set of devices) changed: re-read and converge.
        Events of unrelated devices are ignored."""
        log.debug("device event %s", event)
        obs = self.rec.observation
        ours = {g.pci for g in obs.gpus} | {c.address for g in obs.gpus for c in g.companions}
        if event.action not in ("add", "remove", "rescan") and event.subsystem != "vfio" and event.address not in ours:
            return
        self.bus.publish("device", f"{event.action} {event.subsystem} {event.address or ''}".strip(),
                         gpu=event.address)
        self.rec.kick(f"udev {event.action}")

    def _update_status(self) -> None:
        self.notifier.status(self.rec.summary())
        key = (self.rec.passes, self.rec.phase, tuple(self.rec.layout_issues[0]))
        if self.args.metrics_textfile and key != self._metrics_key:  # after a pass or a layout change
            self._metrics_key = key
            from gpud.api.metrics import render
            from gpud.api.replies import status_reply

            try:
                render(status_reply(self.rec), self.rec.passes, self.args.metrics_textfile)
            except OSError as e:
                log.warning("metrics not written to %s: %s", self.args.metrics_textfile, e)

    def _reload_on_sighup(self, handler: RequestHandler) -> None:
        """`kill -HUP`: re-read the file. The loop keeps only weak references to tasks, so the
        reload task is held here until it ends, or it could be collected half-way."""
        task = asyncio.ensure_future(handler.op_reload())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def watchdog(self, interval: float) -> None:
        """Pinged from the loop itself, so a stuck loop stops the pings and systemd restarts us."""
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    # ---- life cycle --------------------------------------------------------------------------
    async def run(self) -> int:
        from gpud.api.server import serve
        from gpud.host.sd_notify import listen_socket

        loop = asyncio.get_running_loop()
        self.rec.drainer = await _connect_drainer(self.bus)
        self.rec.on_change(self._update_status)
        try:
            self.hw.nvml.open()
        except NvmlError as e:  # no nvidia driver (every GPU on vfio-pci, or none yet): serve anyway
            log.warning("NVML not available: %s", e)
        self.rec.load_config()
        handler = RequestHandler(self.rec, notifier=self.notifier, dev_root=self.args.dev_root)
        try:
            server = await serve(handler, self.args.socket, sock=listen_socket(), group=self.args.socket_group)
        except OSError as e:
            raise RuntimeError(f"cannot serve on {self.args.socket}: {e.strerror or e}") from e
        events = self.device_events(self.on_device_event)
        try:
            events.start(loop)
        except Exception as e:  # no libudev, no netlink (some containers): serve anyway, say so
            log.warning("device events unavailable (%s): hardware changes are seen on the next request", e)
            self.bus.publish("warning", f"device events unavailable: {e}")
        self.rec.refresh()  # the first state, before READY
        tasks = [
            asyncio.create_task(self.rec.run(), name="reconciler"),
            asyncio.create_task(self.watch_config(), name="inotify"),
        ]
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
        self.rec.kick("start")
        self._update_status()
        self.notifier.ready()
        log.info("gpud %s ready: socket %s, %d GPU(s)%s", VERSION, self.args.socket,
                 len(self.rec.observation.gpus), " (read-only)" if self.args.read_only else "")
        stopped = await self._wait_stop_or_failure(tasks)
        # A stop is not a rollback: the hardware stays as it is.
        self.notifier.stopping()
        events.stop()
        for t in tasks:
            t.cancel()
        if not await self.rec.finish_steps(timeout=60):
            log.warning("a hardware step is still running; NVML is left open for it")
        else:
            self.hw.nvml.close()
        await server.close()
        log.info("gpud stopped; hardware left as it is")
        return 0 if stopped else 1

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


async def _connect_drainer(bus: EventBus):
    """The system bus is where GPU client units are stopped and started; without one (a dev
    machine, a container) policy.drain-units cannot be honoured and says so when used."""
    from gpud.host.unit_drain import UnitDrainer

    try:
        return await asyncio.wait_for(UnitDrainer.connect(on_event=lambda m: bus.publish("drain", str(m))), 5)
    except Exception as e:  # no bus socket, refused, timed out
        log.info("system D-Bus not available (%s): policy.drain-units cannot be used", e)
        return None


def _stall_forever() -> None:
    log.warning("SIGUSR2 under --sim: stalling the event loop (watchdog test)")
    threading.Event().wait()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    faulthandler.enable()  # a watchdog SIGABRT then prints every thread's stack to the journal
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
