"""Render the simulated host's DIR/sys, DIR/dev and DIR/proc from its SimState.

The tree is what `gpud.host` reads on the simulator, so it mirrors the kernel's layout and the
attribute formats of a real H200 (tests/fixtures/h200; docs/hardware/driver-binding.md). It is derived state: `render` recomputes
the whole desired tree and changes only what differs, each file and link replaced atomically
(temp name + rename), so readers never see a half-written attribute. Call it with the host lock held
(`gpud.sim.state.locked`) so two renders never interleave.

This module also holds the small views of SimState that both the renderer and the kernel write
semantics (`gpud.sim.kernel`) need: loaded drivers, usable VFIO groups, who holds what.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import uuid
from pathlib import Path

import gpud.sim.dev_nodes as dev_nodes
import gpud.sim.pci_files as pci_files
import gpud.sim.vgpu as vgpu
from gpud import profiles
from gpud.sim.state import (
    AFTER_DEAD_DROPPED,
    FABRIC_MANAGER_PID,
    LOCK_FILE,
    PERSISTENCED_PID,
    SimFunction,
    SimProcess,
    SimState,
    locked,
    save,
)

PCI_ROOT = "devices/pci0000:00"
NVIDIA = "nvidia"
VFIO_PCI = "vfio-pci"
# Linux's VFIO variant driver for Grace GPUs (drivers/vfio/pci/nvgrace-gpu: module nvgrace-gpu-vfio-pci,
# pci_driver .name KBUILD_MODNAME) and the device ids of its table, each PCI_DRIVER_OVERRIDE_DEVICE_VFIO:
# bound only through driver_override, found by userspace in modules.alias (docs/hardware/grace.md)
NVGRACE = "nvgrace_gpu_vfio_pci"
NVGRACE_IDS = (0x2342, 0x2345, 0x2348)
VFIO_DRIVERS = frozenset({VFIO_PCI, NVGRACE})  # vfio-pci-core drivers: a group node, no auto-probe
# module name -> PCI driver name, where they differ (module names use "_", modprobe accepts both).
MODULE_DRIVERS = {"vfio_pci": VFIO_PCI, "xhci_pci": "xhci_hcd", "nvidia_nvswitch": "nvidia-nvswitch",
                  "pci_pf_stub": "pci-pf-stub"}
# nvidia-caps minors (/proc/driver/nvidia-caps/mig-minors): 1 config, 2 monitor, then per GPU minor
# 15 GIs x (GI access + 8 CI access).
CAPS_PER_GI = 9
GIS_PER_GPU = 15
CAPS_PER_GPU = CAPS_PER_GI * GIS_PER_GPU

# Entry kinds of the desired tree.
_DIR, _FILE, _LINK, _CHAR = "d", "f", "l", "c"


def module_name(name: str) -> str:
    return name.replace("-", "_")


def driver_of_module(module: str) -> str:
    module = module_name(module)
    return MODULE_DRIVERS.get(module, module)


def loaded_drivers(state: SimState) -> set[str]:
    """Driver names with a driver directory: modules loaded, plus any driver something is bound to
    (a bound driver is loaded by definition, whatever the catalog wrote in loaded_modules)."""
    out = {driver_of_module(m) for m in state.loaded_modules}
    out |= {f.driver for f in state.functions.values() if f.driver and f.present}
    return out


def present(state: SimState) -> dict[str, SimFunction]:
    return {a: f for a, f in state.functions.items() if f.present}


def group_members(state: SimState, group: int | None) -> list[SimFunction]:
    if group is None:
        return []
    return [f for f in present(state).values() if f.iommu_group == group]


def vfio_groups(state: SimState) -> set[int]:
    """Groups with a /dev/vfio/<N>: every endpoint on vfio-pci or driverless, at least one on vfio-pci."""
    groups: dict[int, list[SimFunction]] = {}
    for f in present(state).values():
        if f.iommu_group is not None:
            groups.setdefault(f.iommu_group, []).append(f)
    return {
        g for g, fs in groups.items()
        if all(f.driver is None or f.driver in VFIO_DRIVERS for f in fs) and any(f.driver in VFIO_DRIVERS for f in fs)
    }


def cap_minor(gpu_minor: int, gi: int, ci: int | None = None) -> int:
    """nvidia-caps minor of `gpu<m>/gi<g>/access` (ci None) or `gpu<m>/gi<g>/ci<c>/access`."""
    base = 3 + gpu_minor * CAPS_PER_GPU + gi * CAPS_PER_GI
    return base if ci is None else base + 1 + ci


def mig_owner(state: SimState, uuid: str) -> tuple[str, int, int] | None:
    """(GPU address, GI id, CI id) of a MIG device UUID."""
    for addr, gpu in state.gpus.items():
        for gi in gpu.gis:
            for ci in gi.cis:
                if ci.uuid == uuid:
                    return addr, gi.id, ci.id
    return None


def gpu_holders(state: SimState, address: str) -> list:
    """SimProcesses holding the GPU at `address` (whole GPU by UUID/PCI address, or any of its MIG
    devices): what keeps the nvidia driver's usage count above zero."""
    gpu = state.gpus.get(address)
    ids = {address}
    if gpu is not None:
        ids.add(gpu.uuid)
        ids |= {ci.uuid for gi in gpu.gis for ci in gi.cis}
    out = [p for p in state.processes if p.device in ids]
    return out + persistenced_holders(state, address)


def persistenced_holders(state: SimState, address: str) -> list:
    """nvidia-persistenced, in daemon mode, keeps the device node of each GPU it persists open."""
    if state.persistence != "daemon" or address not in state.persistent or not _nvidia_bound(state, address):
        return []
    return [SimProcess(pid=PERSISTENCED_PID, name="nvidia-persistenced", device=address)]


def fabric_manager_runs(state: SimState) -> bool:
    from gpud.sim.catalog import is_nvswitch

    return state.fabric_manager == "running" and any(f.present and is_nvswitch(f) for f in state.functions.values())


def session_holders(state: SimState, address: str) -> list:
    """Open NVML sessions holding the GPU at `address` (gpud's own included): an nvmlInit opens
    the device node of every GPU on nvidia at that moment (docs/hardware/gpu-reset.md)."""
    return [s for s in state.sessions if address in s.gpus]


def vfio_holders(state: SimState, group: int | None) -> list:
    """SimProcesses with /dev/vfio/<group> open: holders of a vfio-bound endpoint of the group."""
    if group is None:
        return []
    addrs = {f.address for f in group_members(state, group) if f.driver in VFIO_DRIVERS}
    return [p for p in state.processes if p.device in addrs]


VFIO_CDEV_MAJOR = 511  # dynamic; the number is not what a reader keys on


def vfio_cdevs(state: SimState) -> dict[str, tuple[str, int]]:
    """Kernels 6.8+ (CONFIG_VFIO_DEVICE_CDEV) give every vfio device a cdev besides its group:
    `<dev>/vfio-dev/vfioN` and `/dev/vfio/devices/vfioN`; an iommufd VMM opens only that. The vfio
    devices: PCI functions on vfio-pci, VFs carrying a vGPU type, mdevs. Device (PCI address or
    mdev UUID) -> (its sysfs directory under sys/, N), N in device order."""
    found: list[tuple[str, str]] = []
    here = present(state)
    for a, fn in sorted(here.items()):
        if fn.driver in VFIO_DRIVERS:
            found.append((a, f"{PCI_ROOT}/{a}"))
    for v in state.vgpu.values():  # a VF or mdev of a removed card went with it (no sysfs dir to hold a cdev)
        found += [(vf.address, f"{PCI_ROOT}/{vf.address}") for vf in v.vfs if vf.vgpu_type and vf.address in here]
        found += [(m.uuid, f"{PCI_ROOT}/{m.parent}/{m.uuid}") for m in v.mdevs if m.parent in here]
    return {dev: (sysdir, n) for n, (dev, sysdir) in enumerate(sorted(found))}


def process_devices(state: SimState, proc: SimProcess) -> list[str]:
    """Device paths (relative to DIR/dev) a SimProcess has open, as the kernel would show them: a
    VMM holding a vfio device through its cdev (`gpud-sim hold --cdev`) has only that open."""
    if proc.cdev:
        got = vfio_cdevs(state).get(proc.device)
        return [f"vfio/devices/vfio{got[1]}"] if got is not None else []
    held_vgpu = vgpu.process_devices(state, proc)
    if held_vgpu is not None:
        return held_vgpu
    fn = state.functions.get(proc.device)
    if fn is not None and fn.present and fn.driver in VFIO_DRIVERS:
        if fn.iommu_group in vfio_groups(state):
            return ["vfio/vfio", f"vfio/{fn.iommu_group}"]
        return []
    mig = mig_owner(state, proc.device)
    if mig is not None:
        addr, gi, ci = mig
        gpu = state.gpus[addr]
        if _nvidia_bound(state, addr):
            return ["nvidiactl", f"nvidia{gpu.minor}",
                    f"nvidia-caps/nvidia-cap{cap_minor(gpu.minor, gi)}",
                    f"nvidia-caps/nvidia-cap{cap_minor(gpu.minor, gi, ci)}"]
        return []
    for addr, gpu in state.gpus.items():
        if proc.device in (addr, gpu.uuid) and _nvidia_bound(state, addr):
            return ["nvidiactl", f"nvidia{gpu.minor}"]
    return []


def _nvidia_bound(state: SimState, address: str) -> bool:
    f = state.functions.get(address)
    return f is not None and f.present and f.driver == NVIDIA and address in state.gpus


def modalias(f: SimFunction) -> str:
    c = f.class_code
    return (f"pci:v{f.vendor:08X}d{f.device:08X}sv{f.subsystem_vendor:08X}sd{f.subsystem_device:08X}"
            f"bc{(c >> 16) & 0xFF:02X}sc{(c >> 8) & 0xFF:02X}i{c & 0xFF:02X}")


def uevent(f: SimFunction) -> str:
    lines = [f"DRIVER={f.driver}"] if f.driver else []
    lines += [
        f"PCI_CLASS={f.class_code:X}",
        f"PCI_ID={f.vendor:04X}:{f.device:04X}",
        f"PCI_SUBSYS_ID={f.subsystem_vendor:04X}:{f.subsystem_device:04X}",
        f"PCI_SLOT_NAME={f.address}",
        f"MODALIAS={modalias(f)}",
    ]
    return "\n".join(lines) + "\n"


def proc_modules(state: SimState) -> str:
    """/proc/modules: one line per loaded module, in the real H200 host's format (name, size, no
    use count or dependencies shown, Live, address, taint: tests/fixtures/h200/nvml-and-files.json)."""
    lines = []
    for i, mod in enumerate(dict.fromkeys(module_name(m) for m in state.loaded_modules)):
        size = 14299136 if mod == "nvidia" else 65536
        lines.append(f"{mod} {size} - - Live 0x{0xffffffffc0400000 + i * 0x1000000:x} (O)")
    return "".join(line + "\n" for line in lines)


def information(state: SimState, address: str) -> str:
    """/proc/driver/nvidia/gpus/<BDF>/information, in the driver's format (tabs included)."""
    gpu = state.gpus[address]
    model = profiles.MODELS.get(gpu.model)
    name = model.name if model else "NVIDIA Graphics Device"
    return (
        f"Model: \t\t {name}\n"
        f"IRQ:   \t\t {40 + gpu.minor + 1}\n"
        f"GPU UUID: \t {gpu.uuid}\n"
        "Video BIOS: \t 96.00.a5.00.1a\n"
        "Bus Type: \t PCIe\n"
        "DMA Size: \t 52 bits\n"
        "DMA Mask: \t 0xfffffffffffff\n"
        f"Bus Location: \t {address}\n"
        f"Device Minor: \t {gpu.minor}\n"
        f"GPU Firmware: \t {state.driver_version}\n"
        "GPU Excluded:\t No\n"
    )


@functools.lru_cache(maxsize=8)
def mig_minors(top: int) -> bytes:
    """/proc/driver/nvidia-caps/mig-minors for GPU minors 0..top (the same text for every host of
    that size: made once, not on every render)."""
    lines = ["config 1", "monitor 2"]
    for m in range(top + 1):
        for g in range(GIS_PER_GPU):
            lines.append(f"gpu{m}/gi{g}/access {cap_minor(m, g)}")
            lines += [f"gpu{m}/gi{g}/ci{c}/access {cap_minor(m, g, c)}" for c in range(8)]
    return ("\n".join(lines) + "\n").encode()


def desired_tree(host_dir: str | os.PathLike, state: SimState) -> dict[str, tuple]:
    """Relative path -> (kind, payload, mode). payload: bytes for files (None: keep existing content,
    create with b"0\\n"), link target for links, (major, minor) for character nodes."""
    root = os.path.abspath(host_dir)
    t: dict[str, tuple] = {}

    def d(p: str) -> None:
        t[p] = (_DIR, None, 0o755)

    def f(p: str, data: str | bytes | None, mode: int = 0o444) -> None:
        t[p] = (_FILE, data.encode() if isinstance(data, str) else data, mode)

    def ln(p: str, target: str) -> None:
        t[p] = (_LINK, target, 0)

    chosen: list[dict[str, int]] = []  # [the majors] once decided: [{}] where nodes cannot be made

    def node(p: str, driver: str, minor: int, mode: int) -> None:
        """A character node of the simulated nvidia driver (gpud.sim.dev_nodes: safe majors only),
        or a plain file where nodes cannot be made."""
        if not chosen:
            m = dev_nodes.majors() if os.geteuid() == 0 else {}
            chosen.append(m if m and all(dev_nodes.can_mknod(v) for v in m.values()) else {})
        if not chosen[0]:
            f(p, "", mode)
            return
        t[p] = (_CHAR, (chosen[0][driver], minor), mode)

    for p in ("sys", "sys/devices", f"sys/{PCI_ROOT}", "sys/bus", "sys/bus/pci", "sys/bus/pci/devices",
              "sys/bus/pci/drivers", "sys/kernel", "sys/kernel/iommu_groups", "sys/module", "dev", "proc"):
        d(p)
    for p in ("proc/sys", "proc/sys/kernel", "proc/sys/kernel/random"):
        d(p)
    f("proc/sys/kernel/random/boot_id", state.boot_id + "\n")
    f("proc/modules", proc_modules(state))
    f("sys/bus/pci/drivers_probe", "", 0o200)
    f("sys/bus/pci/rescan", "", 0o200)

    drivers = loaded_drivers(state)
    for drv in drivers:
        base = f"sys/bus/pci/drivers/{drv}"
        d(base)
        for attr in ("bind", "unbind", "new_id", "remove_id"):
            f(f"{base}/{attr}", "", 0o200)
    for mod in {module_name(m) for m in state.loaded_modules} | {module_name(x) for x in drivers}:
        d(f"sys/module/{mod}")
        f(f"sys/module/{mod}/initstate", "live\n")

    live = present(state)
    positions = {a: i for i, a in enumerate(sorted(state.functions))}
    for addr, fn in live.items():
        base = f"sys/{PCI_ROOT}/{addr}"
        d(base)
        is_gpu = addr in state.gpus
        f(f"{base}/resource", pci_files.resource(positions[addr], is_gpu))
        f(f"{base}/config", pci_files.config(fn, positions[addr], is_gpu), 0o644)
        f(f"{base}/vendor", f"0x{fn.vendor:04x}\n")
        f(f"{base}/device", f"0x{fn.device:04x}\n")
        f(f"{base}/subsystem_vendor", f"0x{fn.subsystem_vendor:04x}\n")
        f(f"{base}/subsystem_device", f"0x{fn.subsystem_device:04x}\n")
        f(f"{base}/class", f"0x{fn.class_code:06x}\n")
        f(f"{base}/revision", f"0x{fn.revision:02x}\n")
        f(f"{base}/driver_override", f"{fn.driver_override or '(null)'}\n", 0o644)
        f(f"{base}/numa_node", f"{fn.numa_node}\n")
        f(f"{base}/modalias", modalias(fn) + "\n")
        f(f"{base}/uevent", uevent(fn), 0o644)
        f(f"{base}/enable", "1\n", 0o644)
        f(f"{base}/d3cold_allowed", "1\n", 0o644)
        f(f"{base}/power_state", "D0\n")
        f(f"{base}/reset_method", "flr\n", 0o644)
        f(f"{base}/current_link_speed", "32.0 GT/s PCIe\n")
        f(f"{base}/current_link_width", "16\n")
        for attr in ("reset", "remove", "rescan"):
            f(f"{base}/{attr}", "", 0o200)
        ln(f"{base}/subsystem", "../../../bus/pci")
        if fn.driver:
            ln(f"{base}/driver", f"../../../bus/pci/drivers/{fn.driver}")
            ln(f"sys/bus/pci/drivers/{fn.driver}/{addr}", f"../../../../{PCI_ROOT}/{addr}")
        if fn.iommu_group is not None:
            g = fn.iommu_group
            ln(f"{base}/iommu_group", f"../../../kernel/iommu_groups/{g}")
            d(f"sys/kernel/iommu_groups/{g}")
            d(f"sys/kernel/iommu_groups/{g}/devices")
            ln(f"sys/kernel/iommu_groups/{g}/devices/{addr}", f"../../../../{PCI_ROOT}/{addr}")
        ln(f"sys/bus/pci/devices/{addr}", f"../../../{PCI_ROOT}/{addr}")
        if fn.physfn is not None:
            ln(f"{base}/physfn", f"../{fn.physfn}")

    vgpu.render(state, PCI_ROOT, d, f, ln)

    # the kernel log (a regular file here: readers follow it by its records' sequence numbers)
    f("dev/kmsg", "".join(r + "\n" for r in state.kmsg), 0o644)

    # nvidia: control node, caps, per-GPU node and /proc entries
    if NVIDIA in drivers:
        node("dev/nvidiactl", dev_nodes.NVIDIA, dev_nodes.NVIDIACTL_MINOR, 0o666)
        d("dev/nvidia-caps")
        node("dev/nvidia-caps/nvidia-cap1", dev_nodes.NVIDIA_CAPS, 1, 0o400)
        node("dev/nvidia-caps/nvidia-cap2", dev_nodes.NVIDIA_CAPS, 2, 0o444)
        for p in ("proc/driver", "proc/driver/nvidia", "proc/driver/nvidia/gpus", "proc/driver/nvidia-caps"):
            d(p)
        # only the parameter the simulator models (the real file lists every NVreg_ one)
        f("proc/driver/nvidia/params", f'CoherentGPUMemoryMode: "{state.coherent_memory_mode}"\n')
        f("proc/driver/nvidia/version",
          f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {state.driver_version}  Release Build\n")
        f("proc/driver/nvidia-caps/mig-minors", mig_minors(max((g.minor for g in state.gpus.values()), default=-1)))
        for addr, gpu in state.gpus.items():
            if not _nvidia_bound(state, addr):
                continue
            node(f"dev/nvidia{gpu.minor}", dev_nodes.NVIDIA, gpu.minor, 0o666)
            base = f"proc/driver/nvidia/gpus/{addr}"
            d(base)
            f(f"{base}/information", information(state, addr))
            f(f"{base}/unbindLock", None, 0o644)
            if gpu.mig_mode:
                for gi in gpu.gis:
                    minor = cap_minor(gpu.minor, gi.id)
                    node(f"dev/nvidia-caps/nvidia-cap{minor}", dev_nodes.NVIDIA_CAPS, minor, 0o444)
                    for ci in gi.cis:
                        minor = cap_minor(gpu.minor, gi.id, ci.id)
                        node(f"dev/nvidia-caps/nvidia-cap{minor}", dev_nodes.NVIDIA_CAPS, minor, 0o444)
        if chosen and chosen[0]:
            f("proc/devices", dev_nodes.proc_devices(chosen[0]))

    for sysdir, n in vfio_cdevs(state).values():  # iommufd: one cdev per vfio device
        d(f"sys/{sysdir}/vfio-dev")
        d(f"sys/{sysdir}/vfio-dev/vfio{n}")
        f(f"sys/{sysdir}/vfio-dev/vfio{n}/dev", f"{VFIO_CDEV_MAJOR}:{n}\n")
        d("dev/vfio")
        d("dev/vfio/devices")
        f(f"dev/vfio/devices/vfio{n}", "", 0o600)
    groups = vfio_groups(state)
    if drivers & VFIO_DRIVERS:
        d("dev/vfio")
        f("dev/vfio/vfio", "", 0o666)
    for g in groups:
        d("dev/vfio")
        f(f"dev/vfio/{g}", "", 0o600)

    opened: dict[int, tuple[str, list[str]]] = {}  # pid -> (comm, device nodes open)
    cmdlines: dict[int, str] = {}  # pid -> /proc/PID/cmdline, for a simulated VM (qemu -name guest=...)
    for proc in state.processes:
        opened.setdefault(proc.pid, (proc.name, []))[1].extend(process_devices(state, proc))
        if (line := vgpu.cmdline(proc)) is not None:
            cmdlines[proc.pid] = line
    if fabric_manager_runs(state):  # it opens the NVSwitches' nodes, no GPU's (not modelled here)
        opened.setdefault(FABRIC_MANAGER_PID, ("nv-fabricmanager", []))
    persisted = [a for a in state.persistent if persistenced_holders(state, a)]
    if state.persistence == "daemon":
        opened.setdefault(PERSISTENCED_PID, ("nvidia-persistenced", []))[1].extend(
            ["nvidiactl"] + [f"nvidia{state.gpus[a].minor}" for a in persisted])
    for session in state.sessions:  # an open NVML session holds nvidiactl and its GPUs' nodes
        nodes = ["nvidiactl"] + [f"nvidia{state.gpus[a].minor}" for a in session.gpus
                                 if a in state.gpus and _nvidia_bound(state, a)]
        opened.setdefault(session.pid, (session.name, []))[1].extend(nodes)
    for pid, (name, devs) in sorted(opened.items()):
        base = f"proc/{pid}"
        d(base)
        f(f"{base}/comm", name[:15] + "\n", 0o644)
        if pid in cmdlines:
            f(f"{base}/cmdline", cmdlines[pid])
        d(f"{base}/fd")
        for n, dev in enumerate(dict.fromkeys(devs), start=3):
            ln(f"{base}/fd/{n}", f"{root}/dev/{dev}")
    return t


def _scan(root: Path, rel: str, out: dict[str, str]) -> None:
    try:
        it = os.scandir(root / rel)
    except FileNotFoundError:
        return
    with it:
        for e in it:
            p = f"{rel}/{e.name}"
            if e.is_symlink():
                out[p] = _LINK
            elif e.is_dir(follow_symlinks=False):
                out[p] = _DIR
                _scan(root, p, out)
            elif stat.S_ISCHR(e.stat(follow_symlinks=False).st_mode):
                out[p] = _CHAR
            else:
                out[p] = _FILE


def _remove(path: Path, kind: str) -> None:
    try:
        if kind == _DIR:
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def lay_out(host_dir: str | os.PathLike, state: SimState) -> None:
    """A new simulated host in `host_dir`: its state file, its lock, and the trees rendered from it
    (gpud-sim create, and the replay of a capture)."""
    d = Path(host_dir)
    (d / "run").mkdir(parents=True, exist_ok=True)
    (d / LOCK_FILE).touch()
    save(d, state)
    with locked(d) as st:
        render(d, st)


# What this process rendered last, per host root: (pid, token, the desired tree written). The
# token is also in the host's RENDER_MARK file, which every render writes when it is not already its
# own: while the file still holds this process's token, no other process has rendered since, the
# tree on disk is exactly the cached one, and a render writes only the entries whose desired value
# changed. At 64 GPUs a full render (scan the tree, read back every file) costs about 37 ms, and a
# MIG change makes one per NVML call. Writers of the tree are renders only: the simulated kernel's
# stores (gpud.sim.kernel) change the state and render, like everything else here. Renders of one
# host are serialised by the host lock, so the cache needs no lock of its own.
_RENDERED: dict[str, tuple[int, str, dict[str, tuple]]] = {}
_RENDERED_KEPT = 8
RENDER_MARK = "run/tree-render"


def render(host_dir: str | os.PathLike, state: SimState) -> None:
    """(Re)write DIR/sys, DIR/dev, DIR/proc to match `state`, touching only what changed."""
    root = Path(os.path.abspath(host_dir))
    want = desired_tree(root, state)
    key, pid = str(root), os.getpid()
    mine = _RENDERED.pop(key, None)  # gone until this render completes: a failure forgets it
    mark = root / RENDER_MARK
    if mine is not None and mine[0] == pid and _read_mark(mark) == mine[1]:
        _render_changes(root, mine[2], want)
        token = mine[1]
    else:
        _render_all(root, want)
        token = f"{pid}-{uuid.uuid4().hex}"
        mark.parent.mkdir(parents=True, exist_ok=True)
        _put(mark, (_FILE, token.encode(), 0o644))
    _RENDERED[key] = (pid, token, want)
    while len(_RENDERED) > _RENDERED_KEPT:  # a test process renders many hosts: keep the latest few
        _RENDERED.pop(next(iter(_RENDERED)))


def _read_mark(mark: Path) -> str | None:
    try:
        return mark.read_text()
    except FileNotFoundError:
        return None


def _render_changes(root: Path, before: dict[str, tuple], want: dict[str, tuple]) -> None:
    """Bring the tree from `before` (known to be on disk) to `want`: only the entries that differ."""
    gone = [p for p, e in before.items() if (w := want.get(p)) is None or w[0] != e[0]]
    removed: set[str] = set()
    for p in sorted(gone, key=lambda s: s.count("/"), reverse=True):
        _remove(root / p, before[p][0])
        removed.add(p)
    if any(before[p][0] == _DIR for p in removed):  # a directory took what was under it along
        prefixes = tuple(p + "/" for p in removed if before[p][0] == _DIR)
        removed |= {p for p in before if p.startswith(prefixes)}
    changed = []
    for p, entry in want.items():
        old = None if p in removed else before.get(p)
        if old == entry or (old is not None and old[0] == _FILE == entry[0] and entry[1] is None):
            continue  # unchanged (a file whose content the kernel store owns is left alone)
        changed.append(p)
    for p in sorted(changed, key=lambda s: (s.count("/"), s)):
        _put(root / p, want[p])


def _render_all(root: Path, want: dict[str, tuple]) -> None:
    """Scan the tree and bring it to `want`, comparing every entry with what is on disk."""
    have: dict[str, str] = {}
    for top in ("sys", "dev", "proc"):
        if (root / top).is_dir():
            have[top] = _DIR
            _scan(root, top, have)
    # Remove what should not be there (deepest first), or has the wrong kind.
    for p in sorted(have, key=lambda s: s.count("/"), reverse=True):
        w = want.get(p)
        if w is None or w[0] != have[p]:
            _remove(root / p, have[p])
            have.pop(p)
    for p in sorted(want, key=lambda s: (s.count("/"), s)):
        kind, payload, mode = entry = want[p]
        path = root / p
        if p in have:
            if kind == _DIR:
                continue
            if kind == _LINK and os.readlink(path) == payload:
                continue
            if kind == _CHAR:
                st = path.stat()
                if st.st_mode & 0o7777 == mode and st.st_rdev == os.makedev(*payload):
                    continue
            if kind == _FILE:
                if payload is None:
                    continue  # content owned by the kernel store (unbindLock)
                st = path.stat()
                if st.st_mode & 0o7777 == mode and st.st_size == len(payload) and path.read_bytes() == payload:
                    continue
        _put(path, entry)


def _put(path: Path, entry: tuple) -> None:
    """Write one entry of the desired tree, replacing atomically what is there."""
    kind, payload, mode = entry
    if kind == _DIR:
        path.mkdir(exist_ok=True)
        return
    tmp = _tmp(path)
    _remove(tmp, _FILE)
    if kind == _LINK:
        os.symlink(payload, tmp)
    elif kind == _CHAR:
        major, minor = payload
        dev_nodes.check_safe({major})
        os.mknod(tmp, stat.S_IFCHR | mode, os.makedev(major, minor))
        os.chmod(tmp, mode)
    else:
        tmp.write_bytes(b"0\n" if payload is None else payload)
        os.chmod(tmp, mode)
    os.replace(tmp, path)


AFTER_DEAD_DROPPED.append(render)
