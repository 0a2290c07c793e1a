"""How long `gpudctl version` and `gpudctl status` take, end to end, against a fake gpud.

gpudctl is run in loops and from scripts, so its wall time is mostly interpreter start-up plus
imports. This measures it (and the floors it cannot beat: a bare interpreter, one that only imports
msgpack, which gpudctl reads the wire with, and one that only imports msgspec, which it read it with
until gpud.cli.view), started every way it is installed or run:
- `python -m gpud.cli.gpudctl` in this venv;
- the script `pip install .` and `pip install -e .` put in a venv (packaging/gpudctl-pip.in, built
  and installed offline into fresh venvs by bench/venvs.py), and beside each, for comparison, the
  console script pip would write for an entry point to the same program (pip 26.3's form: the
  interpreter runs `site`, every .pth file and an editable install's finder, and honours PYTHON*);
- this venv's own gpudctl (an editable install among the test dependencies, typing_extensions
  among them), and an entry point's console script in this venv;
- the launcher the package installs (packaging/gpudctl.in: python -I -S with only gpudctl's paths).
The commands take turns, run by run, so a change in the machine's load falls on all of them; the
CPU column (user + system time of the process) moves less with the load than the wall time.
Writes out/client_startup.md (`make bench-update`: bench/results/). Numbers only; nothing asserts
them. The comparison with `nvidia-smi -L` needs a GPU host: scripts/h200-status-timing.

    .venv/bin/python bench/client_startup.py [-n 50] [-o PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import venvs  # noqa: E402
from gpud.api.server import serve  # noqa: E402
from gpud.wire import replies as wire_replies  # noqa: E402


def _status() -> wire_replies.StatusReply:
    """What a host of 8 whole GPUs answers: the size of the reply gpudctl decodes and renders."""
    gpus = [wire_replies.GpuStatus(index=i, pci=f"0000:{0x18 + 0x11 * i:02x}:00.0", uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000",
                                   model="NVIDIA H100 80GB HBM3", pci_id="10de:2330", driver="nvidia", workload="container",
                                   mig=wire_replies.MigStatus(capable=True, mode="disabled"), converged=True, state="converged",
                                   message="whole GPU") for i in range(8)]
    return wire_replies.StatusReply(phase="converged", layout=wire_replies.LayoutStatus(path="/etc/gpud/layout.yaml", selected="all",
                                                                                        valid=True), gpus=gpus, version="0.1.0")


class FakeGpud:
    """Answers `version` and `status` from constants: only the client's own cost is measured."""

    async def handle(self, op: str, args: dict[str, Any], peer: Any) -> Any:
        if op == "status":
            return _status()
        return wire_replies.VersionReply(version="0.1.0", driver="550.90.07", nvml="12.550.90.07")

    def subscribe(self) -> asyncio.Queue:
        return asyncio.Queue()

    def recent_events(self) -> list:
        return []


def start_server(path: str) -> tuple[asyncio.AbstractEventLoop, Any, threading.Thread]:
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        box["server"] = loop.run_until_complete(serve(FakeGpud(), path, group=None))
        ready.set()
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    ready.wait(30)
    return loop, box["server"], t


def _write_launcher(path: Path) -> None:
    """packaging/gpudctl.in filled in as build-deb.sh does, for this checkout and interpreter."""
    import msgpack

    text = (REPO / "packaging" / "gpudctl.in").read_text()
    text = text.replace("@PYTHON@", os.path.realpath(sys.executable)).replace(
        "@PATHS@", repr([str(REPO), str(Path(msgpack.__file__).parents[1])]))
    path.write_text(text)
    path.chmod(0o755)


def _entry_point_script(path: Path, python: Path) -> Path:
    """The console script pip 26.3 writes for an entry point `gpudctl = gpud.cli.program:run`: the same
    program as the installed script, started the console script's way (with `site`)."""
    path.write_text(f"#!{python}\nimport sys\nfrom gpud.cli.program import run\n"
                    "if __name__ == '__main__':\n    sys.argv[0] = sys.argv[0].removesuffix('.exe')\n"
                    "    sys.exit(run())\n")
    path.chmod(0o755)
    return path


FLOOR = "python -I -S -c pass (floor of the launcher and the pip script)"
LAUNCHER_STATUS = "gpudctl status (package launcher, -I -S)"
PIP_STATUS = "gpudctl status (pip install .: its gpudctl)"


def measure(cases: list[tuple[str, list[str]]], n: int, env: dict[str, str],
            python_m_env: dict[str, str]) -> dict[str, tuple[list[float], list[float]]]:
    """(wall ms, CPU ms) of each command, n runs each after one warm-up, the commands in turn."""
    out: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, _ in cases}
    envs = {name: python_m_env if cmd[1:2] == ["-m"] else env for name, cmd in cases}
    for name, cmd in cases:
        subprocess.run(cmd, env=envs[name], check=True, capture_output=True)  # warm the page cache / .pyc
    for _ in range(n):
        for name, cmd in cases:
            env = envs[name]
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            subprocess.run(cmd, env=env, check=True, capture_output=True)
            wall = (time.perf_counter() - t0) * 1000
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            out[name][0].append(wall)
            out[name][1].append((r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) * 1000)
    return out


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=50, help="runs per command")
    ap.add_argument("-o", default=str(REPO / "out" / "client_startup.md"),
                    help="where to write (default out/; `make bench-update` refreshes bench/results/)")
    a = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="gpud-bench", dir="/tmp")
    path = f"{tmp}/gpud.sock"
    installed = {}
    for kind, editable in (("pip install .", False), ("pip install -e .", True)):
        work = Path(tmp) / ("editable" if editable else "regular")
        wheel = venvs.build_wheel(venvs.copy_source(work / "src"), work / "wheel", editable=editable)
        installed[kind] = venvs.make_venv(work / "venv", wheel)
    loop, server, thread = start_server(path)
    # The installed scripts run in an environment without PYTHON* variables (what they find is what
    # was installed); `python -m` gets the checkout first, and a PYTHONPATH already set
    # (dependencies installed with --target) after it.
    env = {**venvs.env_without_python_vars(), "GPUD_SOCKET": path}
    python_m_env = {**os.environ, "GPUD_SOCKET": path,
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    py = sys.executable
    launcher = Path(tmp) / "gpudctl"
    _write_launcher(launcher)
    fresh = installed["pip install ."]
    cases = [
        (FLOOR,
         [os.path.realpath(py), "-I", "-S", "-c", "pass"]),
        ("python -c pass (floor, a fresh venv)", [str(fresh / "python"), "-c", "pass"]),
        ("python -c 'import msgpack' (floor, a fresh venv)", [str(fresh / "python"), "-c", "import msgpack"]),
        ("python -c 'import msgspec' (floor, a fresh venv)", [str(fresh / "python"), "-c", "import msgspec"]),
        ("gpudctl version (package launcher, -I -S)", [str(launcher), "version"]),
        (LAUNCHER_STATUS, [str(launcher), "status"]),
    ]
    for kind, bin_dir in installed.items():
        cases += [(f"gpudctl status ({kind}: its gpudctl)", [str(bin_dir / "gpudctl"), "status"]),
                  (f"gpudctl status ({kind}: an entry point's console script, for comparison)",
                   [str(_entry_point_script(bin_dir / "gpudctl-entry-point", bin_dir / "python")), "status"])]
    cases.append(("gpudctl version (pip install .: its gpudctl)", [str(fresh / "gpudctl"), "version"]))
    own = Path(py).parent / "gpudctl"
    if own.exists():
        cases += [("gpudctl status (this venv's: -e with the test dependencies)", [str(own), "status"]),
                  ("gpudctl status (this venv: an entry point's console script, for comparison)",
                   [str(_entry_point_script(Path(tmp) / "gpudctl-entry-point", Path(py))), "status"])]
    cases += [
        ("python -m gpud.cli.gpudctl version (this venv)", [py, "-m", "gpud.cli.gpudctl", "version"]),
        ("python -m gpud.cli.gpudctl status (this venv)", [py, "-m", "gpud.cli.gpudctl", "status"]),
    ]
    load_before = os.getloadavg()[0]
    try:
        rows = measure(cases, a.n, env, python_m_env)
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        shutil.rmtree(tmp, ignore_errors=True)

    lines = [
        "# gpudctl start-up: `gpudctl version` and `status` against a fake gpud",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}, {platform.node()}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load average (1 min) {load_before:.1f} at the start and {os.getloadavg()[0]:.1f} at "
        f"the end; {a.n} runs each after one warm-up, the commands in turn (ms: wall time of the whole process; "
        "CPU: its user + system time). `status` answers for 8 GPUs.",
        "Reproduce: `make bench` (writes out/client_startup.md) or `.venv/bin/python bench/client_startup.py`.",
        "",
        "| command | p50 | p95 | min | max | CPU p50 | p50 / floor |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    floor = statistics.median(rows[FLOOR][0])
    for name, (xs, cpu) in rows.items():
        lines.append(f"| {name} | {statistics.median(xs):.1f} | {pct(xs, 95):.1f} | {min(xs):.1f} | {max(xs):.1f} "
                     f"| {statistics.median(cpu):.1f} | {statistics.median(xs) / floor:.2f}x |")
    pip_p50, launcher_p50 = statistics.median(rows[PIP_STATUS][0]), statistics.median(rows[LAUNCHER_STATUS][0])
    lines += ["", f"Issue 28's client targets, in this run: `gpudctl status` from a pip install at most 3x the bare "
              f"interpreter by median: **{pip_p50 / floor:.2f}x** ({pip_p50:.1f} / {floor:.1f} ms); from the package's launcher "
              f"{launcher_p50 / floor:.2f}x here (its target, 1.5x `nvidia-smi -L` by median, is measured on the GPU host: "
              "scripts/h200-status-timing)."]
    lines += ["", "The package installs the launcher as /usr/bin/gpudctl (packaging/gpudctl.in, filled in by "
              "packaging/build-deb.sh); pip installs packaging/gpudctl-pip.in (setup.py), which pays one /bin/sh "
              "start before Python, since a wheel cannot carry -I -S. An entry point's console script pays `site` "
              "instead, whose cost grows with what the venv holds (.pth files, an editable install's finder). "
              "Against `nvidia-smi -L` on a real GPU host: "
              "[scripts/h200-status-timing](../../scripts/h200-status-timing).", ""]
    Path(a.o).parent.mkdir(parents=True, exist_ok=True)
    Path(a.o).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
