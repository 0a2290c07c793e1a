"""`gpud-sim reboot DIR`: what a host reboot does to the simulated GPUs (docs/hardware/reboot.md).

A reboot is a power cycle of every device and a fresh kernel, so it is modelled per subsystem, each
step a function of the state that says what it cleared:

- processes: every process is gone, with the device nodes it held and any wedged device (`hang`);
- MIG: GPU and compute instances never survive; a pending mode becomes current; the mode itself
  persists on Ampere and is lost on Hopper and later (NVIDIA MIG user guide, "Deployment
  Considerations");
- vGPU / SR-IOV: VFs and vGPU (mdev) devices are gone (gpud/sim/vgpu.py's clear_for_reboot);
- PCI: `driver_override` lives on the kernel's device object and is lost, every function starts
  unbound and no driver module is loaded;
- boot: the devices are added again in PCI-address order; the udev rules under DIR/etc/udev/rules.d
  run on each `add` as udevd would (driver_override assignments, `kmod load` builtins), then the
  native drivers' modules load (modalias) and probe what matches, and the boot id changes.

The daemon is not running across a reboot (the reboot stopped it), so no uevent is sent.
"""

from __future__ import annotations

import fnmatch
import os
import uuid
from collections.abc import Callable
from pathlib import Path

from gpud.profiles import MODELS
from gpud.sim.state import SimState, locked

RULES_DIR = "etc/udev/rules.d"

Step = Callable[[SimState], list[str]]


class RuleError(ValueError):
    """A udev rule the simulated udevd cannot apply: file, line and what was expected."""


def _processes(state: SimState) -> list[str]:
    notes = [f"process {p.pid} ({p.name}) gone" for p in state.processes]
    state.processes.clear()
    if state.hangs:
        notes.append(f"wedged device(s) {', '.join(state.hangs)} power-cycled")
    state.hangs.clear()
    return notes


def mig_mode_persists(arch: str) -> bool:
    """Ampere keeps its MIG mode across reboots, "similar to ECC mode" (NVIDIA MIG user guide,
    Deployment Considerations); Hopper and later do not keep it across a driver reload."""
    return arch == "ampere"


def _mig(state: SimState) -> list[str]:
    notes = []
    for address in sorted(state.gpus):
        gpu = state.gpus[address]
        model = MODELS[gpu.model]
        if not model.mig_capable:
            continue
        if gpu.gis:
            notes.append(f"{address}: {len(gpu.gis)} GPU instance(s) gone")
        gpu.gis.clear()
        if gpu.mig_pending != gpu.mig_mode:
            notes.append(f"{address}: pending MIG mode {gpu.mig_pending} took effect")
            gpu.mig_mode = gpu.mig_pending
        if gpu.mig_mode and not mig_mode_persists(model.arch):
            notes.append(f"{address}: MIG mode lost ({model.arch})")
            gpu.mig_mode = gpu.mig_pending = 0
    return notes


def _vgpu(state: SimState) -> list[str]:
    """SR-IOV VFs and vGPU devices do not survive a reboot (gpud/sim/vgpu.py: clear_for_reboot)."""
    from gpud.sim.vgpu import clear_for_reboot

    notes = []
    for address, v in sorted(state.vgpu.items()):
        if v.vfs:
            notes.append(f"{address}: {len(v.vfs)} VF(s) gone")
        if v.mdevs:
            notes.append(f"{address}: {len(v.mdevs)} mdev vGPU(s) gone")
    clear_for_reboot(state)
    return notes


VGPU_STEP: Step = _vgpu


def _pci(state: SimState) -> list[str]:
    notes = []
    for address in sorted(state.functions):
        f = state.functions[address]
        if f.driver_override:
            notes.append(f"{address}: driver_override {f.driver_override} cleared")
        f.driver_override = None
        f.driver = None
    state.loaded_modules.clear()
    return notes


# The order matters only in that `boot` comes last: it is the kernel starting again.
STEPS: list[Step] = [_processes, _mig, VGPU_STEP, _pci]


# ---- boot: devices added, udev rules applied, modules loaded ---------------------------------------
def _parse_rule(text: str, where: str) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """One rule line -> (matches, attribute assignments, modules to load). Only the forms gpud's
    generator writes (engine/binding/udev_rules.py) and plain matches are understood; anything else is an
    error naming the file and line, never skipped."""
    matches: dict[str, str] = {}
    assigns: dict[str, str] = {}
    modules: list[str] = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        for op in ("==", "+=", "="):
            key, sep, value = token.partition(op)
            if sep:
                break
        if not sep or len(value) < 2 or value[0] != '"' or value[-1] != '"':
            raise RuleError(f"{where}: expected KEY==\"value\", KEY=\"value\" or KEY+=\"value\", got {token!r}")
        key, value = key.strip(), value[1:-1]
        if op == "==" and key in ("ACTION", "SUBSYSTEM", "KERNEL"):
            matches[key] = value
        elif op == "=" and key.startswith("ATTR{") and key.endswith("}"):
            assigns[key[5:-1]] = value
        elif op == "+=" and key == "RUN{builtin}" and value.startswith("kmod load "):
            modules.extend(value.split()[2:])
        else:
            raise RuleError(f"{where}: the simulated udevd does not know {key}{op}\"{value}\"")
    return matches, assigns, modules


def udev_rules(host_dir: str | os.PathLike) -> list[tuple[dict[str, str], dict[str, str], list[str]]]:
    """Every rule of DIR/etc/udev/rules.d/*.rules, in udev's order (file name, then line)."""
    rules_dir = Path(host_dir) / RULES_DIR
    out = []
    for path in sorted(rules_dir.glob("*.rules")) if rules_dir.is_dir() else ():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                out.append(_parse_rule(line, f"{path}:{n}"))
    return out


def _boot(host_dir: str | os.PathLike, state: SimState) -> list[str]:
    from gpud.sim.kernel import _probe, module_name

    notes = []
    rules = udev_rules(host_dir)
    wanted_modules: list[str] = []
    for address in sorted(state.functions):
        f = state.functions[address]
        if not f.present:
            continue
        event = {"ACTION": "add", "SUBSYSTEM": "pci", "KERNEL": address}
        for matches, assigns, modules in rules:
            if all(fnmatch.fnmatchcase(event.get(k, ""), v) for k, v in matches.items()):
                for attr, value in assigns.items():
                    if attr != "driver_override":
                        raise RuleError(f"the simulated PCI device has no writable attribute {attr}")
                    f.driver_override = value or None
                    notes.append(f"{address}: udev rule set driver_override {value}")
                wanted_modules.extend(modules)
        if f.native_driver:
            wanted_modules.append(f.native_driver)  # modalias -> the native driver's module
    for name in wanted_modules:
        mod = module_name(name)
        if mod not in state.loaded_modules:
            state.loaded_modules.append(mod)
    for address in sorted(state.functions):
        f = state.functions[address]
        if f.present:
            _probe(state, f, [])
            notes.append(f"{address}: bound to {f.driver}" if f.driver else f"{address}: no driver")
    state.boot_id = str(uuid.uuid4())
    state.boots += 1
    state.kmsg = []  # the kernel log ring is the running kernel's
    return notes


def reboot(host_dir: str | os.PathLike) -> list[str]:
    """Reboot the simulated host; returns what each subsystem cleared and how the devices came up.
    A bad rules file changes nothing (RuleError)."""
    from gpud.sim.sysfs_tree import render

    udev_rules(host_dir)  # refused before anything changes
    with locked(host_dir) as state:
        notes = [note for step in STEPS for note in step(state)]
        notes += _boot(host_dir, state)
        render(host_dir, state)
    return notes
