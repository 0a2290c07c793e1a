"""Item: the GPU Operator's mig-manager ConfigMap works unchanged as gpud's layout file under
--kube-node, where the node label (not `selected`) chooses the layout.

Oracles: NVIDIA's own mig-parted configs (tests/fixtures/mig-parted, copied unchanged from
NVIDIA/mig-parted v0.15.0) read with plain yaml.safe_load for the names they offer; the simulator's
state file for what the hardware holds after a label selected a layout.
"""

from __future__ import annotations

import json

import pytest
import yaml

from gpud.layout import parse_layout
from gpud.layout.schema import ALL_DISABLED, DeviceEntry
from tests.support.operator_fixtures import CONFIGS, FIXTURES, WITHOUT_ALL_DISABLED
from tests.support.present import present


@pytest.mark.parametrize("name", CONFIGS)
def test_nvidias_configmap_without_selected_is_refused_without_a_label_and_loads_with_one(name):
    text = (FIXTURES / name).read_text()
    offered = list(yaml.safe_load(text)["mig-configs"])  # what mig-manager would accept as a label value
    assert len(offered) > 1 and "selected" not in yaml.safe_load(text)

    plain = parse_layout(text, name)
    assert not plain.ok
    assert any(e.path == "selected" and "missing" in e.message for e in plain.errors)

    kube = parse_layout(text, name, label_selects=True)
    assert kube.ok, [str(e) for e in kube.errors]
    assert present(kube.layout).selected is None  # nothing in force until a label selects
    assert list(present(kube.layout).layouts) == offered
    for label in offered:  # every value of nvidia.com/mig.config the operator's users may set
        chosen = parse_layout(text, name, select=label, label_selects=True)
        assert chosen.ok and present(chosen.layout).selected == label, label
    # the file's own all-disabled stays the file's
    file_all_disabled = yaml.safe_load(text)["mig-configs"]["all-disabled"]
    assert [e.mig_enabled for e in present(kube.layout).layouts["all-disabled"]] == [d["mig-enabled"] for d in file_all_disabled]


def test_all_disabled_exists_under_kube_even_when_the_file_lacks_it():
    assert "all-disabled" not in yaml.safe_load(WITHOUT_ALL_DISABLED)["mig-configs"]
    plain = parse_layout(WITHOUT_ALL_DISABLED, select="all-disabled")
    assert not plain.ok and "all-disabled" in str(plain.errors[0])
    kube = parse_layout(WITHOUT_ALL_DISABLED, select="all-disabled", label_selects=True)
    assert kube.ok, [str(e) for e in kube.errors]
    assert present(kube.layout).selected == "all-disabled"
    assert present(kube.layout).entries == ALL_DISABLED == (DeviceEntry(devices="all", workload="container", mig_enabled=False),)


def test_a_name_neither_in_the_file_nor_all_disabled_is_still_an_error():
    kube = parse_layout(WITHOUT_ALL_DISABLED, select="nope", label_selects=True)
    assert not kube.ok and "nope" in str(kube.errors[0])


# --- a gpud process under --kube-node, the ConfigMap's text as its layout file ----------------

from tests.support.daemon import Daemon, wait_until  # noqa: E402
from tests.support.kube_cluster import NODE, EmulatorThread, write_kubeconfig  # noqa: E402

CONFIG, STATE = "nvidia.com/mig.config", "nvidia.com/mig.config.state"
GPU0, GPU1 = "0000:18:00.0", "0000:2a:00.0"


@pytest.fixture
def emulator():
    emu = EmulatorThread()
    yield emu
    emu.close()


def _node(emu, labels):
    emu.call(emu.api.put_object("nodes", {"metadata": {"name": NODE, "labels": labels}}))


def _labels(emu):
    return emu.read(lambda: emu.api.get("nodes", NODE)["metadata"]["labels"])


def _sim(d: Daemon, pci: str) -> tuple[int, list[int]]:
    gpu = json.loads((d.host / "state.json").read_text())["gpus"][pci]
    return gpu["mig_mode"], sorted(gi["profile_id"] for gi in gpu["gis"])


def _kube_daemon(tmp_path, emu, text):
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", emu.url)
    return Daemon(tmp_path / "d", ["h100-80gb:2"], text, ["--kube-node", NODE, "--kubeconfig", kubeconfig,
                                                         "--nfd-features", str(tmp_path / "none" / "gpud")])


@pytest.mark.daemon
def test_nvidias_default_config_unchanged_is_gpuds_layout_file(tmp_path, emulator):
    _node(emulator, {CONFIG: "all-1g.10gb"})
    d = _kube_daemon(tmp_path, emulator, (FIXTURES / "config-default.yaml").read_text())
    try:
        wait_until(lambda: _labels(emulator).get(STATE) == "success", timeout=120, what="all-1g.10gb applied")
        # H100 80GB: 1g.10gb is GI profile 19 (nvidia-smi mig -lgip); the file's H100 entry asks for 7
        assert _sim(d, GPU0) == _sim(d, GPU1) == (1, [19] * 7)
        _node(emulator, {CONFIG: "all-disabled"})
        wait_until(lambda: _labels(emulator).get(STATE) == "success" and _sim(d, GPU0)[0] == 0, timeout=120,
                   what="all-disabled applied")
        assert _sim(d, GPU0) == _sim(d, GPU1) == (0, [])
    finally:
        d.stop()
    assert d.proc.returncode == 0, d.log.read_text()


@pytest.mark.daemon
def test_operators_all_disabled_works_when_the_file_lacks_it(tmp_path, emulator):
    _node(emulator, {CONFIG: "half"})
    d = _kube_daemon(tmp_path, emulator, WITHOUT_ALL_DISABLED)
    try:
        wait_until(lambda: _labels(emulator).get(STATE) == "success", timeout=120, what="half applied")
        assert _sim(d, GPU0) == (1, [9, 9]) and _sim(d, GPU1) == (0, [])  # 3g.40gb is GI profile 9
        _node(emulator, {CONFIG: "all-disabled"})  # as the operator sets it on its own
        wait_until(lambda: _labels(emulator).get(STATE) == "success" and _sim(d, GPU0)[0] == 0, timeout=120,
                   what="all-disabled applied")
        assert _sim(d, GPU0) == _sim(d, GPU1) == (0, [])
        status = json.loads(d.ctl("status", "--json").stdout)
        assert status["kubernetes"]["agent"]["selected"] == "all-disabled"
        assert all(g["workload"] == "container" for g in status["gpus"])
    finally:
        d.stop()
    assert d.proc.returncode == 0, d.log.read_text()
