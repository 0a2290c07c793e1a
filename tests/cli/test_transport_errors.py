"""gpudctl's DaemonError crosses a process boundary intact: a process pool (bench/reliability.py
runs its simulated hosts in one) pickles a worker's exception back to the parent; one that does
not unpickle kills the pool's result thread and every worker's result is lost."""

from __future__ import annotations

import pickle

from gpud.cli.transport import DaemonError


def test_daemon_error_survives_pickling():
    e = pickle.loads(pickle.dumps(DaemonError("busy", "gpud is full")))
    assert isinstance(e, DaemonError) and (e.code, e.message, str(e)) == ("busy", "gpud is full", "gpud is full [busy]")
