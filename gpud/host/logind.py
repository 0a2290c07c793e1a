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
from dataclasses import asdict, dataclass

from gpud.host.atomic_file import remove_file, replace_file
from gpud.host.unit_drain import SystemdError

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
