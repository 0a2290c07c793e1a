"""gpudctl's rendering: a reply struct in, text for a person out. Pure: no socket, no printing.

The tables follow nvidia-smi's where one exists (`mig profiles` is `nvidia-smi mig -lgip` and
`-lgipp`), so people and their scripts read familiar shapes.
"""

from __future__ import annotations

import time

TYPE_CHECKING = False
if TYPE_CHECKING:  # the structs the replies are read as (gpud.cli.view): for mypy, not imported at run time
    from typing import Any

    from gpud.wire import protocol as wire
    from gpud.wire import replies as wire_replies


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in rows
    )


def _holder(h: wire_replies.HolderInfo, *, device: bool = False) -> str:
    text = f"pid {h.pid} {h.name}"
    if h.vm:
        text += f" (VM {h.vm})"
    return f"{text} ({h.device})" if device and h.device else text


def _placement(p: wire_replies.Placement | None) -> str:
    return f"{{{p.start}}}:{p.size}" if p is not None else ""


def _profile_order(name: str) -> tuple[int, str]:
    head = name.split(".", 1)[0].rstrip("cg")
    return (int(head) if head.isdigit() else 99, name)


def mig_column(m: wire_replies.MigStatus) -> str:
    if not m.capable or m.mode is None:  # not capable, or not visible to NVML (e.g. on vfio-pci)
        return "-"
    words = {"enabled": "on", "disabled": "off"}
    if m.pending and m.pending != m.mode:
        return f"pending({words.get(m.pending, '?')})"  # takes effect at the next GPU reset
    return words.get(m.mode, "?")


def _instances_column(g: wire_replies.GpuStatus) -> str:
    """MIG devices (`4x1g.10gb 1x3g.40gb`), or a vm-vgpu GPU's vGPUs (`4xL40S-12Q`)."""
    if g.vgpu is not None and g.vgpu.devices:
        vcounts: dict[str, int] = {}
        for d in g.vgpu.devices:
            vcounts[d.type] = vcounts.get(d.type, 0) + 1
        return " ".join(f"{n}x{t}" for t, n in sorted(vcounts.items()))
    counts: dict[str, int] = {}
    for inst in g.mig.instances:
        counts[inst.profile] = counts.get(inst.profile, 0) + 1
    if not counts:
        return "-"
    return " ".join(f"{counts[p]}x{p}" for p in sorted(counts, key=_profile_order))


def state_column(g: wire_replies.GpuStatus) -> str:
    holders = g.holders or [h for i in g.mig.instances for h in i.holders] or \
        [h for d in (g.vgpu.devices if g.vgpu is not None else []) for h in d.holders]
    if g.state in ("waiting", "stuck") and holders:
        more = f" (+{len(holders) - 1} more)" if len(holders) > 1 else ""
        return f"{g.state}: {_holder(holders[0])}{more}"
    if g.state == "converged":  # the other columns already say what it converged to
        return g.state
    if g.message.startswith(g.state):  # "waiting for ...", "pending: 3 steps": the word once
        return g.message
    return f"{g.state}: {g.message}" if g.message else g.state


ELLIPSIS = "\u2026"
MIN_STATE = 20  # the STATE column never shrinks below this, however narrow the terminal


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + ELLIPSIS


def _status_rows(gpus: list[wire_replies.GpuStatus], width: int | None) -> list[list[str]]:
    """The table's rows; with `width`, made to fit it, each step only when the last did not: the
    PCI domain left out when every GPU is in domain 0000, "NVIDIA " left out of the models, the
    MODEL column left out (`gpudctl status GPU` has it), then INSTANCES and STATE cut with an
    ellipsis (STATE never below MIN_STATE)."""
    one_domain = all(g.pci.startswith("0000:") for g in gpus)

    def rows_with(short_pci: bool, model: str) -> list[list[str]]:
        head = ["GPU", "PCI", "MODEL", "DRIVER", "WORKLOAD", "MIG", "INSTANCES", "STATE"]
        rows = [head if model != "none" else head[:2] + head[3:]]
        for g in gpus:
            name = (g.model or "-").removeprefix("NVIDIA ") if model == "short" else g.model or "-"
            row = [str(g.index), g.pci[5:] if short_pci else g.pci, name, g.driver or "-", g.workload,
                   mig_column(g.mig), _instances_column(g), state_column(g)]
            rows.append(row if model != "none" else row[:2] + row[3:])
        return rows

    def left_of(rows: list[list[str]], upto: int) -> int:
        return sum(max(len(row[i]) for row in rows) + 2 for i in range(upto))

    if width is None:
        return rows_with(False, "full")
    for short_pci, model in ((False, "full"), (one_domain, "full"), (one_domain, "short"), (one_domain, "none")):
        rows = rows_with(short_pci, model)
        if left_of(rows, len(rows[0]) - 1) + MIN_STATE <= width:
            break
    n = len(rows[0])  # INSTANCES is n-2, STATE n-1
    room_instances = max(len("INSTANCES"), width - MIN_STATE - left_of(rows, n - 2) - 2)
    rows = [row[:n - 2] + [_fit(row[n - 2], room_instances), row[n - 1]] for row in rows]
    room = max(MIN_STATE, width - left_of(rows, n - 1))
    return [row[:-1] + [_fit(row[-1], room)] for row in rows]


def render_status(r: wire_replies.StatusReply, width: int | None = None) -> str:
    """The status table; with `width` (the terminal's columns) the STATE column is cut, with an
    ellipsis, so that rows do not wrap: `gpudctl status GPU` and `--json` carry whole messages."""
    gone = [g for g in r.gpus if g.state == "gone"]
    phase = r.phase
    if gone:  # the pass converged what is there; the top line must not hide a GPU that left
        phase += f", {len(gone)} GPU{'s' if len(gone) > 1 else ''} gone ({', '.join(str(g.index) for g in gone)})"
    head = f"gpud {r.version}: {phase}" if r.version else f"gpud: {phase}"
    out = [head + ("  [read-only]" if r.read_only and r.phase != "read-only" else "")]
    if r.gpus:
        out += ["", table(_status_rows(r.gpus, width))]
    else:
        out += ["", "no GPUs managed"]
    lay = r.layout
    validity = "valid" if lay.valid else "INVALID"
    selected = (f"selected: {lay.selected}{' (gpudctl select)' if lay.chosen else ''}" if lay.selected
                else "no layout selected")
    out += ["", f"layout: {lay.path}  {selected}  {validity}"]
    out += [f"  error: {e}" for e in lay.errors]
    out += [f"  warning: {w}" for w in lay.warnings]
    if r.rebuilt_after_boot:
        out += ["", r.rebuilt_after_boot]
    out += [f"state file: {m}" for m in r.state_files]
    migs = [g for g in r.gpus if g.mig.instances]
    if migs:
        out += ["", "MIG devices:"]
        for g in migs:
            out.append(f"GPU {g.index}: {g.model or g.pci} (UUID: {g.uuid or '-'})")
            insts = sorted(g.mig.instances, key=lambda i: (i.placement.start, i.gi, i.ci))
            for n, inst in enumerate(insts):
                out.append(f"  MIG {inst.profile:<12} Device {n:>2}: (UUID: {inst.uuid})")
    leased = [lease for g in r.gpus for lease in g.leases]
    if leased:
        out += ["", "Leases (MIG on demand):", render_leases(leased)]
    vgpus = [g for g in r.gpus if g.vgpu is not None and (g.vgpu.devices or g.vgpu.rebuilt)]
    if vgpus:
        out += ["", "vGPUs:"]
        for g in vgpus:
            v = g.vgpu
            assert v is not None  # chosen above for it
            out.append(f"GPU {g.index}: {g.model or g.pci} ({v.interface}, {v.vfs} VFs)")
            for d in v.devices:
                where = f"mdev {d.uuid} on {d.parent}" if d.uuid else f"VF {d.vf}"
                gi = f" GI {d.gi}" if d.gi is not None else ""
                held = ("  held by " + ", ".join(_holder(h) for h in d.holders)) if d.holders else ""
                out.append(f"  {d.type:<14} {where}{gi}{held}")
            if v.rebuilt:
                out.append(f"  rebuilt from gpud's record: {', '.join(v.rebuilt)}")
    return "\n".join(out)


def render_lease(lease: wire_replies.LeaseInfo) -> str:
    """What `gpudctl lease` prints: the id to release, and what a job puts in its environment."""
    where = f"GPU {lease.index} " if lease.index is not None else ""
    at = f" at {lease.placement}" if lease.placement else ""
    lines = [f"lease {lease.id}: {lease.profile}{at} on {where}{lease.gpu}",
             f"  CUDA_VISIBLE_DEVICES={lease.uuid or '-'}"]
    if lease.devices:
        lines.append(f"  devices: {' '.join(lease.devices)}")
    return "\n".join(lines)


def render_leases(leases: list[wire_replies.LeaseInfo], now: float | None = None) -> str:
    """The lease table (`gpudctl leases`, the status section): age from `created`, as of `now`."""
    if not leases:
        return "no leases"
    now = time.time() if now is None else now
    rows = [["ID", "GPU", "PROFILE", "PLACEMENT", "UUID", "OWNER", "PID", "AGE", "STATE"]]
    for x in leases:
        rows.append([x.id, str(x.index) if x.index is not None else x.gpu, x.profile, x.placement or "-",
                     x.uuid or "-", x.owner or f"uid {x.uid}", str(x.pid) if x.pid is not None else "-",
                     _age(max(0.0, now - x.created)), x.state + (f" ({x.note})" if x.note else "")])
    return table(rows)


def _age(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 86400}d{s % 86400 // 3600}h" if s >= 86400 else f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 \
        else f"{s // 60}m{s % 60:02d}s"


def _describe_step(s: wire_replies.StepInfo) -> str:
    """One step, single-spaced: the action, then what it acts on, each named once. A MIG step reads
    as the daemon's events name it (gpud.mig_text.step_text)."""
    from gpud.mig_text import MIG_ACTIONS, step_text  # the MIG words: a plan's, not every run's

    if s.action in MIG_ACTIONS:
        text = step_text(s)
    elif s.action == "load-module":
        text = f"load-module {s.module or s.driver}"
    else:
        parts = [s.action]
        if s.pci:
            parts.append(s.pci)
        if s.driver:
            word = {"bind": "to ", "set-override": "to ", "unbind": "from "}.get(s.action, "")
            parts.append(word + s.driver)
        if s.module and s.module != s.driver:
            parts.append(s.module)
        if s.group is not None:
            parts.append(f"/dev/vfio/{s.group}")
        if s.type:
            parts.append(s.type)
        if s.vf:
            parts.append(f"VF {s.vf}")
        if s.count is not None:
            parts.append(f"{s.count} VFs")
        if s.uuid:
            parts.append(s.uuid)
        text = " ".join(parts)
    return f"{text} ({s.message})" if s.message else text


def _steps_summary(steps: list[wire_replies.StepInfo]) -> str:
    """One line before a GPU's numbered steps: how many, of which kinds, in the order they run."""
    kinds: dict[str, int] = {}
    for s in steps:
        kinds[s.action] = kinds.get(s.action, 0) + 1
    return f"{len(steps)} step{'s' if len(steps) != 1 else ''} (" + ", ".join(
        f"{k} x{n}" if n > 1 else k for k, n in kinds.items()) + ")"


def render_plan(r: wire_replies.PlanReply) -> str:
    if r.errors:  # an invalid file has no plan: a GPU list or "disruption: none" would mislead
        return "\n".join([f"error: {e}" for e in r.errors] + [f"warning: {w}" for w in r.warnings])
    out: list[str] = []
    for g in r.gpus:
        if g.infeasible:
            out.append(f"GPU {g.index} {g.pci}: INFEASIBLE: {g.infeasible}")
        elif not g.steps:
            out.append(f"GPU {g.index} {g.pci}: nothing to do")
        else:
            out.append(f"GPU {g.index} {g.pci}: {_steps_summary(g.steps)}")
        out += [f"  {n}. {_describe_step(s)}" for n, s in enumerate(g.steps, 1)]
        if g.dynamic:
            out.append(f"  {g.dynamic}")
        if g.blocked_by:
            out.append("  blocked by: " + ", ".join(_holder(h, device=True) for h in g.blocked_by))
    if not r.gpus:
        out.append("no GPUs managed")
    d = r.disruption
    if d.destroyed or d.mode_changes or d.resets or d.rebinds or d.vgpus_removed or d.vfs_disabled:
        out += ["", "disruption:"]
        for b in d.rebinds:
            target = "vfio-pci" if b.to == "vfio-pci" else "its native driver"
            left = ", ".join(f"{pci} leaves {drv}" for pci, drv in b.detached.items())
            out.append(f"  rebinds {b.pci} and its IOMMU group to {target}: {left}")
            if b.leaves_nvml:
                mig = f"; {b.mig_instances} MIG instance(s) go with it" if b.mig_instances else ""
                out.append(f"    the GPU disappears from NVML, containers and monitoring{mig}")
            if b.vfio_group is not None:
                out.append(f"    a VM using /dev/vfio/{b.vfio_group} loses the device")
            if b.holders:
                out.append("    held by " + ", ".join(_holder(h, device=True) for h in b.holders)
                           + " (gpud waits for them, never kills)")
        for v in d.vgpus_removed:
            held = (" held by " + ", ".join(_holder(h) for h in v.holders)) if v.holders else ""
            out.append(f"  removes vGPU {v.type} {v.uuid or 'VF ' + (v.vf or '?')} on {v.pci}{held}")
        if d.vfs_disabled:
            out.append("  SR-IOV VFs disabled: " + ", ".join(d.vfs_disabled))
        for x in d.destroyed:
            held = (" held by " + ", ".join(_holder(h) for h in x.holders)) if x.holders else ""
            uuid = f" {x.uuid}" if x.uuid else ""
            out.append(f"  destroys {x.profile} {_placement(x.placement)} on {x.pci}{uuid}{held}")
        if d.mode_changes:
            out.append("  MIG mode changes: " + ", ".join(d.mode_changes))
        if d.resets:
            out.append("  GPU resets: " + ", ".join(d.resets))
        if d.reset_with:
            out.append("  NVSwitch system: a reset takes these GPUs with it: " + ", ".join(d.reset_with))
    else:
        out += ["", "disruption: none"]
    out += [f"warning: {w}" for w in r.warnings]
    return "\n".join(out)


def pick_gpu(r: wire_replies.StatusReply, selector: str) -> wire_replies.GpuStatus | None:
    """A GPU by index, PCI address (full or without the domain) or UUID, as the daemon selects."""
    sel = selector.strip().lower()
    for g in r.gpus:
        if sel == str(g.index) or sel in (g.pci.lower(), g.pci.lower().removeprefix("0000:")) \
                or (g.uuid and sel == g.uuid.lower()):
            return g
    return None


def render_gpu(g: wire_replies.GpuStatus) -> str:
    """`gpudctl status GPU`: everything status knows about one GPU, messages whole."""
    from gpud.mig_text import subdivided  # the MIG words: this view's, not every run's

    out = [f"GPU {g.index}  {g.pci}  {g.model or '-'}",
           f"  uuid:        {g.uuid or '- (not visible to NVML)'}",
           f"  pci id:      {g.pci_id or '-'}",
           f"  driver:      {g.driver or '-'}",
           f"  workload:    {g.workload}",
           f"  iommu group: {'-' if g.iommu_group is None else g.iommu_group}"
           f"   numa node: {'-' if g.numa_node is None else g.numa_node}",
           f"  state:       {g.state}"]
    if g.message:
        out.append(f"  message:     {g.message}")
    if g.holders:
        out.append("  holders:     " + ", ".join(_holder(h, device=True) for h in g.holders))
    mode = mig_column(g.mig)
    out.append(f"  MIG:         {'capable' if g.mig.capable else 'not capable'}" + (f", {mode}" if mode != "-" else ""))
    for inst in sorted(g.mig.instances, key=lambda i: (i.placement.start, i.gi, i.ci or 0)):
        held = (" held by " + ", ".join(_holder(h) for h in inst.holders)) if inst.holders else ""
        ci = f" ci {inst.ci}" if inst.ci is not None else ""
        if inst.ci_placement is not None and subdivided(inst.profile):
            ci += f" at compute {inst.ci_placement.start}:{inst.ci_placement.size}"
        out.append(f"    {inst.profile:<12} {_placement(inst.placement):<6} gi {inst.gi}{ci}  {inst.uuid or '-'}{held}")
    v = g.vgpu
    if v is not None:
        vfs = f", {v.vfs} VFs" if v.vfs else ""
        out.append(f"  vGPU:        {v.interface or 'no interface yet'}{vfs}; {len(v.devices)} vGPU(s)")
        for d in sorted(v.devices, key=lambda d: (d.type, d.vf or "", d.uuid or "")):
            held = (" held by " + ", ".join(_holder(h) for h in d.holders)) if d.holders else ""
            where = f"VF {d.vf}" if d.vf else f"mdev {d.uuid}"
            gi = f" gi {d.gi}" if d.gi is not None else ""
            out.append(f"    {d.type:<14} {where}{gi}{held}")
        if v.rebuilt:
            out.append("  rebuilt:     " + ", ".join(v.rebuilt))
    for m in g.group:
        if m.pci != g.pci:
            out.append(f"  group:       {m.pci} {m.class_} on {m.driver or 'no driver'}")
    if g.vfio_device:
        out.append(f"  vfio:        {g.vfio_device}")
    return "\n".join(out)


def render_progress(e: wire.Event, totals: dict[str, int], done: dict[str, int]) -> str | None:
    """On a terminal, `apply --wait` shows one progress line per GPU step: `[3/7]`. `totals` and
    `done` are per-GPU counters this function keeps up to date."""
    if e.gpu is None:
        return None
    if e.kind == "applying" and isinstance(e.data.get("steps"), int):
        totals[e.gpu], done[e.gpu] = e.data["steps"], 0
        return None
    if e.kind not in ("step", "vgpu"):  # a MIG or binding step, or one vGPU created or removed
        return None
    done[e.gpu] = done.get(e.gpu, 0) + 1
    total = totals.get(e.gpu)
    count = f"{done[e.gpu]}/{total}" if total else str(done[e.gpu])
    return f"  GPU {e.gpu} [{count}] {e.message}"


def render_kubernetes(k: wire_replies.KubernetesStatus | None) -> str:
    """What the device plugins will advertise, and the label protocol's state on this node."""
    if k is None:
        return "gpud did not say what Kubernetes will advertise (an older gpud)"
    ad = k.advertised
    out = [f"Kubernetes will advertise (k8s-device-plugin, mig-strategy={ad.mig_strategy}):"]
    out += [f"  {name}: {n}" for name, n in ad.resources.items()] or ["  nothing (no GPU on nvidia)"]
    if ad.sandbox:
        out += ["KubeVirt passthrough (kubevirt-gpu-device-plugin):"]
        out += [f"  {name}: {n}" for name, n in ad.sandbox.items()]
    out += [f"problem: {p}" for p in ad.problems]
    a = k.agent
    if a is not None:
        state = f"{a.state}" + (f": {a.message}" if a.message else "") if a.state else "-"
        # not connected: the API server's own answer when it gave one (a 403 names the missing verb)
        api = "API server connected" if a.connected else (
            a.message if a.message.startswith("Kubernetes API:") else "API server NOT REACHABLE")
        out += ["", f"node {a.node}: {api}",
                f"  layout selected by label: {a.selected or '- (the file chooses)'}",
                f"  mig.config.state: {state}"]
        if a.paused:
            out += [f"  paused: {', '.join(a.paused)}"]
        if a.workload_config:
            out += [f"  gpu.workload.config: {a.workload_config}"]
        out += [f"  not served: {u}" for u in a.unserved]
        if a.other_agents:
            out += [f"  the operator's GPU agents on this node (gpud changes no GPU until they leave): "
                    f"{', '.join(a.other_agents)}"]
    d = k.dra
    if d is not None:
        reg = {True: "registered with the kubelet", False: "kubelet REFUSED the registration",
               None: "not registered yet (the kubelet has not called)"}[d.registered]
        out += ["", f"DRA driver {d.driver} on node {d.node}: {reg}",
                f"  published: {d.devices} device(s) in {d.slices} slice(s), pool generation {d.generation}"]
        out += [f"  prepared: {c.claim} ({c.uid}): {', '.join(c.devices)}"
                + (f" (leases {', '.join(c.leases)})" if c.leases else "") for c in d.claims] or ["  prepared: none"]
        gone = " (the API server drops taints: withdrawn instead)" if d.taints_dropped else ""
        out += [f"  unhealthy: GPU {x.pci}: Xid {x.xid}, its devices tainted {d.driver}/xid={x.xid}:{x.effect}"
                + (gone if x.effect == "NoSchedule" else "") + (f" ({x.text})" if x.text else "") for x in d.xids]
    return "\n".join(out)


def render_labels(r: wire_replies.LabelsReply) -> str:
    if r.path is None:
        return "gpud writes no node labels"
    if r.file_refused is not None:
        head = f"{r.path}: not shown: {r.file_refused}"
        return "\n".join([head, "labels gpud would write:", *[f"{k}={v}" for k, v in r.labels.items()]])
    if r.file is None:
        head = f"{r.path}: no file ({r.result or 'not written yet'})"
        return "\n".join([head, "labels gpud would write:", *[f"{k}={v}" for k, v in r.labels.items()]])
    out = [f"# {r.path} ({r.label_set} labels; last write: {r.result or '-'})"]
    out += [f"{k}={v}" for k, v in sorted(r.file.items())]
    if r.file != r.labels:
        out += ["# differs from what gpud computes now (the next pass writes it)"]
    out += [f"# left out: {w}" for w in r.warnings]
    return "\n".join(out)


def render_event(e: wire.Event) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(e.time))
    where = f" {e.gpu}" if e.gpu else ""
    return f"{stamp} {e.kind}{where}: {e.message}"


def event_json(e: wire.Event) -> str:
    """One event per line for `events --json`: compact, so a follower can read it line by line."""
    return json_text(e, compact=True)


def to_json(obj: Any) -> str:
    """What `--json` prints: the reply with every field, indented."""
    return json_text(obj)


def json_text(obj: Any, *, compact: bool = False) -> str:
    """`obj` (a reply as gpud sent it, gpud.cli.view; or a wire struct) as JSON: UTF-8 as it is,
    the fields in the struct's order. What msgspec.json printed, without importing msgspec for it:
    the same document, numbers in Python's spelling (1e-05 where msgspec wrote 0.00001), and a
    number that is not finite (which JSON cannot hold) as null, as msgspec wrote it."""
    import json

    spacing = {"separators": (",", ":")} if compact else {"indent": 2}
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, default=_builtins, **spacing)
    except ValueError:  # NaN or an infinity somewhere: null, as msgspec.json writes it
        return json.dumps(_finite(obj), ensure_ascii=False, default=_builtins, **spacing)


def _builtins(obj: Any) -> Any:
    """A wire struct (a reply built in this process, as tests render them) as
    msgspec gives it to JSON: a map of every field by its wire name."""
    import msgspec

    return msgspec.to_builtins(obj)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if obj - obj == 0 else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return _finite(_builtins(obj)) if hasattr(obj, "__struct_fields__") else obj


# ---------------------------------------------------------------------------------------------
# nvidia-smi's listings from a status reply: `-L`, `mig -lgi`, `mig -lci`


