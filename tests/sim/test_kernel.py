"""Kernel write semantics of the simulated sysfs, driven through the real Sysfs adapter."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from gpud.host.kernel.procs import Procs
from gpud.host.kernel.sysfs import SysfsError
from gpud.sim import kernel
from gpud.sim.kernel import Store
from gpud.sim.state import (
    SimGi,
    SimProcess,
    load,
    locked,
)
from gpud.sim.sysfs_tree import render
from tests.support.present import present
from tests.support.sim_kernel_host import (
    AUDIO,
    GPU,
    GPU2,
    NOGROUP,
    UUID,
    adapter,
    add_process,
    drop_processes,
    make_host,
    to_native,
    to_vfio,
)


@pytest.fixture
def host(tmp_path):
    return make_host(tmp_path / "host")


def test_native_to_vfio_and_back_with_companion(host):
    s = adapter(host)
    assert "vfio-pci" not in s.drivers()
    s.load_module("vfio-pci")
    assert "vfio-pci" in s.drivers()
    assert os.path.exists(os.path.join(host, "dev/nvidia0"))

    to_vfio(s, GPU)
    gpu = s.function(GPU)
    assert (present(gpu).driver, present(gpu).driver_override) == ("vfio-pci", "vfio-pci")
    assert s.vfio_device_path(20) is None  # audio still on snd_hda_intel: group not viable
    assert not os.path.exists(os.path.join(host, "dev/nvidia0"))
    assert not os.path.exists(os.path.join(host, f"proc/driver/nvidia/gpus/{GPU}"))

    to_vfio(s, AUDIO)
    assert present(s.function(AUDIO)).driver == "vfio-pci"
    assert s.vfio_device_path(20) == os.path.join(host, "dev/vfio/20")
    assert sorted(os.listdir(os.path.join(host, "sys/bus/pci/drivers/vfio-pci"))) == sorted(
        [GPU, AUDIO, "bind", "unbind", "new_id", "remove_id"])
    # the untouched GPU kept its driver and node
    assert present(s.function(GPU2)).driver == "nvidia"

    to_native(s, GPU)
    to_native(s, AUDIO)
    assert [(f.address, f.driver, f.driver_override) for f in s.functions()] == [
        (NOGROUP, "nvidia", None), (GPU, "nvidia", None), (AUDIO, "snd_hda_intel", None), (GPU2, "nvidia", None)]
    assert s.vfio_device_path(20) is None
    assert os.path.exists(os.path.join(host, "dev/nvidia0"))
    assert Procs(os.path.join(host, "proc"), os.path.join(host, "dev")).nvidia_minor(GPU) == 0


def _errno(fn) -> SysfsError:
    with pytest.raises(SysfsError) as ei:
        fn()
    return ei.value


def test_errnos(host):
    s = adapter(host)
    w = s.write
    # vfio-pci is not loaded: its bind file does not exist
    assert _errno(lambda: w("bus/pci/drivers/vfio-pci/bind", GPU)).errno == errno.ENOENT
    s.load_module("vfio_pci")
    e = _errno(lambda: w("bus/pci/drivers/vfio-pci/bind", GPU))  # no override: no match
    assert e.errno == errno.ENODEV and "driver_override" in e.meaning
    e = _errno(lambda: w("bus/pci/drivers/nvidia/bind", GPU))  # matches, but already bound
    assert e.errno == errno.EBUSY and str(e).startswith("EBUSY: device already bound")
    assert _errno(lambda: w("bus/pci/drivers/nvidia/bind", "0000:99:00.0")).errno == errno.ENODEV
    assert _errno(lambda: w("bus/pci/drivers/snd_hda_intel/unbind", GPU)).errno == errno.ENODEV
    assert _errno(lambda: w("bus/pci/drivers_probe", "0000:99:00.0")).errno == errno.ENODEV
    e = _errno(lambda: w(f"bus/pci/devices/{GPU}/driver_override", "x" * 4096))
    assert e.errno == errno.EINVAL and "too long" in e.meaning
    assert _errno(lambda: w(f"bus/pci/devices/{GPU}/reset", "0")).errno == errno.EINVAL
    assert _errno(lambda: w(f"bus/pci/devices/{GPU}/reset", "yes")).errno == errno.EINVAL
    assert _errno(lambda: w(f"bus/pci/devices/{GPU}/vendor", "0x1234")).errno == errno.EACCES
    assert _errno(lambda: w(f"bus/pci/devices/{GPU}/no_such_attr", "1")).errno == errno.ENOENT
    assert _errno(lambda: w(f"bus/pci/devices/{GPU}", "1")).errno == errno.EISDIR
    # vfio-pci probe of a device without an IOMMU group
    w(f"bus/pci/devices/{NOGROUP}/driver_override", "vfio-pci")
    w("bus/pci/drivers/nvidia/unbind", NOGROUP)
    assert _errno(lambda: w("bus/pci/drivers/vfio-pci/bind", NOGROUP)).errno == errno.EINVAL
    w("bus/pci/drivers_probe", NOGROUP)  # succeeds even though nothing binds
    assert present(s.function(NOGROUP)).driver is None
    # nothing above changed a driver it should not have
    assert present(s.function(GPU)).driver == "nvidia" and present(s.function(GPU)).driver_override is None


def test_reset_busy_with_holder_and_applies_pending_mig_mode(host):
    s = adapter(host)
    with locked(host) as st:
        st.gpus[GPU].mig_pending = 1
    add_process(host, SimProcess(4242, "python3", UUID))
    assert _errno(lambda: s.reset(GPU)).errno == errno.EBUSY
    assert load(host).gpus[GPU].mig_mode == 0
    drop_processes(host)
    s.reset(GPU)
    assert load(host).gpus[GPU].mig_mode == 1


def test_dma_ownership_conflict_in_group(host):
    s = adapter(host)
    s.load_module("vfio-pci")
    to_vfio(s, GPU)
    s.write("bus/pci/drivers/snd_hda_intel/unbind", AUDIO)  # driverless companion: group viable
    assert s.vfio_device_path(20) is not None
    add_process(host, SimProcess(777, "qemu-system-x86", GPU))  # a VM owns the group
    e = _errno(lambda: s.write("bus/pci/drivers/snd_hda_intel/bind", AUDIO))
    assert e.errno == errno.EBUSY and "IOMMU group" in e.meaning
    drop_processes(host)
    s.write("bus/pci/drivers/snd_hda_intel/bind", AUDIO)
    assert present(s.function(AUDIO)).driver == "snd_hda_intel"
    assert s.vfio_device_path(20) is None


def _blocking_unbind(host, drv, addr, release):
    """Start an unbind in a thread; return once it reported being blocked; `release` frees it."""
    blocked = threading.Event()
    s = adapter(host, on_block=lambda a: blocked.set())
    errors = []

    def run():
        try:
            s.write(f"bus/pci/drivers/{drv}/unbind", addr)
        except Exception as e:  # noqa: BLE001 - pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert blocked.wait(10), "unbind never blocked"
    assert t.is_alive()
    assert present(s.function(addr)).driver == drv  # still bound while blocked
    release()
    t.join(10)
    assert not t.is_alive() and not errors
    assert present(s.function(addr)).driver is None


def test_unbind_of_held_gpu_blocks_until_holder_leaves(host):
    with locked(host) as st:
        st.gpus[GPU].mig_mode = 1
        st.gpus[GPU].gis = [SimGi(1, 9, 0, 4)]
        from gpud.sim.state import SimCi
        st.gpus[GPU].gis[0].cis = [SimCi(0, 2, "MIG-aaaaaaaa-0000-0000-0000-000000000001")]
    add_process(host, SimProcess(31337, "trainer", "MIG-aaaaaaaa-0000-0000-0000-000000000001"))
    _blocking_unbind(host, "nvidia", GPU, lambda: drop_processes(host))


def test_hung_unbind_blocks_until_unhung(host):
    kernel.hang(host, GPU)
    _blocking_unbind(host, "nvidia", GPU, lambda: kernel.unhang(host, GPU))


def test_vfio_unbind_blocks_while_vm_holds_group(host):
    s = adapter(host)
    s.load_module("vfio-pci")
    to_vfio(s, GPU)
    to_vfio(s, AUDIO)
    add_process(host, SimProcess(9000, "qemu-system-x86", AUDIO))
    holders = Procs(os.path.join(host, "proc"), os.path.join(host, "dev")).holders(["/dev/vfio/20"])
    assert [(h.pid, h.device) for h in holders] == [(9000, "/dev/vfio/20")]
    _blocking_unbind(host, "vfio-pci", GPU, lambda: drop_processes(host))


def test_remove_forgets_override_and_rescan_probes_native(host):
    s = adapter(host)
    s.write(f"bus/pci/devices/{GPU}/driver_override", "vfio-pci")
    s.write(f"bus/pci/devices/{GPU}/remove", "1")
    s.write(f"bus/pci/devices/{AUDIO}/remove", "1")
    assert s.function(GPU) is None and GPU not in [f.address for f in s.functions()]
    assert s.group_members(20) == []
    assert _errno(lambda: s.write("bus/pci/drivers_probe", GPU)).errno == errno.ENODEV
    s.write("bus/pci/rescan", "1")
    gpu = s.function(GPU)
    assert (present(gpu).driver, present(gpu).driver_override) == ("nvidia", None)
    assert present(s.function(AUDIO)).driver == "snd_hda_intel"
    assert s.group_members(20) == [GPU, AUDIO]


def test_modprobe_claims_overridden_unbound_devices(host):
    s = adapter(host)
    s.write(f"bus/pci/devices/{GPU2}/driver_override", "vfio-pci")
    s.write("bus/pci/drivers/nvidia/unbind", GPU2)
    s.write("bus/pci/drivers_probe", GPU2)  # vfio-pci not loaded: nothing binds, no error
    assert present(s.function(GPU2)).driver is None
    s.load_module("vfio-pci")
    assert present(s.function(GPU2)).driver == "vfio-pci"
    assert s.vfio_device_path(30) is not None


def test_new_id_grabs_every_matching_unbound_device(host):
    s = adapter(host)
    s.load_module("vfio-pci")
    for a in (GPU, GPU2):
        s.write("bus/pci/drivers/nvidia/unbind", a)
    s.write("bus/pci/drivers/vfio-pci/new_id", "10de 2335")
    assert present(s.function(GPU)).driver == present(s.function(GPU2)).driver == "vfio-pci"
    assert present(s.function(NOGROUP)).driver == "nvidia"  # bound devices are left alone
    assert _errno(lambda: s.write("bus/pci/drivers/vfio-pci/new_id", "zz")).errno == errno.EINVAL


def test_unbind_lock_granted_only_without_holders(host):
    procs = Procs(os.path.join(host, "proc"), os.path.join(host, "dev"), store=Store(host))
    add_process(host, SimProcess(5, "nvidia-persiste", GPU))
    assert procs.take_unbind_lock(GPU) is False
    drop_processes(host)
    assert procs.take_unbind_lock(GPU) is True
    assert procs.take_unbind_lock("0000:99:00.0") is False
    render(host, load(host))  # a re-render keeps the driver's lock state
    with open(os.path.join(host, f"proc/driver/nvidia/gpus/{GPU}/unbindLock")) as f:
        assert f.read().strip() == "1"


def test_unplug_and_plug_whole_card(host):
    kernel.unplug(host, GPU)
    s = adapter(host)
    assert s.function(GPU) is None and s.function(AUDIO) is None
    assert load(host).functions[GPU].present is False
    kernel.plug(host, AUDIO)
    assert present(s.function(GPU)).driver == "nvidia" and present(s.function(AUDIO)).driver == "snd_hda_intel"
    with pytest.raises(LookupError):
        kernel.unplug(host, "0000:99:00.0")


def test_failed_write_leaves_state_untouched(host):
    before = load(host)
    s = adapter(host)
    _errno(lambda: s.write("bus/pci/drivers/nvidia/bind", GPU))
    assert load(host) == before
