"""Which hook phases an apply passes, around which GPUs: mig-parted's order (apply-start,
pre-apply-mode when a MIG mode changes, pre-apply-config when MIG devices change, the GPUs, then
apply-exit whatever happened), and the CDI refresh after MIG devices changed. A failing
before-hook aborts the apply before the GPUs it would have touched are touched."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from gpud.engine.gpu_state import Action
from gpud.engine.gpu_tasks import for_each_gpu
from gpud.engine.hooks.runner import ApplyInfo, HookFailed, HookRunner, refresh_cdi
from gpud.engine.ports import Drainer
from gpud.layout.desired import DesiredGpu
from gpud.layout.schema import Layout


async def apply_with_hooks(
    todo: Mapping[str, Action],
    desired: Mapping[str, DesiredGpu],
    *,
    layout: Layout,
    layout_path: str,
    apply_one: Callable[[str], Awaitable[None]],
    converged: Callable[[str], bool],
    changed_mig: Callable[[], bool],
    abort: Callable[[str, HookFailed], None],
    drainer: Drainer | None,
    log: Callable[[str], object],
    cdi_generate: Callable[[], Awaitable[str]] | None = None,
) -> None:
    """Run `apply_one(pci)` for each GPU of `todo` inside the hook phases. After the GPUs,
    `converged(pci)` says whether a GPU got there and `changed_mig()` whether MIG devices were
    created or destroyed; `abort(pci, failure)` is told of each GPU left untouched because a
    before-hook failed."""
    hooks = HookRunner(layout.hooks, log=log)
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
            await for_each_gpu(sorted(todo), apply_one)
            info.changed_mig = changed_mig()
            failed = [p for p in todo if not converged(p)]
            if failed:
                info.result, info.error = "failure", f"{len(failed)} GPU(s) not converged"
    except HookFailed as e:
        for pci in sorted(set(todo) - done):
            abort(pci, e)
        return
    if info.changed_mig and (drainer is not None or cdi_generate is not None):
        await refresh_cdi(drainer, log=log, generate=cdi_generate)
