"""vGPU type names of the RTX PRO 6000 Blackwell in layout.yaml: the driver prints them with a
product prefix of four words (`NVIDIA RTX Pro 6000 Blackwell DC-1-24Q`), NVIDIA's tools key them by
the last token, and several MIG-backed vGPUs share one `+gfx` GPU instance.

Oracles, independent of gpud's table: the names as a real host's driver printed them
(tests/fixtures/captures/rtx-pro-6000/vgpu-types-*.txt, from bigstack-oss/cubecos#312), and the
per-GPU counts NVIDIA's vgpu-device-manager v0.5.0 ships in examples/config-example.yaml, typed in
below from that file.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from gpud.layout import check_text
from gpud.vgpu_types import by_device, parse_vgpu_name, strip_prefix
from tests.support.gpus import make_gpu
from tests.support.present import present

CAPTURES = Path(__file__).resolve().parents[1] / "fixtures" / "captures" / "rtx-pro-6000"
RTX = "0000:18:00.0"

# vgpu-device-manager v0.5.0 examples/config-example.yaml: the config of each RTX PRO 6000 type
# fills one GPU with this many vGPUs (no device-filter; these DC-* entries are the 96 GB board's).
NVIDIA_COUNTS = {
    "DC-1-2Q": 48, "DC-1-3Q": 32, "DC-1-4Q": 24, "DC-1-6Q": 16, "DC-1-8C": 12, "DC-1-8Q": 12, "DC-1-12C": 8,
    "DC-1-12Q": 8, "DC-1-24C": 4, "DC-1-24Q": 4, "DC-2-12C": 8, "DC-2-12Q": 8, "DC-2-16C": 6, "DC-2-16Q": 6,
    "DC-2-24C": 4, "DC-2-24Q": 4, "DC-2-48C": 2, "DC-2-48Q": 2, "DC-3Q": 32, "DC-4Q": 24, "DC-4-24C": 4,
    "DC-4-24Q": 4, "DC-4-32C": 3, "DC-4-32Q": 3, "DC-4-48C": 2, "DC-4-48Q": 2, "DC-4-96C": 1, "DC-4-96Q": 1,
    "DC-6Q": 16, "DC-8C": 12, "DC-8Q": 12, "DC-12C": 8, "DC-12Q": 8, "DC-16C": 6, "DC-16Q": 6, "DC-24C": 4,
    "DC-24Q": 4, "DC-32C": 3, "DC-32Q": 3, "DC-48C": 2, "DC-48Q": 2, "DC-96C": 1, "DC-96Q": 1,
}


def printed_names() -> list[str]:
    """Every type name as the host's driver printed it, from the committed listings."""
    names = []
    for path in sorted(CAPTURES.glob("vgpu-types-*.txt")):
        for line in path.read_text().splitlines():
            m = re.match(r"^(?:type: nvidia-\d+, name: )?\s*(NVIDIA RTX Pro 6000 Blackwell \S+?)(?:,|$)", line)
            if m:
                names.append(m[1])
    return names


def check(vgpu_devices: str):
    text = textwrap.dedent(f"""\
        version: v1
        layouts:
          a:
            - devices: [0]
              workload: vm-vgpu
              vgpu-devices: {vgpu_devices}
        """)
    return check_text(text, "layout.yaml", [make_gpu("rtx-pro-6000", 0, RTX)])


def test_a_printed_name_is_keyed_by_its_last_token() -> None:
    names = printed_names()
    assert len(names) > 40
    for printed in names:
        short = printed.rsplit(" ", 1)[1]
        assert strip_prefix(printed) == short
        parsed = parse_vgpu_name(printed)
        assert parsed is not None and parsed.board == "DC", printed
        assert present(by_device(0x2BB5)).find(printed) is not None, printed
    # a name that is not NVIDIA's stays whole: the kernel's mtty sample has two types ending in "serial"
    assert strip_prefix("Dual port serial") == "Dual port serial"


def test_the_model_has_nvidias_counts_and_the_hosts_types() -> None:
    table = by_device(0x2BB5)
    for name, n in NVIDIA_COUNTS.items():
        assert present(present(table).find(name)).max_instances == n, name
    listed = {strip_prefix(p) for p in printed_names()}
    assert listed <= set(present(table).names())
    for line in (CAPTURES / "vgpu-types-time-sliced.txt").read_text().splitlines():
        m = re.match(r"type: nvidia-(\d+), name: .* (\S+), spec: .*max_instance=(\d+)$", line)
        if m:
            t = present(table).find(m[2])
            assert (present(t).vfio_id, present(t).max_instances) == (int(m[1]), int(m[3])), line


@pytest.mark.parametrize(("devices", "mig", "vgpus"), [
    # one vGPU to a 1g.24gb+gfx instance; the printed name and the short one mean the same type
    ('{"NVIDIA RTX Pro 6000 Blackwell DC-1-24Q": 2}', {"1g.24gb+gfx": 2}, {"DC-1-24Q": 2}),
    # eight DC-1-3Q fill one instance (32 per GPU over the 4 instances), the ninth needs a second
    ('{"DC-1-3Q": 8}', {"1g.24gb+gfx": 1}, {"DC-1-3Q": 8}),
    ('{"DC-1-3Q": 9, "DC-1-24Q": 1}', {"1g.24gb+gfx": 3}, {"DC-1-3Q": 9, "DC-1-24Q": 1}),
    # one type to an instance: a Q and an A of one size take one instance each
    ('{"DC-1-3Q": 4, "DC-1-3A": 4}', {"1g.24gb+gfx": 2}, {"DC-1-3Q": 4, "DC-1-3A": 4}),
    ('{"DC-2-12Q": 8}', {"2g.48gb+gfx": 2}, {"DC-2-12Q": 8}),
    ('{"DC-4-24C": 4}', {"4g.96gb+gfx": 1}, {"DC-4-24C": 4}),
    # vgpu-device-manager's spelling with the instance's attribute is the driver's type on +gfx
    ('{"DC-1-24QGFX": 4}', {"1g.24gb+gfx": 4}, {"DC-1-24Q": 4}),
    ('{"DC-48Q": 2}', {}, {"DC-48Q": 2}),
])
def test_types_imply_their_gfx_instances(devices: str, mig: dict, vgpus: dict) -> None:
    r = check(devices)
    assert r.errors == [] and not [str(w) for w in r.warnings if "cannot check" in str(w)]
    d = r.desired[RTX]
    assert (d.mig_enabled, d.mig_devices, d.vgpu_devices) == (bool(mig), mig, vgpus)


def test_a_type_of_another_board_is_an_error_with_the_valid_names() -> None:
    r = check('{"H200X-1-18C": 1}')
    assert len(r.errors) == 1
    message = str(r.errors[0])
    assert "H200X-1-18C is not a vGPU type of NVIDIA RTX PRO 6000 Blackwell Server Edition" in message
    assert "DC-1-24Q" in message
