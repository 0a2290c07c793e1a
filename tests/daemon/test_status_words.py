"""Issue 29 item 17: what `gpudctl status` says, read from a real daemon's output. The top line does
not say `converged` alone while a GPU is gone; the table fits 80 columns; no word twice in a row
(`read-only  [read-only]`, `waiting: waiting for`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.scenarios.definitions import layout, mig
from tests.support.daemon import ROOT, wait_until

pytestmark = pytest.mark.daemon

GPU1 = "0000:2a:00.0"


def _status_text(d, columns: int) -> str:
    r = subprocess.run([sys.executable, "-m", "gpud.cli.gpudctl", "--socket", str(d.socket), "status"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=dict(os.environ, COLUMNS=str(columns)))
    assert r.returncode == 0, r.stderr
    return r.stdout


def _table(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("GPU "))
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


def test_the_table_fits_80_columns_and_a_gone_gpu_is_on_the_top_line(daemon):
    d = daemon(["h100-80gb:4"], layout(mig([0], {"1g.10gb": 4, "3g.40gb": 1}), mig([2], {"1c.3g.40gb": 3}),
                                       {"devices": [3], "workload": "vm-passthrough"}))
    assert d.ctl("apply", "--wait", "--timeout", "120").returncode == 0
    wide = _table(_status_text(d, 200))
    assert max(len(ln) for ln in wide) > 80  # the case: it would not fit as it is
    narrow = _table(_status_text(d, 80))
    assert len(narrow) == 5 and all(len(ln) <= 80 for ln in narrow), "\n".join(narrow)
    assert d.sim("unplug", GPU1).returncode == 0
    wait_until(lambda: any(g["state"] == "gone" for g in d.status()["gpus"]), what="the GPU gone")
    top = _status_text(d, 80).splitlines()[0]
    assert top.endswith(", 1 GPU gone (1)"), top


def test_no_word_twice(daemon):
    d = daemon(["h100-80gb"], layout(mig([0], {"1g.10gb": 7})), "--read-only")
    text = _status_text(d, 200)
    top = text.splitlines()[0]
    assert "read-only" in top and top.count("read-only") == 1, top
    row = _table(text)[1]
    assert "read-only: read-only" not in row, row
