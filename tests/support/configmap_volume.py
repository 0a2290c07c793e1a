"""A ConfigMap volume as the kubelet writes it (kubernetes pkg/volume/util/atomic_writer.go,
AtomicWriter.Write): the payload goes into a new hidden timestamped directory, a `..data_tmp`
symlink to it is renamed over `..data` (the one atomic step), each key is a symlink
`<key> -> ..data/<key>`, and the old directory and the keys no longer in the payload are removed.
An edited ConfigMap therefore never changes the key's own directory entry: only `..data` moves.
An empty payload is what the kubelet projects for an `optional: true` ConfigMap that was deleted
(configmap.go SetUpAt); a non-optional one that is deleted keeps its last projection (the kubelet's
update fails and leaves the volume as it was)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

DATA = "..data"


class ConfigMapVolume:
    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._n = 0

    def path(self, key: str) -> Path:
        return self.dir / key

    def write(self, payload: dict[str, str]) -> None:
        old = os.readlink(self.dir / DATA) if (self.dir / DATA).is_symlink() else None
        self._n += 1
        stamp = time.strftime("..%Y_%m_%d_%H_%M_%S.", time.gmtime()) + f"{os.getpid()}{self._n:04d}"
        (self.dir / stamp).mkdir(mode=0o755)
        for key, text in payload.items():
            (self.dir / stamp / key).write_text(text)
        tmp = self.dir / "..data_tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(stamp)
        os.rename(tmp, self.dir / DATA)
        for key in payload:
            if not (self.dir / key).is_symlink():
                (self.dir / key).symlink_to(f"{DATA}/{key}")
        for entry in self.dir.iterdir():
            if not entry.name.startswith("..") and entry.name not in payload:
                entry.unlink()
        if old is not None:
            shutil.rmtree(self.dir / old)
