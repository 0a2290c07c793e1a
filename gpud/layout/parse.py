"""layout.yaml v1, the grammar: YAML nodes (gpud.layout.yaml_reader) -> `Layout`, with every problem
reported at once, by file, line and key path. `parse_layout` never raises on bad input; the daemon
refuses to apply a file with errors and shows them all (mig-parted stopped at the first, or ignored
some).
"""

from __future__ import annotations

import math
import re
from typing import Literal

from msgspec import Struct, field
from yaml.nodes import MappingNode, Node, ScalarNode

from gpud.layout.desired import LayoutIssue
from gpud.layout.names import parse_mig_name
from gpud.layout.schema import (
    ALL_DISABLED,
    ALL_DISABLED_NAME,
    APPLY,
    DEFAULT_MATCH,
    DYNAMIC,
    HOOK_PHASES,
    LEASE_MIG_MODE,
    LEASE_PLACEMENT,
    ON_BUSY,
    ON_DRIFT,
    ON_INFEASIBLE,
    REBOOT,
    RESET,
    UNIT_SUFFIXES,
    WORKLOADS,
    DeviceEntry,
    Hook,
    Hooks,
    Layout,
    MatchRule,
    PciId,
    Policy,
)
from gpud.layout.yaml_reader import (
    FLOAT,
    INT,
    MERGE,
    NULL,
    SCALARS,
    STR,
    NodeReader,
    TooLarge,
    is_null,
    item_path,
    key_path,
    line_of,
    one_of,
    quote,
    yaml11_note,
)
from gpud.mig_text import SYNTAX
from gpud.pci import normalize_pci
from gpud.vgpu_types import strip_prefix

TOP_KEYS = ("version", "selected", "layouts", "mig-configs", "vgpu-configs", "match", "policy", "hooks")
# Synonyms of `layouts`, so mig-parted and vgpu-device-manager files load unchanged. Entries under
# `vgpu-configs` default to `workload: vm-vgpu`, as that is all vgpu-device-manager configures.
LAYOUTS_SYNONYMS = ("mig-configs", "vgpu-configs")
ENTRY_KEYS = ("devices", "device-filter", "workload", "mig-enabled", "mig-devices", "vgpu-devices")
MATCH_KEYS = ("vendor", "device", "class")
POLICY_KEYS = ("drain-units", "on-busy", "reset", "reboot", "lease-group", "lease-placement", "lease-mig-mode",
               "on-infeasible", "apply", "on-drift")
HOOK_KEYS = ("command", "args", "env", "timeout")

_UUID = re.compile(r"GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
# device id, then vendor id; optionally `:0x` subsystem device id, then subsystem vendor id
_FILTER_MIG_PARTED = re.compile(r"0[xX]([0-9a-fA-F]{4})([0-9a-fA-F]{4})(?::0[xX]([0-9a-fA-F]{4})([0-9a-fA-F]{4}))?")
_FILTER_LSPCI = re.compile(r"([0-9a-fA-F]{4}):([0-9a-fA-F]{4})")  # vendor:device
_HEX16 = re.compile(r"(?:0[xX])?([0-9a-fA-F]{1,4})")
_UNIT = re.compile(r"[A-Za-z0-9:_.\\-]+(?:@[A-Za-z0-9:_.\\-]*)?(" + "|".join(re.escape(s) for s in UNIT_SUFFIXES) + ")")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_VGPU_NAME = re.compile(r"[A-Za-z0-9]+(?:[-_][A-Za-z0-9]+)*")
_GROUP = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?")  # shadow-utils' portable group names


class ParsedLayout(Struct):
    """The outcome of reading one layout.yaml.

    `layout` is set only when there are no errors, so it can never be applied half-valid. `draft`
    is the best-effort Layout built from the parts that were valid; `resolve` checks it against the
    host so that profile and selector errors show up in the same report as syntax errors.
    `lines` maps key paths (as in messages) to 1-based line numbers.
    """

    file: str
    layout: Layout | None
    errors: list[LayoutIssue] = field(default_factory=list)
    warnings: list[LayoutIssue] = field(default_factory=list)
    lines: dict[str, int] = field(default_factory=dict)
    draft: Layout | None = None
    # Draft key path -> key path in the file, where dropping invalid entries or selectors from the
    # draft renumbered list items (`layouts.x[0]` in the draft was `layouts.x[1]` in the file).
    origins: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def selected(self) -> str | None:
        """The name of the layout in force; None while the file has errors (no `layout`)."""
        return self.layout.selected if self.layout is not None else None

    def line(self, path: str) -> int | None:
        return self.lines.get(path)

    def origin(self, path: str) -> str:
        """The file's key path for a draft list item (identical unless items were dropped)."""
        return self.origins.get(path, path)


def entry_path(layouts_key: str, name: str, index: int) -> str:
    """Key path of one device entry: `layouts.partial-mig[0]`."""
    return item_path(key_path(layouts_key, name), index)


def parse_layout(text: str, file: str = "layout.yaml", *, select: str | None = None,
                 label_selects: bool = False) -> ParsedLayout:
    """Parse and validate layout.yaml text. Never raises on bad input.

    `select` overrides the file's `selected` (like mig-parted's `-c`), so that a mig-parted file
    with several configs and no `selected` key loads unchanged.

    `label_selects` (gpud --kube-node): a node label chooses the layout, as it chooses a config for
    mig-manager, so a file with many layouts and no `selected` is valid (nothing is in force until
    a label selects), and `all-disabled` exists even when the file lacks it, meaning what the GPU
    Operator means by it when it sets `nvidia.com/mig.config=all-disabled` on its own: every GPU
    with MIG off, whole, for containers (`ALL_DISABLED`).
    """
    parser = _Parser(file, select, label_selects=label_selects)
    try:
        layout = parser.run(text)
    except TooLarge:
        if parser.aliases:
            why = f"YAML aliases expand it to over {parser.limit} values"
        else:
            why = f"it has over {parser.limit} values (keys, list items, settings); a layout describes one host's GPUs"
        parser.error(None, "", f"the layout is too large: {why}")
        layout = None
    except Exception as exc:  # noqa: BLE001 - a bug must still not take the daemon down
        parser.error(None, "", f"internal error while reading the layout ({type(exc).__name__}: {exc})")
        layout = None
    errors = sorted(parser.errors, key=lambda e: e.line or 0)  # file order; stable within a line
    if len(errors) > MAX_ERRORS:  # nobody reads the 101st; a runaway file must not flood the API
        more = len(errors) - MAX_ERRORS
        errors = errors[:MAX_ERRORS] + [LayoutIssue(file, None, "", f"{more} more errors not shown")]
    return ParsedLayout(
        file=file,
        layout=layout if not errors else None,
        errors=errors,
        warnings=parser.warnings,
        lines=parser.lines,
        draft=layout,
        origins=parser.origins,
    )


def _is_dynamic(node: Node) -> bool:
    """`mig-devices: dynamic`: the GPU's instances are made by leases, not listed in the file."""
    return isinstance(node, ScalarNode) and node.tag == STR and node.value == DYNAMIC


MAX_ERRORS = 100


class _Parser(NodeReader):
    def __init__(self, file: str, select: str | None = None, *, label_selects: bool = False) -> None:
        super().__init__(file)
        self.select = select
        self.label_selects = label_selects
        self.warnings: list[LayoutIssue] = []
        self.origins: dict[str, str] = {}
        self.default_workload = "container"

    def _renumbered(self, draft: str, original: str) -> None:
        if draft != original:
            self.origins[draft] = original

    # -- the file --------------------------------------------------------------------------------

    def run(self, text: str) -> Layout | None:
        root = self.compose(text, empty='the file is empty; expected a mapping starting with "version: v1"')
        if root is None:
            return None
        top = self.mapping(root, "", TOP_KEYS, 'a mapping with "version: v1" and "layouts"')
        if top is None:
            return None
        assert isinstance(root, MappingNode)  # mapping() accepted it
        return self.layout(root, top)

    def layout(self, root: MappingNode, top: dict[str, tuple[Node, Node]]) -> Layout | None:
        version = None
        if "version" not in top:
            self.error(root, "version", 'missing; expected "version: v1"')
        else:
            node = top["version"][1]
            if isinstance(node, ScalarNode) and node.tag == STR and node.value == "v1":
                version = "v1"
            else:
                self.expected(node, "version", '"v1"')

        layouts_key = "layouts"
        given = [k for k in ("layouts", *LAYOUTS_SYNONYMS) if k in top]
        if len(given) > 1:
            key = max((top[k][0] for k in given), key=line_of)
            self.error(key, key.value, f'use either "{given[0]}" or its synonym "{given[1]}", not both'
                       if len(given) == 2 else 'use one of "layouts", "mig-configs" and "vgpu-configs", not all three')
        elif given:
            layouts_key = given[0]
        self.default_workload = "vm-vgpu" if layouts_key == "vgpu-configs" else "container"
        layouts: dict[str, tuple[DeviceEntry, ...]] = {}
        layouts_node: Node | None = None
        if layouts_key not in top:
            self.error(root, "layouts", 'missing; expected "layouts" (or its synonym "mig-configs" or "vgpu-configs")')
        else:
            layouts_node = top[layouts_key][1]
            layouts = self.layouts(layouts_node, layouts_key)
            if not layouts and isinstance(layouts_node, MappingNode) and not layouts_node.value:
                self.error(layouts_node, layouts_key, "at least one layout is required (a layout may have no entries)")
            if self.label_selects and isinstance(layouts_node, MappingNode) and ALL_DISABLED_NAME not in layouts:
                if not any(isinstance(k, ScalarNode) and k.value == ALL_DISABLED_NAME for k, _ in layouts_node.value):
                    layouts[ALL_DISABLED_NAME] = ALL_DISABLED

        # Names as written, valid or not, so one broken layout does not change what "selected" needs.
        names: tuple[str, ...] = ()
        if isinstance(layouts_node, MappingNode):
            names = tuple(dict.fromkeys(
                k.value for k, _ in layouts_node.value if isinstance(k, ScalarNode) and k.tag not in (NULL, MERGE)
            ))
        selected = None
        if "selected" in top and not is_null(top["selected"][1]):
            node = top["selected"][1]
            name = self.text(node, "selected", "the name of a layout")
            if name is not None:
                if name in layouts:
                    selected = name
                elif name not in names and layouts_node is not None:
                    self.error(node, "selected",
                               f"{quote(name)} is not a layout in {layouts_key}; one of: {one_of(names)}")
        elif len(names) == 1:
            selected = names[0] if names[0] in layouts else None
        elif len(names) > 1 and self.select is None and not self.label_selects:
            self.error(top[layouts_key][0], "selected",
                       f'missing; {layouts_key} has {len(names)} layouts, so "selected" must name one of: '
                       f"{one_of(names)}")
        if self.select is not None:  # the caller's choice (mig-parted's `-c`) wins over the file's
            selected = self.select if self.select in layouts else None
            if self.select not in layouts and self.select not in names and layouts_node is not None:
                self.error(None, "selected", f"{quote(self.select)} (chosen by the caller) is not a layout in "
                                             f"{layouts_key}; one of: {one_of(names)}")

        match = DEFAULT_MATCH
        if "match" in top and not is_null(top["match"][1]):
            match = self.match(top["match"][1]) or DEFAULT_MATCH
        policy = Policy()
        if "policy" in top and not is_null(top["policy"][1]):
            policy = self.policy(top["policy"][1])
        hooks = Hooks()
        if "hooks" in top and not is_null(top["hooks"][1]):
            hooks = self.hooks(top["hooks"][1])

        return Layout(version=version or "v1", selected=selected, layouts=layouts, layouts_key=layouts_key,
                      match=match, policy=policy, hooks=hooks)

    # -- layouts ---------------------------------------------------------------------------------

    def layouts(self, node: Node, layouts_key: str) -> dict[str, tuple[DeviceEntry, ...]]:
        out: dict[str, tuple[DeviceEntry, ...]] = {}
        for name, key, value in self.free_mapping(node, layouts_key, "a mapping of layout name -> list of entries"):
            lpath = key_path(layouts_key, name)
            if not name:
                self.error(key, lpath, "a layout name must not be empty")
                continue
            if is_null(value):
                out[name] = ()  # `name:` with nothing under it: a layout with no entries
                continue
            items = self.sequence(value, lpath, "a list of device entries")
            if items is None:
                continue
            kept: list[DeviceEntry] = []
            for ipath, item in items:
                if (entry := self.entry(item, ipath)) is not None:
                    self._renumbered(item_path(lpath, len(kept)), ipath)
                    kept.append(entry)
            out[name] = tuple(kept)
        return out

    def entry(self, node: Node, path: str) -> DeviceEntry | None:
        keys = self.mapping(node, path, ENTRY_KEYS, "a device entry (a mapping with \"devices\")")
        if keys is None:
            return None

        def get(key: str) -> Node | None:  # a key with a null value counts as absent
            return keys[key][1] if key in keys and not is_null(keys[key][1]) else None

        devices: Literal["all"] | tuple[int | str, ...] | None = None
        if (n := get("devices")) is None:
            self.error(node, path, 'missing key "devices" ("all" or a list of GPU indices, PCI addresses or GPU UUIDs)')
        else:
            devices = self.devices(n, key_path(path, "devices"))

        device_filter: tuple[PciId, ...] = ()
        if (n := get("device-filter")) is not None:
            device_filter = self.device_filter(n, key_path(path, "device-filter"))

        workload = self.default_workload
        if (n := get("workload")) is not None:
            workload = self.enum(n, key_path(path, "workload"), WORKLOADS) or self.default_workload

        mig_enabled = None
        if (n := get("mig-enabled")) is not None:
            mig_enabled = self.boolean(n, key_path(path, "mig-enabled"))

        mig_devices: dict[str, int] | None = None
        dynamic = "mig-devices" in keys and _is_dynamic(keys["mig-devices"][1])
        if "mig-devices" in keys and not dynamic:
            mig_devices = self.mig_devices(keys["mig-devices"][1], key_path(path, "mig-devices"))

        vgpu_devices: dict[str, int] | None = None
        if "vgpu-devices" in keys:
            vgpu_devices = self.vgpu_devices(keys["vgpu-devices"][1], key_path(path, "vgpu-devices"))

        # Rules between keys (mig-parted's, plus the ones a per-GPU driver choice brings).
        mig_key = keys.get("mig-enabled", (node,))[0]
        if mig_enabled is True and "mig-devices" not in keys:
            self.error(mig_key, key_path(path, "mig-enabled"),
                       "mig-enabled: true needs mig-devices (use {} for MIG on with no instances)")
        if "mig-devices" in keys:
            mkey = keys["mig-devices"][0]
            mpath = key_path(path, "mig-devices")
            has_names = isinstance(keys["mig-devices"][1], MappingNode) and bool(keys["mig-devices"][1].value)
            if "mig-enabled" not in keys:
                self.error(mkey, mpath, "mig-devices needs mig-enabled: true")
            elif mig_enabled is False and (has_names or dynamic):
                self.error(mkey, mpath, "mig-enabled: false forbids mig-devices")
            if dynamic and workload != "container":
                self.error(mkey, mpath, f"mig-devices: {DYNAMIC} (instances made by leases) needs workload: "
                                        f"container, not {workload}")
        if workload == "vm-passthrough" and mig_enabled is True:
            self.error(mig_key, key_path(path, "mig-enabled"),
                       "vm-passthrough gives the whole GPU to a VM through vfio-pci; MIG needs the nvidia "
                       "driver (use workload: container or vm-vgpu)")
        if "vgpu-devices" in keys and workload != "vm-vgpu":
            self.error(keys["vgpu-devices"][0], key_path(path, "vgpu-devices"), "vgpu-devices needs workload: vm-vgpu")

        if devices is None:
            return None
        return DeviceEntry(
            devices=devices,
            device_filter=device_filter,
            workload=workload,
            mig_enabled=mig_enabled,
            mig_devices=mig_devices or {},
            vgpu_devices=vgpu_devices or {},
            mig_dynamic=dynamic,
        )

    def devices(self, node: Node, path: str) -> Literal["all"] | tuple[int | str, ...] | None:
        what = '"all" or a list of GPU indices, PCI addresses or GPU UUIDs'
        if isinstance(node, ScalarNode):
            if node.tag == STR and node.value == "all":
                return "all"
            self.expected(node, path, what)
            return None
        items = self.sequence(node, path, what)
        if items is None:
            return None
        if not items:
            self.error(node, path, 'must not be empty; list at least one GPU, or use "all"')
            return None
        out: list[int | str] = []
        first: dict[int | str, str] = {}
        for ipath, item in items:
            selector = self.selector(item, ipath)
            if selector is None:
                continue
            if selector in first:
                self.error(item, ipath, f"{_selector_text(selector)} is listed twice (also {first[selector]})")
                continue
            first[selector] = ipath
            self._renumbered(item_path(path, len(out)), ipath)
            out.append(selector)
        return tuple(out)

    def selector(self, node: Node, path: str) -> int | str | None:
        what = "an index, PCI address or GPU UUID"
        if isinstance(node, ScalarNode) and node.tag == INT:
            index = self.integer(node)
            if index is None:
                self.expected(node, path, what + yaml11_note(node))
            elif index < 0:
                self.expected(node, path, "a GPU index >= 0")
                return None
            return index
        if isinstance(node, ScalarNode) and node.tag != NULL:
            # Unquoted `0000:00:01.0` is a YAML 1.1 float; the text as written is what counts.
            value = node.value.strip()
            if pci := normalize_pci(value):
                return pci
            if _UUID.fullmatch(value):
                return "GPU-" + value[4:].lower()
        self.expected(node, path, what)
        return None

    def device_filter(self, node: Node, path: str) -> tuple[PciId, ...]:
        if isinstance(node, ScalarNode):
            one = self.pci_id(node, path)
            return (one,) if one is not None else ()
        items = self.sequence(node, path, 'a PCI id like "0x233010DE" or "10de:2330", or a list of them')
        if items is None:
            return ()
        if not items:
            self.error(node, path, "must not be empty; leave device-filter out to match every GPU")
            return ()
        ids = (self.pci_id(item, ipath) for ipath, item in items)
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def pci_id(self, node: Node, path: str) -> PciId | None:
        if isinstance(node, ScalarNode) and node.tag != NULL:
            value = node.value.strip()  # unquoted 0x233010DE is a YAML int; take the text
            if m := _FILTER_MIG_PARTED.fullmatch(value):
                if m[3] is not None:
                    return PciId(vendor=int(m[2], 16), device=int(m[1], 16), subsystem_vendor=int(m[4], 16),
                                 subsystem_device=int(m[3], 16))
                return PciId(vendor=int(m[2], 16), device=int(m[1], 16))
            if m := _FILTER_LSPCI.fullmatch(value):
                return PciId(vendor=int(m[1], 16), device=int(m[2], 16))
        self.expected(node, path, 'a PCI id like "0x233010DE" (device id, then vendor id), "0x233010DE:0x16C110DE" '
                                  '(then the subsystem\'s) or "10de:2330"')
        return None

    def mig_devices(self, node: Node, path: str) -> dict[str, int] | None:
        if is_null(node):
            return None
        out: dict[str, int] = {}
        for name, key, value in self.free_mapping(node, path, f'a mapping of MIG device name -> count, or "{DYNAMIC}"'):
            kpath = key_path(path, name)
            if parse_mig_name(name) is None:
                self.error(key, kpath, f"{quote(name)} is not a MIG device name; expected {SYNTAX}")
                continue
            count = self.count(value, kpath)
            if count:  # 0 is allowed (mig-parted allows it) and means none
                out[name] = count
        return out

    def vgpu_devices(self, node: Node, path: str) -> dict[str, int] | None:
        if is_null(node):
            return None
        out: dict[str, int] = {}
        for name, key, value in self.free_mapping(node, path, "a mapping of vGPU type name -> count"):
            kpath = key_path(path, name)
            if not _VGPU_NAME.fullmatch(strip_prefix(name)):
                self.error(key, kpath, f'{quote(name)} is not a vGPU type name; expected e.g. "H200X-1-18C"')
                continue
            count = self.count(value, kpath)
            if count:
                out[name] = count
        return out

    # -- match, policy, hooks --------------------------------------------------------------------

    def match(self, node: Node) -> tuple[MatchRule, ...]:
        items = self.sequence(node, "match", "a list of {vendor, device, class} rules")
        if items is None:
            return ()
        if not items:
            self.error(node, "match",
                       "must not be empty; leave match out for the default (NVIDIA display and 3D controllers)")
            return ()
        rules = []
        for ipath, item in items:
            keys = self.mapping(item, ipath, MATCH_KEYS, "a {vendor, device, class} rule")
            if keys is None:
                continue
            if "vendor" not in keys:
                self.error(item, ipath, 'missing key "vendor" (e.g. "0x10de")')
            values = {k: self.hex16(keys[k][1], key_path(ipath, k)) for k in keys}
            if (vendor := values.get("vendor")) is not None and None not in values.values():
                rules.append(MatchRule(vendor=vendor, device=values.get("device"), class_=values.get("class")))
        return tuple(rules)

    def hex16(self, node: Node, path: str) -> int | None:
        # Text as written: unquoted 0x10de is an int and 0302 an octal int in YAML 1.1.
        if isinstance(node, ScalarNode) and node.tag != NULL and (m := _HEX16.fullmatch(node.value.strip())):
            return int(m[1], 16)
        self.expected(node, path, 'a 16-bit hex value like "0x10de"')
        return None

    def policy(self, node: Node) -> Policy:
        keys = self.mapping(node, "policy", POLICY_KEYS)
        if keys is None:
            return Policy()
        values: dict[str, object] = {}
        if "drain-units" in keys and not is_null(keys["drain-units"][1]):
            values["drain_units"] = self.units(keys["drain-units"][1], "policy.drain-units")
        if "lease-group" in keys and not is_null(keys["lease-group"][1]):
            group = self.string(keys["lease-group"][1], "policy.lease-group", "a group name")
            if group is not None and not _GROUP.fullmatch(group):
                self.expected(keys["lease-group"][1], "policy.lease-group", "a group name")
            elif group is not None:
                values["lease_group"] = group
        for key, allowed in (("on-busy", ON_BUSY), ("reset", RESET), ("reboot", REBOOT),
                             ("lease-placement", LEASE_PLACEMENT), ("lease-mig-mode", LEASE_MIG_MODE),
                             ("on-infeasible", ON_INFEASIBLE), ("apply", APPLY), ("on-drift", ON_DRIFT)):
            if key in keys and (value := self.enum(keys[key][1], key_path("policy", key), allowed)) is not None:
                values[key.replace("-", "_")] = value
        return Policy(**values)  # type: ignore[arg-type]

    def units(self, node: Node, path: str) -> tuple[str, ...]:
        items = self.sequence(node, path, "a list of systemd unit names")
        if items is None:
            return ()
        out = []
        for ipath, item in items:
            name = self.string(item, ipath, 'a systemd unit name like "nvidia-dcgm.service"')
            if name is None:
                continue
            if not _UNIT.fullmatch(name) or "@." in name:  # a template cannot be stopped
                suffixes = ", ".join(UNIT_SUFFIXES)
                self.error(item, ipath,
                           f"{quote(name)} is not a systemd unit name; expected a name ending in one of {suffixes}")
                continue
            out.append(name)
        return tuple(dict.fromkeys(out))

    def hooks(self, node: Node) -> Hooks:
        keys = self.mapping(node, "hooks", HOOK_PHASES)
        if keys is None:
            return Hooks()
        values: dict[str, tuple[Hook, ...]] = {}
        for point, (_, value) in keys.items():
            if is_null(value):
                continue
            hpath = key_path("hooks", point)
            items = self.sequence(value, hpath, "a list of {command, args, env, timeout}")
            if items is None:
                continue
            hooks = (self.hook(item, ipath) for ipath, item in items)
            values[point.replace("-", "_")] = tuple(h for h in hooks if h is not None)
        return Hooks(**values)

    def hook(self, node: Node, path: str) -> Hook | None:
        keys = self.mapping(node, path, HOOK_KEYS, "a hook {command, args, env, timeout}")
        if keys is None:
            return None
        ok = True
        command = None
        if "command" not in keys or is_null(keys["command"][1]):
            self.error(node, path, 'missing key "command" (an absolute path)')
            ok = False
        else:
            n = keys["command"][1]
            command = self.string(n, key_path(path, "command"), "an absolute path")
            if command is not None and not command.startswith("/"):
                self.error(n, key_path(path, "command"),
                           f"{quote(command)} is not an absolute path; hooks run without a shell or PATH")
                command = None
            ok = ok and command is not None
        args: list[str] = []
        if "args" in keys and not is_null(keys["args"][1]):
            items = self.sequence(keys["args"][1], key_path(path, "args"), "a list of strings")
            ok = ok and items is not None
            for ipath, item in items or ():
                arg = self.text(item, ipath, "a string")
                ok = ok and arg is not None
                args.append(arg or "")
        env: dict[str, str] = {}
        if "env" in keys and not is_null(keys["env"][1]):
            epath = key_path(path, "env")
            if not isinstance(keys["env"][1], MappingNode):
                ok = False
            for name, key, value in self.free_mapping(keys["env"][1], epath, "a mapping of NAME -> value"):
                kpath = key_path(epath, name)
                if not _ENV_NAME.fullmatch(name):
                    self.error(key, kpath, f"{quote(name)} is not an environment variable name")
                    ok = False
                    continue
                text = self.text(value, kpath, "a string")
                ok = ok and text is not None
                env[name] = text or ""
        timeout = None
        if "timeout" in keys and not is_null(keys["timeout"][1]):
            n = keys["timeout"][1]
            timeout = self.seconds(n)
            if timeout is None:
                self.expected(n, key_path(path, "timeout"), "a positive number of seconds")
                ok = False
        if not ok or command is None:
            return None
        return Hook(command=command, args=tuple(args), env=env, timeout=timeout)

    def seconds(self, node: Node) -> float | None:
        if not isinstance(node, ScalarNode):
            return None
        value: object = None
        if node.tag == INT:
            value = self.integer(node)
        elif node.tag == FLOAT:
            try:
                value = SCALARS.construct_yaml_float(node)
            except Exception:  # noqa: BLE001 - `!!float abc`
                return None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
            return float(value)
        return None


def _selector_text(selector: int | str) -> str:
    return f"GPU {selector}" if isinstance(selector, int) else selector
