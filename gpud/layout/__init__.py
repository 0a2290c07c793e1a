"""layout.yaml: parse it (with line numbers), resolve it against the GPUs of this host.

Pure code: text and observed GPUs in, `DesiredGpu` per GPU and located issues out.
"""

from gpud.layout.desired import DesiredGpu, LayoutIssue
from gpud.layout.match import DEFAULT_MATCH, managed
from gpud.layout.names import MigName, find_profile, parse_mig_name
from gpud.layout.parse import ParsedLayout, parse_layout
from gpud.layout.resolve import Resolution, check_text, resolve
from gpud.layout.schema import (
    DeviceEntry,
    Hook,
    Hooks,
    Layout,
    MatchRule,
    PciId,
    Policy,
)

__all__ = [
    "DEFAULT_MATCH",
    "DesiredGpu",
    "DeviceEntry",
    "Hook",
    "Hooks",
    "Layout",
    "LayoutIssue",
    "MatchRule",
    "MigName",
    "ParsedLayout",
    "PciId",
    "Policy",
    "Resolution",
    "check_text",
    "find_profile",
    "managed",
    "parse_layout",
    "parse_mig_name",
    "resolve",
]
