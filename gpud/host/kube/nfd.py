"""Node labels out through Node Feature Discovery's local source: one feature file gpud owns.

NFD's nfd-worker reads every regular file of /etc/kubernetes/node-feature-discovery/features.d/
(kubernetes-sigs/node-feature-discovery source/local/local.go): `name=value` lines (a bare name
means `true`), `#` comments and `# +directives`, files over 65536 bytes refused whole, names
starting with "." ignored, the directory watched so a change shows within about a second. So:

* the file is written only when that directory exists (NFD is deployed; gpud never creates it);
* atomically: the bytes go to a dotfile in the same directory (which NFD skips), are fsynced,
  and the dotfile is renamed over the target, so NFD reads the old labels or the new, never half;
* an unchanged label set leaves the file untouched (no rename, no NFD event, no node update);
* a set that would not fit in 64 KiB is refused with the size, and the old file stays;
* features.d may be writable by others (NFD is often deployed by another team): the file is read
  and written only through `gpud.host.files.safe_file` (no link followed, a FIFO never blocks, a
  directory others may write refused unless sticky), and what `gpudctl labels` shows is read
  only from a regular file gpud owns (`FeaturesRefused` otherwise).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from gpud.host.files import safe_file

DEFAULT_PATH = "/etc/kubernetes/node-feature-discovery/features.d/gpud"
MAX_BYTES = 65536  # local.go MaxFeatureFileSize: a larger file is skipped entirely
HEADER = ("# Node labels written by gpud after every pass (GFD-compatible names). Do not edit:\n"
          "# change /etc/gpud/layout.yaml; `gpudctl labels` shows this file.\n")


class NfdError(Exception):
    """The feature file cannot be written as asked; the previous file (if any) is unchanged."""


class FeaturesRefused(Exception):
    """What is at the feature path is not gpud's file (a link, a FIFO, someone else's); never read."""


def render(labels: Mapping[str, str]) -> bytes:
    lines = []
    for key, value in sorted(labels.items()):
        if not key or "=" in key or any(c in key + value for c in "\n\r") or key.strip() != key or key.startswith("#"):
            raise NfdError(f"label {key!r}={value!r} cannot be written as one NFD feature line")
        lines.append(f"{key}={value}\n")
    return (HEADER + "".join(lines)).encode()


def parse(data: bytes) -> dict[str, str]:
    """Labels of a feature file as NFD reads them (comments and directives skipped)."""
    out: dict[str, str] = {}
    for raw in data.decode(errors="replace").split("\n"):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        out[key] = value if sep else "true"
    return out


def write_features(path: str, labels: Mapping[str, str]) -> str:
    """Write `labels` to `path`. Returns what happened: "written", "unchanged", or "no-directory"
    (NFD's features.d is not there: nothing written). Raises NfdError (too large, bad label) and
    OSError (the write itself failed) with the path in the message."""
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        return "no-directory"
    data = render(labels)
    if len(data) > MAX_BYTES:
        raise NfdError(f"{path}: {len(labels)} labels take {len(data)} bytes; NFD skips a feature file over "
                       f"{MAX_BYTES} bytes (write gpud's own labels only, or fewer labels)")
    try:
        if safe_file.read_file(path, MAX_BYTES, owned=True) == data:
            return "unchanged"
    except (FileNotFoundError, safe_file.UnsafeFile):
        pass  # whatever is there is replaced by the rename, never followed
    safe_file.write_file(path, data)
    return "written"


def remove_features(path: str) -> bool:
    """Remove the feature file (gpud stops: nfd-worker drops its labels at once, as GFD's file
    goes when GFD exits). A link or non-regular file there is not gpud's and is left alone.
    False when there was nothing to remove."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def read_features(path: str) -> dict[str, str] | None:
    """The labels the file holds now (None: there is no file). FeaturesRefused when what is there
    is not a regular file gpud owns, or larger than NFD reads: it is never opened through a link."""
    try:
        return parse(safe_file.read_file(path, MAX_BYTES, owned=True))
    except FileNotFoundError:
        return None
    except OSError as e:  # UnsafeFile, or the directory itself unreadable
        raise FeaturesRefused(str(e) if isinstance(e, safe_file.UnsafeFile) else f"{path}: {e.strerror}") from None
