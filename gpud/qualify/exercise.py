"""`gpud qualify --mutate GPU`: every hardware path gpud uses, once, on one idle GPU, each result
compared with what gpud predicts, and the GPU put back as it was.

The paths are gpud's own: MIG mode through the planner and the MIG executor (its reset included),
GPU instances at every placement NVML offers and compute instances through the NVML adapter, the
driver binding to vfio-pci and back through the binding planner and the binder. The prediction for
each is what gpud's planner expects, or for placements gpud's table of the model (the simulator's
source): on the simulator the two must agree, on a real GPU a difference is the finding. A GPU that
is busy (processes on it), not idle (GPU instances, a pending mode change) or not on nvidia is
refused before anything changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpud import profiles as model_tables
from gpud.engine.binding import binder
from gpud.engine.mig import executor as mig_executor
from gpud.engine.observe.discovery import observe
from gpud.engine.observe.holders import device_holders
from gpud.hardware import Hardware
from gpud.host.nvidia.gpu_reset import ResetResult
from gpud.layout.desired import DesiredGpu
from gpud.layout.schema import MatchRule
from gpud.model import Gpu, Holder, MigProfile, NvmlGpu, Placement
from gpud.pci import normalize_pci
from gpud.plan.binding import plan_binding
from gpud.plan.mig import full_ci, plan_gpu
from gpud.qualify.report import Check

SLICES = 8  # memory slices of every MIG GPU gpud knows (placements are in these units)


class _Abort(Exception):
    """A result differed from the prediction: stop exercising, restore what can be restored."""


class _Exercise:
    def __init__(self, hw: Hardware, gpu: Gpu, match: Sequence[MatchRule], unbind_timeout: float) -> None:
        self.hw = hw
        self.pci = gpu.pci
        self.index = gpu.index
        self.match = match
        self.unbind_timeout = unbind_timeout
        self.group = f"exercise GPU {gpu.index} {gpu.pci}"
        self.checks: list[Check] = []

    # ---- reading and recording
    def gpu(self) -> Gpu:
        found = next((g for g in observe(self.hw.sysfs, self.hw.nvml, self.match).gpus if g.pci == self.pci), None)
        if found is None:
            raise _Abort(f"{self.pci} left the PCI bus")
        return found

    def nvml_gpu(self) -> NvmlGpu:
        g = self.gpu().nvml
        if g is None:
            raise _Abort(f"NVML does not see {self.pci}")
        return g

    def record(self, name: str, expected: str, observed: str, action: str = "") -> None:
        ok = expected == observed
        self.checks.append(Check(self.group, name, "ok" if ok else "fail",
                                 observed if ok else "differs from gpud's prediction",
                                 action if not ok else "", expected=expected, observed=observed))
        if not ok:
            raise _Abort(f"{name}: expected {expected}, observed {observed}")

    def device_holders(self, pci: str) -> list[Holder]:
        return device_holders(self.hw.procs, pci)

    # ---- MIG through the planner and the executor
    def apply_mig(self, name: str, enabled: bool, devices: dict[str, int]) -> None:
        gpu = self.gpu()
        plan = plan_gpu(gpu, DesiredGpu(self.pci, self.index, "qualify", mig_enabled=enabled, mig_devices=devices))
        if plan.infeasible:
            self.checks.append(Check(self.group, name, "fail", f"gpud's planner: {plan.infeasible}"))
            raise _Abort(plan.infeasible)
        before = {ci.uuid for gi in (gpu.nvml.instances if gpu.nvml else ()) for ci in gi.cis}
        outcome = mig_executor.execute(self.hw.nvml, plan, holders=self.device_holders)
        if outcome.reset_due:  # a pending mode to settle: the reset a pass makes, then the rest of the plan
            result = self.reset_gpu()
            if not result.ok:
                self.checks.append(Check(self.group, name, "fail", f"reset refused: {result.summary()}"))
                raise _Abort(result.summary())
            plan = plan_gpu(self.gpu(), DesiredGpu(self.pci, self.index, "qualify", mig_enabled=enabled,
                                                   mig_devices=devices))
            outcome = mig_executor.execute(self.hw.nvml, plan, holders=self.device_holders)
        n = self.nvml_gpu()
        want = ("on " + _layout_text(sorted((t.placement, t.profile, len(t.ci_profile_ids)) for t in plan.target or ()))
                if enabled else "off, no instances")
        have = _observed_text(n)
        kept = sorted(u for u in plan.kept)
        still = sorted(u for u in kept if u in {ci.uuid for gi in n.instances for ci in gi.cis})
        self.record(name, f"{want}; {len(plan.steps)} steps converged; kept {len(kept)} of {len(before)}",
                    f"{have}; {outcome.done} steps {outcome.state}; kept {len(still)} of {len(before)}"
                    + ("" if outcome.state == "converged" else f" ({outcome.message})"),
                    "gpud's MIG executor did not reach its plan on this GPU")

    # ---- every placement, through the NVML adapter
    def placements(self, profile: MigProfile, table: MigProfile | None) -> None:
        nvml = self.hw.nvml
        predicted = table.placements if table is not None else profile.placements
        accepted = []
        for pl in profile.placements:
            gi_id = nvml.create_gpu_instance(self.pci, profile.id, pl.start)
            n = self.nvml_gpu()
            got = [(g.profile_id, g.placement) for g in n.instances]
            if got != [(profile.id, pl)]:
                self.record(f"{profile.name} at {pl.start}:{pl.size}", f"one GI {profile.id} at {pl.start}:{pl.size}",
                            f"{got}")
            ci_profile = full_ci(_with_table_cis(profile, table))
            ci_id = nvml.create_compute_instance(self.pci, gi_id, ci_profile.id)
            n = self.nvml_gpu()
            cis = [(c.id, c.profile_id, bool(c.uuid)) for g in n.instances for c in g.cis]
            if cis != [(ci_id, ci_profile.id, True)]:
                self.record(f"{profile.name} CI at {pl.start}:{pl.size}",
                            f"one CI of profile {ci_profile.id} with a MIG UUID", f"{cis}")
            nvml.destroy_compute_instance(self.pci, gi_id, ci_id)
            nvml.destroy_gpu_instance(self.pci, gi_id)
            if self.nvml_gpu().instances:
                self.record(f"{profile.name} destroy", "no instances", _observed_text(self.nvml_gpu()))
            accepted.append(pl)
        refused = self.refused_starts(profile)
        self.record(f"{profile.name} placements",
                    f"created, CI made, destroyed at {_starts(predicted)}; refused elsewhere",
                    f"created, CI made, destroyed at {_starts(tuple(accepted))}; "
                    + ("refused elsewhere" if not refused else f"also accepted at {', '.join(refused)}"),
                    "gpud's table of this model does not match the GPU: report it with this output")

    def refused_starts(self, profile: MigProfile) -> list[str]:
        """A start NVML does not list must be refused (the hardware decides, not gpud's table)."""
        size = profile.placements[0].size if profile.placements else 0
        allowed = {p.start for p in profile.placements}
        wrong = []
        for start in range(0, SLICES - size + 1):
            if start in allowed:
                continue
            try:
                gi_id = self.hw.nvml.create_gpu_instance(self.pci, profile.id, start)
            except Exception:  # noqa: BLE001 - a refusal is the expected answer, whatever its code
                continue
            wrong.append(f"{start}:{size}")
            self.hw.nvml.destroy_gpu_instance(self.pci, gi_id)
            break
        return wrong

    # ---- reset and binding
    def reset_gpu(self) -> ResetResult:
        """gpud's reset, as a pass makes it (gpud.host.nvidia.gpu_reset): gpud's own NVML session closed,
        `nvidia-smi -r -i <PCI>` for a GPU on nvidia (sysfs otherwise), NVML opened again."""
        resetter = self.hw.reset
        assert resetter is not None  # gpud.hardware gives every host one, with the sysfs deadline
        self.hw.nvml.suspend()
        try:
            return resetter.reset(self.pci, self.gpu().function.driver)
        finally:
            self.hw.nvml.resume()

    def reset(self) -> None:
        """A reset through gpud's reset path, the one a pass takes to settle a pending mode."""
        before = self.nvml_gpu()
        method = "nvidia-smi" if self.gpu().function.driver == "nvidia" else "sysfs"  # gpud's rule
        result = self.reset_gpu()
        after = self.nvml_gpu()
        self.record("reset", f"done ({method}); back on nvidia, {before.uuid}, MIG {before.mig_mode}",
                    f"{'done' if result.ok else 'refused'} ({result.method}); back on "
                    f"{self.gpu().function.driver}, {after.uuid}, MIG {after.mig_mode}"
                    + ("" if result.ok else f" ({result.summary()})"),
                    "the GPU did not come back as it was after a reset")

    def bind(self, workload: str, name: str) -> None:
        gpu = self.gpu()
        plan = plan_binding(gpu, workload, drivers=set(self.hw.sysfs.drivers()))
        if plan.infeasible:
            self.checks.append(Check(self.group, name, "fail", f"gpud's binding planner: {plan.infeasible}"))
            raise _Abort(plan.infeasible)
        outcome = binder.execute(self.hw.sysfs, self.hw.procs, plan, before_unbind=self.hw.nvml.close,
                                 timeout=self.unbind_timeout)
        if workload != "vm-passthrough":
            self.hw.nvml.open()  # enumeration happens at init: the returned GPU is seen by a new session
        fns = {f.address: f for f in self.hw.sysfs.functions()}
        target = "vfio-pci" if workload == "vm-passthrough" else (plan.native_driver or "native")
        drivers = ", ".join(f"{a} {fns[a].driver if a in fns else 'gone'}" for a in plan.endpoints)
        want = ", ".join(f"{a} {'vfio-pci' if workload == 'vm-passthrough' else (target if a == self.pci else '*')}"
                         for a in plan.endpoints)
        have = drivers if workload == "vm-passthrough" else ", ".join(
            f"{a} {(fns[a].driver if a == self.pci else '*') if a in fns else 'gone'}" for a in plan.endpoints)
        node = self.hw.sysfs.vfio_device_path(gpu.function.iommu_group) if gpu.function.iommu_group is not None else None
        want_node = workload == "vm-passthrough"
        self.record(name, f"{want}; /dev/vfio node {'present' if want_node else 'gone'}; converged",
                    f"{have}; /dev/vfio node {'present' if node else 'gone'}; {outcome.state}"
                    + ("" if outcome.state == "converged" else f" ({outcome.message})"),
                    "gpud's binder did not reach its plan on this GPU")


def _with_table_cis(profile: MigProfile, table: MigProfile | None) -> MigProfile:
    if profile.ci_profiles or table is None:
        return profile
    from msgspec.structs import replace

    return replace(profile, ci_profiles=table.ci_profiles)


def _starts(placements: tuple[Placement, ...]) -> str:
    return ",".join(f"{p.start}:{p.size}" for p in sorted(placements))


def _layout_text(items: list[tuple[Placement, str, int]]) -> str:
    if not items:
        return "no instances"
    return ", ".join(f"{name}@{pl.start}:{pl.size}x{cis}ci" for pl, name, cis in items)


def _observed_text(n: NvmlGpu) -> str:
    if n.mig_mode != 1:
        return "off, no instances" if not n.instances else f"off with {len(n.instances)} instances"
    names = {p.id: p.name for p in n.profiles}
    return "on " + _layout_text(sorted((g.placement, names.get(g.profile_id, str(g.profile_id)), len(g.cis))
                                       for g in n.instances))


def select(gpus: tuple[Gpu, ...], ref: str) -> Gpu | None:
    pci = normalize_pci(ref)
    for g in gpus:
        if (ref.isdigit() and g.index == int(ref)) or g.pci == pci or (g.nvml is not None and g.nvml.uuid == ref):
            return g
    return None


def _refusal(gpu: Gpu, holders: Callable[[str], list[Holder]]) -> str | None:
    if gpu.function.driver != "nvidia":
        return f"it is on {gpu.function.driver or 'no driver'}; start it on nvidia (the exercise binds it away and back)"
    n = gpu.nvml
    if n is None:
        return "NVML does not see it"
    busy = sorted(set(holders(gpu.pci)) | set(n.processes) | {h for gi in n.instances for h in gi.holders})
    if busy:
        return "busy: " + ", ".join(f"pid {h.pid} {h.name} on {h.device}" for h in busy)
    if n.instances:
        return f"not idle: {len(n.instances)} GPU instance(s) exist; the exercise would destroy them"
    if n.mig_capable and n.mig_pending != n.mig_mode:
        return f"not idle: MIG mode {n.mig_mode} with {n.mig_pending} pending"
    return None


def exercise(hw: Hardware, ref: str, *, match: Sequence[MatchRule], unbind_timeout: float = 30.0) -> list[Check]:
    gpus = observe(hw.sysfs, hw.nvml, match).gpus
    gpu = select(gpus, ref)
    if gpu is None:
        known = ", ".join(f"{g.index} {g.pci}" for g in gpus) or "none"
        return [Check("exercise", "GPU", "fail", f"no managed GPU {ref!r} (GPUs: {known})", "nothing was changed")]
    run = _Exercise(hw, gpu, match, unbind_timeout)
    why = _refusal(gpu, run.device_holders)
    if why:
        return [Check(run.group, "refused", "fail", f"{gpu.pci}: {why}", "nothing was changed")]
    nv = gpu.nvml
    assert nv is not None  # _refusal refuses a GPU NVML does not see
    start_mode = nv.mig_mode
    model = model_tables.by_device(gpu.function.device)
    table = {p.id: p for p in model.profiles} if model is not None else {}
    try:
        if nv.mig_capable:
            run.apply_mig("MIG on", True, {})
            n = run.nvml_gpu()
            for profile in sorted(n.profiles, key=lambda p: (p.slices, p.id)):
                run.placements(profile, table.get(profile.id))
            small = min((p for p in n.profiles if p.slices == 1 and "+" not in p.name),
                        key=lambda p: p.memory_mb, default=None)
            half = next((p for p in n.profiles if p.slices == 3 and "+" not in p.name), None)
            if small is not None:
                run.apply_mig(f"layout {small.instance_count} x {small.name}", True, {small.name: small.instance_count})
                if half is not None:
                    rest = small.instance_count - 3 if small.instance_count == 7 else 0
                    layout = {half.name: 1, **({small.name: rest} if rest else {})}
                    run.apply_mig("layout " + " + ".join(f"{c} x {k}" for k, c in layout.items()) + " (survivors kept)",
                                  True, layout)
            run.apply_mig("MIG off", False, {})
        else:
            run.checks.append(Check(run.group, "MIG", "ok", "not MIG capable: MIG paths skipped"))
        run.reset()
        run.bind("vm-passthrough", "to vfio-pci")
        run.bind("container", "back to nvidia")
    except _Abort as e:
        run.checks.append(Check(run.group, "stopped", "fail", str(e), "the GPU is being restored to its start"))
    except Exception as e:  # noqa: BLE001 - an adapter's refusal: report it, then restore
        run.checks.append(Check(run.group, "stopped", "fail", f"{type(e).__name__}: {e}",
                                "the GPU is being restored to its start"))
    run.checks.append(_restore(run, start_mode))
    return run.checks


def _restore(run: _Exercise, start_mode: int | None) -> Check:
    try:
        gpu = run.gpu()
        if gpu.function.driver != "nvidia":
            run.bind("container", "restore driver")
        n = run.nvml_gpu()
        if n.mig_capable and (n.instances or n.mig_mode != start_mode or n.mig_pending != start_mode):
            run.apply_mig("restore MIG mode", bool(start_mode), {})
        n = run.nvml_gpu()
        state = f"nvidia, MIG {n.mig_mode} (pending {n.mig_pending}), {len(n.instances)} instances"
        want = f"nvidia, MIG {start_mode} (pending {start_mode}), 0 instances"
        return Check(run.group, "restored", "ok" if state == want else "fail", state,
                     "" if state == want else "restore the GPU by hand", expected=want, observed=state)
    except Exception as e:  # noqa: BLE001
        return Check(run.group, "restored", "fail", f"could not restore: {type(e).__name__}: {e}",
                     "restore the GPU by hand (nvidia-smi -mig, driver binding)")
