"""The simulator's `nvidia-smi`, for what gpud runs it for: `-r -i <GPU>` (a GPU reset), `-pm 0|1
[-i <GPU>]` (persistence mode) and `--query-gpu=persistence_mode --format=csv,noheader [-i <GPU>]`.

    python -m gpud.sim.nvidia_smi --sim DIR -r -i <PCI address | UUID | index>[,...]

`gpud-sim create` writes DIR/bin/nvidia-smi, a wrapper that runs this with `--sim DIR`, and the
daemon started with `--sim DIR` runs that wrapper. It is as strict as the real tool, as far as its
captured output shows (docs/hardware/gpu-reset.md has the sources):

- a GPU is found by NVML index, PCI bus id (`0000:18:00.0` or `00000000:18:00.0`) or UUID, among
  the GPUs bound to nvidia only (one on vfio-pci or unbound is invisible to NVML): else exit 6;
- nvidia not loaded: the real tool's "couldn't communicate with the NVIDIA driver", exit 9;
- refused while anything holds the GPU: a process (`gpud-sim hold`, a process on one of its MIG
  devices) or an open NVML session of another process (gpud's own, if it did not shut NVML down
  first). The wording and exit status 255 are the real tool's; like the real tool it does not name
  the holders (gpud must find them itself);
- persistence mode (docs/hardware/persistence.md has the sources): nvidia-persistenced holds the
  device node of each GPU it persists (gpu-operator#118, NVIDIA/NVSentinel#1690). Where this tool
  reaches the daemon's socket it turns persistence off and on again around the reset itself
  (NVSentinel#1243), so the reset goes through; where it does not (`gpud-sim create
  --persistenced-socket hidden`: the daemon in another container, gpu-operator#118) the hold
  refuses the reset like any other client, and persistence reads as Disabled (NVIDIA/dgx-selinux#3),
  so `-pm 0` finds nothing to do. Legacy mode (`-pm 1`, a driver flag, no daemon) refuses nothing:
  no source shows it refusing a reset, so the kinder rule holds, and it is unknown.
  `-pm 0 -i <GPU>` turns it off ("Disabled persistence mode for GPU ...", "All done."), through the
  daemon when one runs;
- on an NVSwitch system (`gpud-sim create --nvswitch`) nvidia-smi(1)'s `-r` rule by architecture:
  Ampere with Fabric Manager running resets each GPU on its own; Ampere with Fabric Manager stopped
  (`--fabric-manager stopped`) refuses a reset that leaves out an NVLink peer (exit 3), naming the
  GPUs that must be reset with it; Hopper and later have no such dependency;
- otherwise each GPU is reset as the driver would (a pending MIG mode takes effect; MIG off drops
  the GPU instances), counted in the state's `resets[<pci>]["nvidia-smi"]`, and the real tool's
  "GPU 00000000:18:00.0 was successfully reset." is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

from gpud.sim.gpu_rules import reports_persistent, reset_gpu
from gpud.sim.state import SimState, count_reset, load, locked

EXIT_OK = 0
EXIT_INVALID_ARGUMENT = 2
EXIT_NOT_AVAILABLE = 3  # "The requested operation is not available on target device"
EXIT_NOT_FOUND = 6
EXIT_DRIVER_NOT_LOADED = 9
EXIT_OTHER = 255  # what the real tool returns for "In use by another client" (NVSentinel#1690, mig-parted#181)

NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
             "Make sure that the latest NVIDIA driver is installed and running.")


def bus_id(address: str) -> str:
    """nvidia-smi's PCI bus id: an 8-digit domain, upper case (`00000000:1A:00.0`)."""
    domain, rest = address.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}"


def nvml_gpus(state: SimState) -> list[str]:
    """PCI addresses of the GPUs NVML would list, in NVML index order (PCI order)."""
    return sorted(a for a, f in state.functions.items() if f.present and f.driver == "nvidia" and a in state.gpus)


def nvswitches(state: SimState) -> list[str]:
    from gpud.sim.catalog import is_nvswitch

    return sorted(a for a, f in state.functions.items() if f.present and is_nvswitch(f))


def catalog_arch(state: SimState, address: str) -> str:
    from gpud.profiles import MODELS

    return MODELS[state.gpus[address].model].arch


def resolve(state: SimState, ident: str) -> str | None:
    gpus = nvml_gpus(state)
    ident = ident.strip()
    if ident.isdigit():
        i = int(ident)
        return gpus[i] if i < len(gpus) else None
    for a in gpus:
        if ident == state.gpus[a].uuid or ident.lower() in (a.lower(), bus_id(a).lower()):
            return a
    return None


def _reaches_persistenced(state: SimState) -> bool:
    """Whether this tool can talk to nvidia-persistenced (its socket in sight)."""
    return state.persistence == "daemon" and state.persistenced_socket == "reachable"


def holders_of(state: SimState, address: str, own_pid: int, *, persistenced: bool = True) -> list[str]:
    """What keeps the GPU in use: processes holding it or its MIG devices (nvidia-persistenced's
    hold only with `persistenced`), and other processes' open NVML sessions that hold its node."""
    from gpud.sim.state import PERSISTENCED_PID
    from gpud.sim.sysfs_tree import gpu_holders, session_holders

    out = [f"pid {p.pid} {p.name}" for p in gpu_holders(state, address) if persistenced or p.pid != PERSISTENCED_PID]
    out += [f"pid {s.pid} (NVML session)" for s in session_holders(state, address) if s.pid != own_pid]
    return out


def in_use_message(addresses: list[str]) -> str:
    n = len(addresses)
    lines = ["The following GPUs could not be reset:"]
    lines += [f"  GPU {bus_id(a)}: In use by another client" for a in addresses]
    these, device = ("this device", "device") if n == 1 else ("these devices", "devices")
    lines += ["", f"{n} {device} {'is' if n == 1 else 'are'} currently being used by one or more other processes "
              "(e.g., Fabric Manager, CUDA application, graphics application such as an X server, or a "
              "monitoring application such as another instance of nvidia-smi). Please first kill all "
              f"processes using {these} and all compute applications running in the system."]
    return "\n".join(lines)


def reset(host_dir: str | os.PathLike, ids: list[str] | None, out: TextIO | None = None,
          err: TextIO | None = None) -> int:
    """`nvidia-smi -r [-i ids]` on the simulated host; returns the exit status."""
    out, err = out or sys.stdout, err or sys.stderr
    with locked(host_dir) as state:
        targets = _targets(state, ids, out, err)
        if isinstance(targets, int):
            return targets
        if not targets:
            print("No devices were found", file=out)
            return EXIT_NOT_FOUND
        if nvswitches(state) and state.fabric_manager != "running" and any(
                catalog_arch(state, a) == "ampere" for a in targets):
            left_out = [a for a in nvml_gpus(state) if a not in targets]
            if left_out:
                print(f"Unable to reset GPU {', '.join(bus_id(a) for a in targets)}: it is NVLink-connected "
                      f"through NVSwitch to GPUs that must be reset in the same command: "
                      f"{', '.join(bus_id(a) for a in left_out)}", file=out)
                return EXIT_NOT_AVAILABLE
        busy = [a for a in targets if holders_of(state, a, os.getpid(), persistenced=not _reaches_persistenced(state))]
        if busy:
            print(in_use_message(busy), file=out)
            return EXIT_OTHER
        for a in targets:
            reset_gpu(state, a)
            count_reset(state, a, "nvidia-smi")
        from gpud.sim.sysfs_tree import render

        render(host_dir, state)
    for a in targets:
        print(f"GPU {bus_id(a)} was successfully reset.", file=out)
    return EXIT_OK


def _targets(state: SimState, ids: list[str] | None, out: TextIO, err: TextIO) -> list[str] | int:
    """The GPUs `-i ids` names (all without it), or the exit status when the driver is not loaded
    or an id names no GPU (the message printed)."""
    if "nvidia" not in state.loaded_modules:
        print(NO_DRIVER, file=out)
        return EXIT_DRIVER_NOT_LOADED
    if ids is None:
        return nvml_gpus(state)
    found: list[str] = []
    for ident in ids:
        a = resolve(state, ident)
        if a is None:
            print(f"No devices were found matching {ident!r}", file=err)
            return EXIT_NOT_FOUND
        if a not in found:
            found.append(a)
    return found


def persistence(host_dir: str | os.PathLike, ids: list[str] | None, on: bool, out: TextIO | None = None,
                err: TextIO | None = None) -> int:
    """`nvidia-smi -pm 0|1 [-i ids]`: legacy persistence flags, or the daemon's (it then opens or
    closes the GPU's node)."""
    out, err = out or sys.stdout, err or sys.stderr
    with locked(host_dir) as state:
        targets = _targets(state, ids, out, err)
        if isinstance(targets, int):
            return targets
        if on and state.persistence == "off":
            state.persistence = "legacy"
        for a in targets:
            word = "Enabled" if on else "Disabled"
            if reports_persistent(state, a) == on:
                print(f"Persistence mode is already {word} for GPU {bus_id(a)}.", file=out)
                continue
            if a in state.persistent and on:  # held by a daemon out of sight: only the words (unknown)
                print(f"{word} persistence mode for GPU {bus_id(a)}.", file=out)
                continue
            if on:
                state.persistent.append(a)
            else:
                state.persistent.remove(a)
            print(f"{word} persistence mode for GPU {bus_id(a)}.", file=out)
        from gpud.sim.sysfs_tree import render

        render(host_dir, state)
    print("All done.", file=out)
    return EXIT_OK


def query(host_dir: str | os.PathLike, ids: list[str] | None, fields: str, fmt: str, out: TextIO | None = None,
          err: TextIO | None = None) -> int:
    """`--query-gpu=persistence_mode --format=csv,noheader`: one line per GPU."""
    out, err = out or sys.stdout, err or sys.stderr
    names = [f.strip() for f in fields.split(",") if f.strip()]
    known = {"persistence_mode", "pci.bus_id"}
    if not names or any(n not in known for n in names) or "csv" not in fmt.split(","):
        print(f"nvidia-smi (simulated): only --query-gpu={','.join(sorted(known))} --format=csv is implemented",
              file=err)
        return EXIT_INVALID_ARGUMENT
    state = load(host_dir)
    targets = _targets(state, ids, out, err)
    if isinstance(targets, int):
        return targets
    if "noheader" not in fmt.split(","):
        print(", ".join(names), file=out)
    for a in targets:
        values = {"persistence_mode": "Enabled" if reports_persistent(state, a) else "Disabled", "pci.bus_id": bus_id(a)}
        print(", ".join(values[n] for n in names), file=out)
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nvidia-smi", description="The simulated host's nvidia-smi (reset only).")
    ap.add_argument("--sim", required=True, metavar="DIR")
    ap.add_argument("-r", "--gpu-reset", action="store_true")
    ap.add_argument("-i", "--id", metavar="ID[,ID...]")
    ap.add_argument("-pm", "--persistence-mode", choices=("0", "1", "ENABLED", "DISABLED"))
    ap.add_argument("--query-gpu", metavar="FIELDS")
    ap.add_argument("--format", default="csv")
    return ap


def main(argv: list[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(argv)
    asked = [x for x in (args.gpu_reset, args.persistence_mode, args.query_gpu) if x]
    if rest or len(asked) != 1:
        print(f"nvidia-smi (simulated): only one of -r, -pm 0|1, --query-gpu [-i ID] is implemented; got "
              f"{' '.join(rest) or 'none or several'}", file=sys.stderr)
        return EXIT_INVALID_ARGUMENT
    ids = [i for i in args.id.split(",") if i] if args.id else None
    if args.persistence_mode:
        return persistence(args.sim, ids, args.persistence_mode in ("1", "ENABLED"))
    if args.query_gpu:
        return query(args.sim, ids, args.query_gpu, args.format)
    return reset(args.sim, ids)


if __name__ == "__main__":
    sys.exit(main())
