"""Item: under --kube-node gpud writes only its own labels while the operator's GFD runs on the
node, GFD's too once the node says GFD is off, and takes the cluster's MIG strategy from the node.

Checked on the feature file read the way nfd-worker reads it, and on `gpudctl status --kube`.
"""

from __future__ import annotations

import pytest

from gpud.engine.kube.node_labels_out import from_cluster
from tests.support.daemon import Daemon, wait_until
from tests.support.kube_cluster import NODE, EmulatorThread, write_kubeconfig
from tests.support.nfd import nfd_read

GFD = "nvidia.com/gpu.deploy.gpu-feature-discovery"
STRATEGY = "nvidia.com/mig.strategy"


@pytest.mark.parametrize(("labels", "flags", "want"), [
    ({}, {}, ("gpud", "mixed")),  # GFD's deploy label unset: the operator deploys it (gpud says mig.capable)
    ({GFD: "true"}, {}, ("gpud", "mixed")),
    ({GFD: "paused-for-mig-change"}, {}, ("gpud", "mixed")),
    ({GFD: "false", STRATEGY: "single"}, {}, ("all", "single")),
    ({STRATEGY: "single"}, {}, ("gpud", "single")),
    ({STRATEGY: "none"}, {}, ("gpud", "mixed")),
    ({GFD: "true", STRATEGY: "single"}, {"label_set": "all", "mig_strategy": "mixed"}, ("all", "mixed")),
])
def test_from_cluster(labels, flags, want):
    assert from_cluster(labels, **{"label_set": None, "mig_strategy": None, **flags}) == want


@pytest.mark.daemon
def test_daemon_follows_gfd_and_the_mig_strategy_of_the_node(tmp_path):
    emu = EmulatorThread()
    features = tmp_path / "features.d"
    features.mkdir()
    try:
        emu.call(emu.api.put_object("nodes", {"metadata": {"name": NODE, "labels": {
            GFD: "true", STRATEGY: "single", "nvidia.com/mig.config": "all-disabled"}}}))
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", emu.url)
        layout = "version: v1\nlayouts:\n  all-disabled:\n    - devices: all\n      mig-enabled: false\n"
        d = Daemon(tmp_path / "d", ["h100-80gb:2"], layout, ["--kube-node", NODE, "--kubeconfig", kubeconfig,
                                                             "--nfd-features", str(features / "gpud")])
        try:
            wait_until(lambda: nfd_read(str(features)).get("nvidia.com/gpud.layout") == "all-disabled", timeout=120,
                       what="gpud's labels")
            labels = nfd_read(str(features))
            assert not any(k.startswith("nvidia.com/gpu.") or k.startswith("nvidia.com/cuda.") for k in labels), labels
            assert "mig-strategy=single" in d.ctl("status", "--kube").stdout
            # the administrator turns GFD off for this node: gpud writes GFD's labels now
            emu.call(emu.api.put_object("nodes", {"metadata": {"name": NODE, "labels": {GFD: "false"}}}))
            wait_until(lambda: nfd_read(str(features)).get("nvidia.com/gpu.count") == "2", timeout=60,
                       what="GFD's labels")
            assert nfd_read(str(features))[STRATEGY] == "single"
        finally:
            d.stop()
        assert d.proc.returncode == 0, d.log.read_text()
    finally:
        emu.close()
