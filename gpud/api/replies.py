"""The socket's replies, built from the engine's typed records straight into `gpud.wire`'s structs.

The engine keeps domain objects (Gpu, GpuState, GpuPlan, BindingPlan, PassthroughEntry); this
module is the one place they become what a client reads. Every reply is constructed as its wire
struct here, so a renamed or mistyped field fails a type check (and msgspec at construction),
never a user parsing `--json`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from gpud import VERSION
from gpud.engine.binding.passthrough import PassthroughEntry, kubevirt_configuration, kubevirt_entry
from gpud.engine.gpu_state import GpuState
from gpud.engine.kube.node_labels_out import LabelsOut
from gpud.engine.leases.records import LeaseRecord
from gpud.engine.queries import ci_remaining_capacity, remaining_capacity
from gpud.engine.vgpu.inventory import entry as vgpu_entry
from gpud.engine.vgpu.inventory import kubevirt_warnings
from gpud.engine.view import EngineView
from gpud.host.kube.nfd import FeaturesRefused, read_features
from gpud.kubevirt_names import vf_resources
from gpud.layout.desired import DesiredGpu
from gpud.layout.names import device_name, mig_device_name
from gpud.layout.resolve import Resolution
from gpud.model import Gpu, Holder, KnownGpu, MigProfile, Placement
from gpud.pci import is_vfio
from gpud.plan.node_labels import Advertised, advertised
from gpud.profiles import GI_PROFILE_INDEX, NVIDIA, ModelInfo, by_device, model_name, with_model_ci_profiles
from gpud.vgpu_types import by_device as vgpu_model_of
from gpud.vgpu_types import parse_vgpu_name
from gpud.wire import protocol as wire
from gpud.wire import replies as wire_replies
from gpud.wire import tables as wire_tables

if TYPE_CHECKING:  # the kube agent's module loads the Kubernetes client: only with --kube-node
    from gpud.engine.kube.agent import AgentStatus

# ---------------------------------------------------------------------------------------------
# Small records


def capped(items: list[str], noun: str, limit: int = wire.MAX_LISTED) -> tuple[list[str], int]:
    """At most `limit` entries, then one saying how many more there were; and that count. A layout
    of 12,000 entries naming missing GPUs must not make a reply outgrow the frame."""
    if len(items) <= limit:
        return list(items), 0
    more = len(items) - limit
    return list(items[:limit]) + [f"... and {more} more {noun} (left out of this reply)"], more


def placement(p: Placement) -> wire_replies.Placement:
    return wire_replies.Placement(start=p.start, size=p.size)


def holders(items: tuple[Holder, ...] | list[Holder]) -> list[wire_replies.HolderInfo]:
    return [wire_replies.HolderInfo(pid=h.pid, name=h.name, device=h.device, vm=h.vm) for h in items]


def _mode(value: int | None) -> str | None:
    return None if value is None else ("enabled" if value else "disabled")


# ---------------------------------------------------------------------------------------------
# status / reload


def _instances(gpu: Gpu) -> list[wire_replies.InstanceStatus]:
    nv = gpu.nvml
    if nv is None:
        return []
    out = []
    for gi in sorted(nv.instances, key=lambda g: (g.placement.start, g.id)):
        for ci in gi.cis:
            slot = wire_replies.Placement(start=ci.start, size=ci.slices) if ci.start is not None else None
            out.append(wire_replies.InstanceStatus(profile=mig_device_name(nv, gi, ci.slices), placement=placement(gi.placement),
                                                   gi=gi.id, ci=ci.id, uuid=ci.uuid, holders=holders(ci.holders),
                                                   ci_placement=slot))
        if not gi.cis:  # no compute instance yet: the GI's own name
            out.append(wire_replies.InstanceStatus(profile=mig_device_name(nv, gi, None), placement=placement(gi.placement),
                                                   gi=gi.id, ci=None, uuid=None, holders=[]))
    return out


def vgpu_status(gpu: Gpu, rebuilt: list[str]) -> wire_replies.VgpuStatus | None:
    v = gpu.vgpu
    if v is None:
        return None
    return wire_replies.VgpuStatus(
        interface=v.interface, offered=[o.type for o in v.offers if o.creatable > 0], vfs=len(v.vfs),
        devices=[wire_replies.VgpuDeviceStatus(type=d.type, uuid=d.uuid, vf=d.vf, parent=d.parent, gi=d.gi,
                                               holders=holders(d.holders)) for d in v.devices],
        rebuilt=list(rebuilt))


def lease_info(rec: LeaseRecord, index: int | None = None, now: float | None = None) -> wire_replies.LeaseInfo:
    """A lease record as the wire shows it (the `lease` reply, `leases`, status per GPU)."""
    now = time.time() if now is None else now
    return wire_replies.LeaseInfo(
        id=rec.id, gpu=rec.gpu, index=index, profile=rec.profile,
        placement=f"{rec.placement.start}:{rec.placement.size}" if rec.placement is not None else None,
        uuid=rec.uuid, devices=list(rec.devices), owner=rec.owner, uid=rec.uid, pid=rec.pid,
        created=round(rec.created, 3), age_s=round(max(0.0, now - rec.created), 1), state=rec.state, note=rec.note)


def leases_reply(view: EngineView) -> wire_replies.LeasesReply:
    index = {g.pci: g.index for g in view.observation.gpus}
    return wire_replies.LeasesReply(leases=[lease_info(r, index.get(r.gpu)) for r in view.leases])


def gpu_status(gpu: Gpu, desired: DesiredGpu | None, state: GpuState | None,
               rebuilt: list[str] | None = None, leases: list[LeaseRecord] | None = None,
               lease_free: Mapping[str, int] | None = None) -> wire_replies.GpuStatus:
    nv = gpu.nvml
    known = by_device(gpu.function.device)
    driver = gpu.function.driver
    if desired is not None:
        workload = desired.workload
    else:
        workload = "vm-passthrough" if is_vfio(driver) else {"nvidia": "container"}.get(driver or "", "unmanaged")
    group = gpu.function.iommu_group
    return wire_replies.GpuStatus(
        index=gpu.index,
        pci=gpu.pci,
        uuid=gpu.uuid,  # NVML's, or the one remembered while NVML does not see it (vfio-pci)
        model=model_name(gpu),
        pci_id=gpu.pci_id,
        driver=driver,
        workload=workload,
        iommu_group=group,
        numa_node=gpu.function.numa_node,
        mig=wire_replies.MigStatus(
            capable=nv.mig_capable if nv is not None else bool(known and known.mig_capable),
            mode=_mode(nv.mig_mode) if nv else None,
            pending=_mode(nv.mig_pending) if nv and nv.mig_pending != nv.mig_mode else None,
            instances=_instances(gpu),
        ),
        converged=state.converged if state else False,
        state=state.state if state else "starting",
        message=state.message if state else "",
        holders=holders(state.holders) if state else [],
        group=[wire_replies.GroupMember(pci=c.address, driver=c.driver, class_=f"0x{c.class_code:06x}")
               for c in gpu.companions],
        vfio_device=f"/dev/vfio/{group}" if is_vfio(driver) and group is not None else None,
        vgpu=vgpu_status(gpu, rebuilt or []),
        dynamic=desired is not None and desired.dynamic,
        leases=[lease_info(r, gpu.index) for r in leases or ()],
        lease_free=dict(lease_free or {}),
    )


def gone_gpu_status(known: KnownGpu, state: GpuState | None) -> wire_replies.GpuStatus:
    """A GPU missing from the bus keeps its row, index and last identity: `gone`."""
    return wire_replies.GpuStatus(index=known.index, pci=known.pci, uuid=known.uuid, model=known.model,
                                  pci_id=known.pci_id, driver=None, workload="-", converged=False, state="gone",
                                  message=state.message if state is not None else "gone from the PCI bus")


def layout_status(view: EngineView) -> wire_replies.LayoutStatus:
    """The file in force and what is wrong with it now, resolved against the host as it is."""
    errors, warnings = list(view.layout_errors), list(view.layout_warnings)
    res = view.resolution
    if res is not None:
        # The file in force is the one resolved now: its warnings as of now (a GPU that came back
        # is no longer warned about); a refused file's own warnings stay beside the ones in force.
        kept = warnings if errors else []
        warnings = list(dict.fromkeys(kept + [str(w) for w in res.warnings]
                                      + list(view.notes.values())))
        errors = list(dict.fromkeys(errors + [str(e) for e in res.errors]))
    shown_errors, errors_omitted = capped(errors, "errors")
    shown_warnings, warnings_omitted = capped(warnings, "warnings")
    return wire_replies.LayoutStatus(path=view.config_path, selected=view.selected, chosen=view.chosen,
                                     valid=not errors, errors=shown_errors, warnings=shown_warnings,
                                     errors_omitted=errors_omitted, warnings_omitted=warnings_omitted)


# What `check` and `plan` say of a GPU with `mig-devices: dynamic` (gpud.engine.leases).
DYNAMIC_NOTE = ("MIG on demand (mig-devices: dynamic): instances are made and removed by leases "
                "(gpudctl lease); the file sets only the MIG mode, and no instance is touched by an apply")


def check_reply(resolution: Resolution, *, others: Sequence[tuple[str, Resolution]] = ()) -> wire_replies.CheckReply:
    """A resolution as the engine judged it (GPUs the planner cannot converge are among its
    errors, or its warnings under `on-infeasible: skip-gpu`: gpud.engine.feasibility).
    `others`: (name, resolution) of the file's other layouts, checked too (any of them may be
    selected by a node label); their problems join the reply's, each said once."""
    all_errors = [str(e) for e in resolution.errors]
    all_warnings = [str(w) for w in resolution.warnings]
    checked = [resolution.selected] if resolution.selected else []
    for name, other in others:
        all_errors += [str(e) for e in other.errors]
        all_warnings += [str(w) for w in other.warnings]
        checked.append(name)
    all_errors, all_warnings = list(dict.fromkeys(all_errors)), list(dict.fromkeys(all_warnings))
    errors, errors_omitted = capped(all_errors, "errors")
    warnings, warnings_omitted = capped(all_warnings, "warnings")
    return wire_replies.CheckReply(valid=not all_errors, errors=errors, warnings=warnings,
                                   selected=resolution.selected, errors_omitted=errors_omitted,
                                   warnings_omitted=warnings_omitted, checked=checked,
                                   dynamic=[f"GPU {d.index} ({d.pci}): {DYNAMIC_NOTE}"
                                            for d in sorted(resolution.desired.values(), key=lambda d: d.index)
                                            if d.dynamic])


def status_reply(view: EngineView, *, kubernetes: wire_replies.KubernetesStatus | None = None,
                 status_of: Callable[..., wire_replies.GpuStatus] | None = None) -> wire_replies.StatusReply:
    """What the engine last observed and concluded, never what it intended. `status_of`: gpu_status,
    or one that keeps a GPU's answer while its inputs stay the same."""
    res = view.resolution
    status_of = status_of or gpu_status
    gpus = [status_of(g, res.desired.get(g.pci) if res else None, shown_state(view, g.pci),
                      list(view.vgpus_rebuilt.get(g.pci, ())) or None,
                      [r for r in view.leases if r.gpu == g.pci], view.lease_free.get(g.pci))
            for g in view.observation.gpus]
    gpus += [gone_gpu_status(k, view.gpu_states.get(k.pci)) for k in view.observation.gone]
    gpus.sort(key=lambda g: g.index)
    return wire_replies.StatusReply(phase=view.phase_now, layout=layout_status(view), gpus=gpus, read_only=view.read_only,
                                    version=VERSION, kubernetes=kubernetes, rebuilt_after_boot=view.rebuilt_after_boot,
                                    state_files=list(view.problems))


NO_LAYOUT = GpuState("unmanaged", "no valid layout has been in force since gpud started: left as it is")


def shown_state(view: EngineView, pci: str) -> GpuState | None:
    """The GPU's state as a reply shows it. Before any good layout was taken no pass will look at
    the GPU, so `starting` (a pass is coming) would be a promise nobody keeps: it is left as it is."""
    if (state := view.gpu_states.get(pci)) is not None:
        return state
    return NO_LAYOUT if view.layout is None else None


# ---------------------------------------------------------------------------------------------
# Kubernetes


def kubernetes_status(gpus: Sequence[Gpu], *, mig_strategy: str, agent: AgentStatus | None = None,
                      dra: dict[str, Any] | None = None, ad: Advertised | None = None) -> wire_replies.KubernetesStatus:
    """What the device plugins will advertise from the GPUs as observed (`ad`, when the caller kept
    it for these GPUs); the label protocol's state (None without --kube-node); the DRA driver's (its
    status record, None without --dra)."""
    ad = ad if ad is not None else advertised(gpus, mig_strategy=mig_strategy)
    agent_status = None
    if agent is not None:
        agent_status = wire_replies.KubeAgentStatus(node=agent.node, connected=agent.connected, selected=agent.selected,
                                                    state=agent.state, message=agent.message, paused=list(agent.paused),
                                                    other_agents=list(agent.other_agents),
                                                    workload_config=agent.workload_config, unserved=list(agent.unserved))
    return wire_replies.KubernetesStatus(
        advertised=wire_replies.Advertised(mig_strategy=mig_strategy, resources=ad.resources, sandbox=ad.sandbox,
                                           problems=list(ad.problems)),
        agent=agent_status, dra=msgspec.convert(dra, wire_replies.DraStatus) if dra is not None else None)


def labels_reply(out: LabelsOut) -> wire_replies.LabelsReply:
    """Called in a worker thread (the file is read)."""
    held, refused = None, None
    try:
        held = read_features(out.path) if out.path else None
    except FeaturesRefused as e:
        refused = str(e)
    last = out.last
    return wire_replies.LabelsReply(path=out.path, label_set="all" if out.gfd else "gpud", result=out.last_result,
                                    file=held, file_refused=refused, labels=dict(last.labels) if last else {},
                                    warnings=list(last.warnings) if last else [])


# ---------------------------------------------------------------------------------------------
# plan


# ---------------------------------------------------------------------------------------------
# apply


def apply_reply(view: EngineView, finished: bool) -> wire_replies.ApplyReply:
    states = {g.pci: shown_state(view, g.pci) for g in view.observation.gpus}
    gpus = [wire_replies.GpuApplyInfo(pci=g.pci, state=st.state if (st := states[g.pci]) else "starting",
                                      message=st.message if st else "")
            for g in view.observation.gpus]
    if not finished:
        return wire_replies.ApplyReply(phase="timeout", converged=False, message="timed out waiting for the apply", gpus=gpus)
    not_ok = [g for g in gpus if not (st.converged if (st := states[g.pci]) else False)]
    shown, _ = capped([f"{g.pci}: {g.state}: {g.message}" for g in not_ok], "GPUs not converged", limit=16)
    message = "; ".join(shown) or "converged"
    return wire_replies.ApplyReply(phase=view.phase, converged=not not_ok, message=message, gpus=gpus)


# ---------------------------------------------------------------------------------------------
# mig profiles


def profile_info(gpu: Gpu, profile: MigProfile) -> wire_tables.ProfileInfo:
    """A profile as NVML states it for this GPU; without NVML (the GPU is not on nvidia) no MIG
    instance can exist, so every instance the profile allows is free."""
    instances = gpu.nvml.instances if gpu.nvml is not None else ()
    existing = [gi for gi in instances if gi.profile_id == profile.id]
    used = [gi.placement for gi in instances]
    return wire_tables.ProfileInfo(
        id=profile.id, name=profile.name, memory_mb=profile.memory_mb, sms=profile.sms, slices=profile.slices,
        free=remaining_capacity(profile, used, len(existing)),  # NVML answers this with MIG off too
        total=profile.instance_count, placements=[placement(p) for p in profile.placements],
        ce=profile.copy_engines, dec=profile.decoders, enc=profile.encoders, jpg=profile.jpegs, ofa=profile.ofas,
    )


# gpud.profiles field names -> the ProfileInfo fields that carry them.
_WIRE_FIELD = {"id": "id", "memory_mb": "memory_mb", "sms": "sms", "instance_count": "total",
               "placements": "placements", "copy_engines": "ce", "decoders": "dec", "encoders": "enc",
               "jpegs": "jpg", "ofas": "ofa"}


def table_profile_info(model: ModelInfo, profile: MigProfile) -> wire_tables.ProfileInfo:
    """A row of gpud's table of known models, for a GPU NVML cannot see: what no source gives is
    marked unknown; how many instances are free is unknown too (nothing can count them)."""
    fields = model.unknown_fields(profile.name)
    unknown = [_WIRE_FIELD[f] for f in fields if f in _WIRE_FIELD]
    if "memory_mb" in fields:  # a profile no listing shows: not even its P2P flag is known
        unknown.append("p2p")
    return wire_tables.ProfileInfo(
        id=profile.id, name=profile.name, memory_mb=profile.memory_mb, sms=profile.sms, slices=profile.slices,
        free=0, total=profile.instance_count, placements=[placement(p) for p in profile.placements],
        ce=profile.copy_engines, dec=profile.decoders, enc=profile.encoders, jpg=profile.jpegs, ofa=profile.ofas,
        unknown=["free", *unknown],
    )


def _nvidia_smi_order(profiles: tuple[MigProfile, ...]) -> list[MigProfile]:
    """nvidia-smi's order: by size, then NVML's profile index (1g, 1g+me, 1g double memory, 2g ...)."""
    return sorted(profiles, key=lambda p: (p.slices, GI_PROFILE_INDEX.get(p.id, p.id)))


def mig_profiles_reply(gpus: list[Gpu]) -> wire_tables.MigProfilesReply:
    """NVML's table of each MIG-capable GPU; for a GPU NVML cannot see, gpud's table of its model."""
    reply = wire_tables.MigProfilesReply()
    for g in gpus:
        if g.nvml is not None:
            if g.nvml.mig_capable:
                reply.gpus.append(wire_tables.GpuProfiles(
                    index=g.index, pci=g.pci, model=model_name(g),
                    profiles=[profile_info(g, p) for p in _nvidia_smi_order(g.nvml.profiles)]))
            continue
        model = by_device(g.function.device) if g.function.vendor == NVIDIA else None
        if model is not None and model.mig_capable:
            reply.gpus.append(wire_tables.GpuProfiles(
                index=g.index, pci=g.pci, model=model.name, source="table",
                profiles=[table_profile_info(model, p) for p in _nvidia_smi_order(model.profiles)]))
    return reply


def mig_compute_profiles_reply(gpus: list[Gpu]) -> wire_tables.MigComputeProfilesReply:
    """`nvidia-smi mig -lcip`: for each GPU instance there, its compute-instance profiles with how
    many more of each it can take. NVML answers a GI profile's CI profiles through a live GI, so
    they are the GPU's own (the model's table only where NVML gave none)."""
    reply = wire_tables.MigComputeProfilesReply()
    for g in gpus:
        if g.nvml is None or not g.nvml.instances:
            continue
        by_id = {p.id: p for p in with_model_ci_profiles(g.nvml.profiles, g.function.device)}
        out = wire_tables.GpuComputeProfiles(index=g.index, pci=g.pci, model=model_name(g))
        for gi in sorted(g.nvml.instances, key=lambda i: (i.placement.start, i.id)):
            prof = by_id.get(gi.profile_id)
            if prof is None:
                continue
            rows = [wire_tables.ComputeProfileInfo(
                id=c.id, name=device_name(prof, c.slices), slices=c.slices,
                free=ci_remaining_capacity(c, gi.cis, prof.slices), total=c.instance_count, sms=c.sms,
                default=c.slices == prof.slices, ce=prof.copy_engines, dec=prof.decoders, enc=prof.encoders,
                jpg=prof.jpegs, ofa=prof.ofas) for c in sorted(prof.ci_profiles, key=lambda c: (c.slices, c.id))]
            out.instances.append(wire_tables.GiComputeProfiles(gi=gi.id, profile=prof.name,
                                                                placement=placement(gi.placement), profiles=rows))
        reply.gpus.append(out)
    return reply


# ---------------------------------------------------------------------------------------------
# passthrough


def passthrough_device(entry: PassthroughEntry) -> wire_tables.PassthroughDevice:
    return wire_tables.PassthroughDevice(
        pci=entry.pci, vendor_device=entry.vendor_device, resource_name=entry.resource_name,
        iommu_group=entry.iommu_group, vfio_device=entry.vfio_device, numa_node=entry.numa_node,
        libvirt_hostdev=entry.libvirt_hostdev, kubevirt=kubevirt_entry(entry),
    )


def passthrough_reply(entries: list[PassthroughEntry], gpus: tuple[Gpu, ...] = ()) -> wire_tables.PassthroughReply:
    vgpus = []
    resources = vf_resources((g.function.device, d) for g in gpus for d in (g.vgpu.devices if g.vgpu is not None else ()))
    for g in gpus:
        for d in g.vgpu.devices if g.vgpu is not None else ():
            e = vgpu_entry(g.pci, g.function.device, d, resources)
            vgpus.append(wire_tables.VgpuPassthrough(gpu=e.gpu, type=e.type, driver_name=e.driver_name, uuid=e.uuid, vf=e.vf,
                                                      vfio_device=e.vfio_device, resource_name=e.resource_name,
                                                      libvirt_hostdev=e.libvirt_hostdev, kubevirt=e.kubevirt))
    devices = [passthrough_device(e) for e in entries]
    config = kubevirt_configuration([d.kubevirt for d in devices] + [v.kubevirt for v in vgpus], vgpus=bool(vgpus))
    warnings = kubevirt_warnings(resources, [(e.pci, e.vendor_device, e.resource_name) for e in entries])
    return wire_tables.PassthroughReply(devices=devices, vgpus=vgpus, kubevirt_configuration=config,
                                         kubevirt_warnings=warnings)


# ---------------------------------------------------------------------------------------------
# vgpu types


def vgpu_types_reply(gpus: list[Gpu]) -> wire_tables.VgpuTypesReply:
    """The types each GPU offers (the driver's lists), with how many more fit now; gpud's table
    adds the per-GPU maximum, and lists its types for a GPU whose VFs are not enabled yet."""
    reply = wire_tables.VgpuTypesReply()
    for g in gpus:
        if g.vgpu is None:
            continue
        table = vgpu_model_of(g.function.device)
        offers = {o.type: o for o in g.vgpu.offers}
        names = list(offers) or (table.names() if table is not None else [])
        types = []
        for name in names:
            o = offers.get(name)
            parsed = parse_vgpu_name(name)
            known = table.find(name) if table is not None else None
            types.append(wire_tables.VgpuTypeInfo(
                name=name, id=o.type_id if o is not None else None,
                mig_profile=(known.mig_profile if known is not None else parsed.mig_profile if parsed is not None
                             else None),
                framebuffer_gb=parsed.framebuffer_gb if parsed is not None else 0,
                creatable=o.creatable if o is not None else 0, max=known.max_instances if known else None))
        reply.gpus.append(wire_tables.GpuVgpuTypes(index=g.index, pci=g.pci, model=model_name(g), interface=g.vgpu.interface,
                                                    types=types))
    return reply
