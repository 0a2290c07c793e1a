"""`gpud qualify`, read-only: what gpud needs from this host and what may stop it, one check each.

Reads through the adapters gpud itself uses (sysfs, NVML, /proc) plus two read-only ones
(host.host_services, host.nvidia.smi_query); the adapters are built read-only, so a mutation would be
refused before it reached the hardware. Every check ends in ok / warn / fail / unknown with what
was found and what gpud does about it. Hardware facts and their sources: docs/qualify.md.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence

from gpud import profiles as model_tables
from gpud.engine.observe.discovery import Observation, observe
from gpud.hardware import Hardware
from gpud.host.host_services import HostServices
from gpud.host.nvidia.nvml import NvmlError
from gpud.host.nvidia.smi_query import NvidiaSmi, NvidiaSmiError, SmiQuery
from gpud.host.nvidia.vgpu_sysfs import vfio_cdevs
from gpud.layout.schema import MatchRule
from gpud.model import Gpu, Holder, MigProfile
from gpud.pci import is_bridge, is_vfio
from gpud.plan.reset_scope import NO_FABRIC_DEPENDENCY
from gpud.qualify.report import Check

NVIDIA = 0x10DE
PCI_CLASS_BRIDGE_OTHER = 0x0680  # class/subclass NVSwitch functions carry on HGX boards (docs/qualify.md)
# Host services that hold GPUs open (hardware-truth: the usual "In use by another client")
HOLDING_SERVICES = {
    "nvidia-persistenced": "keeps the GPUs it persists open (/dev/nvidia*): an unbind waits for it; for a reset "
                           "gpud turns persistence off for that GPU (nvidia-smi -pm 0 -i) and on again",
    "nv-hostengine": "DCGM's host engine; it holds the GPUs it watches",
    "Xorg": "the X server holds the GPUs it drives (through nvidia_drm)",
}
FABRIC_MANAGER = "nv-fabricmanager"  # never drained: nvidia-smi(1) -r wants it running (docs/hardware/gpu-reset.md)


def _nvml_call(checks: list[Check], group: str, name: str, fn: Callable[[], object],
               what: Callable[[object], str], action: str) -> object | None:
    try:
        value = fn()
    except NvmlError as e:
        checks.append(Check(group, name, "fail", f"NVML: {e}", action))
        return None
    except Exception as e:  # noqa: BLE001 - the report must name any failure, not end
        checks.append(Check(group, name, "unknown", f"{type(e).__name__}: {e}", action))
        return None
    checks.append(Check(group, name, "ok", what(value)))
    return value


_MODULE_VERSION = re.compile(r"\s(\d+\.\d+(?:\.\d+)?)\s")


def module_check(services: HostServices, driver: object | None) -> Check:
    """The loaded kernel module's version against NVML's: a mismatch (driver upgraded, module not
    reloaded) makes nvmlInit fail with "Driver/library version mismatch" until a reboot."""
    line = services.nvidia_kernel_module()
    if line is None:
        return Check("driver", "kernel module", "fail",
                     f"{services.proc_root}/driver/nvidia/version missing: the nvidia module is not loaded",
                     "no GPU can be on nvidia: containers and MIG are impossible until it is loaded")
    found = _MODULE_VERSION.search(line + " ")
    version = found.group(1) if found else None
    if driver is not None and version is not None and version != driver:
        return Check("driver", "kernel module", "fail", f"module {version}, NVML library {driver}",
                     "reboot (or reload the nvidia modules) so the module and the library match")
    return Check("driver", "kernel module", "ok", line)


def driver_checks(hw: Hardware, smi: NvidiaSmi, services: HostServices) -> tuple[list[Check], SmiQuery | None]:
    group = "driver"
    checks: list[Check] = []
    no_mig = "without NVML gpud cannot read or change MIG; it can still bind GPUs to vfio-pci"
    driver = _nvml_call(checks, group, "NVML driver version", hw.nvml.driver_version,
                        lambda v: f"driver {v}", no_mig)
    if driver is not None:
        _nvml_call(checks, group, "NVML library version", hw.nvml.nvml_version, lambda v: f"NVML {v}", no_mig)
    checks.append(module_check(services, driver))
    query: SmiQuery | None = None
    path = smi.find()
    if path is None:
        checks.append(Check(group, "nvidia-smi", "warn", f"not found ({smi.configured or 'not on PATH'})",
                            "gpud does not need it to run; reset status and the cross-check below are skipped"))
        return checks, None
    try:
        query = smi.query()
    except NvidiaSmiError as e:
        checks.append(Check(group, "nvidia-smi", "warn", str(e), "reset status from nvidia-smi is unknown"))
        return checks, None
    same = driver is None or query.driver_version == driver
    checks.append(Check(group, "nvidia-smi", "ok" if same else "warn",
                        f"{path}: driver {query.driver_version}, CUDA {query.cuda_version}"
                        + ("" if same else f"; NVML says driver {driver}"),
                        "" if same else "the tool and the library come from different driver installs: reinstall one"))
    return checks, query


def host_checks(observation: Observation, services: HostServices) -> list[Check]:
    group = "host"
    checks: list[Check] = []
    sd = services.systemd()
    checks.append(Check(group, "systemd", "ok" if sd.present else "warn",
                        f"systemd is PID 1 ({sd.evidence})" if sd.present else f"not booted with systemd ({sd.evidence} missing)",
                        "without systemd: no Type=notify readiness, watchdog or drain-units; run gpud by hand"))
    bus = services.dbus()
    checks.append(Check(group, "D-Bus system bus", "ok" if bus.present else "warn",
                        f"accepts connections at {bus.evidence}" if bus.present else bus.evidence,
                        "policy.drain-units and policy.reboot need the system bus; without it they fail and say so"))
    udev = services.udev()
    try:
        import pyudev  # noqa: F401  (gpud's udev adapter needs it)
        pyudev_note = "pyudev importable"
    except ImportError as e:
        pyudev_note = f"pyudev missing: {e}"
    ok_udev = udev.present and pyudev_note == "pyudev importable"
    listening = (f"systemd-udevd listens at {udev.evidence}" if udev.present
                 else f"{udev.evidence} missing: udevd not running")
    checks.append(Check(group, "udev", "ok" if ok_udev else "warn", f"{listening}; {pyudev_note}",
                        "without udev events gpud sees a driver change only on its next pass (file change, apply, start)"))
    groups = services.iommu_groups()
    cmdline = services.kernel_cmdline() or ""
    hints = " ".join(w for w in cmdline.split() if "iommu" in w) or "no iommu option on the kernel command line"
    if groups:
        checks.append(Check(group, "IOMMU", "ok", f"{groups} IOMMU groups ({hints})"))
    else:
        checks.append(Check(group, "IOMMU", "warn" if groups == 0 else "unknown",
                            f"no IOMMU groups ({hints})" if groups == 0 else "iommu_groups unreadable",
                            "vm-passthrough is refused for every GPU (vfio-pci needs an IOMMU group): "
                            "enable VT-d/AMD-Vi and intel_iommu=on / amd_iommu=on"))
    vfio = services.module("vfio-pci")
    if vfio.loaded:
        checks.append(Check(group, "vfio-pci module", "ok", f"loaded ({vfio.evidence})"))
    elif vfio.available:
        checks.append(Check(group, "vfio-pci module", "ok", f"not loaded, available ({vfio.evidence})",
                            "gpud has systemd load it (modprobe@vfio_pci.service) before the first passthrough"))
    else:
        checks.append(Check(group, "vfio-pci module", "warn" if vfio.available is False else "unknown",
                            f"not loaded; {vfio.evidence}",
                            "vm-passthrough fails at its load-module step with modprobe's message"))
    switches = [f for f in observation.functions
                if f.vendor == NVIDIA and (f.class_code >> 8) == PCI_CLASS_BRIDGE_OTHER]
    nvswitch_proc = os.path.join(services.proc_root, "driver", "nvidia-nvswitch", "devices")
    proc_switches = sorted(os.listdir(nvswitch_proc)) if os.path.isdir(nvswitch_proc) else []
    if switches or proc_switches:
        where = ", ".join(sorted({f.address for f in switches} | set(proc_switches)))
        checks.append(Check(group, "NVSwitch", "warn", f"NVSwitch functions present: {where}",
                            "a single-GPU reset needs Fabric Manager running on Ampere (Hopper and later reset "
                            "one GPU alone); without it a MIG mode change that needs a reset leaves the GPU "
                            "reset-required (or a reboot, by policy.reboot)"))
    else:
        checks.append(Check(group, "NVSwitch", "ok", "no NVIDIA bridge (NVSwitch) functions on the PCI bus"))
    checks.append(fabric_manager_check(observation, services, bool(switches or proc_switches)))
    return checks


def fabric_manager_check(observation: Observation, services: HostServices, nvswitch: bool) -> Check:
    """Fabric Manager's state and what it means for a reset (nvidia-smi(1) -r): gpud never stops it."""
    pids = services.running([FABRIC_MANAGER])[FABRIC_MANAGER]
    state = f"running (pid {', '.join(map(str, pids))})" if pids else "not running"
    if not nvswitch:
        return Check("host", "Fabric Manager", "ok", f"{state}; no NVSwitch: resets do not depend on it")
    archs = {m.arch for g in observation.gpus if (m := model_tables.by_device(g.function.device)) is not None}
    if pids or not archs & {"ampere"} and archs:
        return Check("host", "Fabric Manager", "ok", f"{state}; each GPU resets on its own "
                     + ("(Fabric Manager running)" if pids else "(Hopper and later do not depend on it)"),
                     "gpud never stops or waits on it")
    return Check("host", "Fabric Manager", "warn", f"{state} on an Ampere NVSwitch host: all NVLink peers reset "
                 "together only", "start nvidia-fabricmanager so that a GPU resets alone")


def vf_tool_check(hw: Hardware, observation: Observation) -> Check:
    """The tool that enables SR-IOV VFs (NVIDIA's sriov-manage): needed for vGPUs on SR-IOV GPUs."""
    sriov = []
    for g in observation.gpus:
        try:
            with open(os.path.join(hw.sysfs.root, "bus/pci/devices", g.pci, "sriov_totalvfs")) as f:
                if int(f.read().strip() or 0) > 0:
                    sriov.append(g.pci)
        except (OSError, ValueError):
            pass
    if hw.vf_tool is None:
        return Check("host", "VF enabling tool", "unknown", "not configured")
    command = hw.vf_tool.command
    where = " ".join(command)
    found = len(command) > 1 or (os.path.isfile(command[0]) and os.access(command[0], os.X_OK))
    if found:
        return Check("host", "VF enabling tool", "ok", where + (f"; SR-IOV GPUs: {', '.join(sriov)}" if sriov else ""))
    if sriov:
        return Check("host", "VF enabling tool", "warn", f"{where} not found; SR-IOV GPUs: {', '.join(sriov)}",
                     "vm-vgpu cannot enable their VFs: install NVIDIA's vGPU host driver or set --sriov-manage")
    return Check("host", "VF enabling tool", "ok", f"{where} not found", "needed only for vGPUs on SR-IOV GPUs")


def service_checks(services: HostServices) -> list[Check]:
    running = services.running(HOLDING_SERVICES)
    checks = []
    for name, why in HOLDING_SERVICES.items():
        pids = running[name]
        if pids:
            checks.append(Check("services", name, "warn", f"running (pid {', '.join(map(str, pids))}): {why}",
                                "list its unit in policy.drain-units: gpud stops it around disruptive steps "
                                "and starts it after; gpud never kills it"))
        else:
            checks.append(Check("services", name, "ok", "not running"))
    return checks


def _placements_text(p: MigProfile) -> str:
    return f"{p.name} (id {p.id}) x{p.instance_count} at " + ",".join(f"{pl.start}:{pl.size}" for pl in p.placements)


def _table_differences(gpu: Gpu) -> list[str]:
    model = model_tables.by_device(gpu.function.device)
    if model is None or gpu.nvml is None:
        return []
    table = {p.id: p for p in model.profiles}
    out = []
    for p in gpu.nvml.profiles:
        t = table.pop(p.id, None)
        if t is None:
            out.append(f"profile {p.id} {p.name} is not in gpud's table")
            continue
        for field in ("name", "slices", "instance_count", "placements", "memory_mb", "sms"):
            if field in model.unknown_fields(t.name):
                continue
            if getattr(p, field) != getattr(t, field):
                out.append(f"{p.name} {field}: NVML {getattr(p, field)}, gpud's table {getattr(t, field)}")
    out += [f"gpud's table has {p.name} (id {p.id}), NVML does not" for p in table.values()]
    return out


def _gpu_holders(hw: Hardware, gpu: Gpu) -> list[Holder]:
    paths = []
    minor = hw.procs.nvidia_minor(gpu.pci) if gpu.function.driver == "nvidia" else None
    if minor is not None:
        paths.append(f"/dev/nvidia{minor}")
    if is_vfio(gpu.function.driver):
        if gpu.function.iommu_group is not None:
            paths.append(f"/dev/vfio/{gpu.function.iommu_group}")
        device_dir = os.path.join(hw.sysfs.root, "bus/pci/devices", gpu.pci)
        paths += [f"/dev/vfio/devices/{n}" for n in vfio_cdevs(device_dir)]
    found = {h for h in hw.procs.holders(paths) if h.pid != os.getpid()}
    if gpu.nvml is not None:
        found |= set(gpu.nvml.processes) | {h for gi in gpu.nvml.instances for h in gi.holders}
    return sorted(found)


def _smi_section(query: SmiQuery | None, pci: str, *keys: str) -> object | None:
    node: object = query.gpus.get(pci) if query is not None else None
    for k in keys:
        if not isinstance(node, dict):
            return None
        node = node.get(k)
    return node


def gpu_checks(hw: Hardware, gpu: Gpu, observation: Observation, services: HostServices,
               query: SmiQuery | None, nvswitch: bool) -> list[Check]:
    group = f"GPU {gpu.index} {gpu.pci}"
    fn = gpu.function
    checks: list[Check] = []
    model = model_tables.model_name(gpu)
    driver = fn.driver or "no driver"
    if fn.driver == "nvidia" and gpu.nvml is None:
        checks.append(Check(group, "driver", "fail", f"{model} on nvidia, but NVML does not list it",
                            "gpud reports it failed and changes nothing on it; see the NVML error above"))
    else:
        checks.append(Check(group, "driver", "ok", f"{model} on {driver}"
                            + (f", uuid {gpu.nvml.uuid}" if gpu.nvml else "")))
    n = gpu.nvml
    if n is not None:
        if not n.mig_capable:
            checks.append(Check(group, "MIG", "ok", "not MIG capable (NVML: not supported)",
                                "layouts asking MIG of this GPU are refused at validation"))
        else:
            pending = n.mig_pending != n.mig_mode
            checks.append(Check(group, "MIG mode", "warn" if pending else "ok",
                                f"current {'on' if n.mig_mode else 'off'}, pending {'on' if n.mig_pending else 'off'}",
                                "a mode change is pending: gpud settles it by a reset when the layout asks for "
                                "that mode (policy.reset), else changes it back"))
            if n.profiles:
                text = "; ".join(_placements_text(p) for p in sorted(n.profiles, key=lambda p: (p.slices, p.id)))
                checks.append(Check(group, "GI placements", "ok", text))
            else:
                checks.append(Check(group, "GI placements", "fail", "NVML lists no GPU-instance profiles",
                                    "gpud cannot plan MIG layouts for this GPU"))
            diffs = _table_differences(gpu)
            if diffs:
                checks.append(Check(group, "gpud's MIG table", "warn", "; ".join(diffs),
                                    "gpud plans from what NVML reports; its own table serves only GPUs NVML cannot "
                                    "see (on vfio-pci) and the simulator: report this difference"))
            elif model_tables.by_device(fn.device) is not None:
                checks.append(Check(group, "gpud's MIG table", "ok", "NVML's profiles equal gpud's table for this model"))
            else:
                checks.append(Check(group, "gpud's MIG table", "warn", f"gpud has no table for {fn.pci_id}",
                                    "MIG works from NVML while the GPU is on nvidia; plans for it on vfio-pci are refused"))
        if n.instances:
            checks.append(Check(group, "MIG instances", "ok", f"{len(n.instances)} GPU instance(s): "
                                + ", ".join(f"gi {g.id} profile {g.profile_id} at {g.placement.start}:{g.placement.size}"
                                            for g in n.instances)))
    checks.append(_persistence_check(hw, group, gpu, services, query))
    checks.append(_reset_check(group, gpu, services, query, nvswitch))
    checks.append(_iommu_check(group, gpu, observation))
    holders = _gpu_holders(hw, gpu)
    if holders:
        names = ", ".join(f"pid {h.pid} {h.name} ({h.device})" for h in holders)
        checks.append(Check(group, "holders", "warn", names,
                            "gpud waits for these (or fails, policy.on-busy) before changing this GPU; it never kills"))
    else:
        checks.append(Check(group, "holders", "ok", "no process holds its device nodes"))
    return checks


def _persistence_check(hw: Hardware, group: str, gpu: Gpu, services: HostServices, query: SmiQuery | None) -> Check:
    """Persistence mode and its kind: legacy (a driver flag, `nvidia-smi -pm 1`) or nvidia-persistenced.
    Either blocks `nvidia-smi -r`; gpud turns it off for the GPU around a reset and on again."""
    persistence = _smi_section(query, gpu.pci, "Persistence Mode")
    if not isinstance(persistence, str) and hw.reset is not None and gpu.function.driver == "nvidia":
        on = hw.reset.persistence(gpu.pci)
        persistence = {True: "Enabled", False: "Disabled"}.get(on) if on is not None else None
    if not isinstance(persistence, str):
        return Check(group, "persistence mode", "unknown", "nvidia-smi did not say")
    if persistence != "Enabled":
        return Check(group, "persistence mode", "ok", f"nvidia-smi: {persistence}")
    daemon = services.running(["nvidia-persistenced"])["nvidia-persistenced"]
    kind = "nvidia-persistenced" if daemon else "legacy: no nvidia-persistenced runs (nvidia-smi -pm 1)"
    return Check(group, "persistence mode", "ok", f"nvidia-smi: Enabled ({kind})",
                 "it blocks nvidia-smi -r: gpud turns it off for this GPU around a reset (nvidia-smi -pm 0 -i) "
                 "and on again" + ("" if daemon else "; stopping a daemon would not help here"))


def _reset_check(group: str, gpu: Gpu, services: HostServices, query: SmiQuery | None, nvswitch: bool) -> Check:
    methods = services.reset_methods(gpu.pci)
    status = _smi_section(query, gpu.pci, "GPU Reset Status")
    parts = [f"kernel reset_method: {methods}" if methods is not None else "kernel reset_method: not shown"]
    if isinstance(status, dict):
        parts.append("nvidia-smi GPU Reset Status: " + ", ".join(f"{k} {v}" for k, v in status.items()))
    elif query is not None:
        parts.append("nvidia-smi -q prints no GPU Reset Status for it")
    fabric = _smi_section(query, gpu.pci, "Fabric", "State")
    on_fabric = isinstance(fabric, str) and fabric not in ("N/A", "")
    if on_fabric:
        parts.append(f"nvidia-smi Fabric State: {fabric} (the GPU is on an NVLink fabric)")
    reason = "; ".join(parts)
    model = model_tables.by_device(gpu.function.device)
    fm = bool(services.running([FABRIC_MANAGER])[FABRIC_MANAGER])
    together = (nvswitch or on_fabric) and not fm and (model is None or model.arch not in NO_FABRIC_DEPENDENCY)
    if together:
        return Check(group, "reset", "warn", reason + "; NVSwitch fabric without Fabric Manager: its NVLink peers "
                     "reset together, not one alone", "mode changes needing a reset end reset-required (or "
                     "reboot, policy.reboot); start nvidia-fabricmanager")
    if nvswitch or on_fabric:
        reason += "; NVSwitch fabric: " + ("Fabric Manager runs" if fm else "Hopper and later") + ", it resets alone"
    required = isinstance(status, dict) and str(status.get("Reset Required", "")).lower() == "yes"
    if required:
        return Check(group, "reset", "warn", reason, "the driver asks for a reset: gpud leaves it to you")
    if methods == "":
        return Check(group, "reset", "warn", reason, "the kernel offers no reset method: MIG mode changes "
                     "that need a reset end reset-required")
    return Check(group, "reset", "ok" if methods else "unknown", reason,
                 "" if methods else "whether a per-GPU reset works is known only from --mutate")


def _iommu_check(group: str, gpu: Gpu, observation: Observation) -> Check:
    fn = gpu.function
    if fn.iommu_group is None:
        return Check(group, "IOMMU group", "warn", "none", "vm-passthrough is refused for this GPU")
    members = [f for f in observation.functions if f.iommu_group == fn.iommu_group]
    others = [f for f in members if f.address != fn.address]
    if not others:
        return Check(group, "IOMMU group", "ok", f"group {fn.iommu_group}: the GPU alone")
    text = ", ".join(f"{f.address} {f.pci_id} on {f.driver or 'no driver'}"
                     + (" (bridge, left alone)" if is_bridge(f.class_code) else "") for f in others)
    foreign = [f for f in others if not is_bridge(f.class_code) and f.slot != fn.slot]
    return Check(group, "IOMMU group", "warn" if foreign else "ok", f"group {fn.iommu_group} shared with {text}",
                 "vm-passthrough moves every endpoint of the group to vfio-pci with the GPU: "
                 "those devices leave their drivers" if foreign else
                 "the card's own functions follow the GPU to vfio-pci")


def read_only_checks(hw: Hardware, services: HostServices, smi: NvidiaSmi, match: Sequence[MatchRule]) -> list[Check]:
    checks, query = driver_checks(hw, smi, services)
    observation = observe(hw.sysfs, hw.nvml, match)
    if observation.nvml_error:
        checks.append(Check("driver", "NVML devices", "fail", observation.nvml_error,
                            "gpud reports the GPUs on nvidia failed and changes nothing on them"))
    host = host_checks(observation, services)
    nvswitch = any(c.name == "NVSwitch" and c.status == "warn" for c in host)
    checks += host + [vf_tool_check(hw, observation)] + service_checks(services)
    if not observation.gpus:
        checks.append(Check("GPUs", "managed GPUs", "fail", "no NVIDIA display/3D controller on the PCI bus",
                            "gpud has nothing to manage"))
    for gpu in observation.gpus:
        checks += gpu_checks(hw, gpu, observation, services, query, nvswitch)
    return checks


__all__ = ["read_only_checks", "HOLDING_SERVICES"]
