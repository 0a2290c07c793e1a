"""A simulated host driven by gpud's own reconciler, in process: what the daemon does, minus the
socket, so scenarios can look at every step, count NVML calls and compare MIG UUIDs."""

from __future__ import annotations

import asyncio
import subprocess
from collections import Counter
from pathlib import Path

import pynvml

from gpud import sim
from gpud.engine.apply_lock import ApplyLock
from gpud.engine.events import EventBus
from gpud.engine.ports import Clock, Hardware, SystemClock
from gpud.engine.reconciler import Reconciler
from gpud.host.kernel.deadline_write import DeadlineSysfs
from gpud.host.kernel.procs import Procs
from gpud.host.kernel.sysfs import Sysfs
from gpud.host.nvidia.gpu_reset import GpuReset
from gpud.host.nvidia.nvml import Nvml
from gpud.host.nvidia.vgpu_sysfs import VgpuSysfs, names_path
from gpud.profiles import MODELS
from gpud.sim import cli as simcli
from gpud.sim import state as simstate

MUTATING = (
    "nvmlDeviceSetMigMode",
    "nvmlDeviceCreateGpuInstance",
    "nvmlDeviceCreateGpuInstanceWithPlacement",
    "nvmlGpuInstanceCreateComputeInstance",
    "nvmlGpuInstanceCreateComputeInstanceWithPlacement",
    "nvmlComputeInstanceDestroy",
    "nvmlGpuInstanceDestroy",
)

# NVML's compute instance profile constants -> slices (NVML_COMPUTE_INSTANCE_PROFILE_<N>_SLICE).
_CI_SLICES = {getattr(pynvml, n): int(n.split("_")[-2]) for n in dir(pynvml)
              if n.startswith("NVML_COMPUTE_INSTANCE_PROFILE_") and n.endswith("_SLICE")}


class _Resets:
    """GPU resets the simulated kernel carried out since the last `clear()`."""

    def __init__(self, host_dir: Path) -> None:
        self.dir, self.base = host_dir, Counter[str]()

    def _now(self) -> Counter[str]:
        return Counter({pci: sum(by_method.values()) for pci, by_method in simstate.load(self.dir).resets.items()})

    def clear(self) -> None:
        self.base = self._now()

    def values(self):
        return (self._now() - self.base).values()

    def __repr__(self) -> str:
        return repr(self._now() - self.base)


class SimRig:
    def __init__(self, tmp: Path, gpus: tuple[str, ...], *, nvswitch: bool = False, persistence: str = "legacy",
                 fabric_manager: str = "running", persistenced_socket: str = "reachable", clock: Clock | None = None,
                 **reconciler_kw) -> None:
        self.dir = tmp / "host"
        simcli.create(self.dir, list(gpus), nvswitch=nvswitch, persistence=persistence, fabric_manager=fabric_manager,
                      persistenced_socket=persistenced_socket)
        self.host = sim.install(self.dir)
        self.config = tmp / "layout.yaml"
        self.resets = _Resets(self.dir)
        sysfs = Sysfs(str(self.host.sys_root), store=self.host.store, modprobe=self.host.modprobe)
        procs = Procs(str(self.host.proc_root), str(self.host.dev_root), store=self.host.store)
        state_dir = reconciler_kw.get("state_dir")
        self.hw = Hardware(  # as gpud.hardware.adapters builds them, without sriov-manage (VFs are not changed)
            sysfs=sysfs,
            nvml=Nvml(proc_root=str(self.host.proc_root)),
            procs=procs,
            vgpu=VgpuSysfs(sysfs, procs, names_file=names_path(state_dir)),
            reset=GpuReset(str(self.dir / "bin" / "nvidia-smi"),
                           sysfs=DeadlineSysfs(sysfs, reconciler_kw.get("binder_timeout", 30.0))),
            clock=clock or SystemClock(),
        )
        self.hw.nvml.open()
        self.bus = EventBus()
        self.rec = Reconciler(self.hw, config_path=str(self.config), apply_lock=ApplyLock(self.dir / "apply.lock"),
                              bus=self.bus, **reconciler_kw)
        self.children: list[subprocess.Popen] = []

    def new_process(self, state_dir: str | None) -> None:
        """What a new gpud process starts with: its own NVML session and event bus, and the vGPU
        name table read again from `state_dir`; the caller builds its reconciler."""
        self.hw.nvml.close()
        self.hw.nvml.open()
        self.hw.vgpu = VgpuSysfs(self.hw.sysfs, self.hw.procs,
                                 names_file=names_path(state_dir))
        self.bus = EventBus()

    def close(self) -> None:
        for c in self.children:
            c.kill()
            c.wait()
        self.hw.nvml.close()
        sim.uninstall()

    async def apply(self, text: str) -> bool:
        self.config.write_text(text)
        ok = self.rec.load_config()
        if ok:
            await self.rec.converge()
        return ok

    def calls(self) -> Counter[str]:
        return Counter(simstate.load(self.dir).calls)

    def read_spy(self) -> list[str]:
        """From now on, every GPU the NVML adapter reads, by PCI address ("*" for a read of all)."""
        seen: list[str] = []
        nvml = self.hw.nvml
        gpus, gpu = nvml.gpus, nvml.gpu

        def all_gpus(**kw):
            seen.append("*")
            return gpus(**kw)

        def one_gpu(pci, **kw):
            seen.append(pci)
            return gpu(pci, **kw)

        nvml.gpus, nvml.gpu = all_gpus, one_gpu  # type: ignore[method-assign]
        return seen

    def mutating(self, before: Counter[str]) -> int:
        after = self.calls()
        return sum(after[f] - before[f] for f in MUTATING)

    def mig_devices(self) -> dict[int, dict[str, tuple[str, int, int]]]:
        """GPU index -> {MIG UUID: (device name, GI start, CI id)}; {} for a GPU with MIG off.

        Read from the simulator's own state file, not through gpud's NVML adapter, so a scenario
        checks what the (simulated) hardware holds, not what gpud believes it holds. GPU indices
        are PCI-address order over every GPU; the GI name is the catalog's name of its profile id,
        a CI's slice count is NVML's CI profile constant (nvml.h NVML_COMPUTE_INSTANCE_PROFILE_*)."""
        state = simstate.load(self.dir)
        out: dict[int, dict[str, tuple[str, int, int]]] = {}
        for index, address in enumerate(sorted(state.gpus)):
            gpu = state.gpus[address]
            names = {p.id: (p.name, p.slices) for p in MODELS[gpu.model].profiles}
            devs: dict[str, tuple[str, int, int]] = {}
            for gi in gpu.gis if gpu.mig_mode == 1 else ():
                gi_name, gi_slices = names[gi.profile_id]
                for ci in gi.cis:
                    ci_slices = _CI_SLICES[ci.profile_id]
                    name = gi_name if ci_slices >= gi_slices else f"{ci_slices}c.{gi_name}"
                    devs[ci.uuid] = (name, gi.start, ci.id)
            out[index] = devs
        return out

    def mig_mode(self, index: int) -> int:
        """The current MIG mode of the GPU at `index`, from the simulator's state file."""
        state = simstate.load(self.dir)
        return state.gpus[sorted(state.gpus)[index]].mig_mode

    def hold(self, mig_uuid: str, name: str = "train.py") -> subprocess.Popen:
        """A real process, registered as the holder of a MIG device: when it exits, NVML stops
        listing it, as on a real host."""
        child = subprocess.Popen(["sleep", "600"])
        self.children.append(child)
        simcli.hold(self.dir, mig_uuid, child.pid, name)
        return child

    async def wait_state(self, pci: str, states: set[str], timeout: float = 30.0) -> str:
        """Wait for the engine to conclude one of `states` for a GPU (event driven: bus subscription)."""
        q = self.bus.subscribe()
        try:
            async def _wait() -> str:
                while True:
                    st = self.rec.gpu_states.get(pci)
                    if st is not None and st.state in states:
                        return st.state
                    await q.get()
            return await asyncio.wait_for(_wait(), timeout)
        finally:
            self.bus.unsubscribe(q)
