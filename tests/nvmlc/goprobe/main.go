// goprobe: a Go program that speaks to NVML only through NVIDIA's own Go bindings, go-nvml (the
// cgo binding nvidia-mig-parted, gpu-feature-discovery and nvidia-device-plugin vendor) and
// go-nvlib (the device library GFD and the device plugin name MIG devices with), at the versions
// mig-parted v0.15.0 requires. The tests of the simulated libnvidia-ml.so.1 run it under
// `gpud-sim exec` and compare what it prints with the simulator's state file and real captures.
//
//	goprobe dump                      JSON: every GPU and MIG device as go-nvml and go-nvlib see them
//	goprobe errors                    JSON: NVML's answers to the calls a real H200 was asked with MIG off
//	goprobe create GPU GIPROFILEINDEX  one GPU instance (no placement) and its full compute instance, as mig-parted creates them
//	goprobe destroy-all GPU           every compute and GPU instance of the GPU, compute instances first
//	goprobe mig GPU 0|1               nvmlDeviceSetMigMode; prints the activation status
//	goprobe threads N                 N goroutines on their own OS threads reading names and counts at once
//	goprobe wait MS                   one event set, XID events registered on GPU 0, one wait of MS ms
//	goprobe hold                      nvmlInit, then wait for stdin to close, then nvmlShutdown
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"sync"

	"github.com/NVIDIA/go-nvlib/pkg/nvlib/device"
	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

type migDevice struct {
	Index       int    `json:"index"`
	UUID        string `json:"uuid"`
	Name        string `json:"name"`
	Profile     string `json:"profile"` // go-nvlib's name for it (from GetAttributes and the parent's memory)
	GI          int    `json:"gi"`
	CI          int    `json:"ci"`
	MemoryMB    uint64 `json:"memory_mb"`
	SMs         uint32 `json:"sms"`
	GISlices    uint32 `json:"gi_slices"`
	CISlices    uint32 `json:"ci_slices"`
	MemoryTotal uint64 `json:"memory_total"`
	Parent      string `json:"parent_uuid"`
	Minor       int    `json:"minor"`
}

type gpu struct {
	Index       int         `json:"index"`
	UUID        string      `json:"uuid"`
	Name        string      `json:"name"`
	BusID       string      `json:"bus_id"`
	PciDeviceID uint32      `json:"pci_device_id"`
	Minor       int         `json:"minor"`
	MemoryTotal uint64      `json:"memory_total"`
	CudaCC      string      `json:"cuda_cc"`
	MigCapable  bool        `json:"mig_capable"`
	MigEnabled  bool        `json:"mig_enabled"`
	MigCurrent  int         `json:"mig_current"`
	MigPending  int         `json:"mig_pending"`
	MaxMig      int         `json:"max_mig_devices"`
	Profiles    []string    `json:"profiles"` // go-nvlib's VisitMigProfiles
	Fabric      bool        `json:"fabric_attached"`
	MigDevices  []migDevice `json:"mig_devices"`
}

func must(ret nvml.Return, what string) {
	if ret != nvml.SUCCESS {
		fmt.Fprintf(os.Stderr, "goprobe: %s: %v (%d)\n", what, nvml.ErrorString(ret), int(ret))
		os.Exit(3)
	}
}

func check(err error) {
	if err != nil {
		fmt.Fprintf(os.Stderr, "goprobe: %v\n", err)
		os.Exit(3)
	}
}

func emit(v any) {
	out, err := json.MarshalIndent(v, "", " ")
	check(err)
	fmt.Println(string(out))
}

func dump(lib nvml.Interface) {
	devlib := device.New(lib)
	var gpus []gpu
	check(devlib.VisitDevices(func(i int, d device.Device) error {
		var g gpu
		var ret nvml.Return
		g.Index = i
		g.UUID, ret = d.GetUUID()
		must(ret, "GetUUID")
		g.Name, ret = d.GetName()
		must(ret, "GetName")
		pci, ret := d.GetPciInfo()
		must(ret, "GetPciInfo")
		g.BusID = nvmlString(pci.BusId[:])
		g.PciDeviceID = pci.PciDeviceId
		g.Minor, ret = d.GetMinorNumber()
		must(ret, "GetMinorNumber")
		mem, ret := d.GetMemoryInfo()
		must(ret, "GetMemoryInfo")
		g.MemoryTotal = mem.Total
		var err error
		g.CudaCC, err = d.GetCudaComputeCapabilityAsString()
		check(err)
		g.MigCapable, err = d.IsMigCapable()
		check(err)
		g.MigEnabled, err = d.IsMigEnabled()
		check(err)
		g.Fabric, err = d.IsFabricAttached()
		check(err)
		if g.MigCapable {
			cur, pend, ret := d.GetMigMode()
			must(ret, "GetMigMode")
			g.MigCurrent, g.MigPending = cur, pend
			g.MaxMig, ret = d.GetMaxMigDeviceCount()
			must(ret, "GetMaxMigDeviceCount")
			profiles, err := d.GetMigProfiles()
			check(err)
			for _, p := range profiles {
				g.Profiles = append(g.Profiles, p.String())
			}
		}
		g.MigDevices = []migDevice{}
		check(d.VisitMigDevices(func(j int, m device.MigDevice) error {
			var md migDevice
			var ret nvml.Return
			md.Index = j
			md.UUID, ret = m.GetUUID()
			must(ret, "MIG GetUUID")
			md.Name, ret = m.GetName()
			must(ret, "MIG GetName")
			p, err := m.GetProfile()
			check(err)
			md.Profile = p.String()
			md.GI, ret = m.GetGpuInstanceId()
			must(ret, "GetGpuInstanceId")
			md.CI, ret = m.GetComputeInstanceId()
			must(ret, "GetComputeInstanceId")
			attr, ret := m.GetAttributes()
			must(ret, "GetAttributes")
			md.MemoryMB, md.SMs = attr.MemorySizeMB, attr.MultiprocessorCount
			md.GISlices, md.CISlices = attr.GpuInstanceSliceCount, attr.ComputeInstanceSliceCount
			mm, ret := m.GetMemoryInfo()
			must(ret, "MIG GetMemoryInfo")
			md.MemoryTotal = mm.Total
			isMig, ret := m.IsMigDeviceHandle()
			must(ret, "IsMigDeviceHandle")
			if !isMig {
				return fmt.Errorf("MIG device %d: IsMigDeviceHandle false", j)
			}
			parent, ret := m.GetDeviceHandleFromMigDeviceHandle()
			must(ret, "GetDeviceHandleFromMigDeviceHandle")
			md.Parent, ret = parent.GetUUID()
			must(ret, "parent GetUUID")
			md.Minor, ret = m.GetMinorNumber()
			if ret != nvml.SUCCESS {
				md.Minor = -int(ret)
			}
			g.MigDevices = append(g.MigDevices, md)
			return nil
		}))
		gpus = append(gpus, g)
		return nil
	}))
	driver, ret := lib.SystemGetDriverVersion()
	must(ret, "SystemGetDriverVersion")
	nvmlVersion, ret := lib.SystemGetNVMLVersion()
	must(ret, "SystemGetNVMLVersion")
	cuda, ret := lib.SystemGetCudaDriverVersion()
	must(ret, "SystemGetCudaDriverVersion")
	emit(map[string]any{"driver": driver, "nvml": nvmlVersion, "cuda": cuda, "gpus": gpus})
}

func nvmlString(b []int8) string {
	out := make([]byte, 0, len(b))
	for _, c := range b {
		if c == 0 {
			break
		}
		out = append(out, byte(c))
	}
	return string(out)
}

// The calls of the real H200 capture (tests/fixtures/h200/nvml-and-files.json), by its keys.
func errorsProbe(lib nvml.Interface) {
	d, ret := lib.DeviceGetHandleByIndex(0)
	must(ret, "DeviceGetHandleByIndex(0)")
	out := map[string]int{}
	_, ret = d.GetMigDeviceHandleByIndex(0)
	out["nvmlDeviceGetMigDeviceHandleByIndex(0) MIG off"] = int(ret)
	_, ret = d.GetGpuInstanceId()
	out["nvmlDeviceGetGpuInstanceId (MIG off, full GPU)"] = int(ret)
	_, ret = d.GetComputeInstanceId()
	out["nvmlDeviceGetComputeInstanceId (full GPU)"] = int(ret)
	_, ret = d.GetDeviceHandleFromMigDeviceHandle()
	out["nvmlDeviceGetDeviceHandleFromMigDeviceHandle (full GPU)"] = int(ret)
	_, ret = d.GetAttributes()
	out["nvmlDeviceGetAttributes_v2 (full GPU)"] = int(ret)
	_, ret = d.GetGpuInstanceById(1)
	out["nvmlDeviceGetGpuInstanceById(1) MIG off"] = int(ret)
	_, ret = lib.DeviceGetHandleByIndex(1 << 10)
	out["nvmlDeviceGetHandleByIndex(1) (one GPU)"] = int(ret)
	_, ret = lib.DeviceGetHandleByPciBusId("0000:ff:1f.7")
	out["nvmlDeviceGetHandleByPciBusId_v2(bad)"] = int(ret)
	_, ret = lib.DeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
	out["nvmlDeviceGetHandleByUUID(bad)"] = int(ret)
	max, ret := d.GetMaxMigDeviceCount()
	must(ret, "GetMaxMigDeviceCount")
	out["nvmlDeviceGetMaxMigDeviceCount"] = max
	isMig, ret := d.IsMigDeviceHandle()
	must(ret, "IsMigDeviceHandle")
	out["nvmlDeviceIsMigDeviceHandle"] = map[bool]int{false: 0, true: 1}[isMig]
	types, ret := d.GetSupportedEventTypes()
	must(ret, "GetSupportedEventTypes")
	out["nvmlDeviceGetSupportedEventTypes"] = int(types)
	must(lib.Shutdown(), "Shutdown")
	_, ret = lib.DeviceGetCount()
	out["call after shutdown (nvmlDeviceGetCount)"] = int(ret)
	emit(out)
}

func gpuArg(lib nvml.Interface, s string) nvml.Device {
	i, err := strconv.Atoi(s)
	check(err)
	d, ret := lib.DeviceGetHandleByIndex(i)
	must(ret, "DeviceGetHandleByIndex")
	return d
}

// As mig-parted v0.15.0's pkg/mig/state creates a MIG device: profile info by index, a GPU
// instance from it, then the compute instance of the GPU instance's full size.
func create(lib nvml.Interface, d nvml.Device, index int) {
	info, ret := d.GetGpuInstanceProfileInfo(index)
	must(ret, "GetGpuInstanceProfileInfo")
	gi, ret := d.CreateGpuInstance(&info)
	must(ret, "CreateGpuInstance")
	giInfo, ret := gi.GetInfo()
	must(ret, "GpuInstance.GetInfo")
	for j := nvml.COMPUTE_INSTANCE_PROFILE_COUNT - 1; j >= 0; j-- {
		ci, ret := gi.GetComputeInstanceProfileInfo(j, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		if ret != nvml.SUCCESS || ci.SliceCount != info.SliceCount {
			continue
		}
		_, ret = gi.CreateComputeInstance(&ci)
		must(ret, "CreateComputeInstance")
		emit(map[string]any{"gi": giInfo.Id, "start": giInfo.Placement.Start, "ci_profile": ci.Id})
		return
	}
	fmt.Fprintln(os.Stderr, "goprobe: no full-size compute instance profile")
	os.Exit(3)
}

func destroyAll(d nvml.Device) {
	n := 0
	for i := 0; i < nvml.GPU_INSTANCE_PROFILE_COUNT; i++ {
		info, ret := d.GetGpuInstanceProfileInfo(i)
		if ret != nvml.SUCCESS {
			continue
		}
		gis, ret := d.GetGpuInstances(&info)
		must(ret, "GetGpuInstances")
		for _, gi := range gis {
			for j := 0; j < nvml.COMPUTE_INSTANCE_PROFILE_COUNT; j++ {
				ciInfo, ret := gi.GetComputeInstanceProfileInfo(j, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
				if ret != nvml.SUCCESS {
					continue
				}
				cis, ret := gi.GetComputeInstances(&ciInfo)
				must(ret, "GetComputeInstances")
				for _, ci := range cis {
					must(ci.Destroy(), "ComputeInstance.Destroy")
					n++
				}
			}
			must(gi.Destroy(), "GpuInstance.Destroy")
			n++
		}
	}
	emit(map[string]int{"destroyed": n})
}

func threads(lib nvml.Interface, n int) {
	var wg sync.WaitGroup
	errs := make(chan string, n)
	for t := 0; t < n; t++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread() // each goroutine its own OS thread: Python sees n threads
			for k := 0; k < 5; k++ {
				count, ret := lib.DeviceGetCount()
				if ret != nvml.SUCCESS {
					errs <- fmt.Sprintf("DeviceGetCount: %v", ret)
					return
				}
				for i := 0; i < count; i++ {
					d, ret := lib.DeviceGetHandleByIndex(i)
					if ret != nvml.SUCCESS {
						errs <- fmt.Sprintf("DeviceGetHandleByIndex: %v", ret)
						return
					}
					if _, ret := d.GetName(); ret != nvml.SUCCESS {
						errs <- fmt.Sprintf("GetName: %v", ret)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	var failed []string
	for e := range errs {
		failed = append(failed, e)
	}
	emit(map[string]any{"threads": n, "errors": failed})
}

func wait(lib nvml.Interface, ms int) {
	set, ret := lib.EventSetCreate()
	must(ret, "EventSetCreate")
	d, ret := lib.DeviceGetHandleByIndex(0)
	must(ret, "DeviceGetHandleByIndex")
	must(d.RegisterEvents(nvml.EventTypeXidCriticalError, set), "RegisterEvents")
	_, ret = set.Wait(uint32(ms))
	must(set.Free(), "EventSetFree")
	emit(map[string]int{"wait": int(ret)})
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: goprobe dump|errors|create|destroy-all|mig|threads|wait|hold ...")
		os.Exit(2)
	}
	lib := nvml.New()
	must(lib.Init(), "Init")
	switch os.Args[1] {
	case "dump":
		dump(lib)
	case "errors":
		errorsProbe(lib)
		return
	case "create":
		index, err := strconv.Atoi(os.Args[3])
		check(err)
		create(lib, gpuArg(lib, os.Args[2]), index)
	case "destroy-all":
		destroyAll(gpuArg(lib, os.Args[2]))
	case "mig":
		mode, err := strconv.Atoi(os.Args[3])
		check(err)
		status, ret := gpuArg(lib, os.Args[2]).SetMigMode(mode)
		must(ret, "SetMigMode")
		emit(map[string]int{"activation": int(status)})
	case "threads":
		n, err := strconv.Atoi(os.Args[2])
		check(err)
		threads(lib, n)
	case "wait":
		ms, err := strconv.Atoi(os.Args[2])
		check(err)
		wait(lib, ms)
	case "hold":
		fmt.Println("open")
		_, _ = io.Copy(io.Discard, os.Stdin)
	default:
		fmt.Fprintf(os.Stderr, "goprobe: unknown command %q\n", os.Args[1])
		os.Exit(2)
	}
	must(lib.Shutdown(), "Shutdown")
}
