"""`gpudctl select NAME` (mig-parted's `apply -c NAME`): a layout of the file put in force over
its `selected`, so a mig-parted file with many configs and no `selected` is used as it is. The
choice is kept in the state directory (`layout-choice.json`, replaced atomically), so a restart
and a reboot keep it; `gpudctl select --file` goes back to the file's own `selected`."""

from __future__ import annotations

import contextlib
import os

import msgspec

from gpud.host.files import state_files

FILE_NAME = "layout-choice.json"


class Choice(msgspec.Struct, forbid_unknown_fields=True):
    layout: str


def _decode(data: bytes) -> str:
    choice = msgspec.json.decode(data, type=Choice)
    if not choice.layout:
        raise state_files.BadStateFile('expected {"layout": "<name>"}')
    return choice.layout


def load(state_dir: str | None, problems: state_files.Problems | None = None) -> str | None:
    if state_dir is None:
        return None
    return state_files.load(os.path.join(state_dir, FILE_NAME), _decode, problems, limit=65536,
                            what="layout choice")


def save(state_dir: str | None, name: str | None) -> None:
    """Keep `name` (None: forget the choice). OSError when it cannot be written."""
    if state_dir is None:
        return
    path = os.path.join(state_dir, FILE_NAME)
    if name is None:
        with contextlib.suppress(FileNotFoundError):
            state_files.remove(path)
        return
    state_files.save(path, msgspec.json.encode(Choice(layout=name)) + b"\n")


def keep(state_dir: str | None, name: str | None, problems: state_files.Problems) -> None:
    """`save`, with a failure said as a state-file problem: the choice is in force all the same."""
    try:
        save(state_dir, name)
    except OSError as e:
        problems.say(FILE_NAME, f"the layout choice {name!r} is in force but was not kept ({e}): a restart "
                     "goes back to the file's own")
