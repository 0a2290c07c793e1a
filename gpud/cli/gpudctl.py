"""gpudctl: the thin client of gpud.

It imports only the standard library, msgspec and `gpud.api.wire`, and talks over a blocking
socket (no asyncio): people run it in loops and scripts, so start-up time matters more than
anything it could share with the daemon.

Exit codes (stable, for scripts):
  0  success (`status` returns 0 whatever the phase: read the phase, or use `apply --wait`)
  1  error: gpud answered with an error (forbidden, internal...), or a local error
  2  usage
  3  gpud unreachable: no socket, refused, permission denied, no answer, connection lost
  4  invalid layout: `check`/`reload` found errors, `plan` has errors or an infeasible GPU
  5  not converged: `apply --wait` ended blocked, failed or timed out
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from typing import Any

import msgspec

from gpud.api import wire

DEFAULT_SOCKET = "/run/gpud/gpud.sock"
DEFAULT_LAYOUT = "/etc/gpud/layout.yaml"
DEFAULT_TIMEOUT = 30.0  # seconds for one reply; `apply --wait` and `events -f` wait longer

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_INVALID, EXIT_NOT_CONVERGED = 0, 1, 2, 3, 4, 5


class Unreachable(Exception):
    """No conversation with gpud was possible (exit 3)."""


class DaemonError(Exception):
    """gpud answered with an error response."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} [{code}]")
        self.code = code
        self.message = message


class WaitTimeout(Exception):
    """No reply within the client's own deadline."""


class Client:
    """One connection to gpud; requests are answered in order on it."""

    def __init__(self, path: str, *, timeout: float | None = DEFAULT_TIMEOUT) -> None:
        self.path = path
        self.timeout = timeout
        self._reader = wire.FrameReader()
        self._sock: socket.socket | None = None
        self._next_id = 1

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.path)
            except OSError as e:
                sock.close()
                hint = ""
                if isinstance(e, (FileNotFoundError, ConnectionRefusedError)):
                    hint = " (is gpud running?)"
                elif isinstance(e, PermissionError):
                    hint = " (needs root or membership of the gpud group)"
                raise Unreachable(f"cannot reach gpud at {self.path}: {e.strerror or e}{hint}") from None
            self._sock = sock
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _read(self) -> wire.Response | wire.EventFrame:
        assert self._sock is not None
        try:
            payload = self._reader.read_sync(self._sock)
        except TimeoutError:
            raise WaitTimeout(f"gpud did not answer within {self.timeout:g} s") from None
        except OSError as e:
            raise Unreachable(f"lost the connection to gpud at {self.path}: {e.strerror or e}") from None
        if payload is None:
            raise Unreachable(f"gpud at {self.path} closed the connection")
        return wire.decode_message(payload)

    def request(self, op: str, args: dict[str, Any] | None = None, *, timeout: float | None = -1.0) -> Any:
        """Send one request, return its typed result; DaemonError on an error response.
        `timeout`: seconds for this reply (None: no limit; default: the client's)."""
        sock = self._connect()
        rid = self._next_id
        self._next_id += 1
        sock.settimeout(self.timeout if timeout == -1.0 else timeout)
        try:
            sock.sendall(wire.encode_frame(wire.Request(id=rid, op=op, args=args or {})))
        except OSError as e:
            raise Unreachable(f"lost the connection to gpud at {self.path}: {e.strerror or e}") from None
        msg = self._read()
        if not isinstance(msg, wire.Response) or msg.id not in (rid, 0):
            raise wire.FrameError(f"unexpected frame from gpud (waiting for reply {rid})")
        if not msg.ok:
            err = msg.error or wire.ErrorInfo(code=wire.E_INTERNAL, message="error without detail")
            raise DaemonError(err.code, err.message)
        return wire.decode_result(op, msg.result)

    def events(self):
        """Yield the recent history, then every new event until gpud closes the stream."""
        reply = self.request("events", {"follow": True}, timeout=None)
        yield from reply.events
        while True:
            msg = self._read()
            if isinstance(msg, wire.EventFrame):
                yield msg.event
            elif not msg.ok and msg.error is not None:
                raise DaemonError(msg.error.code, msg.error.message)


# ---------------------------------------------------------------------------------------------
# Rendering (pure: reply struct -> text)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows
    )


def _holder(h: wire.HolderInfo, *, device: bool = False) -> str:
    text = f"pid {h.pid} {h.name}"
    return f"{text} ({h.device})" if device and h.device else text


def _placement(p: wire.Placement | None) -> str:
    return f"{{{p.start}}}:{p.size}" if p is not None else ""


def _profile_order(name: str) -> tuple[int, str]:
    head = name.split(".", 1)[0].rstrip("cg")
    return (int(head) if head.isdigit() else 99, name)


def _mig_column(m: wire.MigStatus) -> str:
    if not m.capable or m.mode is None:  # not capable, or not visible to NVML (e.g. on vfio-pci)
        return "-"
    words = {"enabled": "on", "disabled": "off"}
    if m.pending and m.pending != m.mode:
        return f"pending({words.get(m.pending, '?')})"  # takes effect at the next GPU reset
    return words.get(m.mode, "?")


def _instances_column(m: wire.MigStatus) -> str:
    counts: dict[str, int] = {}
    for inst in m.instances:
        counts[inst.profile] = counts.get(inst.profile, 0) + 1
    if not counts:
        return "-"
    return " ".join(f"{counts[p]}x{p}" for p in sorted(counts, key=_profile_order))


def _state_column(g: wire.GpuStatus) -> str:
    holders = g.holders or [h for i in g.mig.instances for h in i.holders]
    if g.state in ("waiting", "stuck") and holders:
        more = f" (+{len(holders) - 1} more)" if len(holders) > 1 else ""
        return f"{g.state}: {_holder(holders[0])}{more}"
    return f"{g.state}: {g.message}" if g.message else g.state


def render_status(r: wire.StatusReply) -> str:
    head = f"gpud {r.version}: {r.phase}" if r.version else f"gpud: {r.phase}"
    out = [head + ("  [read-only]" if r.read_only else "")]
    if r.gpus:
        rows = [["GPU", "PCI", "MODEL", "DRIVER", "WORKLOAD", "MIG", "INSTANCES", "STATE"]]
        for g in r.gpus:
            rows.append([str(g.index), g.pci, g.model or "-", g.driver or "-", g.workload,
                         _mig_column(g.mig), _instances_column(g.mig), _state_column(g)])
        out += ["", _table(rows)]
    else:
        out += ["", "no GPUs managed"]
    lay = r.layout
    validity = "valid" if lay.valid else "INVALID"
    selected = f"selected: {lay.selected}" if lay.selected else "no layout selected"
    out += ["", f"layout: {lay.path}  {selected}  {validity}"]
    out += [f"  error: {e}" for e in lay.errors]
    out += [f"  warning: {w}" for w in lay.warnings]
    migs = [g for g in r.gpus if g.mig.instances]
    if migs:
        out += ["", "MIG devices:"]
        for g in migs:
            out.append(f"GPU {g.index}: {g.model or g.pci} (UUID: {g.uuid or '-'})")
            insts = sorted(g.mig.instances, key=lambda i: (i.placement.start, i.gi, i.ci))
            for n, inst in enumerate(insts):
                out.append(f"  MIG {inst.profile:<12} Device {n:>2}: (UUID: {inst.uuid})")
    return "\n".join(out)


def _describe_step(s: wire.StepInfo) -> str:
    if s.action == "set-mig-mode":
        text = f"set MIG mode {'on' if s.enabled else 'off'}"
    else:
        parts = [s.action]
        if s.profile:
            parts.append(s.profile)
        if s.placement is not None:
            parts.append(_placement(s.placement))
        if s.gi is not None:
            parts.append(f"gi {s.gi}")
        if s.ci is not None:
            parts.append(f"ci {s.ci}")
        for v in (s.pci, s.driver, s.module):
            if v:
                parts.append(v)
        if s.group is not None:
            parts.append(f"/dev/vfio/{s.group}")
        if s.uuid:
            parts.append(s.uuid)
        text = "  ".join(parts)
    return f"{text}  ({s.message})" if s.message else text


def render_plan(r: wire.PlanReply) -> str:
    out: list[str] = []
    for g in r.gpus:
        if g.infeasible:
            out.append(f"GPU {g.index} {g.pci}: INFEASIBLE: {g.infeasible}")
        elif not g.steps:
            out.append(f"GPU {g.index} {g.pci}: nothing to do")
        else:
            out.append(f"GPU {g.index} {g.pci}:")
        out += [f"  {n}. {_describe_step(s)}" for n, s in enumerate(g.steps, 1)]
        if g.blocked_by:
            out.append("  blocked by: " + ", ".join(_holder(h, device=True) for h in g.blocked_by))
    if not r.gpus:
        out.append("no GPUs managed")
    d = r.disruption
    if d.destroyed or d.mode_changes or d.resets:
        out += ["", "disruption:"]
        for x in d.destroyed:
            held = (" held by " + ", ".join(_holder(h) for h in x.holders)) if x.holders else ""
            uuid = f" {x.uuid}" if x.uuid else ""
            out.append(f"  destroys {x.profile} {_placement(x.placement)} on {x.pci}{uuid}{held}")
        if d.mode_changes:
            out.append("  MIG mode changes: " + ", ".join(d.mode_changes))
        if d.resets:
            out.append("  GPU resets: " + ", ".join(d.resets))
    else:
        out += ["", "disruption: none"]
    out += [f"error: {e}" for e in r.errors]
    out += [f"warning: {w}" for w in r.warnings]
    return "\n".join(out)


def render_mig_profiles(r: wire.MigProfilesReply) -> str:
    """`nvidia-smi mig -lgip` followed by `nvidia-smi mig -lgipp`."""
    bar = "+" + "-" * 79 + "+"
    out = [bar,
           "| GPU instance profiles:".ljust(80) + "|",
           "| GPU   Name               ID    Instances   Memory     P2P    SM    DEC   ENC  |",
           "|                                Free/Total   GiB              CE    JPEG  OFA  |",
           "|" + "=" * 79 + "|"]
    for g in r.gpus:
        for p in g.profiles:
            mem = f"{p.memory_mb / 1024:.2f}"
            first = (f"|{g.index:>4}  {'MIG ' + p.name:<18}{p.id:>4}{p.free:>6}/{p.total:<9}"
                     f"{mem:<11}{'Yes' if p.p2p else 'No':<7}{p.sms:<7}{p.dec:<6}{p.enc:<4}")
            out.append(first.ljust(80) + "|")
            out.append(f"|{'':<63}{p.ce:<6}{p.jpg:<6}{p.ofa:<4}".ljust(80) + "|")
            out.append(bar)
    if not any(g.profiles for g in r.gpus):
        out.append("| No MIG-capable GPU found".ljust(80) + "|")
        out.append(bar)
    for g in r.gpus:
        for p in g.profiles:
            size = p.placements[0].size if p.placements else 0
            starts = ",".join(str(pl.start) for pl in p.placements)
            word = "Placements:" if len(p.placements) > 1 else "Placement :"
            out.append(f"GPU {g.index:>2} Profile ID {p.id:>2} {word} {{{starts}}}:{size}")
    return "\n".join(out)


def render_passthrough(r: wire.PassthroughReply) -> str:
    if not r.devices:
        return "no GPU is bound for passthrough"
    rows = [["PCI", "ID", "IOMMU", "VFIO", "NUMA", "RESOURCE"]]
    for d in r.devices:
        rows.append([d.pci, d.vendor_device, "-" if d.iommu_group is None else str(d.iommu_group),
                     d.vfio_device or "-", "-" if d.numa_node is None else str(d.numa_node),
                     d.resource_name or "-"])
    out = [_table(rows)]
    for d in r.devices:
        if d.libvirt_hostdev:
            out += ["", f"libvirt <hostdev> for {d.pci}:"]
            out += ["  " + line for line in d.libvirt_hostdev.strip().splitlines()]
        if d.kubevirt:
            out += ["", f"KubeVirt permittedHostDevices.pciHostDevices entry for {d.pci}:",
                    "  - " + msgspec.json.encode(d.kubevirt).decode()]
    return "\n".join(out)


def render_event(e: wire.Event) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(e.time))
    where = f" {e.gpu}" if e.gpu else ""
    return f"{stamp} {e.kind}{where}: {e.message}"


def _json(obj: Any) -> str:
    return msgspec.json.format(msgspec.json.encode(obj), indent=2).decode()


def _layout_exit(valid: bool, errors: list[str]) -> int:
    return EXIT_OK if valid and not errors else EXIT_INVALID


# ---------------------------------------------------------------------------------------------
# Commands: (client, args) -> exit code


def cmd_status(c: Client, a: argparse.Namespace) -> int:
    r = c.request("status")
    print(_json(r) if a.json else render_status(r))
    return EXIT_OK


def _read_layout(path: str) -> tuple[str, str]:
    """The layout text as the client sees it, with the path errors should name."""
    try:
        if path == "-":
            return sys.stdin.read(), "<stdin>"
        with open(path, encoding="utf-8") as f:
            return f.read(), os.path.abspath(path)
    except UnicodeDecodeError as e:
        raise LocalError(f"cannot read {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise LocalError(f"cannot read {path}: {e.strerror or e}") from None


def cmd_check(c: Client, a: argparse.Namespace) -> int:
    text, path = _read_layout(a.file)
    r = c.request("check", {"text": text, "path": path})
    if a.json:
        print(_json(r))
    else:
        lines = [f"{path}: " + (f"valid (selected: {r.selected})" if r.valid and r.selected
                                else "valid" if r.valid else "INVALID")]
        lines += [f"error: {e}" for e in r.errors] + [f"warning: {w}" for w in r.warnings]
        print("\n".join(lines))
    return _layout_exit(r.valid, r.errors)


def cmd_plan(c: Client, a: argparse.Namespace) -> int:
    args: dict[str, Any] = {}
    if a.file:
        args["text"], args["path"] = _read_layout(a.file)
    r = c.request("plan", args)
    print(_json(r) if a.json else render_plan(r))
    infeasible = any(g.infeasible for g in r.gpus)
    return EXIT_INVALID if r.errors or infeasible else EXIT_OK


def cmd_apply(c: Client, a: argparse.Namespace) -> int:
    if a.timeout is not None and not a.wait:
        raise UsageError("--timeout needs --wait")
    if a.timeout is not None and a.timeout <= 0:
        raise UsageError("--timeout must be positive")
    # the daemon enforces the timeout; the client waits a little longer to hear its answer
    deadline = None if not a.wait or a.timeout is None else a.timeout + 30.0
    r = c.request("apply", {"wait": a.wait, "timeout": a.timeout},
                  timeout=deadline if a.wait else DEFAULT_TIMEOUT)
    if a.json:
        print(_json(r))
    else:
        head = f"apply: {r.phase}" + (f": {r.message}" if r.message else "")
        rows = [f"  {g.pci}  {g.state}" + (f": {g.message}" if g.message else "") for g in r.gpus]
        print("\n".join([head, *rows]))
    if a.wait and not r.converged:
        return EXIT_NOT_CONVERGED
    return EXIT_OK


def cmd_reload(c: Client, a: argparse.Namespace) -> int:
    r = c.request("reload")
    if a.json:
        print(_json(r))
    else:
        state = "valid" if r.valid else "INVALID (gpud keeps converging to the last valid layout)"
        selected = f" (selected: {r.selected})" if r.selected else ""
        lines = [f"reloaded {r.path}: {state}{selected}"]
        lines += [f"error: {e}" for e in r.errors] + [f"warning: {w}" for w in r.warnings]
        print("\n".join(lines))
    return _layout_exit(r.valid, r.errors)


def cmd_events(c: Client, a: argparse.Namespace) -> int:
    show = (lambda e: msgspec.json.encode(e).decode()) if a.json else render_event
    if not a.follow:
        r = c.request("events", {"follow": False})
        for e in r.events:
            print(show(e))
        return EXIT_OK
    c.timeout = None
    try:
        for e in c.events():
            print(show(e), flush=True)
    except KeyboardInterrupt:
        return EXIT_OK
    return EXIT_OK  # not reached: the stream ends with Unreachable


def cmd_version(c: Client, a: argparse.Namespace) -> int:
    mine = getattr(sys.modules.get("gpud"), "VERSION", "?")
    r = c.request("version")
    if a.json:
        print(_json(r))
        return EXIT_OK
    lines = [f"gpudctl {mine} (protocol {wire.PROTOCOL})", f"gpud    {r.version} (protocol {r.protocol})",
             f"driver  {r.driver or '-'}", f"NVML    {r.nvml or '-'}"]
    print("\n".join(lines))
    if r.protocol != wire.PROTOCOL:
        print(f"gpudctl: warning: gpud speaks protocol {r.protocol}, this client {wire.PROTOCOL}",
              file=sys.stderr)
    return EXIT_OK


def cmd_mig_profiles(c: Client, a: argparse.Namespace) -> int:
    r = c.request("mig-profiles", {"gpu": a.gpu} if a.gpu is not None else {})
    print(_json(r) if a.json else render_mig_profiles(r))
    return EXIT_OK


def cmd_passthrough(c: Client, a: argparse.Namespace) -> int:
    r = c.request("passthrough")
    print(_json(r) if a.json else render_passthrough(r))
    return EXIT_OK


class UsageError(Exception):
    """Bad combination of arguments (exit 2)."""


class LocalError(Exception):
    """A local failure before gpud was asked (exit 1)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpudctl", description="Query and drive gpud, the GPU layout daemon.")
    p.add_argument("--socket", default=os.environ.get("GPUD_SOCKET") or DEFAULT_SOCKET,
                   help=f"gpud socket (default: $GPUD_SOCKET or {DEFAULT_SOCKET})")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    js = argparse.ArgumentParser(add_help=False)
    js.add_argument("--json", action="store_true", help="print the reply as JSON")

    s = sub.add_parser("status", parents=[js], help="GPUs, their state and the layout")
    s.set_defaults(func=cmd_status)
    s = sub.add_parser("check", parents=[js], help="validate a layout file against this host")
    s.add_argument("file", nargs="?", default=DEFAULT_LAYOUT, metavar="FILE",
                   help=f"layout file, '-' for stdin (default: {DEFAULT_LAYOUT})")
    s.set_defaults(func=cmd_check)
    s = sub.add_parser("plan", parents=[js], help="what apply would do, and what it would disrupt")
    s.add_argument("file", nargs="?", metavar="FILE", help="plan this file instead of the loaded layout")
    s.set_defaults(func=cmd_plan)
    s = sub.add_parser("apply", parents=[js], help="converge now")
    s.add_argument("--wait", action="store_true", help="wait until converged, blocked or failed")
    s.add_argument("--timeout", type=float, metavar="S", help="give up waiting after S seconds")
    s.set_defaults(func=cmd_apply)
    s = sub.add_parser("reload", parents=[js], help="re-read the layout file")
    s.set_defaults(func=cmd_reload)
    s = sub.add_parser("events", parents=[js], help="recent events")
    s.add_argument("-f", "--follow", action="store_true", help="keep printing new events")
    s.set_defaults(func=cmd_events)
    s = sub.add_parser("version", parents=[js], help="versions of gpudctl, gpud, driver and NVML")
    s.set_defaults(func=cmd_version)
    s = sub.add_parser("mig", help="MIG information")
    mig = s.add_subparsers(dest="mig_command", metavar="COMMAND", required=True)
    s = mig.add_parser("profiles", parents=[js], help="GPU instance profiles and placements")
    s.add_argument("--gpu", metavar="SEL", help="index, PCI address or UUID")
    s.set_defaults(func=cmd_mig_profiles)
    s = sub.add_parser("passthrough", parents=[js], help="GPUs on vfio-pci, for libvirt/KubeVirt")
    s.set_defaults(func=cmd_passthrough)
    return p


def _err(msg: str) -> None:
    print(f"gpudctl: {msg}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        a = parser.parse_args(argv)
    except SystemExit as e:  # argparse: 2 on usage errors, 0 for --help
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    client = Client(a.socket)
    try:
        return a.func(client, a)
    except UsageError as e:
        _err(str(e))
        return EXIT_USAGE
    except Unreachable as e:
        _err(str(e))
        return EXIT_UNREACHABLE
    except WaitTimeout as e:
        _err(str(e))
        return EXIT_NOT_CONVERGED if a.command == "apply" else EXIT_UNREACHABLE
    except DaemonError as e:
        _err(e.message if e.code == wire.E_INVALID_LAYOUT else str(e))
        if e.code == wire.E_INVALID_LAYOUT:
            return EXIT_INVALID
        if e.code == wire.E_TIMEOUT and a.command == "apply":
            return EXIT_NOT_CONVERGED
        return EXIT_ERROR
    except wire.FrameError as e:
        _err(f"protocol error: {e}")
        return EXIT_ERROR
    except BrokenPipeError:
        # stdout closed early (`gpudctl status | head`): not an error worth a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except LocalError as e:
        _err(str(e))
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
