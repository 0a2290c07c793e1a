"""The status a person (gpudctl status) and a script (--json) read: built from what the engine
last observed and concluded, never from what it intended."""

from __future__ import annotations

from typing import Any

from gpud import VERSION, profiles
from gpud.layout.names import device_name
from gpud.model import Gpu, GpuInstance, Holder, NvmlGpu


def mig_device_name(nvml: NvmlGpu, gi: GpuInstance, ci_slices: int | None) -> str:
    """The device's name from its GPU's own profile table (None: the GI without a compute instance)."""
    prof = nvml.profile(gi.profile_id)
    return device_name(prof, ci_slices) if prof is not None else f"profile-{gi.profile_id}"


def model_name(gpu: Gpu) -> str:
    if gpu.nvml is not None:
        return gpu.nvml.name
    known = profiles.by_device(gpu.function.device)
    return known.name if known else f"PCI {gpu.pci_id}"


def _holders(holders: tuple[Holder, ...]) -> list[dict[str, Any]]:
    return [{"pid": h.pid, "name": h.name, "device": h.device} for h in holders]


def _mode(v: int | None) -> str | None:
    return None if v is None else ("enabled" if v else "disabled")


def gpu_status(gpu: Gpu, desired, state) -> dict[str, Any]:
    nv = gpu.nvml
    instances = []
    if nv is not None:
        for gi in sorted(nv.instances, key=lambda g: (g.placement.start, g.id)):
            for ci in gi.cis or ():
                instances.append({
                    "profile": mig_device_name(nv, gi, ci.slices),
                    "placement": {"start": gi.placement.start, "size": gi.placement.size},
                    "gi": gi.id, "ci": ci.id, "uuid": ci.uuid, "holders": _holders(ci.holders),
                })
            if not gi.cis:
                instances.append({
                    "profile": mig_device_name(nv, gi, None),  # no compute instance yet: the GI's own name
                    "placement": {"start": gi.placement.start, "size": gi.placement.size},
                    "gi": gi.id, "ci": None, "uuid": None, "holders": [],
                })
    known = profiles.by_device(gpu.function.device)
    driver = gpu.function.driver
    if desired is not None:
        workload = desired.workload
    else:
        workload = {"nvidia": "container", "vfio-pci": "vm-passthrough"}.get(driver or "", "unmanaged")
    group = gpu.function.iommu_group
    return {
        "index": gpu.index,
        "pci": gpu.pci,
        "uuid": nv.uuid if nv else None,
        "model": model_name(gpu),
        "pci_id": gpu.pci_id,
        "driver": driver,
        "workload": workload,
        "iommu_group": group,
        "numa_node": gpu.function.numa_node,
        "mig": {
            "capable": nv.mig_capable if nv is not None else bool(known and known.mig_capable),
            "mode": _mode(nv.mig_mode) if nv else None,
            "pending": _mode(nv.mig_pending) if nv and nv.mig_pending != nv.mig_mode else None,
            "instances": instances,
        },
        "converged": state.converged if state else False,
        "state": state.state if state else "starting",
        "message": state.message if state else "",
        "holders": _holders(state.holders) if state else [],
        "group": [{"pci": c.address, "driver": c.driver, "class": f"0x{c.class_code:06x}"} for c in gpu.companions],
        "vfio_device": f"/dev/vfio/{group}" if driver == "vfio-pci" and group is not None else None,
    }


def build_status(rec) -> dict[str, Any]:
    errors, warnings = rec.layout_issues
    res = rec.resolution
    if res is not None:  # the layout in force, resolved against the host as it is now
        warnings = list(dict.fromkeys(warnings + [str(w) for w in res.warnings]))
        errors = list(dict.fromkeys(errors + [str(e) for e in res.errors]))
    gpus = [
        gpu_status(g, res.desired.get(g.pci) if res else None, rec.gpu_states.get(g.pci))
        for g in rec.observation.gpus
    ]
    return {
        "phase": rec.phase,
        "layout": {
            "path": rec.config_path,
            "selected": rec.layout.layout.selected if rec.layout else None,
            "valid": not errors,
            "errors": errors,
            "warnings": warnings,
        },
        "gpus": gpus,
        "read_only": rec.read_only,
        "version": VERSION,
    }
