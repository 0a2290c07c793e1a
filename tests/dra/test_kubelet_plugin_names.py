"""Which registration socket makes `--dra-driver gpu.nvidia.com` refuse to start: NVIDIA's kubelet
plugin registers as `<driver>-reg.sock` (or `<driver>-<uid>-reg.sock` with rolling updates) in the
kubelet's plugins_registry (k8s.io/dynamic-resource-allocation kubeletplugin/draplugin.go)."""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path

from gpud.host.kube.kubelet_plugin import other_plugin_registered, paths


def test_nvidias_socket_is_found_and_gpuds_own_is_not():
    tmp = tempfile.mkdtemp(prefix="kl-", dir="/tmp")  # a socket path must fit sun_path (108 bytes)
    try:
        check(Path(tmp))
    finally:
        shutil.rmtree(tmp)


def check(tmp_path: Path) -> None:
    own, _ = paths(str(tmp_path), "gpu.nvidia.com")
    reg = tmp_path / "plugins_registry"
    reg.mkdir()
    assert other_plugin_registered(str(tmp_path), "gpu.nvidia.com", own) is None
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(own)  # gpud's own registration socket, left by a killed gpud: nothing listens
        assert other_plugin_registered(str(tmp_path), "gpu.nvidia.com", own) is None
        s.listen()  # a live plugin on that very path: NVIDIA's, under its default name
        assert other_plugin_registered(str(tmp_path), "gpu.nvidia.com", own) == own
        with socket.socket(socket.AF_UNIX) as nvidia:
            theirs = str(reg / "gpu.nvidia.com-0b1c-reg.sock")
            nvidia.bind(theirs)
            assert other_plugin_registered(str(tmp_path), "gpu.nvidia.com", own) == theirs
    assert other_plugin_registered(str(tmp_path), "other.example.com", own) is None


async def test_a_kubelet_root_too_long_for_a_socket_is_refused_by_name(tmp_path):
    from gpud.host.kube.kubelet_plugin import MAX_SOCKET_PATH, KubeletPlugin

    root = tmp_path / ("k" * (MAX_SOCKET_PATH - len(str(tmp_path))))
    plugin = KubeletPlugin("gpu.gpud.io", None, root=str(root))  # type: ignore[arg-type]
    try:
        await plugin.start()
    except OSError as e:
        assert "at most 107 bytes" in str(e) and "--kubelet-root" in str(e)
    else:
        raise AssertionError("a socket path longer than sun_path was taken")
    assert not root.exists()  # refused before anything was made
