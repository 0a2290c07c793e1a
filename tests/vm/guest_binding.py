"""Runs INSIDE the virtme-ng guest (real Debian kernel, QEMU q35 + intel-iommu): gpud's binder on
real sysfs. Not a pytest module: the host test (test_vm_binding.py) boots the guest once, this
script records every check into RESULTS_DIR/results.json, and the host asserts on it.

Guest devices: 0000:00:10.0 e1000 + 0000:00:10.1 snd_hda_intel (one IOMMU group: a GPU and its
audio function), 0000:00:11.0 e1000 (alone). The layout's `match:` makes gpud manage the e1000s.
Each phase is independent (one failing does not hide the others) and bounded in time.
"""


from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
import traceback

from gpud.engine.binding import binder, passthrough, udev_rules
from gpud.engine.observe.discovery import observe
from gpud.host.kernel.deadline_write import stuck_writes
from gpud.host.kernel.kmsg import last_kmsg_line
from gpud.host.kernel.procs import Procs
from gpud.host.kernel.sysfs import Sysfs
from gpud.host.kernel.udev import UdevEvents
from gpud.layout.parse import parse_layout
from gpud.layout.resolve import resolve
from gpud.plan.binding import plan_binding
from tests.support.present import present
from tests.vm import guest_vgpu

NIC0, AUDIO, NIC1 = "0000:00:10.0", "0000:00:10.1", "0000:00:11.0"
LAYOUT = textwrap.dedent("""\
    version: v1
    selected: passthrough
    match:
      - {vendor: 0x8086, class: 0x0200}
    layouts:
      passthrough:
        - devices: all
          workload: vm-passthrough
      container:
        - devices: all
          workload: container
""")
RULES = "/etc/udev/rules.d/70-gpud-vfio.rules"
# A process holding a VFIO *device* (not just the group): what QEMU does. With only the group fd
# open vfio-pci's remove() does not wait; with the device fd it blocks until released.
HOLDER = textwrap.dedent("""\
    import fcntl, os, struct, sys
    group = sys.argv[1]; bdf = sys.argv[2]
    VFIO_SET_IOMMU, VFIO_GROUP_SET_CONTAINER, VFIO_GROUP_GET_DEVICE_FD = 0x3B66, 0x3B68, 0x3B6A
    cont = os.open("/dev/vfio/vfio", os.O_RDWR)
    grp = os.open("/dev/vfio/" + group, os.O_RDWR)
    what = "group"
    try:
        fcntl.ioctl(grp, VFIO_GROUP_SET_CONTAINER, struct.pack("i", cont))
        try:
            fcntl.ioctl(cont, VFIO_SET_IOMMU, 3)   # VFIO_TYPE1v2_IOMMU
        except OSError:
            fcntl.ioctl(cont, VFIO_SET_IOMMU, 1)   # VFIO_TYPE1_IOMMU
        dev = fcntl.ioctl(grp, VFIO_GROUP_GET_DEVICE_FD, bytearray(bdf.encode() + b"\\0"), True)
        what = "device fd %d" % dev
    except OSError as e:
        what = "group only (%s)" % e
    print("ready " + what, flush=True)
    sys.stdin.read()   # hold until the parent closes our stdin (or kills us)
""")

results: dict = {"phases": {}, "events": [], "kernel_events": []}
T0 = time.monotonic()


def record(name: str, **data) -> None:
    data["t"] = round(time.monotonic() - T0, 2)
    results["phases"].setdefault(name, {}).update(data)


def sh(cmd: str) -> str:
    r = subprocess.run(["sh", "-c", cmd], check=False, capture_output=True, text=True, timeout=60)
    return (r.stdout + r.stderr).strip()


class Guest:
    def __init__(self) -> None:
        self.sysfs = Sysfs("/sys")
        self.procs = Procs("/proc", "/dev")
        self.events: list = []
        self.kernel_events: list = []
        self.changed = asyncio.Event()
        self.ticks = 0

    def drv(self, pci):
        f = self.sysfs.function(pci)
        return f.driver if f else "ABSENT"

    def snapshot(self):
        return {p: {"driver": self.drv(p), "override": (self.sysfs.function(p) or None) and present(self.sysfs.function(p)).driver_override}
                for p in (NIC0, AUDIO, NIC1)}

    def on_event(self, ev) -> None:
        self.events.append([ev.action, ev.subsystem, ev.address, ev.driver, round(time.monotonic() - T0, 2)])
        self.changed.set()

    async def wait_event(self, pred, timeout=30.0, since=0):
        """Bounded wait for a matching event from the udev monitor (events[since:] only)."""
        deadline = time.monotonic() + timeout
        while True:
            for ev in self.events[since:]:
                if pred(ev):
                    return ev
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except TimeoutError:
                return None

    async def ticker(self):
        while True:
            self.ticks += 1
            await asyncio.sleep(0.02)

    async def converge(self, layout_name: str, only: str | None = None, **kw) -> dict:
        """One gpud pass: observe -> resolve the layout -> plan -> execute, per managed device."""
        parsed = parse_layout(LAYOUT, select=layout_name)
        assert parsed.ok, parsed.errors
        obs = observe(self.sysfs, None, present(parsed.layout).match)
        res = resolve(parsed, obs.gpus)
        out = {}
        for gpu in obs.gpus:
            if only is not None and gpu.pci != only:
                continue
            want = res.desired[gpu.pci].workload
            plan = plan_binding(gpu, want, drivers=set(self.sysfs.drivers()))
            o = await asyncio.to_thread(binder.execute, self.sysfs, self.procs, plan, **kw)
            out[gpu.pci] = {"state": o.state, "message": o.message, "steps": [str(s) for s in plan.steps],
                            "companions": [c.address for c in gpu.companions], "index": gpu.index,
                            "holders": [[h.pid, h.name, h.device] for h in o.holders], "stuck_pid": o.stuck_pid,
                            "disruption": plan.disruption.summary}
        return out


async def main(out_dir: str) -> None:
    g = Guest()
    loop = asyncio.get_running_loop()
    ticker = asyncio.create_task(g.ticker())
    record("env", kernel=os.uname().release,
           groups={p: (present(g.sysfs.function(p)).iommu_group if g.sysfs.function(p) else None) for p in (NIC0, AUDIO, NIC1)},
           udevd=bool(sh("pidof systemd-udevd || pgrep -f systemd-udevd")),
           vfio_loaded=os.path.isdir("/sys/bus/pci/drivers/vfio-pci"), before=g.snapshot())

    events_udev = UdevEvents(g.on_event, source="udev")
    events_kernel = UdevEvents(lambda ev: g.kernel_events.append([ev.action, ev.subsystem, ev.address, ev.driver]),
                                 source="kernel")
    for name, src in (("udev", events_udev), ("kernel", events_kernel)):
        try:
            src.start(loop)
            record("monitors", **{name: "started"})
        except Exception as err:  # noqa: BLE001 - recorded for the host to judge
            record("monitors", **{name: f"failed: {err}"})

    group_a = present(g.sysfs.function(NIC0)).iommu_group
    group_b = present(g.sysfs.function(NIC1)).iommu_group

    async def phase(name, coro):
        try:
            await asyncio.wait_for(coro, 240)
        except BaseException as e:  # noqa: BLE001
            record(name, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])

    # A: native -> vfio-pci for both groups; the audio companion follows its group.
    async def a():
        n = len(g.events)
        outcomes = await g.converge("passthrough")
        ev = await g.wait_event(lambda e: e[0] == "add" and e[1] == "vfio" and e[2] == str(group_a), 20, n)
        again = await g.converge("passthrough")
        record("to_vfio", outcomes=outcomes, after=g.snapshot(),
               vfio_nodes={str(group_a): os.path.exists(f"/dev/vfio/{group_a}"),
                           str(group_b): os.path.exists(f"/dev/vfio/{group_b}")},
               vfio_add_event=ev, second_pass=again)

    # B: the inventory a VM manager reads.
    async def b():
        obs = observe(g.sysfs, None, present(parse_layout(LAYOUT).layout).match)
        items = passthrough.entries(obs.gpus)
        record("inventory", entries=[{"pci": e.pci, "vendor_device": e.vendor_device, "resource_name": e.resource_name,
                                      "vfio_device": e.vfio_device, "companions": list(e.companions),
                                      "name_source": e.name_source, "libvirt": e.libvirt_hostdev} for e in items],
               kubevirt=[passthrough.kubevirt_entry(e) for e in items])

    # C: boot persistence with the real udevd, then remove + rescan handled.
    async def c():
        parsed = parse_layout(LAYOUT, select="passthrough")
        obs = observe(g.sysfs, None, present(parsed.layout).match)
        desired = resolve(parsed, obs.gpus).desired
        changed = udev_rules.UdevRules(RULES).sync(obs.gpus, desired)
        unchanged = not udev_rules.UdevRules(RULES).sync(obs.gpus, desired)
        reload = sh("udevadm control --reload; echo rc=$?")
        n = len(g.events)
        sh(f"echo 1 > /sys/bus/pci/devices/{NIC1}/remove")
        removed = await g.wait_event(lambda e: e[0] == "remove" and e[1] == "pci" and e[2] == NIC1, 30, n)
        gone = g.sysfs.function(NIC1) is None
        sh("echo 1 > /sys/bus/pci/rescan")
        added = await g.wait_event(lambda e: e[0] == "add" and e[1] == "pci" and e[2] == NIC1, 30, n)
        bound = await g.wait_event(lambda e: e[0] == "bind" and e[2] == NIC1, 30, n)
        settle = sh("udevadm settle -t 30; echo rc=$?")
        after_rescan = g.snapshot()[NIC1]
        outcomes = await g.converge("passthrough")
        record("remove_rescan", rules_written=changed, rules_unchanged_second_time=unchanged,
               rules=open(RULES).read(), reload=reload, removed_event=removed, gone=gone, add_event=added,
               bind_event=bound, settle=settle, after_rescan=after_rescan, reconcile=outcomes,
               after=g.snapshot(), events=g.events[n:])

    # D: a process holding the VFIO device: waiting (holders named), then, with the check off,
    # the kernel blocks the unbind: stuck with the kernel's reason, and the loop keeps ticking.
    async def d():
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(group_b), NIC1], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        ready = await loop.run_in_executor(None, present(holder.stdout).readline)
        waiting = await g.converge("container", only=NIC1)
        ticks0 = g.ticks
        stuck = await g.converge("container", only=NIC1, check_holders=False, timeout=8.0)
        ticks_during = g.ticks - ticks0
        stuck_pid = stuck.get(NIC1, {}).get("stuck_pid")
        again = await g.converge("container", only=NIC1, timeout=8.0)
        wchan = open(f"/proc/{stuck_pid}/wchan").read() if stuck_pid and os.path.exists(f"/proc/{stuck_pid}") else None
        present(holder.stdin).close()  # release the device: the abandoned unbind can finish
        await loop.run_in_executor(None, holder.wait)
        deadline = time.monotonic() + 60
        while stuck_writes() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        released = not stuck_writes()
        final = await g.converge("container", only=NIC1)
        record("holder", ready=ready.strip(), holder_pid=holder.pid, waiting=waiting, stuck=stuck,
               ticks_during_stuck=ticks_during, while_stuck=again, wchan_while_stuck=wchan,
               abandoned_write_finished=released, final=final, after=g.snapshot(),
               kmsg=last_kmsg_line([NIC1]))

    # E: everything back to native drivers; /dev/vfio/N goes away.
    async def e():
        n = len(g.events)
        outcomes = await g.converge("container")
        ev = await g.wait_event(lambda e: e[0] == "remove" and e[1] == "vfio" and e[2] == str(group_a), 20, n)
        obs = observe(g.sysfs, None, present(parse_layout(LAYOUT).layout).match)
        parsed = parse_layout(LAYOUT, select="container")
        rules_changed = udev_rules.UdevRules(RULES).sync(
            obs.gpus, resolve(parsed, obs.gpus).desired)
        record("to_native", outcomes=outcomes, after=g.snapshot(), vfio_remove_event=ev,
               vfio_nodes={str(group_a): os.path.exists(f"/dev/vfio/{group_a}"),
                           str(group_b): os.path.exists(f"/dev/vfio/{group_b}")},
               rules_removed=rules_changed and not os.path.exists(RULES))

    # F: someone unbinds a device by hand; gpud notices the udev event and puts it back.
    async def f():
        n = len(g.events)
        sh(f"echo {NIC1} > /sys/bus/pci/drivers/e1000/unbind")
        ev = await g.wait_event(lambda e: e[0] == "unbind" and e[2] == NIC1, 30, n)
        seen = g.snapshot()[NIC1]
        outcomes = await g.converge("container")
        record("hand_unbind", event=ev, seen_after_event=seen, reconcile=outcomes, after=g.snapshot(),
               events=g.events[n:])

    for name, fn in (("to_vfio", a), ("inventory", b), ("remove_rescan", c), ("holder", d), ("to_native", e),
                     ("hand_unbind", f)):
        await phase(name, fn())
    events_udev.stop()  # the daemon below has its own monitor
    await phase("daemon", run_daemon(out_dir))
    await phase("vgpu", asyncio.to_thread(guest_vgpu.run, record, HOLDER, out_dir))  # mdev core + SR-IOV
    await asyncio.sleep(0.5)  # let late kernel-source events in before reporting
    ticker.cancel()
    events_kernel.stop()
    results["events"] = g.events
    results["kernel_events"] = g.kernel_events
    results["elapsed"] = round(time.monotonic() - T0, 2)


async def run_daemon(out_dir: str) -> None:
    """G: the gpud daemon itself, as systemd would run it (minus systemd): the file selects
    passthrough, then an outside unbind, then an edit of the file back to container."""
    work = os.path.join(out_dir, "daemon")
    os.makedirs(work, exist_ok=True)
    # the results directory is a 9p share, where no unix socket can be bound (ENXIO): /run is tmpfs
    cfg, sock = os.path.join(work, "layout.yaml"), "/run/gpud-vm-test.sock"
    with open(cfg, "w") as fh:
        fh.write(LAYOUT)
    log = open(os.path.join(work, "gpud.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "gpud.daemon", "--config", cfg, "--socket", sock,
                             "--state-dir", os.path.join(work, "state"), "--lock", os.path.join(work, "apply.lock"),
                             "--udev-rules", os.path.join(work, "70-gpud-vfio.rules"), "--unbind-timeout", "8"],
                            stdout=log, stderr=subprocess.STDOUT)

    def ctl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gpud.cli.gpudctl", "--socket", sock, *args],
                              capture_output=True, text=True, timeout=120, check=False)

    async def until(cond, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = cond()
            if value:
                return value
            await asyncio.sleep(0.2)
        return None

    def drivers() -> dict:
        st = json.loads(ctl("status", "--json").stdout or "{}")
        out = {}
        for g in st.get("gpus", []):
            out[g["pci"]] = g["driver"]
            out.update({m["pci"]: m["driver"] for m in g["group"]})
        return out

    try:
        # Up once its socket answers; a daemon that died fails at once. The socket's existence is
        # checked first so that the wait does not start a gpudctl interpreter every 0.2 s: under TCG
        # on a loaded host those starts took the guest's CPUs from the daemon's own start-up, which
        # then missed a 30 s bound (seen in a fresh Debian 12 root: the log stopped after the NVML line).
        up = await until(lambda: proc.poll() is not None or (os.path.exists(sock) and ctl("version").returncode == 0),
                         120)
        up = up and proc.poll() is None
        applied = ctl("apply", "--wait", "--timeout", "90")
        record("daemon", up=bool(up), apply_rc=applied.returncode, apply_out=applied.stdout + applied.stderr)
        st = ctl("status", "--json")
        record("daemon", status_out=st.stdout[-3000:] + st.stderr[-2000:])
        status1 = json.loads(st.stdout)
        rules = open(os.path.join(work, "70-gpud-vfio.rules")).read() if os.path.exists(
            os.path.join(work, "70-gpud-vfio.rules")) else ""
        sh(f"echo {NIC1} > /sys/bus/pci/drivers/vfio-pci/unbind")
        rebound = await until(lambda: drivers().get(NIC1) == "vfio-pci" and sh(f"readlink /sys/bus/pci/devices/{NIC1}/driver").endswith("vfio-pci"), 60)
        with open(cfg, "w") as fh:  # an edit of the file: inotify, then a pass
            fh.write(LAYOUT.replace("selected: passthrough", "selected: container"))
        back = await until(lambda: (d := drivers()).get(NIC0) == "e1000" and d.get(AUDIO) == "snd_hda_intel"
                           and d.get(NIC1) == "e1000", 90)
        status2 = json.loads(ctl("status", "--json").stdout)
        events = ctl("events").stdout
    finally:
        proc.terminate()
        rc: int | str
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "killed"
        log.close()
        record("daemon", exit=rc, log=open(os.path.join(work, "gpud.log")).read()[-6000:])
    record("daemon", up=bool(up), apply_rc=applied.returncode, apply_out=applied.stdout[-2000:] + applied.stderr[-1000:],
           status_after_apply=status1, rules=rules, rebound_after_hand_unbind=bool(rebound),
           back_to_native_after_edit=bool(back), status_after_edit=status2, events=events[-4000:])


if __name__ == "__main__":
    out = sys.argv[1]
    try:
        asyncio.run(main(out))
    except BaseException:  # noqa: BLE001
        results["fatal"] = traceback.format_exc()[-4000:]
    with open(os.path.join(out, "results.json.tmp"), "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    os.replace(os.path.join(out, "results.json.tmp"), os.path.join(out, "results.json"))
    print("GUEST-DONE", results.get("elapsed"), flush=True)
