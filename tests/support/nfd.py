"""The NFD feature file read back the way nfd-worker's local source reads it: written from
node-feature-discovery source/local/local.go (getFeaturesFromFiles, getFileContent,
parseFeatureFile, updateFeatures), sharing no code with gpud's writer."""

from __future__ import annotations

import os
from pathlib import Path

MAX_FEATURE_FILE_SIZE = 65536


def nfd_read(directory: str) -> dict[str, str]:
    """What nfd-worker labels the node with from `directory` (no expiry directives involved)."""
    labels: dict[str, str] = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("."):  # ignore hidden feature file
            continue
        path = os.path.join(directory, name)
        if not os.path.isfile(path) or os.path.getsize(path) > MAX_FEATURE_FILE_SIZE:
            continue
        for raw in Path(path).read_bytes().split(b"\n"):
            line = raw.decode().strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split("=", 1)
            labels[parts[0]] = "true" if len(parts) == 1 else parts[1]
    return labels
