"""Issue 29 item 16: vfio-pci is loaded only where a layout needs it, and then by systemd: gpud's
sandbox (ProtectKernelModules=yes, no CAP_SYS_MODULE) asks PID 1 over the real system bus to start
systemd's own modprobe@<module>.service and checks /sys/module/<module> afterwards
(gpud.host.systemd.modules), against a real systemd 252 in a container.

A container cannot load kernel modules, so the one stand-in is the kernel's effect: an
instance drop-in for modprobe@vfio_pci.service whose ExecStart makes the module's directory in a
scratch sysfs (the unit, its job, the D-Bus calls and the sandbox are real). The template itself is
left as systemd ships it for the failing case: its ConditionCapability=CAP_SYS_MODULE skips it in
the container, the job still ends "done", and gpud must not take that for a loaded module."""

from __future__ import annotations

import json
import sys

import pytest

from tests.systemd.nspawn import REPO, Container, missing_prerequisites

pytestmark = pytest.mark.nspawn

def _sandbox() -> list[str]:
    """gpud.service's own sandbox, read from the unit: every confinement line of its [Service]
    section as a transient unit's property (the probe then runs as confined as gpud does)."""
    keys = ("Protect", "Private", "Restrict", "CapabilityBoundingSet", "NoNewPrivileges", "LockPersonality",
            "MemoryDenyWriteExecute", "SystemCall", "IPAddress", "ReadWritePaths", "UMask")
    text = (REPO / "systemd" / "gpud.service").read_text()
    service = text.split("[Service]", 1)[1].split("\n[", 1)[0]
    lines = [ln.strip() for ln in service.splitlines() if ln.strip() and not ln.startswith("#")]
    # but ProtectHome and PrivateTmp: they hide where this test's interpreter and repository are
    # bound from when the checkout lives under /home or /tmp (the packaged gpud lives in /opt/gpud);
    # neither has any bearing on module loading
    props = [ln for ln in lines if ln.split("=", 1)[0].startswith(keys)
             and not ln.startswith(("ProtectHome=", "PrivateTmp="))]
    assert any(p == "ProtectKernelModules=yes" for p in props) and not any("CAP_SYS_MODULE" in p for p in props)
    return [a for p in props for a in ("-p", p)]


SANDBOX = _sandbox()

PROBE = """
import json, sys
from gpud.host.systemd.modules import load_module, loaded
module, root = sys.argv[1], sys.argv[2]
try:
    load_module(module, sys_root=root, timeout=60)
    print(json.dumps({"ok": True, "loaded": loaded(module, root)}))
except Exception as e:
    print(json.dumps({"ok": False, "type": type(e).__name__, "error": str(e)}))
"""


@pytest.fixture(scope="module")
def container():
    why = missing_prerequisites()
    if why:
        pytest.skip(f"nspawn tests: {why}")
    with Container() as c:  # booted on entry
        yield c


def in_sandbox(c, module: str, root: str) -> dict:
    r = c.run(["systemd-run", "--wait", "--pipe", "--collect", "--quiet", *SANDBOX,
               "-E", f"PYTHONPATH={REPO}", "-E", "PYTHONDONTWRITEBYTECODE=1",
               sys.executable, "-c", PROBE, module, root], timeout=120)
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_gpud_sandbox_has_systemd_load_the_module(container):
    c = container
    c.run(["mkdir", "-p", "/run/fakesys/module"])
    c.write("/run/systemd/system/modprobe@vfio_pci.service.d/kernel-standin.conf",
            "[Unit]\nConditionCapability=\n[Service]\nExecStart=\n"
            "ExecStart=/bin/sh -c 'mkdir -p /run/fakesys/module/%i && echo ran >>/run/fakesys/runs-%i'\n")
    c.run(["systemctl", "daemon-reload"])
    # the sandbox itself cannot load modules: modprobe there is refused
    direct = c.run(["systemd-run", "--wait", "--pipe", "--collect", "--quiet", *SANDBOX, "modprobe", "vfio-pci"],
                   check=False, timeout=60)
    assert direct.returncode != 0
    assert in_sandbox(c, "vfio-pci", "/run/fakesys") == {"ok": True, "loaded": True}
    assert c.path("/run/fakesys/module/vfio_pci").is_dir()
    runs = c.path("/run/fakesys/runs-vfio_pci")
    assert runs.read_text() == "ran\n"  # the unit ran once, as systemd's job
    assert in_sandbox(c, "vfio-pci", "/run/fakesys") == {"ok": True, "loaded": True}
    assert runs.read_text() == "ran\n"  # loaded already: no second job


def test_a_job_done_without_the_module_is_an_error_naming_the_unit(container):
    """systemd's unmodified template: skipped in a container (ConditionCapability), job "done"."""
    c = container
    out = in_sandbox(c, "gpud-no-such-module", "/run/fakesys")
    assert out["ok"] is False and out["type"] == "ModuleLoadError", out
    assert "journalctl -u modprobe@gpud_no_such_module.service" in out["error"], out
    assert not c.path("/run/fakesys/module/gpud_no_such_module").exists()
