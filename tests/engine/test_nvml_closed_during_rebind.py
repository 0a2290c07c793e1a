"""While a rebind runs, gpud's own NVML session stays closed, whatever else asks for state:
nvmlInit opens every GPU, so reopening it would make gpud the holder its unbind waits for."""

from __future__ import annotations

import asyncio

from gpud.engine.binding import binder
from tests.scenarios.definitions import layout
from tests.support.simrig import SimRig


async def test_status_reads_during_a_rebind_do_not_reopen_nvml(tmp_path, monkeypatch):
    rig = SimRig(tmp_path, ("h100-80gb:1",))
    loop = asyncio.get_running_loop()
    real_execute = binder.execute
    seen = {}

    def execute(sysfs, procs, plan, *, before_unbind=None, **kw):
        before_unbind()
        inits = rig.calls()["nvmlInitWithFlags"]
        # a status request arriving on the event loop mid-rebind
        fut = asyncio.run_coroutine_threadsafe(_refresh(rig), loop)
        seen["gpus"] = fut.result(10)
        seen["inits"] = rig.calls()["nvmlInitWithFlags"] - inits
        return real_execute(sysfs, procs, plan, before_unbind=lambda: None, **kw)

    async def _refresh(r):
        return r.rec.refresh().gpus

    monkeypatch.setattr(binder, "execute", execute)
    try:
        assert await rig.apply(layout({"devices": [0], "workload": "vm-passthrough"}))
        assert seen["inits"] == 0
        assert seen["gpus"][0].nvml is not None  # the last NVML view stood in
        assert rig.rec.gpu_states[seen["gpus"][0].pci].state == "converged"
    finally:
        rig.close()
