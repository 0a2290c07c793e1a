"""Layout x the GPUs of this host -> what each GPU should be (`DesiredGpu`), or why not.

This is where a layout meets hardware: selectors become PCI addresses, and every MIG name is
checked against the table of the GPU it will be applied to, so that on a host mixing an H100 and
an H200 the same name is valid on one and reported on the other (mig-parted #157). Feasibility of
a combination of profiles is the planner's business; it explains infeasibility with placements.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from msgspec import Struct, field

from gpud.layout.desired import DesiredGpu, LayoutIssue
from gpud.layout.names import ci_names, find_profile, parse_mig_name, sorted_names
from gpud.layout.parse import ParsedLayout, entry_path, parse_layout
from gpud.layout.schema import DeviceEntry, Layout
from gpud.layout.yaml_reader import item_path, key_path
from gpud.model import Gpu, KnownGpu, MigProfile
from gpud.pci import is_vfio
from gpud.profiles import NVIDIA, by_device, model_name, with_model_ci_profiles
from gpud.vgpu_types import VgpuModel, mig_need, parse_vgpu_name, strip_prefix
from gpud.vgpu_types import by_device as vgpu_model_of


class Resolution(Struct):
    """`desired` is empty whenever `errors` is not: a layout is applied whole or not at all.
    GPUs missing from `desired` are left as they are."""

    desired: dict[str, DesiredGpu] = field(default_factory=dict)
    errors: list[LayoutIssue] = field(default_factory=list)
    warnings: list[LayoutIssue] = field(default_factory=list)
    selected: str | None = None
    layout: Layout | None = None  # the valid layout (policy, hooks), None when there are errors

    @property
    def ok(self) -> bool:
        return not self.errors


def gpu_profiles(gpu: Gpu) -> tuple[MigProfile, ...] | None:
    """The GPU's own MIG table: NVML's when NVML sees it, else the known model's; () when it is not
    MIG capable, None when nobody can tell (an unknown model on vfio-pci)."""
    if gpu.nvml is not None:
        if gpu.nvml.profiles:
            return with_model_ci_profiles(gpu.nvml.profiles, gpu.function.device)
        if not gpu.nvml.mig_capable:
            return ()
    model = by_device(gpu.function.device) if gpu.function.vendor == NVIDIA else None
    return model.profiles if model is not None else None


def _at(pcis: list[str]) -> str:
    """`0000:3b:00.0` / `0000:3b:00.0, 0000:3c:00.0` / `... and 5 more`: one issue per GPU model."""
    shown = ", ".join(pcis[:3])
    return shown if len(pcis) <= 3 else f"{shown} and {len(pcis) - 3} more"


Found = TypeVar("Found", Gpu, KnownGpu)

_AT = "\x00at\x00"  # where a grouped message lists the GPUs' addresses


class _Collector:
    """Issues that name GPUs; the same problem on several GPUs of one model becomes one issue."""

    def __init__(self, parsed: ParsedLayout) -> None:
        self.parsed = parsed
        self.issues: list[LayoutIssue] = []
        self.grouped: dict[tuple[str, str], list[str]] = {}  # (path, message with _AT) -> PCI addresses

    def add(self, path: str, message: str) -> None:
        self.issues.append(LayoutIssue(self.parsed.file, self.parsed.line(path), path, message))

    def per_gpu(self, path: str, template: str, pci: str) -> None:
        self.grouped.setdefault((path, template), []).append(pci)

    def done(self) -> list[LayoutIssue]:
        for (path, template), pcis in self.grouped.items():
            self.add(path, template.replace(_AT, _at(pcis)))
        self.grouped.clear()
        return sorted(self.issues, key=lambda i: i.line or 0)


def resolve(parsed: ParsedLayout, gpus: Sequence[Gpu], gone: Sequence[KnownGpu] = (),
            index_problem: str | None = None) -> Resolution:
    """Resolve the selected layout against the managed GPUs present (each with its kept index).

    `gone`: GPUs numbered before that are missing from the bus now. A selector naming one of them
    is not an error and selects nothing: its index is never handed to another GPU, so the entry
    waits for that GPU to come back (a warning says so). An `all` or `device-filter` entry that
    would have covered a gone GPU gets a warning too: the set it selects has changed.

    `index_problem`: why GPU indices cannot be trusted now (the kept map was lost and the GPU set
    changed): a selector that is an index is then an error saying so, as it may name another GPU
    than the one the layout was written for; PCI addresses and UUIDs still select."""
    layout = parsed.layout or parsed.draft
    if layout is None or layout.selected is None or layout.selected not in layout.layouts:
        return Resolution(errors=list(parsed.errors), warnings=list(parsed.warnings))
    selected = layout.selected
    errors = _Collector(parsed)
    warnings = _Collector(parsed)
    by_index = {g.index: g for g in gpus}
    by_pci = {g.pci: g for g in gpus}
    by_uuid = {uuid.lower(): g for g in gpus if (uuid := g.uuid)}  # NVML's, or remembered for a GPU it does not see
    gone_index = {k.index: k for k in gone}
    gone_pci = {k.pci: k for k in gone}
    gone_uuid = {k.uuid.lower(): k for k in gone if k.uuid}
    claimed: dict[str, str] = {}  # PCI address -> entry path
    desired: dict[str, DesiredGpu] = {}

    for i, entry in enumerate(layout.layouts[selected]):
        epath = parsed.origin(entry_path(layout.layouts_key, selected, i))
        dpath = key_path(epath, "devices")
        targets: list[tuple[Gpu, str]] = []
        if entry.devices == "all":
            targets = [(g, dpath) for g in gpus]
        else:
            for j, selector in enumerate(entry.devices):
                spath = parsed.origin(item_path(dpath, j))
                if index_problem is not None and isinstance(selector, int):
                    errors.add(spath, f"GPU {selector} is named by its index, but {index_problem}; "
                                      "name the GPU by PCI address or UUID (gpudctl status lists them)")
                    continue
                gpu = _find(selector, by_index, by_pci, by_uuid)
                missing = _find(selector, gone_index, gone_pci, gone_uuid) if gpu is None else None
                if missing is not None:
                    warnings.add(spath, f"{_gone(missing)}; this entry selects nothing there until it "
                                        "returns (its index is never given to another GPU)")
                elif gpu is None:
                    errors.add(spath, _no_such_gpu(selector, gpus))
                else:
                    targets.append((gpu, spath))
        if entry.device_filter:  # narrows the selected devices, as in mig-parted
            targets = [(g, p) for g, p in targets
                       if any(f.matches(g.function.vendor, g.function.device, g.function.subsystem_vendor,
                                        g.function.subsystem_device) for f in entry.device_filter)]
        if entry.devices == "all" or entry.device_filter:
            how = "devices: all" if not entry.device_filter else "device-filter"
            for missing in gone:
                if entry.device_filter and not any(f.matches(missing.vendor, missing.device) for f in entry.device_filter):
                    continue
                if entry.devices != "all" and missing.index not in entry.devices and missing.pci not in entry.devices:
                    continue  # named explicitly: reported above
                warnings.add(dpath, f"the GPU set changed: {_gone(missing)}; this entry ({how}) now selects "
                                    f"{len(targets)} GPU{'' if len(targets) == 1 else 's'} present")

        for gpu, spath in targets:
            if claimed.get(gpu.pci) == epath:
                continue  # one entry naming a GPU twice (index and address): harmless
            if gpu.pci in claimed:
                errors.add(spath, f"GPU {gpu.index} ({gpu.pci}) is also selected by {claimed[gpu.pci]}; "
                                  "a GPU may be in one entry only")
                continue
            claimed[gpu.pci] = epath
            mig_enabled, mig_devices = entry.mig_enabled, dict(entry.mig_devices)
            vgpu_devices: dict[str, int] = {}
            if entry.workload == "vm-vgpu":
                table = vgpu_model_of(gpu.function.device) if gpu.function.vendor == NVIDIA else None
                checked = _check_vgpu(entry, epath, gpu, table, errors, warnings)
                if checked is not None:
                    mig_enabled, mig_devices = vgpu_mig_layout(checked, entry, table)
                vgpu_devices = checked or {}
            if mig_enabled:
                _check_mig(parsed, mig_devices, epath, gpu, errors, warnings)
            desired[gpu.pci] = DesiredGpu(
                pci=gpu.pci,
                index=gpu.index,
                entry=epath,
                workload=entry.workload,
                mig_enabled=mig_enabled,
                mig_devices=mig_devices,
                vgpu_devices=vgpu_devices,
                dynamic=entry.mig_dynamic,
            )

    _check_iommu_groups(gpus, desired, key_path(layout.layouts_key, selected), errors)
    if parsed.ok:  # with parse errors, entries may be missing from the draft: no false alarms
        lpath = key_path(layout.layouts_key, selected)
        for gpu in gpus:
            if gpu.pci not in claimed:
                warnings.add(lpath, f"GPU {gpu.index} ({gpu.pci}, {model_name(gpu)}) is not in layout "
                                    f"{selected}; left untouched")

    all_errors = sorted([*parsed.errors, *errors.done()], key=lambda e: e.line or 0)
    return Resolution(
        desired={} if all_errors else desired,
        errors=all_errors,
        warnings=[*parsed.warnings, *warnings.done()],
        selected=selected,
        layout=parsed.layout if not all_errors else None,
    )


def _check_iommu_groups(gpus: Sequence[Gpu], desired: dict[str, DesiredGpu], lpath: str, errors: _Collector) -> None:
    """A group is one unit: the IOMMU gives a VM all its endpoints or none, so two GPUs of one group
    (behind a PCIe switch without ACS) cannot be one on vfio-pci and one on nvidia. A layout that
    would split a group, counting a GPU it leaves out at the driver it is on now (gpud never moves
    a GPU the layout does not name), is refused naming the group and its members: accepted, the
    GPUs were moved between the drivers forever."""
    groups: dict[int, list[Gpu]] = {}
    for gpu in gpus:
        if gpu.function.iommu_group is not None:
            groups.setdefault(gpu.function.iommu_group, []).append(gpu)
    for group, members in sorted(groups.items()):
        if len(members) < 2:
            continue
        wants: list[tuple[Gpu, bool, str]] = []  # (gpu, on vfio-pci, why)
        for g in sorted(members, key=lambda g: g.index):
            d = desired.get(g.pci)
            if d is not None:
                wants.append((g, d.workload == "vm-passthrough", f"{d.workload} by {d.entry}"))
            else:
                on_vfio = is_vfio(g.function.driver)
                wants.append((g, on_vfio, f"not in the layout, stays on {g.function.driver or 'no driver'}"))
        if len({v for _, v, _ in wants}) < 2:
            continue
        first = next((desired[g.pci].entry for g, _, _ in wants if g.pci in desired), lpath)
        parts = "; ".join(f"GPU {g.index} ({g.pci}) {'vfio-pci' if v else 'nvidia'}: {why}" for g, v, why in wants)
        errors.add(first, f"IOMMU group {group} would be split across drivers ({parts}); a group is one unit: "
                          "give all its GPUs vm-passthrough, or none of them")


def check_text(text: str, file: str = "layout.yaml", gpus: Sequence[Gpu] = (), *,
               select: str | None = None) -> Resolution:
    """Parse and resolve in one call: what the daemon's `check` request answers."""
    return resolve(parse_layout(text, file, select=select), gpus)


def _find(selector: int | str, by_index: dict[int, Found], by_pci: dict[str, Found],
          by_uuid: dict[str, Found]) -> Found | None:
    if isinstance(selector, int):
        return by_index.get(selector)
    if selector.startswith("GPU-"):
        return by_uuid.get(selector.lower())
    return by_pci.get(selector)


def _indices(indices: list[int]) -> str:
    """`0-7` when they run without a gap (the usual case), else `0, 2, 3`."""
    if indices == list(range(indices[0], indices[0] + len(indices))):
        return f"{indices[0]}-{indices[-1]}"
    return ", ".join(map(str, indices))


def _gone(known: KnownGpu) -> str:
    return f"GPU {known.index} ({known.pci}, {known.model}) is gone from the PCI bus"


def _no_such_gpu(selector: int | str, gpus: Sequence[Gpu]) -> str:
    host = (f"this host has {len(gpus)} managed GPU{'s' if len(gpus) != 1 else ''} "
            f"(indices {_indices(sorted(g.index for g in gpus))})" if gpus else "this host has no managed GPUs")
    if isinstance(selector, int):
        return f"no GPU with index {selector}; {host}"
    if selector.startswith("GPU-"):
        unseen = sum(1 for g in gpus if g.uuid is None)
        hint = (f"; the UUID of a GPU is known once NVML has seen it ({unseen} of {len(gpus)} were never seen on "
                "the nvidia driver)" if unseen else "")
        return f"no GPU with UUID {selector}{hint}"
    return f"no managed GPU at {selector}; {host}"


def in_cdmm(gpu: Gpu) -> bool:
    """A Grace superchip's GPU whose driver runs CDMM (docs/hardware/grace.md); CDMM has no effect
    on other GPUs (nvidia's nv-reg.h; GPU Operator 25.3.2: "ignored on other GPU platforms")."""
    model = by_device(gpu.function.device) if gpu.function.vendor == NVIDIA else None
    return bool(model is not None and model.coherent and gpu.nvml is not None
                and gpu.nvml.coherent_memory_mode == "driver")


def _check_mig(parsed: ParsedLayout, mig_devices: dict[str, int], epath: str, gpu: Gpu,
               errors: _Collector, warnings: _Collector) -> None:
    """MIG names against this GPU's own table; the message names the model and the valid names."""
    model = model_name(gpu)
    profiles = gpu_profiles(gpu)
    mpath = key_path(epath, "mig-enabled")
    if profiles is None:
        warnings.per_gpu(mpath, f"cannot check MIG profiles of {model} at {_AT}: NVML does not see it and "
                                "its model is not known to gpud", gpu.pci)
        return
    if not profiles:
        errors.per_gpu(mpath, f"{model} at {_AT} does not support MIG", gpu.pci)
        return
    if in_cdmm(gpu):
        errors.per_gpu(mpath, f"{model} at {_AT}: MIG is not available while the nvidia driver manages this GPU's "
                              "coherent memory (CDMM: CoherentGPUMemoryMode \"driver\" in /proc/driver/nvidia/params); "
                              "NVIDIA lists CDMM as not compatible with MIG (GPU Operator 25.3.2 release notes, known "
                              "issues); load nvidia with NVreg_CoherentGPUMemoryMode=numa to use MIG", gpu.pci)
        return
    for name in mig_devices:
        if find_profile(name, profiles) is not None:
            continue
        npath = key_path(key_path(epath, "mig-devices"), name)
        parsed_name = parse_mig_name(name)
        gi = find_profile(parsed_name.gi_name, profiles) if parsed_name is not None else None
        if gi is not None and parsed_name is not None and parsed_name.ci_slices is not None:
            template = (f"{name}: a {gi[0].name} instance of {model} at {_AT} cannot hold "
                        f"{parsed_name.ci_slices}c compute instances; valid: {', '.join(ci_names(gi[0]))}")
        else:
            template = f"{name} is not a MIG profile of {model} at {_AT}; valid: {', '.join(sorted_names(profiles))}"
        errors.per_gpu(npath, template, gpu.pci)


VGPU_SYNTAX = "<GPU>-<GB><A|B|C|Q> (time-sliced, e.g. L40S-12Q) or <GPU>-<G>-<GB><A|B|C|Q>[ME] (MIG-backed, e.g. A100-1-5C)"


def vgpu_mig_layout(vgpu_devices: dict[str, int], entry: DeviceEntry, table: VgpuModel | None = None
                    ) -> tuple[bool | None, dict[str, int]]:
    """The MIG layout vGPU types imply (vgpu-device-manager's ToMigConfigSpecSlice): MIG-backed types
    need MIG on with as many GPU instances of their profile as their count fills, one type per
    instance (`A100-1-5C: 4` -> `1g.5gb: 4`; on an RTX PRO 6000 `DC-1-3Q: 9` -> `1g.24gb+gfx: 2`,
    eight to an instance); time-sliced types need MIG off; no types leave MIG as the entry says."""
    needed: dict[str, int] = {}
    for name, count in vgpu_devices.items():
        if parse_vgpu_name(name) is None:
            continue
        need = mig_need(name, table)
        if need is None:
            return False, {}
        profile, per_gi = need
        needed[profile] = needed.get(profile, 0) + -(-count // per_gi)
    if needed:
        return True, needed
    return entry.mig_enabled, dict(entry.mig_devices)


def _check_vgpu(entry: DeviceEntry, epath: str, gpu: Gpu, table: VgpuModel | None, errors: _Collector,
                warnings: _Collector) -> dict[str, int] | None:
    """vGPU type names against the types this GPU's model offers (gpud.vgpu_types; sysfs shows the
    same names once the driver is asked); the message names the model and the valid types. Returns
    the bare names -> counts, or None when something is wrong."""
    vpath = key_path(epath, "vgpu-devices")
    model = model_name(gpu)
    out: dict[str, int] = {}
    ok = True
    kinds: dict[bool, str] = {}
    for name, count in entry.vgpu_devices.items():
        npath = key_path(vpath, name)
        parsed = parse_vgpu_name(name)
        if parsed is None:
            if table is not None:
                errors.per_gpu(npath, f"{name} is not a vGPU type of {model} at {_AT}; valid: {', '.join(table.names())}",
                               gpu.pci)
            else:
                errors.per_gpu(npath, f"{name} is not a vGPU type name; expected {VGPU_SYNTAX}", gpu.pci)
            ok = False
            continue
        known = table.find(name) if table is not None else None
        if table is None:
            warnings.per_gpu(vpath, f"cannot check vGPU types of {model} at {_AT}: its model is not known to gpud; "
                                    "the driver decides", gpu.pci)
            bare = strip_prefix(name)
        elif known is None:
            errors.per_gpu(npath, f"{name} is not a vGPU type of {model} at {_AT}; valid: {', '.join(table.names())}",
                           gpu.pci)
            ok = False
            continue
        else:
            bare = known.name  # the driver's name: `DC-1-24QGFX` (vgpu-device-manager's spelling) is DC-1-24Q
        kinds.setdefault(parsed.mig_backed, bare)
        out[bare] = out.get(bare, 0) + count
    if len(kinds) == 2:
        errors.per_gpu(vpath, f"{kinds[False]} is time-sliced and {kinds[True]} is MIG-backed: one GPU runs one kind "
                              f"(MIG off or on), not both ({model} at {_AT})", gpu.pci)
        ok = False
    if out and (entry.mig_enabled is not None or entry.mig_devices):
        errors.per_gpu(key_path(epath, "mig-enabled"),
                       "vgpu-devices decide the MIG layout (MIG-backed types turn MIG on with their GPU instances, "
                       f"time-sliced ones turn it off); leave out mig-enabled and mig-devices ({model} at {_AT})",
                       gpu.pci)
        ok = False
    return out if ok else None
