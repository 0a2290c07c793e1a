"""A large `check` is parsed off the event loop: status is answered while it is being parsed
(a 1 MiB check once blocked the loop 7-11 s, past the systemd watchdog's patience)."""

from __future__ import annotations

import asyncio

import pytest

from gpud.api.handlers import RequestHandler
from gpud.api.peers import Peer
from gpud.engine.engine import Engine
from tests.support.simrig import SimRig

ROOT = Peer(pid=1, uid=0, gid=0, groups=frozenset({0}))


@pytest.fixture
def rig(tmp_path):
    r = SimRig(tmp_path, ("h100-80gb:2",))
    yield r
    r.close()


async def test_status_is_answered_while_a_large_check_is_parsed(rig):
    rig.config.write_text("version: v1\nlayouts:\n  a:\n    - {devices: all, mig-enabled: false}\n")
    assert rig.rec.load_config()
    rig.rec.refresh()  # the first observation, as the daemon reads it before READY
    handler = RequestHandler(Engine(rig.rec))
    # ~250 KB of YAML: seconds of parsing on any machine, against milliseconds for a status
    big = "version: v1\nlayouts:\n  a:\n    - devices: [" + ", ".join(["0"] * 40_000) + "]\n      mig-enabled: false\n"
    check = asyncio.create_task(handler.handle("check", {"text": big, "path": "big.yaml"}, ROOT))
    await asyncio.sleep(0)  # the check starts
    status = await handler.handle("status", {}, ROOT)
    assert not check.done(), "status waited for the whole check: the parse ran on the event loop"
    assert [g.state for g in status.gpus] and status.layout.valid
    reply = await asyncio.wait_for(check, 600)
    assert reply.valid is False and reply.errors  # 40,000 selectors of one GPU: duplicates
    assert len(reply.errors) <= 101


async def test_checks_are_parsed_one_at_a_time(rig):
    """Five large checks at once queue for one parser instead of multiplying the daemon's memory."""
    handler = RequestHandler(Engine(rig.rec))
    keeper = rig.rec.layout_file
    text = "version: v1\nlayouts:\n  a:\n    - devices: [" + ", ".join(["0"] * 5_000) + "]\n"
    active, most = 0, 0
    parse = keeper._parse

    def counting_parse(t, p, select=None):
        nonlocal active, most
        active += 1
        most = max(most, active)
        try:
            return parse(t, p, select)
        finally:
            active -= 1

    keeper._parse = counting_parse
    replies = await asyncio.gather(*(handler.handle("check", {"text": text, "path": f"{i}.yaml"}, ROOT)
                                     for i in range(5)))
    assert most == 1 and len(replies) == 5
