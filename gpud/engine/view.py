"""What the engine shows the world: one frozen, typed record of its state, rebuilt after a change.

Status, metrics, NFD labels, the STATUS= line and the kube agent's reports are functions of an
EngineView, never of the engine's live objects: a reader can neither see half of a change nor
change the engine by accident, and each of those outputs is testable from a view made by hand.
The engine builds a new view only when something in it changed (compared the way the status
reply used to compare the engine's records: immutable records by identity, the rest by value),
so an unchanged engine hands out the same view object and a reader may cache by identity.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from gpud.engine.gpu_state import GpuState, Phase
from gpud.engine.leases.records import LeaseRecord
from gpud.engine.observe.discovery import Observation
from gpud.layout.parse import ParsedLayout
from gpud.layout.resolve import Resolution
from gpud.layout.schema import Policy

EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class EngineView:
    """The engine's state after its last change. Mappings are read-only copies."""

    observation: Observation
    resolution: Resolution | None  # the layout in force resolved against `observation`
    gpu_states: Mapping[str, GpuState]  # PCI -> what the engine last concluded
    phase: Phase  # what the last pass concluded
    phase_now: Phase  # the top line now: an invalid file, then a GPU changing, a change not started, else `phase`
    layout: ParsedLayout | None  # the last good layout in force
    layout_errors: tuple[str, ...]  # of the file as it is now (a refused file keeps the last good layout)
    layout_warnings: tuple[str, ...]
    config_path: str
    read_only: bool
    # PCI -> a change of the GPU set not yet acknowledged by a good file
    notes: Mapping[str, str] = field(default_factory=lambda: EMPTY)
    problems: tuple[str, ...] = ()  # gpud's state files set aside or not written, each once
    rebuilt_after_boot: str | None = None  # what the first pass after a reboot rebuilt, once it ended
    # PCI -> vGPUs recreated from gpud's record
    vgpus_rebuilt: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: EMPTY)
    passes: int = 0  # passes started
    completed_passes: int = 0  # passes ended
    leases: tuple[LeaseRecord, ...] = ()  # MIG on demand (gpud.engine.leases): every lease, oldest first
    # PCI -> GI profile -> how many more leases fit now, per dynamic GPU
    lease_free: Mapping[str, Mapping[str, int]] = field(default_factory=lambda: EMPTY)
    label_selects: bool = False  # --kube-node: the node label chooses the layout (gpudctl select is not taken)
    chosen: bool = False  # the layout in force is the one `gpudctl select` chose, not the file's `selected`

    @property
    def policy(self) -> Policy | None:
        """The layout in force's policy."""
        return self.layout.layout.policy if self.layout is not None and self.layout.layout is not None else None

    @property
    def selected(self) -> str | None:
        """The layout of the file in force (`selected`, or the one a node label chose)."""
        return self.layout.selected if self.layout is not None else None

    @property
    def layout_names(self) -> list[str]:
        """The layouts the file in force offers."""
        return list(self.layout.layout.layouts) if self.layout is not None and self.layout.layout is not None else []

    def workloads(self) -> dict[str, str]:
        """PCI -> the workload the layout in force gives it."""
        desired = self.resolution.desired if self.resolution is not None else {}
        return {pci: d.workload for pci, d in desired.items()}


class ViewCache:
    """The last view and what it was built from: `get` builds a new one only when something in it
    changed. `records` are immutable (frozen structs, replaced rather than edited), so they are
    compared by identity; `values` by value."""

    def __init__(self) -> None:
        self._view: EngineView | None = None
        self._key: tuple[tuple[object, ...], tuple[object, ...]] | None = None

    def get(self, records: tuple[object, ...], values: tuple[object, ...], build: Callable[[], EngineView]) -> EngineView:
        old = self._key
        if (self._view is not None and old is not None and len(old[0]) == len(records)
                and all(a is b for a, b in zip(old[0], records, strict=True)) and old[1] == values):
            return self._view
        self._key = (records, values)
        self._view = build()
        return self._view


def said_once(problems: list[str], index_problem: str | None) -> tuple[str, ...]:
    """What is wrong with gpud's state files (set aside, not written), each said once: the GPU
    index map's problem replaces the shorter notes it begins with."""
    if index_problem and index_problem not in problems:
        problems = [*(m for m in problems if not index_problem.startswith(m)), index_problem]
    return tuple(problems)
