"""The one test-VM boot of a session, shared by every module that judges a phase of it."""

from __future__ import annotations

import json
import os

import pytest

from tests.vm import vm


@pytest.fixture(scope="session")
def guest(tmp_path_factory):
    still = vm.ensure_tools()
    if still:
        pytest.skip("cannot boot the test VM, and installing failed; missing: " + "; ".join(still))
    out = tmp_path_factory.mktemp("vm")
    build = vm.stage_mtty(str(out))  # the kernel's mtty sample for the vGPU phase
    rc, console, secs = vm.boot(str(out), os.path.join(vm.REPO, "tests", "vm", "guest_binding.py"))
    path = out / "results.json"
    assert path.exists(), f"guest wrote no results (vng rc={rc}, {secs:.0f}s):\n{console[-6000:]}"
    res = json.loads(path.read_text())
    res["boot_seconds"] = secs
    res["mtty_build"] = build
    print(f"\nvm: booted and ran in {secs:.0f}s (guest part {res.get('elapsed')}s)")
    assert "fatal" not in res, res["fatal"]
    return res
