"""NVML calls of a reconcile pass on 8 x H100 80GB with 7 x 1g.10gb each (issue 28, item 1).

gpud's reconciler in process on a simulated host (tests/support/simrig.SimRig), the calls counted
by the simulator's own counters (`gpud-sim stats`). In one run, on hosts built the same way:

- *no-op pass*: `converge()` on the converged host, with the session cache (gpud.host.nvidia.nvml_static)
  as shipped;
- *baseline*: the same pass with that cache disabled (nothing stored: every read asks again what
  cannot change, as gpud did before the cache), the figure the target is a share of;
- *one GPU changed*: a pass after GPU 0's layout changed (7 x 1g -> 2 x 3g), which GPUs the
  adapter read (a spy on `Nvml.gpus`/`Nvml.gpu`) and its calls, against the no-op pass's.

    .venv/bin/python -m bench.nvml_reads [-o out/nvml-reads.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpud.host.nvidia.nvml_static import SessionCache  # noqa: E402
from tests.scenarios.definitions import layout, mig  # noqa: E402
from tests.support.simrig import SimRig  # noqa: E402

N_GPUS = 8
ALL = list(range(N_GPUS))


def _disable(cache: SessionCache) -> None:
    """The session's cache emptied and never stored into again (every holder of it, the MIG
    reader included, shares this one object): every read asks NVML for everything."""
    cache.clear()
    cache.store_if = lambda generation, put: None  # type: ignore[method-assign]


def _rig(tmp: Path, *, cached: bool) -> SimRig:
    rig = SimRig(tmp, (f"h100-80gb:{N_GPUS}",))
    assert asyncio.run(rig.apply(layout(mig(ALL, {"1g.10gb": 7}))))
    if not cached:
        _disable(rig.hw.nvml._cache)
    return rig


def _pass(rig: SimRig) -> tuple[Counter[str], float]:
    before = rig.calls()
    t = time.perf_counter()
    asyncio.run(rig.rec.converge())
    wall = time.perf_counter() - t
    assert {s.state for s in rig.rec.gpu_states.values()} == {"converged"}
    return rig.calls() - before, wall




def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", default=str(ROOT / "out" / "nvml-reads.md"))
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpud-nvml-reads-", dir="/tmp"))
    try:
        rig = _rig(tmp / "cached", cached=True)
        try:
            noop, noop_wall = _pass(rig)
            seen = rig.read_spy()
            rig.config.write_text(layout(mig([0], {"3g.40gb": 2}), mig(ALL[1:], {"1g.10gb": 7})))
            assert rig.rec.load_config()
            seen.clear()
            changed, changed_wall = _pass(rig)
            gpu0 = rig.rec.observation.gpus[0].pci
            reads = list(seen)
        finally:
            rig.close()
        base_rig = _rig(tmp / "uncached", cached=False)
        try:
            baseline, base_wall = _pass(base_rig)
        finally:
            base_rig.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    n_noop, n_base, n_changed = sum(noop.values()), sum(baseline.values()), sum(changed.values())
    mutating = sum(n for f, n in changed.items() if f.startswith(("nvmlDeviceCreate", "nvmlGpuInstanceCreate",
                                                                   "nvmlGpuInstanceDestroy",
                                                                   "nvmlComputeInstanceDestroy")))
    whole = reads.count("*")
    single = Counter(r for r in reads if r != "*")
    lines = [
        f"# NVML calls of a pass: {N_GPUS} x H100 80GB, 7 x 1g.10gb each",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, {platform.node()}, Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs. Reproduce: `make bench` (writes out/nvml-reads.md) "
        "or `.venv/bin/python -m bench.nvml_reads`.",
        "",
        "gpud's reconciler in process on a simulated host; calls counted by the simulator. *baseline*: the same",
        "pass, same run, with the session cache of what cannot change disabled (gpud.host.nvidia.nvml_static: nothing",
        "stored, so every read asks the profile tables, placements, identity and MIG devices' ids again).",
        "",
        "| pass | NVML calls | per GPU | share of baseline | wall s (in process) |",
        "|---|---:|---:|---:|---:|",
        f"| no-op, cache disabled (baseline) | {n_base} | {n_base / N_GPUS:.1f} | 100% | {base_wall:.3f} |",
        f"| no-op | {n_noop} | {n_noop / N_GPUS:.1f} | {100 * n_noop / n_base:.1f}% | {noop_wall:.3f} |",
        f"| GPU 0 changed (7 x 1g -> 2 x 3g) | {n_changed} | | {100 * n_changed / n_base:.1f}% | {changed_wall:.3f} |",
        "",
        "Calls of the no-op pass, by function: " + ", ".join(f"{f} {n}" for f, n in noop.most_common()) + ".",
        "",
        f"The pass after GPU 0 changed read the whole host {whole} times (its start and its end) and GPU 0 alone "
        f"{single[gpu0]} times (after its steps); no other GPU was read alone: "
        f"{'yes' if set(single) <= {gpu0} else 'NO: ' + ', '.join(sorted(set(single) - {gpu0}))}. "
        f"It made {mutating} mutating calls; its {n_changed} calls are {n_changed - n_noop} more than a no-op pass.",
        "",
        f"Target (issue 28): a no-op pass at most 10% of the baseline's calls: "
        f"{'met' if n_noop <= 0.1 * n_base else 'NOT met'} ({100 * n_noop / n_base:.1f}%); a pass after one GPU "
        f"changed re-reads that GPU only: {'met' if set(single) <= {gpu0} else 'NOT met'}.",
        "",
    ]
    text = "\n".join(lines)
    Path(a.o).parent.mkdir(parents=True, exist_ok=True)
    Path(a.o).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
