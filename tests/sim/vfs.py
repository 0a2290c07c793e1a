"""Test set-up: n SR-IOV VFs on a simulated PF the way the kernel allows it.

The nvidia driver has no sriov_configure, so `sriov_numvfs` is written while the PF sits on
pci-pf-stub (what NVIDIA's sriov-manage does, with any count here), then the PF goes back to nvidia.
The unbind lock is taken first, so a test holding the GPU fails here instead of blocking.
"""

from __future__ import annotations

import os

import pytest

from gpud.host.kernel.sysfs import Sysfs, SysfsError
from gpud.sim.kernel import Store, modprobe
from gpud.sim.state import load
from tests.support.present import present


def set_vfs(d, pf: str, n: int) -> None:
    d = os.path.abspath(d)
    store = Store(d)

    def w(rel: str, value: str) -> None:
        store(os.path.join(d, rel), value.encode())

    lock = f"proc/driver/nvidia/gpus/{pf}/unbindLock"
    w(lock, "1")
    with open(os.path.join(d, lock)) as f:
        assert f.read().strip() == "1", f"{pf} is held: the unbind lock is refused"
    w("sys/bus/pci/drivers/nvidia/unbind", pf)
    modprobe(d, "pci-pf-stub")
    fn = load(d).functions[pf]
    w("sys/bus/pci/drivers/pci-pf-stub/new_id", f"{fn.vendor:04x} {fn.device:04x}")
    try:
        w(f"sys/bus/pci/devices/{pf}/sriov_numvfs", str(n))
    finally:
        w("sys/bus/pci/drivers/pci-pf-stub/unbind", pf)
        w("sys/bus/pci/drivers/nvidia/bind", pf)


def write_err(fs: Sysfs, rel: str, value: str) -> int:
    """The errno of a sysfs write the test expects to be refused."""
    with pytest.raises(SysfsError) as info:
        fs.write(rel, value)
    return present(info.value.errno, "an errno")
