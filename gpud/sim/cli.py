"""`gpud-sim`: make and drive a simulated GPU host directory.

Other tools script against this syntax; keep it stable:
  gpud-sim create DIR --gpu MODEL[:COUNT] ... [--mig-on INDEX ...] [--nvswitch] [--vgpu vfio|mdev]
  gpud-sim hold DIR DEVICE --pid PID [--name NAME] [--vm NAME]
                                DEVICE: PCI address (a GPU, or a VF), GPU UUID, MIG UUID or mdev UUID
  gpud-sim release DIR DEVICE --pid PID
  gpud-sim fault DIR NVML_FUNCTION --nth N --error CODE
  gpud-sim hang DIR PCI | unplug DIR PCI | plug DIR PCI
  gpud-sim reboot DIR                                   what a host reboot does (gpud/sim/reboot.py)
  gpud-sim unit DIR add NAME [--inactive] | unit DIR remove NAME
                                a systemd unit on the simulated host (gpud/sim/services.py)
  gpud-sim stats DIR [--json]               NVML calls, resets, unit manager and logind calls
  gpud-sim show DIR [--json]
  gpud-sim exec DIR [--no-namespace] [--header NVML_H] -- CMD [ARGS...]
                                CMD on the simulated host (gpud/sim/host_exec.py); its exit status
Exit status: 0 done, 1 the host refused (unknown device, nothing to release), 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pynvml

import gpud.sim.catalog as catalog
import gpud.sim.modules_alias as modules_alias
from gpud.pci import normalize_pci
from gpud.sim.state import (
    FABRIC_MANAGER_STATES,
    PERSISTENCE_MODES,
    PERSISTENCED_SOCKETS,
    SimProcess,
    SimState,
    locked,
    state_path,
)


class SimCliError(Exception):
    pass


def create(host_dir: str | os.PathLike, gpu_specs: list[str], mig_on: Sequence[int] = (),
           nvswitch: bool = False, vgpu: str | None = None, persistence: str = "legacy",
           fabric_manager: str = "running", persistenced_socket: str = "reachable",
           driver: str | None = None, cdmm: bool = False) -> SimState:
    """Write DIR/state.json for a new host, render its sysfs/dev/proc trees and write its
    nvidia-smi (DIR/bin/nvidia-smi). `nvswitch`: the GPUs sit on an HGX baseboard with NVSwitches
    (of the first GPU's architecture) and `fabric_manager` ("running" or "stopped") says whether
    nvidia-fabricmanager runs: on Ampere a GPU resets alone only while it does. `vgpu`: the host
    interface ("vfio" or "mdev") of its vGPU-capable GPUs. `persistence`: "legacy" (`nvidia-smi -pm 1`,
    as many hosts and the lent H200 run), "daemon" (nvidia-persistenced) or "off"; on for every GPU.
    `persistenced_socket`: "reachable" (nvidia-smi talks to the daemon) or "hidden" (the daemon out
    of its sight, in another container). `driver`: the driver version (NVML's, /proc/driver/nvidia's),
    which also picks the profile names of a model whose names differ by driver branch. `cdmm`: the
    nvidia module runs CDMM (CoherentGPUMemoryMode=driver)."""
    from gpud.sim.sysfs_tree import lay_out

    d = Path(host_dir)
    if state_path(d).exists():
        raise SimCliError(f"{d}: already a simulated host")
    models = catalog.parse_gpu_specs(gpu_specs)
    state = catalog.build(models, mig_on)
    if driver is not None:
        if not re.fullmatch(r"\d{3}\.\d+(\.\d+)?", driver):
            raise SimCliError(f"--driver {driver!r}: expected a driver version such as 580.159.04")
        state.driver_version = driver
    if cdmm:
        state.coherent_memory_mode = "driver"
    if nvswitch:
        catalog.add_nvswitches(state, catalog.model(models[0]).arch)
    if vgpu is not None:
        import gpud.sim.vgpu as sim_vgpu

        try:
            sim_vgpu.setup(state, vgpu)
        except ValueError as exc:
            raise SimCliError(str(exc)) from None
        if not state.vgpu:
            raise SimCliError(f"--vgpu {vgpu}: none of these GPUs offers vGPU types; vGPU-capable models: "
                              f"{', '.join(catalog.vgpu_capable())}")
    if persistence not in PERSISTENCE_MODES:
        raise SimCliError(f"--persistence {persistence!r}: expected one of {', '.join(PERSISTENCE_MODES)}")
    state.persistence = persistence
    if persistenced_socket not in PERSISTENCED_SOCKETS:
        raise SimCliError(f"--persistenced-socket {persistenced_socket!r}: expected one of "
                          f"{', '.join(PERSISTENCED_SOCKETS)}")
    state.persistenced_socket = persistenced_socket
    if fabric_manager not in FABRIC_MANAGER_STATES:
        raise SimCliError(f"--fabric-manager {fabric_manager!r}: expected one of {', '.join(FABRIC_MANAGER_STATES)}")
    state.fabric_manager = fabric_manager
    state.persistent = sorted(state.gpus) if persistence != "off" else []
    lay_out(d, state)
    modules_alias.write(d, state)
    for tool, module in (("nvidia-smi", "gpud.sim.nvidia_smi"), ("sriov-manage", "gpud.sim.sriov_manage")):
        write_tool(d, tool, module)
    return state


def write_tool(host_dir: str | os.PathLike, name: str, module: str) -> Path:
    """DIR/bin/NAME: the simulated host's tool that `gpud --sim DIR` runs (and `--nvidia-smi` or
    `--sriov-manage` may name), the module run by this interpreter with this checkout on its path."""
    d = Path(os.path.abspath(host_dir))
    path = d / "bin" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    root = Path(__file__).resolve().parents[2]
    path.write_text(f"#!/bin/sh\n# The simulated host's {name} ({module}).\n"
                    f"PYTHONPATH='{root}'${{PYTHONPATH:+:$PYTHONPATH}} exec '{sys.executable}' "
                    f"-m {module} --sim '{d}' \"$@\"\n")
    path.chmod(0o755)
    return path


def resolve_device(state: SimState, device: str) -> tuple[str, str]:
    """DEVICE as given -> (what a SimProcess stores, PCI address of the GPU it is on)."""
    for gpu in state.gpus.values():
        if device == gpu.uuid:
            return gpu.uuid, gpu.address
        for gi in gpu.gis:
            for ci in gi.cis:
                if device == ci.uuid:
                    return ci.uuid, gpu.address
    import gpud.sim.vgpu as sim_vgpu

    mdev = sim_vgpu.find_mdev(state, device)
    if mdev is not None:
        return mdev[1].uuid, mdev[0]
    try:
        address = _norm_pci(device)
    except ValueError:
        address = None
    if address in state.gpus:
        return address, address
    if address in state.functions:  # a vfio-bound non-GPU endpoint can be held through its group
        return address, address
    raise SimCliError(f"no GPU, MIG device, mdev or PCI function {device!r} on this host")


def _norm_pci(text: str) -> str:
    address = normalize_pci(text)
    if address is None:
        raise ValueError(text)
    return address


def _after_holder_change(host_dir: Path, state: SimState, gpu_address: str) -> None:
    from gpud.sim.sysfs_tree import render

    render(host_dir, state)


def _emit_change(host_dir: Path, state: SimState, address: str) -> None:
    import gpud.sim.uevents as uevents

    f = state.functions.get(address)
    uevents.emit(host_dir, "change", "pci", address, driver=f.driver if f else None)


def hold(host_dir: str | os.PathLike, device: str, pid: int, name: str | None = None,
         vm: str | None = None, cdev: bool = False) -> str:
    """A process opens DEVICE; `cdev`: through its vfio cdev (/dev/vfio/devices/vfioN, as an
    iommufd VMM does) instead of /dev/vfio/<group>."""
    from gpud.sim.sysfs_tree import vfio_cdevs

    d = Path(host_dir)
    with locked(d) as st:
        stored, gpu = resolve_device(st, device)
        if cdev and stored not in vfio_cdevs(st):
            raise SimCliError(f"{device} has no vfio cdev (only a function on vfio-pci, a VF with a vGPU type "
                              "or an mdev has one)")
        if not any(p.pid == pid and p.device == stored for p in st.processes):
            st.processes.append(SimProcess(pid=pid, name=name or ("qemu-system-x86" if vm else f"proc{pid}"),
                                           device=stored, real=os.path.exists(f"/proc/{pid}"), vm=vm, cdev=cdev))
        _after_holder_change(d, st, gpu)
    _emit_change(d, st, gpu)
    return stored


def release(host_dir: str | os.PathLike, device: str, pid: int) -> str:
    d = Path(host_dir)
    with locked(d) as st:
        stored, gpu = resolve_device(st, device)
        keep = [p for p in st.processes if not (p.pid == pid and p.device == stored)]
        if len(keep) == len(st.processes):
            raise SimCliError(f"pid {pid} does not hold {device}")
        st.processes = keep
        _after_holder_change(d, st, gpu)
    _emit_change(d, st, gpu)
    return stored


def parse_error_code(text: str) -> int:
    """"19", "IN_USE", "NVML_ERROR_IN_USE", "in-use" -> 19."""
    t = text.strip()
    if t.lstrip("-").isdigit():
        return int(t)
    name = t.upper().replace("-", "_")
    if not name.startswith("NVML_ERROR_"):
        name = "NVML_ERROR_" + name
    value = getattr(pynvml, name, None)
    if not isinstance(value, int):
        raise SimCliError(f"unknown NVML error {text!r}")
    return value


def fault(host_dir: str | os.PathLike, function: str, nth: int, error: int) -> None:
    import gpud.sim.nvml_lib as nvml_lib
    from gpud.sim.state import SimFault

    if nth < 1:
        raise SimCliError("--nth counts from 1")
    if not any(nvml_lib.fault_matches(function, s) for s in nvml_lib.function_names()):
        raise SimCliError(f"the simulated NVML has no function {function!r}")
    with locked(host_dir) as st:
        st.faults.append(SimFault(function=function, nth=nth, error=error))


def stats(host_dir: str | os.PathLike) -> dict:
    from gpud.sim import services

    with locked(host_dir, write=False) as st:
        out = {"calls": dict(sorted(st.calls.items())),
               "resets": {pci: dict(sorted(by_method.items())) for pci, by_method in sorted(st.resets.items())}}
    svc = services.read(host_dir)
    out["services"] = {"calls": dict(sorted(svc.calls.items())), "units": dict(sorted(svc.units.items())),
                       "reboots": list(svc.reboots)}
    return out


def summary(state: SimState) -> dict:
    """A JSON-able view of the host for `show`."""
    from gpud.sim.inferred import sim_model

    gpus = []
    for index, address in enumerate(sorted(state.gpus)):
        g = state.gpus[address]
        f = state.functions.get(address)
        m = sim_model(g.model, state.driver_version)
        names = {p.id: p.name for p in m.profiles}
        gpus.append({
            "index": index, "pci": address, "model": g.model, "name": m.name, "uuid": g.uuid,
            "driver": f.driver if f else None, "present": f.present if f else False,
            "iommu_group": f.iommu_group if f else None,
            "mig": None if not m.mig_capable else {"current": g.mig_mode, "pending": g.mig_pending,
                                                    "gi_id_order": g.gi_id_order},
            "instances": [{"gi": gi.id, "profile": names.get(gi.profile_id, str(gi.profile_id)),
                           "placement": f"{gi.start}:{gi.size}",
                           "cis": [{"ci": ci.id, "profile_id": ci.profile_id, "uuid": ci.uuid, "start": ci.start}
                                   for ci in gi.cis]}
                          for gi in sorted(g.gis, key=lambda x: x.id)],
            "vgpu": _vgpu_summary(state, address),
        })
    vfs = {vf.address for v in state.vgpu.values() for vf in v.vfs}
    others = [{"pci": f.address, "id": f"{f.vendor:04x}:{f.device:04x}", "class": f"0x{f.class_code:06x}",
               "driver": f.driver, "present": f.present}
              for a, f in sorted(state.functions.items()) if a not in state.gpus and a not in vfs]
    return {"gpus": gpus, "functions": others,
            "processes": [msgspec.to_builtins(p) for p in state.processes],
            "faults": [msgspec.to_builtins(x) for x in state.faults], "hangs": list(state.hangs),
            "modules": list(state.loaded_modules), "driver_version": state.driver_version}


def _vgpu_summary(state: SimState, address: str) -> dict | None:
    import gpud.sim.vgpu as sim_vgpu

    v = state.vgpu.get(address)
    if v is None:
        return None
    return {"interface": v.interface, "vfs": len(v.vfs),
            "devices": [{"type": t.name, "gi": gi if gi >= 0 else None} for t, gi in sim_vgpu.placed(state, address)],
            "vf_types": {vf.address: vf.vgpu_type for vf in v.vfs if vf.vgpu_type},
            "mdevs": [{"uuid": m.uuid, "parent": m.parent, "type": f"nvidia-{m.type_id}"} for m in v.mdevs]}


def _print_show(s: dict) -> None:
    print(f"driver {s['driver_version']}; modules: {', '.join(s['modules']) or '-'}")
    for g in s["gpus"]:
        mig = "n/a" if g["mig"] is None else (f"{g['mig']['current']} (pending {g['mig']['pending']}; "
                                               f"GI ids: {g['mig']['gi_id_order']})")
        state = g["driver"] or "unbound" if g["present"] else "unplugged"
        print(f"GPU {g['index']} {g['pci']} {g['name']} [{state}] group {g['iommu_group']} MIG {mig}  {g['uuid']}")
        if g["vgpu"] is not None:
            kinds = ", ".join(d["type"] for d in g["vgpu"]["devices"]) or "no vGPUs"
            print(f"  vGPU ({g['vgpu']['interface']}, {g['vgpu']['vfs']} VFs): {kinds}")
        for i in g["instances"]:
            cis = ", ".join(f"CI {c['ci']} at {c['start']} {c['uuid']}" for c in i["cis"]) or "no CI"
            print(f"    GI {i['gi']} {i['profile']} @{i['placement']}: {cis}")
    for f in s["functions"]:
        print(f"    {f['pci']} {f['id']} class {f['class']} [{f['driver'] or 'unbound'}]")
    for p in s["processes"]:
        print(f"holder pid {p['pid']} {p['name']} on {p['device']}")
    for x in s["faults"]:
        print(f"fault: call #{x['nth']} of {x['function']} -> {x['error']} (seen {x['seen']})")
    for h in s["hangs"]:
        print(f"hang: unbind of {h} blocks")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gpud-sim", description="Make and drive a simulated GPU host.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("create", help="make a host directory")
    p.add_argument("dir")
    p.add_argument("--gpu", action="append", required=True, metavar="MODEL[:COUNT]",
                   help=f"models: {', '.join(catalog.offered())}")
    p.add_argument("--mig-on", type=int, nargs="+", action="extend", default=[], metavar="INDEX")
    p.add_argument("--nvswitch", action="store_true",
                   help="an HGX baseboard with NVSwitches (and nvidia-fabricmanager, see --fabric-manager)")
    p.add_argument("--fabric-manager", choices=FABRIC_MANAGER_STATES,
                   help="with --nvswitch: nvidia-fabricmanager running (default) or stopped; on Ampere a GPU "
                   "resets alone only while it runs, Hopper and later do not depend on it")
    p.add_argument("--vgpu", choices=("vfio", "mdev"),
                   help="vGPU host interface of the vGPU-capable GPUs (cards without SR-IOV get mdev)")
    p.add_argument("--persistence", choices=PERSISTENCE_MODES, default="legacy",
                   help="persistence mode on every GPU: legacy (nvidia-smi -pm 1, the default), daemon "
                   "(nvidia-persistenced holds the GPUs), off (docs/hardware/persistence.md)")
    p.add_argument("--persistenced-socket", choices=PERSISTENCED_SOCKETS, default="reachable",
                   help="with --persistence daemon: nvidia-smi reaches the daemon's socket and handles its "
                   "hold around a reset (default), or not (hidden: the hold refuses nvidia-smi -r)")
    p.add_argument("--driver", metavar="VERSION",
                   help=f"the NVIDIA driver version the host runs (default {SimState().driver_version}); where a "
                   "model's MIG profile names differ by driver branch (GB300: R59x 1g.35gb, R61x 1g.31gb) NVML "
                   "answers this driver's")
    p.add_argument("--cdmm", action="store_true",
                   help="the nvidia module loaded with NVreg_CoherentGPUMemoryMode=driver (CDMM): Grace GPUs refuse "
                   "MIG (docs/hardware/grace.md)")
    for name in ("hold", "release"):
        p = sub.add_parser(name, help=f"{name} a GPU or MIG device as a process would")
        p.add_argument("dir")
        p.add_argument("device", help="PCI address (GPU or VF), GPU UUID, MIG UUID or mdev UUID")
        p.add_argument("--pid", type=int, required=True)
        if name == "hold":
            p.add_argument("--name")
            p.add_argument("--vm", help="the holder is a VM of this name (qemu command line -name guest=NAME)")
            p.add_argument("--cdev", action="store_true",
                           help="open the vfio device's cdev (/dev/vfio/devices/vfioN, iommufd) instead of its group")
    p = sub.add_parser("fault", help="make the nth next call of an NVML function fail")
    p.add_argument("dir")
    p.add_argument("function")
    p.add_argument("--nth", type=int, default=1)
    p.add_argument("--error", required=True, help="number or name (IN_USE, NVML_ERROR_IN_USE)")
    for name, what in (("hang", "the next unbind of this device never returns"),
                       ("unplug", "surprise-remove the card"), ("plug", "hot-add the card back")):
        p = sub.add_parser(name, help=what)
        p.add_argument("dir")
        p.add_argument("pci")
    p = sub.add_parser("xid", help="the nvidia driver logs an Xid for a GPU (a record in DIR/dev/kmsg)")
    p.add_argument("dir")
    p.add_argument("pci")
    p.add_argument("code", type=int)
    p.add_argument("--text", default="", help="the message after the code")
    p = sub.add_parser("reboot", help="reboot the host: instances and overrides gone, udev rules applied")
    p.add_argument("dir")
    p = sub.add_parser("unit", help="install or remove a systemd unit of the simulated host")
    p.add_argument("dir")
    p.add_argument("action", choices=("add", "remove"))
    p.add_argument("unit")
    p.add_argument("--inactive", action="store_true", help="installed but not running")
    for name in ("stats", "show"):
        p = sub.add_parser(name)
        p.add_argument("dir")
        p.add_argument("--json", action="store_true")
    p = sub.add_parser("exec", help="run a program against the simulated host (its NVML, nvidia-smi and, as root, sysfs)")
    p.add_argument("dir")
    p.add_argument("--no-namespace", action="store_true", help="no private mount namespace, even as root")
    p.add_argument("--header", help="NVML's nvml.h to build the library from (default: go-nvml's, via Go)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "exec":
        import gpud.sim.host_exec as host_exec

        command = list(args.command)
        if "--" in command:  # exec options given after DIR, before the `--`
            cut = command.index("--")
            args = _parser().parse_args(["exec", *command[:cut], args.dir, "--", *command[cut + 1:]])
            command = list(args.command)
        if command[:1] == ["--"]:
            command = command[1:]
        try:
            return host_exec.run(args.dir, command, namespace=False if args.no_namespace else None, header=args.header)
        except host_exec.ExecError as e:
            print(f"gpud-sim exec: {e}", file=sys.stderr)
            return 125
    try:
        if args.cmd == "create":
            try:
                if args.fabric_manager and not args.nvswitch:
                    raise SimCliError("--fabric-manager needs --nvswitch (Fabric Manager runs on NVSwitch hosts)")
                state = create(args.dir, args.gpu, args.mig_on, args.nvswitch, args.vgpu, args.persistence,
                               args.fabric_manager or "running", args.persistenced_socket, args.driver, args.cdmm)
            except catalog.CatalogError as e:
                print(f"gpud-sim: {e}", file=sys.stderr)
                return 2
            for key in sorted({g.model for g in state.gpus.values()}):
                if (parts := catalog.inferred_parts(catalog.model(key, state.driver_version))) is not None:
                    print(f"gpud-sim: {key} has inferred cells, served as if a source gave them "
                          f"(docs/hardware/mig-profiles.md): {parts}", file=sys.stderr)
        elif args.cmd == "hold":
            hold(args.dir, args.device, args.pid, args.name, args.vm, args.cdev)
        elif args.cmd == "release":
            release(args.dir, args.device, args.pid)
        elif args.cmd == "fault":
            fault(args.dir, args.function, args.nth, parse_error_code(args.error))
        elif args.cmd in ("hang", "unplug", "plug"):
            import gpud.sim.kernel as kernel

            pci = _norm_pci(args.pci)
            getattr(kernel, args.cmd)(args.dir, pci)
        elif args.cmd == "xid":
            import gpud.sim.kernel as kernel

            print(kernel.xid(args.dir, _norm_pci(args.pci), args.code, args.text))
        elif args.cmd == "unit":
            from gpud.sim import services

            state_path(args.dir).stat()  # a simulated host, or FileNotFoundError says it is not
            if args.action == "add":
                services.install(args.dir, args.unit, active=not args.inactive)
            else:
                services.remove(args.dir, args.unit)
        elif args.cmd == "reboot":
            from gpud.sim.reboot import reboot

            for note in reboot(args.dir):
                print(note)
        elif args.cmd == "stats":
            s = stats(args.dir)
            if args.json:
                print(json.dumps(s))
            else:
                for fn, n in s["calls"].items():
                    print(f"{n:8d}  {fn}")
                for pci, by_method in s["resets"].items():
                    print(f"reset {pci}: " + ", ".join(f"{m} {n}" for m, n in by_method.items()))
                for fn, n in s["services"]["calls"].items():
                    print(f"{n:8d}  {fn}")
                for unit, active in s["services"]["units"].items():
                    print(f"unit {unit}: {active}")
                for reason in s["services"]["reboots"]:
                    print(f"reboot requested: {reason} (gpud-sim reboot DIR does it)")
        elif args.cmd == "show":
            with locked(args.dir, write=False) as st:
                s = summary(st)
            if args.json:
                print(json.dumps(s, indent=1))
            else:
                _print_show(s)
    except (SimCliError, LookupError, ValueError) as e:
        print(f"gpud-sim: {e}", file=sys.stderr)
        return 1
    except FileNotFoundError as e:
        print(f"gpud-sim: {args.dir}: not a simulated host ({e.strerror}: {e.filename})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
