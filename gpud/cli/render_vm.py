"""gpudctl's views for virtual machines: the vGPU types a GPU offers (`vgpu types`) and the devices
bound for passthrough with libvirt's and KubeVirt's configuration (`passthrough`). Pure, like
gpud.cli.render."""

from __future__ import annotations

from gpud.cli.render import json_text, table

TYPE_CHECKING = False
if TYPE_CHECKING:  # the structs the replies are read as (gpud.cli.view)
    from gpud.wire import tables as wire_tables


def render_vgpu_types(r: wire_tables.VgpuTypesReply) -> str:
    """`gpudctl vgpu types`: the mig-profiles sibling: each type a GPU offers, how many still fit."""
    if not r.gpus:
        return "no GPU shows a vGPU interface"
    out = []
    for g in r.gpus:
        out.append(f"GPU {g.index} {g.pci} {g.model} ({g.interface})")
        rows = [["TYPE", "ID", "FB GB", "MIG PROFILE", "CREATABLE", "MAX"]]
        for t in g.types:
            rows.append([t.name, "-" if t.id is None else str(t.id), str(t.framebuffer_gb), t.mig_profile or "-",
                         str(t.creatable), "-" if t.max is None else str(t.max)])
        out += ["  " + line for line in table(rows).splitlines()]
    return "\n".join(out)


def render_passthrough(r: wire_tables.PassthroughReply) -> str:
    if not r.devices and not r.vgpus:
        return "no GPU is bound for passthrough, and no vGPU exists"
    if not r.devices:
        return _render_vgpus(r)
    rows = [["PCI", "ID", "IOMMU", "VFIO", "NUMA", "RESOURCE"]]
    for d in r.devices:
        rows.append([d.pci, d.vendor_device, "-" if d.iommu_group is None else str(d.iommu_group),
                     d.vfio_device or "-", "-" if d.numa_node is None else str(d.numa_node),
                     d.resource_name or "-"])
    out = [table(rows)]
    for d in r.devices:
        if d.libvirt_hostdev:
            out += ["", f"libvirt <hostdev> for {d.pci}:"]
            out += ["  " + line for line in d.libvirt_hostdev.strip().splitlines()]
    if r.vgpus:
        out += ["", _render_vgpus(r, kubevirt=False)]
    return "\n".join(out + _kubevirt_section(r))


def _render_vgpus(r: wire_tables.PassthroughReply, *, kubevirt: bool = True) -> str:
    rows = [["GPU", "TYPE", "MDEV UUID / VF", "VFIO", "RESOURCE"]]
    for v in r.vgpus:
        rows.append([v.gpu, v.type, v.uuid or v.vf or "-", v.vfio_device or "-", v.resource_name])
    out = [table(rows)]
    for v in r.vgpus:
        out += ["", f"libvirt <hostdev> for {v.type} {v.uuid or v.vf}:", "  " + v.libvirt_hostdev]
    return "\n".join(out + (_kubevirt_section(r) if kubevirt else []))


def _kubevirt_section(r: wire_tables.PassthroughReply) -> list[str]:
    """The KubeVirt CR's spec.configuration as the daemon computed it (gpud.engine.binding
    .passthrough.kubevirt_configuration): permittedHostDevices with one entry per resource (eight
    GPUs or 32 VFs of one model are one entry), and where gpud makes vGPUs the switch that keeps
    virt-handler from making or removing mdevs itself."""
    cfg = r.kubevirt_configuration
    out: list[str] = []
    if "mediatedDevicesConfiguration" in cfg:
        out += ["", "KubeVirt spec.configuration.mediatedDevicesConfiguration (gpud makes the vGPUs; KubeVirt >= 1.8, "
                "older: the feature gate DisableMDEVConfiguration):",
                "  " + json_text(cfg["mediatedDevicesConfiguration"], compact=True)]
    permitted = cfg.get("permittedHostDevices") or {}
    if permitted:
        out += ["", "KubeVirt permittedHostDevices (spec.configuration.permittedHostDevices):"]
        for kind in sorted(permitted):
            out.append(f"  {kind}:")
            out += ["    - " + json_text(e, compact=True) for e in permitted[kind]]
    out += [f"warning: {w}" for w in r.kubevirt_warnings]
    return out
