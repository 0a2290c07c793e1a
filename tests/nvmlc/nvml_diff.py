#!/usr/bin/env python3
"""NVML truth diff (kept with the project: tests/nvmlc/test_nvml_h200_diff.py runs it through the
simulator's C library and compares with the real H200's answers in tests/fixtures/h200/2026-12-04/).

Ask a pynvml-compatible library a broad set of READ-ONLY questions, record every
(function, args, answer or NVML error code) as JSON, and diff two such records (a real GPU's and the
simulator's).

    nvml_diff.py probe -o real.json                       # the real libnvidia-ml, through pynvml
    nvml_diff.py probe --sim h200 -o sim.json             # gpud's simulator: a fresh simulated host
                                                          # (gpud.sim.cli.create + gpud.sim.install, as
                                                          # tests/conftest.py's sim_host does); gpud must
                                                          # be importable (PYTHONPATH=<checkout>)
    nvml_diff.py diff real.json sim.json [--gpud-src DIR] [--tool-calls FILE] -o diff.json [--md diff.md]

Only getters are called: no Set*, Create*, Destroy*, Reset*, Clear*, Register*, no event sets. Every
NVMLError is recorded as its code and string, never raised; any other exception as its type and text.
Calls whose arguments are unusual (a NULL array, a count smaller than the answer) pass buffers far
larger than any answer, so a library that ignores the count writes into our own spare memory only.
Compute-instance profiles need a GPU-instance handle, which does not exist with MIG disabled: they
are recorded as not reachable rather than called with a made-up handle.

Two rows look at what the GI profile info call writes into the caller's struct: one v2 struct reused
for two calls (its version set once), and a v3 struct with a pattern pre-filled in name/capabilities.

The diff marks, per differing call, its kind (value, error code, one side errors, the simulator
lacks the function), which struct fields differ, whether gpud (its package minus gpud/sim) names the
function, and a first guess at the class; the report, not this script, gives the final class.
A function FakeNvmlLib lacks is FUNCTION_NOT_FOUND to pynvml but NOT_SUPPORTED through the
simulator's C library (gpud/sim/nvmlc/bridge.py): where the real library also says NOT_SUPPORTED the
diff says "same through the C library".
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import sys
import tempfile
import time
from ctypes import byref, c_uint
from typing import Any

import pynvml as N

# --------------------------------------------------------------------------------------------------
# value conversion


def jsonable(v, depth=0):
    """ctypes structures/arrays/scalars, pynvml friendly objects, bytes -> JSON values."""
    if depth > 8:
        return repr(v)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if isinstance(v, (ctypes._SimpleCData,)):
        return jsonable(v.value, depth + 1)
    if isinstance(v, ctypes._Pointer) or isinstance(v, ctypes.c_void_p):
        return "<pointer>" if v else "<NULL>"
    if isinstance(v, ctypes.Structure) or isinstance(v, ctypes.Union):
        out = {}
        for f in v._fields_:
            name = f[0]
            try:
                out[name] = jsonable(getattr(v, name), depth + 1)
            except Exception as e:  # noqa: BLE001
                out[name] = f"<{type(e).__name__}>"
        return out
    if isinstance(v, ctypes.Array):
        items = [jsonable(x, depth + 1) for x in v]
        if items and all(isinstance(x, int) for x in items) and len(items) > 64:
            return {"len": len(items), "nonzero": [i for i, x in enumerate(items) if x]}
        return items
    if isinstance(v, (list, tuple)):
        return [jsonable(x, depth + 1) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x, depth + 1) for k, x in v.items()}
    if isinstance(v, N.nvmlFriendlyObject):
        return {k: jsonable(x, depth + 1) for k, x in vars(v).items()}
    if hasattr(v, "__dict__") and vars(v):
        return {k: jsonable(x, depth + 1) for k, x in vars(v).items() if not k.startswith("_")}
    return repr(v)


class Recorder:
    def __init__(self):
        self.rows: list[dict] = []

    def call(self, fn_name: str, argdesc: str, thunk, *, keep=None):
        """Run `thunk()`; record ok/value or the NVML error code. Returns the raw value or None."""
        row: dict[str, Any] = {"fn": fn_name, "args": argdesc}
        t0 = time.perf_counter()
        raw = None
        try:
            raw = thunk()
            row["ok"] = jsonable(raw if keep is None else keep(raw))
        except N.NVMLError as e:
            row["err"] = int(e.value)
            row["str"] = str(e)
        except Exception as e:  # noqa: BLE001  (a binding's TypeError, a missing symbol in old pynvml)
            row["exc"] = f"{type(e).__name__}: {e}"[:300]
        row["ms"] = round((time.perf_counter() - t0) * 1000, 3)
        self.rows.append(row)
        return raw if "ok" in row else None


def raw_fn(name):
    return N._nvmlGetFunctionPointer(name)


def rc_check(ret):
    if ret != N.NVML_SUCCESS:
        raise N.NVMLError(ret)


# The GI profile info struct, version 3 (nvml.h: no isP2pSupported, a capabilities field at the end).
class GiProfileInfoV3(ctypes.Structure):
    _fields_ = [("version", c_uint), ("id", c_uint), ("sliceCount", c_uint), ("instanceCount", c_uint),
                ("multiprocessorCount", c_uint), ("copyEngineCount", c_uint), ("decoderCount", c_uint),
                ("encoderCount", c_uint), ("jpegCount", c_uint), ("ofaCount", c_uint),
                ("memorySizeMB", ctypes.c_ulonglong), ("name", ctypes.c_char * 96), ("capabilities", c_uint)]


GI_INFO_V3 = ctypes.sizeof(GiProfileInfoV3) | (3 << 24)


def gi_info_v3(h, index, by_id=False):
    info = GiProfileInfoV3()
    info.version = GI_INFO_V3
    fn = raw_fn("nvmlDeviceGetGpuInstanceProfileInfoByIdV" if by_id else "nvmlDeviceGetGpuInstanceProfileInfoV")
    rc_check(fn(h, c_uint(index), byref(info)))
    return info


def gi_info_badversion(h, index, version):
    info = N.c_nvmlGpuInstanceProfileInfo_v2_t()
    info.version = version
    rc_check(raw_fn("nvmlDeviceGetGpuInstanceProfileInfoV")(h, c_uint(index), byref(info)))
    return info


def gi_info_reused(h):
    """One v2 struct, its version set once (as a caller that allocates once would), asked for index 0
    and then index 1: what each call returns and what it leaves in the version field."""
    info = N.c_nvmlGpuInstanceProfileInfo_v2_t()  # the constructor sets version = nvmlGpuInstanceProfileInfo_v2
    fn = raw_fn("nvmlDeviceGetGpuInstanceProfileInfoV")
    out = []
    for index in (0, 1):
        before = info.version
        ret = fn(h, c_uint(index), byref(info))
        out.append({"index": index, "version_in": before, "ret": ret, "version_out": info.version, "id": info.id})
    return out


def gi_info_v3_prefilled(h):
    """A v3 struct with a pattern in name and capabilities: which of them the library writes."""
    info = GiProfileInfoV3()
    info.version = GI_INFO_V3
    info.name = b"Z" * 95
    info.capabilities = 0x5A5A5A5A
    ret = raw_fn("nvmlDeviceGetGpuInstanceProfileInfoV")(h, c_uint(0), byref(info))
    return {"ret": ret, "version_out": info.version, "id": info.id, "name": info.name.decode(errors="replace"),
            "capabilities": info.capabilities}


def placements_v2(h, pid, capacity=None, count_in=None):
    """Two-call pattern. capacity None: NULL array (count query). Else an array of `capacity`
    entries with the count set to `count_in` (default: capacity)."""
    count = c_uint(0 if capacity is None else (capacity if count_in is None else count_in))
    if capacity is None:
        rc_check(raw_fn("nvmlDeviceGetGpuInstancePossiblePlacements_v2")(h, c_uint(pid), None, byref(count)))
        return {"count": count.value}
    arr = (N.c_nvmlGpuInstancePlacement_t * capacity)()
    ret = raw_fn("nvmlDeviceGetGpuInstancePossiblePlacements_v2")(h, c_uint(pid), arr, byref(count))
    if ret != N.NVML_SUCCESS:
        e = N.NVMLError(ret)
        e.count_after = count.value
        raise e
    n = min(count.value, capacity)
    return {"count": count.value, "placements": [[arr[i].start, arr[i].size] for i in range(n)]}


def placements_v1(h, pid):
    """The unversioned symbol, with a generous array (its contract has no NULL count query)."""
    count = c_uint(32)
    arr = (N.c_nvmlGpuInstancePlacement_t * 32)()
    rc_check(raw_fn("nvmlDeviceGetGpuInstancePossiblePlacements")(h, c_uint(pid), arr, byref(count)))
    return {"count": count.value, "placements": [[arr[i].start, arr[i].size] for i in range(min(count.value, 32))]}


def gpu_instances(h, pid, capacity=16, null_array=False):
    count = c_uint(0)
    arr = None if null_array else (N.c_nvmlGpuInstance_t * capacity)()
    rc_check(raw_fn("nvmlDeviceGetGpuInstances")(h, c_uint(pid), arr, byref(count)))
    return {"count": count.value}


def memory_v2_version(h, version):
    """The v2 symbol with a v2 struct whose version field holds `version` (the 2026-12-04 capture
    made this call through nvidia-ml-py 13.610.43's wrapper, which passed version=0 on; later
    wrappers take a falsy version as "use v1", so the symbol is called here directly)."""
    info = N.c_nvmlMemory_v2_t()
    info.version = version
    rc_check(raw_fn("nvmlDeviceGetMemoryInfo_v2")(h, byref(info)))
    return info


def mig_mode(h):
    cur, pend = c_uint(), c_uint()
    rc_check(raw_fn("nvmlDeviceGetMigMode")(h, byref(cur), byref(pend)))
    return [cur.value, pend.value]


def fabric_v(h, ver):
    if ver == 3:
        info = N.c_nvmlGpuFabricInfo_v3_t()
    else:
        info = N.c_nvmlGpuFabricInfo_v2_t()
    rc_check(raw_fn("nvmlDeviceGetGpuFabricInfoV")(h, byref(info)))
    d = jsonable(info)
    d["clusterUuid"] = "<omitted>"
    return d


def placements_err(fn_name, argdesc, rec, thunk):
    """Like rec.call, but keeps the count an erroring two-call returned."""
    row: dict[str, Any] = {"fn": fn_name, "args": argdesc}
    try:
        row["ok"] = jsonable(thunk())
    except N.NVMLError as e:
        row["err"] = int(e.value)
        row["str"] = str(e)
        if hasattr(e, "count_after"):
            row["count_after"] = e.count_after
    except Exception as e:  # noqa: BLE001
        row["exc"] = f"{type(e).__name__}: {e}"[:300]
    rec.rows.append(row)


# --------------------------------------------------------------------------------------------------
# the probe


def sysfs_attrs(root: str, address: str) -> dict:
    """A few read-only attributes of the GPU's PCI function (real /sys or the simulated tree)."""
    d = os.path.join(root, "bus/pci/devices", address)
    out: dict[str, object] = {"exists": os.path.isdir(d)}
    for a in ("vendor", "device", "subsystem_vendor", "subsystem_device", "class", "revision", "numa_node",
              "reset_method", "sriov_totalvfs", "sriov_numvfs", "sriov_vf_device", "driver_override",
              "current_link_speed", "current_link_width", "max_link_speed", "max_link_width", "d3cold_allowed",
              "enable", "local_cpulist", "irq"):
        p = os.path.join(d, a)
        try:
            with open(p) as f:
                out[a] = f.read(256).strip()
        except FileNotFoundError:
            out[a] = "<ENOENT>"
        except OSError as e:
            out[a] = f"<{type(e).__name__} errno {e.errno}>"
    for link in ("driver", "iommu_group", "physfn"):
        p = os.path.join(d, link)
        out[link] = os.path.basename(os.readlink(p)) if os.path.islink(p) else "<none>"
    return out


def probe(sim_model: str | None, sim_dir: str | None) -> dict:
    meta = {"pynvml_file": N.__file__, "python": sys.version.split()[0], "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "mode": "sim" if sim_model else "real"}
    try:
        from importlib.metadata import version
        meta["nvidia_ml_py"] = version("nvidia-ml-py")
    except Exception as e:  # noqa: BLE001
        meta["nvidia_ml_py"] = repr(e)
    sys_root = "/sys"
    if sim_model:
        from gpud import sim
        from gpud.sim.cli import create

        d = sim_dir or tempfile.mkdtemp(prefix="nvml-diff-sim-")
        host_dir = os.path.join(d, "host")
        create(host_dir, [sim_model], [])
        h = sim.install(host_dir)
        sys_root = str(h.sys_root)
        meta["sim_model"] = sim_model
        import subprocess
        try:
            meta["gpud_commit"] = subprocess.run(["git", "-C", os.path.dirname(os.path.dirname(sim.__file__)), "rev-parse",
                                                  "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        except Exception:  # noqa: BLE001
            pass
    rec = Recorder()
    t_init = time.perf_counter()
    rec.call("nvmlInit", "", N.nvmlInit)
    meta["init_ms"] = round((time.perf_counter() - t_init) * 1000, 2)

    # system --------------------------------------------------------------------------------------
    rec.call("nvmlSystemGetDriverVersion", "", N.nvmlSystemGetDriverVersion)
    rec.call("nvmlSystemGetNVMLVersion", "", N.nvmlSystemGetNVMLVersion)
    rec.call("nvmlSystemGetCudaDriverVersion", "", N.nvmlSystemGetCudaDriverVersion)
    rec.call("nvmlSystemGetCudaDriverVersion_v2", "", N.nvmlSystemGetCudaDriverVersion_v2)
    rec.call("nvmlSystemGetHicVersion", "", N.nvmlSystemGetHicVersion)
    rec.call("nvmlSystemGetDriverBranch", "", N.nvmlSystemGetDriverBranch)
    rec.call("nvmlSystemGetProcessName", "pid=1", lambda: N.nvmlSystemGetProcessName(1))
    rec.call("nvmlSystemGetConfComputeState", "", N.nvmlSystemGetConfComputeState)
    rec.call("nvmlSystemGetConfComputeCapabilities", "", N.nvmlSystemGetConfComputeCapabilities)
    rec.call("nvmlSystemGetNvlinkBwMode", "", N.nvmlSystemGetNvlinkBwMode)
    rec.call("nvmlSystemGetTopologyGpuSet", "cpu=0", lambda: len(N.nvmlSystemGetTopologyGpuSet(0)))
    rec.call("nvmlUnitGetCount", "", N.nvmlUnitGetCount)
    rec.call("nvmlGetExcludedDeviceCount", "", N.nvmlGetExcludedDeviceCount)
    rec.call("nvmlGetVgpuDriverCapabilities", "cap=0", lambda: N.nvmlGetVgpuDriverCapabilities(0))
    rec.call("nvmlGetVgpuVersion", "", N.nvmlGetVgpuVersion)
    for code in list(range(0, 30)) + [999]:
        rec.call("nvmlErrorString", f"code={code}", lambda c=code: N.nvmlErrorString(c))
    count = rec.call("nvmlDeviceGetCount", "", N.nvmlDeviceGetCount) or 0
    rec.call("nvmlDeviceGetHandleByIndex", "index=count", lambda: N.nvmlDeviceGetHandleByIndex(count))
    rec.call("nvmlDeviceGetHandleByIndex", "index=99", lambda: N.nvmlDeviceGetHandleByIndex(99))

    devices = []
    for i in range(count):
        p = f"dev{i}"
        h = rec.call("nvmlDeviceGetHandleByIndex", f"index={i}", lambda i=i: N.nvmlDeviceGetHandleByIndex(i),
                     keep=lambda x: "<handle>")
        if h is None:
            continue
        c = lambda fn, args="", thunk=None: rec.call(fn, f"{p}{',' if args else ''}{args}",  # noqa: E731
                                                     thunk or (lambda: getattr(N, fn)(h)))
        # identity
        c("nvmlDeviceGetName")
        uuid = c("nvmlDeviceGetUUID")
        c("nvmlDeviceGetSerial")
        c("nvmlDeviceGetBoardId")
        c("nvmlDeviceGetBoardPartNumber")
        c("nvmlDeviceGetBrand")
        c("nvmlDeviceGetIndex")
        c("nvmlDeviceGetMinorNumber")
        c("nvmlDeviceGetMultiGpuBoard")
        c("nvmlDeviceGetVbiosVersion")
        c("nvmlDeviceGetInforomImageVersion")
        for obj in range(3):
            c("nvmlDeviceGetInforomVersion", f"object={obj}", lambda o=obj: N.nvmlDeviceGetInforomVersion(h, o))
        c("nvmlDeviceGetInforomConfigurationChecksum")
        c("nvmlDeviceGetArchitecture")
        c("nvmlDeviceGetCudaComputeCapability")
        c("nvmlDeviceGetNumGpuCores")
        c("nvmlDeviceGetMemoryBusWidth")
        c("nvmlDeviceGetModuleId")
        c("nvmlDeviceGetC2cModeInfoV")
        c("nvmlDeviceGetAddressingMode")
        c("nvmlDeviceGetGspFirmwareMode")
        c("nvmlDeviceGetGspFirmwareVersion")
        # PCI
        pci = c("nvmlDeviceGetPciInfo_v3")
        c("nvmlDeviceGetBusType")
        c("nvmlDeviceGetIrqNum")
        c("nvmlDeviceGetNumaNodeId")
        c("nvmlDeviceGetCurrPcieLinkGeneration")
        c("nvmlDeviceGetCurrPcieLinkWidth")
        c("nvmlDeviceGetMaxPcieLinkGeneration")
        c("nvmlDeviceGetMaxPcieLinkWidth")
        c("nvmlDeviceGetGpuMaxPcieLinkGeneration")
        c("nvmlDeviceGetPcieLinkMaxSpeed")
        c("nvmlDeviceGetPcieSpeed")
        c("nvmlDeviceGetPcieReplayCounter")
        c("nvmlDeviceGetCpuAffinity", "size=4", lambda: N.nvmlDeviceGetCpuAffinity(h, 4))
        c("nvmlDeviceGetMemoryAffinity", "size=4,scope=0", lambda: N.nvmlDeviceGetMemoryAffinity(h, 4, 0))
        c("nvmlDeviceGetTopologyNearestGpus", "level=0", lambda: len(N.nvmlDeviceGetTopologyNearestGpus(h, 0)))
        c("nvmlDeviceGetTopologyCommonAncestor", "self", lambda: N.nvmlDeviceGetTopologyCommonAncestor(h, h))
        c("nvmlDeviceGetP2PStatus", "self,index=0", lambda: N.nvmlDeviceGetP2PStatus(h, h, 0))
        # memory
        c("nvmlDeviceGetMemoryInfo", "v1", lambda: N.nvmlDeviceGetMemoryInfo(h))
        c("nvmlDeviceGetMemoryInfo_v2", "v2", lambda: N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2))
        c("nvmlDeviceGetMemoryInfo_v2", "version=0", lambda: memory_v2_version(h, 0))
        c("nvmlDeviceGetBAR1MemoryInfo")
        c("nvmlDeviceGetConfComputeMemSizeInfo")
        # modes
        c("nvmlDeviceGetPersistenceMode")
        c("nvmlDeviceGetComputeMode")
        c("nvmlDeviceGetDisplayMode")
        c("nvmlDeviceGetDisplayActive")
        c("nvmlDeviceGetAccountingMode")
        c("nvmlDeviceGetEccMode")
        c("nvmlDeviceGetDefaultEccMode")
        c("nvmlDeviceGetDriverModel")
        c("nvmlDeviceGetCurrentGpuOperationMode")
        c("nvmlDeviceGetAutoBoostedClocksEnabled")
        for api in (0, 1):
            c("nvmlDeviceGetAPIRestriction", f"api={api}", lambda a=api: N.nvmlDeviceGetAPIRestriction(h, a))
        c("nvmlDeviceGetDramEncryptionMode")
        # health / telemetry (cosmetic for gpud, but a tool may read them)
        c("nvmlDeviceGetTemperature", "sensor=0", lambda: N.nvmlDeviceGetTemperature(h, 0))
        c("nvmlDeviceGetFanSpeed")
        c("nvmlDeviceGetNumFans")
        c("nvmlDeviceGetPerformanceState")
        c("nvmlDeviceGetPowerState")
        c("nvmlDeviceGetPowerUsage")
        c("nvmlDeviceGetPowerManagementMode")
        c("nvmlDeviceGetPowerManagementLimit")
        c("nvmlDeviceGetPowerManagementDefaultLimit")
        c("nvmlDeviceGetPowerManagementLimitConstraints")
        c("nvmlDeviceGetEnforcedPowerLimit")
        c("nvmlDeviceGetTotalEnergyConsumption")
        c("nvmlDeviceGetUtilizationRates")
        c("nvmlDeviceGetEncoderUtilization")
        c("nvmlDeviceGetDecoderUtilization")
        c("nvmlDeviceGetEncoderCapacity", "type=0", lambda: N.nvmlDeviceGetEncoderCapacity(h, 0))
        c("nvmlDeviceGetEncoderStats")
        for clk in range(4):
            c("nvmlDeviceGetClockInfo", f"clock={clk}", lambda k=clk: N.nvmlDeviceGetClockInfo(h, k))
            c("nvmlDeviceGetMaxClockInfo", f"clock={clk}", lambda k=clk: N.nvmlDeviceGetMaxClockInfo(h, k))
        c("nvmlDeviceGetSupportedClocksEventReasons")
        c("nvmlDeviceGetCurrentClocksEventReasons")
        for et in (0, 1):
            c("nvmlDeviceGetTotalEccErrors", f"type={et},counter=1",
              lambda e=et: N.nvmlDeviceGetTotalEccErrors(h, e, 1))
        c("nvmlDeviceGetRetiredPagesPendingStatus")
        c("nvmlDeviceGetRemappedRows")
        for link in range(18):
            c("nvmlDeviceGetNvLinkState", f"link={link}", lambda lk=link: N.nvmlDeviceGetNvLinkState(h, lk))
        c("nvmlDeviceGetGpuFabricInfoV", "v2", lambda: fabric_v(h, 2))
        c("nvmlDeviceGetGpuFabricInfoV", "v3", lambda: fabric_v(h, 3))
        # processes / events
        c("nvmlDeviceGetComputeRunningProcesses_v3", "", lambda: N.nvmlDeviceGetComputeRunningProcesses_v3(h))
        c("nvmlDeviceGetComputeRunningProcesses_v2", "", lambda: N.nvmlDeviceGetComputeRunningProcesses_v2(h))
        c("nvmlDeviceGetGraphicsRunningProcesses_v3", "", lambda: N.nvmlDeviceGetGraphicsRunningProcesses_v3(h))
        c("nvmlDeviceGetMPSComputeRunningProcesses_v3", "", lambda: N.nvmlDeviceGetMPSComputeRunningProcesses_v3(h))
        c("nvmlDeviceGetSupportedEventTypes")
        # virtualisation / vGPU / SR-IOV
        c("nvmlDeviceGetVirtualizationMode")
        c("nvmlDeviceGetHostVgpuMode")
        c("nvmlDeviceGetSupportedVgpus")
        c("nvmlDeviceGetCreatableVgpus")
        c("nvmlDeviceGetActiveVgpus")
        c("nvmlDeviceGetVgpuHeterogeneousMode")
        c("nvmlDeviceGetVgpuSchedulerCapabilities")
        c("nvmlDeviceGetVgpuSchedulerState")
        c("nvmlDeviceGetPgpuMetadataString")
        for cap in range(N.NVML_DEVICE_VGPU_CAP_COUNT):
            c("nvmlDeviceGetVgpuCapabilities", f"cap={cap}", lambda k=cap: N.nvmlDeviceGetVgpuCapabilities(h, k))
        # handle lookups
        txt = lambda v: v.decode() if isinstance(v, bytes) else v  # noqa: E731
        bus = txt(pci.busId) if pci is not None else None
        legacy = txt(pci.busIdLegacy) if pci is not None else None
        if bus:
            assert legacy is not None  # both come from the same pci record
            rec.call("nvmlDeviceGetHandleByPciBusId", f"{p},own busId", lambda: N.nvmlDeviceGetHandleByPciBusId(bus),
                     keep=lambda x: "<handle>")
            rec.call("nvmlDeviceGetHandleByPciBusId", f"{p},own busIdLegacy lower",
                     lambda: N.nvmlDeviceGetHandleByPciBusId(legacy.lower()), keep=lambda x: "<handle>")
            fn1 = bus[:-1] + "1"
            rec.call("nvmlDeviceGetHandleByPciBusId", f"{p},own bus function 1",
                     lambda: N.nvmlDeviceGetHandleByPciBusId(fn1), keep=lambda x: "<handle>")
        rec.call("nvmlDeviceGetHandleByPciBusId", "absent 0000:fe:1f.0",
                 lambda: N.nvmlDeviceGetHandleByPciBusId("0000:fe:1f.0"), keep=lambda x: "<handle>")
        rec.call("nvmlDeviceGetHandleByPciBusId", "malformed 'garbage'",
                 lambda: N.nvmlDeviceGetHandleByPciBusId("garbage"), keep=lambda x: "<handle>")
        if uuid:
            rec.call("nvmlDeviceGetHandleByUUID", f"{p},own uuid", lambda: N.nvmlDeviceGetHandleByUUID(uuid),
                     keep=lambda x: "<handle>")
        rec.call("nvmlDeviceGetHandleByUUID", "absent GPU-00000000-0000-0000-0000-000000000000",
                 lambda: N.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000"), keep=lambda x: "<handle>")
        rec.call("nvmlDeviceGetHandleByUUID", "empty ''", lambda: N.nvmlDeviceGetHandleByUUID(""), keep=lambda x: "<handle>")
        # MIG --------------------------------------------------------------------------------------
        c("nvmlDeviceGetMigMode", "", lambda: mig_mode(h))
        c("nvmlDeviceGetMaxMigDeviceCount")
        c("nvmlDeviceIsMigDeviceHandle")
        for k in range(9):
            c("nvmlDeviceGetMigDeviceHandleByIndex", f"index={k}",
              lambda k=k: N.nvmlDeviceGetMigDeviceHandleByIndex(h, k))
        c("nvmlDeviceGetGpuInstanceId")
        c("nvmlDeviceGetComputeInstanceId")
        c("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
        c("nvmlDeviceGetAttributes_v2")
        c("nvmlDeviceGetAttributes", "v1 symbol",
          lambda: (rc_check(raw_fn("nvmlDeviceGetAttributes")(h, byref(N.c_nvmlDeviceAttributes()))), "ok")[1])
        for gid in (0, 1, 7):
            c("nvmlDeviceGetGpuInstanceById", f"gi={gid}", lambda g=gid: N.nvmlDeviceGetGpuInstanceById(h, g))
        ids = set()
        for idx in list(range(N.NVML_GPU_INSTANCE_PROFILE_COUNT)) + [N.NVML_GPU_INSTANCE_PROFILE_COUNT, 0x13, 0x20, 99]:
            v2 = c("nvmlDeviceGetGpuInstanceProfileInfoV", f"index={idx},v2",
                   lambda i=idx: N.nvmlDeviceGetGpuInstanceProfileInfo(h, i, version=2))
            c("nvmlDeviceGetGpuInstanceProfileInfo", f"index={idx},v1 symbol",
              lambda i=idx: N.nvmlDeviceGetGpuInstanceProfileInfo(h, i, version=1))
            c("nvmlDeviceGetGpuInstanceProfileInfoV", f"index={idx},v3 struct", lambda i=idx: gi_info_v3(h, i))
            if v2 is not None:
                ids.add(v2.id)
        c("nvmlDeviceGetGpuInstanceProfileInfoV", "index=0,version=0", lambda: gi_info_badversion(h, 0, 0))
        c("nvmlDeviceGetGpuInstanceProfileInfoV", "index=0,version=v1-size|1<<24",
          lambda: gi_info_badversion(h, 0, ctypes.sizeof(N.c_nvmlGpuInstanceProfileInfo_t) | (1 << 24)))
        c("nvmlDeviceGetGpuInstanceProfileInfoV", "v2 struct reused for index 0 then 1, version set once",
          lambda: gi_info_reused(h))
        c("nvmlDeviceGetGpuInstanceProfileInfoV", "index=0,v3 struct with name/capabilities pre-filled",
          lambda: gi_info_v3_prefilled(h))
        for pid in range(0, 33):
            c("nvmlDeviceGetGpuInstanceProfileInfoByIdV", f"id={pid},v2",
              lambda q=pid: N.nvmlDeviceGetGpuInstanceProfileInfoById(h, q))
            c("nvmlDeviceGetGpuInstanceProfileInfoByIdV", f"id={pid},v3 struct", lambda q=pid: gi_info_v3(h, q, by_id=True))
            c("nvmlDeviceGetGpuInstanceRemainingCapacity", f"id={pid}",
              lambda q=pid: N.nvmlDeviceGetGpuInstanceRemainingCapacity(h, q))
            c("nvmlDeviceGetGpuInstancePossiblePlacements_v2", f"id={pid},NULL array (count query)",
              lambda q=pid: placements_v2(h, q))
            c("nvmlDeviceGetGpuInstancePossiblePlacements_v2", f"id={pid},array 32,count 32",
              lambda q=pid: placements_v2(h, q, 32))
            c("nvmlDeviceGetGpuInstancePossiblePlacements", f"id={pid},v1 symbol,array 32",
              lambda q=pid: placements_v1(h, q))
            c("nvmlDeviceGetGpuInstances", f"id={pid},array 16", lambda q=pid: gpu_instances(h, q))
        for pid in sorted(ids):
            placements_err("nvmlDeviceGetGpuInstancePossiblePlacements_v2", f"{p},id={pid},array 32,count 1 (short)", rec,
                           lambda q=pid: placements_v2(h, q, 32, count_in=1))
            placements_err("nvmlDeviceGetGpuInstancePossiblePlacements_v2", f"{p},id={pid},array 32,count 0",
                           rec, lambda q=pid: placements_v2(h, q, 32, count_in=0))
        rec.rows.append({"fn": "nvmlGpuInstanceGetComputeInstanceProfileInfo", "args": f"{p},all",
                         "not_reachable": "needs a GPU instance handle; none exists with MIG disabled"})
        devices.append({"index": i, "bus": bus, "sysfs": sysfs_attrs(sys_root, (legacy or "").lower())})
    rec.call("nvmlShutdown", "", N.nvmlShutdown)
    rec.call("nvmlDeviceGetCount", "after shutdown", N.nvmlDeviceGetCount)
    return {"meta": meta, "calls": rec.rows, "devices": devices}


# --------------------------------------------------------------------------------------------------
# the diff

COSMETIC = [  # (regex on fn, why)
    (r"UUID$|GetSerial|GetBoardId|GetVbiosVersion|GetInforom|GetModuleId|GetIrqNum|GetGspFirmwareVersion",
     "per-board identity"),
    (r"Temperature|FanSpeed|NumFans|PowerUsage|TotalEnergy|UtilizationRates|EncoderUtilization|DecoderUtilization|"
     r"GetClockInfo|PerformanceState|PowerState|ClocksEventReasons|EncoderStats|PcieReplayCounter|TotalEccErrors|"
     r"RemappedRows|RetiredPages", "telemetry"),
    (r"GetCpuAffinity|GetMemoryAffinity|NumaNodeId|TopologyGpuSet|TopologyNearestGpus", "host topology"),
    (r"nvmlErrorString", "error text"),
]


def key(row):
    return f"{row['fn']}({row['args']})"


def answer(row):
    if row is None:
        return {"absent": True}
    if "not_reachable" in row:
        return {"not_reachable": row["not_reachable"]}
    if "ok" in row:
        return {"ok": row["ok"]}
    if "err" in row:
        a = {"err": row["err"], "str": row.get("str")}
        if "count_after" in row:
            a["count_after"] = row["count_after"]
        return a
    return {"exc": row.get("exc")}


def gpud_symbols(src: str | None) -> set[str]:
    found: set[str] = set()
    if not src:
        return found
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if d not in ("sim", "__pycache__")]
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(root, f), errors="replace") as fh:
                    found |= set(re.findall(r"\bnvml[A-Z][A-Za-z0-9_]+", fh.read()))
    return found


def tool_symbols(path: str | None) -> set[str]:
    if not path:
        return set()
    with open(path, errors="replace") as fh:
        return set(re.findall(r"\bnvml[A-Z][A-Za-z0-9_]+", fh.read()))


def base(fn: str) -> str:
    return re.sub(r"(_v\d|V)$", "", fn)


def diff(real: dict, sim: dict, gpud_src: str | None, tool_calls: str | None) -> dict:
    used_by_gpud = {base(s) for s in gpud_symbols(gpud_src)}
    used_by_tools = {base(s) for s in tool_symbols(tool_calls)}
    r_rows = {key(x): x for x in real["calls"]}
    s_rows = {key(x): x for x in sim["calls"]}
    out = []
    same = 0
    for k in list(r_rows) + [k for k in s_rows if k not in r_rows]:
        ra, sa = answer(r_rows.get(k)), answer(s_rows.get(k))
        ra_cmp = {kk: vv for kk, vv in ra.items() if kk != "str"}
        sa_cmp = {kk: vv for kk, vv in sa.items() if kk != "str"}
        if ra_cmp == sa_cmp:
            if ra.get("str") != sa.get("str"):
                out.append({"call": k, "real": ra, "sim": sa, "class": "cosmetic", "why": "error text only"})
            else:
                same += 1
            continue
        either = r_rows.get(k) or s_rows.get(k)
        assert either is not None  # k comes from one of the two
        fn = either["fn"]
        why = []
        cls = "meaningful?"
        for pat, reason in COSMETIC:
            if re.search(pat, fn):
                cls, why = "cosmetic?", [reason]
                break
        if "ok" in ra and "ok" in sa and isinstance(ra["ok"], dict) and isinstance(sa["ok"], dict):
            why.append("fields differ: " + ", ".join(sorted(k for k in set(ra["ok"]) | set(sa["ok"])
                                                             if ra["ok"].get(k) != sa["ok"].get(k))))
        if sa.get("err") == 13 and ra.get("err") == 3:
            cls = "same through the C library"
            why.append("FakeNvmlLib lacks it (pynvml: FUNCTION_NOT_FOUND); the simulator's C library answers "
                       "NOT_SUPPORTED, as the real one does")
        kind = ("only one side called it" if "absent" in ra or "absent" in sa else
                "value" if "ok" in ra and "ok" in sa else
                "sim lacks the function (FUNCTION_NOT_FOUND)" if sa.get("err") == 13 else
                "error code" if "err" in ra and "err" in sa else
                "real answers, sim errors" if "ok" in ra else
                "sim answers, real errors" if "ok" in sa else "other")
        if base(fn) in used_by_gpud:
            why.append("gpud calls it")
        if base(fn) in used_by_tools:
            why.append("NVIDIA's tools call it (2026-12-01b list)")
        out.append({"call": k, "real": ra, "sim": sa, "kind": kind, "class": cls, "why": why})
    return {"real_meta": real["meta"], "sim_meta": sim["meta"], "same": same, "different": len(out),
            "sysfs": {"real": real.get("devices"), "sim": sim.get("devices")}, "diffs": out}


def short(a: dict) -> str:
    if "ok" in a:
        s = json.dumps(a["ok"], sort_keys=True)
        return s if len(s) <= 140 else s[:137] + "..."
    if "err" in a:
        extra = f", count {a['count_after']}" if "count_after" in a else ""
        return f"ERR {a['err']} {a.get('str')}{extra}"
    if "absent" in a:
        return "(not called)"
    if "not_reachable" in a:
        return "(not reachable)"
    return f"EXC {a.get('exc')}"


def to_md(d: dict) -> str:
    lines = [f"same answers: {d['same']}, different: {d['different']}", "",
             "| call | real | sim | kind | class | note |", "|---|---|---|---|---|---|"]
    for x in d["diffs"]:
        lines.append("| `{}` | {} | {} | {} | {} | {} |".format(
            x["call"], short(x["real"]).replace("|", "\\|"), short(x["sim"]).replace("|", "\\|"), x.get("kind", ""),
            x["class"], "; ".join(x.get("why", [])) if isinstance(x.get("why"), list) else x.get("why", "")))
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("probe")
    p.add_argument("--sim", metavar="MODEL", help="probe gpud's simulator with one GPU of MODEL (e.g. h200)")
    p.add_argument("--sim-dir", help="where to create the simulated host (default: a new temp dir)")
    p.add_argument("-o", required=True)
    q = sub.add_parser("diff")
    q.add_argument("real")
    q.add_argument("sim")
    q.add_argument("--gpud-src", help="gpud package dir: mark functions gpud calls (gpud/sim excluded)")
    q.add_argument("--tool-calls", help="a file naming the NVML calls NVIDIA's tools make (regex nvml...)")
    q.add_argument("-o", required=True)
    q.add_argument("--md")
    a = ap.parse_args()
    if a.cmd == "probe":
        res = probe(a.sim, a.sim_dir)
        with open(a.o, "w") as f:
            json.dump(res, f, indent=1, sort_keys=False)
        n_err = sum(1 for r in res["calls"] if "err" in r)
        n_exc = sum(1 for r in res["calls"] if "exc" in r)
        print(f"{res['meta']['mode']}: {len(res['calls'])} calls, {n_err} NVML errors, {n_exc} exceptions -> {a.o}")
        return 0
    with open(a.real) as f:
        real = json.load(f)
    with open(a.sim) as f:
        sim = json.load(f)
    d = diff(real, sim, a.gpud_src, a.tool_calls)
    with open(a.o, "w") as f:
        json.dump(d, f, indent=1)
    if a.md:
        with open(a.md, "w") as f:
            f.write(to_md(d))
    print(f"same {d['same']}, different {d['different']} -> {a.o}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
