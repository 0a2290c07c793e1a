"""Which PCI functions are managed GPUs, and in which order."""

from __future__ import annotations

from gpud.layout.match import DEFAULT_MATCH, managed, matches
from gpud.layout.parse import parse_layout
from gpud.layout.schema import MatchRule
from gpud.model import PciFunction
from gpud.pci import pci_sort_key
from tests.support.present import present


def fn(address: str, vendor: int = 0x10DE, device: int = 0x2335, cls: int = 0x030200) -> PciFunction:
    return PciFunction(address=address, vendor=vendor, device=device, subsystem_vendor=vendor,
                       subsystem_device=0, class_code=cls)


HOST = [
    fn("0000:db:00.0"),                                   # H200 (3D controller)
    fn("0000:3b:00.0", device=0x26B1, cls=0x030000),       # RTX 6000 Ada (VGA)
    fn("0000:3b:00.1", device=0x22BA, cls=0x040300),       # its HD audio companion
    fn("0000:05:00.0", device=0x22A3, cls=0x068000),       # NVSwitch (bridge)
    fn("0000:02:00.0", vendor=0x1A03, device=0x2000, cls=0x030000),  # BMC VGA (ASPEED)
    fn("0000:1a:00.0", vendor=0x15B3, device=0x1021, cls=0x020700),  # NIC
    fn("0000:18:00.0"),
    fn("0000:18:00.4"),                                   # an SR-IOV VF of it (vGPU): not a GPU to manage
    fn("10000:e1:00.0"),                                  # behind a VMD domain
]


def test_default_match() -> None:
    assert [f.address for f in managed(HOST)] == [
        "0000:18:00.0", "0000:3b:00.0", "0000:db:00.0", "10000:e1:00.0"]
    assert managed(HOST) == managed(HOST, DEFAULT_MATCH)


def test_default_match_values() -> None:
    assert DEFAULT_MATCH == (MatchRule(0x10DE, None, 0x0300), MatchRule(0x10DE, None, 0x0302))


def test_class_rule() -> None:
    rules = (MatchRule(vendor=0x10DE, class_=0x0302),)
    assert [f.address for f in managed(HOST, rules)] == ["0000:18:00.0", "0000:db:00.0", "10000:e1:00.0"]


def test_device_rule() -> None:
    rules = (MatchRule(vendor=0x10DE, device=0x26B1),)
    assert [f.address for f in managed(HOST, rules)] == ["0000:3b:00.0"]


def test_vendor_only_rule_still_means_gpus() -> None:
    """A rule without class never picks NVSwitches or audio functions."""
    rules = (MatchRule(vendor=0x10DE),)
    assert [f.address for f in managed(HOST, rules)] == [
        "0000:18:00.0", "0000:3b:00.0", "0000:db:00.0", "10000:e1:00.0"]


def test_explicit_class_can_reach_other_classes() -> None:
    rules = (MatchRule(vendor=0x10DE, class_=0x0680),)
    assert [f.address for f in managed(HOST, rules)] == ["0000:05:00.0"]


def test_other_vendor() -> None:
    rules = (MatchRule(vendor=0x1A03, class_=0x0300),)
    assert [f.address for f in managed(HOST, rules)] == ["0000:02:00.0"]


def test_no_rules_no_gpus() -> None:
    assert managed(HOST, ()) == []
    assert managed([]) == []


def test_matches() -> None:
    assert matches(fn("0000:18:00.0"), MatchRule(0x10DE, 0x2335, 0x0302))
    assert not matches(fn("0000:18:00.0"), MatchRule(0x10DE, 0x2330, 0x0302))
    assert not matches(fn("0000:18:00.0"), MatchRule(0x10DE, None, 0x0300))
    assert not matches(fn("0000:18:00.0", vendor=0x1002), MatchRule(0x10DE))


def test_pci_sort_key_is_numeric() -> None:
    addresses = ["10000:00:00.0", "0000:0a:00.0", "0000:a0:00.0", "0000:09:1f.0", "0001:00:00.0", "bogus"]
    assert sorted(addresses, key=pci_sort_key) == [
        "0000:09:1f.0", "0000:0a:00.0", "0000:a0:00.0", "0001:00:00.0", "10000:00:00.0", "bogus"]


def test_match_from_a_file() -> None:
    p = parse_layout('version: v1\nlayouts: {a: []}\nmatch:\n  - {vendor: "0x10de", device: "0x26b1"}\n')
    assert [f.address for f in managed(HOST, present(p.layout).match)] == ["0000:3b:00.0"]


def test_malformed_address_is_not_managed() -> None:
    assert managed([fn("0000:18:00")]) == []
