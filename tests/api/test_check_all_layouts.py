"""`check --all-layouts` on NVIDIA's own mig-parted config (81 layouts): one parse and one host read
for all of them, and the same verdict per layout as checking that layout alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import yaml

from gpud.api.handlers import RequestHandler
from gpud.engine.engine import Engine
from tests.scenarios.definitions import layout, mig
from tests.support.simrig import SimRig

# H100 and A100 layouts of the file, valid and not on this host (an A100 has no 1g.10gb x 7)
SOME = ("all-disabled", "all-enabled", "all-1g.10gb", "all-1g.5gb", "all-balanced", "all-7g.80gb", "all-2g.20gb",
        "all-3g.40gb", "all-7g.40gb")
CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "mig-parted" / "config-default.yaml"


def test_all_layouts_read_the_host_once_and_agree_with_each_layout_checked_alone(tmp_path):
    rig = SimRig(tmp_path, ("h100-80gb:2", "a100-40gb:1"))
    try:
        assert asyncio.run(rig.apply(layout(mig([0], {"1g.10gb": 7}))))
        handler = RequestHandler(Engine(rig.rec))
        text = CONFIG.read_text()
        names = list(yaml.safe_load(text)["mig-configs"])
        assert len(names) == 81
        before = rig.calls()
        every = asyncio.run(handler.op_check(text, "config-default.yaml", all_layouts=True))
        made = rig.calls() - before
        assert every.checked == names
        assert made["nvmlDeviceGetMigMode"] <= 2 * 3  # the file's check and the others': one read each

        # Fewer layouts, so that no reply leaves findings out: each checked alone (chosen by the
        # file itself) finds what --all-layouts finds for it.
        doc = yaml.safe_load(text)
        few = [n for n in names if n in SOME]
        doc["mig-configs"] = {n: doc["mig-configs"][n] for n in few}
        # and one the A100 40GB cannot converge (NVIDIA's MIG user guide: 4 x 1g.10gb at most)
        doc["mig-configs"]["seven-1g.10gb"] = [{"devices": "all", "mig-enabled": True, "mig-devices": {"1g.10gb": 7}}]
        few.append("seven-1g.10gb")
        every = asyncio.run(handler.op_check(yaml.safe_dump(doc, sort_keys=False), "few.yaml", all_layouts=True))
        assert every.checked == few and every.errors_omitted == 0
        alone: list[str] = []
        for name in few:
            one = asyncio.run(handler.op_check(yaml.safe_dump({**doc, "selected": name}, sort_keys=False), "few.yaml"))
            assert one.errors_omitted == 0
            alone += one.errors

        def findings(lines: list[str]) -> list[str]:  # without line numbers: the files differ in one line
            return sorted({line.split(" ", 1)[1] if line.startswith("few.yaml:") else line for line in lines
                           if not line.startswith("few.yaml:") or not line.split(" ", 2)[1].startswith("selected")})

        assert findings(every.errors) == findings(alone)
        assert any("infeasible" in line for line in alone)
    finally:
        rig.close()
