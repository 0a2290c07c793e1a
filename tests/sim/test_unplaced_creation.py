"""A GPU instance created without a placement (nvmlDeviceCreateGpuInstance, as nvidia-mig-parted
creates them) must be creatable as many times as the profile's published instance count allows
when the GPU is empty: real A30 and RTX PRO 6000 hosts take four 1g instances that way (mig-parted's
all-1g configs in its config-default.yaml target them). The counts come from the `nvidia-smi mig
-lgip` captures the tables were read from (Instances Total), not from the placement rule under test."""

from __future__ import annotations

import pynvml
import pytest

from gpud.profiles import MODELS
from gpud.sim import catalog, nvml_lib
from gpud.sim.cli import main as sim_main

MIG_MODELS = [k for k in catalog.offered() if MODELS[k].mig_capable]


@pytest.mark.parametrize("model", MIG_MODELS)
def test_every_profile_fills_an_empty_gpu_without_placements(tmp_path, model):
    host = tmp_path / "host"
    assert sim_main(["create", str(host), "--gpu", f"{model}:1", "--mig-on", "0"]) in (0, None)
    nvml_lib.install(str(host))
    try:
        pynvml.nvmlInit()
        dev = pynvml.nvmlDeviceGetHandleByIndex(0)
        by_id = {p.id: p for p in catalog.model(model).profiles}
        for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(dev, index)
            except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
                continue
            count = by_id[info.id].instance_count
            made = [pynvml.nvmlDeviceCreateGpuInstance(dev, info.id) for _ in range(count)]
            with pytest.raises(pynvml.NVMLError_InsufficientResources):
                pynvml.nvmlDeviceCreateGpuInstance(dev, info.id)
            for gi in made:
                pynvml.nvmlGpuInstanceDestroy(gi)
        pynvml.nvmlShutdown()
    finally:
        nvml_lib.uninstall()


def test_unplaced_1g_double_memory_gis_take_the_ids_a_gh200_gave_them(tmp_path):
    """github.com/kf-cuanschutz/NVIDIA_Grace_Hopper_benchmarking_logs_ (tests/fixtures/captures/
    gh200-96gb): `nvidia-smi mig -cgi 15,15,15 -C` on a GH200 96GB created GPU instances 5, 3 and 4,
    in that order (a GPU numbering its GIs in the "tree" order, GPU 0 of the simulated host)."""
    host = tmp_path / "host"
    assert sim_main(["create", str(host), "--gpu", "gh200-96gb:1", "--mig-on", "0"]) in (0, None)
    nvml_lib.install(str(host))
    try:
        pynvml.nvmlInit()
        dev = pynvml.nvmlDeviceGetHandleByIndex(0)
        ids = [pynvml.nvmlGpuInstanceGetInfo(pynvml.nvmlDeviceCreateGpuInstance(dev, 15)).id for _ in range(3)]
        assert ids == [5, 3, 4]
    finally:
        pynvml.nvmlShutdown()
        nvml_lib.uninstall()
