"""`gpud qualify`: the entry point of a host's qualification (read-only by default).

Wiring only, like daemon.py: it takes the real host or, with `--sim DIR` (and `--replay CAPTURE`),
the simulator through gpud.hardware.build_hardware, the one seam between the two, and hands the adapters
to gpud.qualify.checks (read-only) or gpud.qualify.exercise (`--mutate`).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from typing import Literal

from gpud.engine.apply_lock import ApplyLock, ApplyLockBusy, ApplyLockRefused
from gpud.hardware import Hardware, Host, HostConfig, build_hardware
from gpud.host.host_services import HostServices
from gpud.host.nvidia.smi_query import NvidiaSmi
from gpud.layout.match import DEFAULT_MATCH
from gpud.qualify.report import Check, Report, counts, render_text, to_json, verdict

CONFIRM = "--yes-i-understand-this-reconfigures-GPU"


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gpud qualify", description=(
        "Check what gpud needs on this host and what may stop it. Read-only unless --mutate."))
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--output", metavar="PATH", help="also write the report here (PATH.json gets the JSON)")
    ap.add_argument("--nvidia-smi", metavar="PATH", help="nvidia-smi to run (default: the one on PATH; "
                    "with --sim, DIR/bin/nvidia-smi)")
    ap.add_argument("--sriov-manage", metavar="PATH", help="NVIDIA's tool that enables a GPU's SR-IOV VFs "
                    "(default /usr/lib/nvidia/sriov-manage; with --sim, DIR/bin/sriov-manage)")
    ap.add_argument("--sim", metavar="DIR", help="qualify the simulated host in DIR")
    ap.add_argument("--replay", metavar="CAPTURE", help="with --sim DIR: NVML answers from a real GPU's capture")
    ap.add_argument("--mutate", metavar="GPU", help="exercise every hardware path once on this idle GPU "
                    "(PCI address, UUID, or index in PCI-address order of the GPUs present) and restore it; needs " + CONFIRM)
    ap.add_argument(CONFIRM, dest="confirmed", action="store_true",
                    help="confirm that --mutate may reconfigure the GPU (MIG on/off, resets, driver rebinds)")
    ap.add_argument("--lock", help="with --mutate: gpud's host-wide apply lock, held while exercising "
                    "(default /run/gpud/apply.lock, or DIR/apply.lock with --sim)")
    ap.add_argument("--unbind-timeout", type=float, default=30.0, help="seconds before an unbind is declared stuck")
    ap.add_argument("--log-level", default=os.environ.get("GPUD_LOG_LEVEL", "WARNING"))
    args = ap.parse_args(argv)
    if args.replay and not args.sim:
        ap.error("--replay needs --sim DIR (laid out by python -m gpud.sim.replay_nvml CAPTURE DIR)")
    if args.mutate and not args.confirmed:
        ap.error(f"--mutate {args.mutate} reconfigures that GPU (MIG on and off, GPU and compute instances, "
                 f"resets, vfio-pci and back): add {CONFIRM} to go ahead")
    if args.mutate and args.replay:
        ap.error("--mutate cannot run on a replay: a capture can be read, not changed")
    return args


def _hardware(args: argparse.Namespace, read_only: bool) -> Host:
    """The adapters and the host-wide apply lock's path, chosen as the daemon chooses them."""
    return build_hardware(HostConfig(sim=args.sim, replay=args.replay, read_only=read_only, lock=args.lock,
                                     nvidia_smi=args.nvidia_smi, sriov_manage=args.sriov_manage,
                                     unbind_timeout=args.unbind_timeout))


def _exercise_under_lock(hw: Hardware, lock_path: str, args: argparse.Namespace) -> list[Check]:
    """--mutate holds gpud's host-wide apply lock, so no gpud pass changes the host meanwhile; a
    gpud that is applying now makes it refuse rather than wait."""
    from gpud.qualify.exercise import exercise

    try:
        with ApplyLock(lock_path).held_now():
            return exercise(hw, args.mutate, match=DEFAULT_MATCH, unbind_timeout=args.unbind_timeout)
    except ApplyLockRefused as e:
        return [Check("exercise", "apply lock", "fail", str(e), "nothing was changed")]
    except ApplyLockBusy as e:
        return [Check("exercise", "apply lock", "fail", str(e),
                      "nothing was changed; stop gpud (systemctl stop gpud) and run it again")]


def _services(args: argparse.Namespace) -> HostServices:
    if not args.sim:
        return HostServices()
    root = os.path.abspath(args.sim)
    return HostServices(proc_root=os.path.join(root, "proc"), sys_root=os.path.join(root, "sys"),
                        run_root=os.path.join(root, "run"), modules_root=os.path.join(root, "lib/modules"))


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def run(args: argparse.Namespace) -> Report:
    started = _now()
    smi = NvidiaSmi(args.nvidia_smi or (os.path.join(args.sim, "bin", "nvidia-smi") if args.sim else None))
    services = _services(args)
    if args.mutate:
        opened = _hardware(args, read_only=False)
        hw = opened.hw
        checks = _exercise_under_lock(hw, opened.lock_path, args)
        mode: Literal["read-only", "mutate"] = "mutate"
    else:
        from gpud.qualify.checks import read_only_checks

        hw = _hardware(args, read_only=True).hw
        checks = read_only_checks(hw, services, smi, DEFAULT_MATCH)
        mode = "read-only"
    try:
        hw.nvml.close()
    except Exception:  # noqa: BLE001 - closing must not hide the report
        pass
    host = f"simulated host {os.path.abspath(args.sim)}" if args.sim else socket.gethostname()
    return Report(mode=mode, host=host, started=started, finished=_now(), checks=checks,
                  verdict=verdict(checks, mode), counts=counts(checks))


EXIT = {"ok": 0, "warn": 0, "unknown": 0, "fail": 3}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[2:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    report = run(args)
    text = render_text(report)
    data = to_json(report)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        with open(args.output + ".json", "wb") as f:
            f.write(data)
    sys.stdout.write(data.decode() if args.json else text)
    return EXIT[report.verdict.status]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
