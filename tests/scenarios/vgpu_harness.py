"""Runs a vGPU scenario on a fresh simulated host through gpud's vGPU pipeline (sysfs adapter ->
planner -> executor, the rounds the engine makes) and reads the results from the simulator's state
file. Every sysfs write goes through a counting wrapper of the simulated kernel's store."""

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
from gpud.sim.catalog import gpu_address
from gpud.sim.cli import create, hold, release
from gpud.sim.state import SimGi, load, locked
from gpud.sim.sysfs_tree import render
from gpud.vgpu_types import by_device
from tests.scenarios.vgpu_definitions import Step, VgpuScenario
from tests.support.present import present

VM_PID = 4100


class CountingStore:
    def __init__(self, store):
        self.store = store
        self.writes = 0

    def __call__(self, path, data):
        self.writes += 1
        return self.store(path, data)


def sim_devices(d: Path, pf: str) -> dict[str, str]:
    """identity (VF address or mdev UUID) -> type name, from the simulator's state file."""
    st = load(d)
    v = st.vgpu[pf]
    types = sim_vgpu.sim_types(present(sim_vgpu.vgpu_model(st, pf)))
    by_vfio = {t.vfio_id: t.name for t in types}
    by_mdev = {t.mdev_id: t.name for t in types}
    out = {vf.address: by_vfio[vf.vgpu_type] for vf in v.vfs if vf.vgpu_type}
    out.update({m.uuid: by_mdev[m.type_id] for m in v.mdevs})
    return out


class VgpuRig:
    def _place_gis(self) -> None:
        """The scenario's MIG layer, as the engine's MIG steps leave it: mode on, its instances. The
        engine makes the instances after the VFs (enabling them destroys instances), and so does this."""
        if not self.sc.mig:
            return
        with locked(self.dir) as st:
            gpu = st.gpus[self.pf]
            gpu.mig_mode = gpu.mig_pending = 1
            if not gpu.gis:
                gpu.gis = [SimGi(id=i, profile_id=p, start=s, size=1 if p == 19 else 4) for i, p, s in self.sc.mig]
            render(self.dir, st)

    def __init__(self, base: Path, sc: VgpuScenario):
        self.dir = base / sc.name
        self.sc = sc
        create(self.dir, list(sc.models), vgpu=sc.interface)
        self.pf = gpu_address(sc.gpu)
        self._place_gis()
        h = sim_paths(self.dir)
        self.store = CountingStore(h.store)
        self.sysfs = Sysfs(str(h.sys_root), store=self.store, dev_root=str(h.dev_root))
        self.procs = Procs(str(h.proc_root), str(h.dev_root))
        self.record = VgpuRecord()
        self.vgpu = VgpuSysfs(self.sysfs, self.procs, names_file=str(self.dir / "vgpu-names.json"))
        self.held: list[str] = []

    def devices(self) -> dict[str, str]:
        return sim_devices(self.dir, self.pf)

    def num_vfs(self) -> int:
        return len(load(self.dir).vgpu[self.pf].vfs)

    def prepare(self, step: Step) -> None:
        """What happens to the host before a step: a VM opens a vGPU, lets go, or the host reboots."""
        if step.release:
            for dev in self.held:
                release(self.dir, dev, VM_PID)
            self.held = []
        if step.hold is not None:
            vtype, nth = step.hold
            dev = sorted(i for i, t in self.devices().items() if t == vtype)[nth]
            hold(self.dir, dev, VM_PID, vm="vm-1")
            self.held.append(dev)
        if step.reboot:
            with locked(self.dir) as st:
                sim_vgpu.clear_for_reboot(st)
                render(self.dir, st)
            self.held = []
            # a new daemon: the names and the record come back from its state directory
            self.vgpu = VgpuSysfs(self.sysfs, self.procs, names_file=str(self.dir / "vgpu-names.json"))

    def gpud_apply(self, step: Step) -> VgpuPlan:
        """The engine's rounds for one GPU: plan, run, re-read, until nothing is left to do."""
        st = load(self.dir)
        model = by_device(st.functions[self.pf].device)
        desired = DesiredGpu(pci=self.pf, index=self.sc.gpu, entry="layouts.x[0]", workload=step.workload,
                             vgpu_devices=dict(step.types))
        plan = None
        for _ in range(4):
            gi_profiles = sim_vgpu._gi_profile_names(load(self.dir), self.pf) if self.sc.mig else None
            plan = plan_vgpu(pci=self.pf, index=self.sc.gpu, gpu_key=st.gpus[self.pf].uuid, where=self.pf,
                             state=self.vgpu.read(self.pf), desired=desired, model=model, record=self.record,
                             gi_profiles=gi_profiles)
            if plan.infeasible or plan.blocked_by or not plan.steps:
                return plan
            out = execute(self.vgpu, plan, self.record, vf_tool=SriovManage(str(self.dir / "bin" / "sriov-manage")))
            if any(s.action == "enable-vfs" for s in plan.steps):
                self._place_gis()
            if out.state != "done":
                raise AssertionError(f"{self.sc.name}: executor {out.state}: {out.message}")
        return present(plan, "a plan")


def outcome(plan: VgpuPlan) -> str:
    if plan.infeasible:
        return "infeasible"
    if plan.blocked_by:
        return "blocked"
    return "done"
