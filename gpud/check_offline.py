"""`gpud check`: the daemon's `check` of a layout, with no daemon running (CI, Ansible, a host
before gpud is started). gpudctl runs it when it cannot reach gpud, so the verdict is the one the
daemon would give: the same parse, resolution against the host and planning (engine.feasibility),
the same reply.

The host is read read-only, as `gpud --read-only` reads it (sysfs and NVML; every mutating call is
refused), and nothing of gpud's state is written: the daemon's GPU index map, when there is one,
is read from a copy in a temporary directory, so indices and remembered UUIDs are the daemon's.

  gpud check [--all-layouts] [--path NAME] [--state-dir DIR] [--sim DIR] FILE|-
prints the reply as JSON (gpud.wire.replies.CheckReply); exit 0 valid, 4 invalid, 1 failed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import sys
import tempfile

import msgspec

from gpud.api.handlers import RequestHandler
from gpud.engine.apply_lock import ApplyLock
from gpud.engine.engine import build_engine
from gpud.engine.events import EventBus
from gpud.engine.observe.gpu_index import FILE_NAME as INDEX_FILE
from gpud.engine.observe.gpu_index import backup_path
from gpud.hardware import HostConfig, build_hardware
from gpud.host.nvidia.nvml import NvmlError
from gpud.wire import replies as wire_replies


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gpud check", description="Check a layout against this host as gpud "
                                 "would, without a running gpud; the host is only read.")
    ap.add_argument("file", metavar="FILE", help="the layout, or - for standard input")
    ap.add_argument("--path", metavar="NAME", help="the name errors give the file (default: FILE)")
    ap.add_argument("--all-layouts", action="store_true", help="check every layout of the file")
    ap.add_argument("--state-dir", default="/var/lib/gpud", help="where gpud keeps its GPU index map (read only)")
    ap.add_argument("--sim", metavar="DIR", help="check against the simulated host in DIR")
    return ap.parse_args(argv)


def check(text: str, path: str, *, all_layouts: bool = False, state_dir: str = "/var/lib/gpud",
          sim: str | None = None) -> wire_replies.CheckReply:
    """The CheckReply the daemon would give for `text` on this host, from a read-only host."""
    with tempfile.TemporaryDirectory(prefix="gpud-check.") as tmp:
        index = os.path.join(state_dir, INDEX_FILE)
        for src in (index, backup_path(index)):
            if os.path.isfile(src) and not os.path.islink(src):
                shutil.copyfile(src, os.path.join(tmp, os.path.basename(src)))
        host = build_hardware(HostConfig(sim=sim, read_only=True, state_dir=tmp))
        engine = build_engine(host.hw, config_path=path, apply_lock=ApplyLock(os.path.join(tmp, "apply.lock")),
                              bus=EventBus(), read_only=True, state_dir=tmp, boot_id_path=host.boot_id_path)
        try:
            host.hw.nvml.open()
        except NvmlError as e:  # every GPU on vfio-pci, or no driver: checked from sysfs as the daemon does
            logging.getLogger("gpud").info("NVML not available: %s", e)
        try:
            return asyncio.run(RequestHandler(engine, dev_root=host.dev_root).op_check(text, path, all_layouts))
        finally:
            host.hw.nvml.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.file == "-":
            text = sys.stdin.read()
        else:
            with open(args.file, encoding="utf-8") as f:
                text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        print(f"gpud check: cannot read {args.file}: {e}", file=sys.stderr)
        return 1
    path = args.path or (args.file if args.file == "-" else os.path.abspath(args.file))
    reply = check(text, path, all_layouts=args.all_layouts, state_dir=args.state_dir, sim=args.sim)
    sys.stdout.buffer.write(msgspec.json.encode(reply) + b"\n")
    return 0 if reply.valid else 4


if __name__ == "__main__":
    sys.exit(main())
