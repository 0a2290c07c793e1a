"""Sysfs adapter on a plain directory (the real-host code path: no store) and read-only mode."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from gpud.host.kernel.sysfs import Sysfs, SysfsError
from gpud.host.readonly import ReadOnlyError
from tests.support.present import present
from tests.support.sim_kernel_host import AUDIO, GPU, GPU2, make_host


def test_read_only_refuses_before_touching_anything(tmp_path):
    d = make_host(tmp_path)
    calls: list[str] = []

    def store(path: str, data: bytes) -> int:
        calls.append(path)
        return len(data)

    s = Sysfs(os.path.join(d, "sys"), read_only=True, store=store, modprobe=calls.append)
    with pytest.raises(ReadOnlyError, match="read-only mode: refusing sysfs write"):
        s.write(f"bus/pci/devices/{GPU}/driver_override", "vfio-pci")
    with pytest.raises(ReadOnlyError):
        s.reset(GPU)
    with pytest.raises(ReadOnlyError):
        s.load_module("vfio-pci")
    assert calls == []
    assert present(s.function(GPU)).driver == "nvidia"  # reading still works


def test_real_write_is_one_os_write(tmp_path, monkeypatch):
    (tmp_path / "bus/pci").mkdir(parents=True)
    target = tmp_path / "bus/pci/drivers_probe"
    target.write_bytes(b"")
    writes = []
    real_write = os.write

    def write(fd: int, data: bytes) -> int:
        writes.append(data)
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    Sysfs(str(tmp_path)).write("bus/pci/drivers_probe", GPU)
    assert writes == [GPU.encode()] and target.read_bytes() == GPU.encode()


def test_real_write_errors_become_sysfs_errors(tmp_path):
    s = Sysfs(str(tmp_path))
    with pytest.raises(SysfsError) as ei:
        s.write("bus/pci/devices/0000:99:00.0/driver_override", "vfio-pci")
    e = ei.value
    assert e.errno == errno.ENOENT and isinstance(e, OSError)
    assert e.path.endswith("0000:99:00.0/driver_override") and "removed" in e.meaning
    with pytest.raises(ValueError):
        s.write("../etc/passwd", "x")
    with pytest.raises(ValueError):
        s.write("/etc/passwd", "x")


def test_missing_tree_reads_empty(tmp_path):
    s = Sysfs(str(tmp_path / "nothing"))
    assert s.functions() == [] and s.drivers() == [] and s.group_members(3) == []
    assert s.function(GPU) is None and s.vfio_device_path(3) is None


def test_a_stuck_read_leaves_the_functions_after_it_read(tmp_path):
    """A full read reads every driver_override in turn on one helper thread: the one stuck on its
    device lock is reported with the value last seen, the functions after it with their own (read
    on a new thread), and only it is `stuck`."""
    d = make_host(tmp_path)
    s = Sysfs(os.path.join(d, "sys"), lock_timeout=0.05)
    base = os.path.join(d, "sys/devices/pci0000:00")
    with open(os.path.join(base, GPU2, "driver_override"), "w") as f:
        f.write("vfio-pci\n")
    started = []
    real_start = threading.Thread.start

    def counting_start(self):
        started.append(self.name)
        real_start(self)

    threading.Thread.start = counting_start  # type: ignore[method-assign]
    try:
        assert {f.address: f.driver_override for f in s.functions()}[GPU2] == "vfio-pci"
        assert started.count("sysfs-read") == 1  # one thread for the whole read
        seen_audio = s.function(AUDIO)
        path = os.path.join(base, GPU, "driver_override")  # GPU sorts before AUDIO and GPU2
        os.unlink(path)
        os.mkfifo(path)
        with open(os.path.join(base, GPU2, "driver_override"), "w") as f:
            f.write("(null)\n")
        started.clear()
        fns = {f.address: f for f in s.functions()}
    finally:
        threading.Thread.start = real_start  # type: ignore[method-assign]
    assert s.stuck == {GPU} and fns[GPU].driver_override is None
    assert fns[GPU2].driver_override is None and fns[AUDIO] == seen_audio  # read after the stuck one
    assert started.count("sysfs-read") == 2
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # a writer appears: the stuck open returns
    os.close(fd)
    left_behind = s._stuck_reads[GPU]
    left_behind.thread.join(5)
    assert not left_behind.thread.is_alive()
    # the thread left behind stopped at the stuck read: the functions after it were read by another
    assert list(left_behind.results)[-1] == GPU and AUDIO not in left_behind.results


def test_stuck_driver_override_read_does_not_block(tmp_path):
    """A device whose lock is held (unbind in progress) must not stall a full read: a FIFO stands in
    for driver_override, whose open() blocks until a writer appears."""
    d = make_host(tmp_path)
    s = Sysfs(os.path.join(d, "sys"), lock_timeout=0.05)
    assert present(s.function(GPU)).driver_override is None  # seen once
    path = os.path.join(d, "sys/devices/pci0000:00", GPU, "driver_override")
    os.unlink(path)
    os.mkfifo(path)
    fns = {f.address: f for f in s.functions()}
    assert fns[GPU].driver == "nvidia" and fns[GPU].driver_override is None
    assert s.stuck == {GPU}
    # a second read does not start another reader while the first is stuck
    before = threading.active_count()
    s.function(GPU)
    assert threading.active_count() == before
    # the lock is released: the stuck reader finishes and the next read sees the value
    fd = os.open(path, os.O_WRONLY)
    os.write(fd, b"vfio-pci\n")
    os.close(fd)
    s._stuck_reads[GPU].thread.join(5)
    os.unlink(path)
    with open(path, "w") as f:
        f.write("vfio-pci\n")
    assert present(s.function(GPU)).driver_override == "vfio-pci" and s.stuck == set()
