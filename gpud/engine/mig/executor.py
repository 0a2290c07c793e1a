"""Runs a GpuPlan's MIG steps through the NVML adapter, checking the GPU's answer after every step.

Why re-read after each call: NVML's return code is not the whole truth (SetMigMode succeeds while
the mode stays pending; a timed-out create may have created). The executor therefore judges every
step by the state NVML reports afterwards, and treats a failed call whose effect is nevertheless
visible as done, which also makes retries safe. That re-read is of the GPU's layout only (mode,
instances, placements) unless what comes next needs more: MIG UUIDs and holders are read before a
CI is destroyed or the GPU reset, and after a call that failed (who holds it).

Before touching an instance it checks that it is still the one the plan saw (same id, placement and
MIG UUID): ids are reused, and destroying a newcomer would break someone's job.

Error handling (NVML return codes):
- 10 NVML_ERROR_TIMEOUT and 999 NVML_ERROR_UNKNOWN are retried `retries` times with exponential
  backoff (the driver answers these under load or while a previous MIG operation settles);
- 19 NVML_ERROR_IN_USE means a process started after planning: the outcome is "waiting" with the
  holders now seen, so the caller's on-busy policy applies as if the plan had been blocked. An
  IN_USE with no identifiable holder (NVML lists no process on the GPU or its MIG devices, and no
  process has its device node open) has nobody to wait for: nothing would ever wake a wait on it.
  It is retried with backoff for a bounded time (`in_use_window_s` of sleeping) and then "failed"
  with the reason;
- everything else (INSUFFICIENT_RESOURCES, NOT_SUPPORTED, NO_PERMISSION, GPU_IS_LOST ...) is final:
  "failed", naming the NVML function, the code and its message.

A mode change that stays pending is settled by resetting that GPU alone (policy reset: per-gpu)
when nothing holds it: the run stops with `reset_due` and the caller resets the GPU (NVML closed,
`nvidia-smi -r`), then plans the rest again. Holders make it "waiting" (the caller's on-busy
policy applies); policy reset: never makes it "reset-required". The create steps, which need MIG
on, are not attempted before the reset.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from msgspec import Struct, field

from gpud.engine.gpu_state import GpuStateName
from gpud.host.readonly import ReadOnlyError
from gpud.model import GpuInstance, Holder, NvmlGpu, Placement
from gpud.plan.mig import GpuPlan, Step

NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IN_USE = 19
NVML_ERROR_UNKNOWN = 999
TRANSIENT = frozenset({NVML_ERROR_TIMEOUT, NVML_ERROR_UNKNOWN})

T = TypeVar("T")


class MigNvml(Protocol):
    """What the executor asks of NVML (gpud.host.nvidia.nvml.Nvml on a host, the simulator's library
    behind the same class in tests): read one GPU, change its mode, create and destroy instances.
    Failures raise an exception with an int `code` (NVML's return code) and a `function` name."""

    def gpu(self, pci: str, *, details: bool = True) -> NvmlGpu | None: ...

    def set_mig_mode(self, pci: str, enabled: bool) -> int: ...

    def create_gpu_instance(self, pci: str, profile_id: int, start: int) -> int: ...

    def create_compute_instance(self, pci: str, gi_id: int, ci_profile_id: int, start: int | None = None) -> int: ...

    def destroy_compute_instance(self, pci: str, gi_id: int, ci_id: int) -> None: ...

    def destroy_gpu_instance(self, pci: str, gi_id: int) -> None: ...


class Outcome(Struct, frozen=True):
    state: GpuStateName  # converged | waiting | failed | reset-required | reboot-required
    message: str
    holders: list[Holder] = field(default_factory=list)
    done: int = 0  # steps completed
    reset_due: bool = False  # the run stopped for a reset of this GPU, which the caller carries out


class _Stop(Exception):
    def __init__(self, state: GpuStateName, message: str, holders: Sequence[Holder] = (),
                 reset_due: bool = False) -> None:
        super().__init__(message)
        self.outcome = (state, message, sorted(set(holders)))
        self.reset_due = reset_due


class _NobodyHolds(Exception):
    """IN_USE, and no process can be named: retried for a bounded time, then `final`."""

    def __init__(self, final: _Stop) -> None:
        super().__init__(str(final))
        self.final = final


class _Retry(Exception):
    """A transient failure inside one attempt: try again, or end with `final` when no tries are left."""

    def __init__(self, final: _Stop) -> None:
        super().__init__(str(final))
        self.final = final


def _code(e: BaseException) -> int | None:
    code = getattr(e, "code", None)
    return code if isinstance(code, int) else None


def _gi_holders(gi: GpuInstance | None) -> list[Holder]:
    return list(gi.holders) if gi is not None else []


def _all_holders(g: NvmlGpu) -> list[Holder]:
    return list(g.processes) + [h for gi in g.instances for h in gi.holders]


def _layout(g: NvmlGpu) -> list[tuple[Placement, int, tuple[int, ...]]]:
    return sorted((gi.placement, gi.profile_id, tuple(sorted(c.profile_id for c in gi.cis))) for gi in g.instances)


class _Run:
    def __init__(self, nvml: MigNvml, plan: GpuPlan, policy_reset: str, retries: int,
                 sleep: Callable[[float], None], backoff_s: float,
                 holders: Callable[[str], Sequence[Holder]] | None, in_use_window_s: float) -> None:
        self.nvml, self.plan, self.pci = nvml, plan, plan.pci
        self.in_use_window_s = in_use_window_s
        self.policy_reset, self.retries = policy_reset, retries
        self.sleep, self.backoff_s, self.holders = sleep, backoff_s, holders
        self.details_next = True  # whether the read after the current step must carry UUIDs and holders

    # ---- reading ------------------------------------------------------------------------------
    def with_retries(self, attempt: Callable[[], T]) -> T:
        """The one retry loop: `attempt` runs up to `retries + 1` times with exponential backoff
        between tries. An attempt that raises _Retry is tried again while tries remain; after the
        last one the outcome it carries is final."""
        for n in range(self.retries + 1):
            try:
                return attempt()
            except _Retry as again:
                if n == self.retries:
                    raise again.final from again.__cause__
                self.sleep(self.backoff_s * 2**n)
        raise AssertionError("unreachable")

    def read(self, details: bool = True) -> NvmlGpu:
        """The GPU as NVML sees it now (`details=False`: its layout only, see gpud.host.nvidia.nvml.Nvml.gpu);
        transient errors and a briefly missing GPU (just reset) are retried."""
        def attempt() -> NvmlGpu:
            try:
                g = self.nvml.gpu(self.pci) if details else self.nvml.gpu(self.pci, details=False)
            except ReadOnlyError as e:
                raise _Stop("failed", str(e)) from e
            except Exception as e:
                code = _code(e)
                if code is None:
                    raise
                stop = _Stop("failed", f"reading {self.pci}: {_describe(e)}")
                raise (_Retry(stop) if code in TRANSIENT else stop) from e
            if g is None:
                raise _Retry(_Stop("failed", f"{self.pci} is no longer visible to NVML"))
            return g

        return self.with_retries(attempt)

    # ---- one NVML call, judged by the state after it ---------------------------------------------
    def call(self, what: str, fn: Callable[[], object], done: Callable[[NvmlGpu], bool],
             busy: Callable[[NvmlGpu], list[Holder]] = lambda g: []) -> NvmlGpu:
        def attempt() -> NvmlGpu:
            try:
                fn()
            except ReadOnlyError as e:
                raise _Stop("failed", f"{what}: {e}") from e
            except Exception as e:
                code = _code(e)
                if code is None:
                    raise
                g = self.read()
                if done(g):  # the call did its work before reporting the error
                    return g
                if code == NVML_ERROR_IN_USE:
                    hs = busy(g) or _all_holders(g) or list(self.holders(self.pci) if self.holders else ())
                    if not hs:
                        raise _NobodyHolds(_Stop("failed", f"{what}: {_describe(e)}, but no process holds "
                                                           f"{self.pci} or its MIG devices")) from e
                    raise _Stop("waiting", f"{what}: in use ({_describe(e)})", hs) from e
                stop = _Stop("failed", f"{what}: {_describe(e)}")
                raise (_Retry(stop) if code in TRANSIENT else stop) from e
            g = self.read(self.details_next)
            if done(g):
                return g
            raise _Stop("failed", f"{what}: NVML reported success but the GPU does not show the change")

        return self.while_nobody_holds(lambda: self.with_retries(attempt))

    def while_nobody_holds(self, attempt: Callable[[], T]) -> T:
        """Retry an IN_USE nobody can be named for: backoff doubling from `backoff_s` up to 2 s,
        until `in_use_window_s` of sleeping has passed; then the failure, saying how long it tried."""
        slept, tries = 0.0, 0
        while True:
            tries += 1
            try:
                return attempt()
            except _NobodyHolds as nobody:
                if slept >= self.in_use_window_s:
                    state, message, hs = nobody.final.outcome
                    raise _Stop(state, f"{message}; still in use after {tries} tries over {slept:.1f} s, "
                                       "so it is not waited for", hs) from nobody.__cause__
                delay = min(self.backoff_s * 2 ** (tries - 1), 2.0, self.in_use_window_s - slept)
                self.sleep(delay)
                slept += delay

    # ---- steps --------------------------------------------------------------------------------
    def find_gi(self, g: NvmlGpu, step: Step) -> GpuInstance | None:
        return next((gi for gi in g.instances
                     if gi.placement == step.placement and gi.profile_id == step.profile_id), None)

    def step(self, step: Step, g: NvmlGpu) -> NvmlGpu:
        a = step.action
        if a == "destroy-ci":
            return self.destroy_ci(step, g)
        if a == "destroy-gi":
            return self.destroy_gi(step, g)
        if a == "set-mig-mode":
            return self.set_mode(step)
        if a == "reset":
            return self.reset(g, want=None)
        if a in ("create-gi", "create-ci"):
            if g.mig_mode != 1:
                if g.mig_pending == 1:
                    raise _Stop("reset-required", f"MIG mode is still pending on {self.pci}; "
                                                  f"a GPU reset is needed before instances can be created")
                raise _Stop("failed", f"{a} on {self.pci}: MIG mode is off")
            return self.create_gi(step, g) if a == "create-gi" else self.create_ci(step, g)
        raise _Stop("failed", f"unknown step {a!r}")

    def destroy_ci(self, step: Step, g: NvmlGpu) -> NvmlGpu:
        what = f"destroy CI {step.ci} ({step.profile}) of GI {step.gi} on {self.pci}"
        gi = next((x for x in g.instances if x.id == step.gi), None)
        ci = next((c for c in gi.cis if c.id == step.ci), None) if gi else None
        if gi is None or ci is None:
            return g  # already gone
        if gi.placement != step.placement or (step.uuid and ci.uuid != step.uuid):
            raise _Stop("failed", f"{what}: it is no longer the instance planned ({ci.uuid} at "
                                  f"{gi.placement.start}); the GPU changed since planning")
        if ci.holders:
            raise _Stop("waiting", f"{what}: {ci.uuid} is in use", ci.holders)

        def gone(g2: NvmlGpu) -> bool:
            gi2 = next((x for x in g2.instances if x.id == step.gi), None)
            return gi2 is None or all(c.id != step.ci for c in gi2.cis)

        gi_id, ci_id = gi.id, ci.id  # found by the step's ids, so equal to them
        return self.call(what, lambda: self.nvml.destroy_compute_instance(self.pci, gi_id, ci_id), gone,
                         lambda g2: _gi_holders(next((x for x in g2.instances if x.id == step.gi), None)))

    def destroy_gi(self, step: Step, g: NvmlGpu) -> NvmlGpu:
        at = step.placement.start if step.placement else "?"
        what = f"destroy GI {step.gi} ({step.profile} at {at}) on {self.pci}"
        gi = next((x for x in g.instances if x.id == step.gi), None)
        if gi is None:
            return g
        if gi.placement != step.placement or gi.profile_id != step.profile_id:
            raise _Stop("failed", f"{what}: GI {gi.id} is now {gi.profile_id} at {gi.placement.start}; "
                                  f"the GPU changed since planning")
        if gi.cis:
            now = next((x for x in self.read().instances if x.id == step.gi), gi)  # with UUIDs and holders
            raise _Stop("failed", f"{what}: it has compute instances the plan did not expect "
                                  f"({', '.join(c.uuid or f'CI {c.id}' for c in now.cis)})", now.holders)
        gi_id = gi.id
        return self.call(what, lambda: self.nvml.destroy_gpu_instance(self.pci, gi_id),
                         lambda g2: all(x.id != step.gi for x in g2.instances))

    def create_gi(self, step: Step, g: NvmlGpu) -> NvmlGpu:
        assert step.placement is not None and step.profile_id is not None
        what = f"create GI {step.profile} at {step.placement.start} on {self.pci}"
        if self.find_gi(g, step) is not None:
            return g  # a retry of an earlier pass
        profile_id, start = step.profile_id, step.placement.start
        return self.call(what, lambda: self.nvml.create_gpu_instance(self.pci, profile_id, start),
                         lambda g2: self.find_gi(g2, step) is not None)

    def create_ci(self, step: Step, g: NvmlGpu) -> NvmlGpu:
        assert step.ci_profile_id is not None  # gpud.plan.mig sets it on every create-ci
        ci_profile_id = step.ci_profile_id
        what = f"create CI {step.profile} in the GI at {step.placement.start if step.placement else '?'} on {self.pci}"
        gi = self.find_gi(g, step)
        if gi is None or (step.gi is not None and gi.id != step.gi):
            raise _Stop("failed", f"{what}: the GI is not there; the GPU changed since planning")
        start = step.ci_placement.start if step.ci_placement is not None else None
        if start is not None:
            what += f" at compute slice {start}"
            if any(c.profile_id == step.ci_profile_id and c.start == start for c in gi.cis):
                return g  # a retry of an earlier pass
        before = sum(c.profile_id == step.ci_profile_id for c in gi.cis)

        def made(g2: NvmlGpu) -> bool:
            # The GI is found again by placement and profile, never by an id assumed from them.
            gi2 = self.find_gi(g2, step)
            if gi2 is None:
                return False
            if start is not None:
                return any(c.profile_id == step.ci_profile_id and c.start == start for c in gi2.cis)
            return sum(c.profile_id == step.ci_profile_id for c in gi2.cis) > before

        if start is None:
            return self.call(what, lambda: self.nvml.create_compute_instance(self.pci, gi.id, ci_profile_id),
                             made)
        return self.call(what, lambda: self.nvml.create_compute_instance(self.pci, gi.id, ci_profile_id, start),
                         made)

    def set_mode(self, step: Step) -> NvmlGpu:
        want = 1 if step.enabled else 0
        what = f"set MIG mode {'on' if want else 'off'} on {self.pci}"
        status: list[int] = []

        def call() -> None:
            status.append(self.nvml.set_mig_mode(self.pci, bool(want)))

        # Done when the mode in effect after the next reset is the wanted one: a current mode that
        # matches while the opposite is pending would be undone by that reset.
        g = self.call(what, call, lambda g2: g2.mig_pending == want)
        if g.mig_mode == want:
            return g
        note = f" (activation status {status[-1]})" if status and status[-1] else ""
        return self.reset(g, want, f"MIG mode {'on' if want else 'off'} is pending on {self.pci}{note}")

    def reset(self, g: NvmlGpu, want: int | None, why: str = "") -> NvmlGpu:
        """Stop here for a reset of this GPU only (never its neighbours: mig-parted #357), when
        policy and holders allow. The reset itself is not done here: it needs gpud's NVML session
        closed, which only the caller can do once no other GPU's NVML work runs (see
        StepRunner.reset); the steps after it are planned again from what the GPU then shows."""
        why = why or f"a reset of {self.pci} was planned"
        if self.policy_reset != "per-gpu":
            raise _Stop("reset-required", f"{why}; policy reset is {self.policy_reset!r}, so the reset is left to you")
        busy = _all_holders(g) + list(self.holders(self.pci) if self.holders else ())
        if busy:
            names = ", ".join(f"pid {h.pid} {h.name}" for h in sorted(set(busy)))
            raise _Stop("waiting", f"{why}; the reset waits for {names}", busy)
        raise _Stop("reset-required", f"{why}; a reset of {self.pci} is due", reset_due=True)

    def verify(self, g: NvmlGpu) -> None:
        """The end state is the plan's target, not just 'no call failed'."""
        if self.plan.mig_enabled is None:
            return
        want = 1 if self.plan.mig_enabled else 0
        if g.mig_mode != want:
            raise _Stop("failed", f"after the steps MIG mode on {self.pci} is {g.mig_mode}, wanted {want}")
        if want and self.plan.target is not None:
            target = sorted((t.placement, t.profile_id, tuple(sorted(t.ci_profile_ids))) for t in self.plan.target)
            have = _layout(g)
            if have != target:
                raise _Stop("failed", f"after the steps {self.pci} shows {_fmt(have)}, the plan wanted {_fmt(target)}")
            for t in self.plan.target:
                gi = next(x for x in g.instances if x.placement == t.placement and x.profile_id == t.profile_id)
                placed = tuple(sorted((c.profile_id, c.start) for c in gi.cis))
                if t.ci_placements and all(c.start is not None for c in gi.cis) and placed != t.ci_placements:
                    raise _Stop("failed", f"after the steps the CIs of the GI at {t.placement.start} on {self.pci} "
                                          f"sit at {list(placed)}, the plan wanted {list(t.ci_placements)}")


# Steps whose checks before the call look at MIG UUIDs and holders: the read before them carries them.
_NEEDS_DETAILS = frozenset({"destroy-ci", "reset"})


def _fmt(layout: list[tuple[Placement, int, tuple[int, ...]]]) -> str:
    if not layout:
        return "no instances"
    return "[" + ", ".join(f"{pid}@{pl.start}{list(cis)}" for pl, pid, cis in layout) + "]"


def _describe(e: BaseException) -> str:
    fn = getattr(e, "function", None)
    msg = getattr(e, "message", None) or str(e)
    return f"{fn + ' ' if fn else ''}failed with NVML error {_code(e)}: {msg}"


def execute(
    nvml: MigNvml,
    plan: GpuPlan,
    *,
    policy_reset: str = "per-gpu",
    on_step: Callable[..., None] | None = None,
    retries: int = 3,
    sleep: Callable[[float], None] = time.sleep,
    backoff_s: float = 0.2,
    holders: Callable[[str], Sequence[Holder]] | None = None,
    in_use_window_s: float = 15.0,
) -> Outcome:
    """Run `plan` on its GPU through `nvml`.
    `on_step(step, result)` is called after each step ("done") and on the step that stops the run.
    `holders(pci)` may add device-node holders (from /proc) to what blocks a reset."""
    if plan.infeasible:
        return Outcome("failed", plan.infeasible)
    if plan.blocked_by:
        names = ", ".join(f"pid {h.pid} {h.name} on {h.device}" for h in plan.blocked_by)
        return Outcome("waiting", f"waiting for {names}", list(plan.blocked_by))
    run = _Run(nvml, plan, policy_reset, retries, sleep, backoff_s, holders, in_use_window_s)
    done = 0
    step: Step | None = None
    try:
        g = run.read()
        for i, step in enumerate(plan.steps):
            after = plan.steps[i + 1].action if i + 1 < len(plan.steps) else None
            run.details_next = step.action == "set-mig-mode" or after in _NEEDS_DETAILS
            g = run.step(step, g)
            done += 1
            if on_step is not None:
                on_step(step, "done")
        step = None
        run.verify(g)
    except _Stop as stop:
        state, message, hs = stop.outcome
        if on_step is not None and step is not None:
            on_step(step, "reset-due" if stop.reset_due else state)
        return Outcome(state, message, hs, done, stop.reset_due)
    n = len(plan.steps)
    return Outcome("converged", f"{n} MIG step{'' if n == 1 else 's'} applied" if n else "nothing to do", [], done)


__all__ = ["MigNvml", "Outcome", "execute", "TRANSIENT"]
