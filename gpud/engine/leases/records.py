"""Lease records: what gpud leased, durable in STATE_DIR/leases.json, written around each NVML change.

Why: a lease outlives the daemon (a job runs for days; gpud restarts on upgrade), and a `kill -9`
may fall between any two NVML calls. So each lease is written as an *intent* before its first
NVML change, rewritten after each one (`gi-made`, then `held` with the MIG UUID), and a release
is written `releasing` before its first destroy and dropped after the last. At start
(gpud.engine.leases.startup) every record is compared with what NVML shows, and the state tells
exactly which calls had happened. The file is read strictly through gpud.host.files.state_files: a file
not in this format is set aside and reported, never acted on.
"""

from __future__ import annotations

import os
import threading
from typing import Literal

import msgspec
from msgspec import Struct

from gpud.host.files import state_files
from gpud.model import Placement

RECORD_FILE = "leases.json"

# intent: written, no NVML change made yet; gi-made: the GI exists (id known), no CI yet;
# held: GI and CI exist, the lease is answered; releasing: destroys begun; vanished: a held lease's
# instance is no longer on the GPU (someone destroyed it, or the GPU was reset): shown until released.
LeaseState = Literal["intent", "gi-made", "held", "releasing", "vanished"]
LeaseKind = Literal["mig", "gpu"]


class LeaseRecord(Struct, frozen=True, kw_only=True):
    id: str
    kind: LeaseKind
    gpu: str  # PCI address
    profile: str  # the MIG device name as asked ("1g.10gb", "1c.3g.40gb"); "gpu" for a whole GPU
    owner: str = ""
    uid: int = 0  # who asked (SO_PEERCRED)
    pid: int | None = None  # holder: released when it is gone and the instance idle
    pid_start: int | None = None  # its start time (/proc/<pid>/stat), so a reused pid is not taken for it
    created: float = 0.0  # Unix seconds
    state: LeaseState = "intent"
    gi_profile_id: int | None = None
    ci_profile_id: int | None = None
    placement: Placement | None = None
    gi: int | None = None
    ci: int | None = None
    uuid: str | None = None  # MIG-... (or the GPU's own UUID for a whole-GPU lease)
    devices: tuple[str, ...] = ()  # the device nodes a job needs: /dev/nvidiaN and its MIG capabilities
    note: str = ""  # why it vanished


def new_id() -> str:
    """Short, unguessable, never reused in practice: `l-1a2b3c4d5e`."""
    return "l-" + os.urandom(5).hex()  # secrets.token_hex without hashlib (gpud.host.files.safe_file)


def _decode(data: bytes) -> dict[str, LeaseRecord]:
    records = msgspec.json.decode(data, type=dict[str, LeaseRecord])
    for key, rec in records.items():
        if key != rec.id:
            raise state_files.BadStateFile(f"record {key!r} has id {rec.id!r}")
    return records


class LeaseBook:
    """The records in memory and on disk. `put`/`drop` write the whole file durably before they
    return (OSError: not written; the caller decides: before an NVML change that refuses the lease).
    `state_dir` None: no durable records (read-only mode, tests without a state directory)."""

    def __init__(self, state_dir: str | None, problems: state_files.Problems | None = None) -> None:
        self.path = os.path.join(state_dir, RECORD_FILE) if state_dir else None
        self.problems = problems if problems is not None else state_files.Problems()
        self.records: dict[str, LeaseRecord] = {}
        self._lock = threading.Lock()  # writers in worker threads: one whole-file snapshot at a time

    def load(self) -> dict[str, LeaseRecord]:
        if self.path is not None:
            self.records = state_files.load(self.path, _decode, self.problems, what="lease record") or {}
        return self.records

    def reserve(self, rec: LeaseRecord) -> None:
        """Book `rec` in memory only (its placement is taken for every later choice); `put` or
        `forget` follows."""
        with self._lock:
            self.records = {**self.records, rec.id: rec}

    def forget(self, lease_id: str) -> None:
        """Undo a `reserve` whose intent was never written."""
        with self._lock:
            self.records = {k: v for k, v in self.records.items() if k != lease_id}

    def put(self, rec: LeaseRecord) -> None:
        with self._lock:
            records = {**self.records, rec.id: rec}
            self._write(records)
            self.records = records

    def drop(self, lease_id: str) -> None:
        with self._lock:
            records = {k: v for k, v in self.records.items() if k != lease_id}
            self._write(records)
            self.records = records

    def _write(self, records: dict[str, LeaseRecord]) -> None:
        if self.path is None:
            return
        state_files.save(self.path, msgspec.json.format(msgspec.json.encode(records)), mode=0o644)
        self.problems.clear(self.path)

    def on(self, pci: str) -> list[LeaseRecord]:
        return [r for r in self.records.values() if r.gpu == pci]
