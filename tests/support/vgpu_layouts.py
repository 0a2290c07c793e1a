"""The vm-vgpu layouts the daemon tests share, with the PCI addresses the simulator gives their GPUs
(`daemon(["l40s", "t4"], ...)`: the L40S first, the T4 second)."""

from __future__ import annotations

L40S, T4 = "0000:18:00.0", "0000:2a:00.0"

# the L40S alone, four L40S-12Q VFs (vendor VFIO, SR-IOV)
L40S_ONLY = """\
version: v1
layouts:
  vms:
    - devices: [0]
      workload: vm-vgpu
      vgpu-devices: {"L40S-12Q": 4}
"""

# the same, and two GRID T4-4Q mdevs on the T4
L40S_AND_T4 = L40S_ONLY + """\
    - devices: [1]
      workload: vm-vgpu
      vgpu-devices: {"GRID T4-4Q": 2}
"""
