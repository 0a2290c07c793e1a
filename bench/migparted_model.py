"""A faithful model of nvidia-mig-parted's apply strategy, run against the same simulated NVML.

From shared/reference (anchors.md, mig-facts.md) and mig-parted's documented behaviour:
1. Mode: if any GPU in the config needs a MIG mode change, every MIG-enabled GPU in the config is
   cleared (all CIs and GIs destroyed), the modes are set, and *all* GPUs in the config are reset
   (NVML shut down, one `nvidia-smi -r -i <ids>`: the simulated host's, which refuses while held).
2. Per GPU whose current MIG devices (counted by name) differ from the config: destroy every CI
   and GI, then create the devices one at a time *without placements* (the driver picks the slot
   by its preference order), trying permutations of the creation order until one succeeds
   (destroying everything again after each failed attempt; n! orders in the worst case).
3. Each MIG device is one GI with one CI: `1c.3g.40gb: 3` means three 3g GIs.
4. No busy check: a destroy on an instance in use fails with IN_USE and the apply fails.
"""

from __future__ import annotations

import itertools
import subprocess
from collections import Counter
from ctypes import byref, c_uint

import pynvml as N

from gpud.layout.names import parse_mig_name
from gpud.profiles import CI_PROFILE_ID, GI_PROFILE_INDEX

MAX_ORDERS = 5040  # 7!: mig-parted gives up after trying every order


class MigPartedFailed(Exception):
    pass


def _handle(pci: str):
    for i in range(N.nvmlDeviceGetCount()):
        h = N.nvmlDeviceGetHandleByIndex(i)
        bus = N.nvmlDeviceGetPciInfo(h).busId
        bus = bus.decode() if isinstance(bus, bytes) else bus
        if bus.lower().endswith(pci.lower()[-7:]) and int(bus.split(":")[0], 16) == int(pci.split(":")[0], 16):
            return h
    raise KeyError(pci)


def _list(fn, ctype, parent, profile_id: int, most: int) -> list:
    """NVML's caller-allocated listing: an array of `most` handles and a count."""
    arr = (ctype * max(1, most))()
    count = c_uint(0)
    fn(parent, profile_id, arr, byref(count))
    return [arr[i] for i in range(count.value)]


def _clear(h) -> None:
    for pid in GI_PROFILE_INDEX:
        try:
            info = N.nvmlDeviceGetGpuInstanceProfileInfo(h, GI_PROFILE_INDEX[pid])
        except N.NVMLError:
            continue
        for gi in _list(N.nvmlDeviceGetGpuInstances, N.c_nvmlGpuInstance_t, h, info.id, info.instanceCount):
            for ci_idx in CI_PROFILE_ID.values():
                try:
                    ci_info = N.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, ci_idx, N.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
                    cis = _list(N.nvmlGpuInstanceGetComputeInstances, N.c_nvmlComputeInstance_t, gi, ci_info.id,
                                ci_info.instanceCount)
                except N.NVMLError:
                    continue
                for ci in cis:
                    N.nvmlComputeInstanceDestroy(ci)
            N.nvmlGpuInstanceDestroy(gi)


def _create(h, gi_profile_id: int, ci_slices: int) -> None:
    info = N.nvmlDeviceGetGpuInstanceProfileInfo(h, GI_PROFILE_INDEX[gi_profile_id])
    gi = N.nvmlDeviceCreateGpuInstance(h, info.id)
    ci_info = N.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, CI_PROFILE_ID[ci_slices],
                                                            N.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
    N.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)


def _current_names(gpu) -> Counter:
    from gpud.layout.names import mig_device_name

    return Counter(mig_device_name(gpu.nvml, gi, ci.slices) for gi in gpu.nvml.instances for ci in gi.cis)


def apply(rig, desired: dict[str, tuple[bool, dict[str, int]]]) -> dict[str, int]:
    """desired: PCI -> (mig_enabled, mig_devices). Returns {"resets": n, "orders_tried": n, "failed": 0/1}."""
    rig.rec.refresh()
    gpus = {g.pci: g for g in rig.rec.observation.gpus}
    stats = {"resets": 0, "orders_tried": 0, "failed": 0}
    try:
        mode_changes = [p for p, (on, _) in desired.items() if gpus[p].nvml.mig_mode != int(on)]
        if mode_changes:
            for p in desired:
                if gpus[p].nvml.mig_mode:
                    _clear(_handle(p))
            for p in mode_changes:
                N.nvmlDeviceSetMigMode(_handle(p), int(desired[p][0]))
            # reset every GPU of the config, changed or not, as mig-parted does with the nvidia
            # module loaded: NVML shut down, then one `nvidia-smi -r -i <ids>` (the host's own)
            rig.hw.nvml.close()
            try:
                argv = [*rig.hw.reset.command, "-r", "-i", ",".join(desired)]
                done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
            finally:
                rig.hw.nvml.open()
            if done.returncode != 0:
                raise MigPartedFailed(f"nvidia-smi -r failed (exit {done.returncode}): {done.stdout.strip()}")
            stats["resets"] += len(desired)
            rig.rec.refresh()
            gpus = {g.pci: g for g in rig.rec.observation.gpus}
        for p, (on, devices) in desired.items():
            if not on:
                continue
            want = Counter({k: v for k, v in devices.items() if v})
            if _current_names(gpus[p]) == want:
                continue
            h = _handle(p)
            items = []
            for name, count in sorted(want.items()):
                # the GI profile from the GPU's table; a `Nc.` prefix gives the CI's slices (NVML
                # lists CI profiles only once a GI exists, so they cannot be looked up beforehand)
                parsed = parse_mig_name(name)
                gi = next((x for x in gpus[p].nvml.profiles if parsed and x.name == parsed.gi_name), None)
                if gi is None or parsed is None:
                    raise MigPartedFailed(f"{name}: not a MIG profile of this GPU")
                items += [(gi.id, parsed.ci_slices or gi.slices)] * count
            _clear(h)
            for order in itertools.islice(dict.fromkeys(itertools.permutations(items)), MAX_ORDERS):
                stats["orders_tried"] += 1
                try:
                    for gi_id, ci_slices in order:
                        _create(h, gi_id, ci_slices)
                    break
                except N.NVMLError:
                    _clear(h)
            else:
                raise MigPartedFailed(f"{p}: no creation order worked")
    except (N.NVMLError, MigPartedFailed, OSError):
        stats["failed"] = 1
    return stats
