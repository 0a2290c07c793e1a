"""The one seam between a real host and the simulator: a typed HostConfig in, the adapters and
every host path that differs between the two out.

Both entry points (the daemon and `gpud qualify`) build their host here, so a simulated host is
driven exactly as a real one is: only the adapters' roots differ. The config is a plain value and
nothing here writes to it; the defaults a real host and the simulator disagree on are resolved
into the returned Host, where the caller reads them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from gpud.device_events import DeviceEventSourceFactory
from gpud.engine.ports import Drainer, Hardware, Rebooter  # Hardware re-exported: the adapters' record
from gpud.host.kernel.deadline_write import DeadlineSysfs
from gpud.host.kernel.module_alias import ModuleAliases
from gpud.host.kernel.procs import Procs
from gpud.host.kernel.sysfs import Sysfs
from gpud.host.nvidia.gpu_reset import GpuReset
from gpud.host.nvidia.nvml import Nvml
from gpud.host.nvidia.sriov_manage import DEFAULT_PATH as SRIOV_MANAGE
from gpud.host.nvidia.sriov_manage import SriovManage
from gpud.host.nvidia.vgpu_sysfs import VgpuSysfs, names_path
from gpud.host.systemd.logind import BOOT_ID_PATH, request_reboot
from gpud.host.systemd.unit_drain import ManagerDrainer, OnDemandDrainer

__all__ = ["APPLY_LOCK", "NFD_FEATURES", "UDEV_RULES", "Hardware", "Host", "HostConfig", "adapters", "build_hardware",
           "sim_nvidia_smi"]

NFD_FEATURES = "/etc/kubernetes/node-feature-discovery/features.d/gpud"
UDEV_RULES = "/etc/udev/rules.d/70-gpud-vfio.rules"
APPLY_LOCK = "/run/gpud/apply.lock"


@dataclass(frozen=True)
class HostConfig:
    """Which host to drive and the paths a caller chose; None: the host's default."""

    sim: str | None = None  # the simulated host's directory (gpud-sim create); None: this machine
    replay: str | None = None  # with sim and read_only: NVML answers from a real GPU's capture
    read_only: bool = False
    # with sim: the simulated NVML library served from a child process (gpud.sim.nvml_process), so
    # its Python work does not hold the daemon's interpreter lock (a real driver's ioctls do not)
    sim_nvml_process: bool = False
    lock: str | None = None
    udev_rules: str | None = None
    nfd_features: str | None = None
    nvidia_smi: str | None = None
    sriov_manage: str | None = None  # NVIDIA's VF enabling script; None: its packaged path
    state_dir: str | None = None  # gpud's state directory (the vGPU type name table); None: none kept
    unbind_timeout: float = 30.0  # the deadline of an unbind and of a sysfs reset


@dataclass(frozen=True)
class Host:
    """The adapters and the resolved paths of one host (real or simulated)."""

    hw: Hardware
    device_events: DeviceEventSourceFactory  # udev, or the simulator's datagram socket
    lock_path: str
    udev_rules: str
    nfd_features: str
    dev_root: str
    boot_id_path: str
    root: str | None  # the simulated host's directory (absolute); None on a real host
    # the host's unit manager and logind: systemd's on the system bus, or the simulated host's
    # (gpud.sim.services), so nothing a simulated host does reaches the real machine's services
    drainer: Callable[[Callable[[str], None] | None], Drainer]  # called with on_event
    rebooter: Rebooter
    # how a program of NVIDIA's (nvidia-ctk) runs on this host: argv prefix and the driver root
    # it is given (a real host: as is, at /; the simulator: under `gpud-sim exec DIR`, whose NVML
    # and /proc it then reads, with DIR as the root holding the driver's files and /dev nodes)
    tool_prefix: tuple[str, ...] = ()
    driver_root: str = "/"


def build_hardware(config: HostConfig) -> Host:
    """Open the host `config` names. A replay without the simulator, or on a writable host, is
    refused here too (a capture can be read, not changed), whichever entry point asked."""
    if config.replay and not (config.sim and config.read_only):
        raise ValueError("a replay needs the simulated host and read-only: a capture can be read, not changed")
    if config.sim:
        return _simulated(config, config.sim)
    from gpud.host.kernel.udev import UdevEvents

    ro = config.read_only
    hw = adapters(config, Sysfs("/sys", read_only=ro, aliases=ModuleAliases()), Nvml(read_only=ro), Procs(read_only=ro),
                  nvidia_smi="nvidia-smi", sriov_manage=SRIOV_MANAGE)
    return Host(hw=hw, device_events=UdevEvents, lock_path=config.lock or APPLY_LOCK,
                udev_rules=config.udev_rules or UDEV_RULES, nfd_features=config.nfd_features or NFD_FEATURES,
                dev_root="/dev", boot_id_path=BOOT_ID_PATH, root=None,
                drainer=lambda on_event: OnDemandDrainer(on_event=on_event),
                rebooter=partial(request_reboot, boot_id_path=BOOT_ID_PATH))


def _simulated(config: HostConfig, sim_dir: str) -> Host:
    from gpud import sim
    from gpud.sim import modules_alias, services
    from gpud.sim.uevents import SimEvents

    host = sim.install(sim_dir, process=config.sim_nvml_process and not config.replay)
    if config.replay:
        from gpud.sim import replay_nvml

        replay_nvml.install(config.replay)
    ro = config.read_only
    hw = adapters(config, Sysfs(str(host.sys_root), read_only=ro, store=host.store, modprobe=host.modprobe,
                                aliases=ModuleAliases(str(modules_alias.path(sim_dir)))),
                  Nvml(read_only=ro, proc_root=str(host.proc_root)),
                  Procs(str(host.proc_root), str(host.dev_root), read_only=ro, store=host.store),
                  nvidia_smi=sim_nvidia_smi(sim_dir),
                  sriov_manage=_sim_tool(sim_dir, "sriov-manage", "gpud.sim.sriov_manage"))
    d = Path(sim_dir)
    boot_id = str(Path(host.proc_root) / "sys/kernel/random/boot_id")
    root = str(host.host_dir)
    return Host(hw=hw, device_events=partial(SimEvents, socket_path=host.uevent_socket),
                lock_path=config.lock or str(d / "apply.lock"),
                udev_rules=config.udev_rules or str(d / UDEV_RULES.lstrip("/")),
                nfd_features=config.nfd_features or str(d / NFD_FEATURES.lstrip("/")),
                dev_root=str(host.dev_root), boot_id_path=boot_id, root=root,
                tool_prefix=(sys.executable, "-m", "gpud.sim.cli", "exec", root, "--"), driver_root=root,
                drainer=lambda on_event: ManagerDrainer(partial(services.unit_state, root),
                                                        partial(services.job, root), on_event=on_event),
                rebooter=partial(request_reboot, boot_id_path=boot_id,
                                 logind=partial(services.reboot_requested, root)))


def adapters(config: HostConfig, sysfs: Sysfs, nvml: Nvml, procs: Procs, *,
             nvidia_smi: str | list[str], sriov_manage: str | list[str]) -> Hardware:
    """The adapters over one host's roots; the tools' paths are the config's where it names them.
    A reset of a function no nvidia driver is bound to goes through sysfs with the unbind's
    deadline (a reset waits on the device lock a stuck unbind holds)."""
    ro = config.read_only
    names = names_path(config.state_dir)
    return Hardware(sysfs=sysfs, nvml=nvml, procs=procs, vgpu=VgpuSysfs(sysfs, procs, names_file=names),
                    reset=GpuReset(config.nvidia_smi or nvidia_smi, sysfs=DeadlineSysfs(sysfs, config.unbind_timeout),
                                   read_only=ro),
                    vf_tool=SriovManage(config.sriov_manage or sriov_manage, read_only=ro))


def _sim_tool(host_dir: str, name: str, module: str) -> str | list[str]:
    """A simulated host's tool: the wrapper gpud-sim create wrote, or the module itself."""
    wrapper = Path(host_dir) / "bin" / name
    if wrapper.is_file():
        return str(wrapper)
    return [sys.executable, "-m", module, "--sim", os.path.abspath(host_dir)]


def sim_nvidia_smi(host_dir: str) -> str | list[str]:
    """The simulated host's nvidia-smi."""
    return _sim_tool(host_dir, "nvidia-smi", "gpud.sim.nvidia_smi")
