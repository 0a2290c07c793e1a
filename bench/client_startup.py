"""How long `gpudctl version` and `gpudctl status` take, end to end, against a fake gpud.

gpudctl is run in loops and from scripts, so its wall time is mostly interpreter start-up plus
imports. This measures it (and the floors it cannot beat: a bare interpreter, and one that only
imports msgspec), started three ways: `python -m`, pip's console script in the venv, and the
launcher the package installs (packaging/gpudctl.in: python -I -S with only gpudctl's paths).
Writes out/client_startup.md (`make bench-update`: bench/results/). Numbers only; nothing asserts
them. The comparison with `nvidia-smi -L` needs a GPU host: scripts/h200-status-timing.

    .venv/bin/python bench/client_startup.py [-n 50] [-o PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
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

from gpud.api import wire  # noqa: E402
from gpud.api.server import serve  # noqa: E402


def _status() -> wire.StatusReply:
    """What a host of 8 whole GPUs answers: the size of the reply gpudctl decodes and renders."""
    gpus = [wire.GpuStatus(index=i, pci=f"0000:{0x18 + 0x11 * i:02x}:00.0", uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000",
                           model="NVIDIA H100 80GB HBM3", pci_id="10de:2330", driver="nvidia", workload="container",
                           mig=wire.MigStatus(capable=True, mode="disabled"), converged=True, state="converged",
                           message="whole GPU") for i in range(8)]
    return wire.StatusReply(phase="converged", layout=wire.LayoutStatus(path="/etc/gpud/layout.yaml", selected="all",
                                                                        valid=True), gpus=gpus, version="0.1.0")


class FakeGpud:
    """Answers `version` and `status` from constants: only the client's own cost is measured."""

    async def handle(self, op: str, args: dict[str, Any], peer: Any) -> Any:
        if op == "status":
            return _status()
        return wire.VersionReply(version="0.1.0", driver="550.90.07", nvml="12.550.90.07")

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
    import msgspec

    text = (REPO / "packaging" / "gpudctl.in").read_text()
    text = text.replace("@PYTHON@", os.path.realpath(sys.executable)).replace(
        "@PATHS@", repr([str(REPO), str(Path(msgspec.__file__).parents[1])]))
    path.write_text(text)
    path.chmod(0o755)


def measure(cmd: list[str], n: int, env: dict[str, str]) -> list[float]:
    subprocess.run(cmd, env=env, check=True, capture_output=True)  # warm the page cache / .pyc
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        out.append((time.perf_counter() - t0) * 1000)
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
    loop, server, thread = start_server(path)
    # the checkout first; a PYTHONPATH already set (dependencies installed with --target) kept after it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "GPUD_SOCKET": path}
    py = sys.executable
    cases = [
        ("python -c pass (floor)", [py, "-c", "pass"]),
        ("python -c 'import msgspec' (floor)", [py, "-c", "import msgspec"]),
        ("python -m gpud.cli.gpudctl version", [py, "-m", "gpud.cli.gpudctl", "version"]),
    ]
    script = Path(py).parent / "gpudctl"
    if script.exists():
        cases.append(("gpudctl version (pip console script)", [str(script), "version"]))
    launcher = Path(tmp) / "gpudctl"
    _write_launcher(launcher)
    cases += [
        ("python -I -S -c pass (floor of the launcher)", [os.path.realpath(py), "-I", "-S", "-c", "pass"]),
        ("gpudctl version (package launcher, -I -S)", [str(launcher), "version"]),
        ("gpudctl status (package launcher, -I -S; 8 GPUs)", [str(launcher), "status"]),
        ("python -m gpud.cli.gpudctl status (8 GPUs)", [py, "-m", "gpud.cli.gpudctl", "status"]),
    ]
    try:
        rows = [(name, measure(cmd, a.n, env)) for name, cmd in cases]
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        shutil.rmtree(tmp, ignore_errors=True)

    lines = [
        "# gpudctl start-up: `gpudctl version` and `status` against a fake gpud",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}, {platform.node()}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (1 min) at the end; {a.n} runs each after "
        "one warm-up (wall time of the whole process, ms).",
        "Reproduce: `make bench` (writes out/client_startup.md) or `.venv/bin/python bench/client_startup.py`.",
        "",
        "| command | p50 | p95 | min | max |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, xs in rows:
        lines.append(f"| {name} | {statistics.median(xs):.1f} | {pct(xs, 95):.1f} | {min(xs):.1f} | {max(xs):.1f} |")
    lines += ["", "The package installs the launcher as /usr/bin/gpudctl (packaging/gpudctl.in, filled in by "
              "packaging/build-deb.sh). Against `nvidia-smi -L` on a real GPU host: "
              "[scripts/h200-status-timing](../../scripts/h200-status-timing).", ""]
    Path(a.o).parent.mkdir(parents=True, exist_ok=True)
    Path(a.o).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
