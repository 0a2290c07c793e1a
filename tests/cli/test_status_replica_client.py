"""gpudctl asks the status replica (gpud/api/status_replica.py) for a plain `status` and the daemon
for everything else, and for that status too whenever the replica fails it in any way: nothing
listening, a refusal, a connection closed, silence. The daemon here is the real API server on the
tests' fake handler (tests/cli/conftest.py); each "replica" a socket whose behaviour the test sets."""

from __future__ import annotations

import socket
import threading

import msgpack
import msgspec
import pytest

from gpud.cli.transport import Client
from gpud.wire import protocol as wire
from tests.api.fakes import status_reply


class FakeReplica:
    """Listens at the status socket of `main` and answers every request as `behaviour` says;
    records the requests it read."""

    def __init__(self, main: str, behaviour: str) -> None:
        self.behaviour = behaviour
        self.requests: list[dict] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(wire.status_socket(main))
        self.sock.listen(8)
        self.held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)
            if self.behaviour == "closes":
                conn.close()
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        reader = wire.FrameReader()
        while True:
            try:
                payload = reader.read_sync(conn)
            except (OSError, wire.FrameError):
                return
            if payload is None:
                return
            req = msgpack.unpackb(payload)
            self.requests.append(req)
            if self.behaviour == "silent":
                continue
            if self.behaviour == "answers":
                reply = msgspec.structs.replace(status_reply(), phase="from-the-replica")
                conn.sendall(wire.encode_frame(wire.Response(id=req["id"], ok=True, result=reply)))
            else:
                conn.sendall(wire.encode_frame(wire.Response(id=req["id"], ok=False, error=wire.ErrorInfo(
                    code=wire.E_ELSEWHERE if self.behaviour == "elsewhere" else wire.E_FORBIDDEN, message="no"))))

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.fixture
def replica(daemon):
    made: list[FakeReplica] = []

    def make(behaviour: str) -> FakeReplica:
        made.append(FakeReplica(daemon.path, behaviour))
        return made[-1]

    yield make
    for r in made:
        r.close()


def statuses_asked_of(daemon) -> int:
    return sum(1 for op, _, _ in daemon.handler.calls if op == "status")


def test_a_plain_status_is_the_replicas_answer_and_the_rest_goes_to_the_daemon(daemon, replica):
    r = replica("answers")
    with Client(daemon.path) as c:
        assert c.request("status").phase == "from-the-replica"
        assert c.request("status", {"fresh": False}).phase == "from-the-replica"
        assert c.request("status", {"fresh": True}).phase == status_reply().phase  # a read begun after the ask
        assert c.request("version").version == "0.1.0"
    assert [q["args"] for q in r.requests] == [{}, {"fresh": False}]
    assert statuses_asked_of(daemon) == 1


@pytest.mark.parametrize("behaviour", ["elsewhere", "forbidden", "closes", "silent"])
def test_any_failure_of_the_replica_is_answered_by_the_daemon(daemon, replica, behaviour):
    r = replica(behaviour)
    with Client(daemon.path, timeout=1.0) as c:  # the replica's silence is waited for up to this long
        assert c.request("status").phase == status_reply().phase
        assert c.request("status").phase == status_reply().phase  # not asked again by this client
    assert statuses_asked_of(daemon) == 2
    assert len(r.requests) == (0 if behaviour == "closes" else 1)


def test_without_a_replica_the_daemon_answers(daemon):
    with Client(daemon.path) as c:
        assert c.request("status").phase == status_reply().phase
    assert statuses_asked_of(daemon) == 1
