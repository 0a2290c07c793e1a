"""Which layout a GPU Operator node's labels select, and where the outcome is reported.

Pure: node labels in, a Selection out. The rules, from the operator's agents this replaces:

* `nvidia.com/mig.config` names a layout, as it names a mig-parted config for mig-manager;
  `nvidia.com/vgpu.config` likewise for vgpu-device-manager. Each reports on its own `.state`.
* The operator sets `mig.config=all-disabled` on its own on every MIG-capable node
  (gpu-operator controllers/nodelabeling_controller.go), so on a vGPU node labelled
  `vgpu.config=X` that automatic value must not veto X: `vgpu.config` wins over `all-disabled`
  (and `mig.config.state` is left alone: MIG is X's business then). Two other, different names are
  an error: gpud has one layout in force.
* vgpu-device-manager applies its default config (`DEFAULT_VGPU_CONFIG`, the operator's
  `vgpuDeviceManager.config.default`, "default" unless set) when the node has no `vgpu.config`
  label (vgpu-device-manager cmd/nvidia-k8s-vgpu-dm/main.go); it runs only on nodes whose
  `nvidia.com/gpu.workload.config` is `vm-vgpu` (controllers/state_manager.go). gpud does the
  same there, when the file has a layout of that name.
"""

from __future__ import annotations

from collections.abc import Collection

from msgspec import Struct

from gpud.layout.schema import ALL_DISABLED_NAME

MIG_CONFIG = "nvidia.com/mig.config"
MIG_STATE = "nvidia.com/mig.config.state"
VGPU_CONFIG = "nvidia.com/vgpu.config"
VGPU_STATE = "nvidia.com/vgpu.config.state"
MIG_CAPABLE = "nvidia.com/mig.capable"
WORKLOAD_CONFIG = "nvidia.com/gpu.workload.config"
DEFAULT_VGPU_CONFIG = "default"  # gpu-operator's VgpuDMDefaultConfigName


class Selection(Struct, frozen=True):
    layout: str | None  # None: no label selects; the file's own `selected` stays in force
    state_labels: tuple[str, ...]  # where the outcome is reported
    error: str | None = None
    why: str = ""  # how the labels chose it, for status ("" : the label names it)


def selection(labels: dict[str, str], *, layouts: Collection[str] = (),
              default_vgpu: str | None = DEFAULT_VGPU_CONFIG) -> Selection:
    """`layouts`: the names the layout file offers (for the vGPU default)."""
    mig, vgpu = labels.get(MIG_CONFIG) or None, labels.get(VGPU_CONFIG) or None
    if vgpu:
        if mig and mig != vgpu and mig != ALL_DISABLED_NAME:
            return Selection(None, (MIG_STATE, VGPU_STATE),
                             f"{MIG_CONFIG}={mig} and {VGPU_CONFIG}={vgpu} name different layouts; gpud has one "
                             "layout in force: set them to the same name or remove one")
        if mig == vgpu:
            return Selection(vgpu, (MIG_STATE, VGPU_STATE))
        return Selection(vgpu, (VGPU_STATE,), why=f"{VGPU_CONFIG} over {MIG_CONFIG}={mig}" if mig else "")
    vgpu_node = labels.get(WORKLOAD_CONFIG) == "vm-vgpu"
    if vgpu_node and default_vgpu and default_vgpu in layouts and mig in (None, ALL_DISABLED_NAME):
        return Selection(default_vgpu, (VGPU_STATE,),
                         why=f"no {VGPU_CONFIG} label on a vm-vgpu node: the default, as vgpu-device-manager")
    if mig:
        return Selection(mig, (MIG_STATE,))
    return Selection(None, ())
