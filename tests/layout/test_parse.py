"""parse_layout: every rule, with file:line and key path asserted exactly."""

from __future__ import annotations

import textwrap

import msgspec
import pytest

from gpud.layout.parse import ParsedLayout, parse_layout
from gpud.layout.schema import (
    DEFAULT_MATCH,
    DeviceEntry,
    Hook,
    Hooks,
    Layout,
    MatchRule,
    PciId,
    Policy,
)
from gpud.layout.yaml_reader import key_path
from gpud.pci import normalize_pci
from tests.support.present import present


def parse(text: str, file: str = "layout.yaml") -> ParsedLayout:
    return parse_layout(textwrap.dedent(text).lstrip("\n"), file)


def errors(text: str) -> list[str]:
    return [str(e) for e in parse(text).errors]


def only_error(text: str) -> str:
    errs = errors(text)
    assert len(errs) == 1, errs
    return errs[0]


SPEC = """
version: v1
selected: partial-mig          # entry of `layouts` in force; optional when there is only one
layouts:                       # `mig-configs` accepted as a synonym: mig-parted files load unchanged
  partial-mig:
    - devices: [0]             # "all" | list of index, PCI address ("0000:3b:00.0") or GPU UUID
      device-filter: "0x233010DE"   # optional; mig-parted form, or "10de:2330"; string or list
      workload: container      # container (default) | vm-passthrough | vm-vgpu
      mig-enabled: true
      mig-devices: {"1g.10gb": 4, "3g.40gb": 1}
    - devices: [1, 2, 3, 4, 5, 6, 7]
      mig-enabled: false
match:                         # which PCI functions gpud manages
  - {vendor: "0x10de", class: "0x0302"}
policy:
  drain-units: [nvidia-dcgm.service]
  on-busy: wait                # wait | fail
  reset: per-gpu               # per-gpu | never
  reboot: never                # never | allow
hooks: {}
"""


# -- the example of the spec ---------------------------------------------------------------------


def test_spec_example_parses() -> None:
    p = parse(SPEC)
    assert p.errors == [] and p.warnings == [] and p.ok
    assert p.layout == Layout(
        version="v1",
        selected="partial-mig",
        layouts={
            "partial-mig": (
                DeviceEntry(devices=(0,), device_filter=(PciId(0x10DE, 0x2330),), workload="container",
                            mig_enabled=True, mig_devices={"1g.10gb": 4, "3g.40gb": 1}),
                DeviceEntry(devices=(1, 2, 3, 4, 5, 6, 7), mig_enabled=False),
            )
        },
        match=(MatchRule(vendor=0x10DE, class_=0x0302),),
        policy=Policy(drain_units=("nvidia-dcgm.service",)),
        hooks=Hooks(),
    )
    assert p.draft == p.layout
    assert p.layout.entries == p.layout.layouts["partial-mig"]


def test_spec_example_lines() -> None:
    p = parse(SPEC)
    assert p.line("version") == 1
    assert p.line("selected") == 2
    assert p.line("layouts") == 3
    assert p.line("layouts.partial-mig") == 4
    assert p.line("layouts.partial-mig[0]") == 5
    assert p.line("layouts.partial-mig[0].devices") == 5
    assert p.line("layouts.partial-mig[0].devices[0]") == 5
    assert p.line("layouts.partial-mig[0].mig-devices") == 9
    assert p.line('layouts.partial-mig[0].mig-devices."1g.10gb"') == 9
    assert p.line("layouts.partial-mig[1].devices[6]") == 10
    assert p.line("layouts.partial-mig[1].mig-enabled") == 11
    assert p.line("policy.reboot") == 18
    assert p.line("nope") is None


def test_layout_encodes_back_to_file_keys() -> None:
    encoded = msgspec.json.decode(msgspec.json.encode(parse(SPEC).layout))
    entry = encoded["layouts"]["partial-mig"][0]
    assert entry["mig-enabled"] is True and entry["device-filter"] == [{"vendor": 0x10DE, "device": 0x2330}]
    assert encoded["policy"]["drain-units"] == ["nvidia-dcgm.service"]
    assert encoded["match"] == [{"vendor": 0x10DE, "device": None, "class": 0x0302}]


def test_file_name_in_messages() -> None:
    p = parse("version: v2\nlayouts: {a: []}\n", file="/etc/gpud/layout.yaml")
    assert [str(e) for e in p.errors] == ['/etc/gpud/layout.yaml:1 version: expected "v1", got "v2"']


def test_minimal_defaults() -> None:
    p = parse("version: v1\nlayouts:\n  only: []\n")
    assert p.ok
    assert p.layout == Layout(version="v1", selected="only", layouts={"only": ()})
    assert p.layout.match == DEFAULT_MATCH and p.layout.policy == Policy() and p.layout.hooks == Hooks()


def test_null_layout_is_empty() -> None:
    p = parse("version: v1\nlayouts:\n  nothing:\n")
    assert p.ok and present(p.layout).layouts == {"nothing": ()}


def test_null_optional_sections_mean_defaults() -> None:
    p = parse("version: v1\nselected:\nlayouts: {a: []}\nmatch:\npolicy:\nhooks:\n")
    assert p.ok and present(p.layout).selected == "a" and present(p.layout).match == DEFAULT_MATCH


# -- YAML-level problems -------------------------------------------------------------------------


def test_yaml_syntax_error_is_one_issue_with_line() -> None:
    text = "version: v1\nlayouts:\n  a:\n    - devices: [0\n  b: []\n"
    p = parse_layout(text)
    assert len(p.errors) == 1 and p.layout is None and p.draft is None
    issue = p.errors[0]
    assert issue.path == "" and issue.line == 5
    assert str(issue).startswith("layout.yaml:5: invalid YAML: ")


def test_yaml_mapping_values_not_allowed() -> None:
    assert only_error("version: v1\nlayouts: a: b\n") == (
        "layout.yaml:2: invalid YAML: mapping values are not allowed here")


def test_tab_indentation() -> None:
    err = only_error("version: v1\nlayouts:\n\ta: []\n")
    assert err == ("layout.yaml:3: invalid YAML: while scanning for the next token, "
                   "found character '\\t' that cannot start any token")


def test_control_character() -> None:
    err = only_error("version: v1\x07\n")
    assert err.startswith("layout.yaml: invalid YAML: ")


def test_two_documents() -> None:
    err = only_error("version: v1\nlayouts: {a: []}\n---\nversion: v1\n")
    assert err == ("layout.yaml:3: invalid YAML: expected a single document in the stream, "
                   "but found another document")


def test_undefined_alias() -> None:
    assert only_error("version: v1\nlayouts: *nope\n").startswith("layout.yaml:2: invalid YAML: found undefined alias")


def test_empty_file() -> None:
    for text in ("", "\n", "# only a comment\n"):
        assert errors(text) == ['layout.yaml: the file is empty; expected a mapping starting with "version: v1"']


def test_top_level_not_a_mapping() -> None:
    assert only_error("- version: v1\n") == (
        'layout.yaml:1: expected a mapping with "version: v1" and "layouts", got a list')
    assert only_error("v1\n") == 'layout.yaml:1: expected a mapping with "version: v1" and "layouts", got "v1"'


def test_not_text() -> None:
    p = parse_layout(b"version: v1")  # type: ignore[arg-type]
    assert [str(e) for e in p.errors] == ["layout.yaml: expected text, got bytes"]


def test_duplicate_top_level_key() -> None:
    assert only_error("version: v1\nlayouts: {a: []}\nversion: v1\n") == (
        "layout.yaml:3 version: duplicate key (first at line 1)")


def test_duplicate_layout_name() -> None:
    text = """
    version: v1
    layouts:
      a: []
      a:
        - devices: all
    """
    assert only_error(text) == "layout.yaml:4 layouts.a: duplicate key (first at line 3)"


def test_duplicate_mig_device_name() -> None:
    text = """
    version: v1
    layouts:
      a:
        - devices: all
          mig-enabled: true
          mig-devices:
            1g.10gb: 2
            "1g.10gb": 3
    """
    assert only_error(text) == 'layout.yaml:8 layouts.a[0].mig-devices."1g.10gb": duplicate key (first at line 7)'


def test_non_scalar_key() -> None:
    assert only_error("version: v1\nlayouts: {a: []}\n? [x]\n: 1\n") == (
        "layout.yaml:3: keys must be plain names, got a list")


def test_null_key() -> None:
    assert only_error("version: v1\nlayouts: {a: []}\n~: 1\n") == "layout.yaml:3: keys must be plain names, got nothing"


# -- top level -----------------------------------------------------------------------------------


def test_unknown_top_level_key() -> None:
    assert only_error("version: v1\nlayouts: {a: []}\nlayout: {}\n") == (
        'layout.yaml:3 layout: unknown key "layout"; did you mean "layouts"? '
        "allowed: version, selected, layouts, mig-configs, vgpu-configs, match, policy, hooks")
    assert only_error("version: v1\nlayouts: {a: []}\nzzz: 1\n") == (
        'layout.yaml:3 zzz: unknown key "zzz"; allowed: version, selected, layouts, mig-configs, vgpu-configs, match, policy, hooks')


def test_unknown_key_path_is_quoted_when_needed() -> None:
    assert only_error("version: v1\nlayouts: {a: []}\nfoo bar: 1\n").startswith(
        'layout.yaml:3 "foo bar": unknown key "foo bar";')


@pytest.mark.parametrize(
    ("value", "got"),
    [("v2", '"v2"'), ("1", "1"), ('"1"', '"1"'), ("[v1]", "a list"), ("V1", '"V1"'), ("1.0", "1.0")],
)
def test_version(value: str, got: str) -> None:
    assert only_error(f"version: {value}\nlayouts: {{a: []}}\n") == f'layout.yaml:1 version: expected "v1", got {got}'


def test_version_missing() -> None:
    assert only_error("layouts: {a: []}\n") == 'layout.yaml:1 version: missing; expected "version: v1"'


def test_layouts_missing() -> None:
    assert only_error("version: v1\n") == (
        'layout.yaml:1 layouts: missing; expected "layouts" (or its synonym "mig-configs" or "vgpu-configs")')


def test_layouts_and_mig_configs() -> None:
    assert only_error("version: v1\nlayouts: {a: []}\nmig-configs: {b: []}\n") == (
        'layout.yaml:3 mig-configs: use either "layouts" or its synonym "mig-configs", not both')


def test_layouts_empty_mapping() -> None:
    assert only_error("version: v1\nlayouts: {}\n") == (
        "layout.yaml:2 layouts: at least one layout is required (a layout may have no entries)")


def test_layouts_not_a_mapping() -> None:
    assert only_error("version: v1\nlayouts: [a]\n") == (
        "layout.yaml:2 layouts: expected a mapping of layout name -> list of entries, got a list")


def test_layout_not_a_list() -> None:
    assert only_error("version: v1\nlayouts:\n  a: {devices: all}\n") == (
        "layout.yaml:3 layouts.a: expected a list of device entries, got a mapping")


def test_empty_layout_name() -> None:
    assert only_error('version: v1\nlayouts:\n  "": []\n') == 'layout.yaml:3 layouts."": a layout name must not be empty'


def test_selected_one_layout_is_implicit() -> None:
    assert present(parse("version: v1\nmig-configs:\n  only: []\n").layout).selected == "only"


def test_selected_required_with_several() -> None:
    assert only_error("version: v1\nlayouts:\n  a: []\n  b: []\n") == (
        'layout.yaml:2 selected: missing; layouts has 2 layouts, so "selected" must name one of: a, b')


def test_selected_unknown() -> None:
    assert only_error("version: v1\nselected: c\nlayouts:\n  a: []\n  b: []\n") == (
        'layout.yaml:2 selected: "c" is not a layout in layouts; one of: a, b')


def test_selected_not_a_name() -> None:
    assert only_error("version: v1\nselected: [a]\nlayouts:\n  a: []\n") == (
        "layout.yaml:2 selected: expected the name of a layout, got a list")


def test_selected_names_an_invalid_layout_reports_only_the_layout() -> None:
    p = parse("version: v1\nselected: a\nlayouts:\n  a: 5\n  b: []\n")
    assert [str(e) for e in p.errors] == ["layout.yaml:4 layouts.a: expected a list of device entries, got 5"]
    assert p.draft is not None and p.draft.selected is None


def test_selected_numeric_name() -> None:
    p = parse("version: v1\nselected: 1\nlayouts:\n  1: []\n  2: []\n")
    assert p.ok and present(p.layout).selected == "1"


def test_selected_with_mig_configs_message_uses_that_word() -> None:
    assert only_error("version: v1\nmig-configs:\n  a: []\n  b: []\n") == (
        'layout.yaml:2 selected: missing; mig-configs has 2 layouts, so "selected" must name one of: a, b')


# -- device entries ------------------------------------------------------------------------------


def entry(body: str, *, layout: str = "a") -> str:
    """A file whose only layout `a` has the entries in `body` (already indented by 4)."""
    return f"version: v1\nlayouts:\n  {layout}:\n" + textwrap.indent(textwrap.dedent(body).strip("\n"), "    ") + "\n"


def test_entry_not_a_mapping() -> None:
    assert only_error(entry("- 0")) == (
        'layout.yaml:4 layouts.a[0]: expected a device entry (a mapping with "devices"), got 0')


def test_unknown_entry_key() -> None:
    assert only_error(entry("- devices: all\n  mig-device: {}")) == (
        'layout.yaml:5 layouts.a[0].mig-device: unknown key "mig-device"; did you mean "mig-devices"? '
        "allowed: devices, device-filter, workload, mig-enabled, mig-devices, vgpu-devices")


def test_devices_missing() -> None:
    assert only_error(entry("- mig-enabled: false")) == (
        'layout.yaml:4 layouts.a[0]: missing key "devices" ("all" or a list of GPU indices, PCI addresses or GPU UUIDs)')
    assert only_error(entry("- devices:\n  mig-enabled: false")) == (
        'layout.yaml:4 layouts.a[0]: missing key "devices" ("all" or a list of GPU indices, PCI addresses or GPU UUIDs)')


def test_devices_all() -> None:
    p = parse(entry("- devices: all"))
    assert p.ok and present(p.layout).entries == (DeviceEntry(devices="all"),)


@pytest.mark.parametrize(("value", "got"), [("0", "0"), ("ALL", '"ALL"'), ("{}", "a mapping"), ('"0"', '"0"')])
def test_devices_bad_shape(value: str, got: str) -> None:
    assert only_error(entry(f"- devices: {value}")) == (
        f'layout.yaml:4 layouts.a[0].devices: expected "all" or a list of GPU indices, PCI addresses or GPU UUIDs, got {got}')


def test_devices_empty_list() -> None:
    assert only_error(entry("- devices: []")) == (
        'layout.yaml:4 layouts.a[0].devices: must not be empty; list at least one GPU, or use "all"')


def test_selectors_normalised() -> None:
    text = entry("""
    - devices:
        - 0
        - 7
        - "0000:3B:00.0"
        - 5e:00.0
        - 0000:00:01.0
        - "10000:e1:00.0"
        - GPU-0C1E3B9A-1234-5678-9ABC-DEF012345678
        - 3
    """)
    p = parse(text)
    assert p.ok, p.errors
    assert present(p.layout).entries[0].devices == (
        0, 7, "0000:3b:00.0", "0000:5e:00.0", "0000:00:01.0", "10000:e1:00.0",
        "GPU-0c1e3b9a-1234-5678-9abc-def012345678", 3)


@pytest.mark.parametrize(
    ("item", "got"),
    [
        ('"gpu1"', '"gpu1"'),
        ("gpu1", '"gpu1"'),
        ("-1", None),
        ("1.5", "1.5"),
        ("true", "true"),
        ("~", "nothing"),
        ("[0]", "a list"),
        ("3b:00", '"3b:00"'),
        ("3b:00.8", '"3b:00.8"'),
        ("3b:20.0", '"3b:20.0"'),
        ("GPU-1234", '"GPU-1234"'),
        ('"0"', '"0"'),
    ],
)
def test_selector_errors(item: str, got: str | None) -> None:
    text = f"version: v1\nlayouts:\n  partial-mig:\n    - devices: [0, {item}]\n"
    expected = (
        "layout.yaml:4 layouts.partial-mig[0].devices[1]: expected a GPU index >= 0, got -1"
        if got is None
        else f"layout.yaml:4 layouts.partial-mig[0].devices[1]: expected an index, PCI address or GPU UUID, got {got}"
    )
    assert only_error(text) == expected


def test_selector_error_spec_wording() -> None:
    text = """
    version: v1
    selected: partial-mig
    layouts:
      partial-mig:
        - devices: [0]
          mig-enabled: false
        - devices: [1, gpu1]
    """
    assert only_error(text) == (
        'layout.yaml:7 layouts.partial-mig[1].devices[1]: expected an index, PCI address or GPU UUID, got "gpu1"')


def test_selector_listed_twice() -> None:
    assert errors(entry('- devices: [0, 1, 0, "3b:00.0", "0000:3b:00.0"]')) == [
        "layout.yaml:4 layouts.a[0].devices[2]: GPU 0 is listed twice (also layouts.a[0].devices[0])",
        "layout.yaml:4 layouts.a[0].devices[4]: 0000:3b:00.0 is listed twice (also layouts.a[0].devices[3])",
    ]


def test_device_filter_forms() -> None:
    text = entry("""
    - devices: all
      device-filter: 0x233010DE
    - devices: all
      device-filter: "10DE:2335"
    - devices: all
      device-filter: ["0x233110de", 10de:2321, "0x233010DE"]
    """)
    p = parse(text)
    assert p.ok, p.errors
    assert [e.device_filter for e in present(p.layout).entries] == [
        (PciId(0x10DE, 0x2330),),
        (PciId(0x10DE, 0x2335),),
        (PciId(0x10DE, 0x2331), PciId(0x10DE, 0x2321), PciId(0x10DE, 0x2330)),
    ]


def test_device_filter_dedupes() -> None:
    p = parse(entry('- devices: all\n  device-filter: ["10de:2330", "0x233010DE"]'))
    assert present(p.layout).entries[0].device_filter == (PciId(0x10DE, 0x2330),)


@pytest.mark.parametrize(
    ("value", "path", "got"),
    [
        ('"0x2330"', "device-filter", '"0x2330"'),
        ("H100", "device-filter", '"H100"'),
        ("10de-2330", "device-filter", '"10de-2330"'),
        ("0x233010DEAA", "device-filter", "0x233010DEAA"),
        ('["10de:2330", bogus]', "device-filter[1]", '"bogus"'),
        ("[[0x233010DE]]", "device-filter[0]", "a list"),
    ],
)
def test_device_filter_errors(value: str, path: str, got: str) -> None:
    """mig-parted silently ignored filters it could not parse; here they are errors."""
    assert only_error(entry(f"- devices: all\n  device-filter: {value}")) == (
        f'layout.yaml:5 layouts.a[0].{path}: expected a PCI id like "0x233010DE" (device id, then vendor id), '
        f'"0x233010DE:0x16C110DE" (then the subsystem\'s) or "10de:2330", got {got}')


def test_device_filter_not_a_list() -> None:
    assert only_error(entry("- devices: all\n  device-filter: {a: 1}")) == (
        'layout.yaml:5 layouts.a[0].device-filter: expected a PCI id like "0x233010DE" or "10de:2330", '
        "or a list of them, got a mapping")


def test_device_filter_empty_list() -> None:
    assert only_error(entry("- devices: all\n  device-filter: []")) == (
        "layout.yaml:5 layouts.a[0].device-filter: must not be empty; leave device-filter out to match every GPU")


@pytest.mark.parametrize("workload", ["container", "vm-passthrough", "vm-vgpu"])
def test_workloads(workload: str) -> None:
    p = parse(entry(f"- devices: all\n  workload: {workload}"))
    assert p.ok and present(p.layout).entries[0].workload == workload


def test_workload_default_is_container() -> None:
    assert present(parse(entry("- devices: all")).layout).entries[0].workload == "container"


def test_workload_unknown() -> None:
    assert only_error(entry("- devices: all\n  workload: vm")) == (
        'layout.yaml:5 layouts.a[0].workload: expected one of container, vm-passthrough, vm-vgpu, got "vm"')


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("false", False), ("yes", True), ("off", False)])
def test_mig_enabled_yaml_booleans(value: str, expected: bool) -> None:
    extra = "\n  mig-devices: {}" if expected else ""
    p = parse(entry(f"- devices: all\n  mig-enabled: {value}{extra}"))
    assert p.ok and present(p.layout).entries[0].mig_enabled is expected


def test_mig_enabled_absent_is_none() -> None:
    assert present(parse(entry("- devices: all")).layout).entries[0].mig_enabled is None


def test_mig_enabled_not_bool() -> None:
    assert only_error(entry('- devices: all\n  mig-enabled: "true"')) == (
        'layout.yaml:5 layouts.a[0].mig-enabled: expected true or false, got "true"')
    assert only_error(entry("- devices: all\n  mig-enabled: 1")) == (
        "layout.yaml:5 layouts.a[0].mig-enabled: expected true or false, got 1")


def test_mig_enabled_true_needs_mig_devices() -> None:
    assert only_error(entry("- devices: all\n  mig-enabled: true")) == (
        "layout.yaml:5 layouts.a[0].mig-enabled: mig-enabled: true needs mig-devices "
        "(use {} for MIG on with no instances)")


def test_mig_enabled_true_with_empty_mig_devices_is_mig_parted_all_enabled() -> None:
    p = parse(entry("- devices: all\n  mig-enabled: true\n  mig-devices: {}"))
    assert p.ok and present(p.layout).entries[0] == DeviceEntry(devices="all", mig_enabled=True, mig_devices={})


def test_mig_enabled_false_forbids_mig_devices() -> None:
    assert only_error(entry('- devices: all\n  mig-enabled: false\n  mig-devices: {"1g.10gb": 1}')) == (
        "layout.yaml:6 layouts.a[0].mig-devices: mig-enabled: false forbids mig-devices")
    assert parse(entry("- devices: all\n  mig-enabled: false\n  mig-devices: {}")).ok  # as mig-parted


def test_mig_devices_without_mig_enabled() -> None:
    assert only_error(entry('- devices: all\n  mig-devices: {"1g.10gb": 1}')) == (
        "layout.yaml:5 layouts.a[0].mig-devices: mig-devices needs mig-enabled: true")


def test_mig_devices_zero_counts_are_dropped() -> None:
    p = parse(entry('- devices: all\n  mig-enabled: true\n  mig-devices: {"1g.10gb": 0, "3g.40gb": 1}'))
    assert p.ok and present(p.layout).entries[0].mig_devices == {"3g.40gb": 1}


def test_mig_devices_names_kept_as_written() -> None:
    p = parse(entry('- devices: all\n  mig-enabled: true\n  mig-devices: {"1c.3g.40gb": 3, 1g.10gb+me: 1}'))
    assert p.ok and present(p.layout).entries[0].mig_devices == {"1c.3g.40gb": 3, "1g.10gb+me": 1}


def test_mig_device_name_syntax() -> None:
    assert only_error(entry('- devices: all\n  mig-enabled: true\n  mig-devices: {"1g10gb": 1}')) == (
        'layout.yaml:6 layouts.a[0].mig-devices.1g10gb: "1g10gb" is not a MIG device name; '
        "expected [Nc.]Ng.NNgb[+me|+me.all|-me|+gfx], e.g. 1g.10gb, 1g.10gb+me, 1c.3g.40gb, 1g.24gb+gfx, "
        "2g.48gb-me")


@pytest.mark.parametrize(("value", "got"), [("-1", "-1"), ("1.5", "1.5"), ('"2"', '"2"'), ("~", "nothing"), ("[1]", "a list")])
def test_mig_device_count(value: str, got: str) -> None:
    assert only_error(entry(f'- devices: all\n  mig-enabled: true\n  mig-devices: {{"1g.10gb": {value}}}')) == (
        f'layout.yaml:6 layouts.a[0].mig-devices."1g.10gb": expected a count >= 0, got {got}')


def test_mig_devices_not_a_mapping() -> None:
    assert only_error(entry("- devices: all\n  mig-enabled: true\n  mig-devices: [1g.10gb]")) == (
        'layout.yaml:6 layouts.a[0].mig-devices: expected a mapping of MIG device name -> count, or "dynamic", got a list')


def test_vm_passthrough_with_mig() -> None:
    assert only_error(entry("- devices: all\n  workload: vm-passthrough\n  mig-enabled: true\n  mig-devices: {}")) == (
        "layout.yaml:6 layouts.a[0].mig-enabled: vm-passthrough gives the whole GPU to a VM through vfio-pci; "
        "MIG needs the nvidia driver (use workload: container or vm-vgpu)")
    assert parse(entry("- devices: all\n  workload: vm-passthrough\n  mig-enabled: false")).ok


def test_vgpu_devices() -> None:
    p = parse(entry('- devices: all\n  workload: vm-vgpu\n  vgpu-devices: {"H200X-1-18C": 4, A100-4C: 0}'))
    assert p.ok and present(p.layout).entries[0].vgpu_devices == {"H200X-1-18C": 4}


def test_vgpu_devices_need_vm_vgpu() -> None:
    assert only_error(entry('- devices: all\n  vgpu-devices: {"H200X-1-18C": 4}')) == (
        "layout.yaml:5 layouts.a[0].vgpu-devices: vgpu-devices needs workload: vm-vgpu")


def test_vgpu_devices_shape() -> None:
    assert errors(entry('- devices: all\n  workload: vm-vgpu\n  vgpu-devices: {"H200X 1": 4, "H200X-1-18C": x}')) == [
        'layout.yaml:6 layouts.a[0].vgpu-devices."H200X 1": "H200X 1" is not a vGPU type name; expected e.g. "H200X-1-18C"',
        'layout.yaml:6 layouts.a[0].vgpu-devices.H200X-1-18C: expected a count >= 0, got "x"',
    ]
    assert only_error(entry("- devices: all\n  workload: vm-vgpu\n  vgpu-devices: [a]")) == (
        "layout.yaml:6 layouts.a[0].vgpu-devices: expected a mapping of vGPU type name -> count, got a list")


def test_many_errors_at_once_in_file_order() -> None:
    text = """
    version: v2
    layouts:
      a:
        - devices: [x]
          workload: vm
          mig-enabled: maybe
        - devices: all
          bogus: 1
    policy:
      on-busy: kill
    """
    assert errors(text) == [
        'layout.yaml:1 version: expected "v1", got "v2"',
        'layout.yaml:4 layouts.a[0].devices[0]: expected an index, PCI address or GPU UUID, got "x"',
        'layout.yaml:5 layouts.a[0].workload: expected one of container, vm-passthrough, vm-vgpu, got "vm"',
        'layout.yaml:6 layouts.a[0].mig-enabled: expected true or false, got "maybe"',
        'layout.yaml:8 layouts.a[1].bogus: unknown key "bogus"; allowed: devices, device-filter, workload, '
        "mig-enabled, mig-devices, vgpu-devices",
        'layout.yaml:10 policy.on-busy: expected one of wait, fail, got "kill"',
    ]


def test_layout_is_none_when_errors_but_draft_kept() -> None:
    p = parse(entry("- devices: [0, x]\n- mig-enabled: false\n- devices: [1]"))
    assert p.layout is None and not p.ok
    assert p.draft is not None
    assert p.draft.entries == (DeviceEntry(devices=(0,)), DeviceEntry(devices=(1,)))
    # the dropped entry [1] renumbers the draft: [1] in the draft is [2] in the file
    assert p.origin("layouts.a[1]") == "layouts.a[2]"
    assert p.origin("layouts.a[0]") == "layouts.a[0]"


# -- YAML anchors and merge keys -----------------------------------------------------------------


def test_aliases_and_merge_keys() -> None:
    text = """
    version: v1
    layouts:
      a:
        - &base
          devices: [0]
          mig-enabled: true
          mig-devices: &split {"3g.40gb": 2}
        - <<: *base
          devices: [1]
        - devices: [2]
          mig-enabled: true
          mig-devices: *split
    """
    p = parse(text)
    assert p.ok, p.errors
    assert [e.devices for e in present(p.layout).entries] == [(0,), (1,), (2,)]
    assert all(e.mig_devices == {"3g.40gb": 2} for e in present(p.layout).entries)


def test_merge_of_non_mapping() -> None:
    assert only_error(entry("- <<: 5\n  devices: all")) == (
        "layout.yaml:4 layouts.a[0]: a merge key (<<) takes a mapping or a list of mappings, got 5")


def test_recursive_alias_does_not_hang() -> None:
    p = parse_layout("version: v1\nlayouts: &l\n  a: *l\n")
    assert [str(e) for e in p.errors] == ["layout.yaml:2 layouts.a: expected a list of device entries, got a mapping"]
    p = parse_layout("version: v1\nlayouts: {a: []}\npolicy: &p {<<: *p}\n")
    assert p.ok


# -- match ---------------------------------------------------------------------------------------


def test_match_forms() -> None:
    text = """
    version: v1
    layouts: {a: []}
    match:
      - {vendor: "0x10de", class: "0x0302"}
      - {vendor: 0x10de, class: 0300}
      - {vendor: 10DE, device: "0x2335"}
    """
    p = parse(text)
    assert p.ok, p.errors
    assert present(p.layout).match == (
        MatchRule(0x10DE, None, 0x0302), MatchRule(0x10DE, None, 0x0300), MatchRule(0x10DE, 0x2335, None))


def test_match_errors() -> None:
    text = """
    version: v1
    layouts: {a: []}
    match:
      - {class: "0x0302"}
      - {vendor: nvidia}
      - {vendor: "0x10de", subclass: 2}
      - 5
    """
    assert errors(text) == [
        'layout.yaml:4 match[0]: missing key "vendor" (e.g. "0x10de")',
        'layout.yaml:5 match[1].vendor: expected a 16-bit hex value like "0x10de", got "nvidia"',
        'layout.yaml:6 match[2].subclass: unknown key "subclass"; did you mean "class"? allowed: vendor, device, class',
        "layout.yaml:7 match[3]: expected a {vendor, device, class} rule, got 5",
    ]


def test_match_empty_or_not_a_list() -> None:
    assert only_error("version: v1\nlayouts: {a: []}\nmatch: []\n") == (
        "layout.yaml:3 match: must not be empty; leave match out for the default (NVIDIA display and 3D controllers)")
    assert only_error("version: v1\nlayouts: {a: []}\nmatch: {vendor: 0x10de}\n") == (
        "layout.yaml:3 match: expected a list of {vendor, device, class} rules, got a mapping")


# -- policy --------------------------------------------------------------------------------------


def test_policy_values() -> None:
    text = """
    version: v1
    layouts: {a: []}
    policy:
      drain-units: [nvidia-dcgm.service, dcgm-exporter.service, kubelet.service, foo@bar.service, x.socket,
                    nvidia-dcgm.service]
      on-busy: fail
      reset: never
      reboot: allow
    """
    p = parse(text)
    assert p.ok, p.errors
    assert present(p.layout).policy == Policy(
        drain_units=("nvidia-dcgm.service", "dcgm-exporter.service", "kubelet.service", "foo@bar.service", "x.socket"),
        on_busy="fail", reset="never", reboot="allow")


def test_policy_errors() -> None:
    text = """
    version: v1
    layouts: {a: []}
    policy:
      drain-units: [dcgm, "foo@.service", 5, "a b.service"]
      on-busy: kill
      reset: always
      reboot: yes
      retries: 3
    """
    suffixes = ".service, .socket, .device, .mount, .automount, .swap, .target, .path, .timer, .slice, .scope"
    assert errors(text) == [
        f'layout.yaml:4 policy.drain-units[0]: "dcgm" is not a systemd unit name; expected a name ending in one of {suffixes}',
        f'layout.yaml:4 policy.drain-units[1]: "foo@.service" is not a systemd unit name; expected a name ending in one of {suffixes}',
        'layout.yaml:4 policy.drain-units[2]: expected a systemd unit name like "nvidia-dcgm.service", got 5',
        f'layout.yaml:4 policy.drain-units[3]: "a b.service" is not a systemd unit name; expected a name ending in one of {suffixes}',
        'layout.yaml:5 policy.on-busy: expected one of wait, fail, got "kill"',
        'layout.yaml:6 policy.reset: expected one of per-gpu, never, got "always"',
        "layout.yaml:7 policy.reboot: expected one of never, allow, got yes",
        'layout.yaml:8 policy.retries: unknown key "retries"; allowed: drain-units, on-busy, reset, reboot, lease-group, '
        'lease-placement, lease-mig-mode, on-infeasible, apply, on-drift',
    ]


def test_policy_not_a_mapping() -> None:
    assert only_error("version: v1\nlayouts: {a: []}\npolicy: [wait]\n") == (
        "layout.yaml:3 policy: expected a mapping, got a list")
    assert only_error("version: v1\nlayouts: {a: []}\npolicy: {drain-units: dcgm.service}\n") == (
        'layout.yaml:3 policy.drain-units: expected a list of systemd unit names, got "dcgm.service"')


# -- hooks ---------------------------------------------------------------------------------------


def test_hooks_values() -> None:
    text = """
    version: v1
    layouts: {a: []}
    hooks:
      apply-start:
        - command: /usr/bin/logger
          args: [-t, gpud, 5, yes]
          env: {LANG: C, N: 1}
          timeout: 2.5
      pre-apply-mode: []
      pre-apply-config:
      apply-exit:
        - {command: /usr/bin/systemctl, args: [restart, nvidia-cdi-refresh.service], timeout: 30}
    """
    p = parse(text)
    assert p.ok, p.errors
    assert present(p.layout).hooks == Hooks(
        apply_start=(Hook("/usr/bin/logger", ("-t", "gpud", "5", "yes"), {"LANG": "C", "N": "1"}, 2.5),),
        apply_exit=(Hook("/usr/bin/systemctl", ("restart", "nvidia-cdi-refresh.service"), {}, 30.0),),
    )


def test_hooks_errors() -> None:
    text = """
    version: v1
    layouts: {a: []}
    hooks:
      apply-start:
        - command: logger
        - args: [x]
        - command: /bin/true
          args: "x"
        - command: /bin/true
          env: {"1BAD": x, OK: [1]}
        - command: /bin/true
          timeout: 0
        - {command: /bin/true, timeout: -1}
        - {command: /bin/true, timeout: .inf}
        - {command: /bin/true, timeout: "5"}
        - {command: /bin/true, cwd: /}
        - {command: /bin/true, env: [A=1]}
      post-apply: []
      apply-exit: {command: /bin/true}
    """
    prefix = "layout.yaml:{} hooks.apply-start[{}]"
    assert errors(text) == [
        f'{prefix.format(5, 0)}.command: "logger" is not an absolute path; hooks run without a shell or PATH',
        f'{prefix.format(6, 1)}: missing key "command" (an absolute path)',
        f'{prefix.format(8, 2)}.args: expected a list of strings, got "x"',
        f'{prefix.format(10, 3)}.env.1BAD: "1BAD" is not an environment variable name',
        f"{prefix.format(10, 3)}.env.OK: expected a string, got a list",
        f"{prefix.format(12, 4)}.timeout: expected a positive number of seconds, got 0",
        f"{prefix.format(13, 5)}.timeout: expected a positive number of seconds, got -1",
        f"{prefix.format(14, 6)}.timeout: expected a positive number of seconds, got .inf",
        f'{prefix.format(15, 7)}.timeout: expected a positive number of seconds, got "5"',
        f'{prefix.format(16, 8)}.cwd: unknown key "cwd"; allowed: command, args, env, timeout',
        f"{prefix.format(17, 9)}.env: expected a mapping of NAME -> value, got a list",
        'layout.yaml:18 hooks.post-apply: unknown key "post-apply"; '
        "allowed: apply-start, pre-apply-mode, pre-apply-config, apply-exit",
        "layout.yaml:19 hooks.apply-exit: expected a list of {command, args, env, timeout}, got a mapping",
    ]


def test_hooks_command_not_a_string() -> None:
    assert only_error("version: v1\nlayouts: {a: []}\nhooks: {apply-exit: [{command: [a]}]}\n") == (
        "layout.yaml:3 hooks.apply-exit[0].command: expected an absolute path, got a list")


# -- helpers -------------------------------------------------------------------------------------


def test_key_path() -> None:
    assert key_path("", "layouts") == "layouts"
    assert key_path("layouts", "partial-mig") == "layouts.partial-mig"
    assert key_path("a", "1g.10gb") == 'a."1g.10gb"'
    assert key_path("a", 'x"y') == 'a."x\\"y"'


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0000:3b:00.0", "0000:3b:00.0"), ("3B:00.0", "0000:3b:00.0"), ("1:3b:1f.7", "0001:3b:1f.7"),
     ("3b:00", None), ("3b:00.0 ", None), ("zz:00.0", None), ("3b:20.0", None)],
)
def test_normalize_pci(text: str, expected: str | None) -> None:
    assert normalize_pci(text) == expected


def test_a_bug_becomes_an_issue_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpud.layout import parse as parse_module

    def boom(self, root, top):
        raise KeyError("x")

    monkeypatch.setattr(parse_module._Parser, "layout", boom)
    p = parse_layout("version: v1\nlayouts: {a: []}\n")
    assert [str(e) for e in p.errors] == ["layout.yaml: internal error while reading the layout (KeyError: 'x')"]
    assert p.layout is None


def test_too_many_errors_are_capped() -> None:
    text = "version: v1\nlayouts:\n  a:\n    - devices: [" + ", ".join(["x"] * 150) + "]\n"
    p = parse_layout(text)
    assert len(p.errors) == 101 and str(p.errors[-1]) == "layout.yaml: 50 more errors not shown"


def test_explicit_tags_do_not_crash() -> None:
    text = 'version: v1\nlayouts:\n  a:\n    - devices: [!!int abc]\n      mig-enabled: !!bool maybe\n'
    assert errors(text) == [
        'layout.yaml:4 layouts.a[0].devices[0]: expected an index, PCI address or GPU UUID, got abc',
        'layout.yaml:5 layouts.a[0].mig-enabled: expected true or false, got maybe',
    ]


def test_null_mig_devices_means_none() -> None:
    p = parse(entry("- devices: all\n  mig-enabled: true\n  mig-devices:\n  workload: vm-vgpu\n  vgpu-devices:"))
    assert p.ok and present(p.layout).entries[0].mig_devices == {} and present(p.layout).entries[0].vgpu_devices == {}


def test_long_values_are_shortened() -> None:
    err = only_error(entry(f"- devices: [{'x' * 100}]"))
    assert err == ("layout.yaml:4 layouts.a[0].devices[0]: expected an index, PCI address or GPU UUID, "
                   f'got "{"x" * 57}..."')


def test_nested_merge_keys() -> None:
    text = """
    version: v1
    base: &base {mig-enabled: false}
    more: &more {<<: *base, workload: vm-passthrough}
    layouts:
      a:
        - <<: [*more]
          devices: all
    """
    p = parse(text)
    assert [e.path for e in p.errors] == ["base", "more"]  # unknown top-level keys, nothing else
    assert present(p.draft).entries == (DeviceEntry(devices="all", workload="vm-passthrough", mig_enabled=False),)


def test_hooks_shapes() -> None:
    assert only_error("version: v1\nlayouts: {a: []}\nhooks: [x]\n") == (
        "layout.yaml:3 hooks: expected a mapping, got a list")
    assert only_error("version: v1\nlayouts: {a: []}\nhooks: {apply-exit: [x]}\n") == (
        'layout.yaml:3 hooks.apply-exit[0]: expected a hook {command, args, env, timeout}, got "x"')
    assert only_error("version: v1\nlayouts: {a: []}\nhooks: {apply-exit: [{command: /x, timeout: [1]}]}\n") == (
        "layout.yaml:3 hooks.apply-exit[0].timeout: expected a positive number of seconds, got a list")
    assert only_error("version: v1\nlayouts: {a: []}\nhooks: {apply-exit: [{command: /x, timeout: !!float x}]}\n") == (
        "layout.yaml:3 hooks.apply-exit[0].timeout: expected a positive number of seconds, got x")
    assert only_error("version: v1\nlayouts: {a: []}\nhooks: {apply-exit: [{command: /x, args: [[1]]}]}\n") == (
        "layout.yaml:3 hooks.apply-exit[0].args[0]: expected a string, got a list")


def test_pci_id_str() -> None:
    assert str(PciId(0x10DE, 0x2330)) == "10de:2330"


def test_mig_devices_dynamic() -> None:
    p = parse(entry("- devices: all\n  mig-enabled: true\n  mig-devices: dynamic"))
    assert p.errors == [] and p.layout is not None
    assert p.layout.entries[0].mig_dynamic and p.layout.entries[0].mig_devices == {}


@pytest.mark.parametrize(("body", "message"), [
    ("- devices: all\n  mig-devices: dynamic", "layout.yaml:5 layouts.a[0].mig-devices: mig-devices needs mig-enabled: true"),
    ("- devices: all\n  mig-enabled: false\n  mig-devices: dynamic",
     "layout.yaml:6 layouts.a[0].mig-devices: mig-enabled: false forbids mig-devices"),
    ("- devices: all\n  workload: vm-vgpu\n  mig-enabled: true\n  mig-devices: dynamic",
     "layout.yaml:7 layouts.a[0].mig-devices: mig-devices: dynamic (instances made by leases) needs workload: "
     "container, not vm-vgpu"),
    ("- devices: all\n  mig-enabled: true\n  mig-devices: dynamik",
     'layout.yaml:6 layouts.a[0].mig-devices: expected a mapping of MIG device name -> count, or "dynamic", '
     'got "dynamik"'),
])
def test_mig_devices_dynamic_errors(body: str, message: str) -> None:
    assert only_error(entry(body)) == message


def test_lease_policy_keys() -> None:
    text = entry("- devices: all") + "policy:\n  lease-group: slurm\n  lease-placement: spread\n  lease-mig-mode: keep-on\n"
    p = parse(text)
    assert p.errors == [] and p.layout is not None
    assert (p.layout.policy.lease_group, p.layout.policy.lease_placement, p.layout.policy.lease_mig_mode) == (
        "slurm", "spread", "keep-on")
    bad = entry("- devices: all") + "policy:\n  lease-placement: scatter\n  lease-group: 'a b'\n"
    assert errors(bad) == [
        "layout.yaml:6 policy.lease-placement: expected one of pack, spread, got \"scatter\"",
        "layout.yaml:7 policy.lease-group: expected a group name, got \"a b\"",
    ]


@pytest.mark.parametrize(("written", "yaml11"), [
    ("010", 8),        # YAML 1.1 octal
    ("1_0", 10),       # YAML 1.1 digit separator
    ("0x1", 1),        # hex
    ("0b11", 3),       # binary
    ("1:0", 60),       # sexagesimal
])
def test_gpu_index_plain_decimal_only(written: str, yaml11: int) -> None:
    """Issue 33 item 8: `devices: [010]` used to select GPU 8 with no word; the key path says what YAML read."""
    assert only_error(entry(f"- devices: [{written}]")) == (
        f"layout.yaml:4 layouts.a[0].devices[0]: expected an index, PCI address or GPU UUID in plain decimal "
        f"(YAML 1.1 would read '{written}' as {yaml11}), got {written}")


def test_mig_count_plain_decimal_only() -> None:
    assert only_error(entry('- devices: all\n  mig-enabled: true\n  mig-devices: {"1g.10gb": 07}')) == (
        'layout.yaml:6 layouts.a[0].mig-devices."1g.10gb": expected a count >= 0 in plain decimal '
        "(YAML 1.1 would read '07' as 7), got 07")


def test_plain_decimal_indices_still_read() -> None:
    p = parse(entry("- devices: [0, 10, +3]"))
    assert p.ok and present(p.layout).entries[0].devices == (0, 10, 3)
