"""Draining the systemd units that use a GPU around a disruptive step, over D-Bus (dbus-fast on
the system bus): stop them, wait for their jobs, start them again afterwards, in reverse order.
dbus-fast is imported only when a drain runs, so a daemon that never drains never loads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any

from gpud.py_compat import add_note
from gpud.py_compat import timeout as time_limit

if TYPE_CHECKING:  # dbus-fast is imported on the first drain, not at start
    from dbus_fast import Message
    from dbus_fast.aio import MessageBus

log = logging.getLogger("gpud.systemd")

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
            async with time_limit(timeout):
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
        self._bus: MessageBus | None = None
        self._jobs = _JobTracker()
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(cls, **kw: Any) -> UnitDrainer:
        d = cls(**kw)
        await d._ensure()
        return d

    async def __aenter__(self) -> UnitDrainer:
        await self._ensure()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        bus, self._bus = self._bus, None
        if bus is not None:
            bus.disconnect()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(bus.wait_for_disconnect(), 5)

    async def _ensure(self) -> None:
        """Connect (again, after the bus went away) and subscribe to job signals."""
        if self._bus is not None and self._bus.connected:
            return
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

    def _on_message(self, msg: Message) -> None:
        from dbus_fast import MessageType

        if (msg.message_type == MessageType.SIGNAL and msg.member == "JobRemoved"
                and msg.interface == MANAGER and msg.path == SYSTEMD_PATH):
            _id, job, unit, result = msg.body
            self._jobs.feed(job, unit, result)

    async def _call(self, dest: str, path: str, iface: str, member: str, sig: str, body: list[Any]) -> list[Any]:
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
                except Exception as e:  # noqa: BLE001 - every unit's failure is collected; they are raised together below
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
        except Exception as e:  # noqa: BLE001 - the drain's own failure is what propagates; this one is noted on it
            log.error("could not start again %s: %s", stopped, e)
            add_note(exc, f"also failed to start again what was drained: {e}")


class ManagerDrainer(UnitDrainer):
    """The same drain over another unit manager than systemd's D-Bus API: `unit_state(unit)`
    answers (LoadState, ActiveState) and `job(verb, unit)` runs StopUnit/StartUnit/RestartUnit
    to its result. The simulated host's unit manager (gpud.sim.services) is driven through this,
    so a drain under --sim orders, fails and restarts exactly as on a real host and never reaches
    the real host's system bus."""

    def __init__(self, unit_state: Callable[[str], tuple[str, str]], job: Callable[[str, str], str], *,
                 on_event: Callable[[str], None] | None = None) -> None:
        super().__init__(on_event=on_event)
        self._manager_state = unit_state
        self._manager_job = job

    async def _ensure(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def _unit_state(self, unit: str) -> tuple[str, str, str]:
        load, active = await asyncio.to_thread(self._manager_state, unit)
        return unit, load, active

    async def _job(self, verb: str, unit: str, *, wait: bool = True) -> None:
        try:
            result = await asyncio.to_thread(self._manager_job, verb, unit)
        except (LookupError, ValueError) as e:
            raise SystemdError(f"{verb} {unit}: {e}", unit=unit) from e
        if result != "done":
            raise SystemdError(f"{verb} {unit}: job result {result}", unit=unit, result=result)


class OnDemandDrainer:
    """A UnitDrainer connected the first time a layout needs it (a drain, or the CDI refresh
    after a MIG change): on hosts whose layouts never drain, D-Bus is neither imported nor
    connected, which keeps the daemon small. Without a system bus (a dev machine, a container)
    a drain fails with the reason and a CDI refresh is reported as not possible."""

    def __init__(self, *, connect_timeout: float = 5.0, on_event: Callable[[str], None] | None = None,
                 bus_address: str | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.on_event = on_event
        self.bus_address = bus_address
        self._drainer: UnitDrainer | None = None

    async def _connected(self) -> UnitDrainer:
        if self._drainer is None:
            try:
                self._drainer = await asyncio.wait_for(
                    UnitDrainer.connect(on_event=self.on_event, bus_address=self.bus_address), self.connect_timeout)
            except Exception as e:  # no bus socket, refused, timed out: said where it is needed
                raise SystemdError(f"the system D-Bus is not reachable ({e or type(e).__name__})") from e
        return self._drainer

    @contextlib.asynccontextmanager
    async def drained(self, units: Iterable[str]) -> AsyncIterator[list[str]]:
        units = list(units)
        try:
            drainer = await self._connected()
        except SystemdError as e:
            raise SystemdError(f"policy.drain-units {units} cannot be honoured: {e}") from e
        async with drainer.drained(units) as stopped:
            yield stopped

    async def restart_if_present(self, unit: str) -> bool:
        try:
            drainer = await self._connected()
        except SystemdError as e:
            log.info("%s not restarted: %s", unit, e)
            if self.on_event is not None:
                self.on_event(f"{unit} not restarted: {e}")
            return False
        return await drainer.restart_if_present(unit)

    async def close(self) -> None:
        if self._drainer is not None:
            await self._drainer.close()
