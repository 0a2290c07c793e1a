"""The kept index map (gpud.engine.observe.gpu_index): expectations written out by hand from the rule in
the README (first start in PCI-address order; a missing GPU keeps its index; a new address takes
the next free index; a returning GPU gets its old one), and the file it keeps."""

from __future__ import annotations

import json
import os

import pytest

from gpud.engine.observe.gpu_index import GpuIndex
from gpud.model import Gpu, NvmlGpu, PciFunction

H100 = 0x2330


def gpu(pci: str, uuid: str | None = None) -> Gpu:
    fn = PciFunction(pci, 0x10DE, H100, 0x10DE, 0x16C1, 0x030200, "nvidia" if uuid else "vfio-pci")
    nv = NvmlGpu(pci=pci, uuid=uuid, name="NVIDIA H100 80GB HBM3") if uuid else None
    return Gpu(index=-1, function=fn, nvml=nv)


A, B, C, D = "0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:05:00.0"


def indices(numbered) -> dict[str, int]:
    return {g.pci: g.index for g in numbered}


def test_first_start_numbers_in_pci_order_and_writes_the_map(tmp_path):
    path = tmp_path / "gpu-index.json"
    idx = GpuIndex(str(path))
    numbered, gone, change = idx.assign([gpu(B, "GPU-b"), gpu(A, "GPU-a"), gpu(C)], [A, B, C], commit=True)
    assert indices(numbered) == {A: 0, B: 1, C: 2}
    assert gone == () and not change
    saved = json.loads(path.read_text())
    assert saved["version"] == 1
    assert [(g["index"], g["pci"], g["uuid"]) for g in saved["gpus"]] == [(0, A, "GPU-a"), (1, B, "GPU-b"), (2, C, None)]


def test_missing_gpu_keeps_its_index_new_address_takes_the_next_free_and_a_return_gets_its_own(tmp_path):
    path = str(tmp_path / "gpu-index.json")
    idx = GpuIndex(path)
    idx.assign([gpu(A, "GPU-a"), gpu(B, "GPU-b"), gpu(C, "GPU-c")], [A, B, C], commit=True)
    numbered, gone, change = idx.assign([gpu(B, "GPU-b"), gpu(C, "GPU-c")], [B, C], commit=True)
    assert indices(numbered) == {B: 1, C: 2}  # nobody shifts into index 0
    assert [(k.index, k.pci, k.uuid, k.model) for k in gone] == [(0, A, "GPU-a", "NVIDIA H100 80GB HBM3")]
    assert [k.pci for k in change.gone] == [A] and not change.joined
    # a card at a new address, lower than every other: index 3, not 0
    numbered, gone, change = idx.assign([gpu(D, "GPU-d"), gpu(B, "GPU-b"), gpu(C, "GPU-c")], [D, B, C], commit=True)
    assert indices(numbered) == {D: 3, B: 1, C: 2}
    assert [k.pci for k in change.joined] == [D] and not change.gone
    # the first card back: index 0 again
    numbered, gone, change = idx.assign([gpu(A, "GPU-a"), gpu(B, "GPU-b"), gpu(C, "GPU-c"), gpu(D, "GPU-d")],
                                        [A, B, C, D], commit=True)
    assert indices(numbered) == {A: 0, B: 1, C: 2, D: 3} and gone == ()
    assert [k.pci for k in change.returned] == [A]
    # and all of it across a restart
    again = GpuIndex(path)
    numbered, gone, change = again.assign([gpu(C, "GPU-c"), gpu(D)], [C, D], commit=True)
    assert indices(numbered) == {C: 2, D: 3}
    assert [(k.index, k.pci) for k in gone] == [(0, A), (1, B)]
    assert [k.pci for k in change.gone] == [A, B]  # missing since the map was written
    assert {k.pci: k.uuid for k in again.known.values()}[D] == "GPU-d"  # UUID kept while NVML cannot see it


def test_a_check_remembers_nothing(tmp_path):
    path = tmp_path / "gpu-index.json"
    idx = GpuIndex(str(path))
    idx.assign([gpu(A, "GPU-a")], [A], commit=True)
    written = path.read_text()
    numbered, _, _ = idx.assign([gpu(A, "GPU-a"), gpu(D, "GPU-d")], [A, D], commit=False)
    assert indices(numbered) == {A: 0, D: 1}
    assert path.read_text() == written and set(idx.known) == {A}


def test_a_function_still_on_the_bus_but_not_managed_is_not_gone(tmp_path):
    idx = GpuIndex(str(tmp_path / "gpu-index.json"))
    idx.assign([gpu(A, "GPU-a"), gpu(B, "GPU-b")], [A, B], commit=True)
    numbered, gone, _ = idx.assign([gpu(B, "GPU-b")], [A, B], commit=True)  # `match:` no longer selects A
    assert indices(numbered) == {B: 1} and gone == ()


def test_an_unreadable_map_is_reported_and_never_overwritten(tmp_path):
    path = tmp_path / "gpu-index.json"
    path.write_text('{"version": 1, "gpus": [{"index": 0}]}')
    problems: list[str] = []
    idx = GpuIndex(str(path), on_problem=problems.append)
    numbered, _, _ = idx.assign([gpu(A, "GPU-a"), gpu(B, "GPU-b")], [A, B], commit=True)
    assert indices(numbered) == {A: 0, B: 1}
    assert idx.problem and str(path) in problems[0] and "not a GPU index map" in problems[0]
    aside, = tmp_path.glob("gpu-index.json.set-aside-*")  # kept for a person, never rewritten
    assert aside.read_text() == '{"version": 1, "gpus": [{"index": 0}]}' and not path.exists()
    again = GpuIndex(str(path))  # a restart still does not trust a fresh numbering as the map
    again.assign([gpu(A, "GPU-a"), gpu(B, "GPU-b")], [A, B], commit=True)
    assert not path.exists() and aside.name in (again.problem or "")


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_a_map_path_that_is_not_a_regular_file_is_set_aside_unopened(tmp_path, kind):
    path = tmp_path / "gpu-index.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        (tmp_path / "elsewhere").write_text(json.dumps({"version": 1, "gpus": []}))
        path.symlink_to(tmp_path / "elsewhere")
    problems: list[str] = []
    idx = GpuIndex(str(path), on_problem=problems.append)  # returns: a FIFO is never opened blocking
    assert idx.known == {} and len(problems) == 1 and "set aside" in problems[0]
    assert not os.path.lexists(path) and list(tmp_path.glob("gpu-index.json.set-aside-*"))


def test_duplicate_indices_in_the_map_are_refused(tmp_path):
    path = tmp_path / "gpu-index.json"
    entry = {"index": 0, "vendor": 0x10DE, "device": H100, "model": "m", "uuid": None}
    path.write_text(json.dumps({"version": 1, "gpus": [dict(entry, pci=A), dict(entry, pci=B)]}))
    idx = GpuIndex(str(path))
    assert "appears twice" in (idx.problem or "")


def test_a_gpu_nvml_no_longer_sees_keeps_its_uuid_across_restarts_unless_the_card_changed(tmp_path):
    path = str(tmp_path / "gpu-index.json")
    GpuIndex(path).assign([gpu(A, "GPU-a"), gpu(B, "GPU-b")], [A, B], commit=True)
    # a restart with B on vfio-pci: NVML does not see it, the map still names it
    numbered, _, _ = GpuIndex(path).assign([gpu(A, "GPU-a"), gpu(B)], [A, B], commit=True)
    by_pci = {g.pci: g for g in numbered}
    assert by_pci[B].nvml is None and by_pci[B].uuid == "GPU-b" and by_pci[A].uuid == "GPU-a"
    assert json.loads((tmp_path / "gpu-index.json").read_text())["gpus"][1]["uuid"] == "GPU-b"
    # another model in B's slot (a swap while the host was off): its UUID is not B's
    fn = PciFunction(B, 0x10DE, 0x2335, 0x10DE, 0x18BE, 0x030200, "vfio-pci")
    numbered, _, _ = GpuIndex(path).assign([gpu(A, "GPU-a"), Gpu(index=-1, function=fn)], [A, B], commit=True)
    assert {g.pci: g.uuid for g in numbered} == {A: "GPU-a", B: None}
