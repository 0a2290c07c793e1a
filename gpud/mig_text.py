"""How MIG is written down: the grammar of a MIG device name (`1g.18gb`, `1g.18gb+me`, `1c.3g.71gb`)
and the one line a MIG step reads as (`create-gi 3g.40gb@4:4`).

Two sides need the same words. The pure core parses layout names with the grammar
(layout/names.py) and prints its steps with `step_text` (plan/mig.py: the daemon's events). The thin
client prints the steps of a plan reply with the same `step_text`, so `gpudctl plan` names a step
exactly as `gpudctl events` will while it runs, and uses the grammar to show a compute instance's
slot only where the name says it is smaller than its GPU instance.

Why here: the client may import only the standard library, msgspec, the protocol modules and this
one (its start-up time; tests/test_layering.py checks the whole closure), and the core may not
import gpud.api. So this module sits at the top of the package and imports only the standard
library: a MIG device name is part of the protocol's vocabulary (every `profile` field carries one).
Sending the step text over the wire instead would still leave the grammar on both sides (the status
of an instance) and give no words for the steps of an older daemon's reply.
"""

from __future__ import annotations

import re

# `[Nc.]Ng.NNgb[suffix]`. The suffixes are the GI profile variants NVML names (nvml.h
# NVML_GPU_INSTANCE_PROFILE_*_REV1 / _GFX / _NO_ME / _ALL_ME): `+me` media extensions (A30, A100,
# Hopper, Blackwell), `+gfx` graphics, `-me` no media engines, `+me.all` all of them (RTX PRO
# Blackwell; docs/hardware/mig-profiles.md). Which ones a GPU has is its table's business.
# A pattern, compiled by `re` (and kept in its cache) at the first name read: `gpudctl status` reads
# none, and compiling at import would be paid by each of its runs.
_NAME = r"(?:([1-9][0-9]?)c\.)?([1-9][0-9]?)g\.([1-9][0-9]{0,3})gb(\+me\.all|\+me|-me|\+gfx|)"

SYNTAX = ("[Nc.]Ng.NNgb[+me|+me.all|-me|+gfx], e.g. 1g.10gb, 1g.10gb+me, 1c.3g.40gb, 1g.24gb+gfx, "
          "2g.48gb-me")

# The actions of a MIG plan (plan/mig.py Step), each one NVML call or the reset a mode change needs.
MIG_ACTIONS = frozenset({"set-mig-mode", "destroy-ci", "destroy-gi", "create-gi", "create-ci", "reset"})


def split_name(name: str) -> tuple[int | None, int, int, str] | None:
    """(compute slices or None for the GI's whole CI, GI slices, memory GB, suffix) of a MIG device
    name; None when `name` is not one. A CI larger than its GI is not a name."""
    m = re.fullmatch(_NAME, name) if isinstance(name, str) else None
    if m is None:
        return None
    ci, gi, mem, suffix = m.groups()
    if ci is not None and int(ci) > int(gi):
        return None
    return (int(ci) if ci is not None else None), int(gi), int(mem), suffix


def subdivided(name: str | None) -> bool:
    """A MIG device smaller than its GPU instance (`1c.3g.40gb`, not `3g.40gb`): only those show the
    compute slot they sit at."""
    parts = split_name(name) if name else None
    return parts is not None and parts[0] is not None and parts[0] < parts[1]


TYPE_CHECKING = False
if TYPE_CHECKING:  # the shape step_text reads, for mypy: `typing` is a cost every gpudctl run would pay
    from typing import Protocol

    class _Slot(Protocol):
        @property
        def start(self) -> int: ...

        @property
        def size(self) -> int: ...

    class MigStep(Protocol):
        """What a step line is made of: plan/mig.py's Step and the wire's StepInfo both have it."""

        @property
        def action(self) -> str: ...

        @property
        def profile(self) -> str | None: ...

        @property
        def placement(self) -> _Slot | None: ...

        @property
        def gi(self) -> int | None: ...

        @property
        def ci(self) -> int | None: ...

        @property
        def ci_placement(self) -> _Slot | None: ...

        @property
        def uuid(self) -> str | None: ...

        @property
        def enabled(self) -> bool | None: ...


def step_text(s: MigStep) -> str:
    """One MIG step as a person reads it, single-spaced: the action, then what it acts on, with the
    GI's placement as NVML and nvidia-smi write it (`create-gi 3g.40gb@4:4`) and a subdivided CI's
    compute slot (`create-ci 1c.3g.40gb@0:4 at compute 2:1`). The GPU is not named: every place
    that prints a step names its GPU already."""
    if s.action == "set-mig-mode":
        return f"set-mig-mode {'on' if s.enabled else 'off'}"
    parts = [s.action]
    if s.profile:
        parts.append(s.profile + (f"@{s.placement.start}:{s.placement.size}" if s.placement is not None else ""))
    if s.gi is not None:
        parts.append(f"gi {s.gi}")
    if s.ci is not None:
        parts.append(f"ci {s.ci}")
    if s.ci_placement is not None and subdivided(s.profile):
        parts.append(f"at compute {s.ci_placement.start}:{s.ci_placement.size}")
    if s.uuid:
        parts.append(s.uuid)
    return " ".join(parts)
