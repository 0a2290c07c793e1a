"""GPU-instance and compute-instance ids against real `nvidia-smi` captures (tests/fixtures/gi-ids).

Each capture is parsed here with its own parser (no gpud code), its instances are created in the
simulator through pynvml in the order the capture lists them, and the ids NVML hands back are
compared with the capture's. The simulator offers two numberings (gpud.sim.gi_ids); a simulated
host gives even GPUs one and odd GPUs the other, so each captured GPU is replayed on both and
exactly one of them must reproduce every id it shows.
"""

from __future__ import annotations

import re
from ctypes import byref
from pathlib import Path

import pynvml as N
import pytest

from gpud.sim.state import load

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures/gi-ids"
LGI_ROW = re.compile(r"^\|\s+(\d+)\s+MIG (\S+)\s+(\d+)\s+(\d+)\s+(\d+):(\d+)\s+\|$")
CGI_LINE = re.compile(r"^Successfully created GPU instance ID\s+(\d+) on GPU\s+(\d+) using profile MIG (\S+) \(ID\s*(\d+)\)$")
CCI_LINE = re.compile(r"^Successfully created compute instance ID\s+(\d+) on GPU\s+(\d+) GPU instance ID\s+(\d+) "
                      r"using profile MIG (\S+) \(ID\s*(\d+)\)$")


def lgi_rows(name: str) -> dict[int, list[tuple[int, int, int, int]]]:
    """GPU -> [(profile id, GI id, start, size)] in listing order."""
    out: dict[int, list[tuple[int, int, int, int]]] = {}
    for line in (FIXTURES / name).read_text().splitlines():
        m = LGI_ROW.match(line.strip())
        if m:
            gpu, _, pid, gid, start, size = m.groups()
            out.setdefault(int(gpu), []).append((int(pid), int(gid), int(start), int(size)))
    assert out, f"no -lgi rows in {name}"
    return out


# The numbering each captured GPU turns out to have (docs/hardware/mig-ids.md).
EXPECTED_ORDER = {
    ("dcgm-138.txt", 0): "tree", ("dcgm-138.txt", 1): "tree-halves-swapped",
    ("go-nvml-146.txt", 2): "tree", ("go-nvml-146.txt", 3): "tree",
    ("dra-driver-933.txt", 3): "tree",
}


@pytest.fixture
def two_h100(sim_host):
    host = sim_host("h100-80gb:2", mig_on=[0, 1])
    N.nvmlInit()
    yield host
    N.nvmlShutdown()


def _replay_with_placements(host, gpu_index: int, rows) -> list[int]:
    """Create the rows' GIs at their placements on simulated GPU `gpu_index`; return the ids NVML
    gives, then destroy them again (the state file must agree with NVML's answer)."""
    h = N.nvmlDeviceGetHandleByIndex(gpu_index)
    gis, ids = [], []
    for pid, _, start, size in rows:
        pl = N.c_nvmlGpuInstancePlacement_t(start, size)
        gi = N.nvmlDeviceCreateGpuInstanceWithPlacement(h, pid, byref(pl))
        gis.append(gi)
        ids.append(N.nvmlGpuInstanceGetInfo(gi).id)
    address = N.nvmlDeviceGetPciInfo(h).busId.lower()[4:]
    in_state = {(g.start, g.size): g.id for g in load(host.host_dir).gpus[address].gis}
    assert [in_state[(start, size)] for _, _, start, size in rows] == ids
    for gi in gis:
        N.nvmlGpuInstanceDestroy(gi)
    return ids


@pytest.mark.parametrize("capture,gpu", sorted(EXPECTED_ORDER))
def test_gi_ids_of_a_listing_are_reproduced_by_one_numbering(two_h100, capture, gpu):
    rows = lgi_rows(capture)[gpu]
    want = [gid for _, gid, _, _ in rows]
    orders = {}
    for index in (0, 1):
        order = load(two_h100.host_dir).gpus[sorted(load(two_h100.host_dir).gpus)[index]].gi_id_order
        orders[order] = _replay_with_placements(two_h100, index, rows)
    matching = [order for order, ids in orders.items() if ids == want]
    assert matching == [EXPECTED_ORDER[(capture, gpu)]], (capture, gpu, want, orders)


def test_one_host_shows_both_numberings():
    """DCGM#138's GPUs 0 and 1 hold the same four instances with different ids: no single
    function of the placement gives both, which is why gpud reads ids back instead."""
    rows = lgi_rows("dcgm-138.txt")
    by_placement = [{(start, size, pid): gid for pid, gid, start, size in rows[g]} for g in (0, 1)]
    assert by_placement[0].keys() == by_placement[1].keys()
    assert all(by_placement[0][k] != by_placement[1][k] for k in by_placement[0])


def test_creation_order_without_placements_gives_the_captured_ids(sim_host):
    """dask-cuda#583 (A100-SXM4-40GB): seven `-cgi 19` without a placement, then one CI per GI."""
    text = (FIXTURES / "dask-cuda-583.txt").read_text().splitlines()
    made = [CGI_LINE.match(line) for line in text]
    want_gis = [(int(m[4]), int(m[1])) for m in made if m]
    cis = [CCI_LINE.match(line) for line in text]
    want_cis = [(int(m[3]), int(m[1])) for m in cis if m]
    assert len(want_gis) == 7 and len(want_cis) == 4

    host = sim_host("a100-40gb:2", mig_on=[0, 1])
    N.nvmlInit()
    try:
        results = {}
        for index in (0, 1):
            h = N.nvmlDeviceGetHandleByIndex(index)
            gis = [N.nvmlDeviceCreateGpuInstance(h, pid) for pid, _ in want_gis]
            got = [(pid, N.nvmlGpuInstanceGetInfo(gi).id) for (pid, _), gi in zip(want_gis, gis, strict=True)]
            by_id = {N.nvmlGpuInstanceGetInfo(gi).id: gi for gi in gis}
            ci_ids = [(gid, N.nvmlComputeInstanceGetInfo(N.nvmlGpuInstanceCreateComputeInstance(by_id[gid], 0)).id)
                      for gid, _ in want_cis if gid in by_id]
            order = load(host.host_dir).gpus[sorted(load(host.host_dir).gpus)[index]].gi_id_order
            results[order] = (got, ci_ids)
        assert [o for o, (got, _) in results.items() if got == want_gis] == ["tree-halves-swapped"], results
        assert results["tree-halves-swapped"][1] == want_cis
    finally:
        N.nvmlShutdown()
