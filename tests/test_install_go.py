"""Issue 29 item 15: where scripts/install-go gets the Go the anchors and the NVML C library are
built with, run for real (no network needed for these cases): a Go new enough on the machine is
taken as it is and nothing is fetched; asking for more than the pinned toolchain is refused with the
reason. And scripts/fresh-check, which runs `make test` on a stock Debian 12 root, brings no Go of
this machine into that root (a stock Debian 12 has golang 1.19 at most: install-go must get its own
there). The fetch itself (Debian's golang-go, then golang.org/toolchain from the Go module proxy)
is what fresh-check's run shows."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.present import present

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "install-go"
PIN = present(re.search(r"^GO_PIN=(\S+)", SCRIPT.read_text(), re.M))[1]


def _go_minor(go: str) -> int | None:
    try:
        v = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, timeout=60).stdout.strip()
    except OSError:
        return None
    m = re.match(r"go1\.(\d+)", v)
    return int(m[1]) if m else None


def _run(want: str, cache: Path, path: str) -> subprocess.CompletedProcess:
    env = {"PATH": path, "GPUD_GO_CACHE": str(cache), "HOME": str(cache.parent / "home"), "LANG": "C.UTF-8"}
    return subprocess.run([str(SCRIPT), want], capture_output=True, text=True, timeout=120, env=env)


def test_a_new_enough_go_on_the_machine_is_taken_and_nothing_fetched(tmp_path):
    go = "/usr/local/go/bin/go"
    minor = _go_minor(go) if os.access(go, os.X_OK) else None
    if minor is None or minor < 26:
        pytest.skip(f"{go} is not a Go >= 1.26 here")
    cache = tmp_path / "cache"
    r = _run("1.26", cache, "/usr/sbin:/usr/bin:/sbin:/bin")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == go
    assert not cache.exists() or not any(cache.iterdir())  # nothing downloaded


def test_more_than_the_pinned_toolchain_is_refused_with_the_reason(tmp_path):
    pin_minor = int(PIN.split(".")[1])
    want = f"1.{pin_minor + 50}"
    r = _run(want, tmp_path / "cache", "/usr/sbin:/usr/bin:/sbin:/bin")
    assert r.returncode == 1
    assert f"the pinned Go {PIN} is older than the {want} asked for" in r.stderr
    assert r.stdout == ""


def test_fresh_check_binds_no_go_of_this_machine():
    text = (REPO / "scripts" / "fresh-check").read_text()
    code = [ln.split("#", 1)[0] for ln in text.splitlines()]
    moved = [ln for ln in code if re.search(r"\b(bind_ro|copy_in|mount)\b", ln)]
    assert moved, "fresh-check's binds were not found"
    for ln in moved:
        assert not re.search(r"/usr/local/go|gpud-go|GOROOT|GOPATH|/root/go|/usr/lib/go", ln), ln
