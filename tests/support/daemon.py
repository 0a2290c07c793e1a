"""A real gpud process on a simulated host, driven through the real gpudctl: the driver the daemon,
kube, gpu and nvmlc tests share (the `daemon` fixture of tests/daemon/conftest.py makes them)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from gpud.sim import cli as simcli

ROOT = Path(__file__).resolve().parents[2]


def wait_until(cond, timeout: float = 30.0, what: str = "condition"):
    """Bounded wait for a condition the daemon reaches asynchronously (never a timing assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def until_ready(d: Daemon, sock: socket.socket, messages: list[str], limit: float = 150.0) -> None:
    """Read sd_notify datagrams from `sock` into `messages` until one says READY=1 (bounded:
    failing with the daemon's log tail after `limit` seconds)."""
    sock.settimeout(5)
    deadline = time.monotonic() + limit
    while not any("READY=1" in m.split("\n") for m in messages):
        assert time.monotonic() < deadline, f"no READY=1; got {messages}\n" + d.log.read_text()[-3000:]
        try:
            messages.append(sock.recv(4096).decode())
        except TimeoutError:
            continue


@contextlib.contextmanager
def notified(d: Daemon) -> Iterator[socket.socket]:
    """`d` started with a NOTIFY_SOCKET of the test's own: the socket its datagrams arrive on."""
    path = str(d.tmp / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        d.start(notify_socket=path)
        yield sock


def start_until_ready(d: Daemon, limit: float = 150.0) -> list[str]:
    """Start `d` with a NOTIFY_SOCKET of the test's own; its datagrams up to READY=1."""
    messages: list[str] = []
    with notified(d) as sock:
        until_ready(d, sock, messages, limit)
    return messages


class Daemon:
    def __init__(self, tmp: Path, gpus: list[str], layout: str, extra_args: Sequence[str] = (),
                 nvswitch: bool = False, vgpu: str | None = None, persistence: str = "legacy",
                 fabric_manager: str = "running", driver: str | None = None, cdmm: bool = False) -> None:
        self.tmp = tmp
        self.host = tmp / "host"
        simcli.create(self.host, gpus, nvswitch=nvswitch, vgpu=vgpu, persistence=persistence,
                      fabric_manager=fabric_manager, driver=driver, cdmm=cdmm)
        self.config = tmp / "etc" / "layout.yaml"
        self.config.parent.mkdir()
        self.config.write_text(layout)
        self.socket = tmp / "gpud.sock"
        self.log = tmp / "gpud.log"
        self.state_dir = tmp / "state"
        self.extra_args = list(extra_args)
        self.start(mode="w")

    def start(self, mode: str = "a", notify_socket: str | None = None) -> None:
        """Start gpud on this host (again: same state directory, socket and log); `notify_socket`:
        where it sends sd_notify messages (a datagram socket the test reads), else nowhere."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("NOTIFY_SOCKET", None)
        if notify_socket is not None:
            env["NOTIFY_SOCKET"] = notify_socket
        with self.log.open(mode) as log:  # the child has its own descriptor of it
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpud.daemon", "--sim", str(self.host), "--config", str(self.config),
                 "--socket", str(self.socket), "--state-dir", str(self.state_dir), *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            )
        try:
            wait_until(lambda: self.ctl("version").returncode == 0 or self.proc.poll() is not None, what="gpud to answer")
        except AssertionError:
            self.stop()  # never left running past the test that started it
            raise
        if self.proc.poll() is not None:
            raise AssertionError("gpud exited:\n" + self.log.read_text())

    def ctl(self, *args: str, input: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gpud.cli.gpudctl", "--socket", str(self.socket), *args],
                              capture_output=True, text=True, input=input, timeout=timeout, cwd=ROOT)

    def sim(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gpud.sim.cli", args[0], str(self.host), *args[1:]],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)

    def sim_state(self) -> dict:
        """The simulator's own record of the hardware (DIR/state.json), not gpud's view of it."""
        return json.loads((self.host / "state.json").read_text())

    def events(self) -> list[dict]:
        r = self.ctl("events", "--json")
        assert r.returncode == 0, r.stderr
        return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]

    def status(self) -> dict:
        r = self.ctl("status", "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def mutating_calls(self) -> int:
        from tests.support.simrig import MUTATING

        calls = json.loads(self.sim("stats", "--json").stdout)["calls"]
        return sum(calls.get(f, 0) for f in MUTATING)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class DaemonOn(Daemon):
    """gpud on a host that already exists (the tests' Daemon makes its own)."""

    def __init__(self, tmp: Path, host: Path, layout: str, extra_args: Sequence[str] = ()) -> None:
        self.tmp, self.host = tmp, host
        self.config = tmp / "etc" / "layout.yaml"
        self.config.parent.mkdir(parents=True, exist_ok=True)
        self.config.write_text(layout)
        self.socket, self.log, self.state_dir = tmp / "gpud.sock", tmp / "gpud.log", tmp / "state"
        self.extra_args = list(extra_args)
        self.start(mode="w")
