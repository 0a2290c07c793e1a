"""The models NVIDIA's own default MIG config knows are models gpud knows.

Oracle: the profile names that NVIDIA's gpu-operator ships in its default mig-parted config
(github.com/NVIDIA/gpu-operator, assets/state-mig-manager/0400_configmap.yaml, commit 0b0b6b15),
keyed by the PCI device ids its device-filters name, typed in here from that file. A layout that
uses NVIDIA's own names for a model must validate against gpud's table of that model, also when
NVML cannot see the GPU (it sits on vfio-pci) and only gpud's table can answer.
"""

from __future__ import annotations

import textwrap

import pytest

from gpud.layout.names import find_profile
from gpud.layout.resolve import check_text
from gpud.profiles import MODELS, by_device
from tests.support.gpus import host

NVIDIA_CONFIG = {
    0x20B0: ["1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"],  # A100-40GB
    0x20B5: ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],  # A100-80GB
    0x2330: ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],  # H100-80GB
    0x2321: ["1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"],  # H100 NVL
    0x2335: ["1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"],  # H200
    0x20B7: ["1g.6gb", "1g.6gb+me", "2g.12gb", "2g.12gb+me", "4g.24gb"],  # A30-24GB
    0x2348: ["1g.18gb", "1g.18gb+me", "1g.36gb", "2g.36gb", "3g.72gb", "4g.72gb", "7g.144gb"],  # GH200 144G
    0x2901: ["1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"],  # B200
    0x2941: ["1g.23gb", "1g.23gb+me", "1g.47gb", "2g.47gb", "3g.93gb"],  # GB200 HGX (all-balanced)
    0x2BB5: ["1g.24gb", "1g.24gb+me", "1g.24gb+gfx", "1g.24gb+me.all", "1g.24gb-me", "2g.48gb",
             "2g.48gb+gfx", "2g.48gb+me.all", "2g.48gb-me", "4g.96gb", "4g.96gb+gfx"],  # RTX PRO 6000
}
# Names the config has that the driver of gpud's capture did not offer yet (captures' READMEs):
OLDER_DRIVER = {0x20B5: {"1g.20gb"}, 0x20B7: {"2g.12gb+me"}}


@pytest.mark.parametrize("device", sorted(NVIDIA_CONFIG))
def test_nvidia_names_are_in_the_models_table(device: int) -> None:
    model = by_device(device)
    assert model is not None, f"gpud does not know PCI device 0x{device:04x}"
    missing = {n for n in NVIDIA_CONFIG[device] if find_profile(n, model.profiles) is None}
    assert missing == OLDER_DRIVER.get(device, set())


@pytest.mark.parametrize("key", ["b200", "gb200", "gh200-144gb", "gh200-96gb", "rtx-pro-6000", "a30"])
def test_a_layout_with_nvidia_names_validates_on_a_gpu_nvml_cannot_see(key: str) -> None:
    """On vfio-pci only gpud's table answers: every name of the model validates, no warning that
    the profiles cannot be checked."""
    names = [p.name for p in MODELS[key].profiles]
    gpus = host(key, nvml=False)
    for name in names:
        text = textwrap.dedent(f"""\
            version: v1
            layouts:
              a:
                - devices: [0]
                  mig-enabled: true
                  mig-devices: {{"{name}": 1}}
            """)
        r = check_text(text, "layout.yaml", gpus)
        assert r.ok, (name, [str(e) for e in r.errors])
        assert not [str(w) for w in r.warnings if "cannot check" in str(w)], name


def test_a_name_of_another_model_is_rejected_with_the_valid_names() -> None:
    gpus = host("rtx-pro-6000", nvml=False)
    text = 'version: v1\nlayouts:\n  a:\n    - devices: [0]\n      mig-enabled: true\n      mig-devices: {"1g.23gb": 1}\n'
    r = check_text(text, "layout.yaml", gpus)
    assert [str(e) for e in r.errors] == [
        'layout.yaml:6 layouts.a[0].mig-devices."1g.23gb": 1g.23gb is not a MIG profile of NVIDIA RTX PRO 6000 '
        "Blackwell Server Edition at 0000:18:00.0; valid: 1g.24gb, 1g.24gb+gfx, 1g.24gb+me, 1g.24gb+me.all, "
        "1g.24gb-me, 2g.48gb, 2g.48gb+gfx, 2g.48gb+me.all, 2g.48gb-me, 4g.96gb, 4g.96gb+gfx"]
