"""The daemon's answers to socket requests: each op maps onto the reconciler's state or its one
apply path, so `gpudctl` never sees anything the engine does not itself act on."""

from __future__ import annotations

import asyncio
from typing import Any

from gpud import VERSION
from gpud.api.server import ApiError
from gpud.api.wire import PROTOCOL
from gpud.engine.reconciler import Reconciler, empty_plan
from gpud.engine.status import build_status, model_name
from gpud.host.nvml import NvmlError
from gpud.model import Gpu, MigProfile, Placement
from gpud.profiles import GI_PROFILE_INDEX


def remaining_capacity(profile: MigProfile, used: list[Placement], existing: int) -> int:
    """NVML's RemainingCapacity: placements of this profile that still fit together, bounded by
    the instances the profile still allows."""
    taken = set().union(*(p.slices for p in used)) if used else set()
    fits = 0
    for pl in profile.placements:
        if not (pl.slices & taken):
            taken |= pl.slices
            fits += 1
    return max(0, min(fits, profile.instance_count - existing))


def select_gpus(gpus: tuple[Gpu, ...], selector: str | None) -> list[Gpu]:
    if not selector:
        return list(gpus)
    sel = selector.lower()
    out = [g for g in gpus if sel in (str(g.index), g.pci, g.pci.removeprefix("0000:"))
           or (g.nvml is not None and g.nvml.uuid.lower() == sel)]
    if not out:
        raise ApiError("not-found", f"no managed GPU matches {selector!r} (index, PCI address or UUID)")
    return out


class RequestHandler:
    def __init__(self, rec: Reconciler, notifier=None, passthrough=None) -> None:
        self.rec = rec
        self.notifier = notifier
        self.passthrough = passthrough  # callable(observation) -> list[dict]

    async def handle(self, op: str, args: dict[str, Any], peer) -> Any:
        fn = getattr(self, "op_" + op.replace("-", "_"), None)
        if fn is None:
            raise ApiError("unknown-op", f"unknown request {op!r}")
        return await fn(**(args or {}))

    def recent_events(self) -> list[dict[str, Any]]:
        return self.rec.bus.recent()

    def subscribe(self) -> asyncio.Queue:
        return self.rec.bus.subscribe()

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self.rec.bus.unsubscribe(q)

    async def op_status(self) -> dict[str, Any]:
        self.rec.refresh()
        return build_status(self.rec)

    async def op_version(self) -> dict[str, Any]:
        try:
            driver, nvml = self.rec.hw.nvml.driver_version(), self.rec.hw.nvml.nvml_version()
        except NvmlError:  # no driver, or closed during a rebind
            driver = nvml = None
        return {"version": VERSION, "driver": driver, "nvml": nvml, "protocol": PROTOCOL}

    async def op_check(self, text: str, path: str | None = None) -> dict[str, Any]:
        parsed, res, _ = self.rec.evaluate(text, path or "layout.yaml")
        return {"valid": not res.errors, "errors": [str(e) for e in res.errors],
                "warnings": [str(w) for w in res.warnings], "selected": res.selected}

    async def op_plan(self, text: str | None = None, path: str | None = None) -> dict[str, Any]:
        if text is None:  # the file in force, against the host as it is now
            observation = self.rec.refresh()
            resolution, errors = self.rec.resolution, list(self.rec.layout_issues[0])
        else:
            _, resolution, observation = self.rec.evaluate(text, path or "layout.yaml")
            errors = []
        if resolution is not None:
            errors += [str(e) for e in resolution.errors if str(e) not in errors]
        if errors or resolution is None:
            return {**empty_plan(), "errors": errors or ["no valid layout in force"]}
        return {**self.rec.plan_all(resolution, observation), "errors": []}

    async def op_apply(self, wait: bool = False, timeout: float | None = None) -> dict[str, Any]:
        self.rec.load_config()
        if self.rec.layout_issues[0]:
            raise ApiError("invalid-layout", "; ".join(self.rec.layout_issues[0]))
        ticket = self.rec.kick("apply requested")
        if not wait:
            return {"phase": "applying", "converged": False, "message": "apply started", "gpus": []}
        finished = await self.rec.wait_for(ticket, timeout)
        return self._apply_reply(finished)

    async def op_reload(self) -> dict[str, Any]:
        """Re-read the file and answer at once; the apply it starts runs on. systemd's ExecReload
        waits for this, and units ordered after gpud (kubelet, dcgm) would deadlock with a reload
        that waited for an apply draining them."""
        if self.notifier is not None:
            self.notifier.reloading()
        try:
            self.rec.reload("reload")
        finally:
            if self.notifier is not None:
                self.notifier.ready()
        return build_status(self.rec)["layout"]

    def _apply_reply(self, finished: bool) -> dict[str, Any]:
        states = self.rec.gpu_states
        gpus = [{"pci": g.pci, "state": states[g.pci].state if g.pci in states else "starting",
                 "message": states[g.pci].message if g.pci in states else ""} for g in self.rec.observation.gpus]
        if not finished:
            return {"phase": "timeout", "converged": False, "message": "timed out waiting for the apply", "gpus": gpus}
        phase = self.rec.phase
        not_ok = [g for g in gpus if not (states[g["pci"]].converged if g["pci"] in states else False)]
        msg = "; ".join(f"{g['pci']}: {g['state']}: {g['message']}" for g in not_ok) or "converged"
        return {"phase": phase, "converged": not not_ok, "message": msg, "gpus": gpus}

    async def op_mig_profiles(self, gpu: str | None = None) -> dict[str, Any]:
        self.rec.refresh()
        out = []
        for g in select_gpus(self.rec.observation.gpus, gpu):
            if g.nvml is None or not g.nvml.mig_capable:
                continue
            rows = []
            for p in sorted(g.nvml.profiles, key=lambda p: (p.slices, GI_PROFILE_INDEX.get(p.id, p.id))):
                # nvidia-smi's order: by size, then NVML's profile index (1g, 1g+me, 1g double memory, 2g ...)
                existing = [gi for gi in g.nvml.instances if gi.profile_id == p.id]
                used = [gi.placement for gi in g.nvml.instances]
                free = remaining_capacity(p, used, len(existing))  # NVML answers this with MIG off too
                rows.append({
                    "id": p.id, "name": p.name, "memory_mb": p.memory_mb, "sms": p.sms, "slices": p.slices,
                    "free": free, "total": p.instance_count,
                    "placements": [{"start": pl.start, "size": pl.size} for pl in p.placements],
                    "ce": p.copy_engines, "dec": p.decoders, "enc": p.encoders, "jpg": p.jpegs, "ofa": p.ofas,
                })
            out.append({"index": g.index, "pci": g.pci, "model": model_name(g), "profiles": rows})
        return {"gpus": out}

    async def op_passthrough(self) -> dict[str, Any]:
        self.rec.refresh()
        devices = self.passthrough(self.rec.observation) if self.passthrough else []
        return {"devices": devices}
