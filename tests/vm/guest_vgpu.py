"""Runs INSIDE the virtme-ng guest, as one phase of tests/vm/guest_binding.py's single boot: gpud's
vGPU adapter, planner and executor against the kernel's own mdev core and SR-IOV code.

- mdev: the kernel's sample parent driver mtty (built on the host by scripts/build-mtty against
  the guest kernel's headers, staged into the results directory) registers a parent
  `mtty` with two types. gpud lists them, plans and creates two mdevs with UUIDs of its choosing,
  hears EEXIST/EINVAL from the kernel, sees a VM-like holder (a process with the mdev's VFIO device
  fd open) and refuses to remove that mdev, while a raw `echo 1 > remove` blocks in the kernel until
  the holder lets go; after all are removed, the same plan with the recorded identities recreates
  the same UUIDs.
- SR-IOV: QEMU 7.2's nvme device with `sriov_max_vfs=2`: `sriov_numvfs` through gpud's adapter
  (ERANGE above the total, EBUSY to change a non-zero count, VFs with physfn/virtfn links, left out
  of gpud's GPU scan, and disabled again).
Every check is recorded; the host (tests/vm/test_vm_vgpu.py) judges.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time

from gpud.engine.vgpu.executor import execute
from gpud.host.kernel.procs import Procs
from gpud.host.kernel.sysfs import Sysfs, SysfsError
from gpud.host.nvidia.vgpu_sysfs import VgpuSysfs
from gpud.layout.desired import DesiredGpu
from gpud.plan.vgpu import VgpuRecord, plan_vgpu
from tests.support.present import present

PARENT = "mtty"
TYPE = "Dual port serial"
NVME_PF = "0000:00:12.0"


def _errno(fn) -> str:
    try:
        fn()
    except SysfsError as e:
        return errno.errorcode.get(e.errno or 0, str(e.errno))
    return "ok"


def _plan(v: VgpuSysfs, count: int, record: VgpuRecord):
    desired = DesiredGpu(pci=PARENT, index=0, entry="layouts.vm[0]", workload="vm-vgpu",
                         vgpu_devices={TYPE: count} if count else {})
    return plan_vgpu(pci=PARENT, index=0, gpu_key="mtty-test-gpu", where="mtty", state=v.read(PARENT),
                     desired=desired, model=None, record=record)


def run_mdev(record, holder_src: str, out_dir: str) -> None:
    module = os.path.join(out_dir, "mtty.ko")  # staged there by tests/vm/vm.py:stage_mtty
    deps = subprocess.run(["modprobe", "-a", "vfio", "vfio_iommu_type1", "mdev"], capture_output=True, text=True)
    ins = subprocess.run(["insmod", module], capture_output=True, text=True)
    record("mdev", module=module, module_exists=os.path.exists(module), modprobe_rc=deps.returncode,
           insmod_rc=ins.returncode, insmod_out=(ins.stdout + ins.stderr)[-500:])
    if ins.returncode != 0:
        return
    v = VgpuSysfs(Sysfs("/sys"), Procs("/proc", "/dev"))
    record("mdev", interface=v.interface(PARENT), types=v.mdev_types(PARENT))
    rec = VgpuRecord()
    plan = _plan(v, 2, rec)
    out = execute(v, plan, rec)
    created = [s.uuid for s in plan.creations]
    state = v.read(PARENT)
    record("mdev", plan_creations=[[s.action, s.type, s.uuid, s.parent] for s in plan.creations], create_state=out.state,
           create_message=out.message, bus_devices=sorted(os.listdir("/sys/bus/mdev/devices")),
           read_devices=[[d.type, d.uuid, d.vfio_group] for d in state.devices],
           types_after=v.mdev_types(PARENT), record_uuids=rec.uuids)
    again = _plan(v, 2, rec)
    record("mdev", replan_steps=len(again.steps), kept=[d.uuid for d in again.kept])
    tdir = v.mdev_types(PARENT)[TYPE][0]
    record("mdev", duplicate=_errno(lambda: v.create_mdev(PARENT, tdir, created[0])),
           bad_uuid=_errno(lambda: v.create_mdev(PARENT, tdir, "not-a-uuid-at-all-but-36-chars-long!")))

    # A VM-like holder: the mdev's VFIO device fd open (what QEMU holds while the guest runs).
    group = next(d.vfio_group for d in state.devices if d.uuid == created[0])
    holder = subprocess.Popen([sys.executable, "-c", holder_src, str(group), created[0]], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready = present(holder.stdout).readline().strip()
    held = v.read(PARENT)
    shrink = _plan(v, 1, rec)
    record("mdev", holder_ready=ready, holder_pid=holder.pid,
           holders=[[d.uuid, [h.pid for h in d.holders]] for d in held.devices],
           shrink_kept=[d.uuid for d in shrink.kept], shrink_removals=[s.uuid for s in shrink.removals])
    to_zero = _plan(v, 0, rec)
    gone = execute(v, to_zero, rec)
    record("mdev", remove_all_state=gone.state, remove_all_holders=[h.pid for h in gone.holders],
           still_there=sorted(os.listdir("/sys/bus/mdev/devices")))
    # The kernel's own behaviour on a held mdev: the remove write does not fail, it waits.
    raw = subprocess.Popen(["sh", "-c", f"echo 1 > /sys/bus/mdev/devices/{created[0]}/remove; echo rc=$?"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        raw_out = raw.communicate(timeout=5)[0]
        raw_blocked = False
    except subprocess.TimeoutExpired:
        raw_blocked, raw_out = True, ""
    present(holder.stdin).close()
    holder.wait(30)
    if raw_blocked:
        raw_out = raw.communicate(timeout=60)[0]
    record("mdev", raw_remove_blocked_while_held=raw_blocked, raw_remove_after_release=raw_out.strip(),
           after_release=sorted(os.listdir("/sys/bus/mdev/devices")))
    # Everything gone (as after a reboot); the recorded identities bring the same UUIDs back.
    rest = execute(v, _plan(v, 0, rec), rec)
    empty = sorted(os.listdir("/sys/bus/mdev/devices"))
    rebuilt = execute(v, _plan(v, 2, rec), rec)
    record("mdev", cleared=rest.state, empty=empty, rebuild_state=rebuilt.state,
           rebuilt=sorted(os.listdir("/sys/bus/mdev/devices")), first=sorted(created))
    execute(v, _plan(v, 0, rec), rec)
    subprocess.run(["rmmod", "mtty"], capture_output=True)


def run_sriov(record) -> None:
    sysfs = Sysfs("/sys")
    v = VgpuSysfs(sysfs, Procs("/proc", "/dev"))
    base = f"/sys/bus/pci/devices/{NVME_PF}"
    if not os.path.exists(f"{base}/sriov_totalvfs"):
        record("sriov", present=False, devices=sorted(os.listdir("/sys/bus/pci/devices")))
        return
    # keep the nvme driver off the VFs: QEMU's secondary controllers are offline until assigned
    try:
        with open(f"{base}/sriov_drivers_autoprobe", "w") as f:
            f.write("0")
    except OSError as e:
        record("sriov", autoprobe_error=str(e))
    total = int(open(f"{base}/sriov_totalvfs").read())
    driver = os.path.basename(os.readlink(f"{base}/driver")) if os.path.exists(f"{base}/driver") else None
    too_many = _errno(lambda: v.set_num_vfs(NVME_PF, total + 1))
    enabled = _errno(lambda: v.set_num_vfs(NVME_PF, total))
    deadline = time.monotonic() + 10
    while not v.vfs(NVME_PF) and time.monotonic() < deadline:
        time.sleep(0.1)
    vfs = v.vfs(NVME_PF)
    physfn = {vf: os.path.basename(os.readlink(f"/sys/bus/pci/devices/{vf}/physfn")) for vf in vfs}
    change = _errno(lambda: v.set_num_vfs(NVME_PF, 1))
    scanned = [f.address for f in sysfs.functions()]
    disabled = _errno(lambda: v.set_num_vfs(NVME_PF, 0))
    record("sriov", present=True, driver=driver, total=total, too_many=too_many, enable=enabled, vfs=vfs,
           physfn=physfn, numvfs_after_enable=len(vfs), change_nonzero=change, vfs_in_gpu_scan=[a for a in vfs if a in scanned],
           disable=disabled, vfs_after_disable=v.vfs(NVME_PF),
           offset=open(f"{base}/sriov_offset").read().strip(), stride=open(f"{base}/sriov_stride").read().strip())


def run(record, holder_src: str, out_dir: str) -> None:
    for name, fn in (("mdev", lambda: run_mdev(record, holder_src, out_dir)), ("sriov", lambda: run_sriov(record))):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - recorded for the host to judge
            import traceback

            record(name, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])


if __name__ == "__main__":  # a boot of its own, for working on this phase alone: python -m tests.vm.vm --vgpu-only
    import json
    import traceback

    from tests.vm.guest_binding import HOLDER

    out_dir = sys.argv[1]
    results: dict = {"phases": {}}

    def record_alone(name: str, **data) -> None:
        results["phases"].setdefault(name, {}).update(data)

    try:
        run(record_alone, HOLDER, out_dir)
    except BaseException:  # noqa: BLE001
        results["fatal"] = traceback.format_exc()[-4000:]
    with open(os.path.join(out_dir, "results.json"), "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    print("GUEST-DONE", flush=True)
