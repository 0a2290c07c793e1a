"""A gpud lease engine in its own process, killed with SIGKILL at one stage of a lease (the
`kill -9` tests): `python -m tests.leases.lease_child TMP PROFILE STAGE`, or with PROFILE
`release:ID` the release of lease ID. It attaches to the simulated host and state directory the
test made, and prints nothing."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from tests.support import simrig as harness


async def main(tmp: Path, profile: str, stage: str) -> None:
    real_create = harness.simcli.create
    harness.simcli.create = lambda *a, **k: None  # type: ignore[assignment]  # the host exists: attach to it
    try:
        rig = harness.SimRig(tmp, (), state_dir=str(tmp / "state"))
    finally:
        harness.simcli.create = real_create
    assert rig.rec.load_config()
    rig.rec.refresh()
    await rig.rec.leases.start()

    def kill_at(rec, now: str) -> None:
        if now == stage:
            os.kill(os.getpid(), signal.SIGKILL)

    rig.rec.leases.on_stage = kill_at
    if profile.startswith("release:"):
        await rig.rec.leases.release(profile.removeprefix("release:"))
    else:
        await rig.rec.leases.lease(profile, owner="killed")


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2], sys.argv[3]))
