"""The .deb on a fresh Debian 12 systemd (container): install, unit verification without ordering
cycles, the security score, and gpud.service's sandbox still allowing what gpud does."""

from __future__ import annotations

import json
import re

import pytest

from tests.systemd.nspawn import REPO

pytestmark = pytest.mark.nspawn

# Stand-ins with the ordering the real units have, so verify sees the whole graph.
NEIGHBOURS = {
    "nvidia-persistenced.service": "[Service]\nType=forking\nExecStart=/bin/true\n",
    "kubelet.service": "[Unit]\nWants=network-online.target\nAfter=network-online.target\n"
                       "[Service]\nExecStart=/usr/bin/sleep infinity\n[Install]\nWantedBy=multi-user.target\n",
    "nvidia-dcgm.service": "[Service]\nExecStart=/usr/bin/sleep infinity\n[Install]\nWantedBy=multi-user.target\n",
    "dcgm-exporter.service": "[Unit]\nAfter=nvidia-dcgm.service\n[Service]\nExecStart=/usr/bin/sleep infinity\n",
    "nvidia-cdi-refresh.service": "[Unit]\nAfter=nvidia-persistenced.service\n"
                                  "[Service]\nType=oneshot\nExecStart=/bin/true\n",
    "nvidia-mig-manager.service": "[Unit]\nBefore=nvidia-persistenced.service\n"
                                  "[Service]\nType=oneshot\nExecStart=/bin/true\n",
}


def test_install_layout(installed):
    c = installed
    r = c.run(["dpkg-query", "-W", "-f=${Status} ${Conffiles}\n", "gpud"])
    assert r.stdout.startswith("install ok installed") and "/etc/gpud/layout.yaml" in r.stdout
    assert c.run(["getent", "group", "gpud"]).stdout.startswith("gpud:")
    for d in ("/run/gpud", "/var/lib/gpud", "/etc/gpud"):
        assert c.path(d).is_dir(), d
    # not enabled, not started by the install
    assert c.run(["systemctl", "is-enabled", "gpud.service"], check=False).stdout.strip() == "disabled"
    assert c.run(["systemctl", "is-active", "gpud.service"], check=False).stdout.strip() == "inactive"
    assert "usage: gpudctl" in c.run(["gpudctl", "--help"]).stdout
    assert "usage: gpud-sim" in c.run(["gpud-sim", "--help"]).stdout
    # bytecode was compiled for /opt/gpud and is used read-only (no __pycache__ writes needed)
    r = c.run(["/opt/gpud/bin/python3", "-B", "-c", "import gpud.host.systemd.sd_notify as m; print(m.__file__, m.__cached__)"])
    assert r.stdout.startswith("/opt/gpud/lib/python3.11/site-packages/gpud/host/systemd/sd_notify.py")
    assert not c.run(["grep", "-rl", "gpud-deb.", "/opt/gpud/bin", "/opt/gpud/pyvenv.cfg"], check=False).stdout


def test_units_verify_clean_without_cycles(installed):
    c = installed
    for name, body in NEIGHBOURS.items():
        c.write(f"/etc/systemd/system/{name}", body)
    try:
        c.run(["systemctl", "daemon-reload"])
        r = c.run(["systemd-analyze", "verify", "gpud.service", "gpud.socket", "kubelet.service",
                   "nvidia-cdi-refresh.service", "dcgm-exporter.service"], check=False)
        assert r.returncode == 0 and r.stderr.strip() == "" and r.stdout.strip() == "", r
        # the boot transaction of multi-user.target with gpud enabled has no cycle
        c.run(["systemctl", "enable", "gpud.service", "kubelet.service", "nvidia-dcgm.service"])
        r = c.run(["systemd-analyze", "verify", "multi-user.target"], check=False)
        assert "cycle" not in (r.stdout + r.stderr).lower(), r
        order = c.run(["systemctl", "list-dependencies", "--after", "kubelet.service", "--plain", "--no-pager"])
        assert "gpud.service" in order.stdout
    finally:
        c.run(["systemctl", "disable", "gpud.service", "kubelet.service", "nvidia-dcgm.service"], check=False)
        c.run(["sh", "-c", "cd /etc/systemd/system && rm -f " + " ".join(NEIGHBOURS)], check=False)
        c.run(["systemctl", "daemon-reload"], check=False)


def test_security_score(installed):
    r = installed.run(["systemd-analyze", "security", "--no-pager", "gpud.service"], check=False)
    m = re.search(r"Overall exposure level for gpud.service: ([0-9.]+)", r.stdout)
    assert m, r.stdout[-2000:]
    assert float(m.group(1)) <= 3.5, r.stdout  # packaging/security.txt records the full table
    recorded = (REPO / "packaging" / "security.txt").read_text()
    assert f"Overall exposure level for gpud.service: {m.group(1)}" in recorded, \
        "packaging/security.txt is stale: regenerate it (see its first line)"


SANDBOX_SKIP = re.compile(r"^(Type|ExecStart|ExecReload|WatchdogSec|Restart|RestartSec|TimeoutStartSec|"
                          r"TimeoutStopSec|KillMode|SyslogIdentifier)=")


def sandbox_of_gpud_service(c) -> list[str]:
    text = c.path("/usr/lib/systemd/system/gpud.service").read_text()
    service = text.split("[Service]", 1)[1].split("[Install]", 1)[0]
    return [ln for ln in service.splitlines() if ln.strip() and not ln.startswith("#") and not SANDBOX_SKIP.match(ln)]


def test_sandbox_allows_what_gpud_needs_and_nothing_it_does_not(installed):
    c = installed
    c.write("/opt/gpud-test/hardening_probe.py", (REPO / "tests/systemd/hardening_probe.py").read_text())
    c.write("/etc/systemd/system/drain-probe.service", "[Service]\nExecStart=/usr/bin/sleep infinity\n")
    lines = sandbox_of_gpud_service(c)
    assert "MemoryDenyWriteExecute=yes" in lines and "ProtectSystem=strict" in lines
    # the directories gpud writes into that others make (udev, NFD, the node exporter); /run/cdi is the unit's
    c.run(["mkdir", "-p", "/etc/udev/rules.d", "/etc/kubernetes/node-feature-discovery/features.d",
           "/var/lib/prometheus/node-exporter"])
    c.run(["systemctl", "daemon-reload"])
    c.run(["systemctl", "start", "drain-probe.service"])
    c.run(["systemd-run", "--unit=nobody-holder", "-p", "User=nobody", "/usr/bin/sleep", "infinity"])
    try:
        pid = c.show("nobody-holder.service", "MainPID")["MainPID"]
        assert pid != "0"
        args = f"{pid} drain-probe.service"
        c.write("/etc/systemd/system/gpud-probe.service",
                "[Service]\nType=oneshot\n"
                f"ExecStart=/opt/gpud/bin/python3 /opt/gpud-test/hardening_probe.py /var/lib/gpud/probe.json {args}\n"
                + "\n".join(lines) + "\n")
        c.run(["systemctl", "daemon-reload"])
        c.run(["systemctl", "start", "gpud-probe.service"], timeout=120)
        confined = json.loads(c.path("/var/lib/gpud/probe.json").read_text())
        # the same probe unconfined, as a plain unit of this systemd (nsenter would have the host's
        # capabilities, not the container's)
        c.run(["systemd-run", "--wait", "--quiet", "--unit=gpud-probe-free", "/opt/gpud/bin/python3",
               "/opt/gpud-test/hardening_probe.py", "/run/probe-unconfined.json", *args.split()], timeout=120)
        free = json.loads(c.path("/run/probe-unconfined.json").read_text())
    finally:
        c.run(["systemctl", "stop", "nobody-holder.service", "drain-probe.service"], check=False)
    gpud_paths = ("write-apply-lock", "write-udev-rules", "write-nfd-features", "write-cdi-spec",
                  "write-metrics-textfile")
    for must in ("ctypes-callback", "imports", "udev-netlink", "write-var-lib-gpud", "write-run-gpud",
                 *gpud_paths, "other-users-fds", "drain-over-dbus", "logind-can-reboot"):
        assert confined[must] == "ok", (must, confined, free)
    for denied, why in (("af-inet", "Address family not supported"), ("write-etc-gpud", "Read-only file system"),
                        ("write-usr", "Read-only file system")):
        assert free[denied] == "ok", (denied, free)
        assert why in confined[denied], (denied, confined)
    # anything else root can do in this container, gpud's sandbox can do too
    for k, v in free.items():
        if k not in ("af-inet", "write-etc-gpud", "write-usr") and v == "ok":
            assert confined[k] == "ok", (k, confined[k])


def test_the_deb_has_md5sums_a_real_maintainer_its_license_and_no_stray_scripts(deb_path, tmp_path):
    """Issue 29 item 16: what dpkg and lintian look at, read from the built .deb by dpkg-deb."""
    import subprocess

    def deb(*args: str) -> str:
        return subprocess.run(["dpkg-deb", *args, str(deb_path)], capture_output=True, text=True, check=True).stdout

    control = deb("--field")
    maintainer = next(ln.split(": ", 1)[1] for ln in control.splitlines() if ln.startswith("Maintainer: "))
    assert re.fullmatch(r"[^<>]+ <[^@<>\s]+@[^@<>\s]+>", maintainer) and "localhost" not in maintainer, maintainer
    subprocess.run(["dpkg-deb", "-R", str(deb_path), str(tmp_path / "x")], check=True)
    shipped = sorted(str(p.relative_to(tmp_path / "x")) for p in (tmp_path / "x").rglob("*")
                     if p.is_file() and not p.is_symlink() and "DEBIAN" not in p.parts)
    listed = (tmp_path / "x" / "DEBIAN" / "md5sums").read_text().splitlines()
    assert sorted(ln.split("  ", 1)[1] for ln in listed) == shipped
    check = subprocess.run(["md5sum", "--check", "--quiet", str(tmp_path / "x" / "DEBIAN" / "md5sums")],
                           cwd=tmp_path / "x", capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert (tmp_path / "x" / "usr/share/doc/gpud/LICENSE").read_text().lstrip().startswith("Apache License")
    bins = sorted(p.name for p in (tmp_path / "x" / "opt/gpud/bin").iterdir())
    assert [b for b in bins if not (b in ("gpud", "gpudctl", "gpud-sim") or b.startswith("python"))] == [], bins
    # It depends on the python3.X it was built with (the release's own: 3.11 on Debian 12, 3.12 on
    # Ubuntu 24.04, 3.10 on 22.04), and loads no module at boot by itself (vfio-pci comes with a
    # layout that passes a GPU through: gpud's udev rule, or systemd's modprobe@ unit).
    built_with = subprocess.run(["/usr/bin/python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    depends = next(ln.split(": ", 1)[1] for ln in control.splitlines() if ln.startswith("Depends: "))
    assert depends == f"python{built_with}, systemd (>= 247)", depends
    assert not [p for p in shipped if "modules-load.d" in p], shipped
    assert "modprobe" not in (tmp_path / "x" / "DEBIAN" / "postinst").read_text()
