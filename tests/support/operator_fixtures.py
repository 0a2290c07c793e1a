"""What the GPU Operator tests share: NVIDIA's own mig-parted configs (tests/fixtures/mig-parted,
copied unchanged from NVIDIA/mig-parted v0.15.0), a ConfigMap-style file without `all-disabled`,
and a layout that mixes workloads per GPU with the label that says what the operator leaves unserved."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "mig-parted"
CONFIGS = ("config-default.yaml", "examples-config.yaml")

WITHOUT_ALL_DISABLED = """\
version: v1
mig-configs:
  all-1g.10gb:
    - devices: all
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
  half:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"3g.40gb": 2}
    - devices: [1]
      mig-enabled: false
"""

PASSTHROUGH_SERVED = "nvidia.com/gpud.workload.vm-passthrough.served"

WORKLOAD_LAYOUT = """version: v1
layouts:
  whole:
    - devices: all
  mixed:
    - devices: [0]
    - devices: [1]
      workload: vm-passthrough
  vms:
    - devices: all
      workload: vm-passthrough
"""
