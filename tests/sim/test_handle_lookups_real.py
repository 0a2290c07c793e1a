"""Handle look-ups by PCI bus id and UUID answer as the real H200 did, string for string
(tests/fixtures/h200-goprobe/handle-lookups.txt: nvidia-ml-py on the real host, read-only)."""

from __future__ import annotations

import ast
from pathlib import Path

import pynvml
import pytest

from gpud.sim import install, uninstall
from gpud.sim.cli import create
from gpud.sim.state import load

CAPTURE = Path(__file__).resolve().parents[1] / "fixtures" / "h200-goprobe" / "handle-lookups.txt"
REAL_GPU = "0000:00:06.0"  # where the captured host's H200 sits


def _rows():
    for line in CAPTURE.read_text().splitlines():
        if line and not line.startswith("#"):
            kind, rest = line.split(" ", 1)
            text, answer = rest.rsplit(" ", 1)
            yield kind, ast.literal_eval(text), answer


def _on_this_host(text: str, address: str) -> str:
    """The captured strings named the real GPU's address; the simulated GPU sits elsewhere."""
    bus, dev = address.split(":")[1:]
    return text.replace("00:06.0", f"{bus}:{dev}")


@pytest.fixture
def h200(tmp_path):
    host = tmp_path / "host"
    create(host, ["h200"])
    install(host)
    pynvml.nvmlInit()
    try:
        (address,) = load(host).gpus
        yield address
    finally:
        pynvml.nvmlShutdown()
        uninstall()


@pytest.mark.parametrize(("kind", "text", "answer"), list(_rows()))
def test_lookup_answers_as_the_real_h200(h200, kind, text, answer):
    if kind == "bus":
        text = _on_this_host(text, h200)
        call = pynvml.nvmlDeviceGetHandleByPciBusId
    else:
        call = pynvml.nvmlDeviceGetHandleByUUID
    if answer == "ok":
        assert pynvml.nvmlDeviceGetPciInfo(call(text.encode())).busId.lower().endswith(h200[5:])
    else:
        with pytest.raises(pynvml.NVMLError) as e:
            call(text.encode())
        assert e.value.value == int(answer)
