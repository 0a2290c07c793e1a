"""The MIG transition scenarios: shared by the scenario tests and the benchmark (bench/mig_bench.py).

Each scenario lays a simulated host, applies `before` (if any) through gpud itself, optionally
starts processes on MIG devices, then applies `after` and states what the host must look like.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml


def layout(*entries: dict, policy: dict | None = None, name: str = "test") -> str:
    doc: dict = {"version": "v1", "selected": name, "layouts": {name: list(entries)}}
    if policy:
        doc["policy"] = policy
    return yaml.safe_dump(doc, sort_keys=False)


def mig(devices, mig_devices: dict[str, int] | None, **extra) -> dict:
    """A device entry: MIG on with these devices, or MIG off when `mig_devices` is None."""
    e: dict = {"devices": devices}
    e.update(extra)
    if mig_devices is None:
        e["mig-enabled"] = False
    else:
        e["mig-enabled"] = True
        e["mig-devices"] = mig_devices
    return e


@dataclass(frozen=True)
class Hold:
    """A process started on a MIG device (by profile name and occurrence) before `after` applies."""

    gpu: int
    profile: str
    nth: int = 0
    release_after: bool = False  # exit once gpud waits; gpud must then proceed by itself


@dataclass(frozen=True)
class Scenario:
    name: str
    gpus: tuple[str, ...]
    after: str
    before: str | None = None
    expect: dict[int, dict[str, int] | None] = field(default_factory=dict)  # GPU index -> MIG devices; None: MIG off
    state: str = "converged"  # what the changed GPUs end in
    holds: tuple[Hold, ...] = ()
    unchanged: bool = False  # nothing may change at all (infeasible, busy with on-busy: fail)
    resets: int | None = None  # GPU resets expected during `after`
    faults: tuple[tuple[str, int, int], ...] = ()  # (NVML function, nth, error) set before `after`
    message: str | None = None  # expected in the failing GPU's message
    # Exactly one of these GPUs fails, whichever meets the fault first: GPUs converge side by side,
    # so which GPU makes the nth call of a function is not fixed. The others must match `expect`.
    fails_one_of: tuple[int, ...] = ()


H100 = "h100-80gb"
H200 = "h200"
A100 = "a100-40gb"
WHOLE_1_7 = mig([1, 2, 3, 4, 5, 6, 7], None)
SEED = layout(mig([0], {"1g.10gb": 4, "3g.40gb": 1}), WHOLE_1_7)
ALL_1G_H100 = {"1g.10gb": 7}
BALANCED_H100 = {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}

SCENARIOS: list[Scenario] = [
    # --- H100 80GB, the seed's 8-GPU host -------------------------------------------------------
    Scenario("seed-partial-mig", (f"{H100}:8",), SEED,
             expect={0: {"1g.10gb": 4, "3g.40gb": 1}, **{i: None for i in range(1, 8)}}),
    Scenario("seed-reapplied-is-a-no-op", (f"{H100}:8",), SEED, before=SEED,
             expect={0: {"1g.10gb": 4, "3g.40gb": 1}}),
    Scenario("h100-all-1g-to-balanced", (f"{H100}:2",), layout(mig([0], BALANCED_H100)),
             before=layout(mig([0], ALL_1G_H100)), expect={0: BALANCED_H100}),
    Scenario("h100-7x1g-to-3g-plus-4x1g", (f"{H100}:1",), layout(mig([0], {"3g.40gb": 1, "1g.10gb": 4})),
             before=layout(mig([0], ALL_1G_H100)), expect={0: {"3g.40gb": 1, "1g.10gb": 4}}),
    Scenario("h100-mig-on-one-gpu-of-eight", (f"{H100}:8",),
             layout(mig([3], {"7g.80gb": 1}), mig([0, 1, 2, 4, 5, 6, 7], None)),
             before=layout(mig("all", None)), expect={3: {"7g.80gb": 1}, 0: None, 7: None}, resets=0),
    Scenario("h100-mig-off-one-gpu-of-eight", (f"{H100}:8",), SEED,
             before=layout(mig([0, 5], {"1g.10gb": 4, "3g.40gb": 1}), mig([1, 2, 3, 4, 6, 7], None)),
             expect={5: None, 0: {"1g.10gb": 4, "3g.40gb": 1}}, resets=0),
    Scenario("h100-balanced-to-7g", (f"{H100}:1",), layout(mig([0], {"7g.80gb": 1})),
             before=layout(mig([0], BALANCED_H100)), expect={0: {"7g.80gb": 1}}),
    Scenario("h100-7g-to-all-1g", (f"{H100}:1",), layout(mig([0], ALL_1G_H100)),
             before=layout(mig([0], {"7g.80gb": 1})), expect={0: ALL_1G_H100}),
    Scenario("h100-all-1g-to-1g.20gb", (f"{H100}:1",), layout(mig([0], {"1g.20gb": 4})),
             before=layout(mig([0], ALL_1G_H100)), expect={0: {"1g.20gb": 4}}),
    Scenario("h100-balanced-to-3x2g", (f"{H100}:1",), layout(mig([0], {"2g.20gb": 3})),
             before=layout(mig([0], BALANCED_H100)), expect={0: {"2g.20gb": 3}}),
    Scenario("h100-2x3g-to-4g-plus-3g", (f"{H100}:1",), layout(mig([0], {"4g.40gb": 1, "3g.40gb": 1})),
             before=layout(mig([0], {"3g.40gb": 2})), expect={0: {"4g.40gb": 1, "3g.40gb": 1}}),
    Scenario("h100-ci-subdivision", (f"{H100}:1",), layout(mig([0], {"1c.3g.40gb": 3, "3g.40gb": 1})),
             before=layout(mig([0], {"3g.40gb": 2})), expect={0: {"1c.3g.40gb": 3, "3g.40gb": 1}}),
    Scenario("h100-media-extensions", (f"{H100}:1",), layout(mig([0], {"1g.10gb+me": 1, "1g.10gb": 6})),
             before=layout(mig([0], ALL_1G_H100)), expect={0: {"1g.10gb+me": 1, "1g.10gb": 6}}),
    Scenario("h100-busy-instance-survives", (f"{H100}:1",), layout(mig([0], {"1g.10gb": 4, "1g.20gb": 2})),
             before=layout(mig([0], {"1g.10gb": 4, "3g.40gb": 1})), holds=(Hold(0, "1g.10gb", 0),),
             expect={0: {"1g.10gb": 4, "1g.20gb": 2}}),
    Scenario("h100-busy-instance-waits-then-proceeds", (f"{H100}:1",), layout(mig([0], {"7g.80gb": 1})),
             before=layout(mig([0], {"1g.10gb": 4, "3g.40gb": 1})), holds=(Hold(0, "3g.40gb", 0, release_after=True),),
             expect={0: {"7g.80gb": 1}}),
    Scenario("h100-busy-with-on-busy-fail", (f"{H100}:1",),
             layout(mig([0], {"7g.80gb": 1}), policy={"on-busy": "fail"}),
             before=layout(mig([0], {"1g.10gb": 4, "3g.40gb": 1})), holds=(Hold(0, "1g.10gb", 2),),
             state="failed", unchanged=True, message="on-busy: fail"),
    # an infeasible GPU refuses the whole file by default (test_mig_scenarios checks that too);
    # under on-infeasible: skip-gpu the pass takes the file and fails that GPU, changing nothing
    Scenario("h100-infeasible-changes-nothing", (f"{H100}:1",),
             layout(mig([0], {"4g.40gb": 1, "3g.40gb": 2}), policy={"on-infeasible": "skip-gpu"}),
             before=layout(mig([0], BALANCED_H100)), state="failed", unchanged=True,
             message="needs 12 of 8 memory slices"),
    Scenario("device-filter-on-mixed-host", (f"{H100}:2", f"{H200}:2"),
             layout(mig("all", {"3g.71gb": 2}, **{"device-filter": "10de:2335"}),
                    mig("all", None, **{"device-filter": "0x233010DE"})),
             expect={0: None, 1: None, 2: {"3g.71gb": 2}, 3: {"3g.71gb": 2}}),
    # --- H200 -----------------------------------------------------------------------------------
    Scenario("h200-partial-mig", (f"{H200}:4",), layout(mig([0], {"1g.18gb": 4, "3g.71gb": 1}), mig([1, 2, 3], None)),
             expect={0: {"1g.18gb": 4, "3g.71gb": 1}, 1: None}),
    Scenario("h200-all-1g-to-1g.35gb-and-3g", (f"{H200}:1",), layout(mig([0], {"1g.35gb": 2, "3g.71gb": 1})),
             before=layout(mig([0], {"1g.18gb": 7})), expect={0: {"1g.35gb": 2, "3g.71gb": 1}}),
    Scenario("h200-2x3g", (f"{H200}:2",), layout(mig([0], {"3g.71gb": 2}), mig([1], None)),
             expect={0: {"3g.71gb": 2}, 1: None}),
    Scenario("h200-ci-subdivision-of-4g", (f"{H200}:1",), layout(mig([0], {"2c.4g.71gb": 2, "3g.71gb": 1})),
             expect={0: {"2c.4g.71gb": 2, "3g.71gb": 1}}),
    Scenario("h200-infeasible", (f"{H200}:1",),
             layout(mig([0], {"3g.71gb": 2, "4g.71gb": 1}), policy={"on-infeasible": "skip-gpu"}),
             before=layout(mig([0], {"1g.18gb": 7})), state="failed", unchanged=True,
             message="needs 12 of 8 memory slices on NVIDIA H200"),
    Scenario("h200-transient-nvml-error-is-retried", (f"{H200}:1",), layout(mig([0], {"1g.18gb": 7})),
             faults=(("nvmlDeviceCreateGpuInstanceWithPlacement", 2, 999),), expect={0: {"1g.18gb": 7}}),
    # --- A100 40GB (Ampere: a mode change waits for a reset) ----------------------------------
    Scenario("a100-mig-on-resets-only-that-gpu", (f"{A100}:3",), layout(mig([1], {"3g.20gb": 2}), mig([0, 2], None)),
             expect={1: {"3g.20gb": 2}, 0: None, 2: None}, resets=1),
    Scenario("a100-reset-never-needs-an-operator", (f"{A100}:1",),
             layout(mig([0], {"7g.40gb": 1}), policy={"reset": "never"}), state="reset-required"),
    Scenario("a100-7x1g-to-3g-plus-4x1g", (f"{A100}:1",), layout(mig([0], {"3g.20gb": 1, "1g.5gb": 4})),
             before=layout(mig([0], {"1g.5gb": 7})), expect={0: {"3g.20gb": 1, "1g.5gb": 4}}, resets=0),
    Scenario("a100-balanced", (f"{A100}:1",), layout(mig([0], {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1})),
             before=layout(mig([0], {"7g.40gb": 1})), expect={0: {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}}),
    Scenario("a100-one-gpu-fails-others-converge", (f"{A100}:3",), layout(mig("all", {"2g.10gb": 3})),
             before=layout(mig("all", {"7g.40gb": 1})),
             faults=(("nvmlDeviceCreateGpuInstanceWithPlacement", 1, 3),),
             expect={0: {"2g.10gb": 3}, 1: {"2g.10gb": 3}, 2: {"2g.10gb": 3}}, fails_one_of=(0, 1, 2),
             state="failed", message="Not Supported"),
]
