"""The rendered tree looks like the real H200's sysfs and /proc, and renders are incremental."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

from gpud.host.kernel.procs import Procs
from gpud.host.kernel.sysfs import Sysfs
from gpud.sim.state import SimCi, SimFunction, SimGi, SimGpu, SimProcess, SimState
from gpud.sim.sysfs_tree import cap_minor, render
from tests.support.sim_kernel_host import AUDIO, GPU, NOGROUP, UUID, make_host, make_state

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures/h200/nvml-sysfs-readonly.json"


def _fixture():
    return json.loads(FIXTURE.read_text())


def test_device_attributes_match_real_h200(tmp_path):
    d = make_host(tmp_path)
    real = _fixture()["sysfs_pci_device"]
    dev = Path(d, "sys/devices/pci0000:00", NOGROUP)  # same address as the fixture host's GPU
    for attr in ("vendor", "device", "subsystem_vendor", "subsystem_device", "class", "revision",
                 "driver_override", "numa_node", "modalias", "reset_method", "power_state", "enable",
                 "d3cold_allowed", "current_link_speed", "current_link_width"):
        assert (dev / attr).read_text() == real[attr] + "\n", attr
    assert (dev / "uevent").read_text() == real["uevent"] + "\n"
    assert "-> " + os.readlink(dev / "driver") == real["driver"]
    assert "-> " + os.readlink(dev / "subsystem") == real["subsystem"]
    for attr in ("reset", "remove", "rescan"):
        assert (dev / attr).stat().st_mode & 0o777 == 0o200


def test_kernel_style_links(tmp_path):
    d = make_host(tmp_path)
    sys = Path(d, "sys")
    assert os.readlink(sys / "bus/pci/devices" / GPU) == f"../../../devices/pci0000:00/{GPU}"
    assert os.readlink(sys / "devices/pci0000:00" / GPU / "iommu_group") == "../../../kernel/iommu_groups/20"
    assert (sys / "bus/pci/devices" / GPU / "iommu_group").resolve() == (sys / "kernel/iommu_groups/20").resolve()
    assert (sys / "kernel/iommu_groups/20/devices" / AUDIO).resolve() == (sys / "devices/pci0000:00" / AUDIO).resolve()
    assert (sys / "bus/pci/drivers/nvidia" / GPU).resolve() == (sys / "devices/pci0000:00" / GPU).resolve()
    assert (sys / "bus/pci/devices" / AUDIO / "driver").resolve() == (sys / "bus/pci/drivers/snd_hda_intel").resolve()
    assert not (sys / "devices/pci0000:00" / NOGROUP / "iommu_group").exists()
    assert not (sys / "bus/pci/drivers/vfio-pci").exists()
    assert sorted(os.listdir(sys / "bus/pci/drivers")) == ["nvidia", "snd_hda_intel"]
    for f in ("bind", "unbind", "new_id", "remove_id"):
        assert (sys / "bus/pci/drivers/nvidia" / f).is_file()
    assert (sys / "bus/pci/drivers_probe").is_file() and (sys / "bus/pci/rescan").is_file()


def test_adapter_parses_rendered_functions(tmp_path):
    d = make_host(tmp_path)
    fns = Sysfs(os.path.join(d, "sys")).functions()
    assert [f.address for f in fns] == [NOGROUP, GPU, AUDIO, "0000:5d:00.0"]
    g = fns[1]
    assert (g.pci_id, g.class_code, g.driver, g.driver_override, g.iommu_group, g.numa_node) == (
        "10de:2335", 0x030200, "nvidia", None, 20, -1)
    assert fns[0].iommu_group is None


def test_proc_information_format_and_minor(tmp_path):
    d = make_host(tmp_path)
    info = Path(d, "proc/driver/nvidia/gpus", GPU, "information").read_text()
    real = _fixture()["proc_and_dev"]["ls -la /proc/driver/nvidia/gpus/ && cat /proc/driver/nvidia/gpus/*/information"]
    keys = re.findall(r"^([A-Za-z ]+):", real[real.index("Model:"):], re.M)
    assert re.findall(r"^([A-Za-z ]+):", info, re.M) == keys
    assert f"GPU UUID: \t {UUID}\n" in info and "Device Minor: \t 0\n" in info
    assert "Model: \t\t NVIDIA H200\n" in info
    procs = Procs(os.path.join(d, "proc"), os.path.join(d, "dev"))
    assert [procs.nvidia_minor(a) for a in (GPU, "0000:5d:00.0", AUDIO)] == [0, 1, None]
    assert Path(d, "proc/driver/nvidia/gpus", GPU, "unbindLock").read_text() == "0\n"
    assert Path(d, "dev/nvidiactl").exists() and Path(d, "dev/nvidia-caps/nvidia-cap1").exists()


def test_holders_of_gpu_and_mig_device(tmp_path):
    st = make_state()
    mig = "MIG-aaaaaaaa-0000-0000-0000-000000000001"
    st.gpus[GPU].mig_mode = 1
    st.gpus[GPU].gis = [SimGi(2, 14, 2, 2, [SimCi(0, 1, mig)])]
    st.processes = [SimProcess(100, "trainer-with-a-very-long-name", mig), SimProcess(200, "dcgm", UUID)]
    d = make_host(tmp_path, st)
    gi_cap, ci_cap = cap_minor(0, 2), cap_minor(0, 2, 0)
    assert Path(d, f"dev/nvidia-caps/nvidia-cap{ci_cap}").exists()
    procs = Procs(os.path.join(d, "proc"), os.path.join(d, "dev"))
    assert procs.mig_cap_minor(0, 2, 0) == ci_cap and procs.mig_cap_minor(0, 2) == gi_cap == 3 + 2 * 9
    found = procs.holders(["/dev/nvidia0", f"/dev/nvidia-caps/nvidia-cap{ci_cap}", "/dev/nvidia1"])
    assert [(h.pid, h.name, h.device) for h in found] == [
        (100, "trainer-with-a-", f"/dev/nvidia-caps/nvidia-cap{ci_cap}"),
        (100, "trainer-with-a-", "/dev/nvidia0"),
        (200, "dcgm", "/dev/nvidia0"),
    ]


def _snapshot(root: str) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_ino, st.st_mtime_ns)
    return out


def _eight_gpus() -> SimState:
    st = SimState(loaded_modules=["nvidia"])
    for i in range(8):
        a = f"0000:{0x18 + i * 0x10:02x}:00.0"
        st.functions[a] = SimFunction(a, 0x10DE, 0x2335, 0x10DE, 0x18BF, 0x030200, native_driver="nvidia",
                                      driver="nvidia", iommu_group=i + 10, numa_node=i // 4)
        st.gpus[a] = SimGpu(a, "h200", f"GPU-{i:08x}-0000-0000-0000-000000000000", i)
    return st


def test_render_is_incremental(tmp_path):
    st = _eight_gpus()
    d = make_host(tmp_path, st)
    before = _snapshot(d)
    render(d, st)
    assert _snapshot(d) == before  # nothing rewritten
    a = "0000:38:00.0"
    st.functions[a].driver = None
    render(d, st)
    after = _snapshot(d)
    changed = {p for p in before.keys() & after.keys() if before[p] != after[p]}
    removed = before.keys() - after.keys()
    assert changed <= {f"sys/devices/pci0000:00/{a}/uevent", "sys/bus/pci/drivers/nvidia", "dev",
                       "proc/driver/nvidia/gpus", f"sys/devices/pci0000:00/{a}"}
    assert f"sys/devices/pci0000:00/{a}/uevent" in changed
    assert removed == {f"sys/devices/pci0000:00/{a}/driver", f"sys/bus/pci/drivers/nvidia/{a}", "dev/nvidia2",
                       f"proc/driver/nvidia/gpus/{a}", f"proc/driver/nvidia/gpus/{a}/information",
                       f"proc/driver/nvidia/gpus/{a}/unbindLock"}
    assert not any(".tmp" in p for p in after)


def _contents(root: str) -> dict[str, tuple]:
    """Every entry under sys/, dev/ and proc/: (kind, what it holds, mode)."""
    out: dict[str, tuple] = {}
    for top in ("sys", "dev", "proc"):
        for dirpath, dirs, files in os.walk(os.path.join(root, top)):
            for n in dirs + files:
                p = os.path.join(dirpath, n)
                st = os.lstat(p)
                rel = os.path.relpath(p, root)
                if os.path.islink(p):
                    out[rel] = ("l", os.readlink(p))
                elif os.path.isdir(p):
                    out[rel] = ("d",)
                elif stat.S_ISCHR(st.st_mode):
                    out[rel] = ("c", st.st_rdev, st.st_mode & 0o7777)
                else:
                    out[rel] = ("f", Path(p).read_bytes(), st.st_mode & 0o7777)
    return out


def test_renders_after_changes_leave_the_tree_a_fresh_render_makes(tmp_path):
    # a render in the process that rendered last writes only what changed (its cached tree):
    # after a run of changes, the tree equals one laid out afresh from the final state
    st = _eight_gpus()
    d = make_host(tmp_path / "a", st)
    gpu = st.gpus["0000:18:00.0"]
    gpu.mig_mode = True
    gpu.gis.append(SimGi(id=1, profile_id=19, start=0, size=1, cis=[SimCi(id=0, profile_id=0, uuid=UUID)]))
    render(d, st)
    st.functions["0000:38:00.0"].driver = None  # unbound: its links, node and /proc entries go
    render(d, st)
    st.processes.append(SimProcess(pid=100, name="trainer", device=UUID))
    render(d, st)
    st.functions["0000:38:00.0"].driver = "vfio-pci"
    st.loaded_modules.append("vfio_pci")
    gpu.gis[0].cis.clear()
    st.processes.clear()
    render(d, st)
    assert _contents(d) == _contents(make_host(tmp_path / "b", st))


def test_a_render_after_another_process_rendered_reads_the_tree_again(tmp_path):
    st = _eight_gpus()
    d = make_host(tmp_path, st)  # this process rendered last: it keeps the tree it wrote
    other = textwrap.dedent("""
        import sys
        from gpud.sim.state import locked
        from gpud.sim.sysfs_tree import render
        with locked(sys.argv[1]) as st:
            st.functions["0000:38:00.0"].driver = None
            render(sys.argv[1], st)
    """)
    subprocess.run([sys.executable, "-c", other, d], check=True, cwd=Path(__file__).resolve().parents[2])
    assert not os.path.lexists(os.path.join(d, "sys/bus/pci/drivers/nvidia/0000:38:00.0"))
    render(d, st)  # this process's state still has the GPU on nvidia: the tree must say so again
    assert _contents(d) == _contents(make_host(tmp_path / "fresh", st))
