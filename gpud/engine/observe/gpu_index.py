"""Stable GPU indices: an index keeps naming the same physical GPU while gpud runs and across restarts.

Why: a layout says `devices: [0]`. If indices were recomputed from the GPUs present (PCI-address
order), a hot-removed GPU 0 would make the next card index 0, and gpud would give it GPU 0's MIG
layout (issue 13, item 1). So indices are kept in a map, PCI address -> index, in the state
directory (`gpu-index.json`, replaced atomically):

- the first start (no map) numbers the managed GPUs in PCI-address order, as before;
- a GPU missing from the bus keeps its index and its last identity (model, PCI id, UUID): status
  shows it `gone`, and entries naming it wait for it instead of moving to another card;
- a PCI address never seen before gets the lowest index no known GPU holds (the next free one);
- a GPU that comes back at its PCI address gets its old index back.

The numbering itself (`number`) is pure; `GpuIndex` adds the file.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence

import msgspec

from gpud.host.atomic_file import replace_file
from gpud.model import Gpu, KnownGpu
from gpud.profiles import model_name

log = logging.getLogger(__name__)

FILE_NAME = "gpu-index.json"
FORMAT_VERSION = 1


class IndexFile(msgspec.Struct):
    """What `gpu-index.json` holds."""

    version: int
    gpus: list[KnownGpu]


class SetChange(msgspec.Struct, frozen=True):
    """How the set of GPUs differs from the one the map last saw (joined: new PCI addresses)."""

    gone: tuple[KnownGpu, ...] = ()
    returned: tuple[KnownGpu, ...] = ()
    joined: tuple[KnownGpu, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.gone or self.returned or self.joined)


def identity(gpu: Gpu, index: int, before: KnownGpu | None) -> KnownGpu:
    """The GPU as seen now; a UUID NVML cannot tell right now (GPU on vfio-pci) is kept from before."""
    uuid = gpu.nvml.uuid if gpu.nvml is not None and gpu.nvml.uuid else (before.uuid if before else None)
    return KnownGpu(index=index, pci=gpu.pci, vendor=gpu.function.vendor, device=gpu.function.device,
                    model=model_name(gpu), uuid=uuid)


def number(known: Iterable[KnownGpu], present: Sequence[Gpu]) -> dict[str, int]:
    """PCI address -> index for every GPU known or present. Known addresses keep their index;
    new ones, in PCI-address order, take the lowest indices nobody holds."""
    indices = {k.pci: k.index for k in known}
    taken = set(indices.values())
    free = 0
    for gpu in sorted(present, key=lambda g: g.pci):
        if gpu.pci in indices:
            continue
        while free in taken:
            free += 1
        indices[gpu.pci] = free
        taken.add(free)
    return indices


class GpuIndex:
    """The map, in memory and (when `path` is set) in the state directory. `problem` says why the
    file could not be used, for status; the map then starts from the GPUs present."""

    def __init__(self, path: str | None, *, on_problem: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.known: dict[str, KnownGpu] = {}
        self.problem: str | None = None
        self._on_problem = on_problem
        self._writable = True
        self._seen_once = False  # the first committed observation compares with the file
        self._last_present: set[str] = set()
        if path is not None:
            self._load(path)

    def _load(self, path: str) -> None:
        try:
            with open(path, "rb") as f:
                data = f.read(1 << 20)
        except FileNotFoundError:
            return
        except OSError as e:
            self._fail(f"{path}: {e.strerror}; GPUs are numbered afresh in PCI-address order")
            return
        try:
            parsed = msgspec.json.decode(data, type=IndexFile)
            if parsed.version != FORMAT_VERSION:
                raise ValueError(f"version {parsed.version}, expected {FORMAT_VERSION}")
            if len({k.index for k in parsed.gpus}) != len(parsed.gpus) or \
                    len({k.pci for k in parsed.gpus}) != len(parsed.gpus):
                raise ValueError("an index or a PCI address appears twice")
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            # Kept as it is for a person to look at: never overwritten by a guess.
            self._writable = False
            self._fail(f"{path}: not a GPU index map ({e}); left as it is, GPUs are numbered in "
                       "PCI-address order until it is fixed or removed")
            return
        self.known = {k.pci: k for k in parsed.gpus}

    def _fail(self, message: str) -> None:
        self.problem = message
        log.error("%s", message)
        if self._on_problem is not None:
            self._on_problem(message)

    def assign(self, gpus: Sequence[Gpu], present_functions: Iterable[str], *,
               commit: bool) -> tuple[tuple[Gpu, ...], tuple[KnownGpu, ...], SetChange]:
        """Give each present GPU its index. Returns (the GPUs with their indices, the known GPUs
        missing from the PCI bus, the change since the map last saw the host). With `commit` the
        map takes the new GPUs and identities and is written; without it (a `check` of a candidate
        file) nothing is remembered."""
        indices = number(self.known.values(), gpus)
        on_bus = set(present_functions)
        numbered = tuple(msgspec.structs.replace(g, index=indices[g.pci]) for g in gpus)
        now = {g.pci: identity(g, indices[g.pci], self.known.get(g.pci)) for g in numbered}
        gone = tuple(sorted((k for pci, k in self.known.items() if pci not in now and pci not in on_bus),
                            key=lambda k: k.index))
        change = SetChange(
            gone=tuple(k for k in gone if k.pci in self._last_present),
            returned=tuple(now[p] for p in sorted(now) if p in self.known and p not in self._last_present
                           and self._seen_once),
            joined=tuple(now[p] for p in sorted(now) if p not in self.known and self.known),
        )
        if commit:
            updated = {**self.known, **now}
            if not self._seen_once:  # against the file: what was missing at the start is gone now
                change = msgspec.structs.replace(change, gone=gone)
            self._seen_once = True
            self._last_present = set(now)
            if updated != self.known:
                self.known = updated
                self._save()
        return numbered, gone, change

    def _save(self) -> None:
        if self.path is None or not self._writable:
            return
        body = IndexFile(version=FORMAT_VERSION, gpus=sorted(self.known.values(), key=lambda k: k.index))
        text = json.dumps(msgspec.to_builtins(body), indent=1) + "\n"
        try:
            replace_file(self.path, text.encode(), mode=0o644)
        except OSError as e:
            self._fail(f"{self.path}: not written ({e.strerror}); indices hold until gpud restarts")


def index_path(state_dir: str | None) -> str | None:
    return os.path.join(state_dir, FILE_NAME) if state_dir else None
