"""Which hook phases an apply passes, around which GPUs: mig-parted's order (apply-start,
pre-apply-mode when a MIG mode changes, pre-apply-config when MIG devices change, the GPUs, then
apply-exit whatever happened), and the CDI refresh after MIG devices changed. A failing
before-hook aborts the apply before the GPUs it would have touched are touched."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from gpud.engine.gpu_state import Action
from gpud.engine.gpu_tasks import for_each_gpu
from gpud.engine.hooks.runner import ApplyInfo, HookFailed, HookRunner, refresh_cdi
from gpud.engine.ports import Drainer
from gpud.layout.desired import DesiredGpu
from gpud.layout.schema import Layout


class PassGpus(Protocol):
    """The pass, as the hook phases drive it: each changing GPU applied, then asked how it ended."""

    async def apply_gpu(self, pci: str) -> None: ...

    def gpu_converged(self, pci: str) -> bool: ...

    def mig_changed(self) -> bool:
        """Whether MIG devices were created or destroyed (the CDI spec then needs a refresh)."""
        ...

    def hook_aborted(self, pci: str, failure: HookFailed) -> None:
        """A GPU left untouched because a before-hook failed."""
        ...

    def hook_said(self, line: str) -> None:
        """A line of a hook's output (or of the CDI refresh)."""
        ...


async def apply_with_hooks(
    todo: Mapping[str, Action],
    desired: Mapping[str, DesiredGpu],
    *,
    layout: Layout,
    layout_path: str,
    gpus: PassGpus,
    drainer: Drainer | None,
    cdi_generate: Callable[[], Awaitable[str]] | None = None,
) -> None:
    """Apply each GPU of `todo` (`gpus.apply_gpu`) inside the hook phases."""
    hooks = HookRunner(layout.hooks, log=gpus.hook_said)
    # A GPU coming back from vfio-pci gets its MIG layout after the rebind: count it now.
    comes_back_with_mig = [p for p, a in todo.items() if a.kind == "bind" and desired[p].mig_enabled]
    mode_change = bool(comes_back_with_mig) or any(a.kind == "mig" and a.plan.mode_change for a in todo.values())
    mig_config = bool(comes_back_with_mig) or any(a.kind == "mig" for a in todo.values())
    info = ApplyInfo(layout=layout_path, selected=layout.selected or "", gpus=sorted(todo),
                     mode_change=mode_change)
    done: set[str] = set()
    try:
        async with hooks.around_apply(info) as info:
            if mode_change:
                await hooks.run("pre-apply-mode", info)
            if mig_config:
                await hooks.run("pre-apply-config", info)
            done.update(todo)  # side by side, bounded: one GPU's slow step never holds up another
            await for_each_gpu(sorted(todo), gpus.apply_gpu)
            info.changed_mig = gpus.mig_changed()
            failed = [p for p in todo if not gpus.gpu_converged(p)]
            if failed:
                info.result, info.error = "failure", f"{len(failed)} GPU(s) not converged"
    except HookFailed as e:
        for pci in sorted(set(todo) - done):
            gpus.hook_aborted(pci, e)
        return
    if info.changed_mig and (drainer is not None or cdi_generate is not None):
        await refresh_cdi(drainer, log=gpus.hook_said, generate=cdi_generate)
