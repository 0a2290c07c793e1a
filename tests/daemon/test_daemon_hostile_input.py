"""Issue 13 on a real gpud process: layout files that are not files, or too big, never stall the
daemon or pass as valid; a file linked to a secret is not quoted to readers of status; replies of a
layout with 12,000 errors still fit in a frame; and a stuck unbind's helper does not outlive SIGTERM."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpud.sim.kernel import unhang
from tests.scenarios.definitions import layout
from tests.support.daemon import wait_until

pytestmark = pytest.mark.daemon

GOOD = layout({"devices": [0, 1], "mig-enabled": False})
LIMIT = 512 * 1024  # the layout size limit the README states


def layout_errors(d) -> list[str]:
    r = d.ctl("status", "--json", timeout=30)  # a stalled daemon fails here, not later
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)["layout"]["errors"]


def replace(path, make) -> None:
    """Swap what is at the layout path (inotify then makes the daemon re-read it)."""
    tmp = path.with_name(".swap")
    if tmp.exists() or tmp.is_symlink():
        tmp.unlink()
    make(tmp)
    os.replace(tmp, path)


def test_fifo_oversize_and_secret_link_at_the_layout_path(daemon, tmp_path):
    d = daemon(["h100-80gb:2"], GOOD)
    assert d.ctl("apply", "--wait").returncode == 0

    # A FIFO nobody writes to: reading it once blocked the daemon for good.
    replace(d.config, os.mkfifo)
    wait_until(lambda: any("a FIFO, not a regular file" in e for e in layout_errors(d)), what="FIFO refused")
    st = d.status()
    assert st["layout"]["valid"] is False and all(g["converged"] for g in st["gpus"])

    # Over the limit: refused by its size before a byte is parsed, never `valid`.
    replace(d.config, lambda p: p.write_text("# padding\n" * (LIMIT // 10 + 1)))
    wait_until(lambda: any(f"a layout may be at most {LIMIT} bytes" in e for e in layout_errors(d)),
               what="oversized file refused")
    assert d.status()["layout"]["valid"] is False

    # A link to a secret-like file in another tree: its lines must not reach status or events.
    secret = tmp_path / "secret" / "shadow"
    secret.parent.mkdir()
    secret.write_text("root:$6$SeCrEtSaLt$HaShHaShHaSh:19000:0:99999:7:::\nsvc-token: QWERTY-123456\n")
    replace(d.config, lambda p: p.symlink_to(secret))
    errors = wait_until(lambda: (e := layout_errors(d)) and "not quoted" in e[0] and e, what="secret unquoted")
    shown = json.dumps(d.status()) + d.ctl("events").stdout
    for word in ("SeCrEtSaLt", "HaShHaShHaSh", "svc-token", "QWERTY-123456", "99999"):
        assert word not in shown, word
    assert "at line(s) 1, 2" in errors[0]

    # Back to a good file: taken again.
    replace(d.config, lambda p: p.write_text(GOOD))
    wait_until(lambda: d.status()["layout"]["valid"], what="good file taken again")


def test_replies_for_a_layout_with_12000_missing_gpus_fit_and_say_what_was_left_out(daemon, tmp_path):
    d = daemon(["h100-80gb:2"], GOOD)
    assert d.ctl("apply", "--wait").returncode == 0
    big = "version: v1\nlayouts:\n  big:\n    - devices: [" + ", ".join(str(100 + i) for i in range(12000)) + "]\n" \
          "      mig-enabled: false\n"
    candidate = tmp_path / "big.yaml"
    candidate.write_text(big)
    more = "... and 11900 more errors (left out of this reply)"

    r = d.ctl("check", str(candidate), timeout=300)
    assert r.returncode == 4, r.stdout + r.stderr  # invalid layout, not "frame exceeds the limit"
    assert "big.yaml:4 layouts.big[0].devices[0]: no GPU with index 100" in r.stdout and more in r.stdout
    r = d.ctl("plan", "--json", str(candidate), timeout=300)
    assert r.returncode == 4, r.stdout + r.stderr
    plan = json.loads(r.stdout)
    assert plan["errors_omitted"] == 11900 and len(plan["errors"]) == 101 and plan["errors"][-1] == more

    d.config.write_text(big)
    r = d.ctl("reload", timeout=300)
    assert r.returncode == 4, r.stdout + r.stderr
    assert more in r.stdout
    st = d.status()
    assert st["layout"]["valid"] is False and st["layout"]["errors_omitted"] == 11900
    assert len(st["layout"]["errors"]) == 101 and st["layout"]["errors"][-1] == more
    assert all(g["converged"] for g in st["gpus"])  # the last good layout stays in force
    r = d.ctl("plan", "--json", timeout=300)
    assert r.returncode == 4 and json.loads(r.stdout)["errors_omitted"] == 11900, r.stdout + r.stderr
    r = d.ctl("apply", "--wait", timeout=300)
    assert r.returncode == 4, r.stdout + r.stderr
    assert "no GPU with index 100" in r.stderr + r.stdout and "more errors" in r.stderr + r.stdout
    r = d.ctl("events", "--json")
    assert r.returncode == 0, r.stderr
    invalid = [json.loads(line) for line in r.stdout.splitlines() if '"layout-invalid"' in line]
    assert invalid and invalid[-1]["data"]["errors_omitted"] == 11980


def _helpers_of(host) -> list[int]:
    """Live sysfs-writer helpers working on this simulated host (zombies are not alive)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"gpud.host.kernel.sysfs_writer" in cmd and str(host).encode() in cmd and state != "Z":
            pids.append(int(entry))
    return pids


def test_stuck_unbind_helper_does_not_outlive_sigterm(daemon):
    d = daemon(["h100-80gb:1"], layout({"devices": [0], "workload": "container"}), "--unbind-timeout", "2")
    assert d.ctl("apply", "--wait").returncode == 0
    pci = d.status()["gpus"][0]["pci"]
    assert d.sim("hang", pci).returncode == 0
    d.config.write_text(layout({"devices": [0], "workload": "vm-passthrough"}))
    wait_until(lambda: d.status()["gpus"][0]["state"] == "stuck", what="stuck")
    helpers = _helpers_of(d.host)
    assert helpers, "the abandoned helper is running"
    try:
        assert d.stop() == 0  # SIGTERM
        wait_until(lambda: not _helpers_of(d.host), timeout=30, what="the helper to be gone")
    finally:
        unhang(d.host, pci)  # on failure: let it finish, so nothing outlives the test
    assert "is still blocked in the kernel; killed" not in d.log.read_text()  # the simulator's hang is killable
