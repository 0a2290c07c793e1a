"""layout.yaml v1 as typed records: what `gpud.layout.parse` produces once the text is valid.

The records hold normalised values (PCI addresses lower case with a 4-digit domain, PCI ids as
ints) so that nothing downstream re-parses strings. Field names encode back to the file's
kebab-case keys (`rename="kebab"`), so `msgspec.json.encode(layout)` shows the layout as written.
Line numbers are not kept here but in `ParsedLayout.lines`, keyed by the same key paths the error
messages use, so these records stay plain data.
"""

from __future__ import annotations

from typing import Literal, get_args

from msgspec import Struct, field

WORKLOADS = ("container", "vm-passthrough", "vm-vgpu")
ON_BUSY = ("wait", "fail")
RESET = ("per-gpu", "never")
REBOOT = ("never", "allow")
# A file with a GPU the planner cannot converge (`7 x 1g.10gb` on an A100 40GB): refused whole, as
# `gpudctl check` says INVALID (the default), or taken with that GPU failed and the others applied
ON_INFEASIBLE = ("refuse-file", "skip-gpu")
# auto: a saved file is applied at once; manual: only `gpudctl apply` changes GPUs (status says
# what is pending), so a file can be saved, planned and then applied
APPLY = ("auto", "manual")
# Hardware changed behind gpud (another tool changed MIG or a binding): a pass puts the layout back
# (converge), or status, an event and the metric only say so (report)
ON_DRIFT = ("converge", "report")
LEASE_PLACEMENT = ("pack", "spread")  # across dynamic GPUs: fill used GPUs first, or the emptiest first
LEASE_MIG_MODE = ("follow", "keep-on")  # Hopper+: MIG mode on at the first lease, off after the last; or kept on
DYNAMIC = "dynamic"  # `mig-devices: dynamic`: the GPU's instances are made by leases (gpud.engine.leases)
# The hook phases, in the order an apply passes them (mig-parted's names); the engine runs them.
HookPhase = Literal["apply-start", "pre-apply-mode", "pre-apply-config", "apply-exit"]
HOOK_PHASES: tuple[HookPhase, ...] = get_args(HookPhase)
UNIT_SUFFIXES = (
    ".service", ".socket", ".device", ".mount", ".automount", ".swap", ".target", ".path", ".timer",
    ".slice", ".scope",
)

# PCI classes of a GPU, as the top 16 bits of sysfs `class` (0x030200 -> 0x0302).
VGA_CLASS = 0x0300
CONTROLLER_3D_CLASS = 0x0302
GPU_CLASSES = (VGA_CLASS, CONTROLLER_3D_CLASS)


class PciId(Struct, frozen=True, order=True, omit_defaults=True):
    """A vendor:device pair, the unit of `device-filter`; with a subsystem (mig-parted's
    `0xDEVVEN:0xSUBDEVSUBVEN`, pkg/types/device.go) it matches only cards of that subsystem."""

    vendor: int
    device: int
    subsystem_vendor: int | None = None
    subsystem_device: int | None = None

    def matches(self, vendor: int, device: int, subsystem_vendor: int | None = None,
                subsystem_device: int | None = None) -> bool:
        """mig-parted's DeviceID.Matches: vendor and device, and the subsystem where the filter
        names one (a card whose subsystem is unknown, a gone GPU, is matched on the first two)."""
        if (vendor, device) != (self.vendor, self.device):
            return False
        if self.subsystem_vendor is None or subsystem_vendor is None:
            return True
        return (subsystem_vendor, subsystem_device) == (self.subsystem_vendor, self.subsystem_device)

    def __str__(self) -> str:
        sub = (f" subsystem {self.subsystem_vendor:04x}:{self.subsystem_device:04x}"
               if self.subsystem_vendor is not None and self.subsystem_device is not None else "")
        return f"{self.vendor:04x}:{self.device:04x}{sub}"


# A device selector: an int is a GPU index; a str is a PCI address ("0000:3b:00.0", normalised)
# or a GPU UUID ("GPU-<uuid>", lower-case hex).
Selector = int | str


class DeviceEntry(Struct, frozen=True, rename="kebab"):
    """One item of a layout: which GPUs, and what they should be."""

    devices: Literal["all"] | tuple[Selector, ...]
    device_filter: tuple[PciId, ...] = ()  # empty: no filtering
    workload: str = "container"
    mig_enabled: bool | None = None  # None: the entry says nothing about MIG
    mig_devices: dict[str, int] = field(default_factory=dict)  # names as written, counts > 0 only
    vgpu_devices: dict[str, int] = field(default_factory=dict)  # vm-vgpu only; applying is out of scope
    mig_dynamic: bool = False  # `mig-devices: dynamic`: instances come from leases, not from the file


# What the GPU Operator means by the layout it names on its own (nvidia.com/mig.config=all-disabled,
# set by its node-labeling controller on a MIG-capable node without the label): every GPU with MIG
# off, whole, for containers. Under --kube-node the parser provides it when the file lacks it.
ALL_DISABLED_NAME = "all-disabled"
ALL_DISABLED: tuple[DeviceEntry, ...] = (DeviceEntry(devices="all", workload="container", mig_enabled=False),)


class MatchRule(Struct, frozen=True, rename={"class_": "class"}):
    """Which PCI functions are GPUs gpud manages. `class_` is the 16-bit class (0x0302); None means
    a display or 3D controller, so a vendor-only rule never picks up NVSwitches or audio."""

    vendor: int
    device: int | None = None
    class_: int | None = None


DEFAULT_MATCH: tuple[MatchRule, ...] = (
    MatchRule(vendor=0x10DE, class_=VGA_CLASS),
    MatchRule(vendor=0x10DE, class_=CONTROLLER_3D_CLASS),
)


class Policy(Struct, frozen=True, rename="kebab"):
    drain_units: tuple[str, ...] = ()  # stopped before a GPU is changed, started after
    on_busy: str = "wait"  # wait | fail: when processes hold what must change
    reset: str = "per-gpu"  # per-gpu | never
    reboot: str = "never"  # never | allow
    on_infeasible: str = "refuse-file"  # refuse-file | skip-gpu
    apply: str = "auto"  # auto | manual
    on_drift: str = "converge"  # converge | report: when the hardware no longer matches a converged GPU
    lease_group: str | None = None  # a group whose members may lease and release (root always may)
    lease_placement: str = "pack"  # pack | spread: how leases are spread over dynamic GPUs
    lease_mig_mode: str = "follow"  # follow | keep-on: MIG mode of a dynamic Hopper+ GPU without leases


class Hook(Struct, frozen=True):
    """One operator command of a hook phase, as the parser checked it (absolute path, string args
    and env, a positive timeout)."""

    command: str  # absolute path; run without a shell
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None  # seconds; None: the runner's default


class Hooks(Struct, frozen=True, rename="kebab"):
    apply_start: tuple[Hook, ...] = ()
    pre_apply_mode: tuple[Hook, ...] = ()
    pre_apply_config: tuple[Hook, ...] = ()
    apply_exit: tuple[Hook, ...] = ()  # always runs, even after a failed apply

    def for_phase(self, phase: HookPhase) -> tuple[Hook, ...]:
        """The hooks of one phase, by the phase's name as written in the file."""
        if phase not in HOOK_PHASES:
            raise ValueError(f"unknown hook phase {phase!r} (known: {', '.join(HOOK_PHASES)})")
        return getattr(self, phase.replace("-", "_"))


class Layout(Struct, frozen=True):
    """A whole layout.yaml. `selected` is the layout in force (filled in when there is only one);
    `layouts_key` records whether the file said `layouts` or mig-parted's `mig-configs`, because
    key paths in messages use the word the user wrote."""

    version: str
    selected: str | None
    layouts: dict[str, tuple[DeviceEntry, ...]]
    layouts_key: str = "layouts"
    match: tuple[MatchRule, ...] = DEFAULT_MATCH
    policy: Policy = Policy()
    hooks: Hooks = Hooks()

    @property
    def entries(self) -> tuple[DeviceEntry, ...]:
        """The entries of the selected layout (none when nothing is selected)."""
        return self.layouts.get(self.selected, ()) if self.selected is not None else ()
