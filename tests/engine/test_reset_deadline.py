"""A GPU reset runs like an unbind: in a child with a deadline, so a reset the kernel never
finishes leaves the GPU `reset-required` with the reason instead of hanging the pass."""

from __future__ import annotations

import errno
import os
import signal

import pytest

from gpud.host.kernel import deadline_write
from gpud.host.kernel.deadline_write import DeadlineSysfs
from gpud.host.kernel.sysfs import Sysfs
from gpud.host.readonly import ReadOnlyError
from tests.engine.kernel_stores import NeverFinishingReset, RefusingKernel


def test_reset_that_never_returns_times_out(tmp_path):
    pci = "0000:fe:00.0"  # an address no other test uses: the stuck-writes registry is per process
    sysfs = Sysfs(str(tmp_path), store=NeverFinishingReset())
    try:
        with pytest.raises(TimeoutError) as e:
            DeadlineSysfs(sysfs, timeout=0.5, kmsg=str(tmp_path / "kmsg")).reset(pci)
        assert "reset still blocked" in str(e.value)
        with pytest.raises(TimeoutError, match="still blocked"):  # a second reset does not pile up
            DeadlineSysfs(sysfs, timeout=0.5, kmsg=str(tmp_path / "kmsg")).reset(pci)
    finally:
        stuck = deadline_write.stuck_write_for(pci)
        if stuck is not None:  # the simulated kernel never returns: end the abandoned writer
            os.kill(stuck.pid, signal.SIGKILL)


def test_reset_errors_keep_their_errno(tmp_path):
    with pytest.raises(OSError) as e:
        DeadlineSysfs(Sysfs(str(tmp_path), store=RefusingKernel("ENOTTY")), timeout=5).reset("0000:3b:00.1")
    assert e.value.errno == errno.ENOTTY


def test_read_only_refuses_before_forking(tmp_path):
    with pytest.raises(ReadOnlyError):
        DeadlineSysfs(Sysfs(str(tmp_path), read_only=True), timeout=5).reset("0000:3b:00.2")
