"""gpud.hardware: the one seam between a real host and the simulator. The expected paths are
spelled out here from the simulated host's directory (gpud-sim's own layout), not taken from
the module under test."""

from __future__ import annotations

import dataclasses
import os

import pytest

from gpud import sim
from gpud.hardware import HostConfig, build_hardware
from gpud.sim.cli import create
from tests.support.present import present


@pytest.fixture
def sim_dir(tmp_path):
    d = tmp_path / "host"
    create(d, ["h200"], [])
    yield d
    sim.uninstall()


def test_a_simulated_host_resolves_every_path_under_its_directory(sim_dir):
    host = build_hardware(HostConfig(sim=str(sim_dir), read_only=True))
    root = os.path.realpath(sim_dir)
    assert host.root == root
    assert host.lock_path == f"{sim_dir}/apply.lock"
    assert host.udev_rules == f"{sim_dir}/etc/udev/rules.d/70-gpud-vfio.rules"
    assert host.nfd_features == f"{sim_dir}/etc/kubernetes/node-feature-discovery/features.d/gpud"
    assert host.dev_root == f"{root}/dev"
    assert host.boot_id_path == f"{root}/proc/sys/kernel/random/boot_id"
    assert (host.hw.sysfs.root, host.hw.procs.dev_root, host.hw.nvml.proc_root) == (
        f"{root}/sys", f"{root}/dev", f"{root}/proc")
    assert host.hw.sysfs.read_only and host.hw.procs.read_only and host.hw.nvml.read_only
    # the simulator's own NVML answers: the GPU gpud-sim created
    host.hw.nvml.open()
    try:
        assert len(host.hw.nvml.gpus()) == 1
    finally:
        host.hw.nvml.close()


def test_paths_the_caller_chose_are_kept(sim_dir, tmp_path):
    chosen = HostConfig(sim=str(sim_dir), lock=str(tmp_path / "l"), udev_rules=str(tmp_path / "u"),
                        nfd_features=str(tmp_path / "n"), nvidia_smi="/bin/false")
    before = dataclasses.replace(chosen)
    host = build_hardware(chosen)
    assert (host.lock_path, host.udev_rules, host.nfd_features) == (
        str(tmp_path / "l"), str(tmp_path / "u"), str(tmp_path / "n"))
    assert present(host.hw.reset).command == ["/bin/false"]
    assert chosen == before


def test_a_real_host_takes_the_system_paths():
    host = build_hardware(HostConfig(read_only=True))  # builds adapters; opens nothing
    assert (host.root, host.dev_root, host.lock_path) == (None, "/dev", "/run/gpud/apply.lock")
    assert host.udev_rules == "/etc/udev/rules.d/70-gpud-vfio.rules"
    assert host.boot_id_path == "/proc/sys/kernel/random/boot_id"
    assert host.hw.sysfs.root == "/sys"


@pytest.mark.parametrize("config", [HostConfig(replay="capture.json"),
                                    HostConfig(replay="capture.json", sim="/nonexistent"),
                                    HostConfig(replay="capture.json", read_only=True)])
def test_a_replay_is_refused_unless_simulated_and_read_only(config):
    with pytest.raises(ValueError, match="replay"):
        build_hardware(config)


def test_the_daemon_reads_its_arguments_without_changing_them(sim_dir):
    from gpud.daemon import host_config, parse_args

    args = parse_args(["--sim", str(sim_dir), "--read-only", "--lock", "/x/apply.lock"])
    before = dict(vars(args))
    config = host_config(args)
    build_hardware(config)
    assert vars(args) == before
    assert config == HostConfig(sim=str(sim_dir), read_only=True, sim_nvml_process=True, lock="/x/apply.lock",
                                state_dir="/var/lib/gpud")


@pytest.mark.parametrize("entry", ["daemon", "qualify"])
def test_both_entry_points_give_the_reset_their_unbind_deadline(sim_dir, entry):
    """A reset off nvidia goes through sysfs like an unbind: with the deadline the command line
    gives (`--unbind-timeout`), whichever entry point opened the host."""
    if entry == "daemon":
        from gpud.daemon import host_config, parse_args

        host = build_hardware(host_config(parse_args(["--sim", str(sim_dir), "--unbind-timeout", "7"])))
    else:
        from gpud.qualify.main import _hardware
        from gpud.qualify.main import parse_args as qualify_args

        host = _hardware(qualify_args(["--sim", str(sim_dir), "--unbind-timeout", "7"]), read_only=True)
    assert host.hw.reset is not None
    assert host.hw.reset.sysfs._timeout == 7.0
