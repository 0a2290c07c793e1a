"""Runs inside the container: UnitDrainer against real units, printing what it saw as JSON."""

import asyncio
import json
import sys

from gpud.host.systemd.logind import reboot_outcome, request_reboot
from gpud.host.systemd.unit_drain import SystemdError, UnitDrainer


async def states(d: UnitDrainer, units) -> dict:
    return {u: await d.active_state(u) for u in units}


async def drain(units: list[str]) -> dict:
    out: dict = {}
    async with UnitDrainer(job_timeout=60) as d:
        out["before"] = await states(d, units)
        async with d.drained(units) as stopped:
            out["stopped"] = stopped
            out["inside"] = await states(d, units)
        out["after"] = await states(d, units)
        try:
            async with d.drained(units):
                out["inside_failing"] = await states(d, units)
                raise RuntimeError("disruptive step failed")
        except RuntimeError as e:
            out["body_error"] = str(e)
        out["after_failing"] = await states(d, units)
    return out


async def cancelled(units: list[str]) -> dict:
    """The daemon stopping mid-step: the drained body is cancelled; starts are only queued."""
    out: dict = {}
    async with UnitDrainer(job_timeout=60) as d:
        entered = asyncio.Event()

        async def step():
            async with d.drained(units):
                entered.set()
                await asyncio.Event().wait()

        t = asyncio.create_task(step())
        await entered.wait()
        out["inside"] = await states(d, units)
        t.cancel()
        try:
            await t
        except asyncio.CancelledError:
            out["cancelled"] = True
        out["after"] = await states(d, units)  # queued start jobs: activating or already active
    return out


async def stop_refused(units: list[str]) -> dict:
    out: dict = {}
    async with UnitDrainer(job_timeout=60) as d:
        try:
            async with d.drained(units):
                out["body_ran"] = True
        except SystemdError as e:
            out["error"] = str(e)
            out["unit"] = e.unit
            out["stopped_before_error"] = e.stopped
        out["after"] = await states(d, units)
    return out


async def start(units: list[str]) -> dict:
    out: dict = {}
    async with UnitDrainer(job_timeout=60) as d:
        try:
            await d.start(units)
        except SystemdError as e:
            out["error"] = str(e)
            out["unit"] = e.unit
            out["result"] = e.result
        out["after"] = await states(d, units)
    return out


async def restart_if_present(units: list[str]) -> dict:
    async with UnitDrainer(job_timeout=60) as d:
        return {u: await d.restart_if_present(u) for u in units}


async def reboot(args: list[str]) -> dict:
    state_dir, reason = args
    first = await request_reboot(state_dir, reason)
    rec = reboot_outcome(state_dir)
    return {"requested": first, "record": None if rec is None else rec.__dict__}


if __name__ == "__main__":
    fn = {"drain": drain, "stop-refused": stop_refused, "cancelled": cancelled, "start": start,
          "restart-if-present": restart_if_present, "reboot": reboot}[sys.argv[1]]
    print(json.dumps(asyncio.run(fn(sys.argv[2:]))))
