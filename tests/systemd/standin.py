"""Stand-in services run by the container's systemd, using gpud.host.systemd.sd_notify the way the daemon
does. Each waits on FIFOs the test writes to, so every step is driven by an event.

  standin.py notify DIR     Type=notify: STATUS, then READY after DIR/go; SIGHUP -> RELOADING
                            until DIR/reload-go, then READY
  standin.py watchdog       Type=notify with WatchdogSec=: pings from the asyncio loop; SIGUSR2
                            stalls the loop (as a stuck daemon would)
  standin.py fake-logind F  owns org.freedesktop.login1 and records Reboot() calls in F
"""


import asyncio
import os
import signal
import sys
import time

from gpud.host.systemd.sd_notify import Notifier, child_env


def wait_fifo(path: str) -> str:
    if not os.path.exists(path):
        os.mkfifo(path)
    with open(path) as f:  # blocks until the test opens it for writing
        return f.read().strip()


def notify(d: str) -> None:
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # sys.stdout is a TextIOWrapper here
    n = Notifier()
    assert "NOTIFY_SOCKET" not in child_env()
    n.status("waiting for go")
    n.barrier()
    wait_fifo(os.path.join(d, "go"))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP, signal.SIGTERM})
    n.ready("serving")
    n.barrier()
    while True:
        sig = signal.sigwaitinfo({signal.SIGHUP, signal.SIGTERM})
        if sig.si_signo == signal.SIGTERM:
            n.stopping("stopping")
            return
        n.reloading("reloading")
        n.barrier()
        wait_fifo(os.path.join(d, "reload-go"))
        n.ready("serving, reloaded")
        n.barrier()
        print("reload done", flush=True)


def watchdog() -> None:
    n = Notifier()
    interval = n.watchdog_interval()
    assert interval, "no watchdog armed"

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR2, lambda: time.sleep(3600))  # the loop stalls here
        print(f"started pid={os.getpid()} interval={interval}", flush=True)
        n.ready(f"pinging every {interval}s")
        while True:
            n.watchdog()
            await asyncio.sleep(interval)

    asyncio.run(main())


def fake_logind(record: str) -> None:
    from dbus_fast import BusType
    from dbus_fast.aio import MessageBus
    from dbus_fast.service import ServiceInterface, method

    class Manager(ServiceInterface):
        def __init__(self) -> None:
            super().__init__("org.freedesktop.login1.Manager")

        @method()
        def Reboot(self, interactive: "b") -> None:  # type: ignore[name-defined]  # noqa: F821 - a D-Bus signature, as dbus-fast reads it
            with open(record, "a") as f:
                f.write(f"Reboot interactive={interactive}\n")

        @method()
        def CanReboot(self) -> "s":  # type: ignore[name-defined]  # noqa: F821 - a D-Bus signature
            return "yes"

    async def main() -> None:
        bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
        bus.export("/org/freedesktop/login1", Manager())
        await bus.request_name("org.freedesktop.login1")
        Notifier().ready("fake logind")
        await bus.wait_for_disconnect()

    asyncio.run(main())


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    {"notify": lambda: notify(rest[0]), "watchdog": watchdog, "fake-logind": lambda: fake_logind(rest[0])}[mode]()
