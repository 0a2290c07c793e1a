"""The GPU-instance id a real driver gives a GI, from its memory placement (docs/hardware/mig-ids.md).

Why a table and not "lowest free id": every published `nvidia-smi mig -lgi` listing shows GI ids
that follow the memory placement, not the creation order. The ids number the nodes of a binary
tree over the GPU's memory slices: 0 is the whole GPU, 1-2 the halves, 3-6 the quarters, 7-14
the eighths (on 8-memory-slice GPUs). A GI spanning `size` slices at `start` has the id of that
node. Real GPUs come in two kinds (both seen on one host, NVIDIA/DCGM#138): on some, NVML's
placement numbering and the tree agree ("tree"); on others the two halves are the other way round
("tree-halves-swapped": a 3g at 4:4 is GI 1, a 1g at 0:1 is GI 11). No capture shows what tells
the kinds apart, so gpud never derives an id from a placement: it reads ids back.

The simulator gives each GPU one of the two kinds (`SimGpu.gi_id_order`).
"""

from __future__ import annotations

TREE = "tree"
TREE_HALVES_SWAPPED = "tree-halves-swapped"
ORDERS = (TREE, TREE_HALVES_SWAPPED)


def gi_id(order: str, start: int, size: int, total: int) -> int:
    """The id of a GI at `start:size` on a GPU of `total` memory slices (NVML placement units).

    `total / size` must be a power of two and `start` a multiple of `size`: true of every
    placement NVML offers (every -lgipp capture in tests/fixtures)."""
    if order not in ORDERS:
        raise ValueError(f"unknown GI id order {order!r}; known: {', '.join(ORDERS)}")
    parts, rest = divmod(total, size)
    if size <= 0 or rest or parts & (parts - 1) or start % size or not 0 <= start < total:
        raise ValueError(f"placement {start}:{size} does not sit on the id tree of a {total}-slice GPU")
    if order == TREE_HALVES_SWAPPED and parts > 1:
        start = (start + total // 2) % total
    return parts - 1 + start // size
