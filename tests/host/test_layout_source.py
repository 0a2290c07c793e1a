"""Reading the layout file: only a regular file, bounded before it is read, never blocking on a
special file; and whether its text may be quoted to readers of status."""

from __future__ import annotations

import os
import threading

import pytest

from gpud.host.files.layout_source import MAX_LAYOUT_BYTES, LayoutUnreadable, read_layout


def read_in_thread(path, timeout: float = 30.0):
    """read_layout in a thread the test can give up on: a blocked read must fail the test, not hang it."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["source"] = read_layout(str(path))
        except Exception as e:  # noqa: BLE001 - handed to the test
            outcome["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"read_layout({path}) blocked"
    return outcome


def test_fifo_at_the_layout_path_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "layout.yaml"
    os.mkfifo(fifo)
    outcome = read_in_thread(fifo)
    assert isinstance(outcome.get("error"), LayoutUnreadable)
    assert "a FIFO, not a regular file" in outcome["error"].message


def test_dev_zero_behind_a_symlink_is_refused_unread(tmp_path):
    link = tmp_path / "layout.yaml"
    link.symlink_to("/dev/zero")
    outcome = read_in_thread(link)
    assert isinstance(outcome.get("error"), LayoutUnreadable)
    assert "a character device, not a regular file" in outcome["error"].message


def test_directory_is_refused(tmp_path):
    (tmp_path / "layout.yaml").mkdir()
    with pytest.raises(LayoutUnreadable, match="a directory, not a regular file"):
        read_layout(str(tmp_path / "layout.yaml"))


def test_oversized_file_is_refused_naming_the_limit(tmp_path):
    path = tmp_path / "layout.yaml"
    with open(path, "wb") as f:  # sparse: nothing is written, the size alone must refuse it
        f.truncate(50 * 1024 * 1024)
    with pytest.raises(LayoutUnreadable) as err:
        read_layout(str(path))
    assert err.value.message == (f"{path}: the layout is {50 * 1024 * 1024} bytes; a layout may be at most "
                                 f"{MAX_LAYOUT_BYTES} bytes (512 KiB)")


def test_file_at_the_limit_is_read(tmp_path):
    path = tmp_path / "layout.yaml"
    text = "#" * (MAX_LAYOUT_BYTES - 1) + "\n"
    path.write_text(text)
    assert read_layout(str(path)).text == text


def test_missing_file_and_bad_utf8(tmp_path):
    with pytest.raises(LayoutUnreadable, match="file not found") as err:
        read_layout(str(tmp_path / "absent.yaml"))
    assert err.value.missing
    (tmp_path / "bad.yaml").write_bytes(b"version: \xff\n")
    with pytest.raises(LayoutUnreadable, match=r"not UTF-8 text \(invalid start byte at byte 9\)"):
        read_layout(str(tmp_path / "bad.yaml"))


def test_quotable_only_when_owned_by_gpuds_user_and_not_linked_out_of_its_tree(tmp_path):
    etc = tmp_path / "etc" / "gpud"
    etc.mkdir(parents=True)
    own = etc / "layout.yaml"
    own.write_text("version: v1\n")
    assert read_layout(str(own)).quotable

    (etc / "layouts").mkdir()
    (etc / "layouts" / "a.yaml").write_text("version: v1\n")
    inside = etc / "inside.yaml"
    inside.symlink_to(etc / "layouts" / "a.yaml")  # a link within the tree: still gpud's file
    assert read_layout(str(inside)).quotable

    secret = tmp_path / "root" / "secret"
    secret.parent.mkdir()
    secret.write_text("password: hunter2\n")
    outside = etc / "outside.yaml"
    outside.symlink_to(secret)
    source = read_layout(str(outside))
    assert not source.quotable and "link into another directory tree" in source.unquoted_because

    theirs = etc / "theirs.yaml"
    theirs.write_text("version: v1\n")
    os.chown(theirs, os.geteuid() + 1000, -1)
    source = read_layout(str(theirs))
    assert not source.quotable and f"owned by uid {os.geteuid() + 1000}" in source.unquoted_because
