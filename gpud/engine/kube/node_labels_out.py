"""After every pass: the node's labels, from what the engine last observed, into NFD's feature file.

The labels themselves are pure (`gpud.plan.node_labels`); this module gathers their inputs from
the engine's state (observation, the layout in force and how far it got, NVML's versions) and
hands them to the NFD adapter. A failed write is reported, never a reason to fail the pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal, assert_never

from msgspec import Struct

from gpud.engine.gpu_state import Phase
from gpud.host.kube import nfd
from gpud.model import Gpu
from gpud.plan.node_labels import LabelInputs, NodeLabels, node_labels

log = logging.getLogger(__name__)

# `nvidia.com/gpud.layout.state`: mig.config.state's values, and "rebooting".
LayoutState = Literal["success", "pending", "failed", "rebooting"]

LABEL_SETS = ("all", "gpud")  # --nfd-labels: GFD's set + gpud's, or gpud's only
MIG_STRATEGIES = ("mixed", "single")
GFD_DEPLOY = "nvidia.com/gpu.deploy.gpu-feature-discovery"
MIG_STRATEGY = "nvidia.com/mig.strategy"


def from_cluster(labels: dict[str, str], *, label_set: str | None, mig_strategy: str | None) -> tuple[str, str]:
    """The label set and MIG strategy for a GPU Operator node (`gpud --kube-node`), the flags'
    values (None: not given) winning. GFD runs on the node unless its deploy label is `false`
    (the operator's DaemonSet selects on `=true`, and gpud's mig.capable makes the operator deploy
    it), and a second writer of GFD's labels through NFD races it (nfd-master keeps the last
    NodeFeature object by name): so gpud writes its own labels only, unless GFD is off. GFD
    publishes the cluster's strategy as `nvidia.com/mig.strategy`; gpud's advertised resources and
    labels follow it (mixed when unset)."""
    if label_set is None:
        label_set = "all" if labels.get(GFD_DEPLOY) == "false" else "gpud"
    if mig_strategy is None:
        value = labels.get(MIG_STRATEGY)
        mig_strategy = value if value in MIG_STRATEGIES else "mixed"
    return label_set, mig_strategy


def layout_state(phase: Phase, *, rebooting: bool = False) -> LayoutState:
    """The label's value for an engine phase (`rebooting`: a reboot gpud asked for is under way).
    Every phase is named: mypy fails here when a phase is added without its value."""
    match phase:
        case "converged":
            return "success"
        case "starting" | "applying" | "pending" | "waiting" | "read-only" | "drift":
            return "pending"
        case "failed" | "stuck" | "reset-required" | "invalid-layout":
            return "failed"
        case "reboot-required":
            return "rebooting" if rebooting else "failed"
        case _:
            assert_never(phase)


class Versions(Struct, frozen=True):
    driver: str | None = None
    cuda: int | None = None


class LabelsOut:
    """Writes the node's labels to `path` after each pass (`path` None: labels are only computed,
    for `gpudctl status`). `exclude`: labels another writer owns (with --kube-node, gpud patches
    nvidia.com/mig.capable on the node itself)."""

    def __init__(self, path: str | None, *, label_set: str = "all", mig_strategy: str = "mixed",
                 exclude: tuple[str, ...] = (), on_event: Callable[[str, str], None] | None = None) -> None:
        if label_set not in LABEL_SETS:
            raise ValueError(f"label set {label_set!r}: expected one of {', '.join(LABEL_SETS)}")
        self.path = path
        self.gfd = label_set == "all"
        self.mig_strategy = mig_strategy
        self.exclude = exclude
        self.on_event = on_event or (lambda kind, message: None)
        self.last: NodeLabels | None = None
        self._computed_from: tuple[LabelInputs, bool, tuple[str, ...]] | None = None
        self.label_set = label_set
        self.last_result: str | None = None  # written | unchanged | no-directory | error: ...

    def set_mode(self, label_set: str, mig_strategy: str) -> bool:
        """Change what is written (the cluster said otherwise); True when something changed."""
        if label_set not in LABEL_SETS or mig_strategy not in MIG_STRATEGIES:
            raise ValueError(f"label set {label_set!r} / MIG strategy {mig_strategy!r}")
        changed = (label_set, mig_strategy) != (self.label_set, self.mig_strategy)
        self.label_set, self.gfd, self.mig_strategy = label_set, label_set == "all", mig_strategy
        return changed

    def inputs(self, gpus: tuple[Gpu, ...], *, workloads: dict[str, str], layout: str | None, state: str,
               versions: Versions) -> LabelInputs:
        compute = {g.pci: g.nvml.compute_capability for g in gpus
                   if g.nvml is not None and g.nvml.compute_capability is not None}
        return LabelInputs(gpus=gpus, driver_version=versions.driver, cuda_driver_version=versions.cuda,
                           compute=compute, workloads=workloads, layout=layout, state=state,
                           mig_strategy=self.mig_strategy)

    def compute(self, inputs: LabelInputs) -> NodeLabels:
        """The labels of `inputs`: the last ones again when nothing they are made of changed (each
        new observation asks, and at 64 GPUs making them costs milliseconds on the event loop;
        a GPU's record is replaced, never edited, when a read finds it changed)."""
        done = self._computed_from
        if self.last is not None and done is not None and done[1:] == (self.gfd, self.exclude) and _same(done[0], inputs):
            return self.last
        out = node_labels(inputs, gfd=self.gfd)
        labels = {k: v for k, v in out.labels.items() if k not in self.exclude}
        self.last = NodeLabels(labels, out.warnings)
        self._computed_from = (inputs, self.gfd, self.exclude)
        return self.last

    def remove(self) -> None:
        """gpud stops: remove the file this process wrote (stale labels would outlive the daemon;
        a --read-only gpud that never wrote leaves the file of another alone)."""
        if self.path is None or self.last_result not in ("written", "unchanged"):
            return
        try:
            if nfd.remove_features(self.path):
                log.info("%s removed: the node's labels go with gpud", self.path)
        except OSError as e:
            log.warning("node labels not removed from %s: %s", self.path, e)
        self.last_result = None

    def write(self, inputs: LabelInputs) -> NodeLabels:
        labels = self.compute(inputs)
        if self.path is None:
            return labels
        try:
            result = nfd.write_features(self.path, labels.labels)
        except (nfd.NfdError, OSError) as e:
            result = f"error: {e}"
            self.on_event("labels", f"node labels not written: {e}")
        if result == "written":
            self.on_event("labels", f"{self.path}: {len(labels.labels)} node labels written")
        self.last_result = result
        return labels


def _same(a: LabelInputs, b: LabelInputs) -> bool:
    """The same inputs: the same GPU records (by identity) and equal values."""
    return (len(a.gpus) == len(b.gpus) and all(x is y for x, y in zip(a.gpus, b.gpus, strict=True))
            and (a.driver_version, a.cuda_driver_version, a.compute, a.workloads, a.layout, a.state, a.mig_strategy)
            == (b.driver_version, b.cuda_driver_version, b.compute, b.workloads, b.layout, b.state, b.mig_strategy))
