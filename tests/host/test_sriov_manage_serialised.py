"""Issue 33 item 4 (the kernel-global part): sriov-manage writes pci-pf-stub's `new_id`, which the
kernel applies to every unbound device of that id, so two GPUs of one model enabled side by side
grabbed each other (EBUSY, a GPU left on pci-pf-stub). Runs for different GPUs must not overlap.

The stand-in for the script announces itself and then waits (bounded) for the other run to
announce itself too: runs that overlap both see each other, serialised runs never do. No timing
is asserted; the bounded wait only ends the serialised case."""

from __future__ import annotations

import stat
import threading
from typing import Any

from gpud.host.nvidia.sriov_manage import SriovManage

SCRIPT = """#!/bin/sh
dir={dir}
pf=$2
touch "$dir/started-$pf"
i=0
while [ $i -lt 20 ]; do
  for other in "$dir"/started-*; do
    if [ "$other" != "$dir/started-$pf" ]; then echo overlap > "$dir/saw-$pf"; exit 0; fi
  done
  i=$((i + 1)); sleep 0.1
done
rm -f "$dir/started-$pf"
echo alone > "$dir/saw-$pf"
"""


def test_vf_enabling_of_two_gpus_never_overlaps(tmp_path):
    script = tmp_path / "sriov-manage"
    script.write_text(SCRIPT.format(dir=tmp_path))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    tool = SriovManage(str(script))
    pfs = ["0000:18:00.0", "0000:2a:00.0"]
    results: dict[str, Any] = {}
    threads = [threading.Thread(target=lambda p=p: results.__setitem__(p, tool.enable(p))) for p in pfs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(results[p].ok for p in pfs), results
    assert [(tmp_path / f"saw-{p}").read_text().strip() for p in pfs] == ["alone", "alone"]
