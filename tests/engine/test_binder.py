"""The binder on the simulated kernel: what a QEMU guest cannot show (nvidia, unbindLock, a hang).

The simulator's kernel blocks an unbind exactly where the real one does (busy nvidia GPU, held
vfio group, `hang`), so these tests prove the binder never lets such a write block its caller.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time

import msgspec
import pytest

from gpud.engine.binding import binder
from gpud.engine.observe.discovery import companions_of
from gpud.host.kernel.deadline_write import stuck_writes
from gpud.host.kernel.kmsg import kernel_reason
from gpud.host.kernel.procs import Procs
from gpud.host.kernel.sysfs import Sysfs
from gpud.model import Gpu
from gpud.plan import binding
from gpud.plan.binding import plan_binding
from gpud.sim import catalog, host
from gpud.sim import kernel as simkernel
from gpud.sim import state as simstate
from gpud.sim.state import SimProcess
from gpud.sim.sysfs_tree import render
from tests.support.present import present

ADA = catalog.gpu_address(0)  # rtx6000-ada: GPU + HD audio companion in one IOMMU group
ADA_AUDIO = ADA[:-1] + "1"
H200 = catalog.gpu_address(1)


@pytest.fixture
def sim(tmp_path):
    d = tmp_path / "host"
    d.mkdir()
    (d / "run").mkdir()
    st = catalog.build(["rtx6000-ada", "h200"])
    simstate.save(d, st)
    render(d, st)
    h = host(d)
    yield h
    # Never leave an abandoned writer behind: clear hangs/holders so blocked children finish.
    with simstate.locked(d) as st:
        st.hangs.clear()
        st.processes.clear()
        render(d, st)
    _wait_for(lambda: not stuck_writes(), what="abandoned writers to finish")


def _wait_for(cond, *, what: str, limit: float = 20.0) -> None:
    """Bounded wait on a condition (not a timing assertion: fails only if it never happens)."""
    deadline = time.monotonic() + limit
    delay = 0.005
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def adapters(h, **kw):
    return (Sysfs(str(h.sys_root), store=h.store, modprobe=h.modprobe, dev_root=str(h.dev_root), **kw),
            Procs(str(h.proc_root), str(h.dev_root), store=h.store))


def gpu(sysfs: Sysfs, pci: str) -> Gpu:
    fns = sysfs.functions()
    f = next(x for x in fns if x.address == pci)
    return Gpu(index=0, function=f, companions=companions_of(f, fns))


def driver(sysfs, pci):
    return sysfs.function(pci).driver


def hold(h, pid: int, name: str, device: str) -> None:
    with simstate.locked(h.host_dir) as st:
        st.processes.append(SimProcess(pid=pid, name=name, device=device))
        render(h.host_dir, st)


def release(h, pid: int) -> None:
    with simstate.locked(h.host_dir) as st:
        st.processes = [p for p in st.processes if p.pid != pid]
        render(h.host_dir, st)


def group_of(sysfs, pci):
    return sysfs.function(pci).iommu_group


def test_round_trip_whole_group_and_vfio_node(sim):
    sysfs, procs = adapters(sim)
    group = group_of(sysfs, ADA)
    node = sim.dev_root / "vfio" / str(group)
    closed = []
    plan = plan_binding(gpu(sysfs, ADA), "vm-passthrough", drivers=set(sysfs.drivers()))
    out = binder.execute(sysfs, procs, plan, before_unbind=lambda: closed.append(1), timeout=10)
    assert out.state == "converged", out
    assert driver(sysfs, ADA) == "vfio-pci" and driver(sysfs, ADA_AUDIO) == "vfio-pci"
    assert sysfs.function(ADA_AUDIO).driver_override == "vfio-pci"
    assert node.exists() and closed == [1]
    assert "load-module vfio-pci vfio-pci" in out.done[0]

    # idempotent: a fresh plan has nothing to do, and executing it changes nothing
    again = plan_binding(gpu(sysfs, ADA), "vm-passthrough")
    assert again.steps == ()
    assert binder.execute(sysfs, procs, again).state == "converged"

    back = plan_binding(gpu(sysfs, ADA), "container")
    out = binder.execute(sysfs, procs, back, timeout=10)
    assert out.state == "converged", out
    assert driver(sysfs, ADA) == "nvidia" and driver(sysfs, ADA_AUDIO) == "snd_hda_intel"
    assert sysfs.function(ADA).driver_override is None and not node.exists()


def test_holder_of_the_gpu_means_waiting_and_nothing_written(sim):
    sysfs, procs = adapters(sim)
    hold(sim, 4242, "trainer", H200)
    closed = []
    out = binder.execute(sysfs, procs, plan_binding(gpu(sysfs, H200), "vm-passthrough"),
                         before_unbind=lambda: closed.append(1), timeout=5)
    assert out.state == "waiting", out
    assert [(h.pid, h.name) for h in out.holders] == [(4242, "trainer")]
    assert "4242 (trainer)" in out.message and "/dev/nvidia1" in out.message
    assert out.done == () and closed == []  # NVML not closed for nothing
    f = sysfs.function(H200)
    assert f.driver == "nvidia" and f.driver_override is None


def test_unbind_lock_refused_means_waiting(sim):
    """A user /proc cannot show (another pid namespace, a kernel client): only the driver's
    unbindLock knows. Refused -> waiting, override not written, lock not left taken."""
    sysfs, procs = adapters(sim)
    hold(sim, 777, "persistenced", H200)
    shutil.rmtree(sim.proc_root / "777")  # invisible to the /proc scan
    out = binder.execute(sysfs, procs, plan_binding(gpu(sysfs, H200), "vm-passthrough"), timeout=5)
    assert out.state == "waiting", out
    assert "unbindLock" in out.message and out.holders == ()
    assert sysfs.function(H200).driver == "nvidia"
    assert sysfs.function(H200).driver_override is None


def test_unbind_lock_granted_when_idle(sim):
    sysfs, procs = adapters(sim)
    taken: list[str] = []
    real_take = procs.take_unbind_lock

    def take(pci: str) -> bool:
        taken.append(pci)
        return real_take(pci)

    procs.take_unbind_lock = take  # the real lock, counted
    out = binder.execute(sysfs, procs, plan_binding(gpu(sysfs, H200), "vm-passthrough"), timeout=10)
    assert out.state == "converged", out
    assert taken == [H200]


def test_gpud_own_handle_still_open_fails(sim, tmp_path):
    """If closing NVML did not release our own fd, say so instead of waiting on ourselves."""
    sysfs, procs = adapters(sim)
    me = sim.proc_root / str(os.getpid())
    (me / "fd").mkdir(parents=True)
    (me / "comm").write_text("gpud\n")
    os.symlink(sim.dev_root / "nvidia1", me / "fd" / "5")
    out = binder.execute(sysfs, procs, plan_binding(gpu(sysfs, H200), "vm-passthrough"),
                         before_unbind=lambda: None, timeout=5)
    assert out.state == "failed" and "gpud itself still holds /dev/nvidia1" in out.message


def test_held_nvidia_unbind_blocks_and_becomes_stuck_without_blocking_caller(sim):
    """Without the holders check the kernel blocks the unbind (as nvidia does): the binder gives
    up after its timeout, reports stuck with the kernel's view, and the device is not touched
    again until the write returns; once the holder leaves, the abandoned write completes."""
    sysfs, procs = adapters(sim)
    hold(sim, 4243, "cuda-app", H200)
    plan = plan_binding(gpu(sysfs, H200), "vm-passthrough")
    out = binder.execute(sysfs, procs, plan, timeout=0.5, check_holders=False)
    assert out.state == "stuck", out
    assert out.stuck_pid and "unbind" in present(out.step) and "state" in present(out.message)
    assert "set-override" in out.done[-1]
    # a second pass must not write to the device again
    again = binder.execute(sysfs, procs, plan_binding(gpu(sysfs, H200), "vm-passthrough"), timeout=0.5)
    assert again.state == "stuck" and "still blocked" in again.message and again.stuck_pid == out.stuck_pid
    release(sim, 4243)
    _wait_for(lambda: not stuck_writes(), what="the abandoned unbind to finish")
    assert sysfs.function(H200).driver is None  # the kernel finished the unbind on its own
    out = binder.execute(sysfs, procs, plan_binding(gpu(sysfs, H200), "vm-passthrough"), timeout=10)
    assert out.state == "converged", out
    assert driver(sysfs, H200) == "vfio-pci"


async def test_hang_is_stuck_while_the_event_loop_keeps_serving(sim):
    """`hang`: the unbind never returns. The caller's loop answers requests while the plan runs:
    after each step the binder's thread waits for the loop to serve one, so a loop blocked by the
    binder would fail this test instead of passing it by luck of timing."""
    sysfs, procs = adapters(sim)
    simkernel.hang(sim.host_dir, H200)
    plan = plan_binding(gpu(sysfs, H200), "vm-passthrough")
    loop = asyncio.get_running_loop()
    served: list[str] = []

    async def request(step):  # what the API server does meanwhile: small bits of loop work
        await asyncio.sleep(0)
        served.append(str(step))
        return "pong"

    def on_step(step, result):  # the binder's worker thread, mid-plan
        assert asyncio.run_coroutine_threadsafe(request(step), loop).result(timeout=30) == "pong"

    # on a worker thread, as the reconciler runs it (asyncio.to_thread)
    out = await asyncio.to_thread(binder.execute, sysfs, procs, plan, timeout=1.0, on_step=on_step)
    assert out.state == "stuck", out
    assert served == list(out.done) and served  # the loop answered while the plan was running
    assert "wchan" in out.message or "state" in out.message
    pid = out.stuck_pid
    assert os.path.exists(f"/proc/{pid}")  # abandoned, not killed, not waited on
    simkernel.unhang(sim.host_dir, H200)
    _wait_for(lambda: not stuck_writes(), what="the hung writer to resume")


def test_stuck_writer_from_a_thread_does_not_block_other_threads(sim):
    sysfs, procs = adapters(sim)
    simkernel.hang(sim.host_dir, H200)
    result: dict[str, binder.BindOutcome] = {}
    t = threading.Thread(target=lambda: result.update(
        out=binder.execute(sysfs, procs, plan_binding(gpu(sysfs, H200), "vm-passthrough"), timeout=0.5)))
    t.start()
    # meanwhile another GPU's plan runs to the end on this thread
    other = binder.execute(sysfs, procs, plan_binding(gpu(sysfs, ADA), "vm-passthrough"), timeout=10)
    assert other.state == "converged", other
    t.join(30)
    assert not t.is_alive() and result["out"].state == "stuck"


def test_vfio_holder_blocks_return_to_container(sim):
    sysfs, procs = adapters(sim)
    assert binder.execute(sysfs, procs, plan_binding(gpu(sysfs, ADA), "vm-passthrough"), timeout=10).state == "converged"
    hold(sim, 5151, "qemu-system-x86", ADA)  # a VM has the group
    out = binder.execute(sysfs, procs, plan_binding(gpu(sysfs, ADA), "container"), timeout=5)
    group = group_of(sysfs, ADA)
    assert out.state == "waiting" and f"/dev/vfio/{group}" in out.message and "qemu-system-x86" in out.message
    assert driver(sysfs, ADA) == "vfio-pci"
    assert sysfs.function(ADA).driver_override == "vfio-pci"  # nothing written before the check


def test_device_gone_reports_errno_and_meaning(sim):
    sysfs, procs = adapters(sim)
    plan = plan_binding(gpu(sysfs, H200), "vm-passthrough")
    simkernel.unplug(sim.host_dir, H200)
    out = binder.execute(sysfs, procs, plan, timeout=5)
    assert out.state == "failed"
    assert out.errno is not None and ("gone" in out.message or "ENOENT" in out.message)


def test_probe_that_binds_nothing_is_caught_by_verification(sim):
    """drivers_probe succeeds even when nothing binds: only the verify step notices."""
    sysfs, procs = adapters(sim)
    with simstate.locked(sim.host_dir) as st:  # the GPU's native driver is not loaded
        st.gpus.pop(H200)  # nvidia probe then fails (EPERM inside probe: device stays unbound)
        render(sim.host_dir, st)
    sysfs.write("bus/pci/drivers/nvidia/unbind", H200)
    out = binder.execute(sysfs, procs, plan_binding(gpu(sysfs, H200), "container"), timeout=5,
                         verify_timeout=0.2)
    assert out.state == "failed" and "expected nvidia" in out.message and present(out.step).startswith("verify-driver")


def test_read_only_refuses_before_any_write(sim):
    sysfs, procs = adapters(sim, read_only=True)
    out = binder.execute(sysfs, procs, plan_binding(gpu(sysfs, H200), "vm-passthrough"), timeout=5)
    assert out.state == "failed" and "read-only" in out.message
    assert present(Sysfs(str(sim.sys_root)).function(H200)).driver_override is None


def test_infeasible_plan_fails_without_touching(sim):
    sysfs, procs = adapters(sim)
    g = gpu(sysfs, H200)
    import msgspec

    g = msgspec.structs.replace(g, function=msgspec.structs.replace(g.function, iommu_group=None))
    out = binder.execute(sysfs, procs, plan_binding(g, "vm-passthrough"))
    assert out.state == "failed" and "IOMMU" in out.message


def test_mig_cap_holder_found_from_mig_minors(sim):
    """A process holding only a MIG device's capability node keeps the GPU busy too."""
    sysfs, procs = adapters(sim)
    minors = (sim.proc_root / "driver" / "nvidia-caps" / "mig-minors").read_text().splitlines()
    cap = next(line.split()[1] for line in minors if line.startswith("gpu1/gi3/access"))
    me = sim.proc_root / "9898"
    (me / "fd").mkdir(parents=True)
    (me / "comm").write_text("mig-user\n")
    os.symlink(sim.dev_root / "nvidia-caps" / f"nvidia-cap{cap}", me / "fd" / "7")
    out = binder.execute(sysfs, procs, plan_binding(gpu(sysfs, H200), "vm-passthrough"), timeout=5)
    assert out.state == "waiting" and out.holders[0].device == f"/dev/nvidia-caps/nvidia-cap{cap}"


def test_kernel_reason_reads_state_and_wchan_of_a_sleeping_child():
    pid = os.fork()
    if pid == 0:
        try:
            signal.pause()
        finally:
            os._exit(0)
    try:
        def asleep():
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "S"

        _wait_for(asleep, what="child asleep")
        reason = kernel_reason(pid, ["nothing-matches-this"], kmsg="/nonexistent")
        assert reason.startswith("state S")
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_abandoned_writer_keeps_none_of_the_callers_locks(sim, tmp_path):
    """A stuck child must not inherit the daemon's fds: an inherited flock'd fd would keep e.g.
    the apply lock held for as long as the kernel keeps the child blocked (found the hard way:
    the simulator's own state lock deadlocked against it)."""
    import fcntl

    sysfs, procs = adapters(sim)
    lock = tmp_path / "apply.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    simkernel.hang(sim.host_dir, H200)
    out = binder.execute(sysfs, procs, plan_binding(gpu(sysfs, H200), "vm-passthrough"), timeout=0.5)
    assert out.state == "stuck"
    os.close(fd)  # the caller lets go; nobody else may still hold it
    fd2 = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd2, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError if the child kept it
    finally:
        os.close(fd2)


@pytest.mark.parametrize("bad", [binding.BindStep(binding.SET_OVERRIDE, pci=ADA),  # no driver
                                 binding.BindStep(binding.UNBIND),  # no device
                                 binding.BindStep(binding.VERIFY_VFIO_NODE, pci=ADA)])  # no group
def test_a_step_without_the_field_its_action_needs_fails_before_any_write(sim, bad):
    sysfs, procs = adapters(sim)
    before = simstate.load(sim.host_dir).functions
    plan = plan_binding(gpu(sysfs, ADA), "vm-passthrough", drivers=set(sysfs.drivers()))
    out = binder.execute(sysfs, procs, msgspec.structs.replace(plan, steps=(bad, *plan.steps)), timeout=10)
    assert out.state == "failed" and f"step {bad} has no" in out.message, out
    assert simstate.load(sim.host_dir).functions == before
