"""The host-wide apply lock: a second gpud on the same host waits instead of changing it too."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from gpud.engine.apply_lock import ApplyLock

HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, str(os.getpid()).encode())
print("held", flush=True)
sys.stdin.read()          # hold until the test closes our stdin
"""


async def test_second_holder_waits_for_the_first(tmp_path):
    path = tmp_path / "apply.lock"
    other = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        waits: list[str] = []
        entered = asyncio.Event()

        async def apply() -> None:
            async with ApplyLock(path).held(waits.append):
                entered.set()

        task = asyncio.create_task(apply())
        while not waits:  # the waiting notice comes before the blocking wait
            await asyncio.sleep(0)
        assert f"pid {other.pid}" in waits[0]
        assert not entered.is_set()
        other.stdin.close()  # the other process lets go
        await asyncio.wait_for(task, 30)
        assert entered.is_set()
        assert path.read_text() == str(__import__("os").getpid())
    finally:
        other.kill()
        other.wait()


async def test_uncontended_lock_does_not_wait(tmp_path):
    waits: list[str] = []
    async with ApplyLock(tmp_path / "sub" / "apply.lock").held(waits.append):
        pass
    assert waits == []
