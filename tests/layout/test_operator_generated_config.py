"""Issue 29 item 11: what the GPU Operator generates loads unchanged. Since 26.3 it writes a per-node
ConfigMap `<node>-mig-config` whose mig-parted config has no `selected` (the node label chooses),
and its device filters may carry the subsystem id: `0xDEVVEN:0xSUBDEVSUBVEN`, matched on all four
ids as mig-parted's DeviceID.Matches does (NVIDIA/mig-parted pkg/types/device.go). The subsystem
ids of the cards are the models' own (gpud/profiles.py: H100 SXM 10de:16c1, H200 10de:18bf)."""

from __future__ import annotations

import textwrap

from gpud.layout import parse_layout, resolve
from tests.support.gpus import make_gpu

GENERATED = textwrap.dedent("""\
    version: v1
    mig-configs:
      all-disabled:
        - devices: all
          mig-enabled: false
      all-1g.10gb:
        - device-filter: ["0x233010DE:0x16C110DE"]
          devices: all
          mig-enabled: true
          mig-devices:
            1g.10gb: 7
        - device-filter: ["0x233510DE:0x18BF10DE", "0x233510DE:0xFFFF10DE"]
          devices: all
          mig-enabled: true
          mig-devices:
            1g.18gb: 7
      other-board:
        - device-filter: "0x233010DE:0x123410DE"
          devices: all
          mig-enabled: true
          mig-devices:
            7g.80gb: 1
    """)


def test_the_generated_per_node_config_loads_as_it_is_and_subsystems_match_exactly():
    gpus = [make_gpu("h100-80gb", 0), make_gpu("h200", 1)]
    for name in ("all-disabled", "all-1g.10gb", "other-board"):
        parsed = parse_layout(GENERATED, "node1-mig-config.yaml", label_selects=True, select=name)
        assert parsed.errors == [], parsed.errors
        res = resolve(parsed, gpus)
        assert res.errors == [], (name, res.errors)
        if name == "all-1g.10gb":
            assert {p: d.mig_devices for p, d in res.desired.items()} == {
                gpus[0].pci: {"1g.10gb": 7}, gpus[1].pci: {"1g.18gb": 7}}
        if name == "other-board":  # the H100 here is subsystem 10de:16c1, not 10de:1234: not selected
            assert res.desired == {}
    # without a label's choice nothing is in force, and that is no error
    parsed = parse_layout(GENERATED, "node1-mig-config.yaml", label_selects=True)
    assert parsed.errors == [] and parsed.layout is not None and parsed.layout.selected is None


def test_a_malformed_subsystem_filter_is_an_error_with_its_line():
    text = GENERATED.replace('"0x233010DE:0x16C110DE"', '"0x233010DE:16C110DE"')
    parsed = parse_layout(text, "c.yaml", label_selects=True)
    assert [str(e) for e in parsed.errors] == [
        'c.yaml:7 mig-configs."all-1g.10gb"[0].device-filter[0]: expected a PCI id like "0x233010DE" (device id, '
        'then vendor id), "0x233010DE:0x16C110DE" (then the subsystem\'s) or "10de:2330", got "0x233010DE:16C110DE"']
