"""Stable GPU indices: an index keeps naming the same physical GPU while gpud runs and across restarts.

Why: a layout says `devices: [0]`. If indices were recomputed from the GPUs present (PCI-address
order), a hot-removed GPU 0 would make the next card index 0, and gpud would give it GPU 0's MIG
layout. So indices are kept in a map, PCI address -> index, in the state
directory (`gpu-index.json`, replaced atomically):

- the first start (no map) numbers the managed GPUs in PCI-address order;
- a GPU missing from the bus keeps its index and its last identity (model, PCI id, UUID): status
  shows it `gone`, and entries naming it wait for it instead of moving to another card;
- a PCI address never seen before gets the lowest index no known GPU holds (the next free one);
- a GPU that comes back at its PCI address gets its old index back.

When the map cannot be trusted (set aside: not a regular file, not in the format), another GPU
could silently take a gone GPU's index. So the map is written twice (`gpu-index.json` and its copy
`gpu-index.prev.json`); with the map untrusted, indices come from the copy, the GPUs it knows and
the bus lacks stay listed as gone, and when the GPU set differs from the copy's (or there is no
copy) `index_problem` says why indices cannot be trusted: the layout's index-based entries are
then refused (gpud.layout.resolve), PCI-address and UUID entries still apply. A host whose GPUs
are exactly the copy's takes the copy as its map again.

The numbering itself (`number`) is pure; `GpuIndex` adds the file.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence

import msgspec

from gpud.host.files import state_files
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
    """The GPU as seen now; a UUID NVML cannot tell right now (GPU on vfio-pci) is kept from before,
    unless the card at that address is another model now (a swap: its UUID is unknown)."""
    same_card = before is not None and (before.vendor, before.device) == (gpu.function.vendor, gpu.function.device)
    uuid = gpu.nvml.uuid if gpu.nvml is not None and gpu.nvml.uuid else (before.uuid if before and same_card else None)
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

    def __init__(self, path: str | None, *, on_problem: Callable[[str], object] | None = None,
                 problems: state_files.Problems | None = None) -> None:
        self.path = path
        self.known: dict[str, KnownGpu] = {}
        self.problem: str | None = None
        self._problems = problems if problems is not None else state_files.Problems(on_problem)
        self._writable = True
        self._seen_once = False  # the first committed observation compares with the file
        self._last_present: set[str] = set()
        self.untrusted: str | None = None  # why the map was not used (None: it was, or first start)
        self._copy: dict[str, KnownGpu] | None = None  # the copy's GPUs, while untrusted
        self.index_problem: str | None = None  # why indices cannot be trusted now (index entries refused)
        self._restored = False  # the copy became the map: written at the next commit
        if path is not None:
            self._load(path)

    def _load(self, path: str) -> None:
        parsed = state_files.load(path, _decode, self._problems, what="GPU index map")
        if parsed is not None:
            self.known = {k.pci: k for k in parsed.gpus}
            return
        aside = state_files.set_aside_before(path)
        if not aside:
            return  # a first start: no map, nothing set aside
        # kept for a person to look at: the map is never rebuilt over a guess
        self._writable = False
        self.untrusted = self._problems.by_file.get(path) or f"{path}: an earlier map was set aside ({aside[0]})"
        copy_path = backup_path(path)
        copy = state_files.load(copy_path, _decode, self._problems, what="GPU index map copy")
        self._copy = {k.pci: k for k in copy.gpus} if copy is not None else None
        self.known = dict(self._copy or {})
        self.problem = (f"{self.untrusted}; " + ("indices are taken from " + os.path.basename(copy_path)
                                                 if self._copy is not None else "no copy of the map either")
                        + f"; the map is not rewritten until {', '.join(aside)} is removed from "
                        f"{os.path.dirname(path)} or the GPUs are again those the copy lists")
        log.error("%s", self.problem)

    def verdict(self, present: set[str], on_bus: set[str]) -> tuple[bool, str | None]:
        """With the map untrusted: are these the GPUs the copy knew (then the copy may be the map
        again: True), and otherwise why indices cannot be trusted. Changes nothing: a `check` of a
        candidate file with its own `match:` asks this too, and a read-only request must never
        make gpud trust a map it set aside."""
        if self.untrusted is None:
            return False, None
        copy = self._copy
        if copy is not None and set(copy) == present:
            return True, None
        if copy is None:
            why = "no copy of the map says which GPU had which index"
        else:
            gone = [f"GPU {k.index} ({k.pci})" for k in sorted(copy.values(), key=lambda k: k.index)
                    if k.pci not in present and k.pci not in on_bus]
            new = sorted(present - set(copy))
            why = "the GPUs differ from those its copy lists (" + "; ".join(
                ([f"gone: {', '.join(gone)}"] if gone else []) + ([f"new: {', '.join(new)}"] if new else [])) + ")"
        return False, (f"the GPU index map could not be used ({self.untrusted}) and {why}: indices may "
                       "name other GPUs than before")

    def _judge_untrusted(self, present: set[str], on_bus: set[str]) -> None:
        """A read of the layout in force judged the untrusted map: the copy becomes the map again
        when the GPUs are those it knew; otherwise index-based entries must not be applied."""
        same, self.index_problem = self.verdict(present, on_bus)
        if same:
            self.untrusted = None
            self._writable = self._restored = True
            self.problem = f"{self.path}: rebuilt from its copy {os.path.basename(backup_path(str(self.path)))} (the same GPUs)"

    def assign(self, gpus: Sequence[Gpu], present_functions: Iterable[str], *,
               commit: bool) -> tuple[tuple[Gpu, ...], tuple[KnownGpu, ...], SetChange]:
        """Give each present GPU its index. Returns (the GPUs with their indices, the known GPUs
        missing from the PCI bus, the change since the map last saw the host). With `commit` the
        map takes the new GPUs and identities and is written; without it (a `check` of a candidate
        file) nothing is remembered."""
        on_bus = set(present_functions)
        if self.untrusted is not None and commit:  # only the layout in force's reads judge the map
            self._judge_untrusted({g.pci for g in gpus}, on_bus)
        indices = number(self.known.values(), gpus)
        now = {g.pci: identity(g, indices[g.pci], self.known.get(g.pci)) for g in gpus}
        # the UUID a GPU NVML does not see now had when it last did: a layout naming it still selects it
        numbered = tuple(msgspec.structs.replace(g, index=indices[g.pci], known_uuid=now[g.pci].uuid) for g in gpus)
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
            if updated != self.known or self._restored:
                self.known, self._restored = updated, False
                self._save()
        return numbered, gone, change

    def _save(self) -> None:
        if self.path is None or not self._writable:
            return
        body = IndexFile(version=FORMAT_VERSION, gpus=sorted(self.known.values(), key=lambda k: k.index))
        text = json.dumps(msgspec.to_builtins(body), indent=1) + "\n"
        try:
            state_files.save(backup_path(self.path), text.encode(), mode=0o644)  # the copy first: never newer than the map
            state_files.save(self.path, text.encode(), mode=0o644)
            self._problems.clear(self.path)
        except OSError as e:
            self._problems.say(self.path, f"{self.path}: not written ({e}); indices hold until gpud restarts")


def _decode(data: bytes) -> IndexFile:
    parsed = msgspec.json.decode(data, type=IndexFile)
    if parsed.version != FORMAT_VERSION:
        raise state_files.BadStateFile(f"version {parsed.version}, expected {FORMAT_VERSION}")
    if len({k.index for k in parsed.gpus}) != len(parsed.gpus) or \
            len({k.pci for k in parsed.gpus}) != len(parsed.gpus):
        raise state_files.BadStateFile("an index or a PCI address appears twice")
    if any(k.index < 0 for k in parsed.gpus):
        raise state_files.BadStateFile("a negative index")
    return parsed


def backup_path(path: str) -> str:
    root, ext = os.path.splitext(path)
    return f"{root}.prev{ext}"


def index_path(state_dir: str | None) -> str | None:
    return os.path.join(state_dir, FILE_NAME) if state_dir else None
