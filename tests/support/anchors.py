"""NVIDIA's tools that scripts/install-anchors installs (make test runs it): the binary its
status.json names, or a skip with the reason it recorded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ANCHORS = Path(os.environ.get("GPUD_ANCHORS", "/var/cache/gpud-anchors"))


def anchor(name: str) -> Path:
    status = ANCHORS / "status.json"
    if not status.is_file():
        pytest.skip(f"{name}: {status} missing: scripts/install-anchors has not run (make test runs it)")
    entry = json.loads(status.read_text()).get(name, {})
    binary = entry.get("binary")
    if binary and os.access(binary, os.X_OK):
        return Path(binary)
    pytest.skip(f"{name} {entry.get('version', '')} unavailable: {entry.get('unavailable', 'not recorded')}")
