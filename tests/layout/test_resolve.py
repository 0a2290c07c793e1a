"""resolve / check_text: selectors, filters, claims, per-model MIG names, warnings."""

from __future__ import annotations

import textwrap

import pytest

from gpud.layout import DesiredGpu, check_text, parse_layout, resolve
from gpud.layout.resolve import Resolution, gpu_profiles
from gpud.model import Gpu, NvmlGpu, PciFunction
from gpud.profiles import MODELS, model_name
from tests.support.gpus import gpu_uuid, host, make_gpu
from tests.support.present import present

H200_VALID = "1g.18gb, 1g.18gb+me, 1g.35gb, 2g.35gb, 3g.71gb, 4g.71gb, 7g.141gb"
H100_VALID = "1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb"


def check(text: str, gpus: list[Gpu], **kw: str) -> Resolution:
    return check_text(textwrap.dedent(text).lstrip("\n"), "layout.yaml", gpus, **kw)


def errs(r: Resolution) -> list[str]:
    return [str(e) for e in r.errors]


def warns(r: Resolution) -> list[str]:
    return [str(w) for w in r.warnings]


SPEC = """
version: v1
selected: partial-mig
layouts:
  partial-mig:
    - devices: [0]
      device-filter: "0x233510DE"
      workload: container
      mig-enabled: true
      mig-devices: {"1g.10gb": 4, "3g.40gb": 1}
    - devices: [1, 2, 3, 4, 5, 6, 7]
      mig-enabled: false
"""


def test_spec_message_for_a_name_of_another_model() -> None:
    gpus = [make_gpu("h200", 0, "0000:3b:00.0")] + [make_gpu("h200", i) for i in range(1, 8)]
    r = check(SPEC, gpus)
    assert errs(r) == [
        f'layout.yaml:9 layouts.partial-mig[0].mig-devices."1g.10gb": 1g.10gb is not a MIG profile of NVIDIA H200 '
        f"at 0000:3b:00.0; valid: {H200_VALID}",
        f'layout.yaml:9 layouts.partial-mig[0].mig-devices."3g.40gb": 3g.40gb is not a MIG profile of NVIDIA H200 '
        f"at 0000:3b:00.0; valid: {H200_VALID}",
    ]
    assert r.desired == {} and r.layout is None and r.selected == "partial-mig"


def test_partial_mig_on_h100_host(h100x8: list[Gpu]) -> None:
    r = check(SPEC.replace("0x233510DE", "0x233010DE"), h100x8)
    assert r.ok and r.warnings == []
    assert list(r.desired) == [g.pci for g in h100x8]
    assert r.desired["0000:18:00.0"] == DesiredGpu(
        pci="0000:18:00.0", index=0, entry="layouts.partial-mig[0]", workload="container",
        mig_enabled=True, mig_devices={"1g.10gb": 4, "3g.40gb": 1})
    assert r.desired["0000:88:00.0"] == DesiredGpu(
        pci="0000:88:00.0", index=7, entry="layouts.partial-mig[1]", mig_enabled=False)
    assert r.layout is not None and r.layout.policy.on_busy == "wait"


# -- selectors -----------------------------------------------------------------------------------


def test_selectors_index_pci_uuid() -> None:
    gpus = host("h100-80gb", "h100-80gb", "h100-80gb", "l40s")
    text = f"""
    version: v1
    layouts:
      a:
        - devices: [0]
          mig-enabled: false
        - devices: ["28:00.0"]
          workload: vm-passthrough
        - devices: ["{gpu_uuid('0000:38:00.0').upper().replace('GPU-', 'GPU-')}"]
          workload: vm-vgpu
        - devices: ["0000:48:00.0"]
    """
    r = check(text, gpus)
    assert r.ok, errs(r)
    assert {pci: (d.index, d.entry, d.workload) for pci, d in r.desired.items()} == {
        "0000:18:00.0": (0, "layouts.a[0]", "container"),
        "0000:28:00.0": (1, "layouts.a[1]", "vm-passthrough"),
        "0000:38:00.0": (2, "layouts.a[2]", "vm-vgpu"),
        "0000:48:00.0": (3, "layouts.a[3]", "container"),
    }
    assert r.desired["0000:48:00.0"].mig_enabled is None


def test_unknown_selectors(h100x8: list[Gpu]) -> None:
    text = """
    version: v1
    layouts:
      a:
        - devices: [8, "0000:3b:00.0", GPU-00000000-0000-0000-0000-000000000000, 7]
    """
    assert errs(check(text, h100x8)) == [
        "layout.yaml:4 layouts.a[0].devices[0]: no GPU with index 8; this host has 8 managed GPUs (indices 0-7)",
        "layout.yaml:4 layouts.a[0].devices[1]: no managed GPU at 0000:3b:00.0; this host has 8 managed GPUs (indices 0-7)",
        "layout.yaml:4 layouts.a[0].devices[2]: no GPU with UUID GPU-00000000-0000-0000-0000-000000000000",
    ]


def test_unknown_selectors_on_empty_or_vfio_host() -> None:
    text = "version: v1\nlayouts:\n  a:\n    - devices: [0, GPU-00000000-0000-0000-0000-000000000000]\n"
    assert errs(check(text, [])) == [
        "layout.yaml:4 layouts.a[0].devices[0]: no GPU with index 0; this host has no managed GPUs",
        "layout.yaml:4 layouts.a[0].devices[1]: no GPU with UUID GPU-00000000-0000-0000-0000-000000000000",
    ]
    gpus = [make_gpu("h200", 0, nvml=False), make_gpu("h200", 1)]
    text = "version: v1\nlayouts:\n  a:\n    - devices: [5, GPU-00000000-0000-0000-0000-000000000000]\n"
    assert errs(check(text, gpus)) == [
        "layout.yaml:4 layouts.a[0].devices[0]: no GPU with index 5; this host has 2 managed GPUs (indices 0-1)",
        "layout.yaml:4 layouts.a[0].devices[1]: no GPU with UUID GPU-00000000-0000-0000-0000-000000000000; "
        "the UUID of a GPU is known once NVML has seen it (1 of 2 were never seen on the nvidia driver)",
    ]
    one = [make_gpu("h200", 0)]
    assert errs(check("version: v1\nlayouts:\n  a:\n    - devices: [1]\n", one)) == [
        "layout.yaml:4 layouts.a[0].devices[0]: no GPU with index 1; this host has 1 managed GPU (indices 0-0)"]


def test_index_counts_gpus_on_every_driver() -> None:
    """Index 1 is the second GPU in PCI order even when the first sits on vfio-pci (no NVML)."""
    gpus = [make_gpu("h200", 0, nvml=False), make_gpu("h200", 1)]
    r = check("version: v1\nlayouts:\n  a:\n    - devices: [1]\n      mig-enabled: false\n", gpus)
    assert list(r.desired) == ["0000:28:00.0"]


def test_selector_path_after_dropped_items_points_at_the_file() -> None:
    text = """
    version: v1
    layouts:
      a:
        - mig-enabled: false
        - devices: [x, 9]
    """
    r = check(text, host("h200"))
    assert errs(r) == [
        'layout.yaml:4 layouts.a[0]: missing key "devices" ("all" or a list of GPU indices, PCI addresses or GPU UUIDs)',
        'layout.yaml:5 layouts.a[1].devices[0]: expected an index, PCI address or GPU UUID, got "x"',
        "layout.yaml:5 layouts.a[1].devices[1]: no GPU with index 9; this host has 1 managed GPU (indices 0-0)",
    ]


# -- claims --------------------------------------------------------------------------------------


def test_two_entries_claim_one_gpu(h100x8: list[Gpu]) -> None:
    text = """
    version: v1
    layouts:
      a:
        - devices: [0, 1]
          mig-enabled: false
        - devices: [2, "0000:28:00.0"]
          workload: vm-passthrough
        - devices: all
    """
    r = check(text, h100x8)
    assert errs(r) == [
        "layout.yaml:6 layouts.a[1].devices[1]: GPU 1 (0000:28:00.0) is also selected by layouts.a[0]; "
        "a GPU may be in one entry only",
        *(f"layout.yaml:8 layouts.a[2].devices: GPU {i} ({g.pci}) is also selected by layouts.a[{0 if i < 2 else 1}]; "
          "a GPU may be in one entry only" for i, g in enumerate(h100x8[:3])),
    ]
    assert r.desired == {}


def test_one_entry_naming_a_gpu_twice_is_fine(h100x8: list[Gpu]) -> None:
    r = check('version: v1\nlayouts:\n  a:\n    - devices: [0, "0000:18:00.0"]\n', h100x8)
    assert r.ok and list(r.desired) == ["0000:18:00.0"]


# -- device-filter -------------------------------------------------------------------------------


def test_device_filter_narrows_all() -> None:
    gpus = host("h100-80gb", "h200", "a100-80gb", "l40s")
    text = """
    version: v1
    layouts:
      a:
        - devices: all
          device-filter: ["0x233010DE", "10de:20b5"]
          mig-enabled: true
          mig-devices: {"1g.10gb": 7}
        - devices: all
          device-filter: 0x233510DE
          mig-enabled: true
          mig-devices: {"1g.18gb": 7}
    """
    r = check(text, gpus)
    assert r.ok, errs(r)
    assert {p: (d.entry, d.mig_devices) for p, d in r.desired.items()} == {
        "0000:18:00.0": ("layouts.a[0]", {"1g.10gb": 7}),
        "0000:28:00.0": ("layouts.a[1]", {"1g.18gb": 7}),
        "0000:38:00.0": ("layouts.a[0]", {"1g.10gb": 7}),
    }
    assert warns(r) == ["layout.yaml:3 layouts.a: GPU 3 (0000:48:00.0, NVIDIA L40S) is not in layout a; left untouched"]


def test_device_filter_narrows_explicit_devices() -> None:
    gpus = host("h100-80gb", "h200")
    r = check('version: v1\nlayouts:\n  a:\n    - devices: [0, 1]\n      device-filter: "10de:2335"\n', gpus)
    assert r.ok and list(r.desired) == ["0000:28:00.0"]
    assert warns(r) == [
        "layout.yaml:3 layouts.a: GPU 0 (0000:18:00.0, NVIDIA H100 80GB HBM3) is not in layout a; left untouched"]


def test_device_filter_vendor_must_match_too() -> None:
    gpus = host("h200")
    r = check('version: v1\nlayouts:\n  a:\n    - devices: all\n      device-filter: "0x23351234"\n', gpus)
    assert r.ok and r.desired == {}


# -- MIG names against each GPU's own table ------------------------------------------------------


def test_mixed_host_same_name_checked_per_model() -> None:
    """mig-parted #157: an H100 and an H200 in one layout, each checked against its own table."""
    gpus = host("h100-80gb", "h200")
    text = """
    version: v1
    layouts:
      a:
        - devices: all
          mig-enabled: true
          mig-devices: {"1g.10gb": 7}
    """
    assert errs(check(text, gpus)) == [
        f'layout.yaml:6 layouts.a[0].mig-devices."1g.10gb": 1g.10gb is not a MIG profile of NVIDIA H200 '
        f"at 0000:28:00.0; valid: {H200_VALID}"]
    text = text.replace('"1g.10gb": 7', '"1g.18gb": 7')
    assert errs(check(text, gpus)) == [
        f'layout.yaml:6 layouts.a[0].mig-devices."1g.18gb": 1g.18gb is not a MIG profile of NVIDIA H100 80GB HBM3 '
        f"at 0000:18:00.0; valid: {H100_VALID}"]


def test_mixed_host_per_model_entries_resolve() -> None:
    gpus = host("h100-80gb", "h200")
    text = """
    version: v1
    layouts:
      a:
        - devices: [0]
          mig-enabled: true
          mig-devices: {"1g.10gb": 4, "3g.40gb": 1}
        - devices: [1]
          mig-enabled: true
          mig-devices: {"1g.18gb": 4, "3g.71gb": 1, "1g.18gb+me": 0}
    """
    r = check(text, gpus)
    assert r.ok, errs(r)
    assert r.desired["0000:28:00.0"].mig_devices == {"1g.18gb": 4, "3g.71gb": 1}


def test_same_error_on_many_gpus_is_one_issue(h200x8: list[Gpu]) -> None:
    r = check('version: v1\nlayouts:\n  a:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {"2g.20gb": 3}\n', h200x8)
    assert errs(r) == [
        'layout.yaml:6 layouts.a[0].mig-devices."2g.20gb": 2g.20gb is not a MIG profile of NVIDIA H200 at '
        f"0000:18:00.0, 0000:28:00.0, 0000:38:00.0 and 5 more; valid: {H200_VALID}"]
    r = check('version: v1\nlayouts:\n  a:\n    - devices: [1, 3]\n      mig-enabled: true\n      mig-devices: {"2g.20gb": 3}\n', h200x8)
    assert errs(r) == [
        'layout.yaml:6 layouts.a[0].mig-devices."2g.20gb": 2g.20gb is not a MIG profile of NVIDIA H200 at '
        f"0000:28:00.0, 0000:48:00.0; valid: {H200_VALID}"]


def test_compute_instance_names() -> None:
    gpus = host("h100-80gb")
    ok = check('version: v1\nlayouts:\n  a:\n    - devices: all\n      mig-enabled: true\n'
               '      mig-devices: {"1c.3g.40gb": 3, "2c.4g.40gb": 1}\n', gpus)
    assert ok.ok, errs(ok)
    bad = check('version: v1\nlayouts:\n  a:\n    - devices: all\n      mig-enabled: true\n'
                '      mig-devices: {"3c.4g.40gb": 1, "1c.3g.71gb": 1}\n', gpus)
    assert errs(bad) == [
        'layout.yaml:6 layouts.a[0].mig-devices."3c.4g.40gb": 3c.4g.40gb: a 4g.40gb instance of NVIDIA H100 80GB HBM3 '
        "at 0000:18:00.0 cannot hold 3c compute instances; valid: 1c.4g.40gb, 2c.4g.40gb, 4c.4g.40gb",
        'layout.yaml:6 layouts.a[0].mig-devices."1c.3g.71gb": 1c.3g.71gb is not a MIG profile of NVIDIA H100 80GB HBM3 '
        f"at 0000:18:00.0; valid: {H100_VALID}",
    ]


def test_mig_on_a_non_mig_gpu() -> None:
    gpus = host("l40s", "h100-80gb", "l40s")
    text = "version: v1\nlayouts:\n  a:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {}\n"
    assert errs(check(text, gpus)) == [
        "layout.yaml:5 layouts.a[0].mig-enabled: NVIDIA L40S at 0000:18:00.0, 0000:38:00.0 does not support MIG"]
    r = check(text.replace("true", "false").replace("      mig-devices: {}\n", ""), gpus)
    assert r.ok and all(d.mig_enabled is False for d in r.desired.values())


def test_gpu_on_vfio_checked_against_the_known_table() -> None:
    gpus = [make_gpu("h200", 0, "0000:3b:00.0", nvml=False)]
    r = check('version: v1\nlayouts:\n  a:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {"1g.10gb": 1}\n', gpus)
    assert errs(r) == [
        'layout.yaml:6 layouts.a[0].mig-devices."1g.10gb": 1g.10gb is not a MIG profile of NVIDIA H200 at '
        f"0000:3b:00.0; valid: {H200_VALID}"]


def _unknown_gpu(index: int, device: int = 0x9999, vendor: int = 0x10DE) -> Gpu:
    fn = PciFunction(address=f"0000:{0x18 + 0x10 * index:02x}:00.0", vendor=vendor, device=device,
                     subsystem_vendor=vendor, subsystem_device=0, class_code=0x030200, driver="vfio-pci")
    return Gpu(index=index, function=fn)


def test_unknown_model_off_nvml_is_a_warning() -> None:
    gpus = [_unknown_gpu(0)]
    r = check('version: v1\nlayouts:\n  a:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {"1g.10gb": 1}\n', gpus)
    assert r.ok
    assert warns(r) == [
        "layout.yaml:5 layouts.a[0].mig-enabled: cannot check MIG profiles of GPU 10de:9999 at 0000:18:00.0: "
        "NVML does not see it and its model is not known to gpud"]
    assert r.desired["0000:18:00.0"].mig_devices == {"1g.10gb": 1}


def test_nvml_table_wins_over_the_static_one() -> None:
    """A driver may expose fewer (or renamed) profiles than the static table: NVML is the truth."""
    base = make_gpu("h100-80gb", 0)
    profiles = tuple(p for p in MODELS["h100-80gb"].profiles if p.id in (19, 0))
    gpu = Gpu(index=0, function=base.function, nvml=NvmlGpu(
        pci=base.pci, uuid=present(base.nvml).uuid, name="NVIDIA H100 80GB HBM3", mig_capable=True, profiles=profiles))
    r = check('version: v1\nlayouts:\n  a:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {"3g.40gb": 2}\n', [gpu])
    assert errs(r) == [
        'layout.yaml:6 layouts.a[0].mig-devices."3g.40gb": 3g.40gb is not a MIG profile of NVIDIA H100 80GB HBM3 at '
        "0000:18:00.0; valid: 1g.10gb, 7g.80gb"]


def test_nvml_says_not_mig_capable() -> None:
    base = make_gpu("h100-80gb", 0)
    gpu = Gpu(index=0, function=base.function, nvml=NvmlGpu(pci=base.pci, uuid="GPU-x", name="NVIDIA H100 80GB HBM3"))
    assert gpu_profiles(gpu) == ()
    r = check("version: v1\nlayouts:\n  a:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {}\n", [gpu])
    assert errs(r) == ["layout.yaml:5 layouts.a[0].mig-enabled: NVIDIA H100 80GB HBM3 at 0000:18:00.0 does not support MIG"]


def test_gpu_profiles_and_model_fallbacks() -> None:
    assert gpu_profiles(make_gpu("h200", 0)) == MODELS["h200"].profiles
    assert gpu_profiles(make_gpu("h200", 0, nvml=False)) == MODELS["h200"].profiles
    assert gpu_profiles(make_gpu("l40s", 0, nvml=False)) == ()
    assert gpu_profiles(_unknown_gpu(0)) is None
    assert gpu_profiles(_unknown_gpu(0, device=0x2335, vendor=0x1234)) is None
    assert model_name(_unknown_gpu(0)) == "GPU 10de:9999"
    assert model_name(make_gpu("h200", 0, nvml=False)) == "NVIDIA H200"
    nvml_without_table = Gpu(index=0, function=make_gpu("h200", 0).function,
                             nvml=NvmlGpu(pci="0000:18:00.0", uuid="GPU-x", name="", mig_capable=True))
    assert gpu_profiles(nvml_without_table) == MODELS["h200"].profiles
    assert model_name(nvml_without_table) == "NVIDIA H200"


def test_layouts_not_selected_are_not_checked_against_the_host() -> None:
    text = """
    version: v1
    selected: h200
    layouts:
      h100: [{devices: all, mig-enabled: true, mig-devices: {"1g.10gb": 7}}]
      h200: [{devices: all, mig-enabled: true, mig-devices: {"1g.18gb": 7}}]
    """
    r = check(text, host("h200"))
    assert r.ok and r.selected == "h200"


# -- warnings, errors and the whole-or-nothing rule ----------------------------------------------


def test_uncovered_gpus_warned(h200x8: list[Gpu]) -> None:
    r = check("version: v1\nlayouts:\n  a:\n    - devices: [0, 1, 2, 3, 4, 5]\n", h200x8)
    assert r.ok and len(r.desired) == 6
    assert warns(r) == [
        "layout.yaml:3 layouts.a: GPU 6 (0000:78:00.0, NVIDIA H200) is not in layout a; left untouched",
        "layout.yaml:3 layouts.a: GPU 7 (0000:88:00.0, NVIDIA H200) is not in layout a; left untouched",
    ]


def test_empty_layout_changes_nothing(h200x8: list[Gpu]) -> None:
    r = check("version: v1\nlayouts:\n  as-is: []\n", h200x8)
    assert r.ok and r.desired == {} and len(r.warnings) == 8 and r.selected == "as-is"


def test_parse_and_host_errors_reported_together() -> None:
    text = """
    version: v2
    layouts:
      a:
        - devices: [0]
          mig-enabled: true
          mig-devices: {"1g.10gb": 1}
        - devices: [4]
    """
    r = check(text, host("h200"))
    assert errs(r) == [
        'layout.yaml:1 version: expected "v1", got "v2"',
        f'layout.yaml:6 layouts.a[0].mig-devices."1g.10gb": 1g.10gb is not a MIG profile of NVIDIA H200 at 0000:18:00.0; '
        f"valid: {H200_VALID}",
        "layout.yaml:7 layouts.a[1].devices[0]: no GPU with index 4; this host has 1 managed GPU (indices 0-0)",
    ]
    assert r.desired == {} and r.warnings == [] and r.layout is None


def test_nothing_to_resolve() -> None:
    r = check("layouts: [\n", host("h200"))
    assert len(r.errors) == 1 and r.desired == {} and r.selected is None
    r = check("version: v1\nlayouts:\n  a: []\n  b: []\n", host("h200"))
    assert errs(r) == ['layout.yaml:2 selected: missing; layouts has 2 layouts, so "selected" must name one of: a, b']
    assert r.selected is None


def test_resolve_takes_a_parsed_layout(h100x8: list[Gpu]) -> None:
    parsed = parse_layout(textwrap.dedent(SPEC).lstrip().replace("0x233510DE", "0x233010DE"))
    assert resolve(parsed, h100x8) == check(SPEC.replace("0x233510DE", "0x233010DE"), h100x8)


def test_warnings_and_errors_have_paths() -> None:
    r = check(SPEC, host(*["h200"] * 3))
    assert r.errors and all(e.path and e.line for e in r.errors)


@pytest.mark.parametrize("n", [0, 1, 8])
def test_all_disabled_any_host(n: int) -> None:
    gpus = host(*["h100-80gb"] * n)
    r = check("version: v1\nmig-configs:\n  all-disabled:\n    - devices: all\n      mig-enabled: false\n", gpus)
    assert r.ok and len(r.desired) == n
    assert all(d.entry == "mig-configs.all-disabled[0]" for d in r.desired.values())


def _grouped(*drivers: str) -> list[Gpu]:
    """GPUs 0.. of one IOMMU group (a PCIe switch without ACS), on the given drivers."""
    import msgspec

    gpus = host(*["h100-80gb"] * len(drivers))
    return [msgspec.structs.replace(g, function=msgspec.structs.replace(g.function, iommu_group=7, driver=drv),
                                    nvml=g.nvml if drv == "nvidia" else None)
            for g, drv in zip(gpus, drivers, strict=True)]


def test_a_layout_splitting_an_iommu_group_across_drivers_is_refused() -> None:
    """Issue 33 item 1: GPUs 0 and 1 share IOMMU group 7; passthrough for one and containers for
    the other was accepted, and the GPUs were moved between the drivers forever."""
    gpus = _grouped("nvidia", "nvidia")
    r = check("""
        version: v1
        layouts:
          a:
            - devices: [0]
              workload: vm-passthrough
            - devices: [1]
              workload: container
        """, gpus)
    assert errs(r) == [
        "layout.yaml:4 layouts.a[0]: IOMMU group 7 would be split across drivers (GPU 0 (0000:18:00.0) vfio-pci: "
        "vm-passthrough by layouts.a[0]; GPU 1 (0000:28:00.0) nvidia: container by layouts.a[1]); a group is one "
        "unit: give all its GPUs vm-passthrough, or none of them"]
    assert r.desired == {}


def test_a_gpu_left_out_counts_at_its_driver_and_is_never_a_companion() -> None:
    gpus = _grouped("nvidia", "nvidia")
    r = check("version: v1\nlayouts:\n  a:\n    - devices: [0]\n      workload: vm-passthrough\n", gpus)
    assert len(errs(r)) == 1 and "GPU 1 (0000:28:00.0) nvidia: not in the layout, stays on nvidia" in errs(r)[0]
    both = check("version: v1\nlayouts:\n  a:\n    - devices: [0, 1]\n      workload: vm-passthrough\n", gpus)
    assert errs(both) == [] and set(both.desired) == {g.pci for g in gpus}
    none = check("version: v1\nlayouts:\n  a:\n    - devices: [0, 1]\n      workload: container\n", gpus)
    assert errs(none) == []
