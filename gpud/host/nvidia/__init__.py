"""NVIDIA's driver and tools: NVML, nvidia-smi (GPU reset, queries), sriov-manage, vGPUs in sysfs, nvidia-ctk's CDI spec."""
