"""Loading a kernel module (vfio-pci) on demand from inside gpud.service's sandbox.

Why: the unit keeps `ProtectKernelModules=yes` and has no CAP_SYS_MODULE, so gpud cannot run
modprobe itself; and vfio-pci is loaded only where a layout needs it (a vm-passthrough GPU), not
at every boot of every GPU host. So gpud asks systemd, over the system bus, to start systemd's own
`modprobe@<module>.service` (shipped by systemd since v245: `ExecStart=-/sbin/modprobe -abq %i`,
`ConditionCapability=CAP_SYS_MODULE`) and waits for its job. That unit ignores modprobe's exit
status (the `-`) and is skipped where PID 1 lacks CAP_SYS_MODULE (a container), so its job
"done" proves nothing: the module's directory under /sys/module decides, and its absence is an
error naming the unit's journal. The instance is the module's name with `_` (`vfio_pci`): `%I`
would unescape a `-` into a `/`.

Where no system bus answers (gpud in a privileged container), modprobe runs directly, which works
where the process has CAP_SYS_MODULE; if that fails too, both reasons are given.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess

from gpud.host.systemd.unit_drain import SystemdError, UnitDrainer


class ModuleLoadError(RuntimeError):
    """The module is still not loaded; the message says what was tried and why it failed."""


def unit_for(module: str) -> str:
    return f"modprobe@{module.replace('-', '_')}.service"


def loaded(module: str, sys_root: str = "/sys") -> bool:
    return os.path.isdir(os.path.join(sys_root, "module", module.replace("-", "_")))


class _NoBus(Exception):
    """No system bus answered: not systemd's refusal, so modprobe may still be tried directly."""


async def _start_unit(unit: str, bus_address: str | None, timeout: float) -> None:
    try:
        d = await asyncio.wait_for(UnitDrainer.connect(bus_address=bus_address, job_timeout=timeout,
                                                       call_timeout=min(timeout, 25.0)), 10)
    except Exception as e:  # no socket, refused, timed out, authentication
        raise _NoBus(f"the system D-Bus is not reachable ({e or type(e).__name__})") from e
    try:
        await d.start([unit])
    finally:
        await d.close()


def _run_modprobe(module: str, timeout: float) -> str | None:
    """modprobe directly: None when it succeeded, else why not."""
    try:
        r = subprocess.run(["modprobe", module], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"modprobe {module}: {e}"
    if r.returncode != 0:
        return f"modprobe {module}: {(r.stderr or r.stdout).strip() or f'exit status {r.returncode}'}"
    return None


def load_module(module: str, *, sys_root: str = "/sys", bus_address: str | None = None,
                timeout: float = 120.0) -> None:
    """Make `module` loaded (no-op when it is). Blocking; runs the D-Bus exchange on its own event
    loop in a helper thread, so it may be called from a worker thread or from outside any loop."""
    if loaded(module, sys_root):
        return
    unit = unit_for(module)
    bus_error: str | None = None
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gpud-modprobe") as pool:
        try:
            pool.submit(asyncio.run, _start_unit(unit, bus_address, timeout)).result(timeout + 30)
        except _NoBus as e:
            bus_error = str(e)
        except SystemdError as e:
            raise ModuleLoadError(f"{module} is not loaded: systemd could not start {unit}: {e}") from e
        except concurrent.futures.TimeoutError:
            raise ModuleLoadError(f"{module} is not loaded: {unit} did not finish within {timeout:g}s") from None
    if bus_error is None:
        if loaded(module, sys_root):
            return
        raise ModuleLoadError(
            f"{module} is not loaded: systemd ran {unit} but {os.path.join(sys_root, 'module', module.replace('-', '_'))} "
            f"did not appear (`journalctl -u {unit}`: is the module installed for this kernel? systemd skips the "
            "unit without CAP_SYS_MODULE, e.g. in a container)")
    direct = _run_modprobe(module, timeout)
    if direct is None and loaded(module, sys_root):
        return
    raise ModuleLoadError(f"{module} is not loaded: {bus_error}, so {unit} could not be started; "
                          f"and {direct or 'modprobe succeeded but the module did not appear'}")
