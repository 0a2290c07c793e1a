"""The simulated host's NVIDIA device nodes: real character nodes (NVIDIA's tools stat them for
their major and minor, nvidia-container-toolkit's `lookup.NewCharDeviceLocator` skips anything
else), on majors that reach no driver of the machine the simulator runs on.

Safety rule (docs/hardware/dev-nodes.md): a character node reaches whatever driver registered its
major, whatever directory it lies in. The real driver's GPU major is 195, so a simulated
/dev/nvidia0 with major 195 on a machine whose nvidia module is loaded would open the real GPU.
The simulated nodes therefore take majors from the ranges Linux reserves for local and experimental
use (Documentation/admin-guide/devices.txt: char 60-63 and 120-127; 240-254 is the same, but the
kernel hands those out dynamically, CHRDEV_MAJOR_DYN_END, so they are left alone) and only those
this machine's /proc/devices does not list at the moment of creation. Each render checks again, so a
driver registering one later makes the nodes move to another free major (the simulated
/proc/devices follows); none free is refused. Where nodes cannot be made (not root, or a device
cgroup refuses them) they are plain files: nothing stats them as devices then.
"""

from __future__ import annotations

import os
import stat
import tempfile

LOCAL_MAJORS = (*range(120, 128), *range(60, 64))
REAL_PROC_DEVICES = "/proc/devices"
# /proc/devices names (nvidia-container-toolkit internal/info/proc/devices/devices.go: "nvidia"
# since driver 550.40, "nvidia-frontend" before; nvidia-caps its own dynamic major)
NVIDIA, NVIDIA_CAPS = "nvidia", "nvidia-caps"
NVIDIACTL_MINOR = 255  # the same file: NVIDIACTLMinor


class DevNodeError(RuntimeError):
    """No major is safe for the simulated nodes on this machine."""


def registered_char_majors(path: str | None = None) -> set[int]:
    """The character majors this machine's drivers hold (the "Character devices:" part). Under
    `gpud-sim exec` /proc/devices is the simulated one: its own nvidia lines (the names above on a
    local major, where no real nvidia module registers: 195 and dynamic majors) are not a driver's."""
    out: set[int] = set()
    try:
        with open(path or REAL_PROC_DEVICES) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        if line.startswith("Block devices"):
            break
        head = line.split(None, 1)
        if len(head) == 2 and head[0].isdigit():
            major = int(head[0])
            if not (head[1].strip() in (NVIDIA, NVIDIA_CAPS) and major in LOCAL_MAJORS):
                out.add(major)
    return out


def majors(registered: set[int] | None = None) -> dict[str, int]:
    """Free local majors for the simulated nvidia and nvidia-caps drivers; DevNodeError when fewer
    than two are free."""
    taken = registered_char_majors() if registered is None else registered
    free = [m for m in LOCAL_MAJORS if m not in taken]
    if len(free) < 2:
        raise DevNodeError(f"no free local character major for the simulated nvidia nodes: {REAL_PROC_DEVICES} "
                           f"lists {sorted(set(LOCAL_MAJORS) & taken)} of {list(LOCAL_MAJORS)}; refusing to make "
                           f"nodes that would reach a real driver (docs/hardware/dev-nodes.md)")
    return {NVIDIA: free[0], NVIDIA_CAPS: free[1]}


_mknod_works: dict[int, bool] = {}


def can_mknod(major: int) -> bool:
    """Whether this process may make a character node on `major`: root, and not refused by a
    device cgroup (a container such as systemd-nspawn allows only its own devices). Probed once per
    major, in a private temporary directory, the probe removed at once."""
    if os.geteuid() != 0:
        return False
    if major not in _mknod_works:
        d = tempfile.mkdtemp(prefix="gpud-sim-mknod.")
        probe = os.path.join(d, "probe")
        try:
            check_safe({major})
            os.mknod(probe, stat.S_IFCHR | 0o600, os.makedev(major, 0))
            _mknod_works[major] = True
        except PermissionError:
            _mknod_works[major] = False
        finally:
            if os.path.lexists(probe):
                os.unlink(probe)
            os.rmdir(d)
    return _mknod_works[major]


def proc_devices(chosen: dict[str, int], registered_text: str | None = None) -> str:
    """The simulated /proc/devices: this machine's entries with the simulated driver's added (what
    /proc/devices reads like with the nvidia module loaded: one line per registered name)."""
    text = registered_text
    if text is None:
        try:
            with open(REAL_PROC_DEVICES) as f:
                text = f.read()
        except FileNotFoundError:
            text = ""
    char: list[str] = []
    block: list[str] = []
    part = char
    for line in text.splitlines():
        if line.startswith("Character devices"):
            part = char
        elif line.startswith("Block devices"):
            part = block
        elif line.strip():
            part.append(line)
    char += [f"{major:3d} {name}" for name, major in chosen.items()]
    char.sort(key=lambda s: int(s.split()[0]))
    return "Character devices:\n" + "".join(c + "\n" for c in char) + "\nBlock devices:\n" + \
        "".join(b + "\n" for b in block)


def check_safe(rdev_majors: set[int], registered: set[int] | None = None) -> None:
    """Refuse (DevNodeError) when a simulated node's major is now held by a driver of this machine."""
    taken = registered_char_majors() if registered is None else registered
    clash = sorted(rdev_majors & taken)
    if clash:
        raise DevNodeError(f"simulated device nodes have major(s) {clash}, which this machine's {REAL_PROC_DEVICES} "
                           f"now lists: they would reach a real driver (docs/hardware/dev-nodes.md)")
