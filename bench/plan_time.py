"""Planning time for 8 x H200 on hard layouts (a measurement, not a test: timings vary by host).

Run: .venv/bin/python -m bench.plan_time (bench/mig_bench.py includes it in its report)
Target: p99 < 50 ms for planning all 8 GPUs.
"""

from __future__ import annotations

import statistics
import time

from gpud.layout.desired import DesiredGpu
from gpud.plan.mig import plan_gpu
from tests.plan.hwmodel import build, gpu_of, make_hw

CASES = {
    # most instances, most options each, every existing GI a candidate to keep
    "7x1g over 7x1g shifted": ([("1g.35gb", s) for s in (0, 2, 4, 6)], {"1g.18gb": 7}),
    "mixed 1g/2g over all-1g": ([("1g.18gb", s) for s in range(7)], {"1g.18gb": 3, "2g.35gb": 2}),
    "+me + 6x1g over 7x1g": ([("1g.18gb", s) for s in range(7)], {"1g.18gb+me": 1, "1g.18gb": 6}),
    "1c packing over 3g+4x1g": ([("3g.71gb", 4)] + [("1g.18gb", s) for s in range(4)],
                                {"1c.3g.71gb": 5, "1g.18gb": 1}),
    "infeasible 4g+4x1g (largest-fit search)": ([("7g.141gb", 0)], {"4g.71gb": 1, "1g.18gb": 4}),
}


def measure(rounds: int = 300) -> dict[str, tuple[float, float, float]]:
    """label -> (p50, p99, max) in ms for planning all 8 GPUs."""
    out = {}
    for label, (layout, devs) in CASES.items():
        gpus = []
        for i in range(8):
            hw = make_hw("h200", f"0000:{0x18 + i:02x}:00.0")
            build(hw, layout)
            gpus.append((gpu_of(hw, i), DesiredGpu(hw.pci, i, "bench", mig_enabled=True, mig_devices=devs)))
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            for g, d in gpus:
                plan_gpu(g, d)
            times.append((time.perf_counter() - t) * 1000)
        times.sort()
        p99 = times[int(len(times) * 0.99) - 1]
        out[label] = (statistics.median(times), p99, times[-1])
    return out


def main() -> None:
    for label, (p50, p99, mx) in measure().items():
        print(f"{label:42s} 8 GPUs: p50 {p50:6.2f} ms  p99 {p99:6.2f} ms  max {mx:6.2f} ms")


if __name__ == "__main__":
    main()
