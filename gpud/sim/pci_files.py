"""The PCI `resource` and `config` files of simulated functions, as NVIDIA's tools read them.

go-nvlib's nvpci (v0.12.0, pkg/nvpci/nvpci.go, used by nvidia-mig-parted and the device plugin)
requires `resource` (each line `start end flags`, three hex numbers) and reads `config` through
its ConfigSpace (pkg/nvpci/config.go: vendor and device ids, the capability lists). The layout of
a GPU's BARs is the real H200's (tests/fixtures/h200/nvml-and-files.json: BAR0 16 MiB, BAR2
256 GiB, BAR4 32 MiB, 64-bit prefetchable, seven lines), for every simulated GPU: no other model's
was captured. Other functions get one 1 MiB BAR. Addresses are distinct per function, derived from
its position on the host, so two renders of one host give the same bytes.
"""

from __future__ import annotations

import struct

from gpud.sim.state import SimFunction

CONFIG_SIZE = 4096  # extended config space, as the H200's `config` (config_len 4096)
_FLAGS = 0x14220C  # the H200's resource flags: memory, 64-bit, prefetchable
# (BAR index, offset in the function's window, size): the H200's BAR2 at 0x100000000000, BAR4 at
# +0x4000000000, BAR0 at +0x4002000000.
_GPU_BARS = ((2, 0, 256 << 30), (4, 0x4000000000, 32 << 20), (0, 0x4002000000, 16 << 20))
_OTHER_BARS = ((0, 0, 1 << 20),)
_WINDOW = 1 << 44  # address space per function
_BASE = 0x100000000000
PCIE_CAP_OFFSET = 0x40


def bars(position: int, is_gpu: bool) -> list[tuple[int, int]]:
    """(start, end) of each of the seven resource lines (BAR0-5, ROM); (0, 0) where none."""
    out = [(0, 0)] * 7
    base = _BASE + position * _WINDOW
    for index, offset, size in _GPU_BARS if is_gpu else _OTHER_BARS:
        out[index] = (base + offset, base + offset + size - 1)
    return out


def resource(position: int, is_gpu: bool) -> str:
    lines = []
    for start, end in bars(position, is_gpu):
        flags = _FLAGS if end else 0
        lines.append(f"0x{start:016x} 0x{end:016x} 0x{flags:016x}")
    return "\n".join(lines) + "\n"


def config(fn: SimFunction, position: int, is_gpu: bool) -> bytes:
    """A type-0 header with the function's ids and class, its BARs, subsystem ids, one PCI
    Express capability (an endpoint) at 0x40, and no extended capability (a zero header at 0x100)."""
    cs = bytearray(CONFIG_SIZE)
    struct.pack_into("<HHHH", cs, 0, fn.vendor, fn.device, 0x0546, 0x0010)  # status: capability list
    struct.pack_into("<BBBB", cs, 8, fn.revision, fn.class_code & 0xFF, (fn.class_code >> 8) & 0xFF,
                     (fn.class_code >> 16) & 0xFF)
    for index, (start, end) in enumerate(bars(position, is_gpu)[:6]):
        if end:
            struct.pack_into("<II", cs, 0x10 + 4 * index, (start & 0xFFFFFFF0) | 0xC, start >> 32)
    struct.pack_into("<HH", cs, 0x2C, fn.subsystem_vendor, fn.subsystem_device)
    cs[0x34] = PCIE_CAP_OFFSET
    struct.pack_into("<BB", cs, 0x3C, 0xFF, 0x01)  # interrupt line (none), pin INTA
    struct.pack_into("<BBH", cs, PCIE_CAP_OFFSET, 0x10, 0x00, 0x0002)  # PCIe cap v2, endpoint, no next
    return bytes(cs)
