"""The shipped example layout file (etc/gpud/layout.yaml) with its commented examples turned on."""

from __future__ import annotations

import re
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "etc" / "gpud" / "layout.yaml"


def uncommented() -> str:
    """The file with the commented example layouts, match and hooks turned into YAML."""
    out = []
    for line in EXAMPLE.read_text().splitlines():
        m = re.match(r"^(\s*)# ( *(?:- |[a-z0-9-]+:(?: |$)|\{).*)$", line)
        if m and not line.lstrip().startswith("# ---"):
            line = m[1] + m[2]
        if line.startswith("hooks: {}"):
            line = "hooks:"
        out.append(line)
    return "\n".join(out) + "\n"
