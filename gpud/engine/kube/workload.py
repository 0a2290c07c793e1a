"""What `nvidia.com/gpu.workload.config` a node gets from the layout in force, and which GPUs the
GPU Operator's operands will then not serve.

The operator deploys one family of operands per node, chosen by that label (container,
vm-passthrough, vm-vgpu; default container), and removes the other families' deploy labels
(gpu-operator controllers/state_manager.go, `gpuStateLabels`). gpud's layouts may mix workloads
per GPU; the operator cannot. So: a layout whose GPUs serve one workload sets the label to it; a
mixed one leaves the label as it is and says which GPUs get no operands under it. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping

from msgspec import Struct

from gpud.layout.schema import WORKLOADS

DEFAULT = "container"  # the operator's default (ClusterPolicy sandboxWorkloads.defaultWorkload)
# The operands that serve each workload, from the operator's gpuStateLabels, less the GPU agents
# gpud keeps off (vfio-manager, vgpu-device-manager) and the driver/toolkit installers.
FAMILY = {
    "container": ("device-plugin", "gpu-feature-discovery", "dcgm", "dcgm-exporter", "operator-validator"),
    "vm-passthrough": ("sandbox-device-plugin", "sandbox-validator"),
    "vm-vgpu": ("sandbox-device-plugin", "sandbox-validator", "vgpu-manager"),
}
SERVED_LABEL = "nvidia.com/gpud.workload.{}.served"  # "false" on the node for a workload left unserved


class WorkloadPlan(Struct, frozen=True):
    label: str | None  # the value gpud writes to nvidia.com/gpu.workload.config (None: leave it)
    effective: str  # the family the operator deploys on this node then
    unserved: dict[str, list[str]]  # workload -> its GPUs that the effective family does not serve
    messages: list[str]

    def served_labels(self) -> dict[str, str | None]:
        """gpud's state labels on the node: `.served=false` per unserved workload, others removed."""
        return {SERVED_LABEL.format(w): ("false" if w in self.unserved else None) for w in WORKLOADS}


def plan_workload(workloads: Mapping[str, str], node_value: str | None) -> WorkloadPlan:
    """`workloads`: PCI address -> workload of each GPU the layout in force manages."""
    kinds = sorted(set(workloads.values()))
    if len(kinds) == 1:
        return WorkloadPlan(kinds[0], kinds[0], {}, [])
    effective = node_value if node_value in WORKLOADS else DEFAULT
    unserved = {w: sorted(p for p, x in workloads.items() if x == w) for w in kinds if w != effective}
    messages = []
    for w, gpus in unserved.items():
        missing = [op for op in FAMILY[w] if op not in FAMILY[effective]]
        messages.append(f"{w} GPU(s) {', '.join(gpus)}: the layout mixes workloads and the node's "
                        f"nvidia.com/gpu.workload.config={effective}, so the GPU Operator runs no "
                        f"{', '.join(missing)} for them")
    return WorkloadPlan(None, effective, unserved, messages)
