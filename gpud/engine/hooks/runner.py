"""Operator hooks around an apply, in mig-parted's phases, plus the CDI refresh after MIG changes.

    apply-start       before anything is touched          (failure aborts the apply)
    pre-apply-mode    before MIG mode changes             (failure aborts the apply)
    pre-apply-config  before MIG instances change         (failure aborts the apply)
    apply-exit        after the apply, success or failure (failures are only logged)

The hooks are the layout's records (`gpud.layout.schema.Hook`, checked with line numbers by
`gpud.layout.parse`); this module only runs them. Hooks run without a shell, in their own process
group, with the service-only variables (NOTIFY_SOCKET, WATCHDOG_*, LISTEN_*) removed. What
happened to each hook (started, exit status, a digest of its output) goes to `log` (the events,
which group `gpud` reads); its output lines go only to `output` (the journal, root's): a hook runs
as root and may print what only root may see. mig-parted's hooks being skipped silently under
systemd was one of its worst failure modes. When the phases run around the GPUs of a pass is
`gpud.engine.hooks.phases`'s business.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from gpud.engine.ports import UnitRestarter
from gpud.host.systemd.sd_notify import child_env
from gpud.layout.schema import HOOK_PHASES, Hook, HookPhase, Hooks
from gpud.py_compat import timeout

_journal = logging.getLogger("gpud.hooks")  # hook output: the journal only, never the events
BEFORE_PHASES: frozenset[HookPhase] = frozenset(HOOK_PHASES[:3])
CDI_REFRESH_UNIT = "nvidia-cdi-refresh.service"
MAX_LINE = 4096  # longer output lines are cut: a hook cannot make us buffer without bound
DEFAULT_TIMEOUT = 60.0  # seconds, for a hook that names none
KILL_GRACE = 3.0  # seconds between SIGTERM and SIGKILL to a timed-out hook's process group
DRAIN_AFTER_EXIT = 2.0  # bound on reading output left by processes that escaped the group


@dataclass
class ApplyInfo:
    """What the hooks are told about the apply (as GPUD_* variables). The engine updates
    `changed_mig`, `result` and `error` before apply-exit runs."""

    layout: str  # path of the layout file
    selected: str  # name of the selected layout
    gpus: Sequence[str] = ()  # PCI addresses the apply touches
    mode_change: bool = False  # some GPU's MIG mode will change (a GPU reset follows)
    changed_mig: bool = False  # MIG devices were created or destroyed
    result: str = ""  # apply-exit only: success | failure
    error: str = ""  # apply-exit only: one line, why it failed

    def env(self, phase: HookPhase) -> dict[str, str]:
        e = {
            "GPUD_PHASE": phase,
            "GPUD_LAYOUT": self.layout,
            "GPUD_SELECTED": self.selected,
            "GPUD_GPUS": " ".join(self.gpus),
            "GPUD_MODE_CHANGE": "1" if self.mode_change else "0",
            "GPUD_CHANGED_MIG": "1" if self.changed_mig else "0",
        }
        if phase == "apply-exit":
            e["GPUD_RESULT"] = self.result or "success"
            e["GPUD_ERROR"] = " ".join(self.error.split())
        return e


class HookFailed(Exception):
    """A hook exited non-zero, was killed, timed out or could not be started."""

    def __init__(self, phase: HookPhase, command: str, exit_code: int | None, output: Sequence[str],
                 *, timed_out: bool = False, reason: str = "", digest: str = "") -> None:
        self.phase = phase
        self.command = command
        self.exit_code = exit_code
        self.output = list(output)
        self.timed_out = timed_out
        if not reason:
            if timed_out:
                reason = "timed out; its process group was killed"
            elif exit_code is not None and exit_code < 0:
                try:
                    reason = f"killed by signal {signal.Signals(-exit_code).name}"
                except ValueError:  # a real-time signal Python has no name for
                    reason = f"killed by signal {-exit_code}"
            else:
                reason = f"exited {exit_code}"
        self.reason = reason
        self.digest = digest
        # the output itself is not in the message: the message reaches events and status
        super().__init__(f"{phase} hook {command} {reason}" + (f" (output sha256 {digest}, in the journal)"
                                                                 if digest else ""))


class HookRunner:
    """Runs the layout's hooks (as `gpud.layout.parse` checked them); `log(line)` receives every
    line they print and what happened to them (start, exit code, timeout)."""

    def __init__(self, hooks: Hooks, *, log: Callable[[str], object], output: Callable[[str], object] | None = None,
                 tail_lines: int = 20) -> None:
        """`log`: what happened to each hook (events); `output`: its output lines (default: the
        journal through this module's logger)."""
        self.hooks = hooks
        self.log = log
        self.output = output if output is not None else _journal.info
        self.tail_lines = tail_lines

    async def run(self, phase: HookPhase, info: ApplyInfo) -> list[HookFailed]:
        """Run the hooks of one phase in order. In a before-phase the first failure raises
        HookFailed (the apply must not go on); in apply-exit every hook runs and the failures
        are returned."""
        failures: list[HookFailed] = []
        for hook in self.hooks.for_phase(phase):
            try:
                await self._run_one(phase, hook, info)
            except HookFailed as e:
                self.log(str(e))
                if phase in BEFORE_PHASES:
                    raise
                failures.append(e)
        return failures

    @contextlib.asynccontextmanager
    async def around_apply(self, info: ApplyInfo) -> AsyncIterator[ApplyInfo]:
        """apply-start before the body, apply-exit after it whatever happened (also when
        apply-start itself failed), with GPUD_RESULT/GPUD_ERROR telling the outcome."""
        try:
            await self.run("apply-start", info)
            yield info
        except BaseException as e:
            info.result = "failure"
            info.error = info.error or str(e) or type(e).__name__
            await self.run("apply-exit", info)
            raise
        else:
            info.result = info.result or "success"
            await self.run("apply-exit", info)

    async def _run_one(self, phase: HookPhase, hook: Hook, info: ApplyInfo) -> None:
        name = " ".join([hook.command, *hook.args])
        env = child_env()
        env.update(hook.env)
        env.update(info.env(phase))
        tail: deque[str] = deque(maxlen=self.tail_lines)
        self.log(f"{phase} hook: running {name}")
        # Our own pipe rather than asyncio's: Process.wait() would also wait for an asyncio pipe
        # to close, which a process left behind by the hook can keep open forever.
        r, w = os.pipe2(os.O_CLOEXEC)
        try:
            proc = await asyncio.create_subprocess_exec(
                hook.command, *hook.args, env=env, cwd="/", stdin=asyncio.subprocess.DEVNULL,
                stdout=w, stderr=w,
                start_new_session=True,  # its own process group, so a timeout can kill all of it
            )
        except OSError as e:
            os.close(r)
            raise HookFailed(phase, hook.command, None, [], reason=f"could not be started: {e.strerror}") from e
        finally:
            os.close(w)

        import hashlib  # here, when a hook runs: hashlib maps OpenSSL's libcrypto (docs/internals.md)

        digest = hashlib.sha256()
        lines = 0

        def emit(line: str) -> None:
            nonlocal lines
            tail.append(line)
            lines += 1
            digest.update(line.encode("utf-8", "surrogateescape") + b"\n")
            self.output(f"{phase} hook {os.path.basename(hook.command)}: {line}")

        output = _Output(r, emit)
        timed_out = False
        try:
            try:
                async with timeout(DEFAULT_TIMEOUT if hook.timeout is None else hook.timeout):
                    await proc.wait()
            except TimeoutError:
                timed_out = True
                await _kill_group(proc)
            except BaseException:  # cancelled (daemon stopping): leave nothing running behind us
                await asyncio.shield(_kill_group(proc))
                raise
            # The hook is gone; what it left in its group would hold the pipe open.
            _signal_group(proc.pid, signal.SIGKILL)
            try:
                async with timeout(DRAIN_AFTER_EXIT):
                    await output.eof
            except TimeoutError:
                self.log(f"{phase} hook {hook.command}: output of processes that left its group is ignored")
        finally:
            output.close()
        said = digest.hexdigest()[:16] if lines else ""
        if timed_out:
            raise HookFailed(phase, hook.command, proc.returncode, tail, timed_out=True, digest=said)
        if proc.returncode != 0:
            raise HookFailed(phase, hook.command, proc.returncode, tail, digest=said)
        self.log(f"{phase} hook: {name} done (exit 0" + (f", {lines} output lines, sha256 {said}, in the journal)"
                                                        if lines else ", no output)"))


class _Output:
    """Reads a hook's output pipe from the event loop and emits it line by line, without
    trusting the hook to write newlines: a line longer than MAX_LINE is emitted cut and the
    rest of it dropped."""

    def __init__(self, fd: int, emit: Callable[[str], None]) -> None:
        self.fd = fd
        self.emit = emit
        self.buf = b""
        self.skipping = False  # inside the dropped rest of a cut line
        self.loop = asyncio.get_running_loop()
        self.eof = self.loop.create_future()
        os.set_blocking(fd, False)
        self.loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._flush()
            self.loop.remove_reader(self.fd)
            if not self.eof.done():
                self.eof.set_result(None)
            return
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        for raw in lines:
            if self.skipping:
                self.skipping = False
                continue
            self.emit(raw[:MAX_LINE].decode(errors="replace").rstrip("\r"))
        if len(self.buf) > MAX_LINE:
            if not self.skipping:
                self.emit(self.buf[:MAX_LINE].decode(errors="replace") + " [cut]")
                self.skipping = True
            self.buf = b""

    def _flush(self) -> None:
        if self.buf and not self.skipping:
            self.emit(self.buf[:MAX_LINE].decode(errors="replace").rstrip("\r"))
        self.buf = b""

    def close(self) -> None:
        if self.fd >= 0:
            if not self.eof.done():
                self._flush()
                self.eof.cancel()
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM to the hook's whole process group, SIGKILL if it has not exited after a grace."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        async with timeout(KILL_GRACE):
            await proc.wait()
    except TimeoutError:
        pass
    _signal_group(proc.pid, signal.SIGKILL)
    await proc.wait()


async def refresh_cdi(drainer: UnitRestarter | None, *, log: Callable[[str], object] | None = None,
                      unit: str = CDI_REFRESH_UNIT, generate: Callable[[], Awaitable[str]] | None = None) -> bool:
    """After an apply that changed MIG devices, regenerate the CDI spec (the container toolkit
    does not notice on its own: nvidia-container-toolkit #1828). Restarts the unit through
    systemd when it is installed; else runs `generate` (gpud.host.nvidia.cdi: `nvidia-ctk cdi generate`)
    when the toolkit is; False when neither could."""
    done = False
    if drainer is not None:
        done = await drainer.restart_if_present(unit)
    if done:
        if log:
            log(f"restarted {unit}")
        return True
    if generate is not None:
        try:
            message = await generate()
        except Exception as e:  # noqa: BLE001 - reported; the apply itself is done
            if log:
                log(f"CDI spec not regenerated: {e}")
            return False
        if log:
            log(message)
        return True
    if log:
        log(f"cannot restart {unit}: no system bus" if drainer is None
            else f"{unit} not installed; CDI spec not refreshed")
    return False
