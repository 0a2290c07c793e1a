"""Fidelity per model: the MIG table gpud reads through NVML from a simulated GPU equals a real
`nvidia-smi mig -lgip` / `-lgipp` capture of that model, field by field.

The references are text files published from real GPUs (tests/fixtures/captures/<model>/, each
with a README naming source and driver; the H200 one is this project's own capture). They are read
by the small parser in tests/support/smi_mig_tables.py, which shares no code with gpud: a mistake in gpud's tables cannot
cancel out against the same mistake in the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpud.api.replies import mig_profiles_reply
from gpud.cli.render_smi import render_mig_profiles
from gpud.host.nvidia.nvml import Nvml
from gpud.model import Gpu, PciFunction
from gpud.profiles import MODELS
from gpud.sim import catalog
from tests.support.smi_mig_tables import PLACEMENT_LINE, by_id, read_lgip, read_lgipp

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CAPTURES = FIXTURES / "captures"
GPU = "0000:18:00.0"

# model -> (directory of the -lgip capture, directory of the -lgipp capture)
SOURCES = {
    "a100-40gb": (CAPTURES / "a100-40gb", CAPTURES / "a100-40gb"),
    # No capture of the A100 PCIe 40GB (simulated for its vGPU types): the SXM4 40GB one, same GA100.
    "a100-pcie-40gb": (CAPTURES / "a100-40gb", CAPTURES / "a100-40gb"),
    # No A100 80GB -lgipp was published: the GA100 placements of NVIDIA's guide (README there).
    "a100-80gb": (CAPTURES / "a100-80gb", CAPTURES / "a100-40gb"),
    "h100-80gb": (CAPTURES / "h100-80gb", CAPTURES / "h100-80gb"),
    "h100-nvl": (CAPTURES / "h100-nvl", CAPTURES / "h100-nvl"),
    "h200": (FIXTURES / "h200", FIXTURES / "h200"),
    "a30": (CAPTURES / "a30", CAPTURES / "a30"),
    "rtx-pro-6000": (CAPTURES / "rtx-pro-6000", CAPTURES / "rtx-pro-6000"),
    # No GH200 -lgipp was published: the Hopper placements of the H100 80GB capture (inferred, README there).
    "gh200-96gb": (CAPTURES / "gh200-96gb", CAPTURES / "h100-80gb"),
}

def capture(model: str) -> tuple[dict[int, dict], dict[int, list[tuple[int, int]]]]:
    lgip_dir, lgipp_dir = SOURCES[model]
    return (by_id(read_lgip((lgip_dir / "nvidia-smi-mig-lgip.txt").read_text())),
            read_lgipp((lgipp_dir / "nvidia-smi-mig-lgipp.txt").read_text()))


def test_every_simulated_mig_model_has_a_capture():
    """A model the simulator offers with a MIG table must be listed here, with its files."""
    mig_models = {k for k in catalog.offered() if MODELS[k].mig_capable}
    assert mig_models == set(SOURCES) | set(PARTLY_CAPTURED) | set(NOT_CAPTURED)
    for lgip_dir, lgipp_dir in SOURCES.values():
        assert (lgip_dir / "nvidia-smi-mig-lgip.txt").is_file() and (lgipp_dir / "nvidia-smi-mig-lgipp.txt").is_file()
    for model, (lgip_dir, _) in SOURCES.items():
        if model != "h200":
            assert "Driver:" in (lgip_dir / "README.md").read_text(), model


@pytest.mark.parametrize("model", sorted(SOURCES))
def test_the_parser_reads_every_row_of_the_capture(model):
    """Guards the parser itself: as many rows as the capture has profile lines, ids agreeing."""
    lgip_dir, lgipp_dir = SOURCES[model]
    text = (lgip_dir / "nvidia-smi-mig-lgip.txt").read_text()
    lgip, lgipp = capture(model)
    assert len(lgip) == text.count(" MIG ") > 0
    if lgip_dir == lgipp_dir:
        assert set(lgipp) == set(lgip)
    else:  # borrowed placements (a100-80gb): they cover every captured profile
        assert set(lgip) <= set(lgipp)


def read_through_nvml(model: str, sim_host):
    sim_host(model)
    nvml = Nvml()
    try:
        return nvml.gpu(GPU)
    finally:
        nvml.close()


@pytest.mark.parametrize("model", sorted(SOURCES))
def test_gpud_reads_the_captured_table_from_the_simulator(model, sim_host):
    lgip, lgipp = capture(model)
    gpu = read_through_nvml(model, sim_host)
    ours = {p.id: p for p in gpu.profiles}
    assert set(ours) == set(lgip), "profile ids"
    for pid, row in lgip.items():
        p = ours[pid]
        where = f"{model} profile {pid} ({row['name']})"
        assert p.name == row["name"], where
        assert f"{p.memory_mb / 1024:.2f}" == row["gib"], where
        assert (p.instance_count, p.sms, p.decoders, p.encoders) == (
            row["total"], row["sm"], row["dec"], row["enc"]), where
        assert (p.copy_engines, p.jpegs, p.ofas) == (row["ce"], row["jpeg"], row["ofa"]), where
        assert row["p2p"] == "No"  # the simulator reports isPpSupported 0 for every profile
        assert [(pl.start, pl.size) for pl in p.placements] == lgipp[pid], where
        assert p.slices == int(row["name"].split("g.", 1)[0]), where


# Models whose published -lgip stops after four rows: the simulator serves the rest inferred.
PARTLY_CAPTURED = {"b200": CAPTURES / "b200", "gb200": CAPTURES / "gb200", "gh200-144gb": CAPTURES / "gh200-144gb"}
# no -lgip of it was ever published: ids, names and counts only (docs/hardware/mig-profiles.md),
# every other cell inferred; tests/sim/test_driver_profile_names.py checks what is sourced
NOT_CAPTURED = {"gb300"}


@pytest.mark.parametrize("model", sorted(PARTLY_CAPTURED))
def test_a_model_known_in_part_is_served_with_its_captured_rows_as_published(model, sim_host):
    """The captured rows read back through NVML equal to the capture (a cut-off cell excepted: the
    simulator infers it, gpud/sim/inferred.py); every other row is listed as inferred."""
    lgip = by_id(read_lgip((PARTLY_CAPTURED[model] / "nvidia-smi-mig-lgip.txt").read_text()))
    ours = {p.id: p for p in read_through_nvml(model, sim_host).profiles}
    served = catalog.model(model)
    for pid, row in lgip.items():
        p = ours[pid]
        assert (p.name, f"{p.memory_mb / 1024:.2f}", p.instance_count, p.sms, p.decoders, p.encoders) == (
            row["name"], row["gib"], row["total"], row["sm"], row["dec"], row["enc"]), (model, pid)
        for field, key in (("copy_engines", "ce"), ("jpegs", "jpeg"), ("ofas", "ofa")):
            if key in row:
                assert getattr(p, field) == row[key], (model, pid, field)
            else:
                assert field in dict(served.inferred)[row["name"]], (model, pid, field)
    inferred = dict(served.inferred)
    for p in served.profiles:
        if p.id not in lgip:
            assert {"memory_mb", "sms", "placements"} <= set(inferred[p.name]), p.name


def _gpu(model: str, nvml=None) -> Gpu:
    m = MODELS[model]
    driver = "nvidia" if nvml is not None else "vfio-pci"
    return Gpu(0, PciFunction(GPU, 0x10DE, m.device, 0x10DE, 0, 0x030200, driver), nvml=nvml)


@pytest.mark.parametrize("model", sorted(SOURCES))
def test_gpudctl_mig_profiles_prints_the_captured_table(model, sim_host):
    """`gpudctl mig profiles` (the daemon's reply, rendered by the client) read back with the
    capture's own parser: every row and placement line equals the real listing."""
    lgip, lgipp = capture(model)
    printed = render_mig_profiles(mig_profiles_reply([_gpu(model, read_through_nvml(model, sim_host))]))
    rows = by_id(read_lgip(printed))
    placements = read_lgipp("\n".join(line for line in printed.splitlines() if line.startswith("GPU ")))
    assert set(rows) == set(lgip)
    for pid, want in lgip.items():
        got = rows[pid]
        assert {k: v for k, v in got.items() if k != "free"} == {k: v for k, v in want.items() if k != "free"}, pid
        assert got["free"] == got["total"]  # a fresh simulated GPU: every instance free
        assert placements[pid] == lgipp[pid], pid


PARTIAL = ("b200", "gb200", "gh200-144gb")


@pytest.mark.parametrize("model", PARTIAL)
def test_a_gpu_nvml_cannot_see_is_listed_from_the_table_with_unknowns_marked(model):
    """A B200 on vfio-pci: gpudctl shows gpud's table of it. The published rows read back equal to
    the published capture; what no source gives is printed `?`, never a number."""
    published = by_id(read_lgip((CAPTURES / model / "nvidia-smi-mig-lgip.txt").read_text()))
    printed = render_mig_profiles(mig_profiles_reply([_gpu(model)]))
    rows = read_lgip(printed)
    assert sorted(r["name"] for r in rows) == sorted(p.name for p in MODELS[model].profiles)
    for row in rows:
        assert row["free"] == "?"  # nothing can count free instances without NVML
        want = next((w for w in published.values() if w["name"] == row["name"]), None)
        if want is None:  # a name from NVIDIA's config, no published row (its id from GKE's partitioner)
            table = next(p for p in MODELS[model].profiles if p.name == row["name"])
            assert row["id"] == ("?" if "id" in MODELS[model].unknown_fields(row["name"]) else table.id), row
            assert (row["gib"], row["p2p"], row["sm"], row["dec"], row["enc"]) == ("?",) * 5, row
            assert (row["ce"], row["jpeg"], row["ofa"]) == ("?",) * 3, row
            continue
        for key in ("id", "total", "gib", "p2p", "sm", "dec", "enc"):
            assert row[key] == want[key], (row["name"], key)
        for key in ("ce", "jpeg", "ofa"):
            assert row[key] == want.get(key, "?"), (row["name"], key)
    assert "Placements: unknown" in printed and "NVML cannot see it on its current driver" in printed
    assert not any(PLACEMENT_LINE.match(line) for line in printed.splitlines())  # no -lgipp was published


def _differences(a: dict[int, dict], b: dict[int, dict]) -> dict[tuple[int, str], tuple]:
    """(profile id, field) -> (a's value, b's value) where two listings of one model differ."""
    assert set(a) == set(b)
    return {(pid, k): (a[pid].get(k), b[pid].get(k)) for pid in a for k in sorted(set(a[pid]) | set(b[pid]))
            if a[pid].get(k) != b[pid].get(k)}


def test_two_b200_drivers_print_different_1g_memory_and_gpud_names_the_one_it_copies():
    """mig-parted#166 (January 2025) and #187 (March 2025) list one B200 table but for the 1-slice
    memory; gpud's table is #187's and says so: a table is one capture, never a mix of two."""
    later = by_id(read_lgip((CAPTURES / "b200" / "nvidia-smi-mig-lgip.txt").read_text()))
    earlier = by_id(read_lgip((CAPTURES / "b200" / "nvidia-smi-mig-lgip.mig-parted-166.txt").read_text()))
    assert _differences(earlier, later) == {(19, "gib"): ("22.00", "20.50"), (20, "gib"): ("22.00", "20.50")}
    ours = {p.id: p for p in MODELS["b200"].profiles}
    assert {pid: f"{ours[pid].memory_mb / 1024:.2f}" for pid in later} == {pid: r["gib"] for pid, r in later.items()}
    assert "mig-parted/pull/187" in MODELS["b200"].source


def test_the_production_gb200_names_its_1g_profile_differently_from_the_earlier_board():
    production = by_id(read_lgip((CAPTURES / "gb200" / "nvidia-smi-mig-lgip.txt").read_text()))
    earlier = by_id(read_lgip((CAPTURES / "gb200" / "nvidia-smi-mig-lgip.gpu-operator-1303.txt").read_text()))
    diff = _differences(earlier, production)
    assert diff == {(19, "name"): ("1g.24gb", "1g.23gb"), (19, "gib"): ("20.00", "22.00"),
                    (20, "name"): ("1g.24gb+me", "1g.23gb+me"), (20, "gib"): ("20.00", "22.00"),
                    (14, "ce"): (4, None), (14, "jpeg"): (2, None), (14, "ofa"): (0, None)}  # cut off in #227
    ours = {p.name for p in MODELS["gb200"].profiles}
    assert "1g.23gb" in ours and "1g.24gb" not in ours
    assert MODELS["gb200"].unknown_fields("2g.47gb") == ("placements", "ci_profiles", "copy_engines", "jpegs", "ofas")


def test_another_rtx_pro_6000_driver_prints_other_1g_memory():
    """bigstack-oss/cubecos#312's host prints 23.12 GiB where driver 610.43.02 prints 23.62; the
    simulator serves the 610.43.02 capture's."""
    served = by_id(read_lgip((CAPTURES / "rtx-pro-6000" / "nvidia-smi-mig-lgip.txt").read_text()))
    other = by_id(read_lgip((CAPTURES / "rtx-pro-6000" / "nvidia-smi-mig-lgip.cubecos-312.txt").read_text()))
    assert _differences(other, {pid: served[pid] for pid in other}) == {
        (pid, "gib"): ("23.12", "23.62") for pid in (14, 21, 47)}
    ours = {p.id: p for p in MODELS["rtx-pro-6000"].profiles}
    assert {f"{ours[pid].memory_mb / 1024:.2f}" for pid in other} == {"23.62"}


def test_gpud_sim_create_says_which_cells_are_inferred(tmp_path):
    """A model served partly from inference (gh200-96gb: placements, CI profiles, total memory) says
    so when a host is made of it; a fully sourced one says nothing."""
    import subprocess
    import sys

    def create(model: str, *extra: str) -> str:
        res = subprocess.run([sys.executable, "-m", "gpud.sim.cli", "create", str(tmp_path / f"{model}{len(extra)}"),
                              "--gpu", model, *extra], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        return res.stderr

    said = create("gh200-96gb")
    assert "gh200-96gb has inferred cells" in said and "placements, ci_profiles" in said
    assert "the GPU's total memory" in said
    assert "inferred" not in create("h200")
    # every model gpud's own table knows only in part says so too, naming its inferred rows
    for key in ("b200", "gb200", "gh200-144gb", "gb300"):
        assert MODELS[key].unknown, key
        said = create(key)
        assert f"{key} has inferred cells" in said and all(p.name in said for p in MODELS[key].profiles
                                                           if MODELS[key].unknown_fields(p.name)), (key, said)
    said = create("gb300", "--driver", "610.43.02")  # the R61x names of the inferred rows
    assert "1g.31gb" in said and "7g.251gb" in said and "1g.35gb" not in said
