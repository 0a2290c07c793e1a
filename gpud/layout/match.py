"""Which PCI functions are the GPUs gpud manages (layout.yaml `match`).

A GPU is the function-0 endpoint of its card. Its companions (HD audio 0x0403 at function 1, USB-C
controllers) are not GPUs: they belong to its IOMMU group and are found from there when the card
moves to vfio-pci. Managed GPUs are numbered in PCI-address order, so this order is the index
order layout.yaml's `devices: [0, 1]` refers to, whatever driver each GPU is on.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpud.layout.schema import DEFAULT_MATCH, GPU_CLASSES, MatchRule
from gpud.model import PciFunction
from gpud.pci import pci_sort_key

__all__ = ["DEFAULT_MATCH", "managed", "matches"]


def matches(function: PciFunction, rule: MatchRule) -> bool:
    """Whether one function fits one rule; a rule without `class` means a display/3D controller."""
    if function.vendor != rule.vendor:
        return False
    if rule.device is not None and function.device != rule.device:
        return False
    cls = function.class_code >> 8
    return cls == rule.class_ if rule.class_ is not None else cls in GPU_CLASSES


def _function_number(address: str) -> int | None:
    try:
        return int(address.rsplit(".", 1)[1], 16)
    except (IndexError, ValueError):
        return None


def managed(functions: Sequence[PciFunction], match: Sequence[MatchRule] = DEFAULT_MATCH) -> list[PciFunction]:
    """The functions that are managed GPUs, in PCI-address order (the index order)."""
    found = [
        f for f in functions
        if _function_number(f.address) == 0 and any(matches(f, rule) for rule in match)
    ]
    return sorted(found, key=lambda f: pci_sort_key(f.address))
