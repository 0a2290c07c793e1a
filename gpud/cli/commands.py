"""gpudctl's commands: parsed arguments in, one request (or a stream) to gpud, text out, exit code back.

Exit codes are stable for scripts; gpudctl.py documents them. The nvidia-smi shaped tables
(render_smi) and the VM views (render_vm) are imported by their commands only: a `status` does not
pay for them.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from gpud.cli.escape import term
from gpud.cli.render import (
    event_json,
    pick_gpu,
    render_event,
    render_gpu,
    render_kubernetes,
    render_labels,
    render_lease,
    render_leases,
    render_plan,
    render_progress,
    render_status,
    to_json,
)
from gpud.cli.transport import NO_LIMIT, Client, Unreachable
from gpud.cli.view import reply
from gpud.wire import frames

TYPE_CHECKING = False
if TYPE_CHECKING:  # the structs the replies are read as (gpud.cli.view): for mypy, not imported at run time
    from typing import Any

    from gpud.wire import replies as wire_replies
    from gpud.wire import tables as wire_tables

DEFAULT_LAYOUT = "/etc/gpud/layout.yaml"

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_INVALID, EXIT_NOT_CONVERGED = 0, 1, 2, 3, 4, 5
EXIT_STILL_WORKING = 6  # connected and asked, but no answer within --reply-timeout


def seconds(text: str) -> float:
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


def terminal_width(fallback: int = 160) -> int:
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
    width = terminal_width()
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
    limit = frames.MAX_LAYOUT_TEXT
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
        r = _check_offline(text, path, a.all_layouts, e, shown=not a.json)
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


def _check_offline(text: str, path: str, all_layouts: bool, why: Unreachable, *, shown: bool) -> wire_replies.CheckReply:
    """`gpud check` (gpud.check_offline): the daemon's code in another process, so gpudctl itself
    stays light; its reply is the daemon's own type, as JSON, read as the daemon's would be
    (`shown`: escaped for a terminal)."""
    import json
    import subprocess

    print(f"gpudctl: {why}; checking offline (the host is only read)", file=sys.stderr)
    argv = [sys.executable, "-m", "gpud.main", "check", "--path", path, "-"] + (["--all-layouts"] if all_layouts else [])
    done = subprocess.run(argv, input=text.encode(), capture_output=True)
    if done.returncode not in (0, 4):
        raise LocalError(f"the offline check failed: {done.stderr.decode(errors='replace').strip()[-2000:]}")
    doc = json.loads(done.stdout)
    return reply("check", doc, escape=shown)


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


def client_version() -> str:
    return getattr(sys.modules.get("gpud"), "VERSION", "?")


def cmd_version(c: Client, a: argparse.Namespace) -> int:
    mine = client_version()
    r: wire_replies.VersionReply = c.request("version")
    if a.json:
        print(to_json(r))
        return EXIT_OK
    lines = [f"gpudctl {mine} (protocol {frames.PROTOCOL})", f"gpud    {r.version} (protocol {r.protocol})",
             f"driver  {r.driver or '-'}", f"NVML    {r.nvml or '-'}"]
    print("\n".join(lines))
    if r.protocol != frames.PROTOCOL:
        print(f"gpudctl: warning: gpud speaks protocol {r.protocol}, this client {frames.PROTOCOL}",
              file=sys.stderr)
    return EXIT_OK


def cmd_mig_profiles(c: Client, a: argparse.Namespace) -> int:
    from gpud.cli.render_smi import render_mig_profiles
    r: wire_tables.MigProfilesReply = c.request("mig-profiles", {"gpu": a.gpu} if a.gpu is not None else {})
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
    from gpud.cli.render_smi import render_list
    r, _ = _status_gpus(c, a)
    if a.json:
        print(to_json([{"index": g.index, "pci": g.pci, "uuid": g.uuid, "model": g.model,
                        "mig_devices": [{"profile": i.profile, "uuid": i.uuid} for i in g.mig.instances
                                        if i.ci is not None]} for g in r.gpus]))
    else:
        print(render_list(r))
    return EXIT_OK


def cmd_mig_instances(c: Client, a: argparse.Namespace) -> int:
    from gpud.cli.render_smi import render_gpu_instances
    _, gpus = _status_gpus(c, a)
    print(to_json([{"index": g.index, "instances": g.mig.instances} for g in gpus]) if a.json
          else render_gpu_instances(gpus))
    return EXIT_OK


def cmd_mig_compute(c: Client, a: argparse.Namespace) -> int:
    from gpud.cli.render_smi import render_compute_instances
    _, gpus = _status_gpus(c, a)
    print(to_json([{"index": g.index, "instances": [i for i in g.mig.instances if i.ci is not None]} for g in gpus])
          if a.json else render_compute_instances(gpus))
    return EXIT_OK


def cmd_mig_compute_profiles(c: Client, a: argparse.Namespace) -> int:
    from gpud.cli.render_smi import render_compute_profiles
    r: wire_tables.MigComputeProfilesReply = c.request("mig-compute-profiles", {"gpu": a.gpu} if a.gpu is not None else {})
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
    from gpud.cli.render_vm import render_vgpu_types
    r: wire_tables.VgpuTypesReply = c.request("vgpu-types", {"gpu": a.gpu} if a.gpu is not None else {})
    print(to_json(r) if a.json else render_vgpu_types(r))
    return EXIT_OK


def cmd_passthrough(c: Client, a: argparse.Namespace) -> int:
    from gpud.cli.render_vm import render_passthrough
    r: wire_tables.PassthroughReply = c.request("passthrough")
    print(to_json(r) if a.json else render_passthrough(r))
    return EXIT_OK
