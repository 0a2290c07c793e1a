"""vGPU scenarios: a simulated host, a sequence of layouts (vGPU types per GPU) with holders coming
and going, and what the host must end as. Used by tests/scenarios/test_vgpu_scenarios.py (gpud) and
bench/vgpu_bench.py (gpud beside a model of vgpu-device-manager)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    """Apply `types` to GPU `gpu` (workload vm-vgpu, or `workload`); before it, `hold` the n-th vGPU
    of a type (a VM opens it), `release` holds, or `reboot` the host."""

    types: dict[str, int]
    workload: str = "vm-vgpu"
    hold: tuple[str, int] | None = None  # (type, n-th device of that type in sorted order)
    release: bool = False
    reboot: bool = False


@dataclass(frozen=True)
class VgpuScenario:
    name: str
    models: tuple[str, ...]
    interface: str  # vfio | mdev
    gpu: int  # index of the GPU the steps apply to
    steps: tuple[Step, ...]
    expect: dict[str, int]  # the vGPU types on that GPU at the end
    outcome: str = "done"  # done | blocked | infeasible: what the last step gives
    mig: tuple[tuple[int, int, int], ...] = ()  # (GI id, profile id, start) of a preset MIG layout
    vfs_after: int | None = None  # VFs enabled at the end, when it matters
    uuids_kept: bool = False  # the vGPUs after the last step have the identities they had before it


HOST = ("l40s", "a100-pcie-40gb", "h200", "t4")
L40S, A100, H200, T4 = 0, 1, 2, 3
H200_MIG = ((1, 19, 0), (2, 19, 1), (3, 19, 2), (4, 9, 4))  # 3 x 1g.18gb + 3g.71gb

SCENARIOS: tuple[VgpuScenario, ...] = (
    VgpuScenario("l40s-vfio-seed-4x12Q", HOST, "vfio", L40S, (Step({"L40S-12Q": 4}),), {"L40S-12Q": 4}, vfs_after=32),
    VgpuScenario("l40s-vfio-reapply-is-a-no-op", HOST, "vfio", L40S,
                 (Step({"L40S-12Q": 4}), Step({"L40S-12Q": 4})), {"L40S-12Q": 4}, uuids_kept=True),
    VgpuScenario("l40s-vfio-4-to-2-keeps-two", HOST, "vfio", L40S,
                 (Step({"L40S-12Q": 4}), Step({"L40S-12Q": 2})), {"L40S-12Q": 2}, uuids_kept=True),
    VgpuScenario("l40s-vfio-2-to-4-keeps-two", HOST, "vfio", L40S,
                 (Step({"L40S-12Q": 2}), Step({"L40S-12Q": 4})), {"L40S-12Q": 4}, uuids_kept=True),
    VgpuScenario("l40s-vfio-12Q-to-24Q", HOST, "vfio", L40S,
                 (Step({"L40S-12Q": 4}), Step({"L40S-24Q": 2})), {"L40S-24Q": 2}),
    VgpuScenario("l40s-vfio-busy-type-change-waits", HOST, "vfio", L40S,
                 (Step({"L40S-12Q": 2}), Step({"L40S-24Q": 2}, hold=("L40S-12Q", 0))), {"L40S-12Q": 2},
                 outcome="blocked"),
    VgpuScenario("l40s-vfio-busy-released-then-applied", HOST, "vfio", L40S,
                 (Step({"L40S-12Q": 2}), Step({"L40S-24Q": 2}, hold=("L40S-12Q", 0)),
                  Step({"L40S-24Q": 2}, release=True)), {"L40S-24Q": 2}),
    VgpuScenario("l40s-vfio-mixed-types-infeasible", HOST, "vfio", L40S,
                 (Step({"L40S-12Q": 2}), Step({"L40S-12Q": 2, "L40S-24Q": 1})), {"L40S-12Q": 2},
                 outcome="infeasible"),
    VgpuScenario("l40s-vfio-too-many-infeasible", HOST, "vfio", L40S,
                 (Step({"L40S-12Q": 2}), Step({"L40S-12Q": 5})), {"L40S-12Q": 2}, outcome="infeasible"),
    VgpuScenario("l40s-mdev-seed-2x24Q", HOST, "mdev", L40S, (Step({"L40S-24Q": 2}),), {"L40S-24Q": 2}),
    VgpuScenario("t4-mdev-seed-3x4Q", HOST, "mdev", T4, (Step({"T4-4Q": 3}),), {"T4-4Q": 3}),
    VgpuScenario("t4-mdev-3-to-4-keeps-uuids", HOST, "mdev", T4,
                 (Step({"T4-4Q": 3}), Step({"T4-4Q": 4})), {"T4-4Q": 4}, uuids_kept=True),
    VgpuScenario("t4-mdev-busy-shrink-keeps-the-held-one", HOST, "mdev", T4,
                 (Step({"T4-4Q": 4}), Step({"T4-4Q": 2}, hold=("T4-4Q", 3))), {"T4-4Q": 2}, uuids_kept=True),
    VgpuScenario("t4-mdev-reboot-rebuilds-same-uuids", HOST, "mdev", T4,
                 (Step({"T4-4Q": 4}), Step({"T4-4Q": 4}, reboot=True)), {"T4-4Q": 4}, uuids_kept=True),
    VgpuScenario("a100-mdev-on-vfs-seed-4x10C", HOST, "mdev", A100, (Step({"A100-10C": 4}),), {"A100-10C": 4},
                 vfs_after=16),
    VgpuScenario("a100-mdev-on-vfs-4-to-2", HOST, "mdev", A100,
                 (Step({"A100-10C": 4}), Step({"A100-10C": 2})), {"A100-10C": 2}, uuids_kept=True),
    VgpuScenario("a100-vfio-mig-backed", HOST, "vfio", A100, (Step({"A100-1-5C": 4}),), {"A100-1-5C": 4},
                 mig=((1, 19, 0), (2, 19, 1), (3, 19, 2), (4, 19, 3))),
    VgpuScenario("h200-vfio-mig-backed-seed", HOST, "vfio", H200,
                 (Step({"H200X-1-18C": 3, "H200X-3-71C": 1}),), {"H200X-1-18C": 3, "H200X-3-71C": 1}, mig=H200_MIG),
    VgpuScenario("h200-vfio-mig-backed-3-to-2", HOST, "vfio", H200,
                 (Step({"H200X-1-18C": 3, "H200X-3-71C": 1}), Step({"H200X-1-18C": 2, "H200X-3-71C": 1})),
                 {"H200X-1-18C": 2, "H200X-3-71C": 1}, mig=H200_MIG, uuids_kept=True),
    VgpuScenario("h200-vfio-mig-backed-more-than-instances", HOST, "vfio", H200,
                 (Step({"H200X-1-18C": 4}),), {}, mig=H200_MIG, outcome="infeasible"),
    VgpuScenario("l40s-vfio-to-container-disables-vfs", HOST, "vfio", L40S,
                 (Step({"L40S-12Q": 4}), Step({}, workload="container")), {}, vfs_after=0),
    VgpuScenario("t4-mdev-to-container", HOST, "mdev", T4,
                 (Step({"T4-4Q": 4}), Step({}, workload="container")), {}),
)
