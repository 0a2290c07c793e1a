"""The NFD feature file: read back the way nfd-worker's local source reads it.

`nfd_read` (tests/support/nfd.py) is written from node-feature-discovery source/local/local.go and
shares no code with gpud's writer.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpud.host.kube import nfd
from tests.support.nfd import MAX_FEATURE_FILE_SIZE, nfd_read

LABELS = {"nvidia.com/gpu.product": "NVIDIA-H200", "nvidia.com/gpu.count": "8",
          "nvidia.com/gpu.sharing-strategy": "", "nvidia.com/gpud.layout.state": "success"}


def test_not_written_without_nfd_directory(tmp_path):
    path = tmp_path / "features.d" / "gpud"
    assert nfd.write_features(str(path), LABELS) == "no-directory"
    assert not (tmp_path / "features.d").exists()


def test_written_file_is_what_nfd_labels_the_node_with(tmp_path):
    d = tmp_path / "features.d"
    d.mkdir()
    (d / "other").write_text("feature.node.kubernetes.io/x=1\n")
    assert nfd.write_features(str(d / "gpud"), LABELS) == "written"
    assert nfd_read(str(d)) == {**LABELS, "feature.node.kubernetes.io/x": "1"}
    assert sorted(os.listdir(d)) == ["gpud", "other"]  # no temporary file left behind
    assert oct((d / "gpud").stat().st_mode & 0o777) == "0o644"
    assert nfd.read_features(str(d / "gpud")) == LABELS


def test_unchanged_labels_leave_the_file_alone(tmp_path):
    d = tmp_path / "features.d"
    d.mkdir()
    nfd.write_features(str(d / "gpud"), LABELS)
    before = (d / "gpud").stat()
    assert nfd.write_features(str(d / "gpud"), dict(reversed(list(LABELS.items())))) == "unchanged"
    after = (d / "gpud").stat()
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)


def test_replaced_through_a_dotfile_rename(tmp_path, monkeypatch):
    d = tmp_path / "features.d"
    d.mkdir()
    nfd.write_features(str(d / "gpud"), LABELS)
    seen = []
    real_rename = os.rename

    def spy(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        # at the moment of the rename NFD still sees the complete old file, and the new bytes sit
        # in a file NFD ignores (the rename is relative to the directory's descriptor)
        src_dir = os.readlink(f"/proc/self/fd/{src_dir_fd}")
        seen.append((src_dir, src, nfd_read(str(d)), Path(src_dir, src).read_text()))
        real_rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    monkeypatch.setattr(os, "rename", spy)
    new = {**LABELS, "nvidia.com/gpu.count": "7"}
    assert nfd.write_features(str(d / "gpud"), new) == "written"
    (src_dir, src_name, visible, content), = seen
    assert src_dir == str(d) and src_name.startswith(".") and "/" not in src_name
    assert visible == LABELS
    assert "nvidia.com/gpu.count=7\n" in content
    assert nfd_read(str(d)) == new


def test_too_large_is_refused_and_keeps_the_old_file(tmp_path):
    d = tmp_path / "features.d"
    d.mkdir()
    nfd.write_features(str(d / "gpud"), LABELS)
    huge = {f"nvidia.com/label-{i:05d}": "x" * 60 for i in range(1000)}
    with pytest.raises(nfd.NfdError, match=r"gpud: 1000 labels take \d+ bytes; NFD skips a feature file over 65536"):
        nfd.write_features(str(d / "gpud"), huge)
    assert nfd_read(str(d)) == LABELS
    assert sorted(os.listdir(d)) == ["gpud"]


def test_largest_allowed_size_is_written(tmp_path):
    d = tmp_path / "features.d"
    d.mkdir()
    overhead = len(nfd.render({"nvidia.com/x": ""}))
    exact = {"nvidia.com/x": "v" * (MAX_FEATURE_FILE_SIZE - overhead)}
    assert len(nfd.render(exact)) == MAX_FEATURE_FILE_SIZE
    assert nfd.write_features(str(d / "gpud"), exact) == "written"
    assert nfd_read(str(d)) == exact


@pytest.mark.parametrize("bad", [{"nvidia.com/a": "x\ny=1"}, {"a=b": "1"}, {"# c": "1"}, {"": "1"}])
def test_a_label_that_would_read_back_differently_is_refused(tmp_path, bad):
    d = tmp_path / "features.d"
    d.mkdir()
    with pytest.raises(nfd.NfdError, match="cannot be written as one NFD feature line"):
        nfd.write_features(str(d / "gpud"), bad)
    assert os.listdir(d) == []
