"""gpudctl's tables in nvidia-smi's shapes, so people and their scripts read familiar ones: `list`
(nvidia-smi -L), `mig profiles` (mig -lgip, -lgipp), `mig gpu-instances` (mig -lgi), `mig
compute-profiles` (mig -lcip), `mig compute-instances` (mig -lci). Pure, like gpud.cli.render."""

from __future__ import annotations

from gpud.cli.render import table

TYPE_CHECKING = False
if TYPE_CHECKING:  # the structs the replies are read as (gpud.cli.view)
    from gpud.wire import replies as wire_replies
    from gpud.wire import tables as wire_tables


def render_mig_profiles(r: wire_tables.MigProfilesReply) -> str:
    """`nvidia-smi mig -lgip` followed by `nvidia-smi mig -lgipp`. A GPU NVML cannot see is listed
    from gpud's table of its model, after a note saying so; a value that table has no source for
    is printed as `?`."""
    bar = "+" + "-" * 79 + "+"
    out = [bar,
           "| GPU instance profiles:".ljust(80) + "|",
           "| GPU   Name               ID    Instances   Memory     P2P    SM    DEC   ENC  |",
           "|                                Free/Total   GiB              CE    JPEG  OFA  |",
           "|" + "=" * 79 + "|"]
    for g in r.gpus:
        for p in g.profiles:
            def shown(field: str, value: object, unknown: list[str] = p.unknown) -> str:
                return "?" if field in unknown else str(value)
            mem = shown("memory_mb", f"{p.memory_mb / 1024:.2f}")
            first = (f"|{g.index:>4}  {'MIG ' + p.name:<18}{shown('id', p.id):>4}{shown('free', p.free):>6}/"
                     f"{shown('total', p.total):<9}{mem:<11}{shown('p2p', 'Yes' if p.p2p else 'No'):<7}{shown('sms', p.sms):<7}"
                     f"{shown('dec', p.dec):<6}{shown('enc', p.enc):<4}")
            out.append(first.ljust(80) + "|")
            out.append(f"|{'':<63}{shown('ce', p.ce):<6}{shown('jpg', p.jpg):<6}{shown('ofa', p.ofa):<4}".ljust(80) + "|")
            out.append(bar)
    if not any(g.profiles for g in r.gpus):
        out.append("| No MIG-capable GPU found".ljust(80) + "|")
        out.append(bar)
    for g in r.gpus:
        if g.source != "nvml":
            out.append(f"GPU {g.index:>2} {g.pci} {g.model}: gpud's known table for this model, not read from NVML "
                       "(NVML cannot see it on its current driver; sources: docs/hardware/mig-profiles.md; "
                       "? where no source gives the value)")
    for g in r.gpus:
        for p in g.profiles:
            pid = "?" if "id" in p.unknown else p.id
            if "placements" in p.unknown:
                out.append(f"GPU {g.index:>2} Profile ID {pid:>2} Placements: unknown")
                continue
            size = p.placements[0].size if p.placements else 0
            starts = ",".join(str(pl.start) for pl in p.placements)
            word = "Placements:" if len(p.placements) > 1 else "Placement :"
            out.append(f"GPU {g.index:>2} Profile ID {pid:>2} {word} {{{starts}}}:{size}")
    return "\n".join(out)


def render_list(r: wire_replies.StatusReply) -> str:
    """`nvidia-smi -L`: every managed GPU with its UUID (also one NVML no longer sees: the UUID
    gpud last read for it, or "unknown"), then its MIG devices in placement order."""
    out = []
    for g in sorted(r.gpus, key=lambda x: x.index):
        where = f"{g.driver}" if g.driver and g.driver != "nvidia" else ""
        state = "gone" if g.state == "gone" else where
        out.append(f"GPU {g.index}: {g.model or g.pci_id} (UUID: {g.uuid or 'unknown'})"
                   + (f" [{g.pci}, {state}]" if state else f" [{g.pci}]"))
        devices = [i for i in sorted(g.mig.instances, key=lambda i: (i.placement.start, i.gi, i.ci or 0))
                   if i.ci is not None]
        for n, inst in enumerate(devices):
            out.append(f"  MIG {inst.profile:<12} Device {n:>2}: (UUID: {inst.uuid or '-'})")
    return "\n".join(out) if out else "no GPUs managed"


def _gi_profile(profile: str) -> str:
    """The GPU instance profile of an instance row: `1c.3g.40gb` is a CI of a `3g.40gb` GI."""
    head, _, rest = profile.partition(".")
    return rest if head.endswith("c") and head[:-1].isdigit() else profile


def render_gpu_instances(gpus: list[wire_replies.GpuStatus]) -> str:
    """`nvidia-smi mig -lgi`: GPU instances, one row each, with their placements."""
    rows = [["GPU", "GI", "PROFILE", "PLACEMENT", "COMPUTE INSTANCES"]]
    for g in gpus:
        by_gi: dict[int, list[wire_replies.InstanceStatus]] = {}
        for inst in g.mig.instances:
            by_gi.setdefault(inst.gi, []).append(inst)
        for gi, insts in sorted(by_gi.items(), key=lambda kv: kv[1][0].placement.start):
            cis = sum(1 for i in insts if i.ci is not None)
            rows.append([str(g.index), str(gi), _gi_profile(insts[0].profile),
                         f"{insts[0].placement.start}:{insts[0].placement.size}", str(cis)])
    return table(rows) if len(rows) > 1 else "no GPU instances"


def render_compute_profiles(r: wire_tables.MigComputeProfilesReply) -> str:
    """`nvidia-smi mig -lcip`: the compute-instance profiles of each GPU instance, with how many
    more of each it can take; `*` after the id marks the default (the CI covering the whole GI),
    as nvidia-smi marks it. Shared engines are the GI's, which its compute instances share."""
    rows = [["GPU", "GI", "NAME", "ID", "FREE/TOTAL", "SM", "CE", "DEC", "ENC", "JPEG", "OFA"]]
    for g in r.gpus:
        for gi in g.instances:
            for p in gi.profiles:
                rows.append([str(g.index), str(gi.gi), f"MIG {p.name}", f"{p.id}{'*' if p.default else ''}",
                             f"{p.free}/{p.total}", str(p.sms), str(p.ce), str(p.dec), str(p.enc), str(p.jpg),
                             str(p.ofa)])
    return table(rows) if len(rows) > 1 else "no GPU instances (compute instance profiles are listed per GPU instance)"


def render_compute_instances(gpus: list[wire_replies.GpuStatus]) -> str:
    """`nvidia-smi mig -lci`: compute instances with their GPU instance and slot in it."""
    rows = [["GPU", "GI", "CI", "PROFILE", "GI PLACEMENT", "CI PLACEMENT", "UUID"]]
    for g in gpus:
        for inst in sorted(g.mig.instances, key=lambda i: (i.placement.start, i.gi, i.ci or 0)):
            if inst.ci is None:
                continue
            cp = inst.ci_placement
            rows.append([str(g.index), str(inst.gi), str(inst.ci), inst.profile,
                         f"{inst.placement.start}:{inst.placement.size}", f"{cp.start}:{cp.size}" if cp else "-",
                         inst.uuid or "-"])
    return table(rows) if len(rows) > 1 else "no compute instances"
