"""Runs inside the container twice: unconfined, and in a unit with gpud.service's sandbox.
Prints {check: "ok" | error} as JSON; the test compares the two runs."""

import asyncio
import ctypes
import json
import os
import socket
import sys


def check(results, name, fn):
    try:
        fn()
        results[name] = "ok"
    except Exception as e:  # noqa: BLE001 - the error is the result
        results[name] = f"{type(e).__name__}: {e}"


def ctypes_callback():
    libc = ctypes.CDLL(None)
    cmp = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))
    arr = (ctypes.c_int * 4)(3, 1, 4, 2)
    libc.qsort(arr, 4, ctypes.sizeof(ctypes.c_int), cmp(lambda a, b: a[0] - b[0]))
    assert list(arr) == [1, 2, 3, 4]


def imports():
    import dbus_fast  # noqa: F401  (C extensions under MDWE)

    import gpud.daemon  # noqa: F401


def udev_netlink():
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, 15)  # KOBJECT_UEVENT
    s.bind((0, 2))  # the udev multicast group
    s.close()


def rcvbufforce():
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 15)
    s.setsockopt(socket.SOL_SOCKET, 33, 128 * 1024 * 1024)  # SO_RCVBUFFORCE needs CAP_NET_ADMIN
    s.close()


def inet():
    socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()


def write(path):
    def f():
        with open(path, "w") as fh:
            fh.write("x")
        os.unlink(path)
    return f


def other_users_fds(pid):
    def f():
        links = [os.readlink(f"/proc/{pid}/fd/{n}") for n in os.listdir(f"/proc/{pid}/fd")]
        assert links, "no fds"
    return f


def drain(unit):
    def f():
        from gpud.host.systemd.unit_drain import UnitDrainer

        async def go():
            async with UnitDrainer(job_timeout=30) as d:
                async with d.drained([unit]) as stopped:
                    assert stopped == [unit], stopped
                    assert await d.active_state(unit) == "inactive"
                assert await d.active_state(unit) == "active"
        asyncio.run(go())
    return f


def can_reboot():
    from dbus_fast import BusType, Message
    from dbus_fast.aio import MessageBus

    async def go():
        bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
        r = await bus.call(Message(destination="org.freedesktop.login1", path="/org/freedesktop/login1",
                                   interface="org.freedesktop.login1.Manager", member="CanReboot"))
        bus.disconnect()
        assert r.body == ["yes"], r.body
    asyncio.run(go())


def gpud_writes() -> dict[str, str]:
    """A probe file beside every file gpud writes as a service, from gpud's own defaults, so a
    path added there is probed here too (the metrics directory is the README's example)."""
    from gpud.hardware import APPLY_LOCK, NFD_FEATURES, UDEV_RULES
    from gpud.host.nvidia.cdi import DEFAULT_SPEC

    dirs = {"apply-lock": APPLY_LOCK, "udev-rules": UDEV_RULES, "nfd-features": NFD_FEATURES,
            "cdi-spec": DEFAULT_SPEC, "metrics-textfile": "/var/lib/prometheus/node-exporter/gpud.prom"}
    return {k: os.path.join(os.path.dirname(v), "gpud-probe") for k, v in dirs.items()}


if __name__ == "__main__":
    out_path, nobody_pid, unit = sys.argv[1:4]
    r: dict[str, object] = {}
    check(r, "ctypes-callback", ctypes_callback)
    check(r, "imports", imports)
    check(r, "udev-netlink", udev_netlink)
    check(r, "so-rcvbufforce", rcvbufforce)
    check(r, "af-inet", inet)
    check(r, "write-etc-gpud", write("/etc/gpud/probe"))
    check(r, "write-usr", write("/usr/probe"))
    check(r, "write-var-lib-gpud", write("/var/lib/gpud/probe"))
    check(r, "write-run-gpud", write("/run/gpud/probe"))
    check(r, "write-run-lock", write("/run/lock/probe"))
    for name, path in gpud_writes().items():
        check(r, f"write-{name}", write(path))
    check(r, "other-users-fds", other_users_fds(int(nobody_pid)))
    check(r, "drain-over-dbus", drain(unit))
    check(r, "logind-can-reboot", can_reboot)
    with open(out_path, "w") as f:
        json.dump(r, f)
