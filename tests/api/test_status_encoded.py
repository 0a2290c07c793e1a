"""`status` is sent from bytes encoded once per snapshot (gpud.api.status_snapshot): they must be the
bytes msgspec writes for the whole reply struct, whatever the answer's time, age and Kubernetes
part, and a client over the socket must read the same reply as the handler's struct."""

from __future__ import annotations

import os
import shutil
import tempfile

import msgspec
import pytest

from gpud.api.handlers import RequestHandler
from gpud.api.server import serve
from gpud.api.status_snapshot import StatusSnapshot
from gpud.engine.engine import Engine
from gpud.wire import replies as wire_replies
from tests.scenarios.definitions import layout, mig
from tests.support.api import Conn
from tests.support.simrig import SimRig

ROOT_ARGS = {"fresh": False}


@pytest.fixture
def rig(tmp_path):
    r = SimRig(tmp_path / "r", ("h100-80gb:3",))
    yield r
    r.close()


async def test_the_encoded_answer_is_msgspecs_encoding_of_the_reply(rig):
    # MIG devices on two GPUs, one GPU whole: GPU parts of every shape in the reply
    assert await rig.apply(layout(mig([0, 1], {"1g.10gb": 3, "3g.40gb": 1}), mig([2], None)))
    handler = RequestHandler(Engine(rig.rec))
    view = handler.engine.view
    snap = StatusSnapshot()
    kube = handler.kubernetes(view.observation.gpus)
    assert kube.advertised is not None
    for observed_at, age, kubernetes in ((0.0, 0.0, None), (1764840000.123456, 0.00004, kube),
                                        (1764840001.5, 12.75, kube), (2.0, 1e9, None)):
        raw = snap.encoded(view, observed_at=observed_at, age=age, kubernetes=kubernetes)
        struct = snap.reply(view, observed_at=observed_at, age=age, kubernetes=kubernetes)
        assert bytes(raw) == msgspec.msgpack.encode(struct)
        assert sum(len(g.mig.instances) for g in struct.gpus) == 8
    # the same snapshot's parts serve every answer until the view changes
    kept = snap._encoded
    snap.encoded(view, observed_at=3.0, age=0.5)
    assert snap._encoded is kept and snap.builds == 1


async def test_a_client_reads_the_handlers_reply_over_the_socket(rig):
    assert await rig.apply(layout(mig([0], {"7g.80gb": 1})))
    handler = RequestHandler(Engine(rig.rec))
    sockdir = tempfile.mkdtemp(prefix="gpud-t", dir="/tmp")  # short: sun_path is 108 bytes
    os.chmod(sockdir, 0o755)
    server = await serve(handler, f"{sockdir}/gpud.sock", group=None)
    try:
        c = await Conn.open(f"{sockdir}/gpud.sock")
        for _ in range(2):
            resp = await c.call("status")
            assert resp.ok
            got = wire_replies.decode_result("status", resp.result)
            want = await handler.handle("status", ROOT_ARGS, None)  # type: ignore[arg-type]
            assert isinstance(got, wire_replies.StatusReply)
            assert got.observed_at == want.observed_at
            assert msgspec.structs.replace(got, observation_age=0.0) == msgspec.structs.replace(
                want, observation_age=0.0)
        assert handler.requests["status"] == 4  # both paths are counted for the stats op
    finally:
        await Conn.close_all()
        await server.close()
        shutil.rmtree(sockdir, ignore_errors=True)
