"""The simulated host's state: one file under the host directory, guarded by an flock.

Several processes share one simulated host (the daemon through the fake NVML library and the sysfs
store, the `gpud-sim` command, tests), so every read-modify-write happens under an exclusive lock
on `DIR/state.lock` and the file is replaced atomically.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec

from gpud.sim.call_counts import Counters, bump_generation
from gpud.sim.call_counts import read as read_counts

STATE_FILE = "state.json"
PERSISTENCED_PID = 870  # the simulated nvidia-persistenced (`gpud-sim create --persistence daemon`)
PERSISTENCE_MODES = ("off", "legacy", "daemon")
PERSISTENCED_SOCKETS = ("reachable", "hidden")
FABRIC_MANAGER_PID = 871  # the simulated nv-fabricmanager process (NVSwitch hosts, when running)
FABRIC_MANAGER_STATES = ("running", "stopped")
FIRST_BOOT_ID = "00000000-0000-4000-8000-000000000001"
LOCK_FILE = "state.lock"


class SimCi(msgspec.Struct):
    id: int
    profile_id: int
    uuid: str
    start: int = 0  # placement inside its GI, in compute slices (the size is the CI profile's)


class SimGi(msgspec.Struct):
    id: int
    profile_id: int
    start: int
    size: int
    cis: list[SimCi] = msgspec.field(default_factory=list)


class SimProcess(msgspec.Struct):
    """A process holding a GPU (device = GPU UUID or PCI address) or a MIG device (MIG UUID)."""

    pid: int
    name: str
    device: str
    used_mb: int = 256
    # The pid was a live process of this machine when registered: like NVML, the simulator stops
    # listing it once it exits, so waiting on a holder's exit can be tested end to end.
    real: bool = False
    vm: str | None = None  # a VM's name: the process shows a qemu command line with `-name guest=<vm>`
    cdev: bool = False  # holds a vfio device through /dev/vfio/devices/vfioN (iommufd), not its group


# pid -> a pidfd of the process seen alive: it turns readable when that process exits (a zombie
# included), so a later check is one poll instead of a signal and a /proc read, and a pid reused
# by another process is never taken for the first (pidfd_open(2)).
_PIDFDS: dict[int, int] = {}
_PIDFDS_LOCK = threading.Lock()


def _alive(pid: int) -> bool:
    """A live process of this machine. A zombie is not: the kernel closed its files at exit, so it
    holds no device node and NVML no longer lists it."""
    with _PIDFDS_LOCK:
        fd = _PIDFDS.get(pid)
        if fd is not None:
            if not _exited(fd):
                return True
            os.close(fd)
            del _PIDFDS[pid]
            return False
    if not _alive_now(pid):
        return False
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return True  # no pidfds here (old kernel, seccomp): asked afresh next time
    with _PIDFDS_LOCK:
        if pid in _PIDFDS or _exited(fd):
            os.close(fd)
        else:
            _PIDFDS[pid] = fd
    return True


def _exited(pidfd: int) -> bool:
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def _alive_now(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


class SimFunction(msgspec.Struct):
    """One PCI function of the simulated host, with what the kernel would know about it."""

    address: str
    vendor: int
    device: int
    subsystem_vendor: int
    subsystem_device: int
    class_code: int
    revision: int = 0xA1
    native_driver: str | None = None  # what a probe binds when driver_override is empty
    driver: str | None = None
    driver_override: str | None = None
    iommu_group: int | None = None
    numa_node: int = -1
    present: bool = True
    # times the nvidia driver has probed this function: an NVML session that enumerated an
    # earlier probe has lost the GPU, even when it is bound again at the same address
    nvidia_probes: int = 0
    # times any driver has bound this function (really_probe succeeding): the simulator's own
    # count of rebinds, for tests that a pass never repeats one that changed nothing
    binds: int = 0
    physfn: str | None = None  # an SR-IOV virtual function: the address of its physical function


class SimGpu(msgspec.Struct):
    """NVML-side state of one GPU function (keyed by its PCI address)."""

    address: str
    model: str  # key into gpud.sim.catalog
    uuid: str
    minor: int
    serial: str = ""
    mig_mode: int = 0
    mig_pending: int = 0
    # How the driver numbers this GPU's GIs (gpud.sim.gi_ids): "tree" or "tree-halves-swapped".
    gi_id_order: str = "tree"
    gis: list[SimGi] = msgspec.field(default_factory=list)


class SimSession(msgspec.Struct):
    """An open NVML session (nvmlInit .. nvmlShutdown) of one process: like the real library it
    holds /dev/nvidiactl and the device nodes of the GPUs on nvidia when it opened, so an unbind of
    nvidia, the unbindLock and `nvidia-smi -r` see it as a user of those GPUs. A session of a pid
    that has exited is dropped, as the kernel closes a dead process's files."""

    owner: str  # "<pid>:<library instance>": one process may load the library more than once
    pid: int
    name: str = ""  # the process's comm, shown in DIR/proc with the nodes it holds
    gpus: list[str] = msgspec.field(default_factory=list)  # PCI addresses whose nodes it holds


class SimVf(msgspec.Struct):
    """One SR-IOV virtual function of a vGPU-capable GPU, by index (virtfn<index>)."""

    address: str
    vgpu_type: int = 0  # vendor VFIO `nvidia/current_vgpu_type`; 0 = no vGPU
    gpu_instance_id: int = -1  # the GI a MIG-backed vGPU sits on (driver's choice at creation)


class SimMdev(msgspec.Struct):
    """A mediated device: `/sys/bus/mdev/devices/<uuid>`, child of its parent PCI function."""

    uuid: str
    parent: str  # PCI address: the GPU itself, or one of its VFs on SR-IOV GPUs
    type_id: int  # mdev_supported_types/nvidia-<type_id>
    iommu_group: int  # vfio gives each mdev its own group: /dev/vfio/<group>
    gpu_instance_id: int = -1


class SimVgpu(msgspec.Struct):
    """The vGPU side of one physical GPU (keyed by its PCI address in SimState.vgpu)."""

    interface: str  # "vfio" (vendor-specific VFIO on SR-IOV VFs) | "mdev"
    vfs: list[SimVf] = msgspec.field(default_factory=list)  # enabled VFs (sriov_numvfs == len)
    mdevs: list[SimMdev] = msgspec.field(default_factory=list)


class SimFault(msgspec.Struct):
    """`gpud-sim fault`: the nth call (counted from when it was set) of `function` fails."""

    function: str
    nth: int
    error: int
    seen: int = 0


class SimState(msgspec.Struct):
    functions: dict[str, SimFunction] = msgspec.field(default_factory=dict)
    gpus: dict[str, SimGpu] = msgspec.field(default_factory=dict)
    processes: list[SimProcess] = msgspec.field(default_factory=list)
    faults: list[SimFault] = msgspec.field(default_factory=list)
    hangs: list[str] = msgspec.field(default_factory=list)  # PCI addresses whose next unbind hangs
    loaded_modules: list[str] = msgspec.field(default_factory=list)
    vgpu: dict[str, SimVgpu] = msgspec.field(default_factory=dict)  # PF address -> its vGPU state
    calls: dict[str, int] = msgspec.field(default_factory=dict)  # NVML function -> count
    # PCI address -> reset method ("nvidia-smi" | "sysfs") -> GPU resets done
    resets: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)
    sessions: list[SimSession] = msgspec.field(default_factory=list)
    driver_version: str = "580.159.04"
    # the nvidia module's CoherentGPUMemoryMode ("" unset, "numa", "driver" = CDMM), as
    # /proc/driver/nvidia/params states it; CDMM refuses MIG on a Grace GPU (docs/hardware/grace.md)
    coherent_memory_mode: str = ""
    # /proc/sys/kernel/random/boot_id of the simulated host: `gpud-sim reboot` draws a new one
    boot_id: str = FIRST_BOOT_ID
    boots: int = 0  # reboots since `gpud-sim create`
    cuda_version: int = 13000
    # Persistence mode: "off", "legacy" (`nvidia-smi -pm 1`, a driver flag per GPU) or "daemon"
    # (nvidia-persistenced keeps the device nodes of the GPUs it persists open). `persistent`: the
    # GPUs it is on for. What it does to `nvidia-smi -r`: docs/hardware/persistence.md.
    persistence: str = "off"
    # Whether nvidia-smi reaches nvidia-persistenced's socket (/run/nvidia-persistenced/socket):
    # "reachable" on the host; "hidden" where the daemon runs out of its sight (another container,
    # gpu-operator#118), so its hold refuses a reset.
    persistenced_socket: str = "reachable"
    # nvidia-fabricmanager on an NVSwitch host (`--fabric-manager running|stopped`): on Ampere it
    # decides whether a GPU resets alone (nvidia-smi(1), -r)
    fabric_manager: str = "running"
    persistent: list[str] = msgspec.field(default_factory=list)
    # the kernel log ring as /dev/kmsg hands it out, one "<prio>,<seq>,<usec>,-;<text>" per record
    # (Documentation/ABI/testing/dev-kmsg); only what the simulated driver logs (`gpud-sim xid`)
    kmsg: list[str] = msgspec.field(default_factory=list)


def count_reset(state: SimState, address: str, method: str) -> None:
    per_method = state.resets.setdefault(address, {})
    per_method[method] = per_method.get(method, 0) + 1


def state_path(host_dir: str | os.PathLike) -> Path:
    return Path(host_dir) / STATE_FILE


def load(host_dir: str | os.PathLike) -> SimState:
    """Read without the lock: a consistent snapshot because writers replace the file atomically.
    `calls` are the NVML call counters (gpud.sim.call_counts), exact as of now; the copy in the
    file is as of its last save."""
    state = msgspec.json.decode(state_path(host_dir).read_bytes(), type=SimState)
    state.calls = _with_counts(host_dir, state).calls
    return state


def _with_counts(host_dir: str | os.PathLike, state: SimState) -> SimState:
    """`state` with the counters' calls (a copy when they add any; `state` itself is not changed)."""
    counted = read_counts(host_dir)
    if not counted:
        return state
    return msgspec.structs.replace(state, calls=dict(sorted({**state.calls, **counted}.items())))


def save(host_dir: str | os.PathLike, state: SimState) -> None:
    """Replace the state file (under the host lock). The counters' generation moves on, so a
    process's cached copy (StateCache) is read again."""
    path = state_path(host_dir)
    tmp = path.with_name(f".{STATE_FILE}.{os.getpid()}")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(_with_counts(host_dir, state))))
    os.replace(tmp, path)
    bump_generation(host_dir)


# Run with (host_dir, state) after a save that dropped dead processes. The tree renderer
# (gpud.sim.sysfs_tree, which imports this module) registers itself here, so the state layer
# never imports the layer above it.
AFTER_DEAD_DROPPED: list = []


def _drop_dead(state: SimState) -> bool:
    """Processes and NVML sessions of pids that have exited go, as the kernel closes their files."""
    before = len(state.processes) + len(state.sessions)
    state.processes = [p for p in state.processes if not p.real or _alive(p.pid)]
    state.sessions = [s for s in state.sessions if _alive(s.pid)]
    return len(state.processes) + len(state.sessions) != before


def _after_dead_dropped(host_dir: str | os.PathLike, state: SimState) -> None:
    # the kernel closed a dead process's files: its DIR/proc entry goes with it
    for hook in AFTER_DEAD_DROPPED:
        hook(host_dir, state)


@contextlib.contextmanager
def locked(host_dir: str | os.PathLike, *, write: bool = True) -> Iterator[SimState]:
    """Hold the host lock; yields the state and saves it back on a clean exit when `write`."""
    lock_path = Path(host_dir) / LOCK_FILE
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if write else fcntl.LOCK_SH)
        state = load(host_dir)
        gone = _drop_dead(state)
        yield state
        if write:
            save(host_dir, state)
            if gone:
                _after_dead_dropped(host_dir, state)
    finally:
        os.close(fd)


# Set to "1": every NVML call reads and writes the state file again, as the simulator did until
# 2026-12-04 (what bench/mig_bench.py runs gpud on to compare with a recording made then).
SAVE_EVERY_CALL = "GPUD_SIM_SAVE_EVERY_CALL"
# Set to "1": a read-only NVML call that changed the state is an error (StateCache.locked).
CHECK_READS = "GPUD_SIM_CHECK_READS"


class StateCache:
    """One process's decoded copy of the state file, for the fake NVML library's calls.

    Most NVML calls read: decoding the whole file for each and writing it back (as `locked` does)
    cost 1.8 ms a call on 64 GPUs, growing with the host. Here the copy is kept while nobody saved
    since (the counters' save generation and the file's identity say so), the call is counted in
    the shared counters (gpud.sim.call_counts), and the file is written only when the call changed
    the state: state.json stays the exact record of the hardware that tests read."""

    def __init__(self, host_dir: str | os.PathLike):
        self.dir = Path(host_dir)
        self.counters = Counters(host_dir)
        self._key: tuple | None = None
        self._state: SimState | None = None
        self._encoded = b""
        self.dirty = False  # set by the caller, under the lock, when it changed the state itself

    def _file_key(self) -> tuple:
        st = os.stat(state_path(self.dir))
        return (self.counters.generation(), st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)

    @contextlib.contextmanager
    def locked(self, count: str, *, reads: bool = False) -> Iterator[SimState]:
        """Hold the host lock exclusively, count `count`, yield the state; save it when changed.
        `reads`: the call only reads (an NVML getter), so unless the caller marks the state
        `dirty` (it consumed a fault) or a dead process was dropped, it is not compared with the
        copy (encoding the whole state costs as much as the call); with GPUD_SIM_CHECK_READS=1
        (the test suite sets it) it is, and a read that changed it is an error of the simulator."""
        fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self.counters.bump(count)
            key = self._file_key()
            state = self._state
            every = os.environ.get(SAVE_EVERY_CALL) == "1"
            if state is None or key != self._key or every:
                state = msgspec.json.decode(state_path(self.dir).read_bytes(), type=SimState)
                self._encoded = msgspec.json.encode(state)
            self._state, self._key = None, None  # until the call is through
            self.dirty = False
            gone = _drop_dead(state)
            yield state
            if reads and not (every or gone or self.dirty):
                if os.environ.get(CHECK_READS) == "1" and msgspec.json.encode(state) != self._encoded:
                    raise AssertionError(f"simulator: the read-only NVML call {count} changed the host's state")
                self._state, self._key = state, key
                return
            encoded = msgspec.json.encode(state)
            if every or encoded != self._encoded:
                save(self.dir, state)
                if gone:
                    _after_dead_dropped(self.dir, state)
                key = self._file_key()
            self._state, self._key, self._encoded = state, key, encoded
        finally:
            os.close(fd)
