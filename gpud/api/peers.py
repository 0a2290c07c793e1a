"""Who is on the other end of the socket, as the kernel says, and what they may do.

Authorisation is decided from the kernel's SO_PEERCRED record (and the peer's supplementary groups
from SO_PEERGROUPS, or /proc when that is missing), never from anything the client says.
Who may do what: uid 0 everything; members of the `gpud` group the read ops (`wire.READ_OPS`);
members of the layout's `policy.lease-group` the lease ops (`wire.LEASE_OPS`) and the read ops;
nobody else anything.

Standard library only (the ops' names from gpud.wire.frames): the status replica
(gpud/api/status_replica.py) checks its clients with these same functions in a process that
imports nothing it does not need.
"""

from __future__ import annotations

import grp
import os
import socket
import struct
from typing import NamedTuple

from gpud.wire import frames as wire

_UCRED = struct.Struct("iII")  # struct ucred: pid_t pid; uid_t uid; gid_t gid
# SO_PEERGROUPS (Linux 4.13): the peer's supplementary groups as of connect(), race-free. 59 on
# the asm-generic architectures; elsewhere fall back to /proc.
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", None) or (
    59 if os.uname().machine in ("x86_64", "aarch64", "i686", "riscv64", "s390x", "ppc64le") else None
)


class Peer(NamedTuple):
    """Who is on the other end, as the kernel says. `groups` includes the primary gid."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int] = frozenset()



def read_proc_groups(pid: int, euid: int, proc_root: str = "/proc") -> set[int] | None:
    """Supplementary groups from /proc/<pid>/status, or None if unknown.

    The pid may have exited and been reused since connect(): the effective uid must still match
    the one SO_PEERCRED reported, else the groups are not trusted.
    """
    try:
        with open(f"{proc_root}/{pid}/status", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    uid_ok = False
    groups: set[int] | None = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "Uid":
            fields = value.split()
            uid_ok = len(fields) >= 2 and fields[1] == str(euid)
        elif key == "Groups":
            try:
                groups = {int(g) for g in value.split()}
            except ValueError:
                return None
    return groups if uid_ok else None


def _peer_groups(sock: socket.socket) -> set[int] | None:
    if _SO_PEERGROUPS is None:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 1024)  # 256 groups; ERANGE above
    except OSError:
        return None
    n = len(raw) // 4
    return set(struct.unpack(f"={n}I", raw[: n * 4]))


def peer_credentials(sock: socket.socket, proc_root: str = "/proc") -> Peer:
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    groups = _peer_groups(sock)
    if groups is None:
        groups = read_proc_groups(pid, uid, proc_root) or set()
    return Peer(pid=pid, uid=uid, gid=gid, groups=frozenset(groups | {gid}))


def may_connect(peer: Peer, gpud_gid: int | None, lease_gid: int | None = None) -> bool:
    return peer.uid == 0 or any(g is not None and g in peer.groups for g in (gpud_gid, lease_gid))


def authorize(peer: Peer, op: str, gpud_gid: int | None, lease_gid: int | None = None) -> bool:
    """uid 0: any op; `gpud` group members: read ops only; lease group members: lease and read
    ops; everyone else: nothing."""
    if peer.uid == 0:
        return True
    if op in wire.LEASE_OPS:
        return lease_gid is not None and lease_gid in peer.groups
    return op in wire.READ_OPS and may_connect(peer, gpud_gid, lease_gid)


def group_id(group: str | None) -> int | None:
    if not group:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        return None
