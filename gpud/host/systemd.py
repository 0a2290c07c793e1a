"""gpud's side of systemd: readiness/watchdog notifications, draining GPU client units over
D-Bus around disruptive steps, and reboots through logind.

sd_notify is spoken directly (a datagram on $NOTIFY_SOCKET) so the daemon needs no libsystemd
binding; D-Bus goes through dbus-fast on the system bus. Nothing here may block the event loop
for long: the watchdog pings come from that loop, so a stuck loop must mean a stuck daemon.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import logging
import os
import select
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import asdict, dataclass

from gpud.host.atomic_file import remove_file, replace_file

log = logging.getLogger("gpud.systemd")

# Variables systemd hands to the service itself; a child that inherited them could send
# notifications or pick up our listening socket.
SERVICE_ONLY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
SD_LISTEN_FDS_START = 3


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of the environment for child processes, without the service-only variables."""
    src = os.environ if env is None else env
    return {k: v for k, v in src.items() if k not in SERVICE_ONLY_ENV and not k.startswith("LISTEN_")}


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec=), or None when no watchdog is
    armed for this process (unset, zero, or WATCHDOG_PID names another process)."""
    src = os.environ if env is None else env
    try:
        usec = int(src.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = src.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return usec / 2 / 1_000_000


def listen_socket(env: Mapping[str, str] | None = None, *, unset: bool = True) -> socket.socket | None:
    """The socket passed by gpud.socket (fd 3), or None when not socket-activated.

    Like sd_listen_fds(1), the LISTEN_* variables are removed from os.environ by default so
    that nothing started later mistakes fd 3 for its own."""
    src = os.environ if env is None else env
    try:
        pid = int(src.get("LISTEN_PID", ""))
        nfds = int(src.get("LISTEN_FDS", ""))
    except ValueError:
        return None
    if unset and env is None:
        for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            os.environ.pop(k, None)
    if pid != os.getpid() or nfds < 1:
        return None
    if nfds > 1:
        log.warning("socket activation passed %d fds; using fd %d only", nfds, SD_LISTEN_FDS_START)
    os.set_inheritable(SD_LISTEN_FDS_START, False)
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        sock.detach()
        raise OSError(f"fd {SD_LISTEN_FDS_START} from socket activation is not a unix stream socket")
    return sock


class Notifier:
    """sd_notify(3) for gpud; every method is a no-op when not started by systemd.

    A lost notification is logged, never raised: the service manager will act on the missing
    READY/WATCHDOG itself, and crashing the daemon over it would be worse."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        src = os.environ if env is None else env
        addr = src.get("NOTIFY_SOCKET") or None
        if addr is not None and addr.startswith("@"):
            addr = "\0" + addr[1:]
        if addr is not None and not addr.startswith(("/", "\0")):
            log.warning("ignoring NOTIFY_SOCKET=%r: not a unix socket path", addr)
            addr = None
        self.address = addr
        self._watchdog_interval = watchdog_interval(src)
        self._sock: socket.socket | None = None

    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings, read at construction (the variables may be
        removed from the environment later)."""
        return self._watchdog_interval

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *fields: str, fds: Iterable[int] = ()) -> bool:
        """Send one datagram of KEY=VALUE lines; True when it was handed to the manager."""
        if self.address is None:
            return False
        data = "\n".join(fields).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            fds = list(fds)
            if fds:
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                self._sock.sendmsg([data], anc, 0, self.address)
            else:
                self._sock.sendto(data, self.address)
            return True
        except OSError as e:
            log.warning("sd_notify %s failed: %s", fields[0].split("=", 1)[0] if fields else "", e)
            return False

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *_status(status))

    def status(self, line: str) -> bool:
        return self.notify(*_status(line))

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *_status(status))

    def reloading(self, status: str | None = None) -> bool:
        """Since systemd 253 the timestamp is required to tell this reload from an older one."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}", *_status(status))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def extend_timeout(self, usec: int) -> bool:
        """Ask for `usec` more from now (start, reload or stop), for long MIG work at start."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(usec)}")

    def barrier(self, timeout: float = 5.0) -> bool:
        """Wait until the manager has processed every earlier notification (sd_notify_barrier):
        it closes the fd we pass with BARRIER=1 after handling what came before."""
        if self.address is None:
            return False
        r, w = os.pipe2(os.O_CLOEXEC)
        try:
            sent = self.notify("BARRIER=1", fds=[w])
            os.close(w)
            w = -1
            if not sent:
                return False
            p = select.poll()
            p.register(r, select.POLLHUP)
            return bool(p.poll(int(timeout * 1000)))
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _status(line: str | None) -> tuple[str, ...]:
    if line is None:
        return ()
    return ("STATUS=" + " ".join(line.split("\n")).strip(),)


# ---- D-Bus: draining units ---------------------------------------------------------------

SYSTEMD = "org.freedesktop.systemd1"
SYSTEMD_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
UNIT = "org.freedesktop.systemd1.Unit"
RUNNING_STATES = frozenset({"active", "reloading", "activating"})


class SystemdError(RuntimeError):
    """A unit operation failed. `stopped` lists units this call stopped before failing, so a
    caller that drains can start them again."""

    def __init__(self, message: str, *, unit: str | None = None, result: str | None = None,
                 stopped: list[str] | None = None) -> None:
        super().__init__(message)
        self.unit = unit
        self.result = result
        self.stopped = list(stopped or [])


class _JobTracker:
    """Results of JobRemoved, kept for units we operate on.

    systemd may emit JobRemoved before our StopUnit call's reply arrives, so a result is
    buffered when no one waits for it yet; entries for a unit are dropped when we are done
    with it, so unrelated jobs never pile up."""

    def __init__(self) -> None:
        self._results: dict[str, tuple[str, str]] = {}
        self._waiters: dict[str, asyncio.Future[tuple[str, str]]] = {}
        self._interest: dict[str, int] = {}

    def watch(self, unit: str) -> None:
        self._interest[unit] = self._interest.get(unit, 0) + 1

    def unwatch(self, unit: str) -> None:
        n = self._interest.get(unit, 0) - 1
        if n > 0:
            self._interest[unit] = n
            return
        self._interest.pop(unit, None)
        for job in [j for j, (u, _) in self._results.items() if u == unit]:
            del self._results[job]

    def feed(self, job: str, unit: str, result: str) -> None:
        fut = self._waiters.pop(job, None)
        if fut is not None:
            if not fut.done():
                fut.set_result((unit, result))
        elif unit in self._interest:
            self._results[job] = (unit, result)

    async def wait(self, job: str, timeout: float) -> str:
        if job in self._results:
            return self._results.pop(job)[1]
        fut = asyncio.get_running_loop().create_future()
        self._waiters[job] = fut
        try:
            async with asyncio.timeout(timeout):
                return (await fut)[1]
        finally:
            self._waiters.pop(job, None)

    def fail_all(self, exc: BaseException) -> None:
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(exc)
        self._waiters.clear()


class UnitDrainer:
    """Stops GPU client units (kubelet, dcgm, ...) around a disruptive step and starts them
    again, through systemd's D-Bus API on the system bus.

    Create it inside the running loop: `drainer = await UnitDrainer.connect()`. Every wait is
    bounded: `call_timeout` per D-Bus call, `job_timeout` per stop/start job."""

    def __init__(self, *, bus_address: str | None = None, job_timeout: float = 120.0,
                 call_timeout: float = 25.0, on_event: Callable[[str], None] | None = None) -> None:
        self.bus_address = bus_address
        self.job_timeout = job_timeout
        self.call_timeout = call_timeout
        self.on_event = on_event
        self._bus = None
        self._jobs = _JobTracker()
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(cls, **kw) -> UnitDrainer:
        d = cls(**kw)
        await d._ensure()
        return d

    async def __aenter__(self) -> UnitDrainer:
        await self._ensure()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        bus, self._bus = self._bus, None
        if bus is not None:
            bus.disconnect()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(bus.wait_for_disconnect(), 5)

    async def _ensure(self):
        """Connect (again, after the bus went away) and subscribe to job signals."""
        if self._bus is not None and self._bus.connected:
            return self._bus
        from dbus_fast import BusType
        from dbus_fast.aio import MessageBus

        self._jobs.fail_all(SystemdError("lost the system bus connection"))
        self._jobs = _JobTracker()
        bus = MessageBus(bus_address=self.bus_address, bus_type=BusType.SYSTEM)
        await asyncio.wait_for(bus.connect(), self.call_timeout)
        bus.add_message_handler(self._on_message)
        self._bus = bus
        rule = (f"type='signal',sender='{SYSTEMD}',path='{SYSTEMD_PATH}',"
                f"interface='{MANAGER}',member='JobRemoved'")
        await self._call("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus",
                         "AddMatch", "s", [rule])
        # JobRemoved is only sent to clients that subscribed.
        await self._call(SYSTEMD, SYSTEMD_PATH, MANAGER, "Subscribe", "", [])
        return bus

    def _on_message(self, msg) -> None:
        from dbus_fast import MessageType

        if (msg.message_type == MessageType.SIGNAL and msg.member == "JobRemoved"
                and msg.interface == MANAGER and msg.path == SYSTEMD_PATH):
            _id, job, unit, result = msg.body
            self._jobs.feed(job, unit, result)

    async def _call(self, dest: str, path: str, iface: str, member: str, sig: str, body: list):
        from dbus_fast import DBusError, Message, MessageType

        bus = self._bus
        if bus is None:
            raise SystemdError("not connected to the system bus")
        msg = Message(destination=dest, path=path, interface=iface, member=member, signature=sig, body=body)
        reply = await asyncio.wait_for(bus.call(msg), self.call_timeout)
        if reply.message_type == MessageType.ERROR:
            raise DBusError._from_message(reply)
        return reply.body

    async def _unit_state(self, unit: str) -> tuple[str, str, str]:
        """(object path, LoadState, ActiveState). LoadUnit, unlike GetUnit, also answers for
        units that are not loaded yet."""
        (path,) = await self._call(SYSTEMD, SYSTEMD_PATH, MANAGER, "LoadUnit", "s", [unit])
        props = "org.freedesktop.DBus.Properties"
        (load,) = await self._call(SYSTEMD, path, props, "Get", "ss", [UNIT, "LoadState"])
        (active,) = await self._call(SYSTEMD, path, props, "Get", "ss", [UNIT, "ActiveState"])
        return path, load.value, active.value

    async def active_state(self, unit: str) -> str:
        await self._ensure()
        return (await self._unit_state(unit))[2]

    async def _job(self, verb: str, unit: str, *, wait: bool = True) -> None:
        """Queue `verb` (StopUnit/StartUnit/RestartUnit) and wait for its JobRemoved."""
        from dbus_fast import DBusError

        self._jobs.watch(unit)
        try:
            try:
                (job,) = await self._call(SYSTEMD, SYSTEMD_PATH, MANAGER, verb, "ss", [unit, "replace"])
            except DBusError as e:
                raise SystemdError(f"{verb} {unit}: {e.text}", unit=unit) from e
            if not wait:
                return
            try:
                result = await self._jobs.wait(job, self.job_timeout)
            except TimeoutError:
                raise SystemdError(f"{verb} {unit}: job {job} did not finish within {self.job_timeout:g}s",
                                   unit=unit, result="timeout") from None
        finally:
            self._jobs.unwatch(unit)
        if result != "done":
            raise SystemdError(f"{verb} {unit}: job result {result}", unit=unit, result=result)

    def _event(self, text: str) -> None:
        log.info("%s", text)
        if self.on_event is not None:
            self.on_event(text)

    async def stop_active(self, units: Iterable[str]) -> list[str]:
        """Stop those of `units` that are running, in the order given; returns the ones stopped.
        Units that are inactive, failed or not installed are left alone (and not started later)."""
        async with self._lock:
            await self._ensure()
            stopped: list[str] = []
            for unit in units:
                try:
                    _, load, active = await self._unit_state(unit)
                    if load != "loaded" or active not in RUNNING_STATES:
                        continue
                    self._event(f"stopping {unit} ({active})")
                    await self._job("StopUnit", unit)
                except SystemdError as e:
                    e.stopped = stopped
                    raise
                except Exception as e:  # D-Bus errors, timeouts, a lost bus
                    raise SystemdError(f"stop {unit}: {e}", unit=unit, stopped=stopped) from e
                stopped.append(unit)
            return stopped

    async def start(self, units: Iterable[str], *, wait: bool = True) -> None:
        """Start each unit and wait for its job; tries all of them before reporting failures.
        wait=False only queues the jobs (used while gpud itself is stopping: a start job of a unit
        ordered after gpud.service waits for gpud's stop job, so waiting here would deadlock)."""
        async with self._lock:
            await self._ensure()
            failed: list[SystemdError] = []
            for unit in units:
                self._event(f"starting {unit}")
                try:
                    await self._job("StartUnit", unit, wait=wait)
                except SystemdError as e:
                    failed.append(e)
                except Exception as e:
                    failed.append(SystemdError(f"start {unit}: {e}", unit=unit))
            if failed:
                first = failed[0]
                raise SystemdError("; ".join(str(e) for e in failed), unit=first.unit, result=first.result)

    async def restart_if_present(self, unit: str) -> bool:
        """RestartUnit when the unit is installed (and not masked); False when it is not."""
        async with self._lock:
            await self._ensure()
            _, load, _ = await self._unit_state(unit)
            if load != "loaded":
                return False
            self._event(f"restarting {unit}")
            await self._job("RestartUnit", unit)
            return True

    @contextlib.asynccontextmanager
    async def drained(self, units: Iterable[str]) -> AsyncIterator[list[str]]:
        """Run the body with `units` stopped; start again what was stopped, also when the body
        (or the stopping itself) fails. Yields the list of units that were stopped."""
        units = list(units)
        try:
            stopped = await self.stop_active(units)
        except SystemdError as e:
            if e.stopped:
                await self._restart_after_failure(e.stopped, e)
            raise
        try:
            yield stopped
        except BaseException as body_exc:
            await self._restart_after_failure(stopped, body_exc)
            raise
        else:
            await self.start(list(reversed(stopped)))

    async def _restart_after_failure(self, stopped: list[str], exc: BaseException) -> None:
        try:
            # Cancelled means the daemon is stopping: queue the starts, they run after our stop job.
            await self.start(list(reversed(stopped)), wait=not isinstance(exc, asyncio.CancelledError))
        except Exception as e:
            log.error("could not start again %s: %s", stopped, e)
            exc.add_note(f"also failed to start again what was drained: {e}")


# ---- logind: reboot -----------------------------------------------------------------------

REBOOT_MARKER = "reboot-request.json"
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


@dataclass(frozen=True)
class RebootRecord:
    """A reboot gpud asked for. `rebooted` is True once the machine came back (the boot id
    changed): the engine then checks whether the change took effect and clears the record."""

    reason: str
    boot_id: str
    requested_at: float  # seconds since the epoch
    rebooted: bool


def current_boot_id(path: str = BOOT_ID_PATH) -> str:
    with open(path) as f:
        return f.read().strip()


def reboot_outcome(state_dir: str, *, boot_id_path: str = BOOT_ID_PATH) -> RebootRecord | None:
    """The pending reboot request, if any, and whether a reboot happened since it was made."""
    try:
        with open(os.path.join(state_dir, REBOOT_MARKER)) as f:
            data = json.load(f)
        return RebootRecord(reason=str(data["reason"]), boot_id=str(data["boot_id"]),
                            requested_at=float(data["requested_at"]),
                            rebooted=str(data["boot_id"]) != current_boot_id(boot_id_path))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as e:
        # An unreadable marker must still stop a loop: treat it as "already rebooted for it".
        log.error("unreadable reboot marker in %s (%s); treating it as a past reboot", state_dir, e)
        return RebootRecord(reason="<unreadable marker>", boot_id="", requested_at=0.0, rebooted=True)


def clear_reboot_request(state_dir: str) -> None:
    """Forget the request (the engine calls this once the change took effect, or an operator
    does after looking at why it did not)."""
    with contextlib.suppress(FileNotFoundError):
        remove_file(os.path.join(state_dir, REBOOT_MARKER))


async def request_reboot(state_dir: str, reason: str, *, bus_address: str | None = None,
                         call_timeout: float = 25.0, boot_id_path: str = BOOT_ID_PATH) -> bool:
    """Ask logind to reboot, unless a reboot for an earlier request already happened and its
    marker was not cleared: then return False, so a change that a reboot did not fix cannot
    reboot the machine over and over. The marker is written (durably) before the call."""
    prior = reboot_outcome(state_dir, boot_id_path=boot_id_path)
    if prior is not None and prior.rebooted:
        log.error("not rebooting for %r: a reboot for %r already happened (boot %s) and its "
                  "marker in %s was not cleared", reason, prior.reason, prior.boot_id, state_dir)
        return False
    record = RebootRecord(reason=reason, boot_id=current_boot_id(boot_id_path),
                          requested_at=time.time(), rebooted=False)
    _write_marker(state_dir, record)
    from dbus_fast import BusType, DBusError, Message, MessageType
    from dbus_fast.aio import MessageBus

    bus = MessageBus(bus_address=bus_address, bus_type=BusType.SYSTEM)
    try:
        await asyncio.wait_for(bus.connect(), call_timeout)
        msg = Message(destination="org.freedesktop.login1", path="/org/freedesktop/login1",
                      interface="org.freedesktop.login1.Manager", member="Reboot",
                      signature="b", body=[False])
        reply = await asyncio.wait_for(bus.call(msg), call_timeout)
        if reply.message_type == MessageType.ERROR:
            raise DBusError._from_message(reply)
    except Exception as e:
        clear_reboot_request(state_dir)
        raise SystemdError(f"logind refused the reboot ({reason}): {e}") from e
    finally:
        bus.disconnect()
    log.warning("reboot requested through logind: %s", reason)
    return True


def _write_marker(state_dir: str, record: RebootRecord) -> None:
    d = asdict(record)
    d.pop("rebooted")
    replace_file(os.path.join(state_dir, REBOOT_MARKER), json.dumps(d).encode() + b"\n", mode=0o600)
