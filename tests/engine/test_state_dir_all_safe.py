"""Issue 33 item 7: every file gpud reads from its state dir goes through the one safe reader
(gpud.host.files.state_files). A FIFO at `kube-layout.json` hung `gpud --kube-node` at start (and SIGTERM
with it); `persistence-restore.json` was read the same raw way. Each is read in a thread joined
with a bound, so the old blocking open fails the test instead of hanging it."""

from __future__ import annotations

import json
import os
import threading

import pytest

from gpud.engine.kube.applier import REMEMBERED, ReconcilerApplier
from gpud.host.nvidia.gpu_reset import GpuReset

INTENT = "persistence-restore.json"


def _readers(state):
    reset = GpuReset("/nonexistent/nvidia-smi", intent_path=str(state / INTENT))
    return {REMEMBERED: ReconcilerApplier(str(state)).remembered, INTENT: reset._pending}


def _bounded(call):
    out: list = []
    t = threading.Thread(target=lambda: out.append(call()), daemon=True)
    t.start()
    t.join(10)
    return t.is_alive(), out


def _unblock(path):
    try:  # a writer end lets a blocked open of the old code return, so the thread ends
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


@pytest.mark.parametrize("name", [REMEMBERED, INTENT])
@pytest.mark.parametrize("kind", ["fifo", "symlink", "garbage"])
def test_state_files_read_safely(tmp_path, name, kind):
    state = tmp_path / "state"
    state.mkdir()
    path = state / name
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":  # a link to a well-formed file elsewhere is never followed
        target = tmp_path / "elsewhere.json"
        target.write_text(json.dumps({"layout": "all-disabled"} if name == REMEMBERED else ["0000:3b:00.0"]))
        path.symlink_to(target)
    else:
        path.write_bytes(b"\x00garbage{[")
    try:
        blocked, out = _bounded(_readers(state)[name])
    finally:
        _unblock(path)
    assert not blocked, f"reading {name} blocked on a {kind}"
    assert out == [None] if name == REMEMBERED else out == [[]]
    aside = [p.name for p in state.iterdir() if p.name.startswith(name + ".set-aside-")]
    assert len(aside) == 1 and not os.path.lexists(path), sorted(os.listdir(state))  # kept for a person


def test_good_files_still_read(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / REMEMBERED).write_text(json.dumps({"layout": "all-1g.10gb"}))
    (state / INTENT).write_text(json.dumps(["0000:3b:00.0"]))
    readers = _readers(state)
    assert readers[REMEMBERED]() == "all-1g.10gb"
    assert readers[INTENT]() == ["0000:3b:00.0"]
