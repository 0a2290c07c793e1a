"""The `status` reply, built once per change of what it shows and answered from memory.

Fifty clients asking many times a second must not each rebuild the same reply from the engine's
records: the reply is built when something it is made of has changed (a new observation, a GPU's
state, the phase, the layout or its issues) and reused otherwise; only its age is new in each answer.

What counts as a change is read from the reconciler's own attributes, the ones
`replies.status_reply` reads, so a change the engine makes is never hidden by the snapshot:
the engine's records are immutable (frozen structs, replaced rather than edited), so comparing
them by identity is exact and costs nothing.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gpud.api import replies, wire_replies
from gpud.engine.observe.observer import Observer
from gpud.engine.reconciler import Reconciler


def _made_of(rec: Reconciler) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(records compared by identity, values compared by equality) that status_reply reads."""
    states = rec.gpu_states
    rebuilt = tuple((pci, tuple(what)) for pci, what in rec.vgpus.rebuilt.items())  # a small, edited dict
    return ((rec.observation, rec.resolution, rec.layout, rec.leases.book.records, *states.values()),
            (rec.phase, rec.layout_issues, tuple(states), rec.config_path, rec.read_only,
             rec.boot_rebuild.summary, rebuilt, tuple(rec.state_problems.list()), rec.gpu_index.problem))


class StatusSnapshot:
    def __init__(self) -> None:
        self._key: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None
        self._reply: wire_replies.StatusReply | None = None
        self.builds = 0  # replies built (not reused): for tests and the stats op

    def _current(self, rec: Reconciler) -> wire_replies.StatusReply:
        key = _made_of(rec)
        old = self._key
        if (self._reply is None or old is None or len(old[0]) != len(key[0])
                or any(a is not b for a, b in zip(old[0], key[0])) or old[1] != key[1]):
            self._reply = replies.status_reply(rec)
            self._key = key
            self.builds += 1
        return self._reply

    def reply(self, rec: Reconciler, observer: Observer, *,
              kubernetes: wire_replies.KubernetesStatus | None = None) -> wire_replies.StatusReply:
        """The reply as of now: the snapshot, stamped with the observation's time and age, and
        `kubernetes` (what the device plugins advertise, the label protocol's state) as of now."""
        return msgspec.structs.replace(self._current(rec), observed_at=round(observer.wall_time, 3),
                                       observation_age=round(observer.age(), 4), kubernetes=kubernetes)
