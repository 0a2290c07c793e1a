"""Issue 33 item 10: the fair-share bookkeeping kept one entry per `check`/`plan` forever (about
1 MB an hour for one member looping checks). Whatever the number of turns, what it keeps is bounded
by the uids waiting or running now plus a fixed window of the order turns began."""

from __future__ import annotations

import asyncio

from gpud.api.fair_share import SERVED_KEPT, FairShare


async def test_turns_leave_bounded_records():
    fs = FairShare()

    async def one(uid: int) -> None:
        async with fs.turn(uid):
            await asyncio.sleep(0)

    for round_ in range(50):
        await asyncio.gather(*(one(uid) for uid in (1000, 1001, 1002, 0)), *(one(1000) for _ in range(16)))
        if round_ == 0:
            first = list(fs.served)
    assert first[:4] == [1000, 1001, 1002, 0]  # still served in turn
    assert len(fs.served) <= SERVED_KEPT  # 50 rounds x 20 turns = 1,000 turns
    assert fs.running == {} and len(fs._waiting) == 0
