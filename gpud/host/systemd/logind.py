"""Reboots through logind (D-Bus Reboot on org.freedesktop.login1), guarded by a durable marker
in the state directory so a change that a reboot did not fix cannot reboot the machine over and
over. dbus-fast is imported only when a reboot is asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpud.host.files import state_files
from gpud.host.systemd.unit_drain import SystemdError

log = logging.getLogger("gpud.systemd")

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
    set_aside: str | None = None  # the marker was not gpud's: why (it was set aside, never acted on)


def current_boot_id(path: str = BOOT_ID_PATH) -> str:
    with open(path) as f:
        return f.read().strip()


def _decode_marker(data: bytes) -> tuple[str, str, float]:
    d = json.loads(data)
    if not isinstance(d, dict) or set(d) != {"reason", "boot_id", "requested_at"} or \
            not isinstance(d["reason"], str) or not isinstance(d["boot_id"], str) or not d["boot_id"] or \
            isinstance(d["requested_at"], bool) or not isinstance(d["requested_at"], (int, float)):
        raise state_files.BadStateFile('expected {"reason": str, "boot_id": str, "requested_at": seconds}')
    return d["reason"], d["boot_id"], float(d["requested_at"])


def reboot_outcome(state_dir: str, problems: state_files.Problems | None = None, *,
                   boot_id_path: str = BOOT_ID_PATH) -> RebootRecord | None:
    """The pending reboot request, if any, and whether a reboot happened since it was made.
    A marker that is not a regular file in gpud's format is set aside and returned as a record
    with `set_aside` (and `rebooted`, so no reboot is asked for on the strength of it): the
    caller says so and never reports what a reboot settled."""
    path = os.path.join(state_dir, REBOOT_MARKER)
    problems = problems if problems is not None else state_files.Problems()
    problems.clear(path)
    marker = state_files.load(path, _decode_marker, problems, limit=65536, what="reboot marker")
    if marker is None:
        why = problems.by_file.get(path)  # set aside just now (then the file is gone: said once)
        return None if why is None else RebootRecord(reason="", boot_id="", requested_at=0.0, rebooted=True,
                                                     set_aside=why)
    reason, boot_id, at = marker
    return RebootRecord(reason=reason, boot_id=boot_id, requested_at=at,
                        rebooted=boot_id != current_boot_id(boot_id_path))


def clear_reboot_request(state_dir: str) -> None:
    """Forget the request (the engine calls this once the change took effect, or an operator
    does after looking at why it did not)."""
    with contextlib.suppress(FileNotFoundError):
        state_files.remove(os.path.join(state_dir, REBOOT_MARKER))


async def request_reboot(state_dir: str, reason: str, *, bus_address: str | None = None,
                         call_timeout: float = 25.0, boot_id_path: str = BOOT_ID_PATH,
                         logind: Callable[[str], None] | None = None) -> bool:
    """Ask logind to reboot, unless a reboot for an earlier request already happened and its
    marker was not cleared: then return False, so a change that a reboot did not fix cannot
    reboot the machine over and over. The marker is written (durably) before the call.
    `logind`: another logind than the system bus's (the simulated host's), called with the reason."""
    if not mark_reboot(state_dir, reason, boot_id_path=boot_id_path):
        return False
    if logind is not None:
        try:
            await asyncio.to_thread(logind, reason)
        except Exception as e:
            clear_reboot_request(state_dir)
            raise SystemdError(f"logind refused the reboot ({reason}): {e}") from e
        log.warning("reboot requested through the simulated host's logind: %s", reason)
        return True
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


def mark_reboot(state_dir: str, reason: str, *, boot_id_path: str = BOOT_ID_PATH) -> bool:
    """Write the marker of a reboot about to be asked for; False (and nothing written) when a
    reboot for an earlier request already happened and its marker was not cleared."""
    prior = reboot_outcome(state_dir, boot_id_path=boot_id_path)
    if prior is not None and prior.rebooted:
        log.error("not rebooting for %r: a reboot for %r already happened (boot %s) and its "
                  "marker in %s was not cleared", reason, prior.reason, prior.boot_id, state_dir)
        return False
    _write_marker(state_dir, RebootRecord(reason=reason, boot_id=current_boot_id(boot_id_path),
                                          requested_at=time.time(), rebooted=False))
    return True


def _write_marker(state_dir: str, record: RebootRecord) -> None:
    """Exactly the fields _decode_marker accepts: `rebooted` is derived from the boot id on
    reading, `set_aside` belongs to a foreign marker only."""
    d = {"reason": record.reason, "boot_id": record.boot_id, "requested_at": record.requested_at}
    state_files.save(os.path.join(state_dir, REBOOT_MARKER), json.dumps(d).encode() + b"\n", mode=0o600)
