"""Issue 28 item 4, the daemon's memory: what `gpud` loads in its default mode (a layout file on a
real host, no --kube-node, no --sim), read from outside the process: the interpreter's own import
log (`python -X importtime`, one line per module it loaded) and the kernel's list of the process's
mappings (/proc/PID/maps). What only another mode or a first use needs (the metrics' Prometheus
client, D-Bus, the Kubernetes and gRPC clients, the simulator, OpenSSL) stays out of it.

The daemon runs on this machine's real host, read-only, with a layout that leaves every GPU alone
(what scripts/h200-status-timing runs on the lent H200): every path it could write is under
tmp_path, and read-only mode refuses any mutating call."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpud.asyncio_tls import daemon_needs_tls
from tests.support.daemon import ROOT, wait_until
from tests.support.processes import stop

pytestmark = pytest.mark.daemon

# Loaded only where needed: --metrics-textfile, a drain or reboot (D-Bus), --kube-node, --dra, --sim,
# a hook's output digest or TLS (OpenSSL's libcrypto/libssl, through _hashlib and _ssl).
NOT_IN_DEFAULT_MODE = ("prometheus_client", "dbus_fast", "lightkube", "grpc", "gpud.sim", "gpud.kube_proto",
                       "gpud.engine.dra", "gpud.engine.kube.agent", "gpud.host.kube.node_api", "_ssl", "_hashlib")


def _imported(log: str) -> set[str]:
    """The modules `-X importtime` logged (its lines: `import time: self | cumulative | name`)."""
    return {line.split("|")[2].strip() for line in log.splitlines()
            if line.startswith("import time:") and line.count("|") == 2} - {"imported package"}


def _mapped(pid: int) -> set[str]:
    return {Path(f.split()[5]).name for f in Path(f"/proc/{pid}/maps").read_text().splitlines() if len(f.split()) > 5}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("entry", ["gpud.main", "gpud.daemon"])  # /usr/bin/gpud's, and python -m gpud.daemon
def test_the_default_mode_loads_neither_other_modes_nor_openssl(tmp_path, entry):
    config = tmp_path / "layout.yaml"
    config.write_text("version: v1\nlayouts:\n  hands-off: []\n")
    sock, log = tmp_path / "gpud.sock", tmp_path / "gpud.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-X", "importtime", "-m", entry, "--read-only", "--config", str(config),
             "--socket", str(sock), "--state-dir", str(tmp_path / "state"), "--lock", str(tmp_path / "apply.lock"),
             "--nfd-features", str(tmp_path / "nfd"), "--udev-rules", str(tmp_path / "udev.rules"),
             "--log-level", "INFO"],  # its READY line is read
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        def gpudctl(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "gpud.cli.gpudctl", "--socket", str(sock), *args],
                                  capture_output=True, text=True, timeout=60, cwd=ROOT)

        wait_until(lambda: proc.poll() is not None or gpudctl("version").returncode == 0, timeout=60,
                   what="gpud to answer or exit")
        assert proc.poll() is None, f"gpud exited with {proc.returncode}:\n{log.read_text()}"
        wait_until(lambda: " ready: " in log.read_text(), what="the first pass (READY)")
        status = gpudctl("status")
        assert status.returncode == 0 and "hands-off" in status.stdout, status.stdout + status.stderr
        imported, mapped = _imported(log.read_text()), _mapped(proc.pid)
    finally:
        stop(proc)
    # the log is read as meant: the daemon and its event sources are in it
    assert {"gpud.engine.reconciler", "gpud.api.server", "pyudev", "asyncinotify"} <= imported
    assert sorted(m for m in imported if any(_within(m, p) for p in NOT_IN_DEFAULT_MODE)) == []
    assert sorted(m for m in mapped if m.startswith(("libcrypto.", "libssl."))) == []


@pytest.mark.parametrize(("argv", "tls"), [
    (["--config", "l.yaml", "--read-only"], False),
    (["--sim", "/tmp/h", "--metrics-textfile", "/x/gpud.prom"], False),
    (["--kube-node", "n1"], True),
    (["--kube-node=n1"], True),
    (["--kube-n", "n1"], True),  # argparse's abbreviation
    (["--kubeconfig", "/k"], True),
    (["--kube-node", "n1", "--dra"], True),
    (["--dr", "--kube-node", "n1"], True),
])
def test_tls_is_kept_for_the_kubernetes_options(argv, tls):
    assert daemon_needs_tls(argv) is tls


CHILD_WITHOUT_TLS = """
import sys
from gpud.asyncio_tls import import_asyncio_without_tls
assert import_asyncio_without_tls()
import asyncio
import asyncio.sslproto, ssl  # ssl itself imports again
async def echo(path):
    async def serve(r, w):
        w.write(await r.readline()); await w.drain(); w.close()
    server = await asyncio.start_unix_server(serve, path)
    r, w = await asyncio.open_unix_connection(path)
    w.write(b"hello\\n"); await w.drain()
    line = await r.readline()
    w.close(); server.close(); await server.wait_closed()
    return line
print(asyncio.run(echo(sys.argv[1])).decode().strip(), asyncio.sslproto.ssl is None, ssl.OPENSSL_VERSION_INFO[0] >= 1,
      import_asyncio_without_tls())
"""


def test_asyncio_without_tls_serves_a_unix_socket_and_leaves_ssl_importable(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHILD_WITHOUT_TLS, str(tmp_path / "s")], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    # asyncio works over the socket; its TLS is off; ssl imports for others; a second call does nothing
    assert out.stdout.split() == ["hello", "True", "True", "False"]


def test_kubernetes_mode_keeps_asyncios_tls(tmp_path):
    """gpud.main with --kube-node: asyncio as the standard library makes it (the start fails here on
    a kubeconfig that is not there, after the imports)."""
    child = ("import sys\nfrom gpud.main import main\nrc = main(sys.argv[1:])\n"
             "import asyncio.sslproto as p\nprint(rc, p.ssl is not None)")
    out = subprocess.run([sys.executable, "-c", child,
                          "--kube-node", "n1", "--kubeconfig", str(tmp_path / "none"), "--read-only",
                          "--state-dir", str(tmp_path / "state"), "--lock", str(tmp_path / "apply.lock"),
                          "--socket", str(tmp_path / "s"), "--config", str(tmp_path / "layout.yaml")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.split() == ["1", "True"], out.stdout + out.stderr
