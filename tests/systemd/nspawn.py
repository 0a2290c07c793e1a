"""A real systemd (PID 1, D-Bus, journald, logind) booted in a container, for the service tests.

`systemd-nspawn -D / --volatile=...` boots the host's own /usr, so no image is needed. Readiness
is an event, not a guess: nspawn runs with --notify-ready=yes and a NOTIFY_SOCKET of ours, and
forwards READY=1 once the container's systemd has finished starting up. Commands run inside with
`nsenter -t <container PID 1> -a -r -w`: its root and working directory too, since entering the
mount namespace alone lands in that namespace's first root, which is not the container's when
the tests themselves run chrooted (scripts/fresh-check).
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tests.support.present import present

REPO = Path(__file__).resolve().parents[2]
CLEAN_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
             "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0", "TERM": "dumb"}


def missing_prerequisites() -> str | None:
    """Why the nspawn tests cannot run here (None when they can)."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("systemd-nspawn", "nsenter", "dbus-daemon"):
        if shutil.which(tool) is None:
            return f"{tool} not installed"
    if not Path("/usr/lib/systemd/systemd").exists() and not Path("/lib/systemd/systemd").exists():
        return "systemd not installed"
    return None


def python_binds() -> list[str]:
    """Read-only binds that make this test run's interpreter and the repository usable inside
    the container at the same paths (--volatile=yes only brings /usr from the host)."""
    paths = {str(REPO), os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}
    out = []
    for p in sorted(paths):
        if not p.startswith("/usr/") and p != "/usr":
            out.append(p)
    # Keep the shortest distinct prefixes only.
    kept: list[str] = []
    for p in out:
        if not any(p == k or p.startswith(k + "/") for k in kept):
            kept.append(p)
    return kept


class Container:
    """One booted container. Use as a context manager; `stop()` is bounded and idempotent."""

    def __init__(self, *, volatile: str = "yes", binds_ro: list[str] | None = None,
                 binds: list[str] | None = None, overlay_usr: bool = False,
                 boot_timeout: float = 120.0) -> None:
        self.name = "gpudtest-" + uuid.uuid4().hex[:8]
        self.volatile = volatile
        self.binds_ro = list(binds_ro if binds_ro is not None else python_binds())
        self.binds = list(binds or [])
        self.overlay_usr = overlay_usr  # a writable /usr (tmpfs upper layer) so dpkg -i can install
        self.boot_timeout = boot_timeout
        self.proc: subprocess.Popen | None = None
        self.pid1: int | None = None
        self.workdir = Path(tempfile.mkdtemp(prefix=self.name + "-"))
        self.log_path = self.workdir / "console.log"
        self.share: Path | None = None  # the host side of a bind a fixture sets up, if any

    # ---- life cycle --------------------------------------------------------------------------
    def start(self) -> Container:
        notify_path = str(self.workdir / "notify.sock")
        ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        ns.bind(notify_path)
        cmd = ["systemd-nspawn", "-q", "-D", "/", f"--volatile={self.volatile}", "--register=no",
               "--keep-unit", f"--machine={self.name}", "--notify-ready=yes", "-b", "--console=pipe"]
        cmd += [f"--bind-ro={p}" for p in self.binds_ro]
        cmd += [f"--bind={p}" for p in self.binds]
        if self.overlay_usr:
            cmd.append("--overlay=/usr::/usr")
        env = dict(CLEAN_ENV, NOTIFY_SOCKET=notify_path)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            self._await_ready(ns)
            self.pid1 = self._find_pid1()
            # READY=1 means the initial transaction finished; degraded (a unit that cannot run
            # in a container) is fine for these tests.
            r = self.run(["systemctl", "is-system-running", "--wait"], check=False, timeout=self.boot_timeout)
            state = r.stdout.strip()
            if state not in ("running", "degraded"):
                raise RuntimeError(f"container booted into state {state!r}\n{self.console()}")
        except BaseException:
            self.stop()
            raise
        finally:
            ns.close()
        return self

    def _await_ready(self, ns: socket.socket) -> None:
        deadline = time.monotonic() + self.boot_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"container {self.name} not ready after {self.boot_timeout:g}s\n{self.console()}")
            ns.settimeout(min(left, 1.0))
            try:
                msg = ns.recv(4096).decode(errors="replace")
            except TimeoutError:
                if present(self.proc).poll() is not None:
                    raise RuntimeError(f"systemd-nspawn exited {present(self.proc).returncode}\n{self.console()}") from None
                continue
            if "READY=1" in msg.split("\n"):
                return

    def _find_pid1(self) -> int:
        """The container's init is the only child of the nspawn process."""
        for task in Path(f"/proc/{present(self.proc).pid}/task").iterdir():
            children = (task / "children").read_text().split()
            if children:
                return int(children[0])
        raise RuntimeError("container init not found under systemd-nspawn")

    def stop(self, timeout: float = 60.0) -> None:
        """Ask the container to power off (SIGTERM to nspawn makes init halt), wait bounded,
        then kill this nspawn's process group if needed."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
        self.proc = None
        self.pid1 = None

    def __enter__(self) -> Container:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def console(self, tail: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-tail:])

    # ---- inside ------------------------------------------------------------------------------
    def run(self, cmd: list[str] | str, *, input: str | None = None, check: bool = True,
            timeout: float = 60.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run a command in all of the container's namespaces (a string goes through sh -c)."""
        if self.pid1 is None:
            raise RuntimeError("container not running")
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        r = subprocess.run(["nsenter", "-t", str(self.pid1), "-a", "-r", "-w", "--", *argv], input=input,
                           capture_output=True, text=True, timeout=timeout, env=dict(CLEAN_ENV, **(env or {})))
        if check and r.returncode != 0:
            raise AssertionError(f"in container: {argv} exited {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}")
        return r

    def path(self, p: str) -> Path:
        """A path inside the container, reachable from the host through /proc/<pid1>/root."""
        return Path(f"/proc/{self.pid1}/root") / p.lstrip("/")

    def write(self, p: str, content: str, mode: int = 0o644) -> None:
        target = self.path(p)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
        target.chmod(mode)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        r = self.run(["systemctl", "show", unit, *(f"--property={p}" for p in props)])
        return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)

    def python(self, code_or_args: list[str] | str, **kw) -> subprocess.CompletedProcess:
        """Run this test run's interpreter inside, with the repository importable."""
        args = ["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args
        env = dict(kw.pop("env", None) or {}, PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1")
        return self.run([sys.executable, *args], env=env, **kw)

    def journal_cursor(self) -> str:
        """Where the journal is now: pass it to follow_journal(after=) to see only what follows."""
        r = self.run(["journalctl", "-n", "1", "-o", "export", "--no-pager"])
        for line in r.stdout.splitlines():
            if line.startswith("__CURSOR="):
                return line.split("=", 1)[1]
        raise RuntimeError("empty journal")

    def follow_journal(self, unit: str, needle: str, timeout: float = 60.0, after: str | None = None) -> str:
        """Block until a journal line of `unit` (after the cursor `after`) contains `needle`
        (journalctl -f: an event, not a poll); returns that line."""
        since = [f"--after-cursor={after}"] if after else ["-n", "all"]
        p = subprocess.Popen(["nsenter", "-t", str(self.pid1), "-a", "-r", "-w", "--", "journalctl", "-f", *since,
                              "-o", "cat", "-u", unit], stdout=subprocess.PIPE, env=CLEAN_ENV,
                             start_new_session=True)
        try:
            # Raw reads: a buffered readline() would hide lines it read ahead from select().
            fd = present(p.stdout).fileno()
            deadline = time.monotonic() + timeout
            seen: list[str] = []
            buf = b""
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise TimeoutError(f"{needle!r} not in the journal of {unit} within {timeout:g}s; "
                                       f"saw:\n" + "\n".join(seen[-30:]))
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError("journalctl ended; saw:\n" + "\n".join(seen[-30:]))
                *lines, buf = (buf + chunk).split(b"\n")
                for raw in lines:
                    line = raw.decode(errors="replace")
                    seen.append(line)
                    if needle in line:
                        return line
        finally:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(10)
            present(p.stdout).close()
