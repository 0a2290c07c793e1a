"""The simulated host's `/usr/lib/nvidia/sriov-manage -e|-d <BDF>`: NVIDIA's way to enable VFs.

    python -m gpud.sim.sriov_manage --sim DIR -e|-d <ssss:bb:dd.f>

The nvidia PCI driver has no `.sriov_configure` (open-gpu-kernel-modules kernel-open/nvidia/nv-pci.c),
so the kernel answers a `sriov_numvfs` write on a PF bound to nvidia with ENOENT. NVIDIA's script
(shipped with the vGPU host driver) goes around that; this does the same steps, each through the
simulated kernel (gpud.sim.kernel.Store), so every refusal is the kernel's or the driver's:

1. `-e` on a GPU with VFs, `-d` on one without: "GPU at X already has VFs enabled/disabled.", exit 0;
2. `-d`: each VF is unbound from its driver first;
3. the driver's unbind lock (`/proc/driver/nvidia/gpus/<BDF>/unbindLock`: write 1, read back 1),
   refused while anything holds the GPU, an NVML session of any process included:
   "Cannot obtain unbindLock for X" on stderr, exit 1, nothing changed;
4. PF unbound from nvidia, bound to `pci-pf-stub` (modprobed when missing; it has
   `sriov_configure`), `sriov_numvfs` written (sriov_totalvfs, or 0), PF unbound from the stub and
   bound to nvidia again: that rebind is a new probe, so the GPU's instances are gone (MIG mode
   stays) and NVML sessions opened earlier have lost the GPU;
5. `nvidia-smi -pm 1` (the script's resume_services): persistence mode on for every GPU;
6. `-e`: each VF bound to nvidia.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TextIO

from gpud.sim.kernel import Store, modprobe
from gpud.sim.state import load, locked
from gpud.sim.sysfs_tree import render

PF_STUB = "pci-pf-stub"
EXIT_OK, EXIT_FAILED = 0, 1


def _write(store: Store, host_dir: Path, rel: str, value: str) -> None:
    store(str(host_dir / rel), value.encode())


def _driver(host_dir: Path, bdf: str) -> str | None:
    f = load(host_dir).functions.get(bdf)
    return f.driver if f is not None and f.present else None


def _persistence_on(host_dir: Path) -> None:
    """`nvidia-smi -pm 1` with no -i: every GPU on nvidia (legacy, or through the daemon)."""
    with locked(host_dir) as st:
        mode = st.persistence if st.persistence != "off" else "legacy"
        st.persistence = mode
        for a, f in st.functions.items():
            if a in st.gpus and f.present and f.driver == "nvidia" and a not in st.persistent:
                st.persistent.append(a)
        render(host_dir, st)


def run(host_dir: str | os.PathLike, op: str, bdf: str, out: TextIO | None = None,
        err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    d = Path(os.path.abspath(host_dir))
    st = load(d)
    pf = st.functions.get(bdf.lower())
    if pf is None or not pf.present or pf.vendor != 0x10DE:
        print(f"sriov-manage: no NVIDIA device at {bdf}", file=err)
        return EXIT_FAILED
    bdf = pf.address
    v = st.vgpu.get(bdf)
    if v is None:
        return EXIT_OK  # the script's input_sanity_check: a GPU without SR-IOV is left alone, exit 0
    store = Store(d)
    if op == "-e" and v.vfs:
        print(f"GPU at {bdf} already has VFs enabled.", file=out)
        return EXIT_OK
    if op == "-d" and not v.vfs:
        print(f"GPU at {bdf} already has VFs disabled.", file=out)
        return EXIT_OK
    if PF_STUB not in {m.replace("_", "-") for m in st.loaded_modules}:
        modprobe(d, PF_STUB)
    print(f"{'Enabling' if op == '-e' else 'Disabling'} VFs on {bdf}", file=out)
    if op == "-d":
        for vf in v.vfs:
            drv = _driver(d, vf.address)
            if drv is not None:
                _write(store, d, f"sys/bus/pci/drivers/{drv}/unbind", vf.address)
    if _driver(d, bdf) == "nvidia":
        lock = f"proc/driver/nvidia/gpus/{bdf}/unbindLock"
        _write(store, d, lock, "1")
        if (d / lock).read_text().strip() != "1":
            print(f"Cannot obtain unbindLock for {bdf}", file=err)
            return EXIT_FAILED
    if (drv := _driver(d, bdf)) is not None:
        _write(store, d, f"sys/bus/pci/drivers/{drv}/unbind", bdf)
    # the script's way onto the stub (which has no id table): new_id, then bind if not grabbed
    _write(store, d, f"sys/bus/pci/drivers/{PF_STUB}/new_id", f"{pf.vendor:04x} {pf.device:04x}")
    if _driver(d, bdf) != PF_STUB:
        _write(store, d, f"sys/bus/pci/drivers/{PF_STUB}/bind", bdf)
    total = (d / f"sys/bus/pci/devices/{bdf}/sriov_totalvfs").read_text().strip()
    failed = None
    try:
        _write(store, d, f"sys/bus/pci/devices/{bdf}/sriov_numvfs", total if op == "-e" else "0")
    except OSError as e:
        failed = e  # the script goes on: the PF goes back to nvidia whatever the write said
    _write(store, d, f"sys/bus/pci/drivers/{PF_STUB}/unbind", bdf)
    _write(store, d, "sys/bus/pci/drivers/nvidia/bind", bdf)
    _persistence_on(d)
    if failed is not None:
        print(f"sriov-manage: sriov_numvfs: {failed.strerror}", file=err)
        return EXIT_FAILED
    if op == "-e":
        for vf in load(d).vgpu[bdf].vfs:
            if _driver(d, vf.address) is None:
                _write(store, d, "sys/bus/pci/drivers/nvidia/bind", vf.address)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sriov-manage", description="The simulated host's sriov-manage.")
    ap.add_argument("--sim", required=True, metavar="DIR")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("-e", metavar="BDF")
    g.add_argument("-d", metavar="BDF")
    args = ap.parse_args(argv)
    op, bdf = ("-e", args.e) if args.e else ("-d", args.d)
    try:
        return run(args.sim, op, bdf)
    except OSError as e:
        print(f"sriov-manage: {e}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
