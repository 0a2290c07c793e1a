"""The real nvidia-mig-parted on a scenario's simulated host: the anchor that bench/mig_bench.py
compares gpud with.

The binary comes from the anchors' status file (scripts/install-anchors' format: `{"nvidia-mig-parted":
{"binary": PATH, "version": V}}` under `GPUD_ANCHORS`, default /var/cache/gpud-anchors). The scenario's
target layout is written as a mig-parted config (`version: v1`, `mig-configs`), and the tool runs as
`nvidia-mig-parted apply -f F -c NAME` through `gpud-sim exec` (gpud/sim/host_exec.run_counted), so
every NVML call it makes is counted by the simulator and every reset it asks for (`nvidia-smi -r`)
goes through the simulated host's own nvidia-smi, which refuses while NVML sessions or work hold
the GPU. What the tool did is read back from the simulator's state file, never from the tool.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from gpud.sim.host_exec import run_counted

ANCHORS = Path(os.environ.get("GPUD_ANCHORS", "/var/cache/gpud-anchors"))
TIMEOUT_S = 600


def binary() -> tuple[Path | None, str]:
    """(the nvidia-mig-parted binary, its version) or (None, why it is absent)."""
    status = ANCHORS / "status.json"
    if not status.is_file():
        return None, f"{status} missing (scripts/install-anchors has not run)"
    entry = json.loads(status.read_text()).get("nvidia-mig-parted", {})
    path = entry.get("binary")
    if path and os.access(path, os.X_OK):
        return Path(path), entry.get("version", "unknown version")
    return None, f"nvidia-mig-parted {entry.get('version', '')} unavailable: {entry.get('unavailable', 'not recorded')}"


def _filter(value: str) -> str:
    """gpud's `10de:2335` (vendor:device) -> mig-parted's `0x233510DE` (device id then vendor id);
    mig-parted's own form passes unchanged."""
    v = value.strip()
    if ":" in v:
        vendor, device = v.split(":")
        return f"0x{int(device, 16):04X}{int(vendor, 16):04X}"
    return v


def config(layout_text: str) -> tuple[str, str]:
    """(mig-parted config YAML, the label to apply) from a gpud layout.yaml text. gpud's `policy`
    (on-busy, reset) has no mig-parted counterpart and is dropped; the entries are mig-parted's."""
    doc = yaml.safe_load(layout_text)
    label = doc["selected"]
    entries = []
    for e in (doc.get("layouts") or doc["mig-configs"])[label]:
        out = {"devices": e["devices"], "mig-enabled": bool(e["mig-enabled"])}
        if e.get("device-filter") is not None:
            f = e["device-filter"]
            out["device-filter"] = [_filter(x) for x in f] if isinstance(f, list) else _filter(f)
        if e["mig-enabled"]:
            out["mig-devices"] = dict(e.get("mig-devices") or {})
        entries.append(out)
    return yaml.safe_dump({"version": "v1", "mig-configs": {label: entries}}, sort_keys=False), label


def apply(tool: Path, host_dir: Path, layout_text: str, workdir: Path) -> dict:
    """Run `apply` once; returns {"rc", "calls" (per NVML function), "output"}. The caller's own NVML
    session must be closed: a session holds the GPU's device nodes and `nvidia-smi -r` refuses."""
    text, label = config(layout_text)
    cfg = workdir / "mig-parted.yaml"
    cfg.write_text(text)
    res, calls = run_counted(host_dir, [str(tool), "apply", "-f", str(cfg), "-c", label], timeout=TIMEOUT_S)
    return {"rc": res.returncode, "calls": calls, "output": (res.stdout + res.stderr).strip()}
