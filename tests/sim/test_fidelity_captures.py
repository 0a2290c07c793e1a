"""Fidelity per model: the MIG table gpud reads through NVML from a simulated GPU equals a real
`nvidia-smi mig -lgip` / `-lgipp` capture of that model, field by field.

The references are text files published from real GPUs (tests/fixtures/captures/<model>/, each
with a README naming source and driver; the H200 one is this project's own capture). They are read
by the small parser below, which shares no code with gpud: a mistake in gpud's tables cannot
cancel out against the same mistake in the test.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpud.host.nvml import Nvml
from gpud.profiles import MODELS
from gpud.sim import catalog

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CAPTURES = FIXTURES / "captures"
GPU = "0000:18:00.0"

# model -> (directory of the -lgip capture, directory of the -lgipp capture)
SOURCES = {
    "a100-40gb": (CAPTURES / "a100-40gb", CAPTURES / "a100-40gb"),
    # No A100 80GB -lgipp was published: the GA100 placements of NVIDIA's guide (README there).
    "a100-80gb": (CAPTURES / "a100-80gb", CAPTURES / "a100-40gb"),
    "h100-80gb": (CAPTURES / "h100-80gb", CAPTURES / "h100-80gb"),
    "h100-nvl": (CAPTURES / "h100-nvl", CAPTURES / "h100-nvl"),
    "h200": (FIXTURES / "h200", FIXTURES / "h200"),
    "a30": (CAPTURES / "a30", CAPTURES / "a30"),
    "rtx-pro-6000": (CAPTURES / "rtx-pro-6000", CAPTURES / "rtx-pro-6000"),
}

_FIRST = re.compile(r"^\|\s*\d+\s+MIG\s+(?P<name>\S+)\s+(?P<id>\d+)\s+(?P<free>\d+)/(?P<total>\d+)\s+"
                    r"(?P<gib>\d+\.\d\d)\s+(?P<p2p>Yes|No)\s+(?P<sm>\d+)\s+(?P<dec>\d+)\s+(?P<enc>\d+)\s*\|$")
_SECOND = re.compile(r"^\|\s+(?P<ce>\d+)\s+(?P<jpeg>\d+)\s+(?P<ofa>\d+)\s*\|$")
_PLACEMENTS = re.compile(r"^GPU\s+\d+\s+Profile ID\s+(\d+)\s+Placements?\s*:\s*\{([\d,]+)\}:(\d+)\s*$")


def read_lgip(text: str) -> dict[int, dict]:
    """Profile id -> the fields of its two table lines."""
    rows: dict[int, dict] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        first = _FIRST.match(line)
        if first is None:
            continue
        second = _SECOND.match(lines[i + 1])
        assert second is not None, f"second line of {first['name']}: {lines[i + 1]!r}"
        row = {k: (v if k in ("name", "gib", "p2p") else int(v)) for k, v in first.groupdict().items()}
        row.update({k: int(v) for k, v in second.groupdict().items()})
        assert row["id"] not in rows, f"profile id {row['id']} listed twice"
        rows[row["id"]] = row
    return rows


def read_lgipp(text: str) -> dict[int, list[tuple[int, int]]]:
    """Profile id -> [(start, size)] in the listed order."""
    out: dict[int, list[tuple[int, int]]] = {}
    for line in text.splitlines():
        m = _PLACEMENTS.match(line)
        assert m is not None, f"not a placement line: {line!r}"
        out[int(m[1])] = [(int(s), int(m[3])) for s in m[2].split(",")]
    return out


def capture(model: str) -> tuple[dict[int, dict], dict[int, list[tuple[int, int]]]]:
    lgip_dir, lgipp_dir = SOURCES[model]
    return (read_lgip((lgip_dir / "nvidia-smi-mig-lgip.txt").read_text()),
            read_lgipp((lgipp_dir / "nvidia-smi-mig-lgipp.txt").read_text()))


def test_every_simulated_mig_model_has_a_capture():
    """A model the simulator offers with a MIG table must be listed here, with its files."""
    mig_models = {k for k in catalog.offered() if MODELS[k].mig_capable}
    assert mig_models == set(SOURCES)
    for lgip_dir, lgipp_dir in SOURCES.values():
        assert (lgip_dir / "nvidia-smi-mig-lgip.txt").is_file() and (lgipp_dir / "nvidia-smi-mig-lgipp.txt").is_file()
    for model in SOURCES:
        if model != "h200":
            assert "Driver:" in (CAPTURES / model / "README.md").read_text(), model


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


@pytest.mark.parametrize("model", sorted(SOURCES))
def test_gpud_reads_the_captured_table_from_the_simulator(model, sim_host):
    lgip, lgipp = capture(model)
    sim_host(model)
    nvml = Nvml()
    try:
        gpu = nvml.gpu(GPU)
    finally:
        nvml.close()
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


@pytest.mark.parametrize("model", ["b200", "gb200", "gh200-144gb", "gh200-96gb"])
def test_a_model_known_only_in_part_is_not_simulated(model, tmp_path):
    from gpud.sim.cli import create

    with pytest.raises(catalog.CatalogError, match="cannot be simulated: no source gives its MIG table whole"):
        create(tmp_path / "host", [model], [])
    assert not (tmp_path / "host").exists() or not any((tmp_path / "host").iterdir())
