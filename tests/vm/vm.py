"""Boots Debian's kernel under QEMU (TCG) with virtme-ng and runs a guest script of this repo.

The guest sees the host's filesystem read-only (writes go to tmpfs overlays), so the repo and its
venv run unchanged inside; results come back through a --rwdir. q35 + an emulated intel-iommu
puts 00:10.0 (e1000) and 00:10.1 (ich9 HD audio: the class of a GPU's audio function) in one
IOMMU group and 00:11.0 (e1000) alone in another.
Usage outside pytest: `python -m tests.vm.vm OUT_DIR` (what scripts/vm-run does); `--vgpu-only`
boots for the vGPU phase alone (tests/vm/guest_vgpu.py).
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time

from tests.support.present import present

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VNG_BIN = "/opt/vng/bin"
QEMU_OPTS = ("-machine q35,kernel-irqchip=split -device intel-iommu,intremap=on "
             "-device e1000,addr=0x10.0,multifunction=on -device ich9-intel-hda,addr=0x10.1 "
             "-device e1000,addr=0x11.0 "
             # an SR-IOV capable function for the vGPU phase (QEMU 7.2's nvme: sriov_max_vfs)
             "-device nvme-subsys,id=gpudsubsys -device nvme,serial=gpudsriov,subsys=gpudsubsys,addr=0x12.0,"
             "sriov_max_vfs=2,sriov_vq_flexible=4,sriov_vi_flexible=2")


def find_kernel() -> str | None:
    env = os.environ.get("GPUD_VM_KERNEL")
    if env:
        return env if os.path.exists(env) else None
    kernels = sorted(glob.glob("/boot/vmlinuz-*"))
    return kernels[-1] if kernels else None


def vng_path() -> str | None:
    path = os.pathsep.join([VNG_BIN, os.environ.get("PATH", "")])
    return shutil.which("vng", path=path)


def missing() -> list[str]:
    out = []
    if shutil.which("qemu-system-x86_64") is None:
        out.append("qemu-system-x86_64 (apt-get install qemu-system-x86)")
    if find_kernel() is None:
        out.append("a kernel in /boot (apt-get install linux-image-amd64)")
    if vng_path() is None:
        out.append("virtme-ng (python3 -m venv /opt/vng && /opt/vng/bin/pip install virtme-ng)")
    return out


def ensure_tools() -> list[str]:
    """Install what is missing (scripts/install-sysdeps, as root); returns what is still missing."""
    if missing() and os.geteuid() == 0 and os.path.exists(os.path.join(REPO, "scripts", "install-sysdeps")):
        subprocess.run([os.path.join(REPO, "scripts", "install-sysdeps")], check=False, timeout=1800)
    return missing()


def stage_mtty(out_dir: str) -> dict:
    """Build the kernel's mtty sample for the kernel the VM boots (scripts/build-mtty, cached under
    /var/cache) and copy it into the results directory, the one host directory the guest sees as it
    is (virtme-ng mounts fresh tmpfs over parts of /var)."""
    kernel = find_kernel() or ""
    kver = os.path.basename(kernel).removeprefix("vmlinuz-")
    r = subprocess.run([os.path.join(REPO, "scripts", "build-mtty"), kver], capture_output=True, text=True,
                       timeout=1800, check=False)
    built = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else ""
    if built and os.path.exists(built):
        shutil.copyfile(built, os.path.join(out_dir, "mtty.ko"))
    return {"rc": r.returncode, "module": built, "out": (r.stdout + r.stderr)[-2000:]}


def boot(out_dir: str, guest_script: str, *, timeout: float = 1500.0, python: str | None = None) -> tuple[int, str, float]:
    """One boot: run `guest_script out_dir` as root in the guest. Returns (rc, console, seconds)."""
    python = python or sys.executable
    kernel = find_kernel()
    env = dict(os.environ, PATH=os.pathsep.join([VNG_BIN, os.environ.get("PATH", "")]))
    guest_cmd = f"cd {REPO} && PYTHONPATH={REPO} {python} {guest_script} {out_dir}"
    cmd: list[str] = [present(vng_path(), "vng"), "-r", present(kernel, "a guest kernel"), "--disable-kvm", "--cpus", "2", "--memory", "1G",
           f"--rwdir={out_dir}", "--append", "intel_iommu=on", f"--qemu-opts={QEMU_OPTS}",
           "--exec", guest_cmd]
    t0 = time.monotonic()
    # its own session: on a timeout the whole tree goes (vng's QEMU child would outlive vng)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=out_dir, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        rc, console = proc.returncode, out + err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        rc, console = 124, f"{out or ''}{err or ''}\nTIMEOUT after {timeout}s"
    return rc, console, time.monotonic() - t0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = os.path.abspath(args[0] if args else "vm-out")
    os.makedirs(out, exist_ok=True)
    still = ensure_tools()
    if still:
        sys.exit("cannot boot the test VM, missing: " + "; ".join(still))
    guest = "guest_vgpu.py" if "--vgpu-only" in sys.argv else "guest_binding.py"
    print("mtty:", stage_mtty(out))
    rc, console, secs = boot(out, os.path.join(REPO, "tests", "vm", guest))
    print(console[-6000:])
    print(f"vm: rc={rc} in {secs:.0f}s; results in {out}/results.json")
    sys.exit(rc)
