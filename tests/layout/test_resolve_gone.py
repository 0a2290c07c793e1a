"""resolve with GPUs gone from the bus (issue 13 item 1): a selector naming a gone GPU selects nothing
and is no error; no other GPU answers to its index; `all` and `device-filter` entries say the set changed."""

from __future__ import annotations

import textwrap

from gpud.layout import parse_layout, resolve
from gpud.model import KnownGpu
from gpud.profiles import MODELS
from tests.support.gpus import make_gpu

GONE = KnownGpu(index=0, pci="0000:18:00.0", vendor=0x10DE, device=MODELS["h100-80gb"].device,
                model="NVIDIA H100 80GB HBM3", uuid="GPU-00000000-0000-0000-0000-000000000000")
PRESENT = [make_gpu("h100-80gb", 1), make_gpu("h100-80gb", 2)]  # indices 1 and 2 kept


def resolved(text: str):
    return resolve(parse_layout(textwrap.dedent(text).lstrip("\n"), "layout.yaml"), PRESENT, gone=[GONE])


def test_index_of_a_gone_gpu_selects_nothing_and_is_not_an_error():
    r = resolved("""
        version: v1
        layouts:
          t:
            - devices: [0]
              mig-enabled: true
              mig-devices: {"1g.10gb": 7}
            - devices: [1, 2]
              mig-enabled: false
        """)
    assert r.errors == []
    assert sorted(r.desired) == [g.pci for g in PRESENT]
    assert all(d.mig_enabled is False for d in r.desired.values())  # nobody inherits GPU 0's MIG layout
    assert [str(w) for w in r.warnings] == [
        "layout.yaml:4 layouts.t[0].devices[0]: GPU 0 (0000:18:00.0, NVIDIA H100 80GB HBM3) is gone from the "
        "PCI bus; this entry selects nothing there until it returns (its index is never given to another GPU)"]


def test_pci_address_and_uuid_of_a_gone_gpu_too():
    for selector in ('"0000:18:00.0"', GONE.uuid):
        r = resolved(f"""
            version: v1
            layouts:
              t:
                - devices: [{selector}]
                  mig-enabled: false
            """)
        assert r.errors == [] and r.desired == {} and any("is gone from the PCI bus" in str(w) for w in r.warnings)


def test_an_index_nobody_ever_had_is_still_an_error_naming_the_indices_there_are():
    r = resolved("""
        version: v1
        layouts:
          t:
            - devices: [5]
              mig-enabled: false
        """)
    assert [str(e) for e in r.errors] == [
        "layout.yaml:4 layouts.t[0].devices[0]: no GPU with index 5; this host has 2 managed GPUs (indices 1-2)"]


def test_all_and_device_filter_entries_report_the_changed_set():
    r = resolved("""
        version: v1
        layouts:
          t:
            - devices: all
              device-filter: "10de:2330"
              mig-enabled: false
        """)
    assert r.errors == [] and len(r.desired) == 2
    assert [str(w) for w in r.warnings] == [
        "layout.yaml:4 layouts.t[0].devices: the GPU set changed: GPU 0 (0000:18:00.0, NVIDIA H100 80GB HBM3) "
        "is gone from the PCI bus; this entry (device-filter) now selects 2 GPUs present"]
    other = resolved("""
        version: v1
        layouts:
          t:
            - devices: all
              device-filter: "10de:2335"
              mig-enabled: false
        """)
    assert not any("GPU set changed" in str(w) for w in other.warnings)  # an H200 filter never covered it
