"""gpudctl: the thin client of gpud, and its entry point (`main`).

The package imports only the standard library, msgpack and the protocol's msgspec-free part
(`gpud.wire.frames`, `gpud.mig_text`): people run it in loops and scripts, so start-up time
matters more than anything it could share with the daemon. Replies are read as gpud's wire structs
through gpud.cli.view, which imports msgspec and the structs only for a field an older gpud did not send.
Three parts: `transport` (the blocking socket and the replies), `render` (reply -> text) and
`commands` (arguments -> request -> output -> exit code); this module maps failures to exit codes.

Exit codes (stable, for scripts):
  0  success (`status` returns 0 whatever the phase: read the phase, or use `apply --wait`)
  1  error: gpud answered with an error (forbidden, internal...), or a local error
  2  usage
  3  gpud unreachable: no socket, refused, permission denied, connection lost
  4  invalid layout: `check` or `plan` found errors or an infeasible GPU, `reload` found errors;
     `lease`: no dynamic GPU has room (the shortfall named), or the lease conflicts with one there;
     `release`: no such lease
  5  not converged: `apply --wait` ended blocked, failed or timed out; `release`: the instance is in use
     (on-busy: fail)
  6  still working: gpud took the request but did not answer within --reply-timeout (default 30 s)
"""

from __future__ import annotations

import os
import sys

from gpud.cli.arguments import build_parser
from gpud.cli.commands import (
    EXIT_ERROR,
    EXIT_INVALID,
    EXIT_NOT_CONVERGED,
    EXIT_OK,
    EXIT_STILL_WORKING,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    LocalError,
    UsageError,
)
from gpud.cli.transport import Client, DaemonError, Unreachable, WaitTimeout
from gpud.wire import frames


def _as_written(message: str) -> str:
    return message


def _skip_argparse_translation() -> None:
    """argparse passes each of its own words ("usage: ", "options"...) through gettext, whose
    look-up imports `locale` and stats a catalog path per language for every parser built: about
    2 ms of a run that is meant to take twice what `nvidia-smi -L` does. Python's own messages have
    no catalogs in Debian's packages, so the look-up always ends in the words as written; gpudctl
    (a process of its own) prints them so without asking."""
    import argparse

    argparse._ = _as_written  # type: ignore[attr-defined]  # argparse's own gettext alias


def _err(msg: str) -> None:
    print(f"gpudctl: {msg}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
        _skip_argparse_translation()  # only as the program itself: not when imported by others
    parser = build_parser(argv)
    try:
        a = parser.parse_args(argv)
    except SystemExit as e:  # argparse: 2 on usage errors, 0 for --help
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    # what is printed for a person has every outside string escaped; --json stays exact
    client = Client(a.socket, timeout=a.reply_timeout, escape=not getattr(a, "json", False))
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
        return EXIT_NOT_CONVERGED if a.command == "apply" else EXIT_STILL_WORKING
    except DaemonError as e:
        _err(e.message if e.code == frames.E_INVALID_LAYOUT else str(e))
        if e.code == frames.E_INVALID_LAYOUT:
            return EXIT_INVALID
        if e.code == frames.E_TIMEOUT and a.command == "apply":
            return EXIT_NOT_CONVERGED
        if e.code in (frames.E_NO_ROOM, frames.E_NOT_FOUND, frames.E_CONFLICT) and a.command in ("lease", "release"):
            return EXIT_INVALID
        if e.code == frames.E_IN_USE and a.command == "release":
            return EXIT_NOT_CONVERGED
        return EXIT_ERROR
    except frames.FrameError as e:
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


def run() -> None:
    """gpudctl as a program: main(), its output flushed, then the process ends at once. The
    interpreter's normal exit tears down every module and object one by one (argparse, re,
    the reply), about 6 ms on the lent H200 host (bench/results/h200-status-timing.md): a sixth
    of a `gpudctl status`, for memory the kernel frees anyway. gpudctl registers no atexit work
    and leaves no file open for writing, so nothing is lost by skipping it."""
    code = main()
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # `gpudctl status | head`: the reader left; nothing more to say
        pass
    try:
        sys.stderr.flush()
    except BrokenPipeError:
        pass
    os._exit(code)


if __name__ == "__main__":
    run()
