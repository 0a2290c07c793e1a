"""One read of the host as a layout's `match:` selects it: sysfs and NVML (gpud.engine.observe.discovery),
each GPU's kept index (gpud.engine.observe.gpu_index) and its vGPU side.

Blocking: called in a worker thread (the observer's reads, a `check` of a candidate file) or on
the calling thread before anything is served. While a rebind runs, NVML stays closed: opening it
(nvmlInit opens every GPU) would make gpud itself the holder its unbind waits for. The last good
NVML view stands in meanwhile, marked stale, also for a read that the closing cut short.
"""

from __future__ import annotations

import msgspec

from gpud.engine.observe.discovery import Observation, observe
from gpud.engine.observe.gpu_index import GpuIndex, SetChange
from gpud.engine.ports import Hardware
from gpud.engine.vgpu.keeper import VgpuKeeper
from gpud.host.nvidia.nvml import NvmlError
from gpud.layout.schema import MatchRule
from gpud.model import Gpu, NvmlGpu


class HostReader:
    def __init__(self, hw: Hardware, vgpus: VgpuKeeper, gpu_index: GpuIndex) -> None:
        self.hw = hw
        self.vgpus = vgpus
        self.gpu_index = gpu_index
        self.set_changes: list[SetChange] = []  # seen by a read in a worker thread, said on the loop
        self._last_nvml: dict[str, NvmlGpu] = {}  # PCI -> the last NvmlGpu read without error

    def read(self, match: tuple[MatchRule, ...], *, commit: bool = False) -> Observation:
        """The host as `match` selects it, the known GPUs missing from the bus in `gone`. Only
        `commit` (reads of the layout in force) makes the index map take new GPUs and records a
        change of the GPU set; a `check` of a candidate file remembers nothing."""
        obs = self._read_functions(match)
        on_bus = {f.address for f in obs.functions}
        gpus, gone, change = self.gpu_index.assign(obs.gpus, on_bus, commit=commit)
        if commit and change:
            self.set_changes.append(change)  # list.append is atomic: this runs in a worker thread
        # a candidate's read is judged for itself, and leaves the daemon's judgement as it was
        problem = self.gpu_index.index_problem if commit else self.gpu_index.verdict({g.pci for g in gpus}, on_bus)[1]
        return msgspec.structs.replace(obs, gpus=gpus, gone=gone, index_problem=problem)

    def _read_functions(self, match: tuple[MatchRule, ...]) -> Observation:
        for _ in range(2):  # a read that a whole suspend/resume cut short is read again, once
            if self.hw.nvml.suspended:
                break
            obs = observe(self.hw.sysfs, self.hw.nvml, match)
            if self.hw.nvml.suspended:  # closed under us while reading
                break
            if obs.nvml_error is None:
                self._last_nvml = {g.pci: g.nvml for g in obs.gpus if g.nvml is not None}
                return self._with_vgpus(obs)
        else:
            return obs  # NVML is really unavailable (no driver): status says so
        obs = observe(self.hw.sysfs, None, match)
        gpus = tuple(msgspec.structs.replace(g, nvml=self._last_nvml.get(g.pci)) if g.function.driver == "nvidia"
                     else g for g in obs.gpus)
        return self._with_vgpus(msgspec.structs.replace(obs, gpus=gpus, nvml_stale=True))

    def read_gpu(self, gpu: Gpu) -> Gpu | None:
        """`gpu` with its NVML side read again and nothing else (after the engine changed its MIG
        layout, which changes no PCI function): None when NVML cannot give it now (closed for a
        rebind, the GPU gone from it), and then the caller reads the whole host."""
        if gpu.function.driver != "nvidia" or self.hw.nvml.suspended:
            return None
        try:
            nv = self.hw.nvml.gpu(gpu.pci)
        except NvmlError:
            return None
        if nv is None or self.hw.nvml.suspended:
            return None
        self._last_nvml[gpu.pci] = nv
        return self.vgpus.observe(msgspec.structs.replace(gpu, nvml=nv))

    def _with_vgpus(self, obs: Observation) -> Observation:
        """Each GPU's vGPU side, from sysfs (either interface, found per GPU)."""
        return msgspec.structs.replace(obs, gpus=tuple(self.vgpus.observe(g) for g in obs.gpus))
