"""`gpud-sim exec DIR -- CMD [ARGS...]`: run any program against the simulated host in DIR.

What CMD gets (docs/nvml-c-library.md):
- the simulator's libnvidia-ml.so.1 first on LD_LIBRARY_PATH (built on first use: gpud.sim.nvmlc.build),
  with GPUD_SIM_DIR, GPUD_SIM_PYTHONHOME and GPUD_SIM_PYTHONPATH telling its embedded Python where
  the host and gpud are; DIR/bin first on PATH (the simulator's nvidia-smi);
- as root, a private mount namespace in which the simulated host's files stand where NVIDIA's
  tools read them: /sys/bus/pci, /sys/devices/pci0000:00 (beside the real /sys/devices/system and
  the rest), /sys/kernel/iommu_groups, /sys/class/mdev_bus and /sys/bus/mdev (where the host has
  mdevs), /proc/driver (nvidia, nvidia-caps), /proc/modules and /proc/devices (the simulated nvidia
  majors added: gpud.sim.dev_nodes). Every bind is read-only: a write
  there fails with EROFS (the simulator's kernel is reached through `gpud --sim`, not these paths).
  The simulated tree's relative links resolve, since its /sys/bus and /sys/devices stand together.
  Where a target does not exist on this kernel (/sys/bus/mdev without the mdev module), its parent
  becomes a tmpfs holding the real entries (each bound back) and the simulated one.
- not as root: the environment only (no namespace, the real /sys and /proc), said on stderr.

- the driver's library files where a driver root holds them, DIR/usr/lib/<arch>-linux-gnu:
  libnvidia-ml.so.<driver version>, a copy of the simulator's library refreshed to the build this
  run serves (a tool resolves links under its driver root, so a link out of DIR would not be
  found), and libcuda.so.<driver version>, empty (the simulated host has no CUDA; a program that
  loads it fails), each with its .so.1 link, so NVIDIA's tools given `--driver-root DIR` find the
  driver as on a real host (docs/hardware/dev-nodes.md);
- the device nodes re-rendered first, so none has a major this machine's drivers hold now.

CMD replaces this process, so its exit status is exec's; 127 when it cannot be started.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

MS_RDONLY = 0x1
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
CLONE_NEWNS = 0x00020000

# (path in the simulated host, where it stands, replace | merge): merge keeps the real entries the
# simulated tree does not have (/sys/devices/system stays for programs that read CPU topology).
BINDS = (
    ("sys/bus/pci", "/sys/bus/pci", "replace"),
    ("sys/devices", "/sys/devices", "merge"),
    ("sys/kernel/iommu_groups", "/sys/kernel/iommu_groups", "replace"),
    ("sys/class/mdev_bus", "/sys/class/mdev_bus", "replace"),
    ("sys/bus/mdev", "/sys/bus/mdev", "replace"),
    ("proc/driver", "/proc/driver", "merge"),
    ("proc/modules", "/proc/modules", "replace"),
    ("proc/devices", "/proc/devices", "replace"),
)


class ExecError(RuntimeError):
    pass


def python_path() -> list[str]:
    """What the library's embedded Python imports from: gpud's own root, then this interpreter's
    path (standard library, lib-dynload, site-packages)."""
    import gpud

    root = str(Path(gpud.__file__).resolve().parents[1])
    rest = [p for p in sys.path if p and os.path.exists(p) and os.path.abspath(p) != root]
    return [root] + list(dict.fromkeys(os.path.abspath(p) for p in rest))


def environment(host_dir: Path, lib: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["GPUD_SIM_DIR"] = str(host_dir)
    env["GPUD_SIM_PYTHONHOME"] = sys.base_prefix if sys.base_prefix == sys.base_exec_prefix \
        else f"{sys.base_prefix}:{sys.base_exec_prefix}"
    env["GPUD_SIM_PYTHONPATH"] = ":".join(python_path())
    env["LD_LIBRARY_PATH"] = ":".join([str(lib.parent)] + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p])
    env["PATH"] = ":".join([str(host_dir / "bin")] + [p for p in env.get("PATH", os.defpath).split(":") if p])
    return env


class _Mounts:
    """mount(2) and unshare(2) through libc (util-linux's commands would need a shell per bind)."""

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self.libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            e = ctypes.get_errno()
            raise ExecError(f"{what}: {os.strerror(e)}")

    def unshare(self) -> None:
        self._check(self.libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        self._check(self.libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")

    def bind(self, src: str, dst: str, *, read_only: bool = True) -> None:
        self._check(self.libc.mount(src.encode(), dst.encode(), None, MS_BIND | MS_REC, None), f"bind {src} on {dst}")
        if read_only:
            self._check(self.libc.mount(b"none", dst.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None),
                        f"read-only {dst}")

    def tmpfs(self, dst: str) -> None:
        self._check(self.libc.mount(b"gpud-sim", dst.encode(), b"tmpfs", 0, b"mode=0755"), f"tmpfs on {dst}")


def _placeholder(path: str, like: str) -> None:
    if os.path.isdir(like) and not os.path.islink(like):
        os.makedirs(path, exist_ok=True)
    else:
        open(path, "a").close()


def _merge(m: _Mounts, target: str, entries: dict[str, str], stash_root: str) -> None:
    """Make `target` a tmpfs holding every real entry (bound back from a stash) and, over them,
    `entries` (name -> simulated path)."""
    stash = tempfile.mkdtemp(prefix="real.", dir=stash_root)
    m.bind(target, stash, read_only=False)
    real = sorted(os.listdir(stash))
    m.tmpfs(target)
    for name in real:
        if name in entries:
            continue
        src, dst = os.path.join(stash, name), os.path.join(target, name)
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
            continue
        _placeholder(dst, src)
        m.bind(src, dst, read_only=False)
    for name, src in sorted(entries.items()):
        dst = os.path.join(target, name)
        _placeholder(dst, src)
        m.bind(src, dst)
    m.libc.mount(b"none", target.encode(), None, MS_REMOUNT | MS_RDONLY, None)


def _proc_with(m: _Mounts, entries: dict[str, str], stash_root: str) -> None:
    """A kernel built without a file of /proc (this project's CI kernel has no module support, so no
    /proc/modules) cannot have one bound over it, and procfs takes no new files. So /proc becomes a
    tmpfs whose every entry is a link into the real procfs, bound aside, plus `entries`. `self` and
    `thread-self` link to the real procfs's own magic links, so each process still reads its own;
    a process born later is missing from the listing but reachable through `self`."""
    stash = tempfile.mkdtemp(prefix="proc.", dir=stash_root)
    m.bind("/proc", stash, read_only=False)
    m.tmpfs("/proc")
    for name in sorted(os.listdir(stash)):
        if name not in entries:
            os.symlink(os.path.join(stash, name), os.path.join("/proc", name))
    for name, src in sorted(entries.items()):
        dst = os.path.join("/proc", name)
        _placeholder(dst, src)
        m.bind(src, dst)
    m.libc.mount(b"none", b"/proc", None, MS_REMOUNT | MS_RDONLY, None)


def enter_namespace(host_dir: Path, warn: Callable[[str], object] = print) -> None:
    """Unshare the mount namespace and put the simulated host's files in place (see BINDS)."""
    m = _Mounts()
    m.unshare()
    stash_root = tempfile.mkdtemp(prefix="gpud-sim-exec.")
    m.tmpfs(stash_root)  # stashes live in this namespace only
    for rel, target, mode in BINDS:
        src = str(host_dir / rel)
        if not os.path.exists(src):
            continue
        if os.path.exists(target):
            if mode == "replace" or os.path.isfile(src):
                m.bind(src, target)
            else:
                _merge(m, target, {n: os.path.join(src, n) for n in os.listdir(src)}, stash_root)
        elif os.path.dirname(target) == "/proc":
            _proc_with(m, {os.path.basename(target): src}, stash_root)
            warn(f"gpud-sim exec: {target} does not exist on this kernel: /proc is a tmpfs of links "
                 f"into the real procfs, with the simulated host's {os.path.basename(target)} added")
        elif os.path.isdir(os.path.dirname(target)):
            _merge(m, os.path.dirname(target), {os.path.basename(target): src}, stash_root)
        else:
            warn(f"gpud-sim exec: {target} does not exist on this kernel and cannot be made: "
                 f"programs that read it will not find it")


def lib_dir(host_dir: Path) -> Path:
    """Where the simulated host's driver libraries lie (a Debian/Ubuntu multiarch directory, one of
    nvidia-container-toolkit's library search paths under a driver root, pkg/lookup/library.go)."""
    return host_dir / "usr" / "lib" / f"{platform.machine()}-linux-gnu"


def driver_files(host_dir: Path, lib: Path, version: str) -> None:
    """The driver's library files under DIR (see the module's docstring)."""
    libs = lib_dir(host_dir)
    libs.mkdir(parents=True, exist_ok=True)

    def link(name: str, target: str) -> None:
        path = libs / name
        if path.is_symlink() and os.readlink(path) == target:
            return
        tmp = libs / f".{name}.tmp{os.getpid()}"
        tmp.unlink(missing_ok=True)
        os.symlink(target, tmp)
        os.replace(tmp, path)

    nvml = libs / f"libnvidia-ml.so.{version}"
    data = lib.read_bytes()
    if nvml.is_symlink() or not nvml.is_file() or nvml.read_bytes() != data:
        tmp = libs / f".{nvml.name}.tmp{os.getpid()}"
        tmp.write_bytes(data)
        os.chmod(tmp, 0o755)
        os.replace(tmp, nvml)
    link("libnvidia-ml.so.1", f"libnvidia-ml.so.{version}")
    cuda = libs / f"libcuda.so.{version}"
    if not cuda.is_file():
        cuda.write_bytes(b"")
    link("libcuda.so.1", f"libcuda.so.{version}")


def prepare(host_dir: Path, lib: Path) -> None:
    """Re-render the host's trees (device nodes on majors still free) and lay out its driver files."""
    from gpud.sim.dev_nodes import DevNodeError
    from gpud.sim.state import locked
    from gpud.sim.sysfs_tree import render

    try:
        with locked(host_dir) as st:
            render(host_dir, st)
            version = st.driver_version
    except DevNodeError as e:
        raise ExecError(str(e)) from None
    driver_files(host_dir, lib, version)


def run(host_dir: str | os.PathLike, argv: list[str], *, namespace: bool | None = None, header: str | None = None) -> int:
    """Build the library if needed and exec `argv` on the simulated host; returns only on failure."""
    from gpud.sim.nvmlc.build import BuildError, build
    from gpud.sim.state import state_path

    d = Path(host_dir).resolve()
    if not state_path(d).is_file():
        raise ExecError(f"{d}: not a simulated host (run `gpud-sim create {d} ...`)")
    if not argv:
        raise ExecError("no command given (gpud-sim exec DIR -- CMD [ARGS...])")
    try:
        lib = build(header)
    except BuildError as e:
        raise ExecError(str(e)) from None
    prepare(d, lib)
    env = environment(d, lib)
    as_root = os.geteuid() == 0
    if namespace is None:
        namespace = as_root
    if namespace:
        if not as_root:
            raise ExecError("--namespace needs root (a private mount namespace with bind mounts)")
        enter_namespace(d, warn=lambda msg: print(msg, file=sys.stderr))
    else:
        print("gpud-sim exec: no mount namespace (not root, or --no-namespace): the program sees this machine's "
              "/sys and /proc; NVML is the simulator's", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        print(f"gpud-sim exec: {argv[0]}: {e.strerror}", file=sys.stderr)
        return 127
    return 127  # not reached


def run_counted(host_dir: str | os.PathLike, argv: list[str], *, timeout: float | None = None,
                namespace: bool | None = None) -> tuple[subprocess.CompletedProcess, dict[str, int]]:
    """Run `argv` under `gpud-sim exec` and return its result with the NVML calls it made (the
    host's call counters after minus before, per C function): what a benchmark of a real tool on
    the simulated host reads. Nothing else may use the host meanwhile."""
    from gpud.sim.state import load

    before = load(host_dir).calls
    cmd = [sys.executable, "-m", "gpud.sim.cli", "exec", str(host_dir)]
    if namespace is False:
        cmd.append("--no-namespace")
    res = subprocess.run([*cmd, "--", *argv], capture_output=True, text=True, timeout=timeout)
    after = load(host_dir).calls
    return res, {k: n - before.get(k, 0) for k, n in sorted(after.items()) if n != before.get(k, 0)}
