"""The host-wide apply lock: a second gpud on the same host waits instead of changing it too; and
no other local user can hold it, aim it at another file, or put their words into status."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys

import pytest

from gpud.engine.apply_lock import ApplyLock, ApplyLockBusy, ApplyLockRefused
from tests.support.present import present
from tests.support.processes import reap

# Another gpud, as far as the lock goes: flock, then its record in gpud's format.
HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.write(fd, sys.argv[2].replace("PID", str(os.getpid())).encode())
print("held", flush=True)
sys.stdin.read()          # hold until the test closes our stdin
"""


def hold(path, record: str = "gpud pid=PID\n") -> subprocess.Popen:
    other = subprocess.Popen([sys.executable, "-c", HOLD, str(path), record], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert present(other.stdout).readline().strip() == "held"
    return other


async def first_wait_notice(lock: ApplyLock) -> tuple[asyncio.Task, list[str], asyncio.Event]:
    waits: list[str] = []
    entered = asyncio.Event()

    async def apply() -> None:
        async with lock.held(waits.append):
            entered.set()

    task = asyncio.create_task(apply())
    while not waits and not task.done():  # the waiting notice comes before the blocking wait
        await asyncio.sleep(0)
    return task, waits, entered


async def test_second_holder_waits_for_the_first(tmp_path):
    path = tmp_path / "apply.lock"
    other = hold(path)
    try:
        task, waits, entered = await first_wait_notice(ApplyLock(path))
        assert f"another gpud (pid {other.pid}) is applying" in waits[0]
        assert not entered.is_set()
        present(other.stdin).close()  # the other process lets go
        await asyncio.wait_for(task, 30)
        assert entered.is_set()
        assert path.read_bytes() == f"gpud pid={os.getpid()}\n".encode()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        reap(other)


async def test_uncontended_lock_does_not_wait(tmp_path):
    waits: list[str] = []
    async with ApplyLock(tmp_path / "sub" / "apply.lock").held(waits.append):
        pass
    assert waits == []


async def test_holder_text_not_in_gpuds_format_is_never_shown(tmp_path):
    path = tmp_path / "apply.lock"
    other = hold(path, "\x1b[31mpid 1; rm -rf / is applying\nsecret")
    try:
        task, waits, _ = await first_wait_notice(ApplyLock(path))
        assert "unrecognised lock record" in waits[0]
        assert "rm -rf" not in waits[0] and "secret" not in waits[0] and "\x1b" not in waits[0]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        reap(other)


async def test_symlink_at_the_lock_path_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    path = tmp_path / "run" / "apply.lock"
    path.parent.mkdir(mode=0o755)
    path.symlink_to(victim)
    with pytest.raises(ApplyLockRefused, match="cannot open the apply lock"):
        async with ApplyLock(path).held(lambda m: None):
            pass
    assert victim.read_text() == "precious\n"


async def test_lock_file_of_another_user_is_refused(tmp_path):
    path = tmp_path / "apply.lock"
    path.write_bytes(b"")
    os.chown(path, os.geteuid() + 1000, -1)  # what a stranger who got there first would own
    with pytest.raises(ApplyLockRefused, match=rf"owned by uid {os.geteuid() + 1000}"):
        async with ApplyLock(path).held(lambda m: None):
            pass


async def test_fifo_at_the_lock_path_is_refused_without_blocking(tmp_path):
    path = tmp_path / "apply.lock"
    os.mkfifo(path, 0o600)
    with pytest.raises(ApplyLockRefused, match="not a regular file|cannot open"):
        async with ApplyLock(path).held(lambda m: None):
            pass


async def test_world_writable_directory_is_refused(tmp_path):
    shared = tmp_path / "lock"
    shared.mkdir()
    shared.chmod(0o1777)  # /run/lock
    with pytest.raises(ApplyLockRefused, match="writable by others"):
        async with ApplyLock(shared / "gpud-apply.lock").held(lambda m: None):
            pass
    assert not (shared / "gpud-apply.lock").exists()


async def test_old_0644_lock_file_is_narrowed_so_no_one_else_can_open_it(tmp_path):
    path = tmp_path / "apply.lock"
    path.write_bytes(b"")
    path.chmod(0o644)  # what gpud made before: any user could open it read-only and flock it
    async with ApplyLock(path).held(lambda m: None):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_missing_directory_is_made_writable_by_gpud_only_and_reachable_for_the_socket(tmp_path):
    """gpud's run directory holds the control socket too: made 0755 (owner-writable, as the
    lock demands; searchable, so group gpud reaches the socket), whatever the umask allowed."""
    run = tmp_path / "run" / "gpud"
    old = os.umask(0)
    try:
        with ApplyLock(run / "apply.lock").held_now():
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE(run.stat().st_mode) == 0o755
    assert stat.S_IMODE((run / "apply.lock").stat().st_mode) == 0o600


def test_a_try_now_takes_a_free_lock_and_records_itself(tmp_path):
    path = tmp_path / "apply.lock"
    with ApplyLock(path).held_now():
        assert path.read_bytes() == f"gpud pid={os.getpid()}\n".encode()
        other = subprocess.run([sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
                                "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)", str(path)], capture_output=True)
        assert other.returncode != 0 and b"BlockingIOError" in other.stderr  # held while inside
    other = subprocess.run([sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
                            "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)", str(path)], capture_output=True)
    assert other.returncode == 0, other.stderr  # and let go after


def test_a_try_now_refuses_at_once_naming_the_holder(tmp_path):
    path = tmp_path / "apply.lock"
    other = hold(path)
    try:
        with pytest.raises(ApplyLockBusy, match=rf"another gpud \(pid {other.pid}\) holds {path}"):
            with ApplyLock(path).held_now():
                pytest.fail("entered a lock another process holds")
        assert path.read_bytes() == f"gpud pid={other.pid}\n".encode()  # its record left alone
    finally:
        reap(other)
