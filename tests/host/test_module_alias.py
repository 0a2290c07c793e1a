"""Which VFIO driver takes a device, from modules.alias, by the algorithm given with the kernel
change that added override-only ids (linux-pci, "PCI: Add a PCI_ID_F_VFIO_DRIVER_OVERRIDE flag to
struct pci_device_id", 2021): "vfio_" + the device's modalias, the matching alias with the fewest
'*'. The lines are the patch's own example and the nvgrace-gpu table's form."""

from __future__ import annotations

from gpud.host.kernel.module_alias import ModuleAliases

ALIASES = """\
alias pci:v000015B3d00001021sv*sd*bc*sc*i* mlx5_core
alias vfio_pci:v000015B3d00001021sv*sd*bc*sc*i* mlx5_vfio_pci
alias vfio_pci:v*d*sv*sd*bc*sc*i* vfio_pci
alias vfio_pci:v000010DEd00002342sv*sd*bc*sc*i* nvgrace_gpu_vfio_pci
alias pci:v000010DEd*sv*sd*bc03sc02i00* nvidia
"""


def test_the_most_specific_vfio_alias_wins(tmp_path):
    f = tmp_path / "modules.alias"
    f.write_text(ALIASES)
    a = ModuleAliases(str(f))
    assert a.vfio_variant("pci:v000015B3d00001021sv000015B3sd00000001bc02sc00i00") == "mlx5_vfio_pci"
    assert a.vfio_variant("pci:v000010DEd00002342sv000010DEsd00000000bc03sc02i00\n") == "nvgrace_gpu_vfio_pci"
    # only vfio_pci's own catch-all matches: plain vfio-pci
    assert a.vfio_variant("pci:v000010DEd00002335sv000010DEsd000018BFbc03sc02i00") is None
    assert a.vfio_variant(None) is None


def test_no_file_means_vfio_pci_and_a_new_file_is_read(tmp_path):
    f = tmp_path / "modules.alias"
    a = ModuleAliases(str(f))
    alias = "pci:v000010DEd00002342sv000010DEsd00000000bc03sc02i00"
    assert a.vfio_variant(alias) is None
    f.write_text(ALIASES)
    assert a.vfio_variant(alias) == "nvgrace_gpu_vfio_pci"


def test_every_vfio_pci_core_driver_counts_as_vfio():
    from gpud.pci import is_vfio

    assert is_vfio("vfio-pci") and is_vfio("nvgrace_gpu_vfio_pci") and is_vfio("mlx5_vfio_pci")
    assert not is_vfio("nvidia") and not is_vfio(None) and not is_vfio("")
