"""Hooks run for real (fork/exec of small scripts): environment, no shell, failure semantics,
apply-exit always running, and timeouts killing the whole process group."""

from __future__ import annotations

import hashlib
import os
import select
import stat
from typing import Any

import pytest

from gpud.engine.hooks import runner as hooks_mod
from gpud.engine.hooks.runner import ApplyInfo, HookFailed, HookRunner, refresh_cdi
from gpud.layout.parse import parse_layout
from gpud.layout.schema import Hook, Hooks
from tests.support.present import present


def script(tmp_path, name: str, body: str) -> str:
    p = tmp_path / name
    p.write_text("#!/bin/sh\n" + body)
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return str(p)


def info(**kw) -> ApplyInfo:
    base: dict[str, Any] = dict(layout="/etc/gpud/layout.yaml", selected="partial-mig",
                                gpus=["0000:19:00.0", "0000:3b:00.0"], mode_change=True)
    base.update(kw)
    return ApplyInfo(**base)


@pytest.fixture
def lines():
    return []


def test_environment_is_child_env_plus_hook_env_plus_gpud_vars(tmp_path, monkeypatch, lines):
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", "1")
    monkeypatch.setenv("LISTEN_FDS", "1")
    monkeypatch.setenv("KEEP_ME", "yes")
    cmd = script(tmp_path, "env.sh", "env | sort\n")
    h = HookRunner(Hooks(pre_apply_mode=(Hook(cmd, env={"FOO": "bar", "GPUD_PHASE": "spoofed"}),)), log=lines.append, output=lines.append)

    async def go():
        return await h.run("pre-apply-mode", info())

    import asyncio
    assert asyncio.run(go()) == []
    out = {ln.split(": ", 1)[1] for ln in lines if ln.startswith("pre-apply-mode hook env.sh: ")}
    env = dict(x.split("=", 1) for x in out if "=" in x)
    for k in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS"):
        assert k not in env
    assert env["KEEP_ME"] == "yes" and env["FOO"] == "bar"
    assert env["GPUD_PHASE"] == "pre-apply-mode"  # gpud's facts win over the hook's env
    assert env["GPUD_LAYOUT"] == "/etc/gpud/layout.yaml"
    assert env["GPUD_SELECTED"] == "partial-mig"
    assert env["GPUD_GPUS"] == "0000:19:00.0 0000:3b:00.0"
    assert env["GPUD_MODE_CHANGE"] == "1" and env["GPUD_CHANGED_MIG"] == "0"
    assert "GPUD_RESULT" not in env


async def test_arguments_reach_the_command_without_a_shell(lines):
    h = HookRunner(Hooks(apply_start=(Hook("/usr/bin/printf", args=("%s\\n", "$HOME; touch /tmp/x", "`id`")),)),
                   log=lines.append, output=lines.append)
    await h.run("apply-start", info())
    printed = [ln.split(": ", 1)[1] for ln in lines if ln.startswith("apply-start hook printf: ")]
    assert printed == ["$HOME; touch /tmp/x", "`id`"]


async def test_failing_before_hook_raises_and_skips_the_rest(tmp_path, lines):
    bad = script(tmp_path, "bad.sh", "echo draining kubelet\necho cannot drain >&2\nexit 3\n")
    after = tmp_path / "after-ran"
    good = script(tmp_path, "good.sh", f"touch {after}\n")
    h = HookRunner(Hooks(pre_apply_config=(Hook(bad), Hook(good))), log=lines.append, output=lines.append)
    with pytest.raises(HookFailed) as ei:
        await h.run("pre-apply-config", info())
    e = ei.value
    assert (e.phase, e.command, e.exit_code, e.timed_out) == ("pre-apply-config", bad, 3, False)
    assert e.output == ["draining kubelet", "cannot drain"]  # stderr is captured too
    # issue 33 item 2: the message reaches events and status, so it names the output's digest, not the output
    digest = hashlib.sha256(b"draining kubelet\ncannot drain\n").hexdigest()[:16]
    assert str(e) == f"pre-apply-config hook {bad} exited 3 (output sha256 {digest}, in the journal)"
    assert not after.exists()
    assert any("exited 3" in ln for ln in lines)


async def test_hook_output_goes_to_the_journal_never_to_the_events(tmp_path):
    """Issue 33 item 2: a hook runs as root and its output went into `events`, which group gpud
    reads. Events get the exit status and a digest; the lines go to the journal (the output sink)."""
    secret = script(tmp_path, "secret.sh", "echo 'root:$6$secret-hash'\nexit 0\n")
    events: list[str] = []
    journal: list[str] = []
    await HookRunner(Hooks(apply_start=(Hook(secret),)), log=events.append, output=journal.append).run(
        "apply-start", info())
    digest = hashlib.sha256(b"root:$6$secret-hash\n").hexdigest()[:16]
    assert not any("secret-hash" in e for e in events), events
    assert events[-1] == f"apply-start hook: {secret} done (exit 0, 1 output lines, sha256 {digest}, in the journal)"
    assert journal == ["apply-start hook secret.sh: root:$6$secret-hash"]


async def test_apply_exit_runs_after_failed_apply_start_and_reports_failure(tmp_path, lines):
    record = tmp_path / "exit-env"
    start = script(tmp_path, "start.sh", "exit 1\n")
    exit_hook = script(tmp_path, "exit.sh", f'echo "$GPUD_RESULT|$GPUD_ERROR|$GPUD_CHANGED_MIG" > {record}\n')
    h = HookRunner(Hooks(apply_start=(Hook(start),), apply_exit=(Hook(exit_hook),)), log=lines.append, output=lines.append)
    body_ran = False
    with pytest.raises(HookFailed):
        async with h.around_apply(info()):
            body_ran = True
    assert not body_ran
    result, error, changed = record.read_text().strip().split("|")
    assert result == "failure" and "apply-start hook" in error and changed == "0"


async def test_apply_exit_runs_after_failed_body_and_its_failures_do_not_raise(tmp_path, lines):
    marks = tmp_path / "marks"
    failing_exit = script(tmp_path, "exit1.sh", f'echo one >> {marks}\nexit 7\n')
    second_exit = script(tmp_path, "exit2.sh", f'echo "two $GPUD_RESULT $GPUD_CHANGED_MIG" >> {marks}\n')
    h = HookRunner(Hooks(apply_exit=(Hook(failing_exit), Hook(second_exit))), log=lines.append, output=lines.append)
    i = info()
    with pytest.raises(RuntimeError, match="nvml exploded"):
        async with h.around_apply(i) as cur:
            cur.changed_mig = True
            raise RuntimeError("nvml exploded")
    assert marks.read_text().split("\n")[:2] == ["one", "two failure 1"]
    assert any("exited 7" in ln for ln in lines)
    # success: GPUD_RESULT=success, and the exit hook failure is returned, not raised
    marks.unlink()
    async with h.around_apply(info()):
        pass
    assert marks.read_text().split("\n")[:2] == ["one", "two success 0"]
    assert [f.exit_code for f in await h.run("apply-exit", info())] == [7]


async def test_timeout_kills_the_whole_process_group(tmp_path, lines):
    pidfile = tmp_path / "grandchild.pid"
    # The grandchild ignores SIGTERM: only the group SIGKILL after the grace period ends it.
    cmd = script(tmp_path, "hang.sh",
                 f"sh -c 'trap \"\" TERM; echo $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; "
                 f"while :; do sleep 1; done' &\n"
                 f"while [ ! -e {pidfile} ]; do sleep 0.05; done\necho started\nexec sleep 1000\n")
    h = HookRunner(Hooks(apply_start=(Hook(cmd, timeout=1),)), log=lines.append, output=lines.append)
    with pytest.raises(HookFailed) as ei:
        await h.run("apply-start", info())
    assert ei.value.timed_out and ei.value.output == ["started"]
    gc = int(pidfile.read_text())
    try:
        fd = os.pidfd_open(gc)
    except ProcessLookupError:
        return  # already gone and reaped
    try:
        assert select.select([fd], [], [], 10)[0], f"grandchild {gc} survived the hook's timeout"
    finally:
        os.close(fd)


async def test_processes_left_behind_do_not_hang_the_apply(tmp_path, lines):
    pidfile = tmp_path / "bg.pid"
    cmd = script(tmp_path, "bg.sh", f"sleep 1000 &\necho $! > {pidfile}\necho hi\n")
    h = HookRunner(Hooks(apply_start=(Hook(cmd, timeout=60),)), log=lines.append, output=lines.append)
    await h.run("apply-start", info())  # would wait for EOF forever if the sleep kept our pipe
    bg = int(pidfile.read_text())
    try:
        fd = os.pidfd_open(bg)
    except ProcessLookupError:
        return
    try:
        assert select.select([fd], [], [], 10)[0]
    finally:
        os.close(fd)
    assert "apply-start hook bg.sh: hi" in lines


async def test_long_output_without_newline_is_cut(tmp_path, lines):
    cmd = script(tmp_path, "long.sh", "head -c 100000 /dev/zero | tr '\\0' x\necho\necho after\nprintf tail\n")
    h = HookRunner(Hooks(apply_start=(Hook(cmd),)), log=lines.append, output=lines.append)
    await h.run("apply-start", info())
    out = [ln.split(": ", 1)[1] for ln in lines if ln.startswith("apply-start hook long.sh: ")]
    assert out == ["x" * hooks_mod.MAX_LINE + " [cut]", "after", "tail"]


async def test_missing_command_is_a_hook_failure(tmp_path, lines):
    h = HookRunner(Hooks(pre_apply_mode=(Hook(str(tmp_path / "nope")),)), log=lines.append, output=lines.append)
    with pytest.raises(HookFailed, match="could not be started") as ei:
        await h.run("pre-apply-mode", info())
    assert ei.value.exit_code is None


async def test_runs_the_hooks_as_the_layout_parser_read_them(tmp_path, lines, monkeypatch):
    """The runner takes the parsed layout's records: phases by their file names, args and env as
    written, and the runner's default timeout where the file names none."""
    cmd = script(tmp_path, "show.sh", 'echo "$1 $K"\n')
    parsed = parse_layout(f"""
version: v1
layouts:
  whole: [{{devices: all, workload: container}}]
hooks:
  pre-apply-mode:
    - {{command: {cmd}, args: [first], env: {{K: V}}}}
""")
    assert parsed.ok, parsed.errors
    timeouts = []
    real_timeout = hooks_mod.timeout

    def timeout(s: float) -> Any:
        timeouts.append(s)
        return real_timeout(s)

    monkeypatch.setattr(hooks_mod, "timeout", timeout)
    await HookRunner(present(parsed.layout).hooks, log=lines.append, output=lines.append).run("pre-apply-mode", info())
    assert "pre-apply-mode hook show.sh: first V" in lines
    assert timeouts[0] == hooks_mod.DEFAULT_TIMEOUT
    assert await HookRunner(present(parsed.layout).hooks, log=lines.append, output=lines.append).run("apply-exit", info()) == []
    with pytest.raises(ValueError, match="unknown hook phase 'post-apply'"):
        await HookRunner(present(parsed.layout).hooks, log=lines.append, output=lines.append).run("post-apply", info())  # type: ignore[arg-type]  # an unknown phase, on purpose


class FakeDrainer:
    def __init__(self, present: bool) -> None:
        self.present = present
        self.calls: list[str] = []

    async def restart_if_present(self, unit: str) -> bool:
        self.calls.append(unit)
        return self.present


async def test_refresh_cdi_restarts_only_an_installed_unit(lines):
    d = FakeDrainer(True)
    assert await refresh_cdi(d, log=lines.append) is True
    assert d.calls == ["nvidia-cdi-refresh.service"]
    assert await refresh_cdi(FakeDrainer(False), log=lines.append) is False
    assert await refresh_cdi(None, log=lines.append) is False
    assert lines[-1].startswith("cannot restart")


async def test_cancelling_an_apply_kills_the_running_hook(tmp_path):
    import asyncio

    started = asyncio.Event()
    pids: list[int] = []

    def log(line: str) -> None:
        if "started " in line:
            pids.append(int(line.rsplit(" ", 1)[1]))
            started.set()

    cmd = script(tmp_path, "long.sh", "echo started $$\nexec sleep 1000\n")
    h = HookRunner(Hooks(pre_apply_mode=(Hook(cmd, timeout=600),)), log=log, output=log)
    task = asyncio.create_task(h.run("pre-apply-mode", info()))
    await asyncio.wait_for(started.wait(), 30)
    fd = os.pidfd_open(pids[0])
    try:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert select.select([fd], [], [], 10)[0], "hook still running after cancel"
    finally:
        os.close(fd)
