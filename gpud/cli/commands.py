"""gpudctl's commands: parsed arguments in, one request (or a stream) to gpud, text out, exit code back.

Exit codes are stable for scripts; gpudctl.py documents them.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import msgspec

from gpud.api import wire, wire_replies
from gpud.cli.escape import escaped, term
from gpud.cli.render import (
    event_json,
    pick_gpu,
    render_compute_instances,
    render_compute_profiles,
    render_event,
    render_gpu,
    render_gpu_instances,
    render_kubernetes,
    render_labels,
    render_lease,
    render_leases,
    render_list,
    render_mig_profiles,
    render_passthrough,
    render_plan,
    render_progress,
    render_status,
    render_vgpu_types,
    to_json,
)
from gpud.cli.transport import DEFAULT_SOCKET, DEFAULT_TIMEOUT, NO_LIMIT, Client, Unreachable

DEFAULT_LAYOUT = "/etc/gpud/layout.yaml"

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_INVALID, EXIT_NOT_CONVERGED = 0, 1, 2, 3, 4, 5
EXIT_STILL_WORKING = 6  # connected and asked, but no answer within --reply-timeout


def _seconds(text: str) -> float:
    """--reply-timeout's value: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("must be more than 0 seconds")
    return value


class UsageError(Exception):
    """Bad combination of arguments (exit 2)."""


class LocalError(Exception):
    """A local failure before gpud was asked (exit 1)."""


def _layout_exit(valid: bool, errors: list[str]) -> int:
    return EXIT_OK if valid and not errors else EXIT_INVALID


def _terminal_width(fallback: int = 160) -> int:
    """The terminal's width (COLUMNS when set), else `fallback` (status: a wide page for piped
    output, not a cut one). What shutil.get_terminal_size does, without importing shutil per run."""
    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    if columns > 0:
        return columns
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns or fallback
    except (AttributeError, ValueError, OSError):
        return fallback


def cmd_status(c: Client, a: argparse.Namespace) -> int:
    r: wire_replies.StatusReply = c.request("status", {"fresh": True} if a.fresh else None)
    if a.gpu is not None:
        g = pick_gpu(r, a.gpu)
        if g is None:
            raise LocalError(f"no GPU {a.gpu!r}: give an index, PCI address or GPU UUID "
                             f"({', '.join(str(x.index) for x in r.gpus) or 'no GPUs managed'})")
        print(to_json(g) if a.json else render_gpu(g))
        return EXIT_OK
    width = _terminal_width()
    if a.json:
        print(to_json(r))
    elif a.kube:
        print(render_kubernetes(r.kubernetes))
    else:
        print(render_status(r, width))
    return EXIT_OK


def cmd_labels(c: Client, a: argparse.Namespace) -> int:
    r: wire_replies.LabelsReply = c.request("labels")
    print(to_json(r) if a.json else render_labels(r))
    return EXIT_OK


def _read_layout(path: str) -> tuple[str, str]:
    """The layout text as the client sees it, with the path errors should name; gpud's size limit
    is checked here too (reading at most one byte past it), so a huge file is never sent."""
    limit = wire.MAX_LAYOUT_TEXT
    try:
        if path == "-":
            data, where = sys.stdin.buffer.read(limit + 1), "<stdin>"
        else:
            with open(path, "rb") as f:
                data, where = f.read(limit + 1), os.path.abspath(path)
        if len(data) > limit:
            raise LocalError(f"cannot check {path}: the layout is over {limit} bytes; a layout may be at most "
                             f"{limit} bytes ({limit // 1024} KiB)")
        return data.decode("utf-8"), where
    except UnicodeDecodeError as e:
        raise LocalError(f"cannot read {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise LocalError(f"cannot read {path}: {e.strerror or e}") from None


def _daemon_layout_path(c: Client) -> str:
    """The file the daemon keeps; its default when the daemon cannot be asked (said on stderr)."""
    try:
        r: wire_replies.VersionReply = c.request("version")
    except Unreachable as e:
        print(f"gpudctl: {e}; checking {DEFAULT_LAYOUT}", file=sys.stderr)
        return DEFAULT_LAYOUT
    if r.config is None:  # a gpud older than this client does not say
        print(f"gpudctl: gpud does not report its layout file; checking {DEFAULT_LAYOUT}", file=sys.stderr)
        return DEFAULT_LAYOUT
    return r.config


def cmd_check(c: Client, a: argparse.Namespace) -> int:
    text, path = _read_layout(a.file if a.file is not None else _daemon_layout_path(c))
    args: dict[str, Any] = {"text": text, "path": path}
    if a.all_layouts:
        args["all_layouts"] = True
    try:
        r: wire_replies.CheckReply = c.request("check", args)
    except Unreachable as e:  # no daemon: the same check in a process of its own, the host only read
        r = _check_offline(text, path, a.all_layouts, e)
        if not a.json:
            r = escaped(r)
    if a.json:
        print(to_json(r))
    else:
        which = f"layouts: {', '.join(r.checked)}" if a.all_layouts else f"selected: {r.selected}"
        lines = [f"{term(path)}: " + (f"valid ({which})" if r.valid and r.selected
                                else "valid" if r.valid else "INVALID")]
        lines += [f"error: {e}" for e in r.errors] + [f"warning: {w}" for w in r.warnings]
        lines += [f"note: {d}" for d in r.dynamic]
        print("\n".join(lines))
    return _layout_exit(r.valid, r.errors)


def _check_offline(text: str, path: str, all_layouts: bool, why: Unreachable) -> wire_replies.CheckReply:
    """`gpud check` (gpud.check_offline): the daemon's code in another process, so gpudctl itself
    stays light; its reply is the daemon's own type."""
    import subprocess

    print(f"gpudctl: {why}; checking offline (the host is only read)", file=sys.stderr)
    argv = [sys.executable, "-m", "gpud.main", "check", "--path", path, "-"] + (["--all-layouts"] if all_layouts else [])
    done = subprocess.run(argv, input=text.encode(), capture_output=True)
    if done.returncode not in (0, 4):
        raise LocalError(f"the offline check failed: {done.stderr.decode(errors='replace').strip()[-2000:]}")
    return msgspec.json.decode(done.stdout, type=wire_replies.CheckReply)


def cmd_plan(c: Client, a: argparse.Namespace) -> int:
    args: dict[str, Any] = {}
    if a.file:
        args["text"], args["path"] = _read_layout(a.file)
    r: wire_replies.PlanReply = c.request("plan", args)
    print(to_json(r) if a.json else render_plan(r))
    infeasible = any(g.infeasible for g in r.gpus)
    return EXIT_INVALID if r.errors or infeasible else EXIT_OK


def cmd_apply(c: Client, a: argparse.Namespace) -> int:
    if a.timeout is not None and not a.wait:
        raise UsageError("--timeout needs --wait")
    if a.timeout is not None and not (math.isfinite(a.timeout) and a.timeout > 0):
        raise UsageError("--timeout must be a finite number of seconds > 0")
    # the daemon enforces the timeout; the client waits a little longer to hear its answer
    if not a.wait:
        deadline = a.reply_timeout
    else:
        deadline = NO_LIMIT if a.timeout is None else a.timeout + a.reply_timeout
    if a.config is not None:  # mig-parted's `apply -c NAME`: that layout of the file, kept, then the apply
        chosen: wire_replies.LayoutStatus = c.request("select", {"name": a.config})
        if not a.json:
            print(f"selected: {chosen.selected} (kept across restarts; gpudctl select --file goes back to the file's)")
    args = {"wait": a.wait, "timeout": a.timeout}
    if a.wait and not a.json:
        r = _apply_following(c, a, args, deadline)
    else:
        r = c.request("apply", args, timeout=deadline)
    if a.json:
        print(to_json(r))
    else:
        said = r.message and r.message != r.phase and not (r.converged and r.message == "converged")
        head = f"apply: {r.phase}" + (f": {r.message}" if said else "")
        rows = [f"  {g.pci}  {g.state}" + (f": {g.message}" if g.message else "") for g in r.gpus]
        print("\n".join([head, *rows]))
    if a.wait and not r.converged:
        return EXIT_NOT_CONVERGED
    return EXIT_OK


def _apply_following(c: Client, a: argparse.Namespace, args: dict[str, Any], deadline: float) -> wire_replies.ApplyReply:
    """`apply --wait` that is not silent: subscribe to events first (nothing of this apply is
    missed), send the apply from a thread, and print each event as it comes until the reply is
    in and the stream has gone quiet. On a terminal, step events also get a `[k/n]` progress line."""
    follower = Client(a.socket)
    try:
        follower.follow()
        done: dict[str, Any] = {}

        def send() -> None:
            try:
                done["reply"] = c.request("apply", args, timeout=deadline)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                done["error"] = e

        import threading  # only `apply --wait` needs a thread: not paid by every run

        worker = threading.Thread(target=send, name="apply", daemon=True)
        worker.start()
        tty = sys.stdout.isatty()
        totals: dict[str, int] = {}
        steps: dict[str, int] = {}
        while True:
            e = follower.next_event(0.2)
            if e is None:
                if not worker.is_alive():
                    break  # the reply is in and the events that led to it have been read
                continue
            line = render_progress(e, totals, steps) if tty else None
            print(line if line is not None else render_event(e), flush=True)
        if "error" in done:
            raise done["error"]
        return done["reply"]
    finally:
        follower.close()


def cmd_reload(c: Client, a: argparse.Namespace) -> int:
    r: wire_replies.LayoutStatus = c.request("reload")
    if a.json:
        print(to_json(r))
    else:
        state = "valid" if r.valid else "INVALID (gpud keeps converging to the last valid layout)"
        selected = f" (selected: {r.selected})" if r.selected else ""
        lines = [f"reloaded {r.path}: {state}{selected}"]
        lines += [f"error: {e}" for e in r.errors] + [f"warning: {w}" for w in r.warnings]
        print("\n".join(lines))
    return _layout_exit(r.valid, r.errors)


def cmd_select(c: Client, a: argparse.Namespace) -> int:
    if (a.name is None) == (not a.file):
        raise UsageError("give a layout NAME, or --file for the file's own `selected`")
    r: wire_replies.LayoutStatus = c.request("select", {"name": a.name})
    if a.json:
        print(to_json(r))
    else:
        print(f"selected: {r.selected}" + (" (kept across restarts; `gpudctl apply` converges to it)" if r.chosen
                                           else " (the file's own)"))
    return _layout_exit(r.valid, r.errors)


def cmd_events(c: Client, a: argparse.Namespace) -> int:
    show = event_json if a.json else render_event
    if not a.follow:
        r: wire_replies.EventsReply = c.request("events", {"follow": False})
        for e in r.events:
            print(show(e))
        return EXIT_OK
    try:
        for e in c.events():
            print(show(e), flush=True)
    except KeyboardInterrupt:
        return EXIT_OK
    return EXIT_OK  # not reached: the stream ends with Unreachable


def _client_version() -> str:
    return getattr(sys.modules.get("gpud"), "VERSION", "?")


def cmd_version(c: Client, a: argparse.Namespace) -> int:
    mine = _client_version()
    r: wire_replies.VersionReply = c.request("version")
    if a.json:
        print(to_json(r))
        return EXIT_OK
    lines = [f"gpudctl {mine} (protocol {wire.PROTOCOL})", f"gpud    {r.version} (protocol {r.protocol})",
             f"driver  {r.driver or '-'}", f"NVML    {r.nvml or '-'}"]
    print("\n".join(lines))
    if r.protocol != wire.PROTOCOL:
        print(f"gpudctl: warning: gpud speaks protocol {r.protocol}, this client {wire.PROTOCOL}",
              file=sys.stderr)
    return EXIT_OK


def cmd_mig_profiles(c: Client, a: argparse.Namespace) -> int:
    r: wire_replies.MigProfilesReply = c.request("mig-profiles", {"gpu": a.gpu} if a.gpu is not None else {})
    print(to_json(r) if a.json else render_mig_profiles(r))
    return EXIT_OK


def _status_gpus(c: Client, a: argparse.Namespace) -> tuple[wire_replies.StatusReply, list[wire_replies.GpuStatus]]:
    r: wire_replies.StatusReply = c.request("status")
    if getattr(a, "gpu", None) is None:
        return r, r.gpus
    g = pick_gpu(r, a.gpu)
    if g is None:
        raise LocalError(f"no GPU {a.gpu!r}: give an index, PCI address or GPU UUID "
                         f"({', '.join(str(x.index) for x in r.gpus) or 'no GPUs managed'})")
    return r, [g]


def cmd_list(c: Client, a: argparse.Namespace) -> int:
    r, _ = _status_gpus(c, a)
    if a.json:
        print(to_json([{"index": g.index, "pci": g.pci, "uuid": g.uuid, "model": g.model,
                        "mig_devices": [{"profile": i.profile, "uuid": i.uuid} for i in g.mig.instances
                                        if i.ci is not None]} for g in r.gpus]))
    else:
        print(render_list(r))
    return EXIT_OK


def cmd_mig_instances(c: Client, a: argparse.Namespace) -> int:
    _, gpus = _status_gpus(c, a)
    print(to_json([{"index": g.index, "instances": g.mig.instances} for g in gpus]) if a.json
          else render_gpu_instances(gpus))
    return EXIT_OK


def cmd_mig_compute(c: Client, a: argparse.Namespace) -> int:
    _, gpus = _status_gpus(c, a)
    print(to_json([{"index": g.index, "instances": [i for i in g.mig.instances if i.ci is not None]} for g in gpus])
          if a.json else render_compute_instances(gpus))
    return EXIT_OK


def cmd_mig_compute_profiles(c: Client, a: argparse.Namespace) -> int:
    r: wire_replies.MigComputeProfilesReply = c.request("mig-compute-profiles", {"gpu": a.gpu} if a.gpu is not None else {})
    print(to_json(r) if a.json else render_compute_profiles(r))
    return EXIT_OK


def cmd_lease(c: Client, a: argparse.Namespace) -> int:
    args: dict[str, Any] = {"profile": a.profile, "owner": a.owner}
    if a.gpu is not None:
        args["gpu"] = a.gpu
    if a.pid is not None:
        args["pid"] = a.pid
    if a.start is not None:
        args["start"] = a.start
    r: wire_replies.LeaseInfo = c.request("lease", args)
    print(to_json(r) if a.json else render_lease(r))
    return EXIT_OK


def cmd_release(c: Client, a: argparse.Namespace) -> int:
    r: wire_replies.ReleaseReply = c.request("release", {"id": a.id, "wait": not a.no_wait}, timeout=NO_LIMIT)
    print(to_json(r) if a.json else r.message)
    return EXIT_OK


def cmd_leases(c: Client, a: argparse.Namespace) -> int:
    r: wire_replies.LeasesReply = c.request("leases")
    print(to_json(r) if a.json else render_leases(r.leases))
    return EXIT_OK


def cmd_vgpu_types(c: Client, a: argparse.Namespace) -> int:
    r: wire_replies.VgpuTypesReply = c.request("vgpu-types", {"gpu": a.gpu} if a.gpu is not None else {})
    print(to_json(r) if a.json else render_vgpu_types(r))
    return EXIT_OK


def cmd_passthrough(c: Client, a: argparse.Namespace) -> int:
    r: wire_replies.PassthroughReply = c.request("passthrough")
    print(to_json(r) if a.json else render_passthrough(r))
    return EXIT_OK


class _Formatter(argparse.HelpFormatter):
    """argparse's help formatter with its width given: argparse builds one per add_argument, and
    without a width each imports shutil (and its archive modules) to ask the terminal's size."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=_terminal_width(80) - 2)  # argparse's own default: columns - 2


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
    p.add_argument("--version", action="version", version=f"gpudctl {_client_version()} (protocol {wire.PROTOCOL})",
                   help="gpudctl's version (without asking gpud: `gpudctl version` has gpud's, the driver's)")
    p.add_argument("--socket", default=os.environ.get("GPUD_SOCKET") or DEFAULT_SOCKET,
                   help=f"gpud socket (default: $GPUD_SOCKET or {DEFAULT_SOCKET})")
    p.add_argument("--reply-timeout", type=_seconds, default=DEFAULT_TIMEOUT, metavar="S",
                   help=f"wait S seconds for gpud's answer (default {DEFAULT_TIMEOUT:g}); past that, exit "
                        f"{EXIT_STILL_WORKING}: gpud took the request and is still working on it")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, add in COMMANDS.items():
        if only is None or name == only:
            add(sub)
    return p
