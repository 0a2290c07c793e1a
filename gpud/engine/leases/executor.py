"""A lease's NVML calls, with its record written around each one: runs in a worker thread.

make:    intent (written by the caller) -> [MIG mode on] -> create GI -> `gi-made` -> create CI ->
         read its MIG UUID -> `held`.
unmake:  `releasing` -> destroy CI -> destroy GI -> record dropped -> [MIG mode off].
A failure after the GI was made destroys that GI again (it is idle: no CI, nothing can run in it)
before the lease is refused, so a refused lease leaves the GPU as it found it. `on_stage(stage)`
is told between every two steps: `mode-on`, `gi-created` (the GI made, its id not yet written),
`gi-made`, `ci-made`, `held`; `before-releasing`, `releasing`, `ci-destroyed`, `gi-destroyed`,
`dropped` (the engine adds `before-intent` and `intent`): the tests kill the daemon at each of them.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from gpud.engine.leases.records import LeaseBook, LeaseRecord
from gpud.host.nvidia.nvml import Nvml, NvmlError
from gpud.model import Holder


class LeaseFailed(Exception):
    """NVML refused a lease's call; nothing of the lease is left on the GPU."""

    def __init__(self, message: str, nvml_error: NvmlError | None = None) -> None:
        super().__init__(message)
        self.nvml_error = nvml_error


Stage = Callable[[str], None]


def make(nvml: Nvml, book: LeaseBook, rec: LeaseRecord, *, mode_on: bool, on_stage: Stage,
         devices: Callable[[int, int], tuple[str, ...]]) -> LeaseRecord:
    """Create the GI and CI of an `intent` record (already written). `mode_on`: turn MIG on first
    (Hopper and later apply it at once on an idle GPU; otherwise the lease is refused)."""
    assert rec.placement is not None and rec.gi_profile_id is not None and rec.ci_profile_id is not None
    ci_profile = rec.ci_profile_id
    if mode_on:
        status = nvml.set_mig_mode(rec.gpu, True)
        if status != 0:
            nvml.set_mig_mode(rec.gpu, False)  # left pending it would wait for a reset: cancelled
            book.drop(rec.id)
            raise LeaseFailed(f"MIG mode on {rec.gpu} could not be turned on now: processes use the GPU "
                              f"(NVML activation status {status}); nothing leased, the mode left off")
        on_stage("mode-on")
    try:
        gi = nvml.create_gpu_instance(rec.gpu, rec.gi_profile_id, rec.placement.start)
    except NvmlError as e:
        raise LeaseFailed(f"creating {rec.profile} at {rec.placement.start}:{rec.placement.size} on "
                          f"{rec.gpu}: {e}", e) from e
    on_stage("gi-created")
    rec = msgspec.structs.replace(rec, state="gi-made", gi=gi)
    book.put(rec)
    on_stage("gi-made")
    ci: int | None = None
    try:
        ci = nvml.create_compute_instance(rec.gpu, gi, ci_profile)
        on_stage("ci-made")
        found = nvml.mig_device(rec.gpu, gi, ci)
        if found is None:
            raise LeaseFailed(f"the MIG device of GI {gi} CI {ci} on {rec.gpu} is not listed by NVML")
    except NvmlError as e:
        _undo(nvml, book, rec, ci=ci)
        raise LeaseFailed(f"creating the compute instance of {rec.profile} on {rec.gpu}: {e}", e) from e
    except LeaseFailed:
        _undo(nvml, book, rec, ci=ci)
        raise
    rec = msgspec.structs.replace(rec, state="held", ci=ci, uuid=found[0], devices=devices(gi, ci))
    book.put(rec)
    on_stage("held")
    return rec


def _undo(nvml: Nvml, book: LeaseBook, rec: LeaseRecord, *, ci: int | None) -> None:
    """A half-made lease goes again (its GI is new and nothing runs in it)."""
    assert rec.gi is not None
    if ci is not None:
        nvml.destroy_compute_instance(rec.gpu, rec.gi, ci)
    nvml.destroy_gpu_instance(rec.gpu, rec.gi)
    book.drop(rec.id)


def busy(nvml: Nvml, rec: LeaseRecord) -> tuple[Holder, ...]:
    """Processes in the lease's MIG device now (NVML's view)."""
    if rec.gi is None or rec.ci is None:
        return ()
    found = nvml.mig_device(rec.gpu, rec.gi, rec.ci)
    return found[1] if found is not None else ()


def unmake(nvml: Nvml, book: LeaseBook, rec: LeaseRecord, *, mode_off: Callable[[], bool],
           on_stage: Stage = lambda stage: None) -> bool:
    """Destroy the lease's CI and GI and drop its record. The caller checked it is idle; NVML's
    IN_USE here (a process started meanwhile) leaves the lease `releasing` and raises. Returns
    whether MIG mode was turned off after it (`mode_off()` says whether it should be)."""
    on_stage("before-releasing")
    rec = msgspec.structs.replace(rec, state="releasing")
    book.put(rec)
    on_stage("releasing")
    gi, ci = rec.gi, rec.ci
    if rec.kind == "mig" and gi is not None:
        try:
            if ci is not None:
                ignore_gone(lambda: nvml.destroy_compute_instance(rec.gpu, gi, ci))
                on_stage("ci-destroyed")
            ignore_gone(lambda: nvml.destroy_gpu_instance(rec.gpu, gi))
            on_stage("gi-destroyed")
        except NvmlError as e:
            raise LeaseFailed(f"releasing {rec.id} on {rec.gpu}: {e}", e) from e
    book.drop(rec.id)
    on_stage("dropped")
    if mode_off():
        return nvml.set_mig_mode(rec.gpu, False) == 0
    return False


def ignore_gone(call: Callable[[], None]) -> None:
    """A destroy of what is already gone (an earlier run died after it) is done."""
    try:
        call()
    except NvmlError as e:
        if e.code not in (NOT_FOUND, INVALID_ARGUMENT):
            raise


# NVML return codes (nvml.h) for "no such instance": a destroy repeated after a crash.
INVALID_ARGUMENT, NOT_FOUND = 2, 6
