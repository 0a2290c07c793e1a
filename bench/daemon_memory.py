"""The daemon's memory beside its floors, in one run (issue 28 item 4: the daemon's RSS at most 3 MB
above Python + nvmlInit on the real H200; that figure itself comes from scripts/h200-status-timing
on the lent machine).

Each floor is a process of this interpreter that does what its row says and then waits while its
memory is read (/proc/PID/status VmRSS, /proc/PID/smaps_rollup): bare Python; pynvml imported (this
machine has no NVML library, so no nvmlInit: the H200's floor adds the driver's library and its
allocations); the daemon's module imported as a library (`import gpud.daemon`); the imports the
default mode's start makes (gpud.main's way, then the event sources' modules); the same plus the
simulator installed, initialised and every GPU read once (what --sim adds: the simulator's share).

The daemons are real `gpud` processes (`python -m gpud.main`, the program /usr/bin/gpud runs), read
after their first pass (READY) and a status request: the default mode on this machine's real host
(read-only, a layout that leaves every GPU alone, no GPU and no NVML here: what the H200 run does,
minus the driver), and `gpud --sim` on 8 simulated H100s, with and without MALLOC_ARENA_MAX=2
(glibc's cap on malloc arenas; each thread that allocates may otherwise get its own).

    .venv/bin/python -m bench.daemon_memory [-o out/daemon-memory.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.status_bench import _compile_as_installed  # noqa: E402

GPUS = "h100-80gb:8"
HANDS_OFF = "version: v1\nlayouts:\n  hands-off: []\n"
ALL_1G = 'version: v1\nlayouts:\n  all-1g:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {"1g.10gb": 7}\n'
DEFAULT_START = ("from gpud.main import import_asyncio_without_tls\nimport_asyncio_without_tls()\n"
                 "import gpud.daemon, gpud.host.kernel.udev, gpud.host.nvidia.cdi, pyudev, asyncinotify\n")
SIM = ("import pynvml\nfrom gpud import sim\nsim.install(os.environ['SIM_HOST'])\npynvml.nvmlInit()\n"
       "for i in range(pynvml.nvmlDeviceGetCount()):\n"
       "    h = pynvml.nvmlDeviceGetHandleByIndex(i)\n"
       "    pynvml.nvmlDeviceGetUUID(h); pynvml.nvmlDeviceGetMemoryInfo(h); pynvml.nvmlDeviceGetMigMode(h)\n")
FLOORS = [
    ("python -c pass", ""),
    ("+ import pynvml (the floor here: no NVML library)", "import pynvml\n"),
    ("+ the chosen dependencies: asyncio (no TLS, as the default mode), msgspec, PyYAML, asyncinotify",
     "from gpud.asyncio_tls import import_asyncio_without_tls\nimport_asyncio_without_tls()\n"
     "import pynvml, msgspec, yaml, asyncinotify\n"),
    ("+ import gpud.daemon (as a library: asyncio with ssl)", "import gpud.daemon\n"),
    ("+ the default mode's imports (gpud.main's start, event sources)", DEFAULT_START),
    ("+ the default mode's imports, the simulator installed, every GPU read", DEFAULT_START + SIM),
]


def memory(pid: int) -> dict[str, float]:
    """VmRSS and smaps_rollup's split, in MiB: anonymous (heap, stacks, private memory) and the rest
    (file-backed: the interpreter's, the extension modules' and shared libraries' pages)."""
    kib = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            kib[parts[0].rstrip(":")] = int(parts[1])
    threads = len(os.listdir(f"/proc/{pid}/task"))
    return {"rss": kib["Rss"] / 1024, "anon": kib["Anonymous"] / 1024, "file": (kib["Rss"] - kib["Anonymous"]) / 1024,
            "pss": kib["Pss"] / 1024, "threads": threads}


def floor(code: str, env: dict[str, str]) -> dict[str, float]:
    proc = subprocess.Popen([sys.executable, "-c", "import os, sys\n" + code + "print('ready', flush=True)\nsys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", f"floor failed: {code!r}"
        return memory(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def daemon(tmp: Path, args: list[str], env: dict[str, str], layout: str = HANDS_OFF) -> dict[str, float]:
    """A real gpud, after READY (its first pass) and one status answered."""
    tmp.mkdir()
    (tmp / "layout.yaml").write_text(layout)
    sock, log = tmp / "gpud.sock", tmp / "gpud.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gpud.main", "--config", str(tmp / "layout.yaml"),
                                 "--socket", str(sock), "--state-dir", str(tmp / "state"), "--lock", str(tmp / "apply.lock"),
                                 "--nfd-features", str(tmp / "nfd"), "--udev-rules", str(tmp / "udev.rules"),
                                 "--log-level", "INFO", *args],
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 120
        while " ready: " not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gpud did not get ready:\n{log.read_text()}")
            time.sleep(0.1)
        subprocess.run([sys.executable, "-m", "gpud.cli.gpudctl", "--socket", str(sock), "status"], check=True,
                       capture_output=True, cwd=REPO, env=env, timeout=60)
        time.sleep(1)  # what the status request started (a re-read of the host) has ended
        return memory(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", default="out/daemon-memory.md")
    a = ap.parse_args(argv)
    _compile_as_installed()  # as installed: no module compiled at start
    from gpud.sim import cli as simcli

    tmp = Path(tempfile.mkdtemp(prefix="gpud-memory-", dir="/tmp"))
    host, busy, busy2 = tmp / "host", tmp / "busy-host", tmp / "busy-host-2"
    simcli.create(host, [GPUS])
    for d in (busy, busy2):  # MIG on, no instances: the daemon's first pass lays 7 on each GPU
        simcli.create(d, [GPUS], list(range(8)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               SIM_HOST=str(host), GPUD_LOG_LEVEL="INFO")
    env.pop("NOTIFY_SOCKET", None)
    env.pop("MALLOC_ARENA_MAX", None)
    load = os.getloadavg()
    floors = [(label, floor(code, env)) for label, code in FLOORS]
    n = GPUS.replace(":", " x ")
    daemons = [
        ("`gpud --read-only`, the default mode on this host (no GPU, no NVML library)",
         daemon(tmp / "real", ["--read-only"], env)),
        ("the same with `--kube-namespace x` (a Kubernetes option: asyncio keeps TLS, as every daemon did before)",
         daemon(tmp / "real-tls", ["--read-only", "--kube-namespace", "x"], env)),
        (f"`gpud --sim --read-only`, {n}", daemon(tmp / "sim", ["--read-only", "--sim", str(host)], env)),
        (f"`gpud --sim`, {n}, after laying 7 x 1g.10gb on each", daemon(tmp / "busy", ["--sim", str(busy)], env, ALL_1G)),
        ("the same with MALLOC_ARENA_MAX=2", daemon(tmp / "busy-arenas", ["--sim", str(busy2)],
                                                    dict(env, MALLOC_ARENA_MAX="2"), ALL_1G)),
    ]
    f = dict(floors)
    bare, pynvml, deps, library, default, sim = (f[label]["rss"] for label, _ in FLOORS)
    real, real_tls, on_sim, busy_rss, busy_arenas = (m["rss"] for _, m in daemons)
    lines = [f"# The daemon's memory on {platform.node()}", "",
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}, Python {platform.python_version()}, {os.cpu_count()} CPUs, "
             f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start; one run (`.venv/bin/python -m "
             "bench.daemon_memory`). MiB; *anonymous*: heap, stacks and other private memory; *file-backed*: pages "
             "of the interpreter, extension modules and shared libraries (shared with every process mapping them: "
             "PSS divides those among them).", "",
             "| process | VmRSS | anonymous | file-backed | PSS | threads |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {label} | {m['rss']:.1f} | {m['anon']:.1f} | {m['file']:.1f} | {m['pss']:.1f} | {m['threads']:.0f} |"
              for label, m in [*floors, *daemons]]
    lines += ["",
              f"- The dependencies the project chose, alone (asyncio without TLS, msgspec, PyYAML, asyncinotify): "
              f"**{deps - pynvml:+.1f} MiB** above the pynvml floor, before any of gpud's code.",
              f"- The daemon's imports (the default mode's start) above the pynvml floor: **{default - pynvml:+.1f} MiB** "
              f"({default - bare:.1f} above bare Python); imported as a library, with asyncio's ssl: {library - pynvml:+.1f}.",
              f"- The default-mode daemon after its first pass above the pynvml floor: **{real - pynvml:+.1f} MiB**; "
              f"above its own imports: {real - default:+.1f} (what running adds: the event loop, the first pass's "
              "state, the worker threads' stacks and arenas).",
              f"- asyncio without TLS in the default mode: {real - real_tls:+.1f} MiB (OpenSSL's libraries not mapped).",
              f"- The simulator's share in-process: {sim - default:+.1f} MiB (its modules, its host state, every GPU "
              f"read once, in a process of the daemon's imports); `gpud --sim` serves its NVML library from a child "
              f"process (gpud/sim/nvml_process.py), so the daemon on {GPUS.replace(':', ' x ')} holds only the "
              f"simulated kernel's and the client's part: {on_sim - pynvml:+.1f} above the floor.",
              f"- After laying 56 MIG instances (worker threads at work): {busy_rss - on_sim:+.1f} MiB over the read-only "
              f"daemon on the simulator; MALLOC_ARENA_MAX=2 there: {busy_arenas - busy_rss:+.1f} MiB.",
              "",
              "Target (issue 28): the daemon's RSS at most 3 MB above Python + nvmlInit on the real H200, measured there "
              "(scripts/h200-status-timing, bench/results/h200-status-timing.md): this machine has no NVML, so the "
              "figure here is the daemon above `import pynvml`, in the same run. What the daemon loads when, and why: "
              "docs/internals.md, \"What the daemon loads when\"."]
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
