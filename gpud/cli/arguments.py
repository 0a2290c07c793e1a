"""gpudctl's command line: the top-level options and each command's sub-parser, wired to its
function in gpud.cli.commands. Built per run for the one command named (see build_parser): the
parser is most of a `gpudctl status`'s start-up otherwise.
"""

from __future__ import annotations

import argparse
import os

from gpud.cli.commands import (
    DEFAULT_LAYOUT,
    EXIT_STILL_WORKING,
    client_version,
    cmd_apply,
    cmd_check,
    cmd_events,
    cmd_labels,
    cmd_lease,
    cmd_leases,
    cmd_list,
    cmd_mig_compute,
    cmd_mig_compute_profiles,
    cmd_mig_instances,
    cmd_mig_profiles,
    cmd_passthrough,
    cmd_plan,
    cmd_release,
    cmd_reload,
    cmd_select,
    cmd_status,
    cmd_version,
    cmd_vgpu_types,
    seconds,
    terminal_width,
)
from gpud.cli.transport import DEFAULT_SOCKET, DEFAULT_TIMEOUT
from gpud.wire import frames

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class _Formatter(argparse.HelpFormatter):
    """argparse's help formatter with its width given: argparse builds one per add_argument, and
    without a width each imports shutil (and its archive modules) to ask the terminal's size."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=terminal_width(80) - 2)  # argparse's own default: columns - 2


class _Parser(argparse.ArgumentParser):
    """The parser class of gpudctl and, through add_subparsers, of each command's sub-parser."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(**kwargs)


def _with_json(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--json", action="store_true", help="print the reply as JSON")
    return parser


def _add_status(sub: Any) -> None:
    s = _with_json(sub.add_parser("status", help="GPUs, their state and the layout"))
    s.add_argument("gpu", nargs="?", metavar="GPU", help="one GPU in detail: index, PCI address or UUID")
    s.add_argument("--fresh", action="store_true",
                   help="wait for a new read of the host (default: gpud's current observation, at once)")
    s.add_argument("--kube", action="store_true", help="what Kubernetes will advertise, and the label protocol")
    s.set_defaults(func=cmd_status)


def _add_check(sub: Any) -> None:
    s = _with_json(sub.add_parser("check", help="validate a layout file against this host"))
    s.add_argument("file", nargs="?", metavar="FILE",
                   help=f"layout file, '-' for stdin (default: the daemon's, else {DEFAULT_LAYOUT})")
    s.add_argument("--all-layouts", action="store_true",
                   help="check every layout of the file, not only the selected one (a node label may pick any)")
    s.set_defaults(func=cmd_check)


def _add_labels(sub: Any) -> None:
    s = _with_json(sub.add_parser("labels", help="the node labels in NFD's feature file"))
    s.set_defaults(func=cmd_labels)


def _add_plan(sub: Any) -> None:
    s = _with_json(sub.add_parser("plan", help="what apply would do, and what it would disrupt"))
    s.add_argument("file", nargs="?", metavar="FILE", help="plan this file instead of the loaded layout")
    s.set_defaults(func=cmd_plan)


def _add_apply(sub: Any) -> None:
    s = _with_json(sub.add_parser("apply", help="converge now"))
    s.add_argument("--wait", action="store_true", help="wait until converged, blocked or failed")
    s.add_argument("--timeout", type=float, metavar="S", help="give up waiting after S seconds")
    s.add_argument("-c", "--config", metavar="NAME", help="first select layout NAME of the file, over its "
                   "`selected` (as nvidia-mig-parted apply -c; kept across restarts)")
    s.set_defaults(func=cmd_apply)


def _add_select(sub: Any) -> None:
    s = _with_json(sub.add_parser("select", help="put a layout of the file in force, over its `selected`"))
    s.add_argument("name", nargs="?", metavar="NAME", help="a layout of the file (mig-parted's -c NAME)")
    s.add_argument("--file", action="store_true", help="the file's own `selected` again")
    s.set_defaults(func=cmd_select)


def _add_reload(sub: Any) -> None:
    s = _with_json(sub.add_parser("reload", help="re-read the layout file"))
    s.set_defaults(func=cmd_reload)


def _add_events(sub: Any) -> None:
    s = _with_json(sub.add_parser("events", help="recent events"))
    s.add_argument("-f", "--follow", action="store_true", help="keep printing new events")
    s.set_defaults(func=cmd_events)


def _add_version(sub: Any) -> None:
    s = _with_json(sub.add_parser("version", help="versions of gpudctl, gpud, driver and NVML"))
    s.set_defaults(func=cmd_version)


def _add_per_gpu_listing(sub: Any, group: str, group_help: str, name: str, name_help: str, func: Any) -> None:
    """`gpudctl GROUP NAME [--gpu SEL] [--json]`: a per-GPU table (mig profiles, vgpu types)."""
    s = sub.add_parser(group, help=group_help)
    listings = s.add_subparsers(dest=f"{group}_command", metavar="COMMAND", required=True)
    s = _with_json(listings.add_parser(name, help=name_help))
    s.add_argument("--gpu", metavar="SEL", help="index, PCI address or UUID")
    s.set_defaults(func=func)


def _add_mig(sub: Any) -> None:
    s = sub.add_parser("mig", help="MIG information (nvidia-smi mig -lgip, -lgi, -lci, -lcip)")
    listings = s.add_subparsers(dest="mig_command", metavar="COMMAND", required=True)
    for name, what, func in (("profiles", "GPU instance profiles and placements (-lgip/-lgipp)", cmd_mig_profiles),
                             ("instances", "GPU instances with their placements (-lgi)", cmd_mig_instances),
                             ("compute", "compute instances with their placements and UUIDs (-lci)", cmd_mig_compute),
                             ("compute-profiles", "compute instance profiles of each GPU instance, free/total (-lcip)",
                              cmd_mig_compute_profiles)):
        one = _with_json(listings.add_parser(name, help=what))
        one.add_argument("--gpu", metavar="SEL", help="index, PCI address or UUID")
        one.set_defaults(func=func)


def _add_list(sub: Any) -> None:
    s = _with_json(sub.add_parser("list", help="GPUs with their UUIDs and MIG devices (nvidia-smi -L)"))
    s.set_defaults(func=cmd_list)


def _add_vgpu(sub: Any) -> None:
    _add_per_gpu_listing(sub, "vgpu", "vGPU information", "types",
                         "vGPU types each GPU offers, with how many still fit", cmd_vgpu_types)


def _add_passthrough(sub: Any) -> None:
    s = _with_json(sub.add_parser("passthrough",
                                  help="GPUs on vfio-pci and vGPUs (mdev by UUID, VF vGPUs), for libvirt/KubeVirt"))
    s.set_defaults(func=cmd_passthrough)


def _add_lease(sub: Any) -> None:
    s = _with_json(sub.add_parser("lease", help="a MIG instance (or a whole GPU) on a dynamic GPU, for a job"))
    s.add_argument("profile", metavar="PROFILE",
                   help="a MIG device name as the layout takes it (1g.10gb, 1c.3g.40gb, ...), or 'gpu' for a "
                        "whole GPU (with --gpu)")
    s.add_argument("--gpu", metavar="SEL", help="only this GPU: index, PCI address or UUID")
    s.add_argument("--owner", default="", metavar="TEXT", help="who holds it (a job id), shown in status")
    s.add_argument("--pid", type=int, metavar="PID",
                   help="release it when this process is gone and the instance idle")
    s.add_argument("--start", type=int, metavar="SLICE", help="exactly this placement (with --gpu)")
    s.set_defaults(func=cmd_lease)


def _add_release(sub: Any) -> None:
    s = _with_json(sub.add_parser("release", help="give a lease back: its instance is destroyed"))
    s.add_argument("id", metavar="ID", help="the lease id `gpudctl lease` printed")
    s.add_argument("--no-wait", action="store_true", help="refuse at once when processes use it (exit 5)")
    s.set_defaults(func=cmd_release)


def _add_leases(sub: Any) -> None:
    s = _with_json(sub.add_parser("leases", help="every lease, with its GPU, placement and holder"))
    s.set_defaults(func=cmd_leases)


# Each command's sub-parser, in the order `gpudctl --help` lists them.
COMMANDS = {"status": _add_status, "list": _add_list, "check": _add_check, "labels": _add_labels, "plan": _add_plan,
            "apply": _add_apply, "select": _add_select, "reload": _add_reload, "events": _add_events, "version": _add_version,
            "mig": _add_mig, "vgpu": _add_vgpu, "passthrough": _add_passthrough, "lease": _add_lease,
            "release": _add_release, "leases": _add_leases}


def _command_named(argv: list[str]) -> str | None:
    """The command an argument list names, when that is certain before parsing: the first word
    that is not an option (or --socket's value), unless help is asked for before it."""
    words = iter(argv)
    for w in words:
        if w in ("-h", "--help"):
            return None
        if w in ("--socket", "--reply-timeout"):
            next(words, None)
        elif not w.startswith("-"):
            return w if w in COMMANDS else None
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for this run. Each sub-parser costs argparse's gettext look-ups (a few stat calls
    apiece), which add up to more than the rest of a `gpudctl status`; so when `argv` names its
    command, only that command's sub-parser is built. `gpudctl --help`, or a word that is no
    command, gets all of them (the full list, or argparse's "invalid choice")."""
    only = _command_named(argv) if argv is not None else None
    p = _Parser(prog="gpudctl", description="Query and drive gpud, the GPU layout daemon.")
    p.add_argument("--version", action="version", version=f"gpudctl {client_version()} (protocol {frames.PROTOCOL})",
                   help="gpudctl's version (without asking gpud: `gpudctl version` has gpud's, the driver's)")
    p.add_argument("--socket", default=os.environ.get("GPUD_SOCKET") or DEFAULT_SOCKET,
                   help=f"gpud socket (default: $GPUD_SOCKET or {DEFAULT_SOCKET})")
    p.add_argument("--reply-timeout", type=seconds, default=DEFAULT_TIMEOUT, metavar="S",
                   help=f"wait S seconds for gpud's answer (default {DEFAULT_TIMEOUT:g}); past that, exit "
                        f"{EXIT_STILL_WORKING}: gpud took the request and is still working on it")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, add in COMMANDS.items():
        if only is None or name == only:
            add(sub)
    return p
