"""A simulated host with dynamic GPUs and gpud's reconciler (and so its lease engine), for the lease
tests. What a test checks is read from the simulator's own state file, never from gpud's view."""

from __future__ import annotations

from pathlib import Path

from gpud.model import Placement
from gpud.profiles import MODELS
from gpud.sim import gpu_rules
from gpud.sim import state as simstate
from tests.support.present import present
from tests.support.simrig import SimRig

DYNAMIC = """version: v1
layouts:
  d:
    - devices: all
      mig-enabled: true
      mig-devices: dynamic
{policy}"""


def dynamic_layout(**policy: str) -> str:
    lines = "".join(f"  {k}: {v}\n" for k, v in policy.items())
    return DYNAMIC.format(policy=f"policy:\n{lines}" if lines else "")


async def dynamic_rig(tmp: Path, gpus: tuple[str, ...], **policy: str) -> SimRig:
    rig = SimRig(tmp, gpus, state_dir=str(tmp / "state"))
    assert await rig.apply(dynamic_layout(**policy))
    await rig.rec.leases.start()
    return rig


def sim_gis(rig: SimRig, index: int = 0) -> list[tuple[str, Placement, list[str]]]:
    """(GI profile name, placement, MIG UUIDs of its CIs) on one GPU, from the simulator's state file."""
    state = simstate.load(rig.dir)
    g = state.gpus[sorted(state.gpus)[index]]
    model = MODELS[g.model]
    return sorted((present(gpu_rules.profile_of(model, gi.profile_id)).name, Placement(gi.start, gi.size),
                   [c.uuid for c in gi.cis]) for gi in g.gis)


def foreign_gi(rig: SimRig, name: str, start: int | None = None, index: int = 0) -> None:
    """Someone else's GI with a CI (`nvidia-smi mig -cgi ... -C`), made by the simulator's own rules."""
    with simstate.locked(rig.dir) as state:
        g = state.gpus[sorted(state.gpus)[index]]
        model = gpu_rules.model_of(g, state.driver_version)
        prof = next(p for p in model.profiles if p.name == name)
        gi = gpu_rules.create_gi(g, model, prof, start, prof.placements[0].size if start is not None else None)
        gpu_rules.create_ci(model, gi, next(c.id for c in prof.ci_profiles if c.slices == prof.slices), None, None)


def pci(rig: SimRig, index: int = 0) -> str:
    return sorted(simstate.load(rig.dir).gpus)[index]


async def restarted(rig: SimRig, tmp) -> list[dict]:
    """What a new gpud process does at start: its own NVML session and reconciler, records read."""
    rig.new_process(str(tmp / "state"))
    rig.rec = type(rig.rec)(rig.hw, config_path=str(rig.config), apply_lock=rig.rec.apply_lock, bus=rig.bus,
                            state_dir=str(tmp / "state"))
    assert rig.rec.load_config()
    rig.rec.refresh()
    before = len(rig.bus.recent())
    await rig.rec.leases.start()
    return rig.bus.recent()[before:]
