"""How long `gpudctl version` takes, end to end, against a fake gpud.

gpudctl is run in loops and from scripts, so its wall time is mostly interpreter start-up plus
imports. This measures it (and the floors it cannot beat: a bare interpreter, and one that only
imports msgspec) and writes bench/results/client_startup.md. Numbers only; nothing asserts them.

    .venv/bin/python bench/client_startup.py [-n 50]
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


class VersionOnly:
    async def handle(self, op: str, args: dict[str, Any], peer: Any) -> Any:
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
        box["server"] = loop.run_until_complete(serve(VersionOnly(), path, group=None))
        ready.set()
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    ready.wait(30)
    return loop, box["server"], t


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
    ap.add_argument("-o", default=str(REPO / "bench" / "results" / "client_startup.md"))
    a = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="gpud-bench", dir="/tmp")
    path = f"{tmp}/gpud.sock"
    loop, server, thread = start_server(path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "GPUD_SOCKET": path}
    py = sys.executable
    cases = [
        ("python -c pass (floor)", [py, "-c", "pass"]),
        ("python -c 'import msgspec' (floor)", [py, "-c", "import msgspec"]),
        ("python -m gpud.cli.gpudctl version", [py, "-m", "gpud.cli.gpudctl", "version"]),
    ]
    script = Path(py).parent / "gpudctl"
    if script.exists():
        cases.append(("gpudctl version (console script)", [str(script), "version"]))
    try:
        rows = [(name, measure(cmd, a.n, env)) for name, cmd in cases]
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        shutil.rmtree(tmp, ignore_errors=True)

    lines = [
        "# gpudctl start-up: `gpudctl version` against a fake gpud",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}, {platform.node()}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, {a.n} runs each after one warm-up (wall time of the whole process, ms).",
        "Reproduce: `.venv/bin/python bench/client_startup.py`",
        "",
        "| command | p50 | p95 | min | max |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, xs in rows:
        lines.append(f"| {name} | {statistics.median(xs):.1f} | {pct(xs, 95):.1f} | {min(xs):.1f} | {max(xs):.1f} |")
    lines += ["", "For reference (anchors.md): `nvidia-smi -L` 20 ms; a Python process importing pynvml "
              "and reading the MIG mode 130-190 ms.", ""]
    Path(a.o).parent.mkdir(parents=True, exist_ok=True)
    Path(a.o).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
