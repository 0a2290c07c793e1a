"""One simulated vGPU-capable GPU driven by gpud's own vGPU planner and executor (the engine's
rounds without the engine), its result read back from the simulator's state file."""

from __future__ import annotations

from pathlib import Path

from gpud.engine.vgpu.executor import execute
from gpud.host.kernel.procs import Procs
from gpud.host.kernel.sysfs import Sysfs
from gpud.host.nvidia.sriov_manage import SriovManage
from gpud.host.nvidia.vgpu_sysfs import VgpuSysfs
from gpud.layout.desired import DesiredGpu
from gpud.plan.vgpu import VgpuPlan, VgpuRecord, plan_vgpu
from gpud.sim import host as sim_paths
from gpud.sim import vgpu as sim_vgpu
from gpud.sim.state import load
from gpud.vgpu_types import by_device
from tests.support.present import present


def adapter(d: Path) -> VgpuSysfs:
    """gpud's vGPU adapter on the simulated host in `d`."""
    h = sim_paths(d)
    fs = Sysfs(str(h.sys_root), store=h.store, dev_root=str(h.dev_root))
    return VgpuSysfs(fs, Procs(str(h.proc_root), str(h.dev_root)), names_file=str(d / "names.json"))


def sim_vgpus(host: Path, pf: str) -> list[tuple[str, str]]:
    """(type, VF or mdev UUID) of the GPU at `pf`, from the simulator's state file."""
    st = load(host)
    types = sim_vgpu.sim_types(present(sim_vgpu.vgpu_model(st, pf)))
    by_vfio = {t.vfio_id: t.name for t in types}
    by_mdev = {t.mdev_id: t.name for t in types}
    v = st.vgpu[pf]
    return sorted([(by_vfio[vf.vgpu_type], vf.address) for vf in v.vfs if vf.vgpu_type]
                  + [(by_mdev[m.type_id], m.uuid) for m in v.mdevs])


def want(pci: str, types: dict[str, int], workload: str = "vm-vgpu") -> DesiredGpu:
    return DesiredGpu(pci=pci, index=0, entry="layouts.x[0]", workload=workload, vgpu_devices=types)


class Host:
    """The GPU at `pf` on the simulated host in `d`, through gpud's vGPU adapter."""

    def __init__(self, d: Path, pf: str) -> None:
        self.dir, self.pf = d, pf
        self.vgpu = adapter(d)
        self.record = VgpuRecord()
        self.writes = 0

    def gi_profiles(self) -> dict[int, str]:
        st = load(self.dir)
        return sim_vgpu._gi_profile_names(st, self.pf)

    def apply(self, types: dict[str, int], workload: str = "vm-vgpu", mig: bool = False) -> VgpuPlan | None:
        """Up to three rounds (enable VFs, then vGPUs), as the engine does; returns the last plan."""
        plan: VgpuPlan | None = None
        for _ in range(3):
            state = self.vgpu.read(self.pf)
            plan = plan_vgpu(pci=self.pf, index=0, gpu_key=self.pf, where=self.pf, state=state,
                             desired=want(self.pf, types, workload), model=by_device(load(self.dir).functions[self.pf].device),
                             record=self.record, gi_profiles=self.gi_profiles() if mig else None)
            if plan.infeasible or plan.blocked_by or not plan.steps:
                return plan
            out = execute(self.vgpu, plan, self.record, on_step=lambda s: self._count(),
                          vf_tool=SriovManage(str(self.dir / "bin" / "sriov-manage")))
            assert out.state == "done", out.message
        return plan

    def _count(self) -> None:
        self.writes += 1

    def devices(self) -> list[tuple[str, str]]:
        """(type name, uuid or VF) from the simulator's state file."""
        return sim_vgpus(self.dir, self.pf)
