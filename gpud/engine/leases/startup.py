"""At start: every lease record against what NVML shows, so a `kill -9` anywhere in a lease or a
release leaves no orphan instance and no lease booked twice. Runs in a worker thread.

What each record's state says had happened, and what is done about it:
- `intent`: the GI may have been made just before gpud died (its id never written). A GI of the
  record's profile at its placement, claimed by no other record, is that GI: with its CI it is
  adopted (the lease stands, 0 NVML changes); without one it is destroyed (it is idle: no CI).
  No GI: the record goes (0 NVML changes).
- `gi-made`: the GI by its id; with a CI adopted, without one destroyed, gone: the record goes.
- `held`: its GI and CI present: nothing to do (0 NVML changes); missing: `vanished`, reported.
- `releasing`: what is left of it is destroyed (when idle) and the record goes.
Whole-GPU leases hold nothing on NVML: they stand while their GPU is present.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import msgspec

from gpud.engine.leases.executor import ignore_gone
from gpud.engine.leases.records import LeaseBook, LeaseRecord
from gpud.host.nvidia.nvml import Nvml
from gpud.model import GpuInstance, NvmlGpu

Report = Callable[[str, str, str], None]  # (event kind, message, pci)


def reconcile(nvml: Nvml, book: LeaseBook, gpus: dict[str, NvmlGpu],
              devices: Callable[[str, int, int], tuple[str, ...]], report: Report) -> None:
    """Bring `book` and NVML into agreement (see the module docstring); `gpus`: NVML's view of
    every GPU now, by PCI address."""
    claimed = {(r.gpu, r.gi) for r in book.records.values() if r.gi is not None and r.state in ("held", "gi-made")}
    for rec in sorted(book.records.values(), key=lambda r: r.created):
        nv = gpus.get(rec.gpu)
        instances = nv.instances if nv is not None and nv.mig_mode == 1 else ()
        if rec.kind == "gpu":
            if nv is None:
                _vanish(book, rec, "the GPU is no longer seen by NVML", report)
            continue
        if rec.state == "vanished":
            continue
        if rec.state == "held":
            gi = next((g for g in instances if g.id == rec.gi and g.placement == rec.placement), None)
            if gi is None or not any(c.id == rec.ci for c in gi.cis):
                _vanish(book, rec, f"GI {rec.gi} / CI {rec.ci} at {_at(rec)} is no longer on the GPU", report)
            continue
        if rec.state in ("intent", "gi-made"):
            gi = _its_gi(rec, instances, claimed)
            if gi is None:
                book.drop(rec.id)
                report("lease-dropped", f"lease {rec.id} ({rec.profile}) dropped: gpud stopped before its GPU "
                                        "instance was made; nothing was left on the GPU", rec.gpu)
            elif gi.cis:
                ci = sorted(gi.cis, key=lambda c: c.id)[0]
                book.put(msgspec.structs.replace(rec, state="held", gi=gi.id, ci=ci.id, uuid=ci.uuid,
                                                 devices=devices(rec.gpu, gi.id, ci.id)))
                report("lease-adopted", f"lease {rec.id} ({rec.profile} at {_at(rec)}, {ci.uuid}) adopted: "
                                        "gpud made it before it stopped", rec.gpu)
            else:
                gi_id = gi.id
                ignore_gone(functools.partial(nvml.destroy_gpu_instance, rec.gpu, gi_id))
                book.drop(rec.id)
                report("lease-dropped", f"lease {rec.id} ({rec.profile}) rolled back: gpud stopped before its "
                                        f"compute instance was made; its idle GPU instance {gi.id} was destroyed",
                       rec.gpu)
            continue
        # releasing
        gi = next((g for g in instances if g.id == rec.gi and g.placement == rec.placement), None)
        if gi is not None and any(c.holders for c in gi.cis):
            report("lease-waiting", f"lease {rec.id} was being released when gpud stopped; its instance is busy",
                   rec.gpu)
            continue
        if gi is not None:
            gi_id = gi.id
            for ci_id in [c.id for c in gi.cis]:
                ignore_gone(functools.partial(nvml.destroy_compute_instance, rec.gpu, gi_id, ci_id))
            ignore_gone(functools.partial(nvml.destroy_gpu_instance, rec.gpu, gi_id))
        book.drop(rec.id)
        report("lease-released", f"lease {rec.id} ({rec.profile}) released: its release was interrupted "
                                 "when gpud stopped and is now complete", rec.gpu)


def _its_gi(rec: LeaseRecord, instances: tuple[GpuInstance, ...], claimed: set) -> GpuInstance | None:
    if rec.gi is not None:
        return next((g for g in instances if g.id == rec.gi and g.placement == rec.placement), None)
    return next((g for g in instances if g.profile_id == rec.gi_profile_id and g.placement == rec.placement
                 and (rec.gpu, g.id) not in claimed), None)


def _vanish(book: LeaseBook, rec: LeaseRecord, why: str, report: Report) -> None:
    book.put(msgspec.structs.replace(rec, state="vanished", note=why))
    report("lease-vanished", f"lease {rec.id} ({rec.profile}, owner {rec.owner or '-'}) vanished: {why}", rec.gpu)


def _at(rec: LeaseRecord) -> str:
    return f"{rec.placement.start}:{rec.placement.size}" if rec.placement is not None else "-"
